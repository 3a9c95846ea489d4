"""Bearer / api-key authentication against the token table, cached briefly in memory.

Token hashes are reloaded at most every ``refresh_s`` seconds, so a token added or revoked
with ``healthlog token`` while the service runs takes effect within that time.
"""

from __future__ import annotations

import trio

from healthlog.storage.tokens import Tokens, authenticate


class TokenCache:
    """The live token hashes, read from ``tokens.sqlite`` in a worker thread."""

    def __init__(self, tokens: Tokens, refresh_s: float = 2.0) -> None:
        self._tokens = tokens
        self._refresh_s = refresh_s
        self._hashes: dict[bytes, str] = {}
        self._loaded_at = -float("inf")
        self._limiter = trio.CapacityLimiter(1)

    async def authenticate(self, presented: str) -> str | None:
        """The client name for a presented token, or None.

        Within ``refresh_s`` of the last load this takes no lock and no thread.
        """
        if self._stale():
            async with self._limiter:
                if self._stale():
                    self._hashes = await trio.to_thread.run_sync(self._tokens.hashes)
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
