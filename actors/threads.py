"""Worker threads for blocking calls, and what happens when the system refuses one.

Under a lasting process or thread limit (``ulimit -u`` for the service's user, a container's
pids limit) ``threading`` refuses a new thread with ``RuntimeError: can't start new thread``,
which trio passes on from ``trio.to_thread.run_sync``. :func:`run_sync` turns that into
:class:`NoThread`, a :class:`StorageError`, so that every caller treats it as storage it cannot
reach for now: intake answers 503, the folder leaves deliveries pending and tries again, a
lease renewal fails (RUN-70). The shortage is said once for the process, at ERROR with what
to do, later refusals at DEBUG, and its end once at INFO, when a thread starts again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from healthlog.storage._sqlite import StorageError

log = logging.getLogger("healthlog.threads")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

SHORTAGE = (
    "no thread can be started (can't start new thread: the process limit reached?); raise "
    "the service user's process limit (ulimit -u, LimitNPROC=) or the container's pids limit: "
    "meanwhile deliveries are answered 503 and pending ones wait, tried again until one starts"
)


class NoThread(StorageError):
    """No thread could be started for a blocking call: the process limit reached, for now."""


@attrs.define
class _Shortage:
    """Thread starts refused since one last started (one process's, as its limits are)."""

    refused: int = 0


_shortage = _Shortage()


def start_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is the system refusing a new thread, raised where ``threading`` starts
    one, rather than an error of the call the thread was to run (which might be a
    RuntimeError too, and is raised from other frames, or in another process)."""
    if not isinstance(exc, RuntimeError) or exc.__traceback__ is None:
        return False
    innermost = exc.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return innermost.tb_frame.f_code is threading.Thread.start.__code__


def refused() -> NoThread:
    """The :class:`NoThread` to raise for a thread start just refused; the first of a
    shortage says it at ERROR, the others at DEBUG."""
    _shortage.refused += 1
    if _shortage.refused == 1:
        log.error(SHORTAGE)
    else:
        log.debug("a thread still cannot be started (%d refused)", _shortage.refused)
    return NoThread("no thread can be started")


def _can_start() -> bool:
    """Whether the system lets this process start a thread now."""
    probe = threading.Thread(target=int, name="healthlog thread probe", daemon=True)
    try:
        probe.start()
    except RuntimeError:
        return False
    probe.join()
    return True


def ran() -> None:
    """A blocking call ran in a thread: after refusals, say once that threads start again.
    An idle thread kept from before may have served it, so a new one is started to tell."""
    if _shortage.refused and _can_start():
        log.info("threads start again, after %d refused", _shortage.refused)
        _shortage.refused = 0


async def run_sync(
    fn: Callable[[Unpack[Ts]], T],
    *args: *Ts,
    limiter: trio.CapacityLimiter | None = None,
) -> T:
    """``trio.to_thread.run_sync(fn, *args, limiter=limiter)``, raising :class:`NoThread`
    when no thread can be started for it."""
    try:
        result = await trio.to_thread.run_sync(fn, *args, limiter=limiter)
    except RuntimeError as exc:
        if not start_refused(exc):
            raise
        raise refused() from None
    ran()
    return result
