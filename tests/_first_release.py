"""A data directory and a follow replica as the first releases of healthlog left them, written
with SQL: each file at the schema those releases made (the first step of each file's migrations,
which no later change has touched; the store at its second, the first with a stream, which the
first release of ``follow`` bound its replica to), holding the rows of a directory this
healthlog folded, less every column and table added since.

What the first releases left besides: a lease holder named ``HOST:PID`` (no start time nor
namespace, so it is never known to have ended) whose lease has expired, a subscriber without
the time of its last ACK, events without tags, a replica of 4 KiB pages and no tag at its
cursor, a journal with no snapshot key recorded.
"""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

from healthlog.storage import _sqlite, replica, store, tokens
from healthlog.storage.datadir import DataDir

JOURNAL_V1_COLUMNS = (
    "id, received_at, sha256, bytes, content_type, automation_name, automation_id,"
    " automation_aggregation, automation_period, session_id, client, idempotency_key,"
    " encoding, body"
)
OBJECT_COLUMNS = "metric, layer, hour, units, first, last, points, created_by, hash, sealed, body"
# The store's schema when ``follow`` was first released: version 2 gave the events their time
# and the store its stream id.
STORE_VERSION = 2
OLD_HOLDER = "nas:4242"


def write_first_release(source: DataDir, data: Path, replica_dir: Path, token: str) -> None:
    """Make ``data`` (journal, store, tokens, signing key) and ``replica_dir`` as the first
    releases left them, from ``source``, a data directory this healthlog folded and left closed:
    the same deliveries, objects, outcomes and events; ``token`` the one client token (named
    ``iphone``), and the replica caught up to the store's last event, as subscriber ``nas``."""
    data.mkdir()
    replica_dir.mkdir()
    shutil.copy2(source.path / "signing.key", data / "signing.key")
    journal_path, store_path = data / "journal.sqlite", data / "store.sqlite"
    with closing(sqlite3.connect(source.journal_path)) as conn:
        instance = conn.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()[0]
    _first_journal(source.journal_path, journal_path)
    with closing(_sqlite.connect(store_path)) as conn:
        _sqlite.migrate(conn, store.MIGRATIONS[:STORE_VERSION])
        conn.execute("ATTACH ? AS source", (source.store_path.resolve().as_uri() + "?mode=ro",))
        with _sqlite.write_transaction(conn):
            conn.execute(f"INSERT INTO objects SELECT {OBJECT_COLUMNS} FROM source.objects")
            conn.execute("INSERT INTO outcomes SELECT * FROM source.outcomes")
            conn.execute(
                "UPDATE checkpoint SET (received_at, delivery_id, epoch) ="
                " (SELECT received_at, delivery_id, epoch FROM source.checkpoint)"
            )
            conn.execute(
                "UPDATE lease SET holder = ?, expires_at = 0,"
                " epoch = (SELECT epoch FROM source.lease)",
                (OLD_HOLDER,),
            )
            conn.execute(
                "INSERT INTO events (seq, id, kind, payload, at)"
                " SELECT seq, id, kind, payload, at FROM source.events ORDER BY seq"
            )
            conn.execute(
                "INSERT INTO marks SELECT key, value FROM source.marks"
                " WHERE key = 'first_pass_completed'"
            )
            (head,) = conn.execute("SELECT max(seq) FROM events").fetchone()
            conn.execute("INSERT INTO subscribers (name, acked) VALUES ('nas', ?)", (head,))
        (stream,) = conn.execute(
            "SELECT json_extract(value, '$') FROM marks WHERE key = 'stream'"
        ).fetchone()
        conn.execute("DETACH source")
    with closing(_sqlite.connect(data / "tokens.sqlite")) as conn:
        _sqlite.migrate(conn, tokens.MIGRATIONS[:1])
        with _sqlite.write_transaction(conn):
            conn.execute(
                "INSERT INTO tokens (name, hash, created_at) VALUES ('iphone', ?, 0)",
                (hashlib.sha256(token.encode()).digest(),),
            )
    with closing(_sqlite.connect(replica_dir / replica.REPLICA_FILE)) as conn:
        _sqlite.migrate(conn, replica.MIGRATIONS[:1])
        conn.execute("ATTACH ? AS source", (store_path.resolve().as_uri() + "?mode=ro",))
        with _sqlite.write_transaction(conn):
            conn.execute(f"INSERT INTO objects SELECT {OBJECT_COLUMNS} FROM source.objects")
            conn.execute(
                "UPDATE binding SET instance = ?, stream = ?, public_key = ?, cursor = ?",
                (instance, stream, source.public_key(), head),
            )
        conn.execute("DETACH source")


def _first_journal(source: Path, path: Path) -> None:
    """The journal at schema version 1: every delivery and receipt, ``journaled_at`` and the
    backfills' table not yet there, and of its meta only what the first release kept."""
    with closing(sqlite3.connect(source)) as live, closing(sqlite3.connect(path)) as into:
        live.backup(into)
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("DROP TABLE IF EXISTS unstamped_backfills")
        conn.execute("ALTER TABLE deliveries DROP COLUMN journaled_at")
        conn.execute("DELETE FROM meta WHERE key NOT IN ('last_received_at', 'instance_id')")
        conn.execute("PRAGMA user_version = 1")
        conn.execute("PRAGMA journal_mode = WAL")
