"""The data directory: ``journal.sqlite`` (authoritative, back it up), ``store.sqlite`` (the
projection, rebuildable from the journal), ``tokens.sqlite`` (client token hashes) and the
optional ``healthlog.toml``."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from healthlog.storage.journal import Journal
from healthlog.storage.store import Store
from healthlog.storage.tokens import Tokens

JOURNAL_FILE = "journal.sqlite"
STORE_FILE = "store.sqlite"
TOKENS_FILE = "tokens.sqlite"
CONFIG_FILE = "healthlog.toml"


@attrs.frozen
class DataDir:
    """Where one healthlog instance keeps its files."""

    path: Path = attrs.field(converter=Path)

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

    def open_tokens(self) -> Tokens:
        self.path.mkdir(parents=True, exist_ok=True)
        return Tokens(self.tokens_path)

    def open_journal(self) -> Journal:
        self.path.mkdir(parents=True, exist_ok=True)
        return Journal(self.journal_path)

    def open_store(self) -> Store:
        self.path.mkdir(parents=True, exist_ok=True)
        return Store(self.store_path)


def default_data_dir() -> Path:
    """``HEALTHLOG_DATA``, else ``./var``."""
    return Path(os.environ.get("HEALTHLOG_DATA", "var"))
