"""Restart a crashed actor with backoff; one ERROR per crash, none for a cancellation."""

from __future__ import annotations

import errno
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable

import attrs
import trio

log = logging.getLogger("healthlog.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_S = 300.0
"""How long a restarted actor must run without crashing to count as up again: longer than
any actor's own period (a minute), so that one crashing at each of its runs stays down."""


@attrs.define
class Crashes:
    """What the supervisor has seen: how often each actor crashed, and until when each counts
    as down (trio's clock): a crashed actor is down while it waits out its backoff and, after
    its restart, until it has run for ``healthy_s`` without crashing."""

    counts: Counter[str] = attrs.Factory(Counter)
    down_until: dict[str, float] = attrs.Factory(dict)

    def down(self) -> list[str]:
        """The actors down now, by name."""
        now = trio.current_time()
        return sorted(name for name, until in self.down_until.items() if until > now)


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    crashes: Crashes,
    *,
    backoff_start_s: float = BACKOFF_START_S,
    backoff_max_s: float = BACKOFF_MAX_S,
    healthy_s: float = HEALTHY_S,
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
            crashes.counts[name] += 1
            crashes.down_until[name] = trio.current_time() + backoff + healthy_s
        await trio.sleep(backoff)
        backoff = min(backoff * 2, backoff_max_s)


def _kinds(exc: BaseException) -> str:
    """The type name of an exception, and for an OSError its errno's name and the system's
    text for it (`OSError: EMFILE, Too many open files`: never the file it names, RUN-69); for
    a group (an actor's own nursery wraps what its tasks raise), those of the exceptions in it,
    however deeply nested."""
    if isinstance(exc, BaseExceptionGroup):
        return ", ".join(sorted({_kinds(inner) for inner in exc.exceptions}))
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
        return f"{type(exc).__name__}: {name}, {os.strerror(exc.errno)}"
    return type(exc).__name__
