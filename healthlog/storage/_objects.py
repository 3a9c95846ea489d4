"""The ``objects`` table shared by the projection and a follower's replica."""

from __future__ import annotations

import contextlib
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
    """Objects sorted by metric, layer and hour, read a page at a time under ``lock``.

    With an hour range, each (metric, layer) is sought in turn along the key and only its
    hours in the range are read: the hour is the key's last column, so a range without both
    metric and layer otherwise read every object of the file (a one-day export of 2.5 years,
    all 439,008)."""
    if hour_from is None and hour_to is None:
        yield from _pages(conn, lock, metric, layer, None, None)
        return
    for series_metric in _distinct(conn, lock, "metric", metric, {}):
        for series_layer in _distinct(conn, lock, "layer", layer, {"metric": series_metric}):
            yield from _pages(conn, lock, series_metric, series_layer, hour_from, hour_to)


def _distinct(
    conn: sqlite3.Connection,
    lock: ConnectionGuard,
    column: str,
    given: str | None,
    within: dict[str, str],
) -> Iterator[str]:
    """The values of ``column`` (a key column) among the objects matching ``within`` (the key
    columns before it), in key order, each found by one seek; only ``given`` if it is set and
    present."""
    fixed = "".join(f" AND {name} = ?" for name in within)
    if given is not None:
        with lock:
            row = conn.execute(
                f"SELECT 1 FROM objects WHERE {column} = ?{fixed} LIMIT 1",
                [given, *within.values()],
            ).fetchone()
        if row is not None:
            yield given
        return
    last: list[str] = []
    while True:
        after = f" AND {column} > ?" if last else ""
        with lock:
            row = conn.execute(
                f"SELECT {column} FROM objects WHERE 1{fixed}{after} ORDER BY {column} LIMIT 1",
                [*within.values(), *last],
            ).fetchone()
        if row is None:
            return
        last = [str(row[0])]
        yield last[0]


def _pages(
    conn: sqlite3.Connection,
    lock: ConnectionGuard,
    metric: str | None,
    layer: str | None,
    hour_from: int | None,
    hour_to: int | None,
) -> Iterator[HourlyObject]:
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


class ObjectReading:
    """The reading of an ``objects`` table through ``_conn`` under ``_lock``: for a database
    that writes one (:class:`ObjectDatabase`) and for a replica opened only to read it
    (``replica.ReplicaReader``)."""

    _conn: sqlite3.Connection
    _lock: ConnectionGuard

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

    @contextlib.contextmanager
    def one_state(self) -> Iterator[None]:
        """Every read of the block from one state of the file: one read transaction, begun at
        its first read. :meth:`iter_objects` reads a page at a time, and a write committed
        between two pages (a fold, a reindex's swap, a follower applying events) showed in the
        later pages alone: an export mixed hours from before a fold with hours from after it,
        a state the file never held (CLI-215). While the block runs, the ``-wal`` is not
        checkpointed past that state."""
        with self._lock:
            self._conn.execute("BEGIN")
        try:
            yield
        finally:
            with self._lock:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")


class ObjectDatabase(ObjectReading, Database):
    """A database with an ``objects`` table (the projection, a follower's replica)."""
