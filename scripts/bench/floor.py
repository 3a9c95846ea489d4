"""The floor pipeline: the least work that turns a delivery into stored hourly objects.

orjson parses the whole body; points are grouped by metric and UTC hour
(``datetime.fromisoformat`` of the ``date``); each object's points are sorted by time, encoded
canonically (orjson ``OPT_SORT_KEYS``), hashed (sha256) and gzipped (level 6); the objects of a
delivery are inserted in one transaction into a SQLite file with healthlog's settings (WAL,
``synchronous=FULL``). No merge with stored objects, no events, no outcome: a floor.
"""

from __future__ import annotations

import gzip
import hashlib
import sqlite3
import time
from datetime import datetime
from operator import itemgetter
from pathlib import Path
from typing import Any

import orjson

GZIP_LEVEL = 6
SECONDS_PER_HOUR = 3600


def open_db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS objects (metric TEXT NOT NULL, hour INTEGER NOT NULL,"
        " points INTEGER NOT NULL, hash BLOB NOT NULL, body BLOB NOT NULL,"
        " PRIMARY KEY (metric, hour)) WITHOUT ROWID"
    )
    return conn


def fold(body: bytes, conn: sqlite3.Connection) -> int:
    """Store the hourly objects of one delivery; return how many points it held."""
    document = orjson.loads(body)
    groups: dict[tuple[str, int], list[tuple[float, Any]]] = {}
    count = 0
    for metric in document["data"]["metrics"]:
        name = metric["name"]
        for point in metric["data"]:
            instant = datetime.fromisoformat(point["date"]).timestamp()
            groups.setdefault((name, int(instant // SECONDS_PER_HOUR)), []).append((instant, point))
            count += 1
    rows = []
    for (name, hour), members in groups.items():
        members.sort(key=itemgetter(0))
        plain = orjson.dumps([point for _, point in members], option=orjson.OPT_SORT_KEYS)
        digest = hashlib.sha256(plain).digest()
        rows.append((name, hour, len(members), digest, gzip.compress(plain, GZIP_LEVEL, mtime=0)))
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?)", rows)
    conn.execute("COMMIT")
    return count


def fold_files(paths: list[Path], db: Path) -> tuple[int, float]:
    """Fold the bodies stored in ``paths`` in order into ``db``: (points, seconds)."""
    conn = open_db(db)
    try:
        started = time.perf_counter()
        points = sum(fold(path.read_bytes(), conn) for path in paths)
        return points, time.perf_counter() - started
    finally:
        conn.close()
