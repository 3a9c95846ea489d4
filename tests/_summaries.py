"""The summaries of a store's objects (everything but the body), read from its file: what the
rebuild and seal tests compare, with a connection of their own."""

from __future__ import annotations

import sqlite3

import attrs

from healthlog.objects import ObjectKey
from healthlog.storage.store import SUMMARY_COLUMNS, Store


@attrs.frozen
class ObjectSummary:
    """An object without its body."""

    key: ObjectKey
    units: str | None
    points: int
    hash: bytes
    created_by: int
    sealed: bool


def summaries(store: Store) -> dict[ObjectKey, ObjectSummary]:
    """Every object of ``store`` by key, as committed now."""
    conn = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)
    try:
        rows = conn.execute(f"SELECT {SUMMARY_COLUMNS} FROM objects").fetchall()
    finally:
        conn.close()
    return {
        ObjectKey(m, la, h): ObjectSummary(ObjectKey(m, la, h), u, p, hs, c, bool(s))
        for m, la, h, u, p, hs, c, s in rows
    }
