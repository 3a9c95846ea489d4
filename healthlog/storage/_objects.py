"""The ``objects`` table shared by the projection and a follower's replica."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

from healthlog.objects import HourlyObject, ObjectKey
from healthlog.storage._sqlite import ConnectionGuard, Database

COLUMNS = "metric, layer, hour, units, body, hash, first, last, points, created_by, sealed"
PAGE = 64


def row_to_object(row: Any) -> HourlyObject:
    m, la, h, u, b, hs, f, ls, p, c, s = row
    return HourlyObject(ObjectKey(m, la, h), u, b, hs, f, ls, p, c, bool(s))


def load(conn: sqlite3.Connection, key: ObjectKey) -> HourlyObject | None:
    """The object at ``key``, if any."""
    row = conn.execute(
        f"SELECT {COLUMNS} FROM objects WHERE metric = ? AND layer = ? AND hour = ?",
        (key.metric, key.layer, key.hour),
    ).fetchone()
    return None if row is None else row_to_object(row)


def write(conn: sqlite3.Connection, obj: HourlyObject) -> None:
    """Insert or replace one object."""
    conn.execute(
        f"INSERT OR REPLACE INTO objects ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            obj.key.metric,
            obj.key.layer,
            obj.key.hour,
            obj.units,
            obj.body,
            obj.hash,
            obj.first,
            obj.last,
            obj.count,
            obj.created_by,
            int(obj.sealed),
        ),
    )


def iterate(
    conn: sqlite3.Connection,
    lock: ConnectionGuard,
    *,
    metric: str | None,
    layer: str | None,
    hour_from: int | None,
    hour_to: int | None,
) -> Iterator[HourlyObject]:
    """Objects sorted by metric, layer and hour, read a page at a time under ``lock``."""
    clauses, args = ["1"], []
    for clause, value in (
        ("metric = ?", metric),
        ("layer = ?", layer),
        ("hour >= ?", hour_from),
        ("hour <= ?", hour_to),
    ):
        if value is not None:
            clauses.append(clause)
            args.append(value)
    where = " AND ".join(clauses)
    last: tuple[str, str, int] | None = None
    while True:
        page_where = where + (" AND (metric, layer, hour) > (?, ?, ?)" if last else "")
        page_args = [*args, *last] if last else args
        with lock:
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM objects WHERE {page_where}"
                f" ORDER BY metric, layer, hour LIMIT {PAGE}",
                page_args,
            ).fetchall()
        if not rows:
            return
        for row in rows:
            yield row_to_object(row)
        last = rows[-1][0], rows[-1][1], rows[-1][2]


class ObjectDatabase(Database):
    """A database with an ``objects`` table (the projection, a follower's replica)."""

    def iter_objects(
        self,
        *,
        metric: str | None = None,
        layer: str | None = None,
        hour_from: int | None = None,
        hour_to: int | None = None,
    ) -> Iterator[HourlyObject]:
        """Objects sorted by metric, layer and hour, one at a time."""
        return iterate(
            self._conn,
            self._lock,
            metric=metric,
            layer=layer,
            hour_from=hour_from,
            hour_to=hour_to,
        )
