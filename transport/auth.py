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
        """The client name for a presented token, or None."""
        async with self._limiter:
            if trio.current_time() - self._loaded_at >= self._refresh_s:
                self._hashes = await trio.to_thread.run_sync(self._tokens.hashes)
                self._loaded_at = trio.current_time()
        return authenticate(presented, self._hashes)
