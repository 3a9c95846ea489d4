"""Snapshot files in the data directory: streamed from one read of the store, signed, kept
until two newer ones replace them. Reading the store is the only SQLite work here.

Several processes may serve one data directory, each building snapshots when its subscribers
need one. A build writes, renames and removes files only while it holds an exclusive lock
(``flock``) on the snapshot directory itself, so builds take turns there, and a ``.tmp`` file
that a build holding the lock finds was left by one that failed or was killed: it is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from healthlog import faults, snapshots
from healthlog.documents import Manifest
from healthlog.storage._sqlite import DIRECTORY_MODE, give_to_directory_owner
from healthlog.storage.journal import Journal
from healthlog.storage.store import Store

log = logging.getLogger(__name__)

_NAME = re.compile(r"snapshot-([0-9a-f]+)-([0-9]+)\.snap")
KEPT = 2


def build(
    directory: Path, journal: Journal, store: Store, key: Ed25519PrivateKey, url_base: str
) -> Manifest:
    """Write a snapshot of every object at the current head and remove older ones.

    The objects are read from one read transaction and written to the file one at a time,
    so a build holds neither the store's connection nor more than one object in memory. The
    previous snapshot of the stream stays (``KEPT`` files in all), so a reference handed out
    just before this build can still be fetched; files of other streams go. ``directory`` is
    made if need be, and only beside the store's file: a data directory moved away or
    unmounted under the service (its path gone, or an empty mount point left there) is an
    OSError here, not begun anew.
    """
    faults.point("snapshot.build")
    stream = store.stream_id()
    instance = journal.instance_id()
    if not Path(store.path).exists():
        raise FileNotFoundError(errno.ENOENT, "the store is no longer at its path", store.path)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=DIRECTORY_MODE)
        give_to_directory_owner(directory, directory.parent)
    with _locked(directory):
        _remove_stale(directory)
        with store.snapshot_at_head() as head:
            seq = head.seq
            path = _path(directory, stream, seq)
            tmp = path.with_suffix(".tmp")
            faults.point("snapshot.open")
            with _removed_on_failure(tmp), _private(tmp) as out:
                digest = snapshots.write(
                    out,
                    head.objects,
                    count=head.count,
                    instance=instance,
                    stream=stream,
                    seq=seq,
                    tag=head.tag,
                )
                out.flush()
                os.fsync(out.fileno())
        with _removed_on_failure(tmp):
            faults.point("snapshot.write")
            os.replace(tmp, path)
        kept = sorted(_seqs(directory, stream), reverse=True)[:KEPT]
        for old in directory.glob("snapshot-*.snap"):
            m = _NAME.fullmatch(old.name)
            if m is None or m.group(1) != stream or int(m.group(2)) not in kept:
                old.unlink(missing_ok=True)
    return snapshots.sign(
        key, digest, url=f"{url_base}/{seq}", instance=instance, stream=stream, seq=seq
    )


def find(directory: Path, stream: str, seq: int) -> Path | None:
    """The snapshot file of ``stream`` at ``seq``, if it is still kept: a regular file, as a
    build makes it. Anything else at that name (a link, which :func:`open_file` refuses to
    serve) is None, so that a new snapshot is built rather than a manifest offered whose file
    answers 404 at every fetch (SERVE-95)."""
    path = _path(directory, stream, seq)
    try:
        mode = path.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return path if stat.S_ISREG(mode) else None


def open_file(directory: Path, stream: str, seq: int) -> BinaryIO | None:
    """The snapshot file of ``stream`` at ``seq`` opened for reading, or None if it is not (or
    no longer) kept: a newer build may remove it at any time, and once open it stays readable
    to the end. A link at that name (planted by whoever may write in ``snapshots/``) is None
    (SERVE-88), not the file it names read with the service's rights: a build never makes
    one."""
    try:
        fd = os.open(_path(directory, stream, seq), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        log.warning("not serving snapshot %d: a link is at its name, not a file a build made", seq)
        return None
    return os.fdopen(fd, "rb")


def latest(directory: Path, stream: str) -> int | None:
    """The sequence of the newest kept snapshot of ``stream``."""
    return max(_seqs(directory, stream), default=None)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``directory``, waiting for a build in another process (or
    thread) to release it; the kernel releases it when its holder dies."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _private(path: Path) -> BinaryIO:
    """``path`` made anew for writing, mode 0600: a snapshot holds every object (STORE-62);
    the data directory owner's when made as root (STORE-78). Whatever is at ``path`` (what a
    stopped build left was removed under the lock) is refused, a link above all (STORE-98):
    one planted there by whoever may write in ``snapshots/`` had the build truncate and
    overwrite the file it named, and, run as root, give that file to the directory's owner."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    give_to_directory_owner(fd, path.parent)
    return os.fdopen(fd, "wb")


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """Remove the temporary file ``tmp`` if the block fails or is stopped."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def remove_left_over(directory: Path) -> None:
    """Remove the ``.tmp`` files of snapshot builds that were killed, unless a build holds the
    lock (it is writing its own). A runtime calls it as it opens (STORE-87): otherwise only the
    next build removed them, and with every follower within the online window there may be none
    for good, while such a file is as large as a snapshot of every object."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _remove_stale(directory)
    except BlockingIOError:
        return
    except OSError as exc:
        # A file it may not remove stops nothing: the next build tries again.
        log.warning("cannot remove what a stopped snapshot build left in %s: %s", directory, exc)
    finally:
        os.close(fd)


def _remove_stale(directory: Path) -> None:
    """Under the lock: remove the ``.tmp`` files of builds that failed or were killed."""
    for stale in directory.glob("snapshot-*.tmp"):
        stale.unlink(missing_ok=True)
        log.info("removed %s, left by a snapshot build that was stopped", stale.name)


def _path(directory: Path, stream: str, seq: int) -> Path:
    return directory / f"snapshot-{stream}-{seq}.snap"


def _seqs(directory: Path, stream: str) -> list[int]:
    return [
        int(m.group(2))
        for p in directory.glob("snapshot-*.snap")
        if (m := _NAME.fullmatch(p.name)) and m.group(1) == stream
    ]
