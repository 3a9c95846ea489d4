"""Bearer / api-key authentication against the token table, cached briefly in memory.

Token hashes are reloaded at most every ``refresh_s`` seconds, so a token added or revoked
with ``healthlog token`` while the service runs takes effect within that time.
"""

from __future__ import annotations

import logging

import trio

from actors import threads
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.tokens import Tokens, authenticate

log = logging.getLogger("healthlog.http")


class TokenCache:
    """The live token hashes, read from ``tokens.sqlite`` in a worker thread."""

    def __init__(self, tokens: Tokens, refresh_s: float = 2.0) -> None:
        self._tokens = tokens
        self._refresh_s = refresh_s
        self._hashes: dict[bytes, str] = {}
        self._loaded_at = -float("inf")
        self._limiter = trio.CapacityLimiter(1)
        self._failed = 0

    async def authenticate(self, presented: str) -> str | None:
        """The client name for a presented token, or None.

        Within ``refresh_s`` of the last load this takes no lock and no thread. A
        :class:`StorageError` reading the store is raised (the caller answers 503); while the
        store stays unreadable every request tries it again, and only the first failure is a
        WARNING, the others DEBUG, and the first read that succeeds again one INFO with their
        count: a WARNING each let anyone reaching the port flood the log (SERVE-100).
        """
        if self._stale():
            async with self._limiter:
                if self._stale():
                    try:
                        hashes = await threads.run_sync(self._tokens.hashes)
                    except StorageError as exc:
                        self._failed += 1
                        # No thread to read in is said once for the process (RUN-70).
                        first = self._failed == 1 and not isinstance(exc, threads.NoThread)
                        level = logging.WARNING if first else logging.DEBUG
                        log.log(level, "the token store could not be read: %s", describe(exc))
                        raise
                    if self._failed:
                        log.info(
                            "the token store is read again, after %d failed reads",
                            self._failed,
                        )
                        self._failed = 0
                    self._hashes = hashes
                    self._loaded_at = trio.current_time()
        return authenticate(presented, self._hashes)

    def _stale(self) -> bool:
        return trio.current_time() - self._loaded_at >= self._refresh_s


def presented_token(authorization: str | None, api_key: str | None) -> str | None:
    """The token of ``Authorization: Bearer T`` (preferred) or ``api-key: T``, if any."""
    presented = api_key
    if authorization is not None and authorization[:7].lower() == "bearer ":
        presented = authorization[7:].strip()
    return presented or None
