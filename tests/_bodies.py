"""Tiny builders of Health Auto Export bodies and journal deliveries for the storage tests.

Also :func:`rows`, a raw dump of an SQLite file to compare states before and after.

Point minutes count from 2024-03-01 00:00 UTC; ``BASE_US`` is that instant in microseconds,
the unit of ``received_at``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import orjson

from healthlog.storage.journal import DeliveryMeta, Journal, NewDelivery
from healthlog.storage.passes import Selection
from healthlog.storage.store import Store

BASE_US = 1_709_251_200_000_000
NOW = BASE_US
TTL = 15_000_000


def stamp(minute: int) -> str:
    """``minute`` minutes after BASE_US, in the app's ``yyyy-MM-dd HH:mm:ss Z`` form."""
    day, rest = divmod(minute, 24 * 60)
    return f"2024-03-{1 + day:02d} {rest // 60:02d}:{rest % 60:02d}:00 +0000"


def point(minute: int, qty: float, **extra: Any) -> dict[str, Any]:
    """A quantity point stamped by ``date``."""
    return {"date": stamp(minute), "qty": qty, **extra}


def body(metrics: Mapping[str, Sequence[Mapping[str, Any]]], units: str = "count") -> bytes:
    """A ``{"data": {"metrics": [...]}}`` envelope with one entry per metric."""
    entries = [{"name": name, "units": units, "data": list(data)} for name, data in metrics.items()]
    return orjson.dumps({"data": {"metrics": entries}})


def delivery(
    payload: bytes,
    *,
    received_at: int | None = None,
    aggregation: str | None = "minutes",
    automation: str | None = "A",
) -> NewDelivery:
    """A delivery of automation id ``automation``; ``received_at`` set makes it a backfill."""
    return NewDelivery(
        payload,
        "phone",
        content_type="application/json",
        automation_id=automation,
        automation_aggregation=aggregation,
        received_at=received_at,
    )


def rows(path: str | os.PathLike[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Every table of an SQLite file, read through a separate read-only connection."""
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    with closing(sqlite3.connect(uri, uri=True)) as conn:
        names = [
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return {
            name: sorted(conn.execute(f"SELECT * FROM {name}").fetchall(), key=repr)
            for name in names
        }


def append(journal: Journal, new: NewDelivery) -> DeliveryMeta:
    """Journal one delivery and return its metadata."""
    meta = journal.get_meta(journal.append(new).delivery_id)
    assert meta is not None
    return meta


def pending(journal: Journal, store: Store) -> list[DeliveryMeta]:
    """What a pass starting now would fold, in journal order: its selection, every page."""
    selection = Selection(journal, store)
    held = selection.page()
    while selection.more:
        held += selection.page()
    return held
