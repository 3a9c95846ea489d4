"""The data directory: ``journal.sqlite`` (authoritative, back it up), ``store.sqlite`` (the
projection, rebuildable from the journal), ``tokens.sqlite`` (client token hashes) and the
optional ``healthlog.toml``."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from healthlog.storage.journal import Journal
from healthlog.storage.store import Store
from healthlog.storage.tokens import Tokens

JOURNAL_FILE = "journal.sqlite"
STORE_FILE = "store.sqlite"
TOKENS_FILE = "tokens.sqlite"
CONFIG_FILE = "healthlog.toml"
SIGNING_KEY_FILE = "signing.key"
SNAPSHOT_DIR = "snapshots"


def _absolute(path: str | os.PathLike[str]) -> Path:
    """Absolute, so that worker processes find the same files whatever their directory."""
    return Path(path).absolute()


@attrs.frozen
class DataDir:
    """Where one healthlog instance keeps its files."""

    path: Path = attrs.field(converter=_absolute)

    @property
    def journal_path(self) -> Path:
        return self.path / JOURNAL_FILE

    @property
    def store_path(self) -> Path:
        return self.path / STORE_FILE

    @property
    def tokens_path(self) -> Path:
        return self.path / TOKENS_FILE

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def snapshot_dir(self) -> Path:
        return self.path / SNAPSHOT_DIR

    def signing_key(self) -> Ed25519PrivateKey:
        """The snapshot signing key, created (mode 0600) on first use."""
        path = self.path / SIGNING_KEY_FILE
        if not path.exists():
            self.path.mkdir(parents=True, exist_ok=True)
            pem = Ed25519PrivateKey.generate().private_bytes(
                Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
            )
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        key = load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an Ed25519 key")
        return key

    def open_tokens(self) -> Tokens:
        self.path.mkdir(parents=True, exist_ok=True)
        return Tokens(self.tokens_path)

    def open_journal(self, busy_timeout_ms: int = 5000) -> Journal:
        self.path.mkdir(parents=True, exist_ok=True)
        return Journal(self.journal_path, busy_timeout_ms=busy_timeout_ms)

    def open_store(self, busy_timeout_ms: int = 5000) -> Store:
        self.path.mkdir(parents=True, exist_ok=True)
        return Store(self.store_path, busy_timeout_ms=busy_timeout_ms)


def default_data_dir() -> Path:
    """``HEALTHLOG_DATA``, else ``./var``."""
    return Path(os.environ.get("HEALTHLOG_DATA", "var"))
