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
import re
from collections.abc import Callable
from typing import Any

import trio

from healthlog.storage.passes import STORE_DAMAGED, STORE_FOLDED_ELSEWHERE
from healthlog.storage.tokens import TOKEN_PREFIX

log = logging.getLogger("healthlog.http")

BURST = 5
PERIOD_S = 60.0
_TOKEN = re.compile(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]+")
"""A token as :meth:`Tokens.add` makes it, wherever it stands in a path a client typed."""

# What a route that reads the store answers while `serve` journals beside a store it found unfit
# (STORE-142), and so does the replay stream before its upgrade (STREAM-205): a 503 saying so,
# without a Retry-After (it lasts until the store is moved away and `serve` started again); the
# ERROR that said what to do was logged once, at the check. Each read was a 500 `INTERNAL` and an
# ERROR naming nothing but `StorageError` (SERVE-150).
STORE_UNFIT_ANSWERS = {
    STORE_DAMAGED: (
        "STORE_DAMAGED",
        "store.sqlite is damaged: deliveries are journaled, none is folded and nothing is read"
        " from it until serve is started again with it moved away (its log says how)",
    ),
    STORE_FOLDED_ELSEWHERE: (
        "STORE_FROM_ANOTHER_JOURNAL",
        "store.sqlite was folded from another journal: deliveries are journaled, none is folded"
        " and nothing is read from it until serve is started again with it moved away (its log"
        " says how)",
    ),
}


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


class WrongPathLog:
    """Logs requests for a path the service has no route for (404) at INFO, so that a user can
    see a phone app configured with a wrong URL (POST to `/` or `/v1/delivery`) reaching the
    service: nothing said so before (SERVE-97).

    A line names the method and the path, never the query string, a header's value or the
    body; a token typed into the path (its ``?`` typed as ``&``, or sent encoded as ``%3F``)
    is masked (``hl_...``, SERVE-99); the path is cut at ``MAX_PATH`` characters and its
    control characters escaped. A path is logged once per ``period_s``, the next line for it
    saying how many requests for it went unlogged meanwhile; and all the lines pass one
    :class:`Bucket`, so that a scanner asking for many paths cannot flood the log either."""

    MAX_PATH = 120
    MAX_METHOD = 16
    MAX_PATHS = 256
    """Paths remembered within ``period_s``; one beyond them is left to the bucket alone."""
    DELIVERIES = "deliveries go to POST /v1/deliveries"
    STREAM = "the replay stream is WS /v1/stream"
    """Where a websocket handshake (logged with the method ``WS``) should have gone."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        bucket: Bucket | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._period_s = period_s
        self._bucket = Bucket(clock=clock) if bucket is None else bucket
        self._clock = clock
        self._paths: dict[tuple[str, str], tuple[float, int]] = {}

    def __call__(
        self, method: str, path: str, address: str | None, where: str = DELIVERIES
    ) -> None:
        """Log one request for ``path`` that no route serves (or count it), saying ``where``
        such requests go."""
        now = self._clock()
        # As logged: what is remembered of a path is bounded as its line is.
        masked = _TOKEN.sub(f"{TOKEN_PREFIX}...", path)
        key = (_printable(method, self.MAX_METHOD), _printable(masked, self.MAX_PATH))
        logged_at, unlogged = self._paths.get(key, (None, 0))
        if logged_at is not None and now - logged_at < self._period_s:
            self._paths[key] = (logged_at, unlogged + 1)
            return
        held = self._bucket.admit()
        if held is None:
            if logged_at is not None:
                self._paths[key] = (logged_at, unlogged + 1)
            return
        self._remember(key, now)
        log.info(
            "no route for %s %s from %s: %s%s%s",
            *key,
            address or "an unknown address",
            where,
            f"; {unlogged} more requests for it were not logged before this one"
            if unlogged
            else "",
            f"; {held} more requests for paths without a route were not logged before this one"
            if held
            else "",
        )

    def _remember(self, key: tuple[str, str], now: float) -> None:
        self._paths.pop(key, None)
        if len(self._paths) >= self.MAX_PATHS:
            self._paths = {
                k: (at, n) for k, (at, n) in self._paths.items() if now - at < self._period_s
            }
        if len(self._paths) < self.MAX_PATHS:
            self._paths[key] = (now, 0)


def _printable(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` characters (saying how long it was), each character that is
    not printable written as its escape (``\\n``, ``\\x1b``)."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def client_address(scope: dict[str, Any]) -> str | None:
    """The client's address in an ASGI scope (its host, not its port), when the server knows
    it."""
    client = scope.get("client")
    return None if not client else str(client[0])
