"""The journal: the append-only, authoritative record of every delivery (``journal.sqlite``).

Every accepted delivery is one row of ``deliveries``, its body kept verbatim (optionally zlib
compressed) next to the sha256 of the raw bytes. Rows are never updated or deleted: triggers in
the database refuse it. Journal order is ``(received_at, id)``; live stamps are taken inside the
write transaction and never decrease. Idempotency receipts live in the same file and are written in
the same transaction as the row they point at.

All methods may be called from worker threads; one lock serialises the use of the connection.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import sqlite3
import uuid
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import closing, contextmanager
from types import TracebackType
from typing import Any, Final

import attrs

from healthlog import faults
from healthlog.clock import now_us
from healthlog.content import content_digest
from healthlog.storage._sqlite import (
    ConnectionGuard,
    StorageError,
    check_intact,
    classify,
    connect,
    connect_reading,
    damaged,
    is_damage,
    migrate,
    newer_version,
    opening_failed,
    read_transaction,
    reopened,
    wal_held_back,
    write_transaction,
)
from healthlog.timestamps import format_instant

__all__ = [
    "BodyEncoder",
    "CorruptBody",
    "DeliveryMeta",
    "EncodedBody",
    "IdempotencyCollision",
    "Journal",
    "JournalStatistics",
    "NewDelivery",
    "Receipt",
]

_log = logging.getLogger(__name__)

CLOCK_BEHIND_US: Final = 60_000_000
"""How far behind the last live stamp the clock may read unsaid (an NTP step of seconds)."""

_IDENTITY: Final = "identity"
_ZLIB: Final = "zlib"
_ZLIB_LEVEL: Final = 1
_INFLATE_CHUNK: Final = 1 << 20

DAMAGED: Final = (
    "deliveries answered before it was copied may be missing from it or unreadable"
    ". A copy of the data directory taken while healthlog runs (cp, rsync) does"
    " this when it copies the -wal file at another instant than journal.sqlite: restore a"
    " backup taken with `sqlite3 .backup`, a filesystem snapshot, or one taken with healthlog"
    " stopped"
)
"""What the user can do about a damaged journal."""

GOING_BACK: Final = (
    "a newer healthlog wrote it, and this one cannot read it: run that one again (a backup"
    " taken before the upgrade lacks every delivery journaled since)"
)
"""How to go back to this healthlog from a journal a newer one upgraded (CLI-284)."""

_MIGRATIONS: Final = (
    """
    CREATE TABLE deliveries (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        received_at INTEGER NOT NULL,
        sha256 BLOB NOT NULL CHECK (length(sha256) = 32),
        bytes INTEGER NOT NULL CHECK (bytes >= 0),
        content_type TEXT,
        automation_name TEXT,
        automation_id TEXT,
        automation_aggregation TEXT,
        automation_period TEXT,
        session_id TEXT,
        client TEXT NOT NULL,
        idempotency_key TEXT,
        encoding TEXT NOT NULL CHECK (encoding IN ('identity', 'zlib')),
        body BLOB NOT NULL
    );
    CREATE INDEX deliveries_order ON deliveries (received_at, id);
    CREATE TABLE receipts (
        client TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        delivery_id INTEGER NOT NULL REFERENCES deliveries (id),
        content_digest BLOB NOT NULL,
        PRIMARY KEY (client, idempotency_key)
    );
    CREATE TABLE meta (key TEXT PRIMARY KEY, value);
    INSERT INTO meta (key, value) VALUES ('last_received_at', 0);
    CREATE TRIGGER deliveries_no_update BEFORE UPDATE ON deliveries
    BEGIN SELECT RAISE(ABORT, 'deliveries are append-only'); END;
    CREATE TRIGGER deliveries_no_delete BEFORE DELETE ON deliveries
    BEGIN SELECT RAISE(ABORT, 'deliveries are append-only'); END;
    CREATE TRIGGER receipts_no_update BEFORE UPDATE ON receipts
    BEGIN SELECT RAISE(ABORT, 'receipts are append-only'); END;
    CREATE TRIGGER receipts_no_delete BEFORE DELETE ON receipts
    BEGIN SELECT RAISE(ABORT, 'receipts are append-only'); END;
    """,
    # When each delivery was journaled (JOURNAL-45), which a backfill's ``received_at`` is not.
    # The rows of an older journal keep NULL (adding the column rewrites none of them: the
    # migration is one schema change, committed with its version bump or not at all) and read
    # as :data:`_JOURNALED_AT` says.
    "ALTER TABLE deliveries ADD COLUMN journaled_at INTEGER;",
    # Of the rows journaled before ``journaled_at`` (NULL there), each backfill (a
    # ``received_at`` behind the latest of the rows journaled before it) with that latest
    # stamp: the earliest instant it can have been journaled, the journal stamping one with the
    # clock, never behind that stamp (JOURNAL-4). Read instead of its historical
    # ``received_at``, which made a backfill pending at the upgrade wait years (JOURNAL-47).
    # Its rows are written here once; the deliveries' are not rewritten. Their ids and stamps
    # are read from the order index: a scan of the table read every row's inline body too
    # (398 MiB of a 398 MB journal of 300,000 deliveries, 22 MiB so).
    """
    CREATE TABLE unstamped_backfills (
        delivery_id INTEGER PRIMARY KEY,
        journaled_at INTEGER NOT NULL
    );
    INSERT INTO unstamped_backfills (delivery_id, journaled_at)
        SELECT ordered.id, ordered.latest
        FROM (
            SELECT id, received_at, max(received_at) OVER (
                ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
            ) AS latest
            FROM deliveries INDEXED BY deliveries_order
        ) AS ordered
        JOIN deliveries ON deliveries.id = ordered.id
        WHERE ordered.latest > ordered.received_at AND deliveries.journaled_at IS NULL;
    CREATE TRIGGER unstamped_backfills_no_update BEFORE UPDATE ON unstamped_backfills
    BEGIN SELECT RAISE(ABORT, 'unstamped_backfills are append-only'); END;
    CREATE TRIGGER unstamped_backfills_no_delete BEFORE DELETE ON unstamped_backfills
    BEGIN SELECT RAISE(ABORT, 'unstamped_backfills are append-only'); END;
    """,
)

_JOURNALED_AT: Final = (
    "coalesce(deliveries.journaled_at, (SELECT u.journaled_at FROM unstamped_backfills AS u"
    " WHERE u.delivery_id = deliveries.id), deliveries.received_at)"
)
"""When a delivery was journaled: as kept, else (a row of a journal from before
``journaled_at``) a backfill's earliest possible instant, else its ``received_at``, which a
live delivery's is (JOURNAL-47)."""

_META_COLUMNS: Final = (
    "id, received_at, sha256, bytes, content_type, automation_name, automation_id,"
    f" automation_aggregation, automation_period, session_id, client, {_JOURNALED_AT}"
)


@attrs.frozen
class EncodedBody:
    """A body already hashed and encoded as the journal stores it (see :class:`BodyEncoder`)."""

    sha256: bytes
    length: int
    encoding: str
    stored: bytes

    def raw(self) -> bytes:
        """The raw bytes again (only needed to canonicalise a body with an idempotency key),
        inflated into one buffer, as a body read back is."""
        if self.encoding == _ZLIB:
            return _inflate(self.stored, self.length)
        return self.stored


def _inflate(stored: bytes, length: int) -> bytes:
    """Decompress a stored body into one buffer, stopping once it outgrows ``length`` (a
    tampered row must not inflate without bound). ``zlib.decompress`` with a cap joins its
    output blocks at the end, briefly holding the body twice; a BytesIO grows in place and
    hands its buffer over without a copy."""
    inflater = zlib.decompressobj()
    out = io.BytesIO()
    pending = stored
    while pending and out.tell() <= length:
        out.write(inflater.decompress(pending, _INFLATE_CHUNK))
        pending = inflater.unconsumed_tail
    if out.tell() <= length:
        out.write(inflater.flush())
    return out.getvalue()


class BodyEncoder:
    """Hashes and encodes a body chunk by chunk, as it streams in.

    The raw body is never held whole: only what the journal will store grows (a body under the
    compression threshold is kept as it is). :meth:`hash` and :meth:`encode` keep separate
    state, so one thread may hash while another compresses; each alone must be called in body
    order from one place at a time.
    """

    def __init__(self, compress_min_bytes: int) -> None:
        self._threshold = compress_min_bytes
        self._sha256 = hashlib.sha256()
        self._length = 0
        self._head = bytearray()
        self._compressor: zlib._Compress | None = None
        self._parts: list[bytes] = []
        self._stored = 0
        self._encoded = 0

    @property
    def held(self) -> int:
        """Bytes of this body in memory so far: what is stored of it, and what is hashed but
        not encoded yet (a batch waiting for the encoding thread). Read from another thread
        than the one encoding, it may lag a batch behind."""
        return self._stored + len(self._head) + self._length - self._encoded

    def feed(self, chunk: bytes) -> None:
        """Hash and encode ``chunk``."""
        self.hash(chunk)
        self.encode((chunk,))

    def hash(self, chunk: bytes) -> None:
        """Count and hash the next raw bytes."""
        self._sha256.update(chunk)
        self._length += len(chunk)

    def encode(self, chunks: Sequence[bytes]) -> None:
        """Encode the next raw bytes (compressed once the threshold is reached)."""
        for chunk in chunks:
            self._encoded += len(chunk)
            if self._compressor is not None:
                self._keep(self._compressor.compress(chunk))
                continue
            self._head += chunk
            if len(self._head) >= self._threshold:
                self._compressor = zlib.compressobj(_ZLIB_LEVEL)
                self._keep(self._compressor.compress(self._head))
                self._head.clear()

    def _keep(self, part: bytes) -> None:
        self._parts.append(part)
        self._stored += len(part)

    def finish(self) -> EncodedBody:
        """The encoded body, once every chunk is hashed and encoded; the encoder is spent."""
        if self._compressor is None and self._length >= self._threshold:
            self.encode((b"",))
        if self._compressor is None:
            stored, encoding = bytes(self._head), _IDENTITY
        else:
            self._keep(self._compressor.flush())
            stored, encoding = b"".join(self._parts), _ZLIB
        self._parts = []
        return EncodedBody(self._sha256.digest(), self._length, encoding, stored)


@attrs.frozen
class NewDelivery:
    """A delivery handed to the journal by intake (or by ``healthlog import``).

    ``body`` is the raw bytes, or an :class:`EncodedBody` from the journal's own
    :meth:`Journal.encoder` (intake encodes while the body streams in).
    """

    body: bytes | EncodedBody
    client: str
    content_type: str | None = None
    automation_name: str | None = None
    automation_id: str | None = None
    automation_aggregation: str | None = None
    automation_period: str | None = None
    session_id: str | None = None
    idempotency_key: str | None = None
    received_at: int | None = None
    """Historical stamp (µs UTC) for backfill; ``None`` stamps the delivery when it is journaled."""
    content_digest: bytes | None = None
    """With an idempotency key, :func:`healthlog.content.content_digest` of the body when the
    caller computed it already (intake does, outside the thread that journals every delivery);
    None has the journal compute it."""


@attrs.frozen
class Receipt:
    """Proof that a delivery is in the journal."""

    delivery_id: int
    received_at: int
    sha256: str
    bytes: int
    replayed: bool = False


@attrs.frozen
class DeliveryMeta:
    """Everything the journal keeps about a delivery except its body."""

    id: int
    received_at: int
    sha256: str
    bytes: int
    content_type: str | None
    automation_name: str | None
    automation_id: str | None
    automation_aggregation: str | None
    automation_period: str | None
    session_id: str | None
    client: str
    journaled_at: int
    """When the delivery was journaled (µs UTC): the live stamp of that instant, which is its
    ``received_at`` unless it was backfilled with a historical one (JOURNAL-45); what its wait
    for the fold counts from. A delivery journaled before the journal kept it reads its
    ``received_at``, a backfill then the earliest instant it can have been journaled
    (JOURNAL-47)."""


@attrs.frozen
class JournalStatistics:
    """Counters of one :class:`Journal` object since it was opened.

    ``appends`` counts deliveries handed in (whatever became of them), ``groups`` the committed
    write transactions, ``deliveries`` and ``bytes`` what those transactions journaled, ``replays``
    and ``collisions`` the idempotency outcomes.
    """

    deliveries: int = 0
    bytes: int = 0
    appends: int = 0
    groups: int = 0
    replays: int = 0
    collisions: int = 0


class IdempotencyCollision(StorageError):
    """The client already used this idempotency key for different content."""

    def __init__(self, original_delivery_id: int) -> None:
        super().__init__(
            f"idempotency key already used for delivery {original_delivery_id}"
            " with different content"
        )
        self.original_delivery_id = original_delivery_id


class CorruptBody(StorageError):
    """A stored body does not match its sha256."""


@attrs.frozen
class _Prepared:
    delivery: NewDelivery
    body: EncodedBody
    content_digest: bytes | None


def _order(
    conn: sqlite3.Connection, after: tuple[int, int] | None, limit: int, through: int | None
) -> list[DeliveryMeta]:
    """Deliveries in journal order strictly after ``after``, of ids at most ``through``, at
    most ``limit`` (-1: all)."""
    where: list[str] = []
    args: list[int] = []
    if after is not None:
        where.append("(received_at, id) > (?, ?)")
        args.extend(after)
    if through is not None:
        where.append("id <= ?")
        args.append(through)
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    cursor = conn.execute(
        f"SELECT {_META_COLUMNS} FROM deliveries{condition} ORDER BY received_at, id LIMIT ?",
        (*args, limit),
    )
    return [_meta(row) for row in cursor.fetchall()]


def _waiting(
    conn: sqlite3.Connection, folded: Collection[int], after: tuple[int, int] | None
) -> tuple[int, tuple[int, int] | None]:
    """How many deliveries strictly after ``after`` in journal order are not in ``folded``, and
    the ``(journaled_at, id)`` of the one of them journaled first (of those journaled at the
    same instant, the first in journal order; JOURNAL-45).

    The rows are taken one at a time and only their id and stamp are read, so a backlog of any
    length costs the same memory (STORE-70, STORE-71)."""
    select = f"SELECT id, {_JOURNALED_AT} FROM deliveries"
    if after is None:
        cursor = conn.execute(f"{select} ORDER BY received_at, id")
    else:
        cursor = conn.execute(
            f"{select} WHERE (received_at, id) > (?, ?) ORDER BY received_at, id", after
        )
    waiting, oldest = 0, None
    with closing(cursor) as rows:
        for delivery_id, journaled_at in rows:
            if delivery_id not in folded:
                waiting += 1
                if oldest is None or journaled_at < oldest[0]:
                    oldest = (int(journaled_at), int(delivery_id))
    return waiting, oldest


def _meta(row: Any) -> DeliveryMeta:
    return DeliveryMeta(
        id=row[0],
        received_at=row[1],
        sha256=bytes(row[2]).hex(),
        bytes=row[3],
        content_type=row[4],
        automation_name=row[5],
        automation_id=row[6],
        automation_aggregation=row[7],
        automation_period=row[8],
        session_id=row[9],
        client=row[10],
        journaled_at=row[11],
    )


# What a journal no longer at its path says (in the log too: it quotes nothing it was given).
_NOT_AT_PATH = "not at its path: moved away, deleted or unmounted under the running service"


class Journal:
    """The journal file: append deliveries, read them back in journal order. Without
    ``create``, a file that is not there is a :class:`StorageError`, not a new journal;
    ``reading`` opens it for a command that only reads (:func:`connect_reading`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], int] = now_us,
        compress_min_bytes: int = 1024,
        busy_timeout_ms: int = 5000,
        create: bool = True,
        reading: bool = False,
    ) -> None:
        if compress_min_bytes < 0:
            raise ValueError("compress_min_bytes must not be negative")
        self.path = os.fspath(path)
        self._clock = clock
        self._compress_min_bytes = compress_min_bytes
        self._busy_timeout_ms = busy_timeout_ms
        # A reading connection is not reopened to write (:class:`Database`).
        self._lock = ConnectionGuard(self.path, None if reading else self._reopen)
        self._stats = JournalStatistics()
        self._counted = (0, 0, 0, 0)
        """The last delivery id :meth:`_count` counted, the deliveries, their raw bytes and the
        sum of their ids."""
        self._clock_behind = False
        """Whether the clock was last seen more than :data:`CLOCK_BEHIND_US` behind the last
        live stamp (said once: JOURNAL-44)."""
        self._conn = (connect_reading if reading else connect)(
            path, create=create, busy_timeout_ms=busy_timeout_ms
        )
        try:
            migrate(self._conn, _MIGRATIONS, GOING_BACK)
            self._instance_id = self._load_instance_id()
        except BaseException as exc:
            self._conn.close()
            error = classify(exc) if isinstance(exc, sqlite3.Error) else exc
            if isinstance(error, StorageError) and is_damage(error):
                raise damaged(self.path, str(exc), DAMAGED) from exc
            if isinstance(error, StorageError):
                error = opening_failed(error, self.path)
            if error is not exc:
                raise error from exc
            raise

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; closing twice is harmless."""
        with self._lock:
            self._conn.close()

    def _count(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """(number of deliveries, total raw bytes), the deliveries journaled since the last
        count added to those it found (JOURNAL-35); the sum of their ids is kept with them
        (:meth:`span_through`).

        The journal is append-only and its ids only grow, commit after commit, so the rows
        after the last id counted are exactly the new ones. Summing every row instead read a
        page of each delivery at every status and every ``/metrics`` scrape: 1,059 pages
        (4.3 MB) for 2.5 years. A connection opened again (:meth:`_reopen`), perhaps to
        another file at the path, counts from nothing."""
        last, deliveries, total, ids = self._counted
        added, added_bytes, added_ids, top = conn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0), coalesce(sum(id), 0), max(id)"
            " FROM deliveries WHERE id > ?",
            (last,),
        ).fetchone()
        if top is not None:
            self._counted = (top, deliveries + added, total + added_bytes, ids + added_ids)
        return deliveries + added, total + added_bytes

    def _reopen(self) -> None:
        self._counted = (0, 0, 0, 0)
        self._conn = reopened(
            self._conn,
            self.path,
            lambda: connect(self.path, create=False, busy_timeout_ms=self._busy_timeout_ms),
        )

    def check_intact(self) -> None:
        """Raise a :class:`StorageError` if the file is damaged, as a copy of it taken apart
        from its ``-wal`` file is (JOURNAL-39)."""
        with self._lock:
            check_intact(self._conn, self.path, DAMAGED)

    def interrupt(self) -> None:
        """Make SQLite give up the statement another thread runs through this connection, as
        :meth:`Database.interrupt` does: the check of a journal read from the disk, stopped by a
        signal (RUN-163)."""
        self._conn.interrupt()

    def instance_id(self) -> str:
        """The random id of this journal file, created when the file was created."""
        return self._instance_id

    def statistics(self) -> JournalStatistics:
        with self._lock:
            return self._stats

    def snapshot_key(self) -> str | None:
        """The public half of the snapshot signing key last recorded for this data directory
        (:meth:`record_snapshot_key`), or None if none was."""
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'snapshot_key'").fetchone()
        return None if row is None else str(row[0])

    def record_snapshot_key(self, public_key: str) -> None:
        """Record the public half of the data directory's snapshot signing key: followers pin
        it, so one found changed later is worth saying (``DataDir.signing_key``)."""
        with self._lock, write_transaction(self._conn) as conn:
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('snapshot_key', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (public_key,),
            )

    def encoder(self) -> BodyEncoder:
        """An encoder for a body that streams in, with this journal's compression threshold."""
        return BodyEncoder(self._compress_min_bytes)

    def append(self, delivery: NewDelivery) -> Receipt:
        """Journal one delivery durably; raises :class:`IdempotencyCollision` for a reused key."""
        result = self.append_many([delivery])[0]
        if isinstance(result, IdempotencyCollision):
            raise result
        return result

    def append_many(
        self, deliveries: Sequence[NewDelivery]
    ) -> list[Receipt | IdempotencyCollision]:
        """Journal a group of deliveries in one write transaction and one fsync'd commit.

        The result has one slot per delivery: its receipt (``replayed=True`` when an idempotency
        key matched equivalent earlier content, in which case nothing is journaled) or an
        :class:`IdempotencyCollision`. Either every slot's outcome commits or none does.
        """
        prepared = [self._prepare(delivery) for delivery in deliveries]
        with self._lock:
            self._stats = attrs.evolve(self._stats, appends=self._stats.appends + len(prepared))
            if not prepared:
                return []
            with write_transaction(self._conn) as conn:
                self._still_at_path()
                results = self._append_locked(conn, prepared)
            journaled = [r for r in results if isinstance(r, Receipt) and not r.replayed]
            replays = sum(1 for r in results if isinstance(r, Receipt) and r.replayed)
            collisions = len(results) - len(journaled) - replays
            self._stats = attrs.evolve(
                self._stats,
                deliveries=self._stats.deliveries + len(journaled),
                bytes=self._stats.bytes + sum(r.bytes for r in journaled),
                groups=self._stats.groups + 1,
                replays=self._stats.replays + replays,
                collisions=self._stats.collisions + collisions,
            )
        _log.debug(
            "group committed: %d journaled (ids %s..%s), %d replayed, %d collisions",
            len(journaled),
            journaled[0].delivery_id if journaled else "-",
            journaled[-1].delivery_id if journaled else "-",
            replays,
            collisions,
        )
        return results

    def _still_at_path(self) -> None:
        """Refuse (StorageError) to journal into a file no longer at its path: the data
        directory moved away or deleted under the running service, where SQLite would go on
        writing the open file, which no later start finds (a delivery answered 200 there is
        lost once this process ends, or kept where nobody looks). Whether the file at the
        path is the one opened is not asked: a network filesystem may renumber its inodes."""
        if not os.path.exists(self.path):
            error = StorageError(f"{os.path.basename(self.path)} is {_NOT_AT_PATH}")
            error.kind, error.file = _NOT_AT_PATH, os.path.basename(self.path)
            raise error

    def get_meta(self, delivery_id: int) -> DeliveryMeta | None:
        with self._reading() as conn:
            row = conn.execute(
                f"SELECT {_META_COLUMNS} FROM deliveries WHERE id = ?", (delivery_id,)
            ).fetchone()
        return None if row is None else _meta(row)

    def get_metas(self, delivery_ids: Sequence[int]) -> dict[int, DeliveryMeta]:
        """The metadata of those of ``delivery_ids`` that are journaled, in one query."""
        marks = ", ".join("?" * len(delivery_ids))
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {_META_COLUMNS} FROM deliveries WHERE id IN ({marks})", delivery_ids
            ).fetchall()
        return {row[0]: _meta(row) for row in rows}

    def read_body(self, delivery_id: int) -> bytes:
        """The raw body, byte for byte; :class:`CorruptBody` if it does not match its sha256."""
        with self._reading() as conn:
            row = conn.execute(
                "SELECT sha256, bytes, encoding, body FROM deliveries WHERE id = ?",
                (delivery_id,),
            ).fetchone()
        if row is None:
            raise KeyError(delivery_id)
        faults.point("journal.read_body")
        sha256, length, encoding, stored = bytes(row[0]), row[1], row[2], bytes(row[3])
        if encoding == _IDENTITY:
            body = stored
        elif encoding == _ZLIB:
            try:
                body = _inflate(stored, length)
            except zlib.error:
                raise CorruptBody(
                    f"delivery {delivery_id}: stored body does not decompress"
                ) from None
        else:
            raise CorruptBody(f"delivery {delivery_id}: unknown body encoding")
        if len(body) != length or hashlib.sha256(body).digest() != sha256:
            raise CorruptBody(f"delivery {delivery_id}: stored body does not match its sha256")
        return body

    def iter_order(
        self,
        *,
        after: tuple[int, int] | None = None,
        limit: int | None = None,
        through: int | None = None,
    ) -> list[DeliveryMeta]:
        """Deliveries in journal order ``(received_at, id)``, strictly after ``after``; with
        ``through``, only those of ids at most that (journaled no later than it)."""
        if limit is not None and limit < 0:
            raise ValueError("limit must not be negative")
        with self._reading() as conn:
            return _order(conn, after, -1 if limit is None else limit, through)

    def wal_held_back(self) -> int:
        """:func:`~healthlog.storage._sqlite.wal_held_back` of the journal."""
        with self._reading() as conn:
            return wal_held_back(conn, self.path)

    def newer_version(self) -> int | None:
        """:func:`~healthlog.storage._sqlite.newer_version` of the journal."""
        with self._lock:
            return newer_version(self._conn, _MIGRATIONS)

    def last_id(self) -> int:
        """The id of the delivery journaled last, 0 in an empty journal. Ids only grow and no
        delivery is ever deleted, so every delivery journaled later has a greater one."""
        with self._reading() as conn:
            (last,) = conn.execute("SELECT coalesce(max(id), 0) FROM deliveries").fetchone()
        return int(last)

    def last_and_count(self) -> tuple[int, int, int]:
        """The id of the delivery journaled last (0 in an empty journal), and how many
        deliveries the journal holds up to it and their raw bytes (:meth:`count`), read in one
        transaction."""
        with self._reading() as conn, read_transaction(conn):
            deliveries, total = self._count(conn)
            (last,) = conn.execute("SELECT coalesce(max(id), 0) FROM deliveries").fetchone()
        return int(last), deliveries, total

    def waiting_and_count(
        self, folded: Collection[int], *, after: tuple[int, int] | None = None
    ) -> tuple[int, tuple[int, int] | None, tuple[int, int]]:
        """:meth:`oldest_waiting` with how many wait, and :meth:`count`, read in one
        transaction: a delivery journaled meanwhile is in both or in neither."""
        with self._reading() as conn, read_transaction(conn):
            waiting, oldest = _waiting(conn, folded, after)
            return waiting, oldest, self._count(conn)

    def oldest_waiting(
        self, folded: Collection[int], *, after: tuple[int, int] | None = None
    ) -> tuple[int, int] | None:
        """Of the deliveries strictly after ``after`` in journal order that are not in
        ``folded``, the ``(journaled_at, id)`` of the one journaled first (see ``_waiting``)."""
        with self._reading() as conn:
            return _waiting(conn, folded, after)[1]

    def span_through(self, position: tuple[int, int]) -> tuple[int, int]:
        """(number, sum of ids) of the deliveries at or before ``position`` in journal order.

        Every delivery, as :meth:`_count` keeps them, less those after ``position``, read from
        the order index: a caller tells cheaply whether every one of them is accounted for
        elsewhere. Counting those up to ``position`` read the whole index at every folding
        pass, status and scrape, 0.2 s at 508,000 deliveries (STORE-60).
        """
        with self._reading() as conn, read_transaction(conn):
            self._count(conn)
            _, number, _, ids = self._counted
            later, later_ids = conn.execute(
                "SELECT count(*), coalesce(sum(id), 0) FROM deliveries"
                " WHERE (received_at, id) > (?, ?)",
                position,
            ).fetchone()
        return number - int(later), ids - int(later_ids)

    def keyed(self) -> list[tuple[str, str, int]]:
        """(client, idempotency key, delivery id) of every delivery journaled with a key."""
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT client, idempotency_key, id FROM deliveries"
                " WHERE idempotency_key IS NOT NULL ORDER BY id"
            ).fetchall()
        return [(str(client), str(key), int(delivery_id)) for client, key, delivery_id in rows]

    def count(self) -> tuple[int, int]:
        """(number of deliveries, total raw bytes)."""
        with self._reading() as conn:
            return self._count(conn)

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise classify(exc) from exc

    def _prepare(self, delivery: NewDelivery) -> _Prepared:
        body = delivery.body
        if isinstance(body, EncodedBody):
            encoded = body
        else:
            encoder = self.encoder()
            encoder.feed(body)
            encoded = encoder.finish()
        digest = delivery.content_digest
        if delivery.idempotency_key is not None and digest is None:
            raw = body if isinstance(body, bytes) else encoded.raw()
            digest = content_digest(raw, encoded.sha256)
        return _Prepared(delivery, encoded, digest)

    def _note_clock(self, reading: int, last: int) -> None:
        """Say once (JOURNAL-44) that the clock reads more than a minute behind the last live
        stamp, which live deliveries then take (stamps never decrease): a NAS that booted with
        its clock ahead and had it set back by NTP stamps everything with the instant it
        reached until the clock passes it, and the lag of what waits reads 0, with nothing
        else to say why."""
        if reading >= last:
            self._clock_behind = False
        elif last - reading > CLOCK_BEHIND_US and not self._clock_behind:
            self._clock_behind = True
            _log.warning(
                "the clock reads %s, %s s behind the journal's last stamp %s (was it ahead, and"
                " set back since?): live deliveries are stamped with that instant until the"
                " clock passes it, and their lag reads 0 meanwhile",
                format_instant(reading),
                f"{(last - reading) // 1_000_000:,}",
                format_instant(last),
            )

    def _append_locked(
        self, conn: sqlite3.Connection, prepared: list[_Prepared]
    ) -> list[Receipt | IdempotencyCollision]:
        (last,) = conn.execute("SELECT value FROM meta WHERE key = 'last_received_at'").fetchone()
        start = last
        results: list[Receipt | IdempotencyCollision] = []
        for item in prepared:
            delivery = item.delivery
            if delivery.idempotency_key is not None:
                earlier = self._earlier_outcome(conn, item)
                if earlier is not None:
                    results.append(earlier)
                    continue
            reading = self._clock()
            journaled_at = max(reading, last)
            if delivery.received_at is None:
                self._note_clock(reading, last)
                received_at = last = journaled_at
            else:
                received_at = delivery.received_at
                last = max(last, received_at)
            (delivery_id,) = conn.execute(
                "INSERT INTO deliveries (received_at, journaled_at, sha256, bytes, content_type,"
                " automation_name, automation_id, automation_aggregation, automation_period,"
                " session_id, client, idempotency_key, encoding, body)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (
                    received_at,
                    journaled_at,
                    item.body.sha256,
                    item.body.length,
                    delivery.content_type,
                    delivery.automation_name,
                    delivery.automation_id,
                    delivery.automation_aggregation,
                    delivery.automation_period,
                    delivery.session_id,
                    delivery.client,
                    delivery.idempotency_key,
                    item.body.encoding,
                    item.body.stored,
                ),
            ).fetchone()
            if delivery.idempotency_key is not None:
                conn.execute(
                    "INSERT INTO receipts (client, idempotency_key, delivery_id, content_digest)"
                    " VALUES (?, ?, ?, ?)",
                    (delivery.client, delivery.idempotency_key, delivery_id, item.content_digest),
                )
            results.append(
                Receipt(delivery_id, received_at, item.body.sha256.hex(), item.body.length)
            )
        if last != start:
            conn.execute("UPDATE meta SET value = ? WHERE key = 'last_received_at'", (last,))
        return results

    @staticmethod
    def _earlier_outcome(
        conn: sqlite3.Connection, item: _Prepared
    ) -> Receipt | IdempotencyCollision | None:
        """The outcome of a reused idempotency key, or ``None`` if the key is new."""
        row = conn.execute(
            "SELECT r.delivery_id, r.content_digest, d.received_at, d.sha256, d.bytes"
            " FROM receipts AS r JOIN deliveries AS d ON d.id = r.delivery_id"
            " WHERE r.client = ? AND r.idempotency_key = ?",
            (item.delivery.client, item.delivery.idempotency_key),
        ).fetchone()
        if row is None:
            return None
        delivery_id, stored_digest, original_sha256 = row[0], bytes(row[1]), bytes(row[3])
        if item.body.sha256 != original_sha256 and item.content_digest != stored_digest:
            return IdempotencyCollision(delivery_id)
        return Receipt(delivery_id, row[2], original_sha256.hex(), row[4], replayed=True)

    def _load_instance_id(self) -> str:
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()
        if row is None:
            with write_transaction(self._conn) as conn:
                conn.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('instance_id', ?)",
                    (uuid.uuid4().hex,),
                )
                row = conn.execute("SELECT value FROM meta WHERE key = 'instance_id'").fetchone()
        return str(row[0])
