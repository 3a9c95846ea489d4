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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from healthlog import objects
from healthlog.objects import ObjectKey
from healthlog.points import Point, coordinates, point_at, point_object
from healthlog.storage.journal import DeliveryMeta, Journal, NewDelivery
from healthlog.storage.passes import Selection
from healthlog.storage.store import MIGRATIONS, OTHER_CALENDARS, REINDEX_MARK, Store

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


# Records of one moment (MERGE-35): three symptoms of one cycle day, which all span that day,
# and two doses of medications taken at once.
_DAY = b'"start":"2024-02-06 00:00:00 -0800","end":"2024-02-07 00:00:00 -0800"'
_DOSE = b'"start":"2024-02-06 08:00:00 -0800","end":"2024-02-06 08:00:00 -0800"'
ONE_MOMENT_RECORDS = b'{"data":{"symptoms":[%s],"medications":[%s]}}' % (
    b",".join(
        b'{%s,"name":"%s","severity":"Mild"}' % (_DAY, name)
        for name in (b"Acne", b"Bloating", b"Headache")
    ),
    b",".join(
        b'{%s,"displayText":"%s","dosage":1}' % (_DOSE, name)
        for name in (b"Lisinopril 10 mg", b"Metformin 500 mg")
    ),
)

# The schema version before the migration that marks a store folded before MERGE-35.
BEFORE_MERGE_35 = next(v for v, script in enumerate(MIGRATIONS) if REINDEX_MARK in script)
# The schema version before the migration that marks a store holding points dated in another
# calendar (PARSE-41).
BEFORE_OTHER_CALENDARS = next(v for v, script in enumerate(MIGRATIONS) if OTHER_CALENDARS in script)


def fold_as_before_merge_35(path: str | os.PathLike[str]) -> None:
    """Leave the store at ``path`` as a healthlog before MERGE-35 left it: of the symptoms,
    medication doses and cycle-tracking entries sharing a start and end in an object, one kept
    (the last in the body, as the older fold kept the greatest by canonical form), and its schema
    the version before the migration that marks such a store."""
    with closing(sqlite3.connect(path)) as conn, conn:
        found = conn.execute(
            "SELECT rowid, metric, layer, hour, units, created_by, body FROM objects"
            " WHERE layer = 'records' AND metric IN ('symptoms', 'medications', 'cycleTracking')"
        ).fetchall()
        for rowid, metric, layer, hour, units, created_by, stored in found:
            kept = {(start, end): raw for start, end, raw in objects.entries(stored)}
            older = objects.encode(ObjectKey(metric, layer, hour), units, dict(kept), created_by)
            conn.execute(
                "UPDATE objects SET body = ?, hash = ?, first = ?, last = ?, points = ?"
                " WHERE rowid = ?",
                (older.body, older.hash, older.first, older.last, older.count, rowid),
            )
        conn.execute(f"PRAGMA user_version = {BEFORE_MERGE_35}")


# Steps a phone set to the Buddhist calendar wrote (2567 for 2024), and the years between.
BUDDHIST_ERA_STEPS = (
    b'{"data":{"metrics":[{"name":"thai_steps","units":"count","data":['
    b'{"date":"2567-03-02 08:00:00 +0700","qty":120},{"date":"2567-03-02 09:30:00 +0700","qty":88}'
    b"]}]}}"
)
BUDDHIST_ERA_YEARS = 543


def fold_as_before_parse_41(path: str | os.PathLike[str], metrics: Sequence[str]) -> None:
    """Leave the store at ``path`` as a healthlog before PARSE-41 left the objects of
    ``metrics``, whose points a phone set to the Buddhist calendar dated: each point at the
    instant its year names as written (543 years after the Gregorian one this healthlog reads),
    in the object of that hour; and its schema the version before the migration that marks such
    a store."""

    def late(us: int) -> int:
        then = datetime.fromtimestamp(us / 1_000_000, UTC)
        return int(then.replace(year=then.year + BUDDHIST_ERA_YEARS).timestamp()) * 1_000_000

    with closing(sqlite3.connect(path)) as conn, conn:
        marked = ",".join("?" for _ in metrics)
        found = conn.execute(
            "SELECT rowid, metric, layer, hour, units, created_by, body FROM objects"
            f" WHERE metric IN ({marked})",
            tuple(metrics),
        ).fetchall()
        for rowid, metric, layer, hour, units, created_by, stored in found:
            moved = {(late(start), late(end)): raw for start, end, raw in objects.entries(stored)}
            older = objects.encode(ObjectKey(metric, layer, late(hour)), units, moved, created_by)
            conn.execute(
                "UPDATE objects SET hour = ?, body = ?, hash = ?, first = ?, last = ?, points = ?"
                " WHERE rowid = ?",
                (late(hour), older.body, older.hash, older.first, older.last, older.count, rowid),
            )
        conn.execute(f"PRAGMA user_version = {BEFORE_OTHER_CALENDARS}")


def read_point(raw: bytes) -> Point:
    """One verbatim point as a fold reads it: its object and coordinates as parsing finds them
    (``hae``), then the point at them as the merge takes it (:func:`point_at`)."""
    return point_at(raw, *coordinates(point_object(raw)))
