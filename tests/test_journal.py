"""The journal against real SQLite files (specs/journal.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import cast

import attrs
import orjson
import pytest
from _sqlite_steps import counted_steps
from fixtures import shuffled
from hypothesis import given, settings
from hypothesis import strategies as st

from healthlog.storage import _sqlite
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, Database, Deferred, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV
from healthlog.storage.journal import (
    CorruptBody,
    IdempotencyCollision,
    Journal,
    NewDelivery,
    Receipt,
)
from healthlog.storage.passes import waited_s
from healthlog.storage.replica import Replica
from healthlog.storage.store import Store
from healthlog.storage.tokens import Tokens
from healthlog.timestamps import format_instant
from healthlog.workload import big_body, encode

# What a process that opens a file loads first, as `serve` does: the plan in its environment.
LOAD_PLAN = "from healthlog.storage import faultplan; faultplan.load_environment()"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "journal.sqlite"


@pytest.fixture
def journal(path: Path) -> Iterator[Journal]:
    with Journal(path) as journal:
        yield journal


def raw(path: Path) -> closing[sqlite3.Connection]:
    """A second, plain connection to the same file, closed on leaving the ``with`` block."""
    return closing(sqlite3.connect(path, isolation_level=None))


def clock_of(*readings: int) -> Callable[[], int]:
    values = iter(readings)
    return lambda: next(values)


def delivery(body: bytes = b"{}", client: str = "phone", **fields: object) -> NewDelivery:
    # ``fields`` are NewDelivery's own keyword arguments, which ``object`` cannot say.
    return NewDelivery(body, client, **fields)  # type: ignore[arg-type]


def stored_encoding(path: Path, delivery_id: int) -> tuple[str, int]:
    with raw(path) as conn:
        encoding, size = conn.execute(
            "SELECT encoding, length(body) FROM deliveries WHERE id = ?", (delivery_id,)
        ).fetchone()
    return str(encoding), int(size)


def test_bodies_round_trip_verbatim_journal_1(journal: Journal) -> None:
    """JOURNAL-1: empty, invalid UTF-8 and 3 MiB bodies come back byte for byte, with metadata."""
    rng = random.Random(1)
    bodies = [b"", b"\xff\xfe\x80 not utf-8 \xc3\x28", rng.randbytes(3 * 1024 * 1024)]
    receipts = [
        journal.append(
            delivery(
                body,
                client="anton",
                content_type="application/json",
                automation_name="Hourly",
                automation_id="A-1",
                automation_aggregation="minutes",
                automation_period="Since Last Sync",
                session_id="S-9",
            )
        )
        for body in bodies
    ]
    for body, receipt in zip(bodies, receipts, strict=True):
        assert journal.read_body(receipt.delivery_id) == body
        assert receipt.sha256 == hashlib.sha256(body).hexdigest()
        assert receipt.bytes == len(body)
        meta = journal.get_meta(receipt.delivery_id)
        assert meta is not None
        assert (meta.id, meta.received_at, meta.sha256, meta.bytes) == (
            receipt.delivery_id,
            receipt.received_at,
            receipt.sha256,
            len(body),
        )
        assert (meta.content_type, meta.client, meta.session_id) == (
            "application/json",
            "anton",
            "S-9",
        )
        assert (
            meta.automation_name,
            meta.automation_id,
            meta.automation_aggregation,
            meta.automation_period,
        ) == ("Hourly", "A-1", "minutes", "Since Last Sync")


def test_any_bytes_round_trip_journal_1(tmp_path: Path) -> None:
    """JOURNAL-1: arbitrary bodies, compressed or not, read back verbatim."""
    with Journal(tmp_path / "j.sqlite", compress_min_bytes=16) as journal:

        @settings(max_examples=40, deadline=None)
        @given(st.binary(max_size=4096))
        def round_trip(body: bytes) -> None:
            receipt = journal.append(delivery(body))
            assert journal.read_body(receipt.delivery_id) == body

        round_trip()


def test_compression_above_threshold_journal_2(path: Path, journal: Journal) -> None:
    """JOURNAL-2: bodies from compress_min_bytes on are stored zlib-compressed, smaller ones not."""
    big = b'{"name":"heart_rate","qty":72},' * 64
    at_threshold = big[:1024]
    below = big[:1023]
    ids = [journal.append(delivery(body)).delivery_id for body in (big, at_threshold, below)]
    big_encoding, big_size = stored_encoding(path, ids[0])
    assert big_encoding == "zlib"
    assert big_size < len(big) // 4
    assert stored_encoding(path, ids[1])[0] == "zlib"
    assert stored_encoding(path, ids[2]) == ("identity", 1023)
    for body, delivery_id in zip((big, at_threshold, below), ids, strict=True):
        assert journal.read_body(delivery_id) == body


def test_ids_increase_and_are_never_reused_journal_3(path: Path) -> None:
    """JOURNAL-3: committed ids strictly increase, also across a rolled-back append."""

    def failing_clock() -> int:
        raise RuntimeError("clock failed")

    clock: list[Callable[[], int]] = [lambda: 1]
    handed_out: list[int] = []
    with Journal(path, clock=lambda: clock[0]()) as journal:
        handed_out += [journal.append(delivery()).delivery_id for _ in range(2)]
        clock[0] = failing_clock
        with pytest.raises(RuntimeError, match="clock failed"):
            journal.append_many([delivery(), delivery()])
        clock[0] = lambda: 2
        handed_out += [journal.append(delivery()).delivery_id for _ in range(2)]
    with Journal(path, clock=lambda: 3) as journal:
        handed_out.append(journal.append(delivery()).delivery_id)
        stored = [meta.id for meta in journal.iter_order()]
    assert handed_out == sorted(set(handed_out))
    assert stored == handed_out


def test_live_stamps_never_decrease_journal_4(path: Path) -> None:
    """JOURNAL-4: a clock jumping backwards never makes received_at decrease, across reopening."""
    with Journal(path, clock=clock_of(1_000, 2_000, 500, 400, 3_000)) as journal:
        stamps = [journal.append(delivery()).received_at for _ in range(5)]
    assert stamps == [1_000, 2_000, 2_000, 2_000, 3_000]
    with Journal(path, clock=clock_of(100, 3_500)) as journal:
        group = journal.append_many([delivery(), delivery()])
        assert [r.received_at for r in group if isinstance(r, Receipt)] == [3_000, 3_500]


def test_historical_stamps_journal_5(path: Path) -> None:
    """JOURNAL-5: backfill keeps its stamp, takes its place in order, never pulls stamps back."""
    # The clock is read for every delivery: a backfill's reading is when it was journaled.
    with Journal(path, clock=clock_of(10_000, 10_500, 9_000, 12_000, 11_000)) as journal:
        live = journal.append(delivery(b"live-1"))
        old = journal.append(delivery(b"old", received_at=5_000))
        after_old = journal.append(delivery(b"live-2"))
        future = journal.append(delivery(b"future", received_at=20_000))
        after_future = journal.append(delivery(b"live-3"))
        order = [(meta.received_at, meta.id) for meta in journal.iter_order()]
    assert (live.received_at, old.received_at, after_old.received_at) == (10_000, 5_000, 10_000)
    assert (future.received_at, after_future.received_at) == (20_000, 20_000)
    assert order == [
        (5_000, old.delivery_id),
        (10_000, live.delivery_id),
        (10_000, after_old.delivery_id),
        (20_000, future.delivery_id),
        (20_000, after_future.delivery_id),
    ]


def test_when_each_delivery_was_journaled_journal_45(path: Path) -> None:
    """JOURNAL-45: every delivery keeps when it was journaled, in the same insert: a live one
    its stamp, a backfill the live stamp of that instant (the clock, never behind the last live
    stamp), whatever its historical `received_at`; a backfill moves no live stamp; metadata
    read by id, by ids and in journal order says the same."""
    readings = (10_000, 12_000, 9_000, 13_000, 11_000, 14_000)
    with Journal(path, clock=clock_of(*readings)) as journal:
        live = journal.append(delivery(b"live-1"))
        old = journal.append(delivery(b"old", received_at=5_000))
        behind = journal.append(delivery(b"clock behind", received_at=6_000))
        group = journal.append_many(
            [delivery(b"live-2"), delivery(b"future", received_at=20_000), delivery(b"live-3")]
        )
        receipts = [live, old, behind, *(r for r in group if isinstance(r, Receipt))]
        ids = [r.delivery_id for r in receipts]
        by_id = journal.get_metas(ids)
        assert {i: journal.get_meta(i) for i in ids} == by_id
        assert {m.id: m for m in journal.iter_order()} == by_id
    stamps = [(by_id[i].received_at, by_id[i].journaled_at) for i in ids]
    assert stamps == [
        (10_000, 10_000),
        (5_000, 12_000),
        (6_000, 10_000),
        (13_000, 13_000),
        (20_000, 13_000),
        (20_000, 20_000),
    ]


OLD_COLUMNS = (
    "id, received_at, sha256, bytes, content_type, automation_name, automation_id,"
    " automation_aggregation, automation_period, session_id, client, idempotency_key,"
    " encoding, body"
)


def as_version_1(conn: sqlite3.Connection) -> None:
    """Make the journal open on ``conn`` one of schema version 1, before `journaled_at`."""
    conn.execute("DROP TABLE IF EXISTS unstamped_backfills")
    conn.execute("ALTER TABLE deliveries DROP COLUMN journaled_at")
    conn.execute("PRAGMA user_version = 1")


def test_a_journal_from_before_journaled_at_migrates_once_journal_46(path: Path) -> None:
    """JOURNAL-46: a journal of the schema before `journaled_at` (version 1): a process killed
    (SIGKILL) in the middle of its migration leaves it at version 1, whole, every row as it
    was; opened again, it is migrated to version 2, one step that rewrites no row (every
    column of every row reads the same), then 3 (JOURNAL-47), its live rows read `journaled_at`
    = `received_at`, its backfill the stamp before it (JOURNAL-47), and a delivery journaled
    then keeps when it was."""
    with Journal(path, clock=clock_of(1_000, 2_000, 3_000)) as journal:
        journal.append(delivery(b"live"))
        journal.append(delivery(b"x" * 5000, received_at=500, idempotency_key="k"))
        journal.append(delivery(b"\xff not json"))
    with raw(path) as conn:
        as_version_1(conn)
        rows = conn.execute(f"SELECT {OLD_COLUMNS} FROM deliveries ORDER BY id").fetchall()

    plan = json.dumps({"schema.migrate": {"hits": [1], "do": "kill"}})
    opening = f"from healthlog.storage.journal import Journal; Journal({str(path)!r})"
    killed = subprocess.run(
        [sys.executable, "-c", f"{LOAD_PLAN}; {opening}"],
        env={**os.environ, PLAN_ENV: plan},
        capture_output=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (1,)
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        columns = [row[1] for row in conn.execute("PRAGMA table_info(deliveries)")]
        assert "journaled_at" not in columns
        assert conn.execute(f"SELECT {OLD_COLUMNS} FROM deliveries ORDER BY id").fetchall() == rows

    with Journal(path, clock=clock_of(4_000)) as journal:
        metas = journal.iter_order()
        assert [(m.id, m.received_at, m.journaled_at) for m in metas] == [
            (2, 500, 1_000),
            (1, 1_000, 1_000),
            (3, 3_000, 3_000),
        ]
        assert journal.read_body(2) == b"x" * 5000
        added = journal.append(delivery(b"after", received_at=700))
        after = journal.get_meta(added.delivery_id)
        assert after is not None
        assert (after.received_at, after.journaled_at) == (700, 4_000)
    with raw(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (3,)
        assert (
            conn.execute(
                f"SELECT {OLD_COLUMNS} FROM deliveries WHERE id <= 3 ORDER BY id"
            ).fetchall()
            == rows
        )


def test_a_backfill_from_before_journaled_at_waits_since_the_stamp_before_it_journal_47(
    path: Path,
) -> None:
    """JOURNAL-47: in a journal from before `journaled_at`, a backfill reads as journaled at the
    latest stamp of the deliveries journaled before it, the earliest instant it can have been
    journaled (as the journal stamps one now, less the clock's reading, which it did not keep);
    any other delivery reads its `received_at`. The lag of a backfill waiting since then counts
    from there, not from its historical `received_at`; no row is rewritten."""
    backfill_at = 1_000
    two_years_on = backfill_at + 2 * 365 * 86_400 * 1_000_000
    readings = [two_years_on + n for n in (0, 2, 3, 4, 5, 6)]
    with Journal(path, clock=clock_of(*readings)) as journal:
        ids = [
            journal.append(delivery(b"live-1")).delivery_id,
            journal.append(delivery(b"old", received_at=backfill_at)).delivery_id,
            journal.append(delivery(b"live-2")).delivery_id,
            journal.append(delivery(b"future", received_at=readings[5] + 10)).delivery_id,
            journal.append(delivery(b"old-2", received_at=backfill_at + 1)).delivery_id,
        ]
    with raw(path) as conn:
        as_version_1(conn)
        rows = conn.execute(f"SELECT {OLD_COLUMNS} FROM deliveries ORDER BY id").fetchall()

    now = readings[-1] + 60 * 1_000_000
    with Journal(path, clock=clock_of(now)) as journal:
        metas = journal.get_metas(ids)
        stamps = [(metas[i].received_at, metas[i].journaled_at) for i in ids]
        assert stamps == [
            (readings[0], readings[0]),
            (backfill_at, readings[0]),
            (readings[2], readings[2]),
            (readings[5] + 10, readings[5] + 10),
            (backfill_at + 1, readings[5] + 10),
        ]
        assert {m.id: m for m in journal.iter_order()} == metas
        oldest = journal.oldest_waiting({ids[0], ids[2], ids[3]})
        assert oldest == (readings[0], ids[1])
        assert waited_s(oldest, now) < 61
        waiting, first, _ = journal.waiting_and_count({ids[0], ids[2]})
        assert (waiting, first) == (3, oldest)
    with raw(path) as conn:
        assert conn.execute(f"SELECT {OLD_COLUMNS} FROM deliveries ORDER BY id").fetchall() == rows


def test_iter_order_after_and_limit_journal_6(path: Path) -> None:
    """JOURNAL-6: iter_order returns at most limit deliveries strictly after the position."""
    with Journal(path, clock=clock_of(100, 100, 200, 300, 300)) as journal:
        live = [journal.append(delivery()) for _ in range(4)]
        backfill = journal.append(delivery(received_at=150))
        positions = [(r.received_at, r.delivery_id) for r in (*live[:2], backfill, *live[2:])]
        listed = [(m.received_at, m.id) for m in journal.iter_order()]
        assert listed == positions
        for index, position in enumerate(positions):
            after = [(m.received_at, m.id) for m in journal.iter_order(after=position)]
            assert after == positions[index + 1 :]
            limited = journal.iter_order(after=position, limit=2)
            assert [(m.received_at, m.id) for m in limited] == positions[index + 1 : index + 3]
        assert journal.iter_order(limit=0) == []
        assert journal.iter_order(after=(100, 0), limit=1)[0].id == live[0].delivery_id
        assert journal.iter_order(after=(10**18, 0)) == []
        with pytest.raises(ValueError, match="limit"):
            journal.iter_order(limit=-1)


def test_group_commit_of_fifty_journal_7(journal: Journal) -> None:
    """JOURNAL-7: fifty deliveries in one append_many are one transaction with consecutive ids."""
    bodies = [f'{{"n":{n}}}'.encode() for n in range(50)]
    receipts = journal.append_many([delivery(body) for body in bodies])
    ids = [r.delivery_id for r in receipts if isinstance(r, Receipt)]
    assert ids == list(range(ids[0], ids[0] + 50))
    statistics = journal.statistics()
    assert (statistics.groups, statistics.appends, statistics.deliveries) == (1, 50, 50)
    assert journal.count() == (50, sum(map(len, bodies)))
    assert [journal.read_body(i) for i in ids] == bodies


def test_group_is_all_or_nothing_journal_8(path: Path) -> None:
    """JOURNAL-8: a group whose transaction fails part way journals none of its deliveries."""
    readings = iter(range(1, 30))

    def clock() -> int:
        reading = next(readings, None)
        if reading is None:
            raise RuntimeError("clock failed")
        return reading

    with Journal(path, clock=clock) as journal:
        with pytest.raises(RuntimeError, match="clock failed"):
            journal.append_many([delivery(f"{n}".encode()) for n in range(50)])
        assert journal.count() == (0, 0)
    group = [delivery(f"{n}".encode()) for n in range(50)]
    group[30] = delivery(client=cast(str, None))
    with Journal(path) as journal:
        with pytest.raises(StorageError, match="NOT NULL"):
            journal.append_many(group)
        assert journal.count() == (0, 0)
        assert journal.iter_order() == []
        assert journal.statistics().groups == 0


def test_database_refuses_update_and_delete_journal_9(path: Path, journal: Journal) -> None:
    """JOURNAL-9: UPDATE and DELETE on deliveries and receipts are aborted by the database."""
    receipt = journal.append(delivery(b"truth", idempotency_key="k"))
    with raw(path) as conn:
        for statement in (
            "UPDATE deliveries SET body = x'00' WHERE id = ?",
            "UPDATE deliveries SET received_at = 0 WHERE id = ?",
            "DELETE FROM deliveries WHERE id = ?",
            "UPDATE receipts SET delivery_id = 99 WHERE delivery_id = ?",
            "DELETE FROM receipts WHERE delivery_id = ?",
        ):
            with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                conn.execute(statement, (receipt.delivery_id,))
    assert journal.read_body(receipt.delivery_id) == b"truth"
    assert journal.append(delivery(b"truth", idempotency_key="k")).replayed


@pytest.mark.parametrize("size", [100, 5000], ids=["identity", "zlib"])
def test_tampered_body_is_detected_journal_10(path: Path, journal: Journal, size: int) -> None:
    """JOURNAL-10: a byte flipped on disk makes read_body raise CorruptBody naming the id."""
    body = (b"secret-heart-rate " * 300)[:size]
    journal.append(delivery(b"first"))
    receipt = journal.append(delivery(body))
    with raw(path) as conn:
        (stored,) = conn.execute(
            "SELECT body FROM deliveries WHERE id = ?", (receipt.delivery_id,)
        ).fetchone()
        tampered = bytearray(stored)
        tampered[len(tampered) // 2] ^= 0x01
        conn.execute("DROP TRIGGER deliveries_no_update")
        conn.execute(
            "UPDATE deliveries SET body = ? WHERE id = ?", (bytes(tampered), receipt.delivery_id)
        )
    with pytest.raises(CorruptBody, match=f"delivery {receipt.delivery_id}\\b") as caught:
        journal.read_body(receipt.delivery_id)
    assert "secret" not in str(caught.value)
    assert journal.read_body(1) == b"first"


def test_identical_bytes_replay_journal_11(journal: Journal) -> None:
    """JOURNAL-11: the same bytes under the same key return the original receipt, replayed."""
    for body in (b'{"data":{"metrics":[]}}', b"\x00 not json \xff"):
        original = journal.append(delivery(body, idempotency_key=f"key-{body[:1]!r}"))
        count = journal.count()
        again = journal.append(delivery(body, idempotency_key=f"key-{body[:1]!r}"))
        assert again.replayed
        assert again == Receipt(
            original.delivery_id, original.received_at, original.sha256, original.bytes, True
        )
        assert journal.count() == count


def test_identical_bytes_replay_whatever_the_digest_journal_11(
    path: Path, journal: Journal
) -> None:
    """JOURNAL-11: identical bytes replay even if the receipt's digest came from another
    canonicalisation (here: overwritten behind the journal's back)."""
    body = b'{"qty":1.5,"name":"steps"}'
    original = journal.append(delivery(body, idempotency_key="k"))
    with raw(path) as conn:
        conn.execute("DROP TRIGGER receipts_no_update")
        conn.execute("UPDATE receipts SET content_digest = zeroblob(32)")
    assert journal.append(delivery(body, idempotency_key="k")) == attrs_replayed(original)
    with pytest.raises(IdempotencyCollision):
        journal.append(delivery(b'{"name":"steps","qty":1.5}', idempotency_key="k"))


def test_equivalent_json_replays_journal_12(journal: Journal) -> None:
    """JOURNAL-12: the same JSON with other key order and whitespace replays the original."""
    body = b'{"data":{"metrics":[{"name":"steps","qty":12,"u":"count"}]}}'
    reordered = b'{ "data" : { "metrics" : [ {"u": "count", "qty" : 12, "name":"steps"} ] } }\n'
    original = journal.append(delivery(body, idempotency_key="k"))
    again = journal.append(delivery(reordered, idempotency_key="k"))
    assert again == attrs_replayed(original)
    assert journal.count() == (1, original.bytes)


def test_equivalent_json_of_any_shape_replays_journal_12(journal: Journal) -> None:
    """JOURNAL-12: any JSON document re-sent with shuffled keys and whitespace is a replay."""
    json_values = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=12,
    )

    @settings(max_examples=40, deadline=None)
    @given(json_values, st.randoms(use_true_random=False))
    def replays(value: object, rng: random.Random) -> None:
        key = uuid.uuid4().hex
        original = journal.append(delivery(json.dumps(value).encode(), idempotency_key=key))
        resent = json.dumps(shuffled(value, rng), indent=rng.choice([None, 1, 4])).encode()
        assert journal.append(delivery(resent, idempotency_key=key)) == attrs_replayed(original)

    replays()


def attrs_replayed(receipt: Receipt) -> Receipt:
    return Receipt(receipt.delivery_id, receipt.received_at, receipt.sha256, receipt.bytes, True)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b'{"qty":1}', b'{"qty":2}'),
        (b'{"qty":1}', b'{"qty":1.0}'),
        (b"not json", b"not json!"),
        (b'{"qty":1}', b"not json"),
    ],
    ids=["value", "int-vs-float", "raw", "json-vs-raw"],
)
def test_different_content_collides_journal_13(
    journal: Journal, first: bytes, second: bytes
) -> None:
    """JOURNAL-13: different content under a used key is a collision and journals nothing."""
    original = journal.append(delivery(first, idempotency_key="k"))
    with pytest.raises(IdempotencyCollision, match=f"delivery {original.delivery_id}") as caught:
        journal.append(delivery(second, idempotency_key="k"))
    assert caught.value.original_delivery_id == original.delivery_id
    assert journal.count() == (1, len(first))
    results = journal.append_many(
        [delivery(b"a"), delivery(second, idempotency_key="k"), delivery(b"b")]
    )
    assert isinstance(results[1], IdempotencyCollision)
    assert [journal.read_body(r.delivery_id) for r in results if isinstance(r, Receipt)] == [
        b"a",
        b"b",
    ]
    assert journal.count() == (3, len(first) + 2)
    assert journal.statistics().collisions == 2


def test_keys_are_per_client_journal_14(journal: Journal) -> None:
    """JOURNAL-14: the same key from another client is independent."""
    anton = journal.append(delivery(b'{"a":1}', client="anton", idempotency_key="k"))
    berta = journal.append(delivery(b'{"b":2}', client="berta", idempotency_key="k"))
    assert not berta.replayed
    assert berta.delivery_id != anton.delivery_id
    again = journal.append(delivery(b'{"b":2}', client="berta", idempotency_key="k"))
    assert again == attrs_replayed(berta)
    assert journal.count()[0] == 2


def test_same_key_twice_in_one_group_journal_15(journal: Journal) -> None:
    """JOURNAL-15: deliveries of one group sharing client and key behave as if sequential."""
    first, same, different = journal.append_many(
        [
            delivery(b'{"a":1,"b":2}', idempotency_key="k"),
            delivery(b'{"b":2,"a":1}', idempotency_key="k"),
            delivery(b'{"a":1,"b":3}', idempotency_key="k"),
        ]
    )
    assert isinstance(first, Receipt)
    assert not first.replayed
    assert same == attrs_replayed(first)
    assert isinstance(different, IdempotencyCollision)
    assert journal.count() == (1, first.bytes)
    statistics = journal.statistics()
    assert (statistics.groups, statistics.replays, statistics.collisions) == (1, 1, 1)


def test_receipt_commits_with_its_row_journal_16(path: Path) -> None:
    """JOURNAL-16: a failed group leaves no receipt behind; the retry is journaled as new."""
    group = [delivery(b"x", idempotency_key="k"), delivery(client=cast(str, None))]
    with Journal(path) as journal:
        with pytest.raises(StorageError):
            journal.append_many(group)
        with raw(path) as conn:
            assert conn.execute("SELECT count(*) FROM receipts").fetchone() == (0,)
        retry = journal.append(group[0])
        assert not retry.replayed
        assert journal.count() == (1, 1)


def test_stored_content_digest_journal_17(path: Path, journal: Journal) -> None:
    """JOURNAL-17: receipts store the canonical digest for JSON, the raw sha256 otherwise."""
    json_body = b'{ "b": [1, 2.5, "x"], "a": null }'
    raw_body = b"\xff{ not json"
    journal.append(delivery(json_body, idempotency_key="json"))
    journal.append(delivery(raw_body, idempotency_key="raw"))
    with raw(path) as conn:
        digests = dict(conn.execute("SELECT idempotency_key, content_digest FROM receipts"))
    canonical = orjson.dumps(orjson.loads(json_body), option=orjson.OPT_SORT_KEYS)
    assert canonical == b'{"a":null,"b":[1,2.5,"x"]}'
    assert digests == {
        "json": hashlib.sha256(canonical).digest(),
        "raw": hashlib.sha256(raw_body).digest(),
    }
    assert journal.append(delivery(canonical, idempotency_key="json")).replayed


def test_a_large_body_in_another_key_order_replays_journal_31(path: Path, journal: Journal) -> None:
    """JOURNAL-31: the same 20 MiB of JSON in another key order, under the same key, replays the
    original receipt; other content under that key is a collision."""
    body = big_body(3, target_bytes=20 * 2**20)
    reordered = encode(orjson.loads(body), 4)
    assert reordered != body
    first = journal.append(delivery(body, idempotency_key="big"))
    again = journal.append(delivery(reordered, idempotency_key="big"))
    assert again == attrs.evolve(first, replayed=True)
    with pytest.raises(IdempotencyCollision):
        journal.append(delivery(body.replace(b"count/min", b"count/hr"), idempotency_key="big"))
    assert journal.count() == (1, len(body))


def test_busy_database_defers_journal_18(path: Path) -> None:
    """JOURNAL-18: a real connection holding BEGIN EXCLUSIVE makes append raise Deferred."""
    with Journal(path, busy_timeout_ms=50) as journal, raw(path) as other:
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(Deferred):
            journal.append(delivery(b"waiting", idempotency_key="k"))
        other.execute("ROLLBACK")
        assert journal.count() == (0, 0)
        assert journal.statistics().groups == 0
        receipt = journal.append(delivery(b"waiting", idempotency_key="k"))
        assert not receipt.replayed
        assert journal.read_body(receipt.delivery_id) == b"waiting"
        assert journal.count() == (1, 7)


def test_short_lock_is_waited_out_journal_19(path: Path) -> None:
    """JOURNAL-19: a lock held in another thread shorter than the busy timeout is waited for."""
    locked = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:
        with raw(path) as other:
            other.execute("BEGIN EXCLUSIVE")
            locked.set()
            release.wait(5)
            other.execute("COMMIT")

    with Journal(path, busy_timeout_ms=10_000) as journal:
        holder = threading.Thread(target=hold_lock)
        holder.start()
        try:
            assert locked.wait(5)
            threading.Timer(0.2, release.set).start()
            receipt = journal.append(delivery(b"patient"))
        finally:
            release.set()
            holder.join()
        assert journal.read_body(receipt.delivery_id) == b"patient"


def test_newer_schema_is_refused_journal_20(path: Path) -> None:
    """JOURNAL-20: a file from a newer healthlog is refused and left as it was, one version
    ahead as well as many."""
    Journal(path).close()
    with raw(path) as conn:
        (known,) = conn.execute("PRAGMA user_version").fetchone()
    for newer in (known + 1, 99):
        with raw(path) as conn:
            conn.execute(f"PRAGMA user_version = {newer}")
        with pytest.raises(StorageError, match="newer than this healthlog") as caught:
            Journal(path)
        assert type(caught.value) is StorageError
        with raw(path) as conn:
            assert conn.execute("PRAGMA user_version").fetchone() == (newer,)


@pytest.mark.parametrize(
    ("code", "deferred"),
    [
        (5, True),
        (6, True),
        (261, True),
        (262, True),
        (517, True),
        (1, False),
        (8, False),
        (10, False),
        (11, False),
        (13, False),
        (19, False),
        (2067, False),
        (None, False),
    ],
)
@pytest.mark.parametrize("message", ["database is locked", "database table is locked", "boom"])
def test_errors_are_classified_by_code_journal_21(
    code: int | None, deferred: bool, message: str
) -> None:
    """JOURNAL-21: busy/locked is decided from sqlite_errorcode & 0xFF alone, never the message."""
    error = sqlite3.OperationalError(message)
    if code is not None:
        error.sqlite_errorcode = code
    classified = _sqlite.classify(error)
    assert type(classified) is (Deferred if deferred else StorageError)


def test_connections_are_durable_journal_22(path: Path) -> None:
    """JOURNAL-22: WAL, synchronous=FULL, foreign keys, busy timeout; read-only refuses writes."""
    with closing(_sqlite.connect(path, busy_timeout_ms=1234)) as conn:
        pragmas = [
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        ]
        assert pragmas == ["wal", 2, 1, 1234]
        assert conn.isolation_level is None
        conn.execute("CREATE TABLE t (x)")
    with closing(_sqlite.connect(path, readonly=True)) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("INSERT INTO t VALUES (1)")


class Cancelled(BaseException):
    """Stands in for trio.Cancelled."""


def transaction(
    conn: sqlite3.Connection, *statements: str, then_raise: BaseException | None = None
) -> None:
    with _sqlite.write_transaction(conn):
        for statement in statements:
            conn.execute(statement)
        if then_raise is not None:
            raise then_raise


def test_write_transaction_rolls_back_journal_23(path: Path) -> None:
    """JOURNAL-23: any exception in the block rolls back; SQLite errors come out classified."""
    with closing(_sqlite.connect(path)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER NOT NULL)")
        for exception in (ValueError("plain"), Cancelled()):
            with pytest.raises(type(exception)):
                transaction(conn, "INSERT INTO t VALUES (1)", then_raise=exception)
        with pytest.raises(StorageError, match="NOT NULL") as caught:
            transaction(conn, "INSERT INTO t VALUES (1)", "INSERT INTO t VALUES (NULL)")
        assert isinstance(caught.value.__cause__, sqlite3.IntegrityError)
        assert not conn.in_transaction
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
        with _sqlite.write_transaction(conn):
            conn.execute("INSERT INTO t VALUES (2)")
        assert conn.execute("SELECT x FROM t").fetchall() == [(2,)]


def test_migrations_step_by_step_journal_24(path: Path) -> None:
    """JOURNAL-24: each migration applies once, atomically, with its version bump."""
    first = """
        -- a comment; with a semicolon
        CREATE TABLE a (x TEXT DEFAULT 'semi;colon');
        CREATE TRIGGER a_guard BEFORE DELETE ON a
        BEGIN SELECT RAISE(ABORT, 'no; deleting'); END;
        INSERT INTO a DEFAULT VALUES
    """
    second = "CREATE TABLE b (y); INSERT INTO b VALUES (1);"
    broken = "CREATE TABLE c (z); INSERT INTO nowhere VALUES (1);"
    with closing(_sqlite.connect(path)) as conn:
        _sqlite.migrate(conn, [first])
        _sqlite.migrate(conn, [first, second])
        _sqlite.migrate(conn, [first, second])
        assert conn.execute("SELECT x FROM a").fetchall() == [("semi;colon",)]
        assert conn.execute("SELECT y FROM b").fetchall() == [(1,)]
        with pytest.raises(sqlite3.IntegrityError, match="no; deleting"):
            conn.execute("DELETE FROM a")
        with pytest.raises(StorageError, match="no such table"):
            _sqlite.migrate(conn, [first, second, broken])
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema")}
        assert "c" not in tables
        with pytest.raises(StorageError, match="newer"):
            _sqlite.migrate(conn, [first])
    with closing(_sqlite.connect(path.with_name("at-once.sqlite"))) as conn:
        _sqlite.migrate(conn, [first, second])
        assert conn.execute("PRAGMA user_version").fetchone() == (2,)
        assert conn.execute("SELECT x FROM a").fetchall() == [("semi;colon",)]
        assert conn.execute("SELECT y FROM b").fetchall() == [(1,)]


def test_concurrent_migration_journal_28(path: Path) -> None:
    """JOURNAL-28: a migrate racing another migrator re-reads the version under the lock."""
    script = "CREATE TABLE a (x);"
    errors: list[BaseException] = []
    with raw(path) as first, closing(_sqlite.connect(path)) as second:
        first.execute("BEGIN IMMEDIATE")

        def migrate_second() -> None:
            try:
                _sqlite.migrate(second, [script])
            except BaseException as exc:
                errors.append(exc)

        racer = threading.Thread(target=migrate_second)
        racer.start()
        racer.join(0.3)
        first.execute(script)
        first.execute("PRAGMA user_version = 1")
        first.execute("COMMIT")
        racer.join()
        assert errors == []
        assert second.execute("PRAGMA user_version").fetchone() == (1,)


def test_instance_id_journal_25(path: Path) -> None:
    """JOURNAL-25: a uuid4 hex created with the file, stable across reopening."""
    with Journal(path) as journal:
        created = journal.instance_id()
    with Journal(path) as journal:
        assert journal.instance_id() == created
    assert uuid.UUID(hex=created).version == 4
    assert uuid.UUID(hex=created).hex == created


def test_unknown_ids_counts_and_statistics_journal_26(journal: Journal) -> None:
    """JOURNAL-26: missing ids, count() and statistics()."""
    with pytest.raises(KeyError):
        journal.read_body(1)
    assert journal.get_meta(1) is None
    assert journal.count() == (0, 0)
    assert journal.append_many([]) == []
    journal.append(delivery(b"abc", idempotency_key="k"))
    journal.append_many([delivery(b"defg"), delivery(b"abc", idempotency_key="k")])
    with pytest.raises(IdempotencyCollision):
        journal.append(delivery(b"xyz", idempotency_key="k"))
    assert journal.count() == (2, 7)
    statistics = journal.statistics()
    assert (statistics.deliveries, statistics.bytes) == (2, 7)
    assert (statistics.appends, statistics.groups) == (4, 3)
    assert (statistics.replays, statistics.collisions) == (1, 1)


def test_worker_threads_journal_27(journal: Journal) -> None:
    """JOURNAL-27: concurrent appends from threads each journal once with distinct ids."""
    receipts: list[Receipt] = []
    receipts_lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(25):
            receipt = journal.append(delivery(f"{n}-{i}".encode() * 100))
            with receipts_lock:
                receipts.append(receipt)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({r.delivery_id for r in receipts}) == 200
    assert journal.count()[0] == 200
    for receipt in receipts[::20]:
        assert hashlib.sha256(journal.read_body(receipt.delivery_id)).hexdigest() == receipt.sha256


@pytest.mark.parametrize("size", [1023, 1024, 3 * 2**20], ids=["identity", "threshold", "3 MiB"])
def test_a_body_encoded_while_it_streams_in_is_journaled_as_a_whole_one_journal_29(
    path: Path, journal: Journal, size: int
) -> None:
    """JOURNAL-29: chunks hashed and encoded by ``journal.encoder()`` (hashing and compressing
    in separate steps) give the row, receipt and idempotency replay of the same bytes whole."""
    body = (b'{"name":"heart_rate","qty":72},' * (size // 31 + 1))[:size]
    chunks = [body[i : i + 65536] for i in range(0, size, 65536)]
    encoder = journal.encoder()
    for chunk in chunks:
        encoder.hash(chunk)
    for start in range(0, len(chunks), 7):
        encoder.encode(chunks[start : start + 7])
    encoded = encoder.finish()
    key = "k-stream"

    receipt = journal.append(NewDelivery(body=encoded, client="phone", idempotency_key=key))

    assert (receipt.sha256, receipt.bytes) == (hashlib.sha256(body).hexdigest(), size)
    assert stored_encoding(path, receipt.delivery_id)[0] == ("zlib" if size >= 1024 else "identity")
    assert journal.read_body(receipt.delivery_id) == body
    again = journal.append(NewDelivery(body=body, client="phone", idempotency_key=key))
    assert again == attrs.evolve(receipt, replayed=True)


def test_an_empty_body_streamed_in_no_chunk_is_journaled_as_a_whole_one_journal_29(
    path: Path,
) -> None:
    """JOURNAL-29: with compress_min_bytes 0 the empty body is at the threshold, so it is
    stored zlib-compressed; streamed in no chunk at all, it gets the same row and replays."""
    with Journal(path, compress_min_bytes=0) as journal:
        encoded = journal.encoder().finish()
        streamed = journal.append(NewDelivery(body=encoded, client="phone", idempotency_key="k"))
        whole = journal.append(NewDelivery(body=b"", client="phone"))

        assert stored_encoding(path, whole.delivery_id)[0] == "zlib"
        assert stored_encoding(path, streamed.delivery_id) == stored_encoding(
            path, whole.delivery_id
        )
        assert journal.read_body(streamed.delivery_id) == b""
        again = journal.append(NewDelivery(body=b"", client="phone", idempotency_key="k"))
        assert again == attrs.evolve(streamed, replayed=True)


def test_metadata_of_a_run_and_the_span_up_to_a_position_journal_30(journal: Journal) -> None:
    """JOURNAL-30: get_metas reads several ids at once; span_through counts and sums the ids
    at or before a position in journal order."""
    first, second, third = (
        journal.append(delivery(b"{}", received_at=stamp)).delivery_id for stamp in (100, 300, 200)
    )
    metas = journal.get_metas([first, second, third, third + 1])
    assert metas == {i: journal.get_meta(i) for i in (first, second, third)}
    assert journal.span_through((200, third)) == (2, first + third)
    assert journal.span_through((100, first - 1)) == (0, 0)
    assert journal.span_through((300, second)) == (3, first + second + third)


def test_a_wal_grown_by_a_large_commit_shrinks_after_a_checkpoint_journal_32(
    tmp_path: Path,
) -> None:
    """JOURNAL-32: a delivery larger than WAL_SIZE_LIMIT grows the WAL past it; once another
    connection has checkpointed it, the next append cuts it back to at most WAL_SIZE_LIMIT."""
    path = tmp_path / "journal.sqlite"
    wal = tmp_path / "journal.sqlite-wal"
    large = random.Random(32).randbytes(WAL_SIZE_LIMIT + 8 * 2**20)
    with Journal(path) as journal:
        journal.append(NewDelivery(body=large, client="phone"))
        grown = wal.stat().st_size
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("PRAGMA wal_checkpoint(PASSIVE)")
        journal.append(NewDelivery(body=b'{"n": 1}', client="phone"))
        shrunk = wal.stat().st_size
        assert journal.read_body(2) == b'{"n": 1}'
    assert grown > len(large)
    assert shrunk <= WAL_SIZE_LIMIT


# Each writer of a file other than the journal, and a small write it makes.
OTHER_WRITERS: dict[str, tuple[Callable[[Path], Database], Callable[[Database], object]]] = {
    "store": (
        lambda directory: DataDir(directory).open_store(),
        lambda store: cast(Store, store).acquire_lease("a", now=1, ttl=10**6),
    ),
    "tokens": (
        lambda directory: DataDir(directory).open_tokens(),
        lambda tokens: cast(Tokens, tokens).add("phone"),
    ),
    "replica": (
        lambda directory: Replica(directory / "replica"),
        lambda replica: cast(Replica, replica).bind("instance", "key"),
    ),
}


@pytest.mark.parametrize("writer", list(OTHER_WRITERS))
def test_every_writers_wal_shrinks_after_a_checkpoint_journal_32(
    tmp_path: Path, writer: str
) -> None:
    """JOURNAL-32: the store's, the tokens' and a replica's connections (every writer's comes
    from ``connect``) cut a WAL grown past WAL_SIZE_LIMIT back to it at their next write once
    it has been checkpointed. The WAL is grown by a plain sqlite3 connection, which has no
    such limit, so only the writer's own setting can cut it."""
    open_writer, write = OTHER_WRITERS[writer]
    with open_writer(tmp_path) as database:
        path = Path(database.path)
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("CREATE TABLE ballast (b BLOB)")
            ballast = random.Random(32).randbytes(WAL_SIZE_LIMIT + 8 * 2**20)
            other.execute("INSERT INTO ballast VALUES (?)", (ballast,))
            grown = Path(f"{path}-wal").stat().st_size
            other.execute("PRAGMA wal_checkpoint(PASSIVE)")
        write(database)
        shrunk = Path(f"{path}-wal").stat().st_size
    assert grown > len(ballast)
    assert shrunk <= WAL_SIZE_LIMIT


def test_counting_reads_only_the_deliveries_journaled_since_journal_35(path: Path) -> None:
    """JOURNAL-35: GIVEN a journal of 300 deliveries, counted once WHEN another connection (the
    service's intake, say) journals two more, and the count is read again THEN it is 302
    deliveries and the sum of their bytes, read in a handful of SQLite's steps, not a step
    per delivery; and a connection opened again, on an older copy of the file put in its place,
    counts that file from nothing. (Before, every
    count summed every delivery's row: 1,059 pages, 4.3 MB, for 2.5 years, at every status
    and every `/metrics` scrape.)"""
    bodies = [b'{"n": %d}' % n for n in range(302)]
    older = path.with_name("older.sqlite")
    with Journal(path) as writer:
        writer.append_many([delivery(body) for body in bodies[:300]])
    with closing(sqlite3.connect(path)) as source, closing(sqlite3.connect(older)) as copy:
        source.backup(copy)
    with Journal(path) as journal:
        assert journal.count() == (300, sum(map(len, bodies[:300])))
        with Journal(path) as writer:
            writer.append_many([delivery(body) for body in bodies[300:]])
        counted, steps = counted_steps(journal._conn, journal.count, every=10)
        assert counted == (302, sum(map(len, bodies)))
        assert steps < 10, steps
        journal._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        older.replace(path)
        journal._reopen()
        assert journal.count() == (300, sum(map(len, bodies[:300])))


def test_a_clock_set_back_behind_the_last_stamp_is_said_once_journal_44(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """JOURNAL-44: a clock more than a minute behind the last live stamp (a NAS that booted
    with its clock ahead, then NTP set it back) is said in one WARNING with both instants and
    what it means; not again while the stamps stay clamped, again once the clock has caught up
    and falls behind anew; a step back of less than a minute says nothing."""
    hour = 3_600_000_000
    base = 1_764_576_000_000_000
    readings = (
        base,
        base - 3 * hour,
        base - 3 * hour + 1,
        base + 1,
        base - 30_000_000,
        base - hour,
    )
    caplog.set_level(logging.INFO, "healthlog")
    with Journal(path, clock=clock_of(*readings)) as journal:
        stamps = [journal.append(delivery()).received_at for _ in readings]
    assert stamps == [base, base, base, base + 1, base + 1, base + 1]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("healthlog")]
    assert said == [
        f"the clock reads {format_instant(base - 3 * hour)}, 10,800 s behind the journal's last"
        f" stamp {format_instant(base)} (was it ahead, and set back since?): live deliveries"
        " are stamped with that instant until the clock passes it, and their lag reads 0"
        " meanwhile",
        f"the clock reads {format_instant(base - hour)}, 3,600 s behind the journal's last"
        f" stamp {format_instant(base + 1)} (was it ahead, and set back since?): live"
        " deliveries are stamped with that instant until the clock passes it, and their lag"
        " reads 0 meanwhile",
    ]
    assert all(
        r.levelno == logging.WARNING for r in caplog.records if r.name.startswith("healthlog")
    )
