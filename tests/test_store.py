"""The projection store and its fold transaction against real SQLite files.

Scenarios: STORE-n in specs/storage.md, FOLD-n in specs/folding.md, PARSE-41 in
specs/parsing.md; the replay stream's pruning and the removal of gone subscribers (STREAM-39,
STREAM-63 to STREAM-65) in specs/stream.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import tracemalloc
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import pytest
import trio
from _bodies import BASE_US, NOW, TTL, append, body, delivery, pending, point, rows
from _disk import DISK_ERROR, files_limited_to, in_full_file_system, unwritable
from _sqlite_steps import counted_steps
from fixtures import DEFAULT_START, make_body

from actors.retention import RetentionActor, RetentionStatistics
from healthlog import clock, faults, objects
from healthlog.fold import NO_LAYER, BudgetExceeded
from healthlog.folding import FoldReport, OutcomeClass
from healthlog.objects import ObjectKey
from healthlog.storage import _sqlite
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, Deferred, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV
from healthlog.storage.journal import DeliveryMeta, Journal, NewDelivery
from healthlog.storage.rebuild import reindex, verify
from healthlog.storage.status import collect_status
from healthlog.storage.store import MIGRATIONS, Lease, Store
from healthlog.storage.tokens import Tokens
from healthlog.timestamps import US_PER_HOUR

if TYPE_CHECKING:
    from conftest import Cli


def fold(
    journal: Journal, store: Store, meta: DeliveryMeta, epoch: int, *, guard: bool = True
) -> FoldReport:
    return store.fold(journal, meta, epoch, guard=guard)


def events(store: Store) -> list[tuple[int, str, str, dict[str, Any]]]:
    """Every change event in seq order: (seq, id, kind, payload)."""
    return [(e.seq, e.id, e.kind, e.payload) for e in store.events_after(0, 1000)]


def plan(name: str, hits: set[int], error: type[Exception]) -> faults.Plan:
    return faults.Plan(actions={name: faults.Action(frozenset(hits), faults.raise_fault(error))})


FIRST = body({"hr": [point(1, 60), point(61, 61)]})
FOUR_HOURS = body({"hr": [point(2, 70), point(62, 71), point(122, 72), point(182, 73)]})

FOLD_PATH_FAULTS = [
    ("fold.begin", 1),
    ("fold.object_write", 1),
    ("fold.object_write", 2),
    ("fold.object_write", 3),
    ("fold.outcome_write", 1),
    ("fold.before_commit", 1),
]


@pytest.mark.parametrize(("name", "hit"), FOLD_PATH_FAULTS)
@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (faults.InjectedFault, OutcomeClass.DONE),
        (StorageError, OutcomeClass.UNWRITTEN),
        (Deferred, OutcomeClass.DEFERRED),
    ],
)
def test_fault_inside_the_fold_transaction_writes_nothing_store_1(
    journal: Journal,
    store: Store,
    epoch: int,
    name: str,
    hit: int,
    error: type[Exception],
    expected: OutcomeClass,
) -> None:
    """STORE-1: a fault anywhere in the fold transaction leaves none of the delivery's writes."""
    first = append(journal, delivery(FIRST))
    assert fold(journal, store, first, epoch).status == "parsed"
    second = append(journal, delivery(FOUR_HOURS))
    before = rows(store.path)

    with faults.loaded(plan(name, {hit}, error)) as loaded:
        report = fold(journal, store, second, epoch)

    assert loaded.fired == {name: 1}
    assert report.outcome_class is expected
    after = rows(store.path)
    outcome_tables = {"outcomes", "checkpoint", "events", "sqlite_sequence"}
    assert {k: v for k, v in after.items() if k not in outcome_tables} == {
        k: v for k, v in before.items() if k not in outcome_tables
    }
    if expected is OutcomeClass.DONE:
        assert (report.status, report.reason) == ("failed", "internal error: InjectedFault")
        outcome = store.outcome(second.id)
        assert outcome is not None
        assert (outcome.status, outcome.reason) == ("failed", "internal error: InjectedFault")
        assert outcome.counters["objects_written"] == 0
        folded = {"delivery_id": second.id, "status": "failed", "counters": outcome.counters}
        new_events = events(store)[len(before["events"]) :]
        assert [(kind, payload) for _, _, kind, payload in new_events] == [
            ("delivery.folded", folded)
        ]
        assert store.checkpoint() == (second.received_at, second.id, epoch)
    else:
        assert after == before
        assert fold(journal, store, second, epoch).status == "parsed"
        assert len(rows(store.path)["objects"]) == 4


@pytest.mark.parametrize(
    "error",
    [
        faults.InjectedFault,
        StorageError,
        Deferred,
    ],
)
def test_fault_after_the_commit_leaves_the_delivery_committed_store_2(
    journal: Journal, store: Store, epoch: int, error: type[Exception]
) -> None:
    """STORE-2: a fault after the commit cannot undo it; the report says the fold is done."""
    meta = append(journal, delivery(FOUR_HOURS))

    with faults.loaded(plan("fold.after_commit", {1}, error)) as loaded:
        report = fold(journal, store, meta, epoch)

    assert loaded.fired == {"fold.after_commit": 1}
    outcome = store.outcome(meta.id)
    assert outcome is not None
    assert outcome.status == "parsed"
    assert len(rows(store.path)["objects"]) == 4
    assert (report.outcome_class, report.status) == (OutcomeClass.DONE, "parsed")


def test_stale_epoch_is_fenced_and_writes_nothing_store_3(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-3: a fold under an epoch that is not the lease's is fenced; nothing is written,
    not even the failed outcome of a fold that broke down."""
    meta = append(journal, delivery(FOUR_HOURS))
    before = rows(store.path)

    assert fold(journal, store, meta, epoch - 1).outcome_class is OutcomeClass.FENCED
    with faults.loaded(plan("fold.begin", {1}, faults.InjectedFault)):
        assert fold(journal, store, meta, epoch + 1).outcome_class is OutcomeClass.FENCED

    assert rows(store.path) == before
    assert any(
        r.levelno == logging.WARNING and f"delivery {meta.id}" in r.getMessage()
        for r in caplog.records
    )


def test_takeover_fences_the_first_holder_store_4(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-4: after another holder takes the lease over, the first holder's next fold is
    fenced; checkpoint and outcomes record each delivery's position and its epoch."""
    first = append(journal, delivery(FIRST))
    second = append(journal, delivery(FOUR_HOURS))
    assert fold(journal, store, first, epoch).status == "parsed"
    assert store.checkpoint() == (first.received_at, first.id, epoch)

    with Store(store.path) as other:
        taken = other.acquire_lease("other", now=NOW + 1, ttl=TTL, force=True)
        assert taken == epoch + 1
        before = rows(store.path)
        assert fold(journal, store, second, epoch).outcome_class is OutcomeClass.FENCED
        assert rows(store.path) == before
        assert fold(journal, other, second, taken).status == "parsed"

    assert store.checkpoint() == (second.received_at, second.id, taken)
    epochs = {row[0]: row[-1] for row in rows(store.path)["outcomes"]}
    assert epochs == {first.id: epoch, second.id: taken}


def test_a_holder_renews_its_own_expired_lease_at_the_same_epoch_fence_12(store: Store) -> None:
    """FENCE-12: a holder whose lease expired with nobody taking it renews at the same epoch;
    once another has taken it, the holder is refused, and takes it back only at a new epoch."""
    assert store.acquire_lease("a", now=100, ttl=10) == 1
    assert store.acquire_lease("a", now=150, ttl=10) == 1
    assert store.lease() == Lease("a", 1, 160)
    assert store.acquire_lease("b", now=170, ttl=10) == 2
    assert store.acquire_lease("a", now=175, ttl=10) is None
    assert store.acquire_lease("a", now=181, ttl=10) == 3


def test_lease_acquire_renew_refuse_takeover_release_force_store_5(store: Store) -> None:
    """STORE-5: the lease row through its life; every takeover increments the epoch."""
    assert store.lease() == Lease(None, 0, 0)
    assert store.acquire_lease("a", now=100, ttl=10) == 1
    assert store.lease() == Lease("a", 1, 110)

    assert store.acquire_lease("a", now=105, ttl=10) == 1
    assert store.lease() == Lease("a", 1, 115)

    assert store.acquire_lease("b", now=114, ttl=10) is None
    assert store.lease() == Lease("a", 1, 115)

    assert store.acquire_lease("b", now=115, ttl=10) == 2
    assert store.lease() == Lease("b", 2, 125)

    store.release_lease("b", 1)
    assert store.lease() == Lease("b", 2, 125)
    store.release_lease("b", 2)
    assert store.lease() == Lease(None, 2, 0)

    assert store.acquire_lease("a", now=130, ttl=10) == 3
    assert store.acquire_lease("b", now=131, ttl=10, force=True) == 4
    assert store.acquire_lease("b", now=132, ttl=10, force=True) == 5
    assert store.lease() == Lease("b", 5, 142)


def test_expiry_beyond_one_term_is_cut_to_one_term_fence_11(store: Store) -> None:
    """FENCE-11: a holder whose clock ran an hour ahead left an expiry an hour away; the next
    candidate cuts it to one term and takes over after that term, not after the hour. A longer
    term (a reindex's) within its own term is not cut; a candidate whose TTL is longer than the
    row's term cuts to its own TTL."""
    hour = 3600 * 10**6
    assert store.acquire_lease("ahead", now=1000 + hour, ttl=10) == 1
    assert store.acquire_lease("next", now=1000, ttl=10) is None
    assert store.lease() == Lease("ahead", 1, 1010)
    assert store.acquire_lease("next", now=1009, ttl=10) is None
    assert store.acquire_lease("next", now=1010, ttl=10) == 2
    assert store.lease() == Lease("next", 2, 1020)

    assert store.acquire_lease("reindex", now=2000, ttl=300, force=True) == 3
    assert store.acquire_lease("next", now=2001, ttl=10) is None
    assert store.lease() == Lease("reindex", 3, 2300)

    assert store.acquire_lease("ahead", now=3000 + hour, ttl=10, force=True) == 4
    assert store.acquire_lease("longer", now=3000, ttl=20) is None
    assert store.lease() == Lease("ahead", 4, 3020)


def test_busy_store_defers_and_writes_nothing_store_6(journal: Journal, tmp_path: Path) -> None:
    """STORE-6: a second connection holding the write lock makes the fold DEFERRED at its
    BEGIN IMMEDIATE, before the fold runs; once it commits, the same fold goes through."""
    meta = append(journal, delivery(FOUR_HOURS))
    with Store(tmp_path / "store.sqlite", busy_timeout_ms=50) as store:
        epoch = store.acquire_lease("folder", now=NOW, ttl=TTL)
        assert epoch is not None
        before = rows(store.path)
        with closing(sqlite3.connect(store.path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            with faults.loaded(faults.Plan()) as watched:
                assert fold(journal, store, meta, epoch).outcome_class is OutcomeClass.DEFERRED
            assert watched.hits["fold.begin"] == 0
            assert rows(store.path) == before
            holder.execute("COMMIT")

        report = fold(journal, store, meta, epoch)
        assert (report.outcome_class, report.status) == (OutcomeClass.DONE, "parsed")
        assert len(rows(store.path)["objects"]) == 4


def test_unreadable_journal_leaves_the_delivery_pending_store_17(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-17: when the body cannot be read for another reason than busy, the fold writes
    nothing and reports UNWRITTEN; the delivery stays pending."""
    meta = append(journal, delivery(FOUR_HOURS))
    before = rows(store.path)
    journal.close()

    report = fold(journal, store, meta, epoch)

    assert report.outcome_class is OutcomeClass.UNWRITTEN
    assert rows(store.path) == before


def test_a_fold_the_disk_cannot_hold_names_the_error_and_the_file_store_32(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-32: a fold whose writes the disk refuses reports UNWRITTEN with one WARNING that
    names SQLite's error and the store's file; once there is room, the same fold goes through."""
    meta = append(journal, delivery(FOUR_HOURS))
    before = rows(store.path)

    with caplog.at_level(logging.WARNING, "healthlog"), files_limited_to(4096):
        report = fold(journal, store, meta, epoch)

    assert report.outcome_class is OutcomeClass.UNWRITTEN
    [(level, warning)] = [
        (r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING
    ]
    assert level == logging.WARNING
    assert re.fullmatch(
        rf"delivery {meta.id}: fold not written: StorageError: {DISK_ERROR} \(store\.sqlite\)",
        warning,
    ), warning
    assert rows(store.path) == before
    assert fold(journal, store, meta, epoch).outcome_class is OutcomeClass.DONE


def test_a_file_opened_read_only_is_written_once_mended_store_33(tmp_path: Path) -> None:
    """STORE-33: the store, the journal and the token file, opened while this process may not
    write them (SQLite then opens them read-only), refuse writes with SQLITE_READONLY; once
    the files are writable again the next write goes through on the same open objects,
    without reopening them from outside."""
    paths = [tmp_path / name for name in ("store.sqlite", "journal.sqlite", "tokens.sqlite")]
    Store(paths[0]).close()
    Journal(paths[1]).close()
    Tokens(paths[2]).close()
    with unwritable(*paths) as mend:
        store, journal, tokens = Store(paths[0]), Journal(paths[1]), Tokens(paths[2])
        with store, journal, tokens:
            writes = [
                lambda: store.acquire_lease("folder", now=NOW, ttl=TTL),
                lambda: journal.append(delivery(FOUR_HOURS)),
                lambda: tokens.add("phone"),
            ]
            for write, path in zip(writes, paths, strict=True):
                with pytest.raises(StorageError) as refused:
                    write()
                assert (refused.value.kind, refused.value.file) == (
                    "SQLITE_READONLY: attempt to write a readonly database",
                    path.name,
                )
            mend()
            assert store.acquire_lease("folder", now=NOW, ttl=TTL) == 1
            assert journal.append(delivery(FOUR_HOURS)).delivery_id == 1
            assert tokens.add("phone")
            assert [meta.id for meta in journal.iter_order()] == [1]
            assert store.lease() == Lease("folder", 1, NOW + TTL)


@pytest.mark.parametrize("points", [4, 200], ids=["identity", "zlib"])
def test_corrupt_journal_body_fails_the_delivery_store_7(
    journal: Journal,
    store: Store,
    epoch: int,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    points: int,
) -> None:
    """STORE-7: a body that no longer matches its sha256 is failed with a reason and an ERROR
    naming the delivery; nothing of it is folded."""
    meta = append(journal, delivery(body({"hr": [point(m, m) for m in range(points)]})))
    with closing(sqlite3.connect(tmp_path / "journal.sqlite", isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER deliveries_no_update")
        encoding, stored = conn.execute(
            "SELECT encoding, body FROM deliveries WHERE id = ?", (meta.id,)
        ).fetchone()
        flipped = bytearray(stored)
        flipped[len(flipped) // 2] ^= 0x01
        conn.execute("UPDATE deliveries SET body = ? WHERE id = ?", (bytes(flipped), meta.id))
    assert encoding == ("identity" if points == 4 else "zlib")

    report = fold(journal, store, meta, epoch)

    assert (report.outcome_class, report.status) == (OutcomeClass.DONE, "failed")
    assert report.reason == "body does not match its sha256"
    outcome = store.outcome(meta.id)
    assert outcome is not None
    assert (outcome.status, outcome.reason) == ("failed", report.reason)
    assert rows(store.path)["objects"] == []
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        f"delivery {meta.id}: body does not match its sha256"
    ]


@pytest.mark.parametrize("status", ["parsed", "failed"])
def test_folding_a_folded_delivery_again_changes_nothing_store_8(
    journal: Journal, store: Store, epoch: int, status: str
) -> None:
    """STORE-8: a second fold of a folded delivery reports its outcome, status and reason (and
    no late change) and writes nothing."""
    if status == "parsed":
        meta = append(journal, delivery(FOUR_HOURS))
    else:
        sparse = body({"weight": [point(30, 80.5)]})
        meta = append(journal, delivery(sparse, aggregation=None, automation=None))
    first = fold(journal, store, meta, epoch)
    before = rows(store.path)

    again = fold(journal, store, meta, epoch)

    assert first.status == status
    assert bool(first.late_s) == (status == "parsed")
    assert (first.reason is None) == (status == "parsed")
    assert again == attrs.evolve(first, late_s=())
    assert rows(store.path) == before


def test_change_events_per_object_and_delivery_store_9(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-9: one object.changed per written object and one delivery.folded per delivery,
    committed with the fold, gapless; a rolled-back fold leaves no event and no gap."""
    three = body({"hr": [point(1, 60), point(61, 61)], "steps": [point(5, 100)]})
    first = append(journal, delivery(three))
    resend = append(journal, delivery(three))
    later = append(journal, delivery(body({"hr": [point(2, 62)]})))

    fold(journal, store, first, epoch)
    fold(journal, store, resend, epoch)
    with faults.loaded(plan("fold.before_commit", {1}, Deferred)):
        assert fold(journal, store, later, epoch).outcome_class is OutcomeClass.DEFERRED
    assert len(events(store)) == 5
    fold(journal, store, later, epoch)

    log = events(store)
    assert [seq for seq, *_ in log] == list(range(1, 8))
    assert [(event_id, kind) for _, event_id, kind, _ in log] == [
        (f"{first.id}.1", "object.changed"),
        (f"{first.id}.2", "object.changed"),
        (f"{first.id}.3", "object.changed"),
        (f"{first.id}.folded", "delivery.folded"),
        (f"{resend.id}.folded", "delivery.folded"),
        (f"{later.id}.1", "object.changed"),
        (f"{later.id}.folded", "delivery.folded"),
    ]
    objects = {(o.key.metric, o.key.hour): o for o in store.iter_objects()}
    changed = [payload for _, _, kind, payload in log if kind == "object.changed"]
    assert [(p["metric"], p["layer"], p["delivery_id"]) for p in changed] == [
        ("hr", "minutes", first.id),
        ("hr", "minutes", first.id),
        ("steps", "minutes", first.id),
        ("hr", "minutes", later.id),
    ]
    last = changed[-1]
    assert last["hour"] == "2024-03-01T00:00:00Z"
    assert (last["hash"], last["points"]) == (objects["hr", BASE_US].hash.hex(), 2)
    folded = [payload for _, _, kind, payload in log if kind == "delivery.folded"]
    assert [(p["delivery_id"], p["status"]) for p in folded] == [
        (first.id, "parsed"),
        (resend.id, "parsed"),
        (later.id, "parsed"),
    ]
    counters = [p["counters"] for p in folded]
    assert [(c["objects_written"], c["objects_unchanged"]) for c in counters] == [
        (3, 0),
        (0, 3),
        (1, 0),
    ]


def test_layer_is_inherited_from_the_journal_order_predecessor_store_10(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-10: a delivery without header and dense metric takes the layer of the preceding
    delivery of its automation in journal order that has a layer (the nearest one, not the
    first, and not a failed one in between), not of the one journaled just before it."""
    sparse = body({"weight": [point(30, 80.5)]})
    earliest = append(journal, delivery(FIRST, received_at=BASE_US - 1, aggregation="hours"))
    early = append(journal, delivery(FIRST, received_at=BASE_US, aggregation="minutes"))
    other = append(
        journal, delivery(FIRST, received_at=BASE_US + 2, aggregation="days", automation="B")
    )
    late = append(journal, delivery(FIRST, received_at=BASE_US + 3, aggregation="hours"))
    broken = append(journal, delivery(b"not json", received_at=BASE_US + 1, aggregation="days"))
    backfill = append(journal, delivery(sparse, received_at=BASE_US + 1, aggregation=None))
    assert [m.id for m in journal.iter_order()] == [
        earliest.id,
        early.id,
        broken.id,
        backfill.id,
        other.id,
        late.id,
    ]

    for meta in (earliest, early, other, late, broken, backfill):
        expected = "failed" if meta is broken else "parsed"
        assert fold(journal, store, meta, epoch, guard=False).status == expected
    failed = store.outcome(broken.id)
    assert failed is not None
    assert failed.layer is None

    outcome = store.outcome(backfill.id)
    assert outcome is not None
    assert outcome.layer == "minutes"
    assert [o.key.layer for o in store.iter_objects(metric="weight")] == ["minutes"]


@pytest.mark.parametrize("automation", ["B", None])
def test_layer_not_derivable_fails_the_delivery_store_11(
    journal: Journal, store: Store, epoch: int, automation: str | None
) -> None:
    """STORE-11: without header, dense metric or a predecessor of the same automation, the
    delivery is failed and nothing of it is written."""
    earlier = append(journal, delivery(FIRST, received_at=BASE_US, automation="A"))
    sparse = body({"weight": [point(30, 80.5)]})
    meta = append(
        journal,
        delivery(sparse, received_at=BASE_US + 1, aggregation=None, automation=automation),
    )
    fold(journal, store, earlier, epoch)

    report = fold(journal, store, meta, epoch)

    assert report.status == "failed"
    assert report.reason is not None
    assert report.reason.startswith("layer not derivable")
    assert list(store.iter_objects(metric="weight")) == []


def with_workouts(payload: bytes, workouts: object) -> bytes:
    """``payload`` with a ``workouts`` section beside its metrics."""
    document = orjson.loads(payload)
    document["data"]["workouts"] = workouts
    return orjson.dumps(document)


@pytest.mark.parametrize(
    ("later_delivery", "later_status"),
    [
        (delivery(body({"hr": [point(1, 60)]})), "parsed"),
        (delivery(body({"hr": [point(1, 60), {"date": "yesterday-ish", "qty": 2}]})), "partial"),
        (delivery(body({"hr": [point(1, 60)]}), aggregation=None), "failed"),
        # The same, with a problem of its envelope named after the want of a layer.
        (delivery(with_workouts(body({"hr": [point(1, 60)]}), 5), aggregation=None), "failed"),
    ],
)
def test_backfill_behind_a_folded_delivery_warns_once_fold_10(
    journal: Journal,
    store: Store,
    epoch: int,
    caplog: pytest.LogCaptureFixture,
    later_delivery: NewDelivery,
    later_status: str,
) -> None:
    """FOLD-10: folding a delivery when a later one is already parsed or partial, or failed for
    want of a layer that this one of its automation passes on, commits, marks the report out of
    order and logs one WARNING naming the delivery and `healthlog reindex`."""
    later = append(journal, later_delivery)
    assert fold(journal, store, later, epoch).status == later_status
    backfill = append(journal, delivery(body({"steps": [point(1, 5)]}), received_at=BASE_US))
    caplog.clear()

    report = fold(journal, store, backfill, epoch)

    assert (report.status, report.out_of_order) == ("parsed", True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert f"delivery {backfill.id} " in warnings[0]
    assert "healthlog reindex" in warnings[0]


def test_the_out_of_order_warning_says_the_wait_since_journaled_store_65(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-65: the out-of-order WARNING of a backfill stamped two years back, folded behind
    a parsed live delivery, says how long it waited since it was journaled: at most the whole
    seconds since just before it was journaled, not since its `received_at`."""
    later = append(journal, delivery(body({"hr": [point(1, 60)]})))
    assert fold(journal, store, later, epoch).status == "parsed"
    before = clock.now_us()
    backfill = append(journal, delivery(body({"steps": [point(1, 5)]}), received_at=BASE_US))
    caplog.clear()

    report = fold(journal, store, backfill, epoch)
    waited_at_most = (clock.now_us() - before) // 1_000_000

    assert (report.status, report.out_of_order) == ("parsed", True)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    found = re.search(r"\(waited (\d+) s\)", warning)
    assert found is not None, warning
    assert 0 <= int(found.group(1)) <= waited_at_most


@pytest.mark.parametrize(
    "case", ["later_failed", "later_without_layer_elsewhere", "guard_off", "not_committed"]
)
def test_out_of_order_guard_stays_silent_fold_11(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """FOLD-11: no out-of-order warning when the later delivery failed (not JSON, or for want
    of a layer in another automation, which this one cannot pass on), when the guard is off
    (rebuilds), or when the fold does not commit."""
    later_body = b"not json" if case == "later_failed" else body({"hr": [point(1, 60)]})
    if case == "later_without_layer_elsewhere":
        later = append(journal, delivery(later_body, aggregation=None, automation="B"))
        assert fold(journal, store, later, epoch).reason == NO_LAYER
    else:
        later = append(journal, delivery(later_body))
        fold(journal, store, later, epoch)
    backfill = append(journal, delivery(body({"steps": [point(1, 5)]}), received_at=BASE_US))
    caplog.clear()

    if case == "not_committed":
        with faults.loaded(plan("fold.before_commit", {1}, Deferred)):
            report = fold(journal, store, backfill, epoch)
        assert report.outcome_class is OutcomeClass.DEFERRED
    else:
        report = fold(journal, store, backfill, epoch, guard=case != "guard_off")
        assert report.status == "parsed"

    assert not report.out_of_order
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_pruning_keeps_one_run_of_sequences_after_a_clock_step_stream_39(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STREAM-39: events stamped after the wall clock stepped back two hours look older than
    the ones before them; pruning drops only the oldest sequences, so what is left is one
    run, from just after the window's start to the head."""
    first = [append(journal, delivery(body({"hr": [point(n, n)]}))) for n in range(3)]
    for meta in first:
        store.fold(journal, meta, epoch)
    clock.jump(-7200)
    try:
        later = [append(journal, delivery(body({"hr": [point(n, n)]}))) for n in range(3, 6)]
        for meta in later:
            store.fold(journal, meta, epoch)
    finally:
        clock.jump(7200)
    an_hour_ago = clock.now_us() - 3600 * 10**6

    def left() -> list[int]:
        with closing(sqlite3.connect(store.path)) as conn:
            return [seq for (seq,) in conn.execute("SELECT seq FROM events ORDER BY seq")]

    assert store.prune_events(keep=2, older_than_us=an_hour_ago) == 0
    assert left() == list(range(1, 13))
    assert store.prune_events(keep=2, older_than_us=clock.now_us() + 1) == 10
    assert left() == [11, 12]
    assert store.event_window() == (10, 12)


def test_an_event_stamped_while_the_clock_was_ahead_does_not_stop_pruning_stream_39(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STREAM-39: an event stamped while the wall clock had jumped five years ahead does not
    count as young once the clock is back: the events older than the window before and after
    it are dropped beyond the newest two, and what is left is one run up to the head."""
    metas = [append(journal, delivery(body({"hr": [point(n, n)]}))) for n in range(4)]
    store.fold(journal, metas[0], epoch)
    clock.jump(5 * 365 * 86400)
    try:
        store.fold(journal, metas[1], epoch)
    finally:
        clock.jump(-5 * 365 * 86400)
    for meta in metas[2:]:
        store.fold(journal, meta, epoch)
    assert store.event_window() == (0, 8)

    assert store.prune_events(keep=2, older_than_us=clock.now_us() + 1) == 6
    assert store.event_window() == (6, 8)


DAY_S = 86400.0
WINDOW_S = 30 * DAY_S


def ack_days_ago(store: Store, name: str, seq: int, days: float) -> None:
    """Store an ACK as if it came ``days`` ago (a negative ``days``: ahead of now)."""
    clock.jump(-days * DAY_S)
    try:
        store.ack(name, seq)
    finally:
        clock.jump(days * DAY_S)


def remove_gone(store: Store) -> int:
    """What the retention pass does after pruning, with the default window of 30 days."""
    return store.remove_gone_subscribers(older_than_us=clock.now_us() - int(WINDOW_S * 1e6))


def test_gone_subscribers_are_removed_the_others_stay_stream_63_64(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STREAM-63, STREAM-64: a subscriber whose last ACK is older than the window and whose
    cursor is older than the window's start is removed; one with a recent last ACK (even one
    that did not move its cursor), or with its cursor at the window's start, stays; an ACK
    stamped while the clock was a year ahead does not count as recent. Once every event is
    pruned the window starts at the head. A removed subscriber's next ACK stores it again."""
    for n in range(5):
        store.fold(journal, append(journal, delivery(body({"hr": [point(n, n)]}))), epoch)
    store.prune_events(keep=4, older_than_us=clock.now_us() + 1)
    assert store.event_window() == (6, 10)
    ack_days_ago(store, "gone", 5, days=31)
    ack_days_ago(store, "at-start", 6, days=31)
    ack_days_ago(store, "recent", 2, days=29)
    ack_days_ago(store, "again", 3, days=31)
    ack_days_ago(store, "again", 2, days=1)
    ack_days_ago(store, "ahead", 2, days=-400)

    assert remove_gone(store) == 2
    assert store.subscribers() == {"at-start": 6, "recent": 2, "again": 3}
    assert remove_gone(store) == 0

    store.prune_events(keep=0, older_than_us=clock.now_us() + 1)
    assert store.event_window() == (10, 10)
    assert remove_gone(store) == 1
    assert store.subscribers() == {"recent": 2, "again": 3}

    store.ack("gone", 10)
    assert remove_gone(store) == 0
    assert store.subscribers() == {"recent": 2, "again": 3, "gone": 10}


async def retention_pass(store: Store, *, keep: int) -> RetentionStatistics:
    """Run the retention actor on ``store`` (a window of ``keep`` events and 30 days) until it
    has completed a whole pass: pruning and the removal of gone subscribers."""
    actor = RetentionActor(
        store, trio.CapacityLimiter(1), keep=keep, max_age_s=WINDOW_S, period_s=0.01
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        with trio.fail_after(10):
            # ``runs`` counts a pass once its events are pruned: the second count comes after
            # the first pass has removed its subscribers.
            while actor.statistics().runs < 2:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return actor.statistics()


async def test_subscribers_of_an_older_store_stay_through_the_next_retention_stream_65(
    tmp_path: Path,
) -> None:
    """STREAM-65: a store of the schema before subscribers had the time of their last ACK,
    holding subscribers behind a window of events 40 days old: opening it migrates it and
    stamps them with the migration's time (healthlog.clock), so the next retention pass prunes
    the events and keeps them all; a month later the one behind the window is removed."""
    path = tmp_path / "store.sqlite"
    conn = _sqlite.connect(path)
    try:
        # The schema up to the migration that gave subscribers the time of their last ACK.
        version = next(n for n, script in enumerate(MIGRATIONS) if "acked_at" in script)
        _sqlite.migrate(conn, MIGRATIONS[:version])
        old = clock.now_us() - 40 * 86400 * 10**6
        for n in range(10):
            conn.execute(
                "INSERT INTO events (id, kind, payload, at) VALUES (?, 'delivery.folded', '{}', ?)",
                (f"e{n}", old),
            )
        conn.executemany(
            "INSERT INTO subscribers (name, acked) VALUES (?, ?)", [("nas", 2), ("desk", 9)]
        )
    finally:
        conn.close()

    before = clock.now_us()
    with Store(path) as store:
        after = clock.now_us()
        with closing(sqlite3.connect(path)) as reader:
            stamps = dict(reader.execute("SELECT name, acked_at FROM subscribers"))
        assert set(stamps) == {"nas", "desk"}
        assert all(before <= stamp <= after for stamp in stamps.values())

        statistics = await retention_pass(store, keep=4)
        assert store.event_window() == (6, 10)
        assert (statistics.pruned, statistics.removed) == (6, 0)
        assert store.subscribers() == {"nas": 2, "desk": 9}

        clock.jump(WINDOW_S + DAY_S)
        try:
            statistics = await retention_pass(store, keep=4)
        finally:
            clock.jump(-(WINDOW_S + DAY_S))
        assert statistics.removed == 1
        assert store.subscribers() == {"desk": 9}


async def test_a_clock_behind_the_oldest_event_prunes_nothing_stream_185(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-185: a NAS without a battery-backed clock boots at 1970 and serves before NTP
    sets it: while its clock reads more than a day behind the oldest event held, retention
    drops no event and removes no subscriber, even after events are stamped at that clock,
    and says so once while it lasts; once the clock is set, the window's events are young
    again and stay."""
    for n in range(5):
        store.fold(journal, append(journal, delivery(body({"hr": [point(n, n)]}))), epoch)
    ack_days_ago(store, "follower", 2, days=31)
    boot_s = clock.now_us() / 1e6 - 300
    caplog.set_level(logging.INFO, logger="healthlog.retention")
    clock.jump(-boot_s)
    try:
        statistics = await retention_pass(store, keep=2)
        assert (statistics.pruned, statistics.removed) == (0, 0)
        store.fold(journal, append(journal, delivery(body({"hr": [point(5, 5)]}))), epoch)
        statistics = await retention_pass(store, keep=2)
        assert (statistics.pruned, statistics.removed) == (0, 0)
    finally:
        clock.jump(boot_s)
    assert store.event_window() == (0, 12)
    assert store.subscribers() == {"follower": 2}
    # Once by each of the two actors, each of which ran at least twice.
    said = [r.getMessage() for r in caplog.records if r.name == "healthlog.retention"]
    assert len(said) == 2
    assert all("behind the oldest event's stamp 20" in line for line in said)

    statistics = await retention_pass(store, keep=2)
    assert (statistics.pruned, statistics.removed) == (0, 0)
    assert store.event_window() == (0, 12)


def test_event_window_is_read_in_one_snapshot_store_27(
    tmp_path: Path, journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-27: the window through folding and pruning, and, read while another connection
    folds into an empty store, never pruned up to a head committed between two reads."""
    assert store.event_window() == (0, 0)
    metas = [append(journal, delivery(body({"hr": [point(n, n)]}))) for n in range(60)]

    def fold_elsewhere() -> None:
        with Store(tmp_path / "store.sqlite") as folder:
            for meta in metas:
                folder.fold(journal, meta, epoch)

    folding = threading.Thread(target=fold_elsewhere)
    folding.start()
    starts = set()
    while folding.is_alive():
        starts.add(store.event_window()[0])
    folding.join()
    assert starts == {0}
    head = store.event_window()[1]
    assert head == 2 * len(metas)
    assert store.event_window() == (0, head)
    store.prune_events(keep=2, older_than_us=2**62)
    assert store.event_window() == (head - 2, head)
    store.prune_events(keep=0, older_than_us=2**62)
    assert store.event_window() == (head, head)


def test_a_file_a_full_disk_cannot_open_says_the_disk_is_full_store_35(tmp_path: Path) -> None:
    """STORE-35: on a real file system filled to the last byte (a tmpfs), after the data
    directory's files were closed, `healthlog import` cannot open the journal (SQLite cannot
    make its ``-shm`` file) and says the disk is full and how much is free, not only
    ``disk I/O error``."""
    payload = tmp_path / "body.json"
    payload.write_bytes(body({"step_count": [point(0, 1.0)]}))
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        '"$PY" -m healthlog.cli import --aggregation minutes --data "$1/data" "$2" || exit 98\n'
        '"$PY" -m healthlog.cli status --data "$1/data" > /dev/null || exit 97\n'
        'head -c 2000000 /dev/zero > "$1/fill"\n'
        '"$PY" -m healthlog.cli import --no-wait --data "$1/data" "$2"\n'
        'echo "exit $?" >&2\n'
    )
    stderr = in_full_file_system(script, point_dir, payload)
    assert re.search(
        r"healthlog: database error: disk I/O error: the disk is full \(\d+ bytes free\),"
        r" free some space \(\S+/data/journal\.sqlite\)",
        stderr,
    ), stderr
    assert stderr.endswith("exit 3\n"), stderr


def _fold_summaries(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and " folded: " in r.getMessage()
    ]


def test_each_fold_logs_its_counters_without_values_merge_28(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """MERGE-28: every live fold that commits logs one INFO record with the delivery id, its
    status and its counters (metrics, points, objects, overwrites, held, erased), and no point
    value or device name; a rebuild's fold (guard off) says the same at DEBUG only."""
    device = "Anton's Watch Ultra"
    first = append(journal, delivery(body({"hr": [point(1, 61.25, source=device)]})))
    resend = append(journal, delivery(body({"hr": [point(1, 97.75, source=device)]})))
    broken = append(journal, delivery(b"not json"))
    caplog.set_level(logging.DEBUG, "healthlog")

    for meta in (first, resend, broken):
        assert fold(journal, store, meta, epoch).outcome_class is OutcomeClass.DONE

    summaries = _fold_summaries(caplog, logging.INFO)
    assert len(summaries) == 3
    assert summaries[0] == (
        f"delivery {first.id} folded: status=parsed metrics=1 sections=0 points=1 rejected=0"
        " objects=1 overwrites=0 held=0 erased=0"
    )
    assert summaries[1] == (
        f"delivery {resend.id} folded: status=parsed metrics=1 sections=0 points=1 rejected=0"
        " objects=1 overwrites=1 held=0 erased=1"
    )
    assert summaries[2].startswith(f"delivery {broken.id} folded: status=failed ")
    loud = "\n".join(r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG)
    for value in ("61.25", "97.75", device, "not json"):
        assert value not in loud

    caplog.clear()
    again = append(journal, delivery(body({"hr": [point(3, 62)]})))
    assert fold(journal, store, again, epoch, guard=False).status == "parsed"
    assert _fold_summaries(caplog, logging.INFO) == []
    assert len(_fold_summaries(caplog, logging.DEBUG)) == 1


def test_a_failed_or_partial_fold_says_why_in_its_line_run_96(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-96: the INFO line of a failed or partial fold ends with its recorded reason, which
    names what was wrong and quotes no value; a parsed fold's line has none."""
    bad_date = {"date": "31/02/2024 noon", "qty": 73.5}
    partial = append(journal, delivery(body({"hr": [point(1, 61.25), bad_date]})))
    broken = append(journal, delivery(b"{not json at all"))
    parsed = append(journal, delivery(body({"hr": [point(2, 62)]})))
    caplog.set_level(logging.INFO, "healthlog")

    for meta in (partial, broken, parsed):
        assert fold(journal, store, meta, epoch).outcome_class is OutcomeClass.DONE

    summaries = _fold_summaries(caplog, logging.INFO)
    assert summaries[0].endswith(
        " erased=0 reason=point rejected: unparseable date: timestamp does not match a"
        " supported date/time shape (x1)"
    ), summaries[0]
    assert summaries[1].endswith(
        " erased=0 reason=undecodable body: body is not a JSON object or array"
    ), summaries[1]
    assert summaries[2].endswith(" erased=0"), summaries[2]
    for value in ("61.25", "73.5", "31/02", "noon", "not json"):
        assert value not in "\n".join(summaries)


def test_a_fold_failed_over_its_budget_is_logged_merge_28(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """MERGE-28: a delivery recorded failed over its time budget is logged like any fold: at
    INFO by the live folder, at DEBUG by a rebuild."""
    meta = append(journal, delivery(body({"hr": [point(1, 60), point(2, 61)]})))
    rebuilt = append(journal, delivery(body({"hr": [point(3, 62), point(4, 63)]})))
    caplog.set_level(logging.DEBUG, "healthlog")

    def over() -> None:
        raise BudgetExceeded

    report = store.fold(journal, meta, epoch, check_budget=over)

    assert report.status == "failed"
    summaries = _fold_summaries(caplog, logging.INFO)
    assert len(summaries) == 1
    assert summaries[0].startswith(f"delivery {meta.id} folded: status=failed ")

    caplog.clear()
    assert store.fold(journal, rebuilt, epoch, guard=False, check_budget=over).status == "failed"
    assert _fold_summaries(caplog, logging.INFO) == []
    assert len(_fold_summaries(caplog, logging.DEBUG)) == 1


def test_event_window_reads_the_ends_of_the_key_only_store_48(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-48: with 20,000 events stored, reading the window takes a handful of SQLite's
    steps, not one per event (min and max in one SELECT read every event: 82 ms at 442,656,
    ten times a second while a follower waits)."""
    store.fold(journal, append(journal, delivery(body({"hr": [point(0, 1)]}))), epoch)
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.executemany(
            "INSERT INTO events (id, kind, payload, at) VALUES (?, 'delivery.folded', '{}', 0)",
            ((f"filler.{n}",) for n in range(20_000)),
        )
    head = store.event_window()[1]
    window, steps = counted_steps(store._conn, store.event_window)
    assert window == (0, head)
    assert steps < 10, steps


FOLDED_FOR_TOTALS = 600
LATER_CHECKPOINT_COLUMNS = ("outcomes", "outcome_ids")
"""The columns the migrations after the counters' totals add (STORE-60)."""
LATER_EVENT_COLUMNS = ("tag",)
"""The column the migration after the checkpoint's adds (STREAM-111)."""
TOTALS = ("points", "points_erased", "overwrites", "objects_written", "points_rejected")


def summed_over_outcomes(path: str | Path) -> dict[str, int]:
    """Each of :data:`TOTALS` summed over every outcome's counters, read the long way."""
    with closing(sqlite3.connect(path)) as conn:
        return {
            name: int(
                conn.execute(f"SELECT sum(counters ->> '{name}') FROM outcomes").fetchone()[0]
            )
            for name in TOTALS
        }


def test_counter_totals_read_a_row_per_counter_store_58(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-58: with 600 deliveries folded (each re-sending a changed point of the one
    before), the fold counters' totals (``/metrics``) are what summing every outcome gives,
    read in a few of SQLite's steps, not a few per outcome; a reindex rebuilds them with the
    outcomes (totals lost meanwhile come back), and a store from before their table gets it
    filled at its upgrade.
    (Before, each scrape of ``/metrics`` read every outcome's counters: 0.25 s at 508,000
    deliveries, with the store's one thread held meanwhile.)"""
    for n in range(FOLDED_FOR_TOTALS):
        points = {"hr": [point(n, n), point(n + 1, n)]}
        fold(journal, store, append(journal, delivery(body(points))), epoch)
    expected = summed_over_outcomes(store.path)
    assert expected["overwrites"] == FOLDED_FOR_TOTALS - 1, expected
    totals, steps = counted_steps(store._conn, functools.partial(store.counter_totals, TOTALS))
    assert totals == expected
    assert steps < 10, steps

    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("DELETE FROM counter_totals")
    assert store.counter_totals(TOTALS) == dict.fromkeys(TOTALS, 0)
    reindex(journal, store, "reindex")
    assert store.counter_totals(TOTALS) == summed_over_outcomes(store.path) == expected

    store.close()
    before_totals = next(v for v, script in enumerate(MIGRATIONS) if "counter_totals" in script)
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute("DROP TABLE counter_totals")
        for column in LATER_CHECKPOINT_COLUMNS:
            conn.execute(f"ALTER TABLE checkpoint DROP COLUMN {column}")
        for column in LATER_EVENT_COLUMNS:
            conn.execute(f"ALTER TABLE events DROP COLUMN {column}")
        conn.execute(f"PRAGMA user_version = {before_totals}")
    with Store(store.path) as upgraded:
        assert upgraded.counter_totals(TOTALS) == expected


def pending_steps(journal: Journal, store: Store) -> tuple[list[int], int, int]:
    """The ids a pass's selection selects, and how many of SQLite's steps (in hundreds) it took
    on the store's connection and on the journal's."""
    select = functools.partial(pending, journal, store)
    (metas, journal_steps), store_steps = counted_steps(
        store._conn, functools.partial(counted_steps, journal._conn, select)
    )
    return [meta.id for meta in metas], store_steps, journal_steps


def test_a_pass_selects_from_the_deliveries_after_the_checkpoint_store_60(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-60: with 600 deliveries folded, a pass's selection of the pending ones (and with it
    every status and scrape) takes a few of SQLite's steps on each file, not a few per
    delivery, and selects the one journaled since; so again after a reindex, and in a store
    from before the kept totals, once its upgrade has filled them. A backfill journaled behind
    the checkpoint is still found. (Before, each selection counted every outcome and every
    delivery up to the checkpoint: 0.4 s at 508,000 deliveries, at every pass.)"""
    for n in range(FOLDED_FOR_TOTALS):
        fold(journal, store, append(journal, delivery(body({"hr": [point(n, n)]}))), epoch)
    assert pending_steps(journal, store)[0] == []  # the journal's totals, counted once
    new = append(journal, delivery(body({"hr": [point(0, 1)]})))
    ids, store_steps, journal_steps = pending_steps(journal, store)
    assert ids == [new.id]
    assert max(store_steps, journal_steps) < 10, (store_steps, journal_steps)

    fold(journal, store, new, epoch)
    reindex(journal, store, "reindex")
    newer = append(journal, delivery(body({"hr": [point(1, 1)]})))
    ids, store_steps, journal_steps = pending_steps(journal, store)
    assert ids == [newer.id]
    assert max(store_steps, journal_steps) < 10, (store_steps, journal_steps)

    store.close()
    before_checkpoint = next(v for v, script in enumerate(MIGRATIONS) if "outcome_ids" in script)
    with closing(sqlite3.connect(store.path)) as conn, conn:
        for column in LATER_CHECKPOINT_COLUMNS:
            conn.execute(f"ALTER TABLE checkpoint DROP COLUMN {column}")
        for column in LATER_EVENT_COLUMNS:
            conn.execute(f"ALTER TABLE events DROP COLUMN {column}")
        conn.execute(f"PRAGMA user_version = {before_checkpoint}")
    with Store(store.path) as upgraded:
        ids, store_steps, journal_steps = pending_steps(journal, upgraded)
        assert ids == [newer.id]
        assert max(store_steps, journal_steps) < 10, (store_steps, journal_steps)
        backfill = append(journal, delivery(body({"hr": [point(2, 1)]}), received_at=BASE_US))
        assert pending_steps(journal, upgraded)[0] == [backfill.id, newer.id]


STATUS_BACKLOG = 4000


def test_status_reads_the_backlog_without_holding_it_store_70(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-70: with 4,000 deliveries waiting behind one folded, the status document (which
    every `status`, `/v1/status` and `/metrics` scrape reads) counts them and names the oldest
    while holding less than 256 KiB of Python memory at its peak, however many wait. (Before, it
    built the metadata of every waiting delivery to count them: 2.6 MB at its peak here, about
    650 bytes per waiting delivery at every scrape, 33 MB for a backlog of 50,000.)"""
    fold(journal, store, append(journal, delivery(body({"hr": [point(0, 1)]}))), epoch)
    journal.append_many(
        [delivery(body({"hr": [point(n, n)]})) for n in range(1, STATUS_BACKLOG + 1)]
    )
    oldest = journal.iter_order(limit=2)[1]
    tracemalloc.start()
    try:
        status = collect_status(journal, store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status.deliveries.pending == STATUS_BACKLOG
    assert status.deliveries.parsed == 1
    assert status.lag.oldest_pending_id == oldest.id
    assert status.journal.deliveries == STATUS_BACKLOG + 1
    assert peak < 256 * 2**10, peak


def test_an_hour_range_reads_only_its_hours_store_49(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-49: of 1,440 objects (two metrics of 700 hours in minutes, one of 40 in hours),
    an hour range without metric or layer reads a few of SQLite's steps per object it yields,
    not every object of the file, and yields what a filter over all objects does, for each
    combination of metric and layer."""
    hourly = [point(60 * h, h) for h in range(700)]
    store.fold(journal, append(journal, delivery(body({"hr": hourly, "steps": hourly}))), epoch)
    hours = delivery(body({"hr": hourly[:40]}), aggregation="hours")
    store.fold(journal, append(journal, hours), epoch)
    everything = list(store.iter_objects())
    assert len(everything) == 1440
    first, last = BASE_US + 30 * US_PER_HOUR, BASE_US + 31 * US_PER_HOUR

    def keys(metric: str | None, layer: str | None) -> list[ObjectKey]:
        objects = store.iter_objects(metric=metric, layer=layer, hour_from=first, hour_to=last)
        return [o.key for o in objects]

    for metric, layer in [(None, None), ("hr", None), (None, "hours"), ("steps", "minutes")]:
        expected = [
            o.key
            for o in everything
            if first <= o.key.hour <= last
            and metric in (None, o.key.metric)
            and layer in (None, o.key.layer)
        ]
        found, steps = counted_steps(store._conn, functools.partial(keys, metric, layer))
        assert found == expected, (metric, layer)
        assert steps < 10 * len(expected), (metric, layer, steps)


def test_a_buddhist_era_year_is_read_as_its_gregorian_year_parse_41(
    journal: Journal, store: Store, epoch: int
) -> None:
    """PARSE-41: a phone set to the Buddhist calendar writes 2567 for 2024; its points are stored
    at the Gregorian instants (29 February 2567 is 29 February 2024, a leap day), and the same
    points re-sent by a phone set to the Gregorian calendar are the same points, unchanged."""
    buddhist = [
        {"date": "2567-02-29 10:00:00 +0700", "qty": 1},
        {"date": "2567-03-01 1:05:00\u202fpm +0700", "qty": 2},
        {"startDate": "2567-03-01", "endDate": "2567-03-02", "value": "Core"},
    ]
    gregorian = [
        {"date": "2024-02-29 10:00:00 +0700", "qty": 1},
        {"date": "2024-03-01 1:05:00\u202fpm +0700", "qty": 2},
        {"startDate": "2024-03-01", "endDate": "2024-03-02", "value": "Core"},
    ]
    first = store.fold(journal, append(journal, delivery(body({"s": buddhist}))), epoch)
    again = store.fold(journal, append(journal, delivery(body({"s": gregorian}))), epoch)

    assert (first.status, again.status) == ("parsed", "parsed")
    resent = store.outcome(again.delivery_id)
    assert resent is not None
    assert (resent.counters["points_new"], resent.counters["points_unchanged"]) == (0, 3)
    stored = {
        coordinates: raw
        for stored_object in store.iter_objects()
        for coordinates, raw in objects.decode(stored_object.body).items()
    }
    day = 24 * US_PER_HOUR
    leap_day = 1_709_175_600_000_000  # 2024-02-29T03:00:00Z
    march_first = leap_day + day - 3 * US_PER_HOUR  # 2024-03-01T00:00:00Z
    assert sorted(stored) == [
        (leap_day, leap_day),
        (march_first, march_first + day),
        (march_first + 6 * US_PER_HOUR + 5 * 60_000_000,) * 2,
    ]
    assert sorted(stored.values()) == sorted(orjson.dumps(p) for p in buddhist)


async def test_a_large_prune_keeps_the_wal_small_store_88(tmp_path: Path) -> None:
    """STORE-88: 60,000 events past the window (as a reindex that changed every object leaves
    them for the retention 30 days later) are pruned by one retention pass, a batch of
    PRUNE_BATCH events per transaction, so that store.sqlite-wal stays under WAL_SIZE_LIMIT,
    and the store takes other writes between the batches; the newest `keep` stay."""
    path = tmp_path / "store.sqlite"
    with Store(path):
        pass
    payload = orjson.dumps({"metric": "hr", "layer": "minutes", "hash": "00" * 32}).decode()
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO events (id, kind, payload, at) VALUES (?, 'object.changed', ?, 1)",
            ((f"old.{n}", payload * 3) for n in range(60_000)),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with Store(path) as store:
        statistics = await retention_pass(store, keep=1_000)
        assert statistics.pruned == 59_000
        assert store.event_window() == (59_000, 60_000)
        # Its largest transaction's size, or the limit it is cut back to when that was larger.
        assert os.stat(f"{path}-wal").st_size < WAL_SIZE_LIMIT


# Every hour of a day of two metrics at each minute, with sources and contexts: object bodies of
# 1,039 to 1,895 bytes compressed, over the 1,000 bytes a WITHOUT ROWID table keeps in its page.
DAYS = tuple(
    make_body(seed, hours=24, start=DEFAULT_START + timedelta(days=seed), richness=2)
    for seed in range(2)
)
LOAD_PLAN = "from healthlog.storage import faultplan; faultplan.load_environment()"
OBJECT_COLUMNS = "metric, layer, hour, units, first, last, points, created_by, hash, sealed, body"


def objects_layout(path: Path) -> tuple[int, int, int]:
    """The overflow pages and bytes of the objects table and its key, and the bodies' bytes."""
    with closing(sqlite3.connect(path)) as conn:
        overflow, size = conn.execute(
            "SELECT sum(pagetype = 'overflow'), sum(pgsize) FROM dbstat"
            " WHERE name IN ('objects', 'objects_key')"
        ).fetchone()
        (bodies,) = conn.execute("SELECT sum(length(body)) FROM objects").fetchone()
    return overflow, size, bodies


def fold_days(data: DataDir) -> None:
    with data.open_journal() as journal, data.open_store() as store:
        epoch = store.acquire_lease("t", now=BASE_US, ttl=TTL)
        assert epoch is not None
        for day in DAYS:
            report = fold(journal, store, append(journal, delivery(day)), epoch)
            assert report.outcome_class is OutcomeClass.DONE


@pytest.mark.parametrize("workers", [1, 2])
def test_object_bodies_stay_in_their_pages_store_90(tmp_path: Path, workers: int) -> None:
    """STORE-90: objects of 1 to 2 KB bodies, folded and then reindexed (in one process, and in
    partitions whose scratch files the swap copies from) take no overflow page, and the objects
    table with its key takes at most 1.5 times the bodies' bytes; verify finds no difference."""
    data = DataDir(tmp_path)
    fold_days(data)
    with closing(sqlite3.connect(data.store_path)) as conn:
        lengths = [n for (n,) in conn.execute("SELECT length(body) FROM objects")]
    assert len(lengths) == 96
    assert min(lengths) > 1_000
    folded = rows(data.store_path)["objects"]
    overflow, size, bodies = objects_layout(data.store_path)
    assert overflow == 0
    assert size <= 1.5 * bodies
    with data.open_journal() as journal, data.open_store() as store:
        reindex(journal, store, "t", workers=workers)
        assert verify(journal, store, workers=workers) == []
    assert rows(data.store_path)["objects"] == folded
    overflow, size, bodies = objects_layout(data.store_path)
    assert overflow == 0
    assert size <= 1.5 * bodies


# The store's schema version before its objects had a rowid.
BEFORE_ROWID = next(v for v, script in enumerate(MIGRATIONS) if "objects_by_rowid" in script)


def as_without_rowid(path: Path) -> None:
    """Make the store at ``path`` one of the schema before its objects had a rowid."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        conn.execute(
            "CREATE TABLE objects_old (metric TEXT NOT NULL, layer TEXT NOT NULL,"
            " hour INTEGER NOT NULL, units TEXT, first INTEGER NOT NULL, last INTEGER NOT NULL,"
            " points INTEGER NOT NULL, created_by INTEGER NOT NULL, hash BLOB NOT NULL,"
            " sealed INTEGER NOT NULL DEFAULT 0, body BLOB NOT NULL,"
            " PRIMARY KEY (metric, layer, hour)) WITHOUT ROWID"
        )
        conn.execute(f"INSERT INTO objects_old SELECT {OBJECT_COLUMNS} FROM objects")
        conn.execute("DROP TABLE objects")
        conn.execute("ALTER TABLE objects_old RENAME TO objects")
        conn.execute(f"PRAGMA user_version = {BEFORE_ROWID}")
        conn.execute("COMMIT")


def test_a_store_of_the_older_layout_is_migrated_whole_store_91(tmp_path: Path, cli: Cli) -> None:
    """STORE-91: a store whose objects are in the older WITHOUT ROWID table (every body on an
    overflow page): a process killed (SIGKILL) in the middle of the migration leaves it as it
    was, every row there; opened again, its objects move into the rowid table in one step,
    every column of every row the same, with no overflow page left, writing less -wal than the
    old table's size (its freed pages are not zeroed one by one), and `verify` exits 0."""
    data = DataDir(tmp_path)
    fold_days(data)
    as_without_rowid(data.store_path)
    before = rows(data.store_path)
    overflow, size, _ = objects_layout(data.store_path)
    assert overflow == 96

    plan = json.dumps({"schema.migrate": {"hits": [1], "do": "kill"}})
    opening = f"from healthlog.storage.store import Store; Store({str(data.store_path)!r})"
    killed = subprocess.run(
        [sys.executable, "-c", f"{LOAD_PLAN}; {opening}"],
        env={**os.environ, PLAN_ENV: plan},
        capture_output=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with closing(sqlite3.connect(data.store_path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (BEFORE_ROWID,)
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert rows(data.store_path) == before
    assert objects_layout(data.store_path)[0] == 96

    with data.open_store():
        # The old table's pages are freed, not zeroed through the -wal one by one.
        assert os.path.getsize(f"{data.store_path}-wal") < size
    assert cli("verify", "--data", tmp_path).code == 0
    with closing(sqlite3.connect(data.store_path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (len(MIGRATIONS),)
    assert rows(data.store_path) == before
    overflow, migrated, bodies = objects_layout(data.store_path)
    assert overflow == 0
    assert migrated <= 1.5 * bodies < size / 2
