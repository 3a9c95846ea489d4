"""401 and 413 answers, logged at INFO so that a user can see why a client's requests fail (a
phone app whose pushes are refused shows little of why), and the lines about a connection that
its peer broke (:class:`FaultLog`).

A line names the status, the route and the client's address, and why in words; never the
token, a header's value or the client's name. A flood of refused requests (a scanner, a client
retrying in a loop) cannot fill the log: a token bucket lets ``burst`` lines through at once
and one more every ``period_s / burst`` seconds; what it holds back is counted, and the next
line says how many answers went unlogged since the line before it. The first refusal after a
quiet spell is always logged, which is the one a user looks for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger("healthlog.http")

BURST = 5
PERIOD_S = 60.0


class Bucket:
    """A token bucket for log lines: ``burst`` lines at once, one more every
    ``period_s / burst`` seconds; the lines it holds back are counted."""

    def __init__(
        self,
        burst: int = BURST,
        period_s: float = PERIOD_S,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._burst = burst
        self._refill_s = period_s / burst
        self._clock = clock
        self._tokens = float(burst)
        self._at: float | None = None
        self._unlogged = 0

    def admit(self) -> int | None:
        """None when a line is held back (and counted); else it may be logged, and this is how
        many were held back since the last one that was."""
        now = self._clock()
        if self._at is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._at) / self._refill_s)
        self._at = now
        if self._tokens < 1:
            self._unlogged += 1
            return None
        self._tokens -= 1
        unlogged, self._unlogged = self._unlogged, 0
        return unlogged


class FaultLog:
    """One kind of line about a connection its peer broke (bytes after an upgrade request, a
    protocol error), logged at ``level`` at most as a :class:`Bucket` lets it: a peer causes
    such lines at will, without a token, as fast as it can connect (two lines for each
    connection, 16,772 lines, 2.2 MB, in 10 s from one client: SERVE-61)."""

    def __init__(self, logger: logging.Logger, level: int, bucket: Bucket | None = None) -> None:
        self._logger = logger
        self._level = level
        self._bucket = Bucket() if bucket is None else bucket

    def __call__(self, message: str, *args: object) -> None:
        unlogged = self._bucket.admit()
        if unlogged is None:
            return
        if unlogged:
            message += "; %d more like it were not logged before this one"
            args = (*args, unlogged)
        self._logger.log(self._level, message, *args)


class RefusalLog:
    """Logs refused requests at INFO, in a flood at most as a :class:`Bucket` lets it."""

    def __init__(self, bucket: Bucket | None = None) -> None:
        self._bucket = Bucket() if bucket is None else bucket

    def refused(self, status: int, method: str, route: str, address: str | None, why: str) -> None:
        """Log one refused request (or count it, in a flood)."""
        unlogged = self._bucket.admit()
        if unlogged is None:
            return
        log.info(
            "refused %d %s %s from %s: %s%s",
            status,
            method,
            route,
            address or "an unknown address",
            why,
            f"; {unlogged} more refused requests were not logged before this one"
            if unlogged
            else "",
        )

    def unauthorized(
        self, method: str, route: str, address: str | None, presented: bool, status: int = 401
    ) -> None:
        """A 401 (or the stream's 4401): no token presented, or one that is not (or no longer)
        a client's."""
        why = (
            "the token is not a client's (mistyped, or revoked)"
            if presented
            else "no token (send Authorization: Bearer TOKEN, or api-key: TOKEN)"
        )
        self.refused(status, method, route, address, why)


def client_address(scope: dict[str, Any]) -> str | None:
    """The client's address in an ASGI scope (its host, not its port), when the server knows
    it."""
    client = scope.get("client")
    return None if not client else str(client[0])
