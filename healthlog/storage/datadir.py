"""The data directory: ``journal.sqlite`` (authoritative, back it up) and ``store.sqlite``
(the projection, rebuildable from the journal)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from healthlog.storage.journal import Journal
from healthlog.storage.store import Store

JOURNAL_FILE = "journal.sqlite"
STORE_FILE = "store.sqlite"


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

    def open_journal(self) -> Journal:
        self.path.mkdir(parents=True, exist_ok=True)
        return Journal(self.journal_path)

    def open_store(self) -> Store:
        self.path.mkdir(parents=True, exist_ok=True)
        return Store(self.store_path)


def default_data_dir() -> Path:
    """``HEALTHLOG_DATA``, else ``./var``."""
    return Path(os.environ.get("HEALTHLOG_DATA", "var"))
