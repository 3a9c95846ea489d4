"""A worker process ends once the process that started it is gone.

A fold worker (of ``serve`` or ``import``) and a rebuild's partition worker ignore the stopping
signals, which their parent handles for them; so when the parent is killed alone (SIGKILL by
hand, or the out-of-memory killer, which picks the largest process), nothing tells the worker.
Left alone it went on with the work in hand for nobody: a fold of 200 MiB for 28 s more, holding
the store's write lock, so that the service started again waited for it. An orphan is handed to
another parent (init, or a subreaper: systemd, a container's init), which is how it notices.

A thread polls rather than ``prctl(PR_SET_PDEATHSIG)``: that signal follows the death of the
parent *thread*, and a fold worker is started from one of trio's worker threads, which ends
after ten idle seconds while the service lives on. The poll costs the worker a wakeup each
period, nothing per point. Ending with ``os._exit`` anywhere in a fold is safe: a worker writes
only the store, in transactions, and one not committed is rolled back by SQLite.
"""

from __future__ import annotations

import logging
import os
import threading
import time

POLL_S = 0.5
"""How often a worker looks at its parent: the longest it outlives it."""


def exit_when_orphaned(parent: int, log: logging.Logger | None = None) -> None:
    """In a worker whose parent is ``parent``: end this process (exit status 1) within
    :data:`POLL_S` of that parent being gone, first saying so at WARNING to ``log``."""
    threading.Thread(target=_watch, args=(parent, log), name="orphan-watch", daemon=True).start()


def _watch(parent: int, log: logging.Logger | None) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    if log is not None:
        log.warning(
            "the process that started this worker (pid %d) is gone: the worker ends, its work"
            " in hand undone",
            parent,
        )
    os._exit(1)
