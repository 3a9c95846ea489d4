"""The projection file ``store.sqlite``: hourly objects, fold outcomes, checkpoint, lease, events
and the seals folded so far.

Everything here can be rebuilt from the journal. A delivery folds in one write transaction
(S10) that checks the lease epoch it was started under (L2), writes the objects the fold
yields, the outcome, the checkpoint and the change events, and commits, or writes nothing; a
journaled seal folds the same way, marking the objects it covers instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson

from healthlog import clock, faults, seals
from healthlog.documents import DeliveryFolded, ObjectChanged, converter, dumps
from healthlog.fold import (
    FAILED,
    NO_LAYER,
    PARSED,
    PARTIAL,
    BudgetExceeded,
    DeliveryFold,
    DeliveryInfo,
    Outcome,
)
from healthlog.folding import FoldReport, OutcomeClass
from healthlog.merge import Counters
from healthlog.objects import HourlyObject, ObjectKey
from healthlog.seals import Seal, SealError
from healthlog.storage import _objects, holders
from healthlog.storage._sqlite import (
    ConnectionGuard,
    Deferred,
    StorageError,
    connect,
    describe,
    read_transaction,
    write_transaction,
)
from healthlog.storage.journal import CorruptBody, DeliveryMeta, Journal
from healthlog.timestamps import US_PER_HOUR, format_instant

log = logging.getLogger("healthlog.store")

FOLD_LEASE = "fold"
# The reason of a delivery failed because its fold ran over its time budget (F5).
OVER_BUDGET = "fold over its time budget"
# The reason of a delivery failed after its fold lost ``WORKER_DEATHS`` worker processes in a
# row (the runtime's folding actor; the kernel's out-of-memory killer, say).
WORKER_DIED = "fold worker died"
# The reason of a delivery whose fold ran out of memory in its process.
OUT_OF_MEMORY = "internal error: MemoryError"
# Failures that the machine decided (its clock, its memory), not the journal: a rebuild
# records them as the live fold did, so that verify compares what follows them as it was
# folded; reindex folds them.
GIVEN_UP = (OVER_BUDGET, WORKER_DIED, OUT_OF_MEMORY)
# The reason of a delivery failed because its journaled body no longer matches its sha256.
BODY_CORRUPT = "body does not match its sha256"
# How far after now an event's stamp may lie and still count as recent when events are pruned.
FUTURE_SKEW_US = 86_400 * 1_000_000
# How long a write that is tried again later anyway (a subscriber's ACK, a mark, the runtime's
# lease renewal, a retention run) waits for the write lock before it is deferred, rather than
# hold the store's reads behind it.
BRIEF_WAIT_MS = 250


def _span(row: str) -> str:
    """:func:`healthlog.seals.span` of the layer of ``row`` (a table or its alias), in SQL."""
    cases = " ".join(f"WHEN '{layer}' THEN {us}" for layer, us in seals.SPANS.items())
    return f"CASE {row}.layer {cases} ELSE {US_PER_HOUR} END"


def _in_scope(row: str) -> str:
    """Whether the seal ``s`` names the metric and layer of ``row``, or leaves them open."""
    return f"coalesce(s.metric = {row}.metric, 1) AND coalesce(s.layer = {row}.layer, 1)"


# The mark of why a reindex is advised: a list of codes of ``REINDEX_REASONS``, set by a
# migration where the store holds what an older fold made otherwise than this one does; a
# reindex's swap takes it away. A store folded by this healthlog from the start never has it.
REINDEX_MARK = "reindex_advised"
RECORDS_OF_ONE_MOMENT = "records_of_one_moment"
OTHER_CALENDARS = "other_calendars"
REINDEX_REASONS = {
    RECORDS_OF_ONE_MOMENT: "an older healthlog kept one of the symptoms, medication doses or"
    " cycle-tracking entries that share a start and end, and the journal alone holds the others"
    " (MERGE-35)",
    OTHER_CALENDARS: "an older healthlog stored points dated in a calendar other than the"
    " Gregorian at the year written (a phone set to the Buddhist calendar writes 2567 for 2024:"
    " 543 years late, where no query of the days lived finds them), which this one reads as"
    " Gregorian or refuses (PARSE-41, PARSE-44, PARSE-47)",
}


# The objects no seal covers yet, by hour: a seal looks for those it covers among them
# (:data:`MARK_SEALED`), where it read every object of the store, bodies and all, each night
# (0.12 to 0.84 s for 691,053 objects over 4 years, growing with every year kept); it now reads
# the few no seal covers yet (965 there, 2 to 6 ms; SEAL-30).
UNSEALED_INDEX = """
    CREATE INDEX IF NOT EXISTS objects_unsealed ON objects (hour) WHERE sealed = 0;
"""

MIGRATIONS = (
    """
    CREATE TABLE objects (
        metric TEXT NOT NULL,
        layer TEXT NOT NULL,
        hour INTEGER NOT NULL,
        units TEXT,
        first INTEGER NOT NULL,
        last INTEGER NOT NULL,
        points INTEGER NOT NULL,
        created_by INTEGER NOT NULL,
        hash BLOB NOT NULL,
        sealed INTEGER NOT NULL DEFAULT 0,
        body BLOB NOT NULL,
        PRIMARY KEY (metric, layer, hour)
    ) WITHOUT ROWID;
    CREATE TABLE outcomes (
        delivery_id INTEGER PRIMARY KEY,
        received_at INTEGER NOT NULL,
        automation TEXT,
        status TEXT NOT NULL CHECK (status IN ('parsed', 'partial', 'failed')),
        reason TEXT,
        layer TEXT,
        counters TEXT NOT NULL,
        epoch INTEGER NOT NULL
    );
    CREATE INDEX outcomes_order ON outcomes (received_at, delivery_id);
    CREATE INDEX outcomes_automation ON outcomes (automation, received_at, delivery_id);
    CREATE TABLE checkpoint (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        received_at INTEGER,
        delivery_id INTEGER,
        epoch INTEGER NOT NULL
    );
    INSERT INTO checkpoint VALUES (1, NULL, NULL, 0);
    CREATE TABLE lease (
        name TEXT PRIMARY KEY,
        holder TEXT,
        epoch INTEGER NOT NULL,
        expires_at INTEGER NOT NULL
    );
    INSERT INTO lease VALUES ('fold', NULL, 0, 0);
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL,
        payload TEXT NOT NULL
    );
    CREATE TABLE marks (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE subscribers (name TEXT PRIMARY KEY, acked INTEGER NOT NULL);
    """,
    """
    ALTER TABLE events ADD COLUMN at INTEGER NOT NULL DEFAULT 0;
    INSERT INTO marks (key, value) VALUES ('stream', json_quote(lower(hex(randomblob(16)))));
    """,
    """
    ALTER TABLE lease ADD COLUMN term INTEGER NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE seals (
        delivery_id INTEGER PRIMARY KEY,
        before INTEGER NOT NULL,
        metric TEXT,
        layer TEXT
    );
    """,
    """
    CREATE INDEX outcomes_listed ON outcomes (status, received_at, delivery_id)
        WHERE status IN ('failed', 'partial');
    """,
    # When each subscriber's last ACK was stored (healthlog.clock, µs). A subscriber stored
    # before this migration counts as seen now, not at the epoch: an upgrade removes none.
    """
    ALTER TABLE subscribers ADD COLUMN acked_at INTEGER NOT NULL DEFAULT 0;
    UPDATE subscribers SET acked_at = now_us();
    """,
    # Each fold counter summed over every outcome, kept as outcomes are written (and copied
    # with a swap's), so that ``/metrics`` reads a few rows: it summed every outcome's counters
    # at each scrape, 0.25 s at 508,000 deliveries, holding the store's one thread meanwhile,
    # and more with every delivery (STORE-58).
    """
    CREATE TABLE counter_totals (name TEXT PRIMARY KEY, total INTEGER NOT NULL) WITHOUT ROWID;
    INSERT INTO counter_totals
        SELECT key, sum(value) FROM outcomes, json_each(outcomes.counters) GROUP BY key;
    """,
    # How many outcomes there are and the sum of their ids, kept as outcomes are written (and
    # copied with a swap's), so that a pass tells whether every delivery up to the checkpoint
    # has its outcome from the outcomes after it alone: it counted every outcome up to the
    # checkpoint at each pass, status and scrape, 0.16 s at 508,000 deliveries (STORE-60).
    """
    ALTER TABLE checkpoint ADD COLUMN outcomes INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE checkpoint ADD COLUMN outcome_ids INTEGER NOT NULL DEFAULT 0;
    UPDATE checkpoint SET (outcomes, outcome_ids) =
        (SELECT count(*), coalesce(sum(delivery_id), 0) FROM outcomes);
    """,
    # A random tag for each event as it is written (``EVENT_TAG``), sent in its frame: a
    # subscriber that resumes with the tag of the event at its cursor is told when this store's
    # event at that seq is another one (restored from a backup, or a copy of its data directory,
    # that went on with other changes under the same numbers, STREAM-111). Events written
    # before have none, and are not checked.
    """
    ALTER TABLE events ADD COLUMN tag TEXT;
    """,
    # Objects in a rowid table, their key a unique index: a WITHOUT ROWID table keeps at most
    # about 1,000 bytes of a row in its 4 KiB page, so every body (most are 1 to 2 KB) spilled
    # into an overflow page of its own, mostly empty; a rowid table keeps up to 4,061 bytes of
    # a row in its page. The table was 80.6 MB for 21.9 MB of bodies, 56.9 MB of it unused
    # (STORE-90). The pages it frees stay in the file until a VACUUM (README, upgrading).
    """
    CREATE TABLE objects_by_rowid (
        metric TEXT NOT NULL,
        layer TEXT NOT NULL,
        hour INTEGER NOT NULL,
        units TEXT,
        first INTEGER NOT NULL,
        last INTEGER NOT NULL,
        points INTEGER NOT NULL,
        created_by INTEGER NOT NULL,
        hash BLOB NOT NULL,
        sealed INTEGER NOT NULL DEFAULT 0,
        body BLOB NOT NULL
    );
    INSERT INTO objects_by_rowid
        SELECT metric, layer, hour, units, first, last, points, created_by, hash, sealed, body
        FROM objects ORDER BY metric, layer, hour;
    DROP TABLE objects;
    ALTER TABLE objects_by_rowid RENAME TO objects;
    CREATE UNIQUE INDEX objects_key ON objects (metric, layer, hour);
    """,
    # A seal covers a daily or longer total once its longest period has ended (SEAL-22), no
    # longer once its hour has: a flag the hour alone gave, which no seal kept gives now, is
    # taken off as a rebuild would (verify compares flags) and the object announced as a
    # reindex announces one; a flag no seal gave (SEAL-7) stays for verify to report. Only the
    # objects key index is read to find them, not every body (STORE-104).
    f"""
    CREATE TEMP TABLE unsealed AS
        SELECT o.rowid AS id, o.metric, o.layer, o.hour, o.hash, o.points FROM objects o
        WHERE o.sealed = 1 AND o.rowid IN (
            SELECT k.rowid FROM objects k
            WHERE k.layer IN ({", ".join(f"'{layer}'" for layer in seals.SPANS)})
            AND EXISTS (
                SELECT 1 FROM seals s WHERE k.hour + {US_PER_HOUR} <= s.before AND {_in_scope("k")}
            )
            AND NOT EXISTS (
                SELECT 1 FROM seals s WHERE k.hour + {_span("k")} <= s.before AND {_in_scope("k")}
            )
        );
    UPDATE objects SET sealed = 0 WHERE rowid IN (SELECT id FROM temp.unsealed);
    INSERT INTO events (id, kind, payload, at, tag)
        SELECT 'upgrade.seals.' || id, 'object.changed', json_object(
            'metric', metric, 'layer', layer,
            'hour', strftime('%Y-%m-%dT%H:%M:%SZ', hour / 1000000, 'unixepoch'),
            'hash', lower(hex(hash)), 'points', points, 'delivery_id', NULL
        ), now_us(), lower(hex(randomblob(8)))
        FROM temp.unsealed ORDER BY metric, layer, hour;
    DROP TABLE temp.unsealed;
    """,
    # Records of one moment are each kept since MERGE-35: an older healthlog kept one of the
    # symptoms, doses or cycle-tracking entries sharing a start and end, the others in the
    # journal alone, and which objects lost one only a rebuild tells. A store holding any
    # object of those sections is marked, so that ``serve``, ``status`` and ``verify`` advise
    # the reindex that brings them back, rather than a README section alone; one holding none
    # has lost nothing (STORE-127). The names are those the older fold stored, written out:
    # the step stays what it was whatever sections are told apart later. Only the objects key
    # index is read.
    f"""
    INSERT INTO marks (key, value)
        SELECT '{REINDEX_MARK}', json_array('{RECORDS_OF_ONE_MOMENT}')
        WHERE EXISTS (
            SELECT 1 FROM objects WHERE layer = 'records'
            AND metric IN ('symptoms', 'medications', 'cycleTracking')
        );
    """,
    UNSEALED_INDEX,
    # Points dated in another calendar are read as Gregorian (a Buddhist-era year, 2500 to
    # 2999, 543 years earlier: PARSE-41) or refused (a year before 1900, PARSE-44; from 3000
    # on, PARSE-47) since 1 December 2026: an older healthlog stored them at the year written,
    # centuries off, where no query of the days lived finds them. A store holding an object of
    # an hour this one can no longer make (before 31 December 1899, a day before 1900 in any
    # offset, or from 2500 on; written out, so the step stays what it was) is marked, so that
    # ``serve``, ``status`` and ``verify`` advise the reindex that moves them (STORE-156), as for
    # MERGE-35, beside whose reason this one is added. Only the objects key index is read.
    f"""
    CREATE TEMP TABLE other_calendars AS
        SELECT 1 FROM objects INDEXED BY objects_key
        WHERE hour < -2209075200000000 OR hour >= 16725225600000000 LIMIT 1;
    INSERT INTO marks (key, value)
        SELECT '{REINDEX_MARK}', json_array() FROM temp.other_calendars WHERE true
        ON CONFLICT (key) DO NOTHING;
    UPDATE marks SET value = json_insert(value, '$[#]', '{OTHER_CALENDARS}')
        WHERE key = '{REINDEX_MARK}' AND EXISTS (SELECT 1 FROM temp.other_calendars);
    DROP TABLE temp.other_calendars;
    """,
)
# A rebuild partition's scratch file (``_partition``) has the store's schema but for
# ``objects_unsealed``: it is never sealed (its objects are marked as they are gathered into
# the rebuilt store), and each of its objects, rewritten with every delivery that touches it,
# is unsealed, so the index held them all and was written with each (SEAL-31).
SCRATCH_MIGRATIONS = tuple("" if step == UNSEALED_INDEX else step for step in MIGRATIONS)
# Mark the objects a seal covers (``Seal.covers`` in SQL) that lack it, returning their metric,
# layer, hour, hash and points; ``hour <= before`` lets it search ``objects_unsealed``, whose
# WHERE term it holds as is (SQLite takes a partial index only then).
MARK_SEALED = (
    "UPDATE objects SET sealed = 1 WHERE sealed = 0 AND hour <= :before"
    f" AND hour + {_span('objects')} <= :before"
    " AND coalesce(:metric = metric, 1) AND coalesce(:layer = layer, 1)"
    " RETURNING metric, layer, hour, hash, points"
)
# The tag of an event as it is inserted: 64 random bits, as 16 hex digits.
EVENT_TAG = "lower(hex(randomblob(8)))"
# The mark of the last event pruned, ``{"seq": N, "tag": T}``: a subscriber resuming with its
# cursor there (the window's start) is checked against that tag, as against a held event's.
PRUNED_MARK = "pruned"
# The statuses of the outcomes a delivery list holds (:meth:`Store.newest_outcomes`), which the
# partial index ``outcomes_listed`` indexes, and its WHERE clause: SQLite takes a partial index
# only for a query whose own WHERE holds that term, so each query of the lists holds it as is.
LISTED_OUTCOMES = (FAILED, PARTIAL)
# How many objects :meth:`Store.iter_objects` reads from the file at a time.
OBJECTS_PAGE = _objects.PAGE
# The columns of an object's summary (everything but its body), in the order it is read.
SUMMARY_COLUMNS = "metric, layer, hour, units, points, hash, created_by, sealed"
# How many object summaries :meth:`Store.snapshot_into` copies at a time.
SUMMARIES_PAGE = 1024
_LISTED = "status IN ('failed', 'partial')"
# The statements of the counts by status (:meth:`Store.folded_view`): every outcome, counted
# over the smallest index that holds them all, and the failed and partial ones, over
# ``outcomes_listed``; the rest are parsed, the only other status the table's CHECK allows.
# Neither reads an outcome's row: a GROUP BY over the table read every row (15 ms at 100,000;
# these take 0.3 ms).
COUNT_QUERIES = (
    "SELECT count(*) FROM outcomes",
    f"SELECT status, count(*) FROM outcomes WHERE {_LISTED} GROUP BY status",
)


class Fenced(StorageError):
    """The lease epoch changed under a fold: its result is not authoritative (L2, L5)."""


@attrs.frozen
class OutcomeRow:
    """A recorded delivery outcome."""

    delivery_id: int
    received_at: int
    status: str
    reason: str | None
    layer: str | None
    counters: dict[str, int]


@attrs.frozen
class FoldedView:
    """The fold outcomes as one transaction saw them (:meth:`Store.folded_view`).

    ``folded`` holds the ids of the deliveries with an outcome after the checkpoint position
    ``after`` in journal order, or of every one when ``after`` is None; ``counts`` the outcomes
    by status, when asked for.
    """

    after: tuple[int, int] | None
    folded: frozenset[int]
    counts: dict[str, int]


@attrs.frozen
class Event:
    """One change event of the replay stream; ``payload`` is its stored document (an
    :class:`~healthlog.documents.ObjectChanged` or :class:`~healthlog.documents.DeliveryFolded`
    by its ``kind``) as read, a mapping: a replay hands it on to the frame as it is."""

    seq: int
    id: str
    kind: str
    payload: dict[str, Any]
    # Random, written with the event; None for an event written before tags were (STREAM-111).
    tag: str | None = None


@attrs.frozen
class HeadSnapshot:
    """What :meth:`Store.snapshot_at_head` read: the head sequence, how many objects there
    are, and the objects, sorted by metric, layer and hour, read while they are iterated; and
    the tag of the event at the head (None: it has none, or is pruned)."""

    seq: int
    count: int
    objects: Iterator[HourlyObject]
    tag: str | None = None


@attrs.frozen
class Lease:
    """The lease row."""

    holder: str | None
    epoch: int
    expires_at: int


def default_holder(directory: Path | None = None) -> str:
    """A lease holder name unique to this process: the host and process, and a random part,
    since a process id comes back (a restarted container's service often has the same one),
    and a holder renews a lease that names it at the same epoch; then the process's start time
    and pid namespace, and its lock in the data directory ``directory``'s ``lease.lock``, by
    which a holder of this machine that has ended is told from one that runs
    (:func:`holders.ended`)."""
    name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    mark = holders.mark(directory)
    return name if mark is None else f"{name}:{mark}"


SERVE_PREFIX = "serve:"


def serve_holder(directory: Path | None = None) -> str:
    """The lease holder name of ``healthlog serve``: ``serve:`` and :func:`default_holder`. A
    second serve started on the same data directory by mistake (a second unit, a container
    beside a host install) tells by it that a serve, not an ``import`` or ``seal`` that folds a
    while and lets go, keeps it from folding (RUN-140)."""
    return SERVE_PREFIX + default_holder(directory)


def process_of(holder: str | None, prefix: str) -> tuple[str, str] | None:
    """The host and process id in ``holder``, a name ``PREFIX`` + :func:`default_holder`, or
    None for a holder of another kind."""
    if holder is None or not holder.startswith(prefix):
        return None
    host, _, rest = holder.removeprefix(prefix).partition(":")
    return host, rest.partition(":")[0]


def serve_of(holder: str | None) -> tuple[str, str] | None:
    """The host and process id of the ``serve`` that ``holder`` names, or None for another
    holder (a reindex, an ``import``, a ``seal``)."""
    return process_of(holder, SERVE_PREFIX)


# A live row ``o`` equal in every column to a rebuilt row ``n``: the swap neither writes it nor
# announces it.
_SAME_ROW = (
    "o.metric = n.metric AND o.layer = n.layer AND o.hour = n.hour AND o.units IS n.units"
    " AND o.first = n.first AND o.last = n.last AND o.points = n.points"
    " AND o.created_by = n.created_by AND o.hash = n.hash AND o.sealed = n.sealed"
    " AND o.body = n.body"
)


def listing_queries(
    statuses: Sequence[str], limit: int
) -> tuple[tuple[str, tuple[str | int, ...]], tuple[str, tuple[str | int, ...]]]:
    """The statements of :meth:`Store.newest_outcomes` with their arguments: how many outcomes
    have one of ``statuses`` (of :data:`LISTED_OUTCOMES`), and the newest ``limit`` of them.

    Both read ``outcomes_listed`` (status, received_at, delivery_id), never every outcome: the
    count counts its entries of those statuses; the list reads each status's entries newest
    first, one arm of a UNION ALL per status, and SQLite merges the arms in journal order and
    stops after ``limit`` rows, sorting nothing, as the query plan shows (CLI-45).
    """
    wanted = [status for status in LISTED_OUTCOMES if status in statuses]
    if not wanted or len(wanted) != len(set(statuses)):
        raise ValueError(f"statuses are among {', '.join(LISTED_OUTCOMES)}")
    marks = ", ".join("?" for _ in wanted)
    count = f"SELECT count(*) FROM outcomes WHERE {_LISTED} AND status IN ({marks})"
    arm = (
        "SELECT delivery_id, received_at, status, reason, layer, counters FROM outcomes"
        f" WHERE {_LISTED} AND status = ?"
    )
    newest = (
        " UNION ALL ".join(arm for _ in wanted)
        + " ORDER BY received_at DESC, delivery_id DESC LIMIT ?"
    )
    return (count, tuple(wanted)), (newest, (*wanted, limit))


def automation_of(meta: DeliveryMeta) -> str | None:
    """The automation a delivery belongs to, for layer inheritance."""
    if meta.automation_id:
        return f"id:{meta.automation_id}"
    if meta.automation_name:
        return f"name:{meta.automation_name}"
    return None


def _log_folded(delivery_id: int, outcome: Outcome, *, live: bool) -> None:
    """Log a committed fold's status and counters (S11: counters and ids, never a value), at
    INFO for the live folder and at DEBUG for a rebuild, which would only repeat it. A failed
    or partial fold's line ends with its reason, so the log says why without a lookup of the
    delivery: a reason names what was wrong, never a value (PARSE-33)."""
    counters = outcome.counters
    log.log(
        logging.INFO if live else logging.DEBUG,
        "delivery %d folded: status=%s metrics=%d sections=%d points=%d rejected=%d objects=%d"
        " overwrites=%d held=%d erased=%d%s",
        delivery_id,
        outcome.status,
        counters.metrics,
        counters.sections,
        counters.points,
        counters.points_rejected + counters.entries_rejected,
        counters.objects_written,
        counters.overwrites,
        counters.points_held,
        counters.points_erased,
        f" reason={outcome.reason}" if outcome.reason else "",
    )


def _seals(conn: sqlite3.Connection) -> list[Seal]:
    """The seals folded so far."""
    return [
        Seal(before, metric, layer)
        for before, metric, layer in conn.execute("SELECT before, metric, layer FROM seals")
    ]


class _Projection:
    """The fold's read view of the store, inside the fold transaction."""

    def __init__(self, conn: sqlite3.Connection, meta: DeliveryMeta) -> None:
        self._conn = conn
        self._meta = meta
        self._seals: list[Seal] | None = None

    def load(self, key: ObjectKey) -> HourlyObject | None:
        return _objects.load(self._conn, key)

    def sealed(self, key: ObjectKey) -> bool:
        if self._seals is None:
            self._seals = _seals(self._conn)
        return seals.covered(self._seals, key)

    def inherited_layer(self) -> str | None:
        automation = automation_of(self._meta)
        if automation is None:
            return None
        row = self._conn.execute(
            "SELECT layer FROM outcomes WHERE automation = ? AND layer IS NOT NULL"
            " AND (received_at, delivery_id) < (?, ?)"
            " ORDER BY received_at DESC, delivery_id DESC LIMIT 1",
            (automation, self._meta.received_at, self._meta.id),
        ).fetchone()
        return None if row is None else str(row[0])


class Store(_objects.ObjectDatabase):
    """The projection database. Methods may be called from worker threads."""

    MIGRATIONS = MIGRATIONS
    DAMAGED = (
        "it is rebuilt from the journal: move store.sqlite and its -wal and -shm"
        " files away, then `healthlog reindex` (or `serve`) folds the journal into a new one"
    )
    GOING_BACK = (
        "a newer healthlog wrote it; run that one again, or, to go back to this one, move"
        " store.sqlite and its -wal and -shm files away and run `healthlog reindex` (or start"
        " serve): this one folds the journal into a new store, losing nothing (followers then"
        " restore a snapshot once)"
    )

    # -- lease (L1) -------------------------------------------------------------------

    def acquire_lease(
        self,
        holder: str,
        *,
        now: int,
        ttl: int,
        force: bool = False,
        brief: bool = False,
        spare: Callable[[str], bool] = lambda current: False,
    ) -> int | None:
        """Take or renew the fold lease; return the epoch held, or None if someone else holds it.

        With ``brief`` it waits for the write lock at most ``BRIEF_WAIT_MS``, then raises
        :class:`Deferred`: a holder that renews again later anyway does not hold the store's
        reads behind it for the whole busy timeout while another process writes.

        ``force`` takes the lease from any other holder but an unexpired one ``spare`` names
        (a reindex still running, whose work a second reindex would throw away): it is decided
        in the same write transaction as the take-over, so two started at once cannot both
        take it.

        A takeover (a new holder, a lease another let expire, or ``force``) increments the
        epoch. The holder renews its own lease at the same epoch even once it has expired, as
        long as nobody took it meanwhile (the row still names it): no other writer can have
        folded in between, and a fold that held the write lock past the expiry is not fenced
        for it. An expiry further ahead than one term (the holder's or ours, whichever is
        longer) was written by a clock that has since jumped back: it is cut to one term from
        now, so a dead holder's lease frees within a term, while a live holder keeps it by
        renewing. A holder whose process is known to have ended (:func:`holders.ended`: killed
        on this machine, in its pid namespace or in a container's) holds nothing: its lease is
        taken over at once, not once it expires.
        """
        waiting = self._waiting_at_most(BRIEF_WAIT_MS) if brief else contextlib.nullcontext()
        with self._lock, waiting, write_transaction(self._conn):
            current, epoch, expires_at, term = self._conn.execute(
                "SELECT holder, epoch, expires_at, term FROM lease WHERE name = ?", (FOLD_LEASE,)
            ).fetchone()
            if current == holder and not force:
                self._conn.execute(
                    "UPDATE lease SET expires_at = ?, term = ? WHERE name = ?",
                    (now + ttl, ttl, FOLD_LEASE),
                )
                return int(epoch)
            held = current is not None and current != holder and expires_at > now
            if held and holders.ended(current, Path(self.path).parent):
                log.info(
                    "fold lease of %s taken over before it expires: that process has ended"
                    " (killed by SIGKILL, the out-of-memory killer or a power cut)",
                    current,
                )
                held = False
            if held and force and spare(current):
                return None
            if held and not force:
                longest = max(term, ttl)
                if expires_at > now + longest:
                    log.warning(
                        "fold lease expires %.1f s ahead, beyond its term: cut to %.1f s",
                        (expires_at - now) / 1e6,
                        longest / 1e6,
                    )
                    self._conn.execute(
                        "UPDATE lease SET expires_at = ? WHERE name = ?",
                        (now + longest, FOLD_LEASE),
                    )
                return None
            self._conn.execute(
                "UPDATE lease SET holder = ?, epoch = epoch + 1, expires_at = ?, term = ?"
                " WHERE name = ?",
                (holder, now + ttl, ttl, FOLD_LEASE),
            )
            return int(epoch) + 1

    def release_lease(self, holder: str, epoch: int) -> None:
        """Give the lease up if it is still ours at that epoch."""
        with self._lock, write_transaction(self._conn):
            self._conn.execute(
                "UPDATE lease SET holder = NULL, expires_at = 0"
                " WHERE name = ? AND holder = ? AND epoch = ?",
                (FOLD_LEASE, holder, epoch),
            )

    def lease(self) -> Lease:
        with self._lock:
            holder, epoch, expires_at = self._conn.execute(
                "SELECT holder, epoch, expires_at FROM lease WHERE name = ?", (FOLD_LEASE,)
            ).fetchone()
        return Lease(holder, int(epoch), int(expires_at))

    # -- folding (S10, F2, F9, F10, L2) ---------------------------------------------------

    def fold(
        self,
        journal: Journal,
        meta: DeliveryMeta,
        epoch: int,
        *,
        guard: bool = True,
        check_budget: Callable[[], None] = lambda: None,
    ) -> FoldReport:
        """Fold one journaled delivery in one transaction under the lease epoch ``epoch``.

        ``guard`` off is a rebuild: no out-of-order check (F9), and collisions are noted at
        DEBUG since the live fold already warned about them.
        """
        try:
            body = journal.read_body(meta.id)
        except Deferred:
            return FoldReport(meta.id, OutcomeClass.DEFERRED)
        except CorruptBody:
            log.error("delivery %d: %s", meta.id, BODY_CORRUPT)
            return self.fail(meta, epoch, BODY_CORRUPT, live=guard)
        except StorageError as exc:
            log.warning("delivery %d: body not readable: %s", meta.id, describe(exc))
            return FoldReport(meta.id, OutcomeClass.UNWRITTEN, reason=describe(exc))
        except Exception as exc:
            # No memory to inflate a large body, say: failed like a fold that breaks, or the
            # queue would stop at it for good.
            log.error("delivery %d: body not read: %s", meta.id, type(exc).__name__)
            return self.fail(meta, epoch, f"internal error: {type(exc).__name__}", live=guard)
        try:
            with self._lock:
                return self._fold_locked(meta, body, epoch, guard, check_budget)
        except Deferred:
            return FoldReport(meta.id, OutcomeClass.DEFERRED)
        except Fenced:
            log.warning("delivery %d: fold fenced, lease epoch %d lost", meta.id, epoch)
            return FoldReport(meta.id, OutcomeClass.FENCED)
        except BudgetExceeded:
            return self.fail(meta, epoch, OVER_BUDGET, live=guard)
        except StorageError as exc:
            log.warning("delivery %d: fold not written: %s", meta.id, describe(exc))
            return FoldReport(meta.id, OutcomeClass.UNWRITTEN, reason=describe(exc))
        except Exception as exc:
            log.error("delivery %d: fold failed: %s", meta.id, type(exc).__name__)
            return self.fail(meta, epoch, f"internal error: {type(exc).__name__}", live=guard)

    def _fold_locked(
        self,
        meta: DeliveryMeta,
        body: bytes,
        epoch: int,
        guard: bool,
        check_budget: Callable[[], None],
    ) -> FoldReport:
        conn = self._conn
        with write_transaction(conn):
            faults.point("fold.begin")
            self._check_epoch(epoch)
            if self._folded(meta.id):
                return self._report_existing(meta.id)
            later = guard and self._later_folded(meta)
            late: list[float] = []
            seal = seals.is_seal(meta.client, meta.content_type)
            if seal:
                outcome = self._seal(meta, body, live=guard)
            else:
                fold = DeliveryFold(
                    body,
                    DeliveryInfo(meta.id, meta.received_at, meta.automation_aggregation),
                    _Projection(conn, meta),
                    check_budget,
                    warn=guard,
                )
                del body
                for n, written in enumerate(fold.writes(), start=1):
                    faults.point("fold.object_write")
                    self._write_object(written)
                    event = _object_event(written.key, written.hash, written.count, meta.id)
                    self._event(f"{meta.id}.{n}", event)
                    # Late once a seal could have covered it (a daily total: 25 h on), so
                    # that the histogram tells how far back a seal reaches (SEAL-26).
                    after = meta.received_at - (written.key.hour + seals.span(written.key.layer))
                    if after > 0:
                        late.append(after / 1_000_000)
                assert fold.outcome is not None
                outcome = fold.outcome
            self._write_outcome(meta, outcome, epoch)
            faults.point("fold.before_commit")
        if not seal:
            _log_folded(meta.id, outcome, live=guard)
        if later:
            waited = max(0, clock.now_us() - meta.journaled_at) // 1_000_000
            log.warning(
                "delivery %d folded after a later delivery (waited %d s): the projection no"
                " longer follows journal order; run `healthlog reindex`",
                meta.id,
                waited,
            )
        try:
            faults.point("fold.after_commit")
        except Exception as exc:
            log.warning("delivery %d: fault after commit: %s", meta.id, type(exc).__name__)
        return FoldReport(
            meta.id, OutcomeClass.DONE, outcome.status, outcome.reason, later, tuple(late)
        )

    def _seal(self, meta: DeliveryMeta, body: bytes, *, live: bool) -> Outcome:
        """Fold a journaled seal: record it and mark the stored objects it covers, each with
        an ``object.changed`` event. Its counters stay zero, whatever it marked, so that a
        rebuild's outcome does not depend on which objects a partition had folded by then.
        The count marked is logged at INFO by the live folder, at DEBUG by a rebuild."""
        try:
            seal = seals.decode(body)
        except SealError as exc:
            return Outcome(FAILED, str(exc), None, Counters())
        self._record_seal(meta.id, seal)
        marked = self._mark_sealed(seal)
        for n, (metric, layer, hour, digest, count) in enumerate(sorted(marked), start=1):
            event = _object_event(ObjectKey(metric, layer, hour), digest, count, meta.id)
            self._event(f"{meta.id}.{n}", event)
        level = logging.INFO if live else logging.DEBUG
        log.log(level, "seal %d folded: %d stored objects sealed", meta.id, len(marked))
        return Outcome(PARSED, None, None, Counters())

    def _record_seal(self, delivery_id: int, seal: Seal) -> None:
        """Keep ``seal`` in the ``seals`` table in place of those of its metric and layer that
        end no later (it covers all they cover), unless one there ends later (SEAL-18): one row
        per metric and layer, however many seals a nightly ``healthlog seal`` journals, since
        every fold reads the table and checks each object it writes against each row."""
        group = (seal.metric, seal.layer, seal.before)
        self._conn.execute(
            "DELETE FROM seals WHERE metric IS ? AND layer IS ? AND before <= ?", group
        )
        self._conn.execute(
            "INSERT INTO seals (delivery_id, before, metric, layer) SELECT ?, ?, ?, ?"
            " WHERE NOT EXISTS (SELECT 1 FROM seals WHERE metric IS ? AND layer IS ?)",
            (delivery_id, seal.before, seal.metric, seal.layer, seal.metric, seal.layer),
        )

    def seal_covered(self, epoch: int) -> None:
        """Mark every object that a recorded seal covers (a partitioned rebuild, whose
        partitions are gathered after the seals were folded)."""
        with self._lock, write_transaction(self._conn):
            self._check_epoch(epoch)
            for seal in _seals(self._conn):
                self._mark_sealed(seal)

    def _mark_sealed(self, seal: Seal) -> list[tuple[str, str, int, bytes, int]]:
        """Set ``sealed`` on the stored objects ``seal`` covers (``Seal.covers`` in SQL) that
        lack it; their metric, layer, hour, hash and points."""
        return self._conn.execute(
            MARK_SEALED, {"before": seal.before, "metric": seal.metric, "layer": seal.layer}
        ).fetchall()

    def fail(self, meta: DeliveryMeta, epoch: int, reason: str, *, live: bool = True) -> FoldReport:
        """Record ``meta`` failed with ``reason`` and no points, under lease epoch ``epoch``,
        unless it has an outcome already; reported as a fold attempt is. ``live`` off is a
        rebuild, which logs the outcome at DEBUG."""
        outcome = Outcome(status=FAILED, reason=reason, layer=None, counters=Counters())
        try:
            with self._lock, write_transaction(self._conn):
                self._check_epoch(epoch)
                if self._folded(meta.id):
                    return self._report_existing(meta.id)
                self._write_outcome(meta, outcome, epoch)
        except Deferred:
            return FoldReport(meta.id, OutcomeClass.DEFERRED)
        except Fenced:
            return FoldReport(meta.id, OutcomeClass.FENCED)
        except StorageError as exc:
            log.warning("delivery %d: outcome not written: %s", meta.id, describe(exc))
            return FoldReport(meta.id, OutcomeClass.UNWRITTEN, reason=describe(exc))
        _log_folded(meta.id, outcome, live=live)
        return FoldReport(meta.id, OutcomeClass.DONE, FAILED, reason)

    def _check_epoch(self, epoch: int) -> None:
        row = self._conn.execute("SELECT epoch FROM lease WHERE name = ?", (FOLD_LEASE,)).fetchone()
        if row[0] != epoch:
            raise Fenced(f"lease epoch is {row[0]}, fold started under {epoch}")

    def _folded(self, delivery_id: int) -> bool:
        row = self._conn.execute(
            "SELECT 1 FROM outcomes WHERE delivery_id = ?", (delivery_id,)
        ).fetchone()
        return row is not None

    def _report_existing(self, delivery_id: int) -> FoldReport:
        status, reason = self._conn.execute(
            "SELECT status, reason FROM outcomes WHERE delivery_id = ?", (delivery_id,)
        ).fetchone()
        return FoldReport(delivery_id, OutcomeClass.DONE, status, reason)

    def _later_folded(self, meta: DeliveryMeta) -> bool:
        """Whether a delivery later in journal order has an outcome that folding ``meta``
        first could have changed: one with points stored, or one of the same automation failed
        for want of a layer that ``meta`` could have passed on (P5)."""
        # The reason starts with NO_LAYER, followed by "; " and the body's other problems if any.
        row = self._conn.execute(
            "SELECT 1 FROM outcomes WHERE (received_at, delivery_id) > (?, ?)"
            " AND (status IN ('parsed', 'partial') OR (status = 'failed' AND automation = ?"
            " AND (reason = ? OR substr(reason, 1, ?) = ?))) LIMIT 1",
            (
                meta.received_at,
                meta.id,
                automation_of(meta),
                NO_LAYER,
                len(NO_LAYER) + 2,
                f"{NO_LAYER}; ",
            ),
        ).fetchone()
        return row is not None

    def _write_object(self, obj: HourlyObject) -> None:
        self._conn.execute(
            "INSERT INTO objects (metric, layer, hour, units, first, last, points, created_by,"
            " hash, sealed, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (metric, layer, hour) DO UPDATE SET units = excluded.units,"
            " first = excluded.first, last = excluded.last, points = excluded.points,"
            " hash = excluded.hash, body = excluded.body",
            (
                obj.key.metric,
                obj.key.layer,
                obj.key.hour,
                obj.units,
                obj.first,
                obj.last,
                obj.count,
                obj.created_by,
                obj.hash,
                int(obj.sealed),
                obj.body,
            ),
        )

    def _write_outcome(self, meta: DeliveryMeta, outcome: Outcome, epoch: int) -> None:
        faults.point("fold.outcome_write")
        counters: dict[str, int] = converter.unstructure(outcome.counters)
        self._conn.execute(
            "INSERT INTO outcomes (delivery_id, received_at, automation, status, reason, layer,"
            " counters, epoch) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                meta.id,
                meta.received_at,
                automation_of(meta),
                outcome.status,
                outcome.reason,
                outcome.layer,
                dumps(counters).decode(),
                epoch,
            ),
        )
        self._conn.executemany(
            "INSERT INTO counter_totals (name, total) VALUES (?, ?)"
            " ON CONFLICT (name) DO UPDATE SET total = total + excluded.total",
            [(name, value) for name, value in counters.items() if value],
        )
        changed = self._conn.execute(
            "UPDATE checkpoint SET received_at = ?, delivery_id = ?, epoch = ?,"
            " outcomes = outcomes + 1, outcome_ids = outcome_ids + ? WHERE id = 1"
            " AND (SELECT epoch FROM lease WHERE name = ?) = ?",
            (meta.received_at, meta.id, epoch, meta.id, FOLD_LEASE, epoch),
        ).rowcount
        if changed != 1:
            raise Fenced(f"checkpoint not written under epoch {epoch}")
        self._event(f"{meta.id}.folded", DeliveryFolded(meta.id, outcome.status, counters))

    def _event(self, event_id: str, event: ObjectChanged | DeliveryFolded) -> None:
        self._conn.execute(
            f"INSERT INTO events (id, kind, payload, at, tag) VALUES (?, ?, ?, ?, {EVENT_TAG})",
            (event_id, event.KIND, dumps(event).decode(), clock.now_us()),
        )

    def _events(self, events: Iterable[tuple[str, ObjectChanged | DeliveryFolded]]) -> None:
        """:meth:`_event` of each of ``events`` (id, event), in order, in one statement."""
        self._conn.executemany(
            f"INSERT INTO events (id, kind, payload, at, tag) VALUES (?, ?, ?, ?, {EVENT_TAG})",
            (
                (event_id, event.KIND, dumps(event).decode(), clock.now_us())
                for event_id, event in events
            ),
        )

    # -- rebuild swap (L3) ------------------------------------------------------------------

    def bodies_lost(self, rebuilt: str | os.PathLike[str]) -> list[int]:
        """The deliveries this store folded (parsed or partial) that the store at ``rebuilt``
        failed because their journaled bodies no longer match their sha256 (STORE-56): this
        store holds what the journal has lost of them, which a swap would drop."""
        conn = connect(rebuilt, readonly=True, busy_timeout_ms=self._busy_timeout_ms)
        try:
            failed = [
                row[0]
                for row in conn.execute(
                    "SELECT delivery_id FROM outcomes WHERE status = 'failed' AND reason = ?",
                    (BODY_CORRUPT,),
                )
            ]
        finally:
            conn.close()
        if not failed:
            return []
        with self._lock:
            return [
                delivery_id
                for delivery_id in failed
                if self._conn.execute(
                    "SELECT 1 FROM outcomes WHERE delivery_id = ? AND status != 'failed'",
                    (delivery_id,),
                ).fetchone()
            ]

    def swap_in(self, rebuilt: str | os.PathLike[str], epoch: int) -> int:
        """Replace objects, outcomes and checkpoint with a rebuilt store's, in one transaction.

        Only under the lease epoch ``epoch``, which the swapped outcomes then carry. Appends an
        ``object.changed`` event for every object whose row differs in any column (a repaired
        body under the same hash too: a follower's replica copies the row; a vanished object
        reports zero points) and a ``delivery.folded`` event for every delivery only the
        rebuild folded or whose status it changed; returns the number of objects changed.
        The advice of a reindex (``REINDEX_MARK``) goes with the objects it was about.
        """
        with self._lock:
            self._conn.execute("ATTACH DATABASE ? AS rebuilt", (os.fspath(rebuilt),))
            try:
                with write_transaction(self._conn):
                    self._check_epoch(epoch)
                    # Kept in a temporary table, not in memory: into an empty store (a
                    # restore) every object changes, 439,008 of them for 2.5 years.
                    self._conn.execute("DROP TABLE IF EXISTS temp.changed")
                    self._conn.execute(
                        "CREATE TEMP TABLE changed AS"
                        " SELECT metric, layer, hour, hash, points FROM rebuilt.objects n"
                        f" WHERE NOT EXISTS (SELECT 1 FROM main.objects o WHERE {_SAME_ROW})"
                        " UNION ALL"
                        " SELECT metric, layer, hour, NULL, 0 FROM main.objects o"
                        " WHERE NOT EXISTS (SELECT 1 FROM rebuilt.objects n WHERE o.metric ="
                        " n.metric AND o.layer = n.layer AND o.hour = n.hour)"
                    )
                    # Those only the rebuild folded, and those whose status it changed (a
                    # parser fix, a layer a backfill passed on, a fold given up over its budget):
                    # a subscriber that keeps the deliveries' statuses learns the new one.
                    refolded = self._conn.execute(
                        "SELECT n.delivery_id, n.status, n.counters FROM rebuilt.outcomes n"
                        " LEFT JOIN main.outcomes o ON o.delivery_id = n.delivery_id"
                        " WHERE o.status IS NOT n.status ORDER BY n.received_at, n.delivery_id"
                    ).fetchall()
                    # Only rows that differ are written: after a rebuild most are equal, and
                    # rewriting every object would copy the whole store through the WAL. They
                    # are the rows just found, written by their keys rather than compared
                    # once more, column by column (STORE-43); a vanished one has no hash.
                    self._conn.execute(
                        "DELETE FROM main.objects WHERE (metric, layer, hour) IN"
                        " (SELECT metric, layer, hour FROM temp.changed WHERE hash IS NULL)"
                    )
                    self._conn.execute(
                        "INSERT OR REPLACE INTO main.objects SELECT n.* FROM temp.changed k"
                        " JOIN rebuilt.objects n USING (metric, layer, hour)"
                        " WHERE k.hash IS NOT NULL"
                    )
                    # The objects are a rebuild's now, folded by this healthlog's rules.
                    self._conn.execute("DELETE FROM main.marks WHERE key = ?", (REINDEX_MARK,))
                    self._conn.execute("DELETE FROM main.seals")
                    self._conn.execute("INSERT INTO main.seals SELECT * FROM rebuilt.seals")
                    self._conn.execute("DELETE FROM main.outcomes")
                    self._conn.execute(
                        "INSERT INTO main.outcomes SELECT delivery_id, received_at, automation,"
                        " status, reason, layer, counters, ? FROM rebuilt.outcomes",
                        (epoch,),
                    )
                    self._conn.execute("DELETE FROM main.counter_totals")
                    self._conn.execute(
                        "INSERT INTO main.counter_totals SELECT * FROM rebuilt.counter_totals"
                    )
                    self._conn.execute(
                        "UPDATE main.checkpoint SET (received_at, delivery_id, epoch, outcomes,"
                        " outcome_ids) = (SELECT received_at, delivery_id, ?, outcomes,"
                        " outcome_ids FROM rebuilt.checkpoint)",
                        (epoch,),
                    )
                    (changed,) = self._conn.execute("SELECT count(*) FROM temp.changed").fetchone()
                    # Closed however the writing ends: a read left open when a write fails
                    # (a full disk) kept ``rebuilt`` from being detached, which hid the
                    # failure and refused every later swap on this connection (STORE-54).
                    with contextlib.closing(
                        self._conn.execute(
                            "SELECT metric, layer, hour, hash, points FROM temp.changed"
                            " ORDER BY rowid"
                        )
                    ) as rows:
                        self._events(
                            (
                                f"reindex.{epoch}.{n}",
                                _object_event(ObjectKey(metric, layer, hour), digest, count, None),
                            )
                            for n, (metric, layer, hour, digest, count) in enumerate(rows, start=1)
                        )
                    self._conn.execute("DROP TABLE temp.changed")
                    for delivery_id, status, counters in refolded:
                        self._event(
                            f"reindex.{epoch}.{delivery_id}.folded",
                            DeliveryFolded(delivery_id, status, orjson.loads(counters)),
                        )
            finally:
                self._conn.execute("DETACH DATABASE rebuilt")
        return int(changed)

    def record_outcomes(self, folded: Sequence[tuple[DeliveryMeta, Outcome]], epoch: int) -> None:
        """Record outcomes a partitioned rebuild put together, in journal order, as its folds
        would have (outcome, checkpoint, ``delivery.folded`` event), in one fenced transaction."""
        with self._lock, write_transaction(self._conn):
            self._check_epoch(epoch)
            for meta, outcome in folded:
                self._write_outcome(meta, outcome, epoch)

    def absorb_objects(self, part: str | os.PathLike[str], epoch: int) -> None:
        """Copy every object of a rebuild partition's file (the store's schema) into this store."""
        with self._lock:
            self._conn.execute("ATTACH DATABASE ? AS part", (os.fspath(part),))
            try:
                with write_transaction(self._conn):
                    self._check_epoch(epoch)
                    self._conn.execute(
                        f"INSERT INTO main.objects ({_objects.COLUMNS})"
                        f" SELECT {_objects.COLUMNS} FROM part.objects"
                    )
            finally:
                self._conn.execute("DETACH DATABASE part")

    # -- reads ----------------------------------------------------------------------------

    def folded_ids(self) -> set[int]:
        with self._lock:
            return {row[0] for row in self._conn.execute("SELECT delivery_id FROM outcomes")}

    def unfolded(self, delivery_ids: Iterable[int]) -> set[int]:
        """Those of ``delivery_ids`` without an outcome, each looked up by its key: a wait for
        a few deliveries reads those, not every outcome (FOLD-19)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT value FROM json_each(?) WHERE NOT EXISTS"
                " (SELECT 1 FROM outcomes WHERE delivery_id = value)",
                (orjson.dumps(sorted(set(delivery_ids))).decode(),),
            )
            return {int(row[0]) for row in rows}

    def folded_view(
        self, agrees: Callable[[tuple[int, int], tuple[int, int]], bool], *, counts: bool = False
    ) -> FoldedView:
        """Which deliveries have an outcome, and with ``counts`` how many of each status, read
        in one transaction.

        ``agrees(position, through)`` says whether the journal holds exactly ``through``
        (number, sum of ids) deliveries at or before the checkpoint's ``position``, as the
        outcomes do. If it does, only the ids after the checkpoint are read; otherwise every id.
        """
        with self._lock, read_transaction(self._conn):
            received_at, delivery_id, outcomes, outcome_ids = self._conn.execute(
                "SELECT received_at, delivery_id, outcomes, outcome_ids FROM checkpoint"
                " WHERE id = 1"
            ).fetchone()
            after = None if received_at is None else (int(received_at), int(delivery_id))
            if after is not None:
                # Those up to the checkpoint are every outcome but those after it: the kept
                # totals less a read of the few after it, not of every one before it.
                later, later_ids = self._conn.execute(
                    "SELECT count(*), coalesce(sum(delivery_id), 0) FROM outcomes"
                    " WHERE (received_at, delivery_id) > (?, ?)",
                    after,
                ).fetchone()
                through = (int(outcomes) - int(later), int(outcome_ids) - int(later_ids))
                if not agrees(after, through):
                    after = None
            if after is None:
                rows = self._conn.execute("SELECT delivery_id FROM outcomes")
            else:
                rows = self._conn.execute(
                    "SELECT delivery_id FROM outcomes WHERE (received_at, delivery_id) > (?, ?)",
                    after,
                )
            folded = frozenset(row[0] for row in rows)
            by_status = {}
            if counts:
                everything, listed = COUNT_QUERIES
                (total,) = self._conn.execute(everything).fetchone()
                by_status = {str(status): int(n) for status, n in self._conn.execute(listed)}
                by_status[PARSED] = int(total) - sum(by_status.values())
        return FoldedView(after, folded, by_status)

    def outcome(self, delivery_id: int) -> OutcomeRow | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT delivery_id, received_at, status, reason, layer, counters FROM outcomes"
                " WHERE delivery_id = ?",
                (delivery_id,),
            ).fetchone()
        if row is None:
            return None
        return OutcomeRow(row[0], row[1], row[2], row[3], row[4], orjson.loads(row[5]))

    def newest_outcomes(self, statuses: Sequence[str], limit: int) -> tuple[int, list[OutcomeRow]]:
        """How many recorded outcomes have one of ``statuses`` (of :data:`LISTED_OUTCOMES`),
        and the newest ``limit`` of them, last in journal order first, read in one transaction
        (so they agree), through the index ``outcomes_listed``."""
        (count, count_args), (newest, newest_args) = listing_queries(statuses, limit)
        with self._lock, read_transaction(self._conn):
            (total,) = self._conn.execute(count, count_args).fetchone()
            rows = self._conn.execute(newest, newest_args).fetchall()
        return int(total), [
            OutcomeRow(row[0], row[1], row[2], row[3], row[4], orjson.loads(row[5])) for row in rows
        ]

    def snapshot_into(self, path: str | os.PathLike[str]) -> tuple[set[int], dict[int, str]]:
        """The folded delivery ids and the reasons of those of them the machine gave up on
        (:data:`GIVEN_UP`), read in one transaction with the object summaries, which are
        copied row by row into table ``summaries`` of a new database at ``path`` (the columns
        of :data:`SUMMARY_COLUMNS`) rather than held in memory: a store of years holds
        hundreds of thousands of objects. The status and reason of each folded delivery are
        copied likewise, into table ``outcomes`` (STORE-83)."""
        target = connect(path, journal_mode="OFF")
        # The copy's own errors are classified and name its file: the live store is only read
        # (STORE-55). The rows are read a page at a time outside it, so that an error reading
        # them names the live store.
        copying = ConnectionGuard(path)
        try:
            with copying:
                target.execute(
                    "CREATE TABLE summaries (metric TEXT NOT NULL, layer TEXT NOT NULL,"
                    " hour INTEGER NOT NULL, units TEXT, points INTEGER NOT NULL,"
                    " hash BLOB NOT NULL, created_by INTEGER NOT NULL, sealed INTEGER NOT NULL,"
                    " PRIMARY KEY (metric, layer, hour)) WITHOUT ROWID"
                )
                target.execute(
                    "CREATE TABLE outcomes (delivery_id INTEGER PRIMARY KEY, status TEXT NOT NULL,"
                    " reason TEXT)"
                )
                target.execute("BEGIN")
            with self._lock, read_transaction(self._conn):
                folded: set[int] = set()
                outcomes = self._conn.execute("SELECT delivery_id, status, reason FROM outcomes")
                with contextlib.closing(outcomes):
                    while rows := outcomes.fetchmany(SUMMARIES_PAGE):
                        folded.update(row[0] for row in rows)
                        with copying:
                            target.executemany("INSERT INTO outcomes VALUES (?, ?, ?)", rows)
                given_up = self._given_up_locked()
                summaries = self._conn.execute(f"SELECT {SUMMARY_COLUMNS} FROM objects")
                with contextlib.closing(summaries):
                    while rows := summaries.fetchmany(SUMMARIES_PAGE):
                        with copying:
                            target.executemany(
                                "INSERT INTO summaries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows
                            )
            with copying:
                target.execute("COMMIT")
        finally:
            target.close()
        return folded, given_up

    def given_up(self) -> dict[int, str]:
        """The reasons of the deliveries failed for a cause of the machine's, not the journal's
        (:data:`GIVEN_UP`: over their time budget, F5; a fold worker that died; no memory)."""
        with self._lock:
            return self._given_up_locked()

    def _given_up_locked(self) -> dict[int, str]:
        rows = self._conn.execute(
            "SELECT delivery_id, reason FROM outcomes WHERE status = ? AND reason IN (?, ?, ?)",
            (FAILED, *GIVEN_UP),
        )
        return {row[0]: row[1] for row in rows}

    def counter_totals(self, names: Sequence[str]) -> dict[str, int]:
        """Fold counters summed over every recorded outcome, as the table ``counter_totals``
        keeps them (a row per counter, not a read of every outcome)."""
        with self._lock:
            rows = dict(self._conn.execute("SELECT name, total FROM counter_totals").fetchall())
        return {name: int(rows.get(name, 0)) for name in names}

    def checkpoint(self) -> tuple[int | None, int | None, int]:
        with self._lock:
            received_at, delivery_id, epoch = self._conn.execute(
                "SELECT received_at, delivery_id, epoch FROM checkpoint WHERE id = 1"
            ).fetchone()
        return received_at, delivery_id, int(epoch)

    def mark(self, key: str) -> Any:
        with self._lock:
            row = self._conn.execute("SELECT value FROM marks WHERE key = ?", (key,)).fetchone()
        return None if row is None else orjson.loads(row[0])

    def reindex_advised(self) -> list[str]:
        """Why a reindex is advised (codes of ``REINDEX_REASONS``): empty unless a migration
        found objects an older healthlog folded otherwise, and no reindex has run since."""
        return [str(code) for code in self.mark(REINDEX_MARK) or []]

    def set_mark(self, key: str, value: Any) -> None:
        """Write a mark, waiting at most ``BRIEF_WAIT_MS`` for the write lock (:class:`Deferred`
        then): marks are written again at every pass's end."""
        with self._lock, self._waiting_at_most(BRIEF_WAIT_MS), write_transaction(self._conn):
            self._conn.execute(
                "INSERT INTO marks (key, value) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, orjson.dumps(value).decode()),
            )

    def subscribers(self) -> dict[str, int]:
        return {name: acked for name, (acked, _) in self.subscriber_acks().items()}

    def subscriber_acks(self) -> dict[str, tuple[int, int]]:
        """Each named subscriber's stored cursor and when its last ACK was stored (µs)."""
        with self._lock:
            rows = self._conn.execute("SELECT name, acked, acked_at FROM subscribers")
            return {str(n): (int(a), int(t)) for n, a, t in rows}

    # -- change events and subscribers (R1 to R5) -------------------------------------------

    def stream_id(self) -> str:
        """The name of this store's event stream; a new store file starts a new stream."""
        return str(self.mark("stream"))

    def events_after(self, after: int, limit: int) -> list[Event]:
        """Up to ``limit`` events with ``seq > after``, in sequence order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT seq, id, kind, payload, tag FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
        return [
            Event(seq, event_id, kind, orjson.loads(payload), tag)
            for seq, event_id, kind, payload, tag in rows
        ]

    def event_tag(self, seq: int) -> tuple[bool, bool, str | None]:
        """Whether the event ``seq`` is held (not pruned, not beyond the head), whether its tag
        is known (held, or the last event pruned, :data:`PRUNED_MARK`), and that tag (None for
        one written before events had tags)."""
        with self._lock:
            row = self._conn.execute("SELECT tag FROM events WHERE seq = ?", (seq,)).fetchone()
            pruned = (
                None
                if row is not None
                else self._conn.execute(
                    "SELECT value FROM marks WHERE key = ?", (PRUNED_MARK,)
                ).fetchone()
            )
        if row is not None:
            return True, True, row[0]
        if pruned is not None:
            last = orjson.loads(pruned[0])
            if last["seq"] == seq:
                return False, True, last["tag"]
        return False, False, None

    def replay_page(
        self, after: int, limit: int, max_bytes: int
    ) -> list[tuple[Event, HourlyObject | None]]:
        """Up to ``limit`` events with ``seq > after`` in sequence order, each with the current
        state of the object an ``object.changed`` event names (None when it no longer exists,
        and for other kinds), read in one statement: one snapshot, one trip to this thread.

        The page ends early once the object bodies read reach ``max_bytes`` (at least one
        event), so a page of large objects stays bounded. The event names its hour as ISO
        text, the objects table in microseconds; an unreadable hour matches no object.
        """
        rows = []
        size = 0
        with self._lock:
            cursor = self._conn.execute(
                "SELECT e.seq, e.id, e.kind, e.payload, e.tag, o.metric, o.layer, o.hour, o.units,"
                " o.body, o.hash, o.first, o.last, o.points, o.created_by, o.sealed"
                " FROM events AS e LEFT JOIN objects AS o ON e.kind = 'object.changed'"
                " AND o.metric = json_extract(e.payload, '$.metric')"
                " AND o.layer = json_extract(e.payload, '$.layer')"
                " AND o.hour = CAST(strftime('%s', json_extract(e.payload, '$.hour')) AS INTEGER)"
                " * 1000000"
                " WHERE e.seq > ? ORDER BY e.seq LIMIT ?",
                (after, limit),
            )
            try:
                for row in cursor:
                    rows.append(row)
                    size += len(row[9] or b"")  # o.body, None when no object matched
                    if size >= max_bytes:
                        break
            finally:
                cursor.close()
        return [
            (
                Event(seq, event_id, kind, orjson.loads(payload), tag),
                None if state[0] is None else _objects.row_to_object(state),
            )
            for seq, event_id, kind, payload, tag, *state in rows
        ]

    def event_window(self) -> tuple[int, int]:
        """(oldest retained seq - 1, head seq): a cursor in that range can be replayed.

        One statement, so one snapshot: with no events left (all pruned) the head is the last
        sequence handed out, and an event committed meanwhile cannot make the window look
        pruned up to it. Each end is a subquery of its own, which SQLite answers from one end
        of the key; ``min`` and ``max`` in one SELECT read every event instead (82 ms at
        442,656 events), and the stream's hub reads the window ten times a second while a
        follower waits.
        """
        with self._lock:
            oldest, head, issued = self._conn.execute(
                "SELECT (SELECT min(seq) FROM events), (SELECT max(seq) FROM events),"
                " (SELECT seq FROM sqlite_sequence WHERE name = 'events')"
            ).fetchone()
        if head is None:
            return int(issued or 0), int(issued or 0)
        return int(oldest) - 1, int(head)

    def oldest_event_ahead(self, now: int) -> int | None:
        """The stamp of the oldest event held, if it lies more than ``FUTURE_SKEW_US`` after
        ``now``, else None. Every other event was stamped after it, so a clock that reads that
        far behind it is not to be trusted with ages: a NAS without a battery-backed clock
        boots at 1970 (or at its build date) and serves until NTP sets it, and every event
        then looks more than a day ahead and so old (:meth:`prune_events`)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT at FROM events WHERE seq = (SELECT min(seq) FROM events)"
            ).fetchone()
        if row is None or row[0] <= now + FUTURE_SKEW_US:
            return None
        return int(row[0])

    def prune_events(
        self, *, keep: int, older_than_us: int, at_most: int | None = None, brief: bool = False
    ) -> int:
        """Drop events outside the online window: beyond the newest ``keep`` and older than
        the given instant, and only ever the oldest ones: an event stamped after a clock
        stepped back can look older than one before it, and what is left must stay one run of
        sequences (a replay never skips). An event stamped more than ``FUTURE_SKEW_US`` after
        now (while the clock had jumped forward) does not count as young, or nothing after it
        would be dropped for years. The price: after a clock that ran more than a day fast is
        set right, the events stamped meanwhile count as old, and only the newest ``keep`` of
        them stay (a follower behind them restores a snapshot). The journal is never touched.
        With ``at_most``, only the oldest that many sequences are dropped (STORE-88): every
        page a transaction frees goes to the ``-wal``, and dropping a reindex's worth of events
        at once (321,000) wrote a 137 MB one. The seq and tag of the last event dropped are kept
        (:data:`PRUNED_MARK`, in the same transaction), so that a subscriber whose cursor is that
        event's is still checked against it (STREAM-123). With ``brief`` it waits for the write
        lock at most ``BRIEF_WAIT_MS``, then raises :class:`Deferred` (RUN-74). Returns how many
        were dropped."""
        waiting = self._waiting_at_most(BRIEF_WAIT_MS) if brief else contextlib.nullcontext()
        with self._lock, waiting, write_transaction(self._conn):
            last = self._conn.execute(
                "SELECT seq, tag FROM events WHERE seq <= (SELECT max(seq) FROM events) - ?"
                " AND seq < coalesce("
                "(SELECT min(seq) FROM events WHERE at >= ? AND at <= ?), 1 << 62)"
                " AND seq < (SELECT min(seq) FROM events) + ? ORDER BY seq DESC LIMIT 1",
                (
                    keep,
                    older_than_us,
                    clock.now_us() + FUTURE_SKEW_US,
                    (1 << 62) if at_most is None else at_most,
                ),
            ).fetchone()
            if last is None:
                return 0
            self._conn.execute(
                "INSERT INTO marks (key, value) VALUES (?, ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (PRUNED_MARK, orjson.dumps({"seq": last[0], "tag": last[1]}).decode()),
            )
            return self._conn.execute("DELETE FROM events WHERE seq <= ?", (last[0],)).rowcount

    def remove_gone_subscribers(self, *, older_than_us: int, brief: bool = False) -> int:
        """Remove the subscribers that are gone: whose last ACK is older than the given instant
        and whose cursor is older than the online window (:meth:`event_window`), so that they
        could only resume from a snapshot (``CURSOR_TOO_OLD``) anyway. As for events
        (:meth:`prune_events`), an ACK stamped more than ``FUTURE_SKEW_US`` after now (while the
        clock had jumped forward) does not count as recent. A removed subscriber's next ACK
        stores it again. With ``brief``, as for :meth:`prune_events`. Returns how many were
        removed."""
        waiting = self._waiting_at_most(BRIEF_WAIT_MS) if brief else contextlib.nullcontext()
        with self._lock, waiting, write_transaction(self._conn):
            return self._conn.execute(
                "DELETE FROM subscribers WHERE acked < coalesce("
                "(SELECT min(seq) - 1 FROM events),"
                " (SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)"
                " AND NOT (acked_at >= ? AND acked_at <= ?)",
                (older_than_us, clock.now_us() + FUTURE_SKEW_US),
            ).rowcount

    def ack(self, subscriber: str, seq: int) -> int:
        """Store a subscriber's durable cursor, only ever moving forward, and the time of this
        ACK (which keeps it from being removed as gone); returns the stored cursor.

        It waits for the write lock at most ``BRIEF_WAIT_MS`` (longer than a fold's commit),
        then raises :class:`Deferred`: the stream tries again later."""
        with self._lock, self._waiting_at_most(BRIEF_WAIT_MS), write_transaction(self._conn):
            self._conn.execute(
                "INSERT INTO subscribers (name, acked, acked_at) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET acked = max(acked, excluded.acked),"
                " acked_at = excluded.acked_at",
                (subscriber, seq, clock.now_us()),
            )
            return int(
                self._conn.execute(
                    "SELECT acked FROM subscribers WHERE name = ?", (subscriber,)
                ).fetchone()[0]
            )

    def object(self, key: ObjectKey) -> HourlyObject | None:
        with self._lock:
            return _objects.load(self._conn, key)

    @contextlib.contextmanager
    def snapshot_at_head(self) -> Iterator[HeadSnapshot]:
        """Every object and the head sequence they reflect, read in one transaction on a
        connection of its own: WAL lets it read beside the store's writes, and the store's
        other reads do not wait for it. The objects are read one at a time while the block
        runs."""
        conn = connect(self.path, readonly=True, busy_timeout_ms=self._busy_timeout_ms)
        try:
            with read_transaction(conn):
                head = conn.execute(
                    "SELECT s.seq, e.tag FROM sqlite_sequence AS s"
                    " LEFT JOIN events AS e ON e.seq = s.seq WHERE s.name = 'events'"
                ).fetchone()
                (count,) = conn.execute("SELECT count(*) FROM objects").fetchone()
                rows = conn.execute(
                    f"SELECT {_objects.COLUMNS} FROM objects ORDER BY metric, layer, hour"
                )
                yield HeadSnapshot(
                    0 if head is None else int(head[0]),
                    int(count),
                    map(_objects.row_to_object, rows),
                    None if head is None else head[1],
                )
        finally:
            conn.close()

    @contextlib.contextmanager
    def objects_of_one_state(
        self,
        *,
        metric: str | None = None,
        layer: str | None = None,
        hour_from: int | None = None,
        hour_to: int | None = None,
    ) -> Iterator[Iterator[HourlyObject]]:
        """:meth:`iter_objects` from one read transaction on a connection of its own, as
        :meth:`snapshot_at_head` reads: a fold committed between two pages showed in the later
        pages alone, a state the store never held (SERVE-140). The store's own connection,
        which lease renewals and ACKs write through, keeps no read transaction open meanwhile,
        and its other reads do not wait for this one's reader (a slow HTTP client)."""
        conn = connect(self.path, readonly=True, busy_timeout_ms=self._busy_timeout_ms)
        try:
            with read_transaction(conn):
                yield _objects.iterate(
                    conn,
                    ConnectionGuard(self.path),
                    metric=metric,
                    layer=layer,
                    hour_from=hour_from,
                    hour_to=hour_to,
                )
        finally:
            conn.close()


def _object_event(
    key: ObjectKey, digest: bytes | None, points: int, delivery_id: int | None
) -> ObjectChanged:
    """The ``object.changed`` event of the object at ``key`` (no hash and 0 points: gone)."""
    return ObjectChanged(
        key.metric,
        key.layer,
        format_instant(key.hour),
        digest.hex() if digest is not None else None,
        points,
        delivery_id,
    )
