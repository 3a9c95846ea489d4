"""Restart a crashed actor with backoff; one ERROR per crash, none for a cancellation."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("healthlog.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    crashes: list[str],
    *,
    backoff_start_s: float = BACKOFF_START_S,
    backoff_max_s: float = BACKOFF_MAX_S,
) -> None:
    """Run ``run`` until it returns; restart it after a crash, waiting longer each time.

    A run that lasted longer than the current backoff resets the backoff.
    """
    backoff = backoff_start_s
    while True:
        started = trio.current_time()
        try:
            await run()
            return
        except Exception as exc:
            if trio.current_time() - started > backoff:
                backoff = backoff_start_s
            log.error("actor %s crashed (%s); restarting in %.1f s", name, _kinds(exc), backoff)
            log.debug("actor %s crash", name, exc_info=True)
            crashes.append(name)
        await trio.sleep(backoff)
        backoff = min(backoff * 2, backoff_max_s)


def _kinds(exc: BaseException) -> str:
    """The type name of an exception; for a group (an actor's own nursery wraps what its
    tasks raise), the names of the exceptions in it, however deeply nested."""
    if not isinstance(exc, BaseExceptionGroup):
        return type(exc).__name__
    return ", ".join(sorted({_kinds(inner) for inner in exc.exceptions}))
