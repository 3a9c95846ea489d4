"""A full disk for the tests that need one: ``files_limited_to(size)`` lowers this process's
file size limit (RLIMIT_FSIZE) for the block, so a write past ``size`` bytes of any file fails
for real (EFBIG; Python ignores SIGXFSZ), and SQLite reports it as it reports a full disk
(SQLITE_FULL, or SQLITE_IOERR_WRITE when nothing of the write fitted)."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

DISK_ERROR = r"SQLITE_(FULL: database or disk is full|IOERR\w*: disk I/O error)"
"""How :func:`healthlog.storage._sqlite.describe` names what such a write gets."""


@contextlib.contextmanager
def files_limited_to(size: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
