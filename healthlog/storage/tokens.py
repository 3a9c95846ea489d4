"""Client tokens (``tokens.sqlite``): only sha256 hashes are stored, never a secret.

A token is shown once, when created. Requests are authenticated by hashing the presented
token and comparing hashes in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import attrs

from healthlog import faults
from healthlog.storage._sqlite import (
    Database,
    StorageError,
    write_transaction,
)

TOKEN_PREFIX = "hl_"
# Client names of what the command line journals itself (``cli:import``, ``cli:seal``): no
# token may be named so, or its deliveries could pass for a seal.
RESERVED_PREFIX = "cli:"

MIGRATIONS = (
    """
    CREATE TABLE tokens (
        name TEXT PRIMARY KEY,
        hash BLOB NOT NULL UNIQUE,
        created_at INTEGER NOT NULL
    );
    """,
)


class TokenError(StorageError):
    """A token operation the caller got wrong (duplicate or unknown name)."""


@attrs.frozen
class TokenInfo:
    name: str


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Tokens(Database):
    """The token table. Methods may be called from worker threads."""

    MIGRATIONS = MIGRATIONS
    GOING_BACK = (
        "a newer healthlog wrote it; run that one again, or move tokens.sqlite and its -wal and"
        " -shm files away and add the tokens again (`healthlog token add NAME`)"
    )

    def add(self, name: str) -> str:
        """Create a token for ``name`` and return the secret (the only time it is seen)."""
        if not name or len(name) > 128 or not name.isprintable():
            raise TokenError("a token name is 1 to 128 printable characters")
        if name.startswith(RESERVED_PREFIX):
            raise TokenError(f"token names beginning {RESERVED_PREFIX!r} are reserved")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._lock, write_transaction(self._conn):
            if self._conn.execute("SELECT 1 FROM tokens WHERE name = ?", (name,)).fetchone():
                raise TokenError(f"a token named {name!r} exists; revoke it first")
            self._conn.execute(
                "INSERT INTO tokens (name, hash, created_at) VALUES (?, ?, ?)",
                (name, token_hash(token), time.time_ns() // 1000),
            )
        return token

    def revoke(self, name: str) -> None:
        """Revoke ``name``; its name can then be used again."""
        with self._lock, write_transaction(self._conn):
            gone = self._conn.execute("DELETE FROM tokens WHERE name = ?", (name,)).rowcount
        if not gone:
            raise TokenError(f"no token named {name!r}")

    def list(self) -> list[TokenInfo]:
        with self._lock:
            rows = self._conn.execute("SELECT name FROM tokens ORDER BY name").fetchall()
        return [TokenInfo(*row) for row in rows]

    def reserved(self) -> tuple[str, ...]:
        """The names of the tokens that authenticate nothing: named with the reserved prefix,
        which an older healthlog allowed (:meth:`hashes`)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT name FROM tokens WHERE substr(name, 1, ?) = ? ORDER BY name",
                (len(RESERVED_PREFIX), RESERVED_PREFIX),
            ).fetchall()
        return tuple(str(name) for (name,) in rows)

    def hashes(self) -> dict[bytes, str]:
        """Every live token hash with its client name; a token with a reserved name (one made
        before names were reserved) authenticates nothing."""
        faults.point("tokens.read")
        with self._lock:
            rows = self._conn.execute("SELECT hash, name FROM tokens").fetchall()
        return {bytes(h): str(n) for h, n in rows if not str(n).startswith(RESERVED_PREFIX)}


def authenticate(presented: str, hashes: dict[bytes, str]) -> str | None:
    """The client name of a presented token, comparing every stored hash in constant time."""
    digest = token_hash(presented)
    found = None
    for stored, name in hashes.items():
        if hmac.compare_digest(stored, digest):
            found = name
    return found
