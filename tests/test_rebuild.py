"""Rebuild, verify and reindex against real SQLite files (specs/storage.md, STORE-n)."""

from __future__ import annotations

import fcntl
import gc
import gzip
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import attrs
import orjson
import pytest
import trio
from _bodies import (
    BASE_US,
    BUDDHIST_ERA_STEPS,
    NOW,
    ONE_MOMENT_RECORDS,
    TTL,
    append,
    body,
    delivery,
    fold_as_before_merge_35,
    fold_as_before_parse_41,
    point,
    rows,
)
from _bodies import stamp as minute_stamp
from _disk import (
    DISK_ERROR,
    files_limited_to,
    in_full_file_system,
    on_remounted_read_only,
    python_for_all,
    reachable_home,
)
from _hostile_corpus import corpus
from _runtime_helpers import alive, children_of, config
from _service_helpers import write_minute_body
from _summaries import summaries
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.runtime import open_runtime
from healthlog import faults, objects
from healthlog.fold import DeliveryFold, Outcome
from healthlog.folding import FoldPass, OutcomeClass
from healthlog.merge import Counters
from healthlog.objects import ObjectKey
from healthlog.seals import SEAL_CLIENT, SEAL_CONTENT_TYPE, Seal
from healthlog.storage import _partition, rebuild
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import DeliveryMeta, Journal, NewDelivery
from healthlog.storage.passes import Budget, run_pass
from healthlog.storage.rebuild import (
    Difference,
    RebuildError,
    rebuild_into,
    reindex,
    verify,
    verify_all,
)
from healthlog.storage.store import OUT_OF_MEMORY, WORKER_DIED, Store
from healthlog.timestamps import format_instant
from healthlog.workload import big_body, encode, window

if TYPE_CHECKING:
    from conftest import Cli, RunCli

HR = ObjectKey("hr", "minutes", BASE_US)
# Less than what one object's summary (key, hash, counts) takes in memory.
SUMMARY_BYTES = 150


def collide(journal: Journal, store: Store, epoch: int) -> None:
    """A live delivery folded, then a backfill before it with equally complete other values."""
    append(journal, delivery(body({"hr": [point(1, 60)], "steps": [point(2, 10)]})))
    run_pass(journal, store, epoch)
    append(journal, delivery(body({"hr": [point(1, 99)]}), received_at=BASE_US))
    run_pass(journal, store, epoch)


def test_verify_finds_nothing_after_folding_in_journal_order_store_12(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-12: overlapping deliveries folded in journal order equal their rebuild; a
    delivery journaled since, not folded yet, is not part of it."""
    rich = {"source": "Watch", "context": "walk"}
    for stamp, points in [
        (BASE_US + 3, [point(1, 60), point(2, 61)]),
        (BASE_US + 1, [point(1, 60.0000000000001, **rich), point(61, 70)]),
        (BASE_US + 2, [point(1, 59), point(2, 62, **rich)]),
        (None, [point(2, 63), point(62, 71, **rich)]),
    ]:
        append(journal, delivery(body({"hr": points}), received_at=stamp))

    run_pass(journal, store, epoch)
    append(journal, delivery(body({"hr": [point(1, 58), point(3, 64)]})))

    assert verify(journal, store) == []


def _out_of_memory(_: str) -> None:
    raise MemoryError


def give_up(cause: str, journal: Journal, store: Store, epoch: int, meta: Any) -> str:
    """Fail ``meta`` live for the machine's ``cause``: its reason."""
    if cause == "budget":
        run_pass(journal, store, epoch, budget=Budget(base_s=0, per_mib_s=0))
    elif cause == "memory":
        plan = faults.Plan(actions={"fold.begin": faults.Action(frozenset({1}), _out_of_memory)})
        with faults.loaded(plan):
            run_pass(journal, store, epoch)
    else:
        # What the folding actor records after WORKER_DEATHS lost workers (RUN-30).
        store.fail(meta, epoch, WORKER_DIED)
    outcome = store.outcome(meta.id)
    assert outcome is not None
    return outcome.reason


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    ("cause", "says"),
    [
        ("budget", "verify: 1 deliveries failed over their fold's time budget"),
        ("memory", "verify: 1 deliveries failed out of memory"),
        ("worker", "verify: 1 deliveries failed because their fold worker died"),
    ],
)
def test_a_fold_the_machine_gave_up_verifies_as_failed_and_reindex_folds_it_store_31(
    journal: Journal,
    store: Store,
    epoch: int,
    tmp_path: Path,
    cli: Cli,
    workers: int,
    cause: str,
    says: str,
) -> None:
    """STORE-31: a delivery failed live for a cause of the machine's (over its fold budget, out
    of memory, or its fold worker died twice), and its successor, which found no layer to
    inherit, verify clean: the rebuild keeps the first failed with its reason, as the live
    fold decided, and the command says so; reindex folds both, and verifies clean after."""
    heavy = append(journal, delivery(body({"hr": [point(1, 60), point(2, 61)]})))
    reason = give_up(cause, journal, store, epoch, heavy)
    inheriting = append(journal, delivery(body({"hr": [point(61, 70)]}), aggregation=None))
    run_pass(journal, store, epoch)
    statuses = [store.outcome(meta.id) for meta in (heavy, inheriting)]
    assert reason in {"fold over its time budget", OUT_OF_MEMORY, WORKER_DIED}
    assert [(o.status, o.reason) for o in statuses if o is not None] == [
        ("failed", reason),
        ("failed", "layer not derivable: no header, no dense metric, no history"),
    ]
    assert summaries(store) == {}

    assert verify(journal, store, workers=workers) == []
    store.release_lease("folder", epoch)
    run = cli("verify", "--data", tmp_path)
    assert run.code == 0, run.err
    assert says in run.err

    reindex(journal, store, "reindex", workers=workers)
    folded = [store.outcome(meta.id) for meta in (heavy, inheriting)]
    assert [(o.status, o.layer) for o in folded if o is not None] == [("parsed", "minutes")] * 2
    assert {key.hour for key in summaries(store)} == {BASE_US, BASE_US + 3600 * 10**6}
    assert verify(journal, store, workers=workers) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_backfill_collision_is_found_and_reindex_repairs_it_store_13(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, workers: int
) -> None:
    """STORE-13: a backfill that collides with folded content makes verify report the object;
    reindex makes the live objects equal a fresh rebuild (in one process or partitioned)."""
    collide(journal, store, epoch)
    live_hash = summaries(store)[HR].hash

    differences = verify(journal, store, workers=workers)

    assert [d.key for d in differences] == [HR]
    assert differences[0].live == live_hash
    assert differences[0].rebuilt not in (None, live_hash)

    assert reindex(journal, store, "reindex", workers=workers) == 1
    assert verify(journal, store, workers=workers) == []
    rebuild_into(journal, tmp_path / "fresh.sqlite")
    with Store(tmp_path / "fresh.sqlite") as fresh:
        assert list(store.iter_objects()) == list(fresh.iter_objects())
    (hr,) = store.iter_objects(metric="hr")
    assert [orjson.loads(raw)["qty"] for raw in objects.decode(hr.body).values()] == [60]


def test_reindex_takes_a_higher_epoch_and_fences_the_folder_store_14(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-14: reindex takes the lease from the live folder, whose lease has not expired, by
    force, folds under a higher epoch and releases the lease; the folder holding the old epoch
    is fenced until it takes the lease again."""
    collide(journal, store, epoch)
    assert store.acquire_lease("folder", now=time.time_ns() // 1000, ttl=TTL) == epoch

    reindex(journal, store, "reindex")
    meta = append(journal, delivery(body({"hr": [point(5, 1)]})))

    lease = store.lease()
    assert (lease.holder, lease.epoch) == (None, epoch + 1)
    assert store.checkpoint()[2] == epoch + 1
    assert store.fold(journal, meta, epoch).outcome_class is OutcomeClass.FENCED
    assert store.outcome(meta.id) is None
    again = store.acquire_lease("folder", now=NOW, ttl=TTL)
    assert again == epoch + 2
    assert store.fold(journal, meta, again).outcome_class is OutcomeClass.DONE


def test_reindex_announces_the_deliveries_only_the_rebuild_folded_store_34(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-34: a delivery journaled but not yet folded when reindex runs is folded by the
    rebuild: the swap appends its object's ``object.changed`` and its ``delivery.folded``
    (none for the delivery folded live before), and every outcome carries the reindex epoch."""
    folded = append(journal, delivery(body({"hr": [point(1, 60)]})))
    run_pass(journal, store, epoch)
    pending = append(journal, delivery(body({"steps": [point(2, 10)]})))
    last = store.event_window()[1]

    assert reindex(journal, store, "reindex") == 1

    reindexed = epoch + 1
    steps = summaries(store)[ObjectKey("steps", "minutes", BASE_US)]
    outcome = store.outcome(pending.id)
    assert outcome is not None
    assert (outcome.status, outcome.counters["objects_written"]) == ("parsed", 1)
    assert [(e.id, e.kind, e.payload) for e in store.events_after(last, 9)] == [
        (
            f"reindex.{reindexed}.1",
            "object.changed",
            {
                "metric": "steps",
                "layer": "minutes",
                "hour": "2024-03-01T00:00:00Z",
                "hash": steps.hash.hex(),
                "points": 1,
                "delivery_id": None,
            },
        ),
        (
            f"reindex.{reindexed}.{pending.id}.folded",
            "delivery.folded",
            {"delivery_id": pending.id, "status": "parsed", "counters": outcome.counters},
        ),
    ]
    epochs = {row[0]: row[-1] for row in rows(store.path)["outcomes"]}
    assert epochs == {folded.id: reindexed, pending.id: reindexed}


@pytest.mark.parametrize("workers", [1, 2])
def test_swap_in_announces_only_changed_objects_and_keeps_history_store_15(
    journal: Journal, store: Store, epoch: int, workers: int
) -> None:
    """STORE-15: reindex appends object.changed only for objects whose hash changed (a vanished
    one with zero points), after the existing events, with no gap; a second reindex adds none
    and writes no object row (a trigger of the test's own counts the writes).
    The same whether the rebuild runs in one process or partitioned. STORE-43: the swap writes
    and deletes, by key, exactly the rows it found to differ."""
    append(
        journal,
        delivery(body({"hr": [point(1, 60)]}), received_at=BASE_US + 1, aggregation="hours"),
    )
    sparse = body({"weight": [point(30, 80.5)]})
    append(journal, delivery(sparse, received_at=BASE_US + 3, aggregation=None))
    run_pass(journal, store, epoch)
    late = body({"steps": [point(2, 10), point(3, 11)]})
    append(journal, delivery(late, received_at=BASE_US + 2, aggregation="minutes"))
    run_pass(journal, store, epoch)
    before = sorted(rows(store.path)["events"])
    unchanged = {k: s.hash for k, s in summaries(store).items() if k.metric != "weight"}

    assert reindex(journal, store, "reindex", workers=workers) == 2

    after = sorted(rows(store.path)["events"])
    assert after[: len(before)] == before
    assert [seq for seq, *_ in after] == list(range(1, len(after) + 1))
    added = [e.payload for e in store.events_after(before[-1][0], 1000)]
    live = summaries(store)
    weight = ObjectKey("weight", "minutes", BASE_US)
    assert sorted(added, key=lambda p: p["layer"]) == [
        {
            "metric": "weight",
            "layer": "hours",
            "hour": "2024-03-01T00:00:00Z",
            "hash": None,
            "points": 0,
            "delivery_id": None,
        },
        {
            "metric": "weight",
            "layer": "minutes",
            "hour": "2024-03-01T00:00:00Z",
            "hash": live[weight].hash.hex(),
            "points": 1,
            "delivery_id": None,
        },
    ]
    assert {k: live[k].hash for k in unchanged} == unchanged

    with closing(sqlite3.connect(store.path, isolation_level=None)) as conn:
        conn.execute("CREATE TABLE object_writes (kind TEXT)")
        for kind in ("INSERT", "UPDATE", "DELETE"):
            conn.execute(
                f"CREATE TRIGGER object_{kind.lower()} AFTER {kind} ON objects"
                f" BEGIN INSERT INTO object_writes VALUES ('{kind}'); END"
            )
    assert reindex(journal, store, "reindex", workers=workers) == 0
    assert sorted(rows(store.path)["events"]) == after
    assert rows(store.path)["object_writes"] == []


spec_point = st.tuples(
    st.sampled_from(["hr", "steps"]),
    st.sampled_from([0, 1, 60]),
    st.sampled_from([1, 2, 2.0000000000001]),
    st.booleans(),
)
spec_delivery = st.tuples(
    st.none() | st.integers(0, 4),
    st.sampled_from(["minutes", None]),
    st.sampled_from(["A", "B"]),
    st.lists(spec_point, min_size=1, max_size=6),
)


DeliverySpec = tuple[int | None, str | None, str, list[tuple[str, int, float, bool]]]


def journal_specs(journal: Journal, specs: list[DeliverySpec]) -> None:
    """Journal the deliveries ``spec_delivery`` drew: (offset of a backfill stamp, header,
    automation, points as (metric, minute, qty, rich))."""
    for offset, aggregation, automation, points in specs:
        metrics: dict[str, list[dict[str, Any]]] = {}
        for metric, minute, qty, rich in points:
            extra = {"source": "Watch", "context": "run"} if rich else {}
            metrics.setdefault(metric, []).append(point(minute, qty, **extra))
        stamp = None if offset is None else BASE_US + offset
        append(
            journal,
            delivery(
                body(metrics), received_at=stamp, aggregation=aggregation, automation=automation
            ),
        )


@contextmanager
def scratch_data() -> Iterator[tuple[Path, Journal, Store]]:
    """A temporary directory with a journal and a store in it: a hypothesis example cannot
    use ``tmp_path``, which one test shares between its examples."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Journal(Path(tmp) / "journal.sqlite") as journal,
        Store(Path(tmp) / "store.sqlite") as store,
    ):
        yield Path(tmp), journal, store


def fold_live(journal: Journal, store: Store) -> FoldPass[DeliveryMeta]:
    """One pass of the live folder over ``journal``, under a lease of its own."""
    held = store.acquire_lease("folder", now=NOW, ttl=TTL)
    assert held is not None
    return run_pass(journal, store, held)


@settings(max_examples=30, deadline=None)
@given(st.lists(spec_delivery, min_size=2, max_size=6))
def test_any_deliveries_folded_in_journal_order_verify_clean_store_16(
    specs: list[DeliverySpec],
) -> None:
    """STORE-16: random overlapping deliveries folded in journal order verify clean."""
    with scratch_data() as (_, journal, store):
        journal_specs(journal, specs)
        assert fold_live(journal, store).stopped_because == "empty"

        assert verify(journal, store) == []


def corrupt(path: Path, delivery_id: int) -> None:
    """Flip one byte of a journaled body on disk, behind the journal's back."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER deliveries_no_update")
        (stored,) = conn.execute(
            "SELECT body FROM deliveries WHERE id = ?", (delivery_id,)
        ).fetchone()
        flipped = bytearray(stored)
        flipped[len(flipped) // 2] ^= 0x01
        conn.execute("UPDATE deliveries SET body = ? WHERE id = ?", (bytes(flipped), delivery_id))


def rebuilt(journal: Journal, path: Path, workers: int) -> dict[str, list[tuple[Any, ...]]]:
    """The objects, outcomes and checkpoint of a fresh rebuild with ``workers`` processes."""
    rebuild_into(journal, path, workers=workers)
    tables = rows(path)
    return {name: tables[name] for name in ("objects", "outcomes", "checkpoint")}


def with_records(payload: bytes, **sections: list[dict[str, Any]]) -> bytes:
    """``payload`` with record sections beside its metrics."""
    document = orjson.loads(payload)
    document["data"].update(sections)
    return orjson.dumps(document)


def mixed_journal(journal: Journal, tmp_path: Path) -> None:
    """Deliveries meeting every case a delivery-wide decision of the fold has."""
    day = [point(m, m % 7, source="Watch") for m in range(0, 150, 3)]
    workout = {"name": "Walk", "start": minute_stamp(20), "end": minute_stamp(50)}
    three = body({"hr": day, "steps": day[::2], "energy": day[1::2]})
    append(journal, delivery(with_records(three, workouts=[workout])))
    # No header: the layer comes from the spacing of all metrics, the sparse one included.
    dense = {"hr": [point(1, 61), point(2, 62)], "weight": [point(3, 80.5)]}
    append(journal, delivery(body(dense), aggregation=None))
    # No header, no spacing: inherited from the automation's predecessor; or not derivable.
    append(journal, delivery(body({"weight": [point(30, 81)]}), aggregation=None))
    append(journal, delivery(body({"weight": [point(31, 82)]}), aggregation=None, automation="B"))
    append(journal, delivery(b"not json at all"))
    # Rejected points: partial, and failed when nothing could be read.
    bad = [
        {"qty": 1},
        {"date": "yesterday", "qty": 2},
        {"date": minute_stamp(5), "end": minute_stamp(1)},
    ]
    append(journal, delivery(body({"hr": [point(7, 70), *bad], "steps": [bad[0]]})))
    append(journal, delivery(body({"hr": bad, "steps": bad[:1]})))
    # No header, no history, no metric element readable: no layer is needed, and its workout
    # joins an hour of records a partition holds already.
    run = {"name": "Run", "start": minute_stamp(25), "end": minute_stamp(40)}
    unreadable = with_records(body({"hr": bad}), workouts=[run])
    append(journal, delivery(unreadable, aggregation=None, automation="C"))
    # Re-sends: conflicting, poorer and richer; other units than stored.
    append(journal, delivery(body({"hr": [point(m, 99) for m in range(0, 150, 3)]})))
    append(journal, delivery(body({"steps": [point(0, 0)]}, units="km")))
    richer = [point(m, m % 7, source="Watch", context="run") for m in range(3, 150, 6)]
    append(journal, delivery(body({"energy": richer})))
    # Metrics without points: their units still count, in whichever partition.
    entries = [
        {"name": "x", "units": "a", "data": []},
        {"name": "x", "units": "b", "data": []},
        {"name": "hr", "units": "count", "data": [point(200, 1)]},
    ]
    append(journal, delivery(orjson.dumps({"data": {"metrics": entries}})))
    append(journal, delivery(orjson.dumps({"data": {"metrics": entries[:2]}, "extra": 1})))
    broken = append(journal, delivery(body({"hr": [point(m, 5) for m in range(300, 500)]})))
    corrupt(tmp_path / "journal.sqlite", broken.id)
    for case in corpus():
        append(journal, delivery(case.body, aggregation=None, automation=case.name))


def test_partitioned_rebuild_equals_the_one_process_rebuild_store_18(
    journal: Journal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-18: objects, outcomes (status, reason, layer, counters) and checkpoint of a
    partitioned rebuild are those of the one-process rebuild, byte for byte."""
    mixed_journal(journal, tmp_path)

    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)

    statuses = {status for _, _, _, status, *_ in alone["outcomes"]}
    assert statuses == {"parsed", "partial", "failed"}
    assert len(alone["objects"]) > 50
    for workers in (2, 3):
        assert rebuilt(journal, tmp_path / f"part{workers}.sqlite", workers) == alone
    assert not [r for r in caplog.records if r.name == "healthlog.rebuild"]


@settings(max_examples=15, deadline=None)
@given(st.lists(spec_delivery, min_size=2, max_size=6))
def test_any_deliveries_rebuild_the_same_partitioned_store_18(
    specs: list[DeliverySpec],
) -> None:
    """STORE-18 (property): random overlapping deliveries rebuild to the same objects and
    outcomes in one process and partitioned."""
    with tempfile.TemporaryDirectory() as tmp, Journal(Path(tmp) / "journal.sqlite") as journal:
        journal_specs(journal, specs)

        alone = rebuilt(journal, Path(tmp) / "one.sqlite", workers=1)

        assert rebuilt(journal, Path(tmp) / "two.sqlite", workers=2) == alone


# A metric's points: none, one (no spacing: the layer is inherited), or three spaced by seconds,
# minutes or hours (a layer that may differ from the one the automation had last).
_SPACED = {
    "none": (0, 0),
    "one": (1, 0),
    "seconds": (3, 10),
    "minutes": (3, 60),
    "hours": (3, 3600),
}
_DELIVERY = st.tuples(
    st.just("delivery"),
    st.sampled_from(["A", "B", None]),
    st.sampled_from([None, "minutes", "fortnights"]),
    st.lists(
        st.tuples(
            st.sampled_from(["hr", "steps"]),
            st.sampled_from(sorted(_SPACED)),
            st.sampled_from([0, 50, 130]),
            st.sampled_from(["count", "km"]),
        ),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
    st.booleans(),
    st.none() | st.integers(0, 3),
)
_STEP = st.one_of(
    _DELIVERY,
    st.tuples(st.just("seal"), st.sampled_from([1, 3]), st.sampled_from([None, "hr", "workouts"])),
    _DELIVERY,
    st.just(("undecodable",)),
    _DELIVERY,
)


def _spaced(kind: str, minute: int, qty: int) -> list[dict[str, Any]]:
    count, seconds = _SPACED[kind]
    return [
        {"date": minute_stamp(minute + n * seconds // 60)[:-8] + f"{n * seconds % 60:02d} +0000"}
        | {"qty": qty + n}
        for n in range(count)
    ]


def _journal_steps(journal: Journal, steps: list[tuple[Any, ...]]) -> None:
    """Journal what ``_STEP`` drew: seals, undecodable bodies, and deliveries of metrics
    (possibly with elements that are not points, or only those) and a workout."""
    for qty, (kind, *args) in enumerate(steps):
        if kind == "seal":
            hours, metric = args
            seal = Seal(BASE_US + hours * 3_600_000_000, metric)
            append(journal, NewDelivery(seal.encode(), SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))
        elif kind == "undecodable":
            append(journal, delivery(b"{not json"))
        else:
            automation, header, metrics, rejected, workout, backfill = args
            entries = [
                {"name": name, "units": units, "data": _spaced(spacing, minute, qty)}
                for name, spacing, minute, units in metrics
            ]
            if rejected:
                entries.append({"name": "hr", "units": "count", "data": [7, {"qty": 1}]})
            sections = {"workouts": [{"name": "Walk", "start": minute_stamp(qty)}]}
            document = {"metrics": entries, **(sections if workout else {})}
            append(
                journal,
                delivery(
                    orjson.dumps({"data": document}),
                    received_at=None if backfill is None else BASE_US + backfill,
                    aggregation=header,
                    automation=automation,
                ),
            )


@settings(max_examples=30, deadline=None)
@given(st.lists(_STEP, min_size=2, max_size=10))
def test_any_journal_folds_live_and_rebuilds_the_same_both_ways_store_41(
    steps: list[tuple[Any, ...]],
) -> None:
    """STORE-41 (property): seals, undecodable bodies and deliveries of several automations
    (or none), with a header, none or one naming no layer, whose metrics hold no point, one,
    or points spaced by seconds, minutes or hours, with elements rejected (or only those),
    with a workout, in other units, some historical: the live fold, the one-process rebuild
    and the partitioned one (each delivery a task of its own) give the same objects and
    outcomes."""
    with scratch_data() as (tmp, journal, store):
        _journal_steps(journal, steps)
        assert fold_live(journal, store).reached_end
        live = rows(store.path)

        alone = rebuilt(journal, tmp / "one.sqlite", workers=1)
        with mock.patch.object(_partition, "TASK_BYTES", 1):
            apart = rebuilt(journal, tmp / "three.sqlite", workers=3)

        for table, columns in (("objects", slice(0, 10)), ("outcomes", slice(0, 7))):
            folded = [row[columns] for row in live[table]]
            assert [row[columns] for row in alone[table]] == folded
            assert [row[columns] for row in apart[table]] == folded


@pytest.mark.parametrize("regrouped", [False, True])
def test_assumed_layers_are_checked_and_folded_again_when_wrong_store_23(
    journal: Journal, tmp_path: Path, caplog: pytest.LogCaptureFixture, regrouped: bool
) -> None:
    """STORE-23: deliveries without a header are folded under their automation's last layer
    and checked against the spacing the workers measured; an automation that changed its
    grouping is folded a second time, under the layers then known, with the same result."""
    caplog.set_level(logging.DEBUG, logger="healthlog.partition")
    every = 60 if regrouped else 1
    for automation in ("A", None):
        for n in range(3):
            spaced = [point(1000 * n + m * (every if n == 1 else 1), m) for m in range(40)]
            append(
                journal,
                delivery(
                    body({"hr": spaced, "steps": spaced[::2]}),
                    aggregation=None,
                    automation=automation,
                ),
            )
        lone = body({"hr": [point(5000, 1)]})
        append(journal, delivery(lone, aggregation=None, automation=automation))

    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)

    layers = {layer for *_, layer, _, _ in alone["outcomes"]}
    assert layers == ({"minutes", "hours", None} if regrouped else {"minutes", None})
    assert rebuilt(journal, tmp_path / "two.sqlite", workers=2) == alone
    again = [r.levelno for r in caplog.records if "folding again" in r.getMessage()]
    assert again == ([logging.DEBUG] if regrouped else [])


def paged_journal(journal: Journal, tmp_path: Path) -> dict[int, str]:
    """:func:`mixed_journal`, a seal, an automation that changed its grouping without a header
    (so that a partitioned rebuild folds twice), one delivery given up live, and a rejected
    element in every one of a run (each judged); the given-up delivery's reason by id."""
    mixed_journal(journal, tmp_path)
    seal = Seal(BASE_US + 3_600_000_000, "hr")
    append(journal, NewDelivery(seal.encode(), SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))
    for n in range(3):
        spaced = [point(1000 * n + m * (60 if n == 1 else 1), m) for m in range(40)]
        append(journal, delivery(body({"hr": spaced}), aggregation=None, automation="D"))
    given_up = append(journal, delivery(body({"steps": [point(9, 9)]})))
    for n in range(5):
        append(journal, delivery(body({"energy": [point(600 + n, n), {"qty": 1}]})))
    return {given_up.id: WORKER_DIED}


def everything(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """The objects, outcomes and checkpoint of a rebuilt store, and its events in order
    (without the instants they were written at)."""
    tables = rows(path)
    with closing(sqlite3.connect(path)) as conn:
        events = conn.execute("SELECT id, kind, payload FROM events ORDER BY seq").fetchall()
    return {
        **{name: tables[name] for name in ("objects", "outcomes", "checkpoint")},
        "events": events,
    }


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_rebuild_reading_its_journal_a_page_at_a_time_folds_the_same_store_80(
    journal: Journal,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    workers: int,
) -> None:
    """STORE-80: a rebuild that reads the journal 1, 2 or 3 deliveries at a time, its pages
    ending anywhere (among seals, failing and given-up deliveries, an automation folded twice,
    judged ones), in one process or partitioned (each delivery a task of its own), writes the
    objects, outcomes, checkpoint and events of the rebuild that reads it in one page."""
    caplog.set_level(logging.DEBUG, logger="healthlog.partition")
    given_up = paged_journal(journal, tmp_path)
    monkeypatch.setattr(_partition, "TASK_BYTES", 1)
    rebuild_into(journal, tmp_path / "whole.sqlite", workers=workers, given_up=given_up)
    whole = everything(tmp_path / "whole.sqlite")
    assert len(whole["outcomes"]) == len(journal.iter_order())
    assert {"parsed", "partial", "failed"} == {row[3] for row in whole["outcomes"]}

    for page in (1, 2, 3):
        monkeypatch.setattr(rebuild, "PAGE", page)
        path = tmp_path / f"page{page}.sqlite"
        rebuild_into(journal, path, workers=workers, given_up=given_up)
        assert everything(path) == whole, page

    again = [r for r in caplog.records if "folding again" in r.getMessage()]
    assert len(again) == (4 if workers > 1 else 0)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_delivery_journaled_while_a_rebuild_reads_its_pages_is_not_its_store_80(
    journal: Journal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """STORE-80: the deliveries a rebuild folds are those journaled when it starts: one
    journaled while it reads the journal a page at a time, live or backfilled with an early
    stamp among the pages not read yet, is not folded by it (verify compares it as not folded,
    a reindex leaves it to the folder), and the progress counts to the same total."""
    paged_journal(journal, tmp_path)
    rebuild_into(journal, tmp_path / "before.sqlite", workers=workers)
    before = everything(tmp_path / "before.sqlite")
    monkeypatch.setattr(rebuild, "PAGE", 1)
    journaled: list[int] = []
    totals: set[int] = set()

    def journal_meanwhile(done: int, total: int) -> None:
        totals.add(total)
        if not journaled:
            late = append(journal, delivery(body({"hr": [point(7, 1)]})))
            early = append(journal, delivery(body({"hr": [point(8, 1)]}), received_at=BASE_US))
            journaled.extend((late.id, early.id))

    rebuild_into(journal, tmp_path / "during.sqlite", workers=workers, progress=journal_meanwhile)

    assert journaled
    assert everything(tmp_path / "during.sqlite") == before
    assert totals == {len(before["outcomes"])}


class _Held:
    """The most of each kind of per-delivery object alive at any progress report."""

    KINDS = (DeliveryMeta, Outcome, Counters)

    def __init__(self) -> None:
        self.most = dict.fromkeys(self.KINDS, 0)

    def __call__(self, done: int, total: int) -> None:
        alive = dict.fromkeys(self.KINDS, 0)
        for found in gc.get_objects():
            if isinstance(found, self.KINDS):
                alive[type(found)] += 1
        for kind, count in alive.items():
            self.most[kind] = max(self.most[kind], count)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_rebuild_holds_a_page_of_deliveries_not_every_one_store_81(
    journal: Journal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """STORE-81: a rebuild of 60 deliveries (some of them judged, a seal, one that cannot be
    read) reading 4 at a time holds at most two pages of their metadata, outcomes and counters
    at any moment it reports progress, in one process or partitioned; it held every one of
    them (the whole journal's metadata for the whole rebuild: 837 bytes a delivery with the
    phone's headers, 84 MB at 100,000)."""
    for n in range(60):
        elements = [point(n, n), {"qty": 1}] if n % 7 == 0 else [point(n, n)]
        append(journal, delivery(body({"hr": elements, f"m{n % 5}": [point(n, 1)]})))
    seal = Seal(BASE_US + 3_600_000_000, None)
    append(journal, NewDelivery(seal.encode(), SEAL_CLIENT, content_type=SEAL_CONTENT_TYPE))
    append(journal, delivery(b"not json at all"))
    total = len(journal.iter_order())
    monkeypatch.setattr(rebuild, "PAGE", 4, raising=False)
    monkeypatch.setattr(_partition, "TASK_BYTES", 1)
    held = _Held()
    gc.collect()

    rebuild_into(journal, tmp_path / "paged.sqlite", workers=workers, progress=held)

    assert (
        everything(tmp_path / "paged.sqlite")["outcomes"]
        == rebuilt(journal, tmp_path / "whole.sqlite", workers=1)["outcomes"]
    )
    assert all(most <= 2 * 4 for most in held.most.values()), (held.most, total)


def _slow_fold_chunk(path: str, chunk: list[Any]) -> Any:
    """A worker's fold that takes half a second more, so that reading runs ahead."""
    time.sleep(0.5)
    return _FOLD_CHUNK(path, chunk)


_FOLD_CHUNK = _partition.fold_chunk
_slow_fold_chunk.__qualname__ = "fold_chunk"
_slow_fold_chunk.__module__ = _partition.__name__


def test_a_partitioned_rebuild_reads_ahead_a_bounded_number_of_shares_store_82(
    journal: Journal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORE-82: a partitioned rebuild of 60 small deliveries (120 shares) whose workers are
    slower than its reading, allowed 8 shares ahead of them, holds at most 8 waiting and as
    many in its workers' tasks at any progress report, and rebuilds what one process rebuilds;
    it read ahead by bytes alone (32 MiB), which for small deliveries was every one of them."""
    for n in range(60):
        append(journal, delivery(body({"hr": [point(n, n)], f"m{n % 5}": [point(n, 1)]})))
    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)
    monkeypatch.setattr(_partition, "AHEAD_SHARES", 8, raising=False)
    monkeypatch.setattr(_partition, "fold_chunk", _slow_fold_chunk)
    most = 0

    def count(done: int, total: int) -> None:
        nonlocal most
        most = max(most, sum(isinstance(found, _partition.Planned) for found in gc.get_objects()))

    gc.collect()
    rebuild_into(journal, tmp_path / "ahead.sqlite", workers=2, progress=count)

    assert rows(tmp_path / "ahead.sqlite")["outcomes"] == alone["outcomes"]
    assert 0 < most <= 2 * 8 + 2, most


def test_shares_waiting_for_a_slow_partition_do_not_hold_their_whole_bodies_store_145(
    journal: Journal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORE-145: a partitioned rebuild of 60 deliveries of a large metric (225 kB of JSON
    each) and a one-point one, whose one-point partition folds nothing until all 60 are read,
    allowed 1 MiB of shares ahead of its workers, holds less than 4 MiB more memory than it
    began with at any progress report, and rebuilds what one process rebuilds. A share's
    arrays were slices of the whole body, each keeping all of it alive: the one-point shares
    held every body read (10.4 MB; 2.5 MB now)."""
    big = [point(m, m % 7) for m in range(5000)]
    for n in range(60):
        append(journal, delivery(body({"big": big, "small": [point(n, 1)]})))
    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)
    monkeypatch.setattr(_partition, "AHEAD_BYTES", 2**20)
    monkeypatch.setattr(_partition, "TASK_BYTES", 2**18)
    go = tmp_path / "go"
    fold_chunk = _partition.fold_chunk

    def folding(path: str, chunk: list[Any]) -> Any:
        while not any("big" in share.metrics for _, share in chunk) and not go.exists():
            time.sleep(0.01)
        return fold_chunk(path, chunk)

    folding.__qualname__ = "fold_chunk"
    folding.__module__ = _partition.__name__
    monkeypatch.setattr(_partition, "fold_chunk", folding)
    reports, most = 0, 0

    def measure(done: int, total: int) -> None:
        nonlocal reports, most
        reports += 1
        most = max(most, tracemalloc.get_traced_memory()[0] - began)
        if reports >= total:
            go.touch()

    gc.collect()
    tracemalloc.start()
    try:
        began = tracemalloc.get_traced_memory()[0]
        rebuild_into(journal, tmp_path / "two.sqlite", workers=2, progress=measure)
    finally:
        tracemalloc.stop()

    two = rows(tmp_path / "two.sqlite")
    assert {name: two[name] for name in alone} == alone
    assert 0 < most < 4 * 2**20, most


def test_partitions_settle_as_they_finish_and_are_gathered_as_they_settle_store_42(
    journal: Journal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORE-42: once every delivery is handed out, a partition whose shares are all folded
    settles while another still folds, and one settled is gathered while another still
    settles; the result is the one-process rebuild's."""
    day = [point(m, m % 7) for m in range(0, 600)]
    for _ in range(3):
        append(journal, delivery(body({"hr": day, "steps": day[::4], "energy": day[::4]})))
    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)
    log_path = tmp_path / "tasks.log"
    fold_chunk, settle = _partition.fold_chunk, _partition.settle

    def record(kind: str, path: str, started: float, slow: bool) -> None:
        if slow:
            time.sleep(0.5)
        with open(log_path, "a") as log:
            log.write(f"{kind} {Path(path).name} {slow} {started} {time.monotonic()}\n")

    def folding(path: str, chunk: list[Any]) -> Any:
        started, slow = time.monotonic(), any("hr" in share.metrics for _, share in chunk)
        folded = fold_chunk(path, chunk)
        record("fold", path, started, slow)
        return folded

    def settling(path: str, reference: str | None) -> None:
        started = time.monotonic()
        settle(path, reference)
        record("settle", path, started, Path(path).name in slow_parts())

    def slow_parts() -> set[str]:
        lines = log_path.read_text().split("\n")[:-1] if log_path.exists() else []
        return {line.split()[1] for line in lines if line.split()[2] == "True"}

    absorb = Store.absorb_objects

    def absorbing(self: Store, part: str, epoch: int) -> None:
        started = time.monotonic()
        absorb(self, part, epoch)
        record("gather", os.fspath(part), started, False)

    for name, wrapper in (("fold_chunk", folding), ("settle", settling)):
        wrapper.__qualname__ = name
        wrapper.__module__ = _partition.__name__
        monkeypatch.setattr(_partition, name, wrapper)
    monkeypatch.setattr(Store, "absorb_objects", absorbing)

    assert rebuilt(journal, tmp_path / "three.sqlite", workers=3) == alone

    tasks = [line.split() for line in log_path.read_text().split("\n")[:-1]]
    (slow,) = {part for _, part, slow, *_ in tasks if slow == "True"}
    ends = {
        (kind, part): max(float(end) for k, p, _, _, end in tasks if (k, p) == (kind, part))
        for kind, part, *_ in tasks
    }
    starts = {
        (kind, part): min(float(start) for k, p, _, start, _ in tasks if (k, p) == (kind, part))
        for kind, part, *_ in tasks
    }
    others = {part for _, part, *_ in tasks} - {slow}
    assert len(others) == 2
    assert all(starts[("settle", part)] < ends[("fold", slow)] for part in others)
    assert any(ends[("gather", part)] < ends[("settle", slow)] for part in others)


def test_a_partition_settles_its_objects_reading_their_keys_a_page_at_a_time_store_146(
    tmp_path: Path,
) -> None:
    """STORE-146: a partition's scratch file of 20,000 objects settles (each body compressed)
    with under 1 MiB of Python memory at its peak (0.35 MB): its keys are read a page at a
    time, where all of them were read at once and held until all were settled (6.1 MB here; a
    fold worker of a rebuild of 400 deliveries peaked at 48.6 to 51.0 MB resident, now 43.4)."""
    scratch = str(tmp_path / "scratch.sqlite")
    _partition.fold_chunk(scratch, [])
    plain = orjson.dumps([[60 * m, m] for m in range(60)])
    with closing(sqlite3.connect(scratch)) as conn, conn:
        conn.executemany(
            "INSERT INTO objects (metric, layer, hour, units, body, hash, first, last, points,"
            " created_by, sealed) VALUES (?, 'minutes', ?, 'count', ?, ?, 0, 0, 60, 1, 0)",
            (
                (f"metric_{n % 20}", n * 3600 * 10**6, plain, n.to_bytes(32, "big"))
                for n in range(20_000)
            ),
        )
    tracemalloc.start()
    try:
        _partition.settle(scratch, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    with closing(sqlite3.connect(scratch)) as conn:
        bodies = conn.execute("SELECT DISTINCT body FROM objects").fetchall()
    assert [objects.decompress(body) for (body,) in bodies] == [plain]


def test_partitioned_reindex_renews_the_lease_and_stops_when_it_is_lost_store_19(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORE-19: while worker processes fold, reindex keeps renewing the lease and reporting
    progress up to the total; when another holder takes the lease meanwhile, the reindex
    stops with an error and swaps nothing in."""
    monkeypatch.setattr(rebuild, "LEASE_RENEW_S", 0.0)
    mixed_journal(journal, tmp_path)
    run_pass(journal, store, epoch)
    reported: list[tuple[int, int]] = []
    renewals = []

    def watch(done: int, total: int) -> None:
        reported.append((done, total))
        renewals.append(store.lease().expires_at)

    assert reindex(journal, store, "reindex", progress=watch, workers=2) == 0

    total = len(journal.iter_order())
    assert reported[-1] == (total, total)
    assert [done for done, _ in reported] == sorted(done for done, _ in reported)
    assert len(set(renewals)) > 1
    before = rows(store.path)["objects"]

    def steal(done: int, total: int) -> None:
        with Store(store.path) as other:
            other.acquire_lease("thief", now=time.time_ns() // 1000, ttl=10**9, force=True)

    with pytest.raises(RebuildError, match="lease was lost"):
        reindex(journal, store, "reindex", progress=steal, workers=2)

    assert rows(store.path)["objects"] == before
    assert store.lease().holder == "thief"


class _Breaking(DeliveryFold):
    """A fold that breaks on steps, as a bug would."""

    def writes(self) -> Iterator[objects.HourlyObject]:
        for written in super().writes():
            if written.key.metric == "steps":
                raise ZeroDivisionError
            yield written


@pytest.mark.skipif(sys.platform != "linux", reason="workers inherit the broken fold by fork")
def test_a_broken_partition_falls_back_to_one_process_store_20(
    journal: Journal,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """STORE-20: when a partition's fold breaks with an error that is not a storage error, the
    rebuild is done again in one process, with a WARNING, and equals a one-process rebuild."""
    mixed_journal(journal, tmp_path)
    alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)
    monkeypatch.setattr(_partition, "DeliveryFold", _Breaking)

    assert rebuilt(journal, tmp_path / "two.sqlite", workers=2) == alone

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["partitioned rebuild broke (ZeroDivisionError); rebuilding in one process"]


def test_swap_writes_every_column_that_differs_store_21(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STORE-21: an object whose content equals the rebuild's but whose provenance does not
    (a backfill of the same point folded after the live delivery) takes the rebuild's
    provenance on reindex, counted as changed with an event carrying its unchanged hash (a
    follower's replica holds the provenance too); objects equal in every column are left as
    they are, unannounced."""
    append(journal, delivery(body({"hr": [point(1, 60)], "steps": [point(2, 10)]})))
    run_pass(journal, store, epoch)
    backfill = append(journal, delivery(body({"hr": [point(1, 60)]}), received_at=BASE_US))
    run_pass(journal, store, epoch)
    assert summaries(store)[HR].created_by != backfill.id
    events = store.event_window()[1]
    hr_hash = summaries(store)[HR].hash

    assert reindex(journal, store, "reindex") == 1

    assert summaries(store)[HR].created_by == backfill.id
    assert [
        (e.kind, e.payload["metric"], e.payload["hash"]) for e in store.events_after(events, 9)
    ] == [("object.changed", "hr", hr_hash.hex())]
    rebuild_into(journal, tmp_path / "fresh.sqlite")
    with Store(tmp_path / "fresh.sqlite") as fresh:
        assert list(store.iter_objects()) == list(fresh.iter_objects())


@pytest.mark.parametrize("workers", [1, 2])
def test_verify_names_an_object_differing_only_by_provenance_store_75(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, cli: Cli, workers: int
) -> None:
    """STORE-75: an object whose points equal the rebuild's but whose creating delivery does
    not (a backfill of the same point folded after the live delivery) is a difference by its
    provenance, not corrupt: ``verify`` returns it so, in one process and partitioned, and
    ``healthlog verify`` prints ``provenance`` with its key, says on stderr what differs, and
    exits 1; after a reindex nothing differs."""
    append(journal, delivery(body({"hr": [point(1, 60)], "steps": [point(2, 10)]})))
    run_pass(journal, store, epoch)
    append(journal, delivery(body({"hr": [point(1, 60)]}), received_at=BASE_US))
    run_pass(journal, store, epoch)
    hr_hash = summaries(store)[HR].hash

    run = cli("verify", "--data", tmp_path)

    assert run.code == 1
    assert run.lines() == [
        f"provenance\t{HR.metric}\t{HR.layer}\t{format_instant(HR.hour)}\n".encode()
    ]
    assert "corrupt" not in run.err
    assert run.err.splitlines()[-2:] == [
        "verify: 1 objects (`provenance`) hold the points a rebuild holds but name another"
        " delivery as the one that created them (a backfill folded after a later delivery);"
        " `healthlog reindex` records the rebuild's",
        "verify: 1 objects differ",
    ]
    assert verify(journal, store, workers=workers) == [
        Difference(HR, hr_hash, hr_hash, provenance=True)
    ]
    reindex(journal, store, "reindex", workers=workers)
    assert verify(journal, store, workers=workers) == []


def test_the_command_line_reindexes_a_large_journal_in_worker_processes_store_22(
    run_cli: RunCli, tmp_path: Path
) -> None:
    """STORE-22: ``healthlog reindex`` and ``healthlog verify`` (real processes) on a journal
    large enough for the partitioned rebuild: the reindex folds in worker processes (their
    partition files are seen while it runs), both exit 0, and the live objects and outcomes
    are those of a one-process rebuild."""
    if _partition.available_cores() < 2:
        pytest.skip("the partitioned rebuild needs two cores")
    data = DataDir(tmp_path / "data")
    days = [encode(window(n, first_minute=n * 1440, minutes=1440), n) for n in range(12)]
    assert sum(map(len, days)) >= rebuild.PARALLEL_MIN_BYTES
    with data.open_journal() as journal, data.open_store() as store:
        journal.append_many([NewDelivery(body=day, client="phone") for day in days])
        held = store.acquire_lease("folder", now=time.time_ns() // 1000, ttl=10**9)
        assert held is not None
        run_pass(journal, store, held)
        store.release_lease("folder", held)

    errors = tmp_path / "reindex.err"
    command = [sys.executable, "-m", "healthlog.cli", "reindex", "--data", str(data.path)]
    partitioned = False
    with errors.open("wb") as sink, subprocess.Popen(command, stderr=sink) as reindexing:
        deadline = time.monotonic() + 120
        while reindexing.poll() is None:
            assert time.monotonic() < deadline, "the reindex did not end"
            partitions = data.path.glob(".rebuild-*/.partitions-*/*/part-*.sqlite")
            partitioned = partitioned or any(partitions)
            time.sleep(0.005)
    verified = run_cli("verify", "--data", data.path)

    assert (reindexing.returncode, verified.code) == (0, 0), errors.read_text() + verified.err
    assert "reindex: 12/12" in errors.read_text()
    assert partitioned, "the reindex folded in one process"
    with data.open_journal() as journal:
        alone = rebuilt(journal, tmp_path / "one.sqlite", workers=1)
    live = rows(data.store_path)
    assert live["objects"] == alone["objects"]
    assert [row[:-1] for row in live["outcomes"]] == [row[:-1] for row in alone["outcomes"]]


HOUR_US = 3600 * 10**6


def body_of(path: str, key: ObjectKey) -> bytes:
    """An object's stored body, read through a connection of its own."""
    with closing(sqlite3.connect(path)) as conn:
        (stored,) = conn.execute(
            "SELECT body FROM objects WHERE metric = ? AND layer = ? AND hour = ?",
            (key.metric, key.layer, key.hour),
        ).fetchone()
    return bytes(stored)


def set_body(path: str, key: ObjectKey, stored: bytes) -> None:
    """Replace an object's body behind the store's back, leaving its hash."""
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "UPDATE objects SET body = ? WHERE metric = ? AND layer = ? AND hour = ?",
            (stored, key.metric, key.layer, key.hour),
        )


@attrs.frozen
class Damaged:
    """Three live objects whose bodies were replaced behind the store's back, hashes intact:
    ``kept`` by the same bytes compressed at level 1, ``junk`` by bytes that are not gzip,
    ``other`` by gzip of other bytes; ``plains`` are their bytes as folded."""

    kept: ObjectKey
    junk: ObjectKey
    other: ObjectKey
    kept_body: bytes
    plains: dict[ObjectKey, bytes]


def damaged(journal: Journal, store: Store, epoch: int) -> Damaged:
    hours = {name: [point(m, m % 9) for m in range(0, 300, 7)] for name in ("hr", "steps")}
    append(journal, delivery(body(hours)))
    run_pass(journal, store, epoch)
    kept, junk, other = (
        ObjectKey(metric, "minutes", BASE_US + hour * HOUR_US)
        for metric, hour in (("hr", 0), ("hr", 1), ("steps", 2))
    )
    plains = {key: gzip.decompress(body_of(store.path, key)) for key in (kept, junk, other)}
    kept_body = gzip.compress(plains[kept], compresslevel=1, mtime=0)
    assert kept_body != body_of(store.path, kept)
    set_body(store.path, kept, kept_body)
    set_body(store.path, junk, b"not gzip at all")
    set_body(store.path, other, gzip.compress(plains[other] + b"0\t0\t{}\n", mtime=0))
    return Damaged(kept, junk, other, kept_body, plains)


def test_rebuilt_objects_equal_to_the_live_ones_take_their_bodies_store_24(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STORE-24: a partitioned reindex keeps a live body that decompresses to the rebuilt
    object's bytes (here compressed at another level), uncounted and unannounced, and rewrites
    one that does not (not gzip, or gzip of other bytes), with its hash intact in both cases:
    each rewritten one is counted as changed with an ``object.changed`` event of its own (a
    follower's replica copied the damaged body); every other row is the fresh rebuild's, and
    a second reindex changes nothing."""
    d = damaged(journal, store, epoch)
    kept, junk, other, kept_body, plains = d.kept, d.junk, d.other, d.kept_body, d.plains
    events = store.event_window()[1]
    hashes = {key: summary.hash for key, summary in summaries(store).items()}

    assert reindex(journal, store, "reindex", workers=2) == 2

    added = [e.payload for e in store.events_after(events, 1000)]
    assert sorted((p["metric"], p["hour"], p["hash"], p["points"]) for p in added) == sorted(
        (key.metric, format_instant(key.hour), hashes[key].hex(), summaries(store)[key].points)
        for key in (junk, other)
    )
    assert reindex(journal, store, "reindex", workers=2) == 0
    assert store.event_window()[1] == events + 2
    assert body_of(store.path, kept) == kept_body
    assert body_of(store.path, junk) == objects.compress(plains[junk])
    assert body_of(store.path, other) == objects.compress(plains[other])
    rebuild_into(journal, tmp_path / "fresh.sqlite", workers=2)
    live, fresh = rows(store.path)["objects"], rows(tmp_path / "fresh.sqlite")["objects"]
    assert len(live) == len(fresh) > 3
    assert [row for row in live if row[:3] != attrs.astuple(kept)] == [
        row for row in fresh if row[:3] != attrs.astuple(kept)
    ]
    assert verify(journal, store, workers=2) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_verify_reports_a_live_body_that_does_not_hold_its_content_store_26(
    journal: Journal, store: Store, epoch: int, workers: int
) -> None:
    """STORE-26: verify, in one process and partitioned, reports the two live bodies that do
    not hold the bytes their hash names as corrupt, not the one compressed at another level;
    after a reindex it reports nothing."""
    d = damaged(journal, store, epoch)
    hashes = {key: summary.hash for key, summary in summaries(store).items()}

    differences = verify(journal, store, workers=workers)

    assert differences == [
        Difference(key, hashes[key], hashes[key], corrupt=True) for key in (d.junk, d.other)
    ]
    reindex(journal, store, "reindex", workers=workers)
    assert verify(journal, store, workers=workers) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_verify_reports_a_live_row_whose_columns_are_not_the_rebuilds_store_28(
    journal: Journal, store: Store, epoch: int, workers: int
) -> None:
    """STORE-28: a live object whose units, or whose point count, was changed on disk behind
    its intact hash is reported corrupt, in one process and partitioned; a reindex rewrites
    both, counted as changed, and then nothing is."""
    append(journal, delivery(body({"hr": [point(n, n) for n in range(3)]}, units="count/min")))
    append(journal, delivery(body({"steps": [point(n, n) for n in range(2)]}, units="count")))
    run_pass(journal, store, epoch)
    units_damaged, count_damaged = sorted(summaries(store), key=attrs.astuple)[:2]
    with sqlite3.connect(store.path) as conn:
        conn.execute(
            "UPDATE objects SET units = 'kg' WHERE metric = ? AND layer = ? AND hour = ?",
            attrs.astuple(units_damaged),
        )
        conn.execute(
            "UPDATE objects SET points = points + 1 WHERE metric = ? AND layer = ? AND hour = ?",
            attrs.astuple(count_damaged),
        )
    hashes = {key: summary.hash for key, summary in summaries(store).items()}

    differences = verify(journal, store, workers=workers)

    assert differences == [
        Difference(key, hashes[key], hashes[key], corrupt=True)
        for key in sorted((units_damaged, count_damaged), key=attrs.astuple)
    ]
    assert reindex(journal, store, "reindex", workers=workers) == 2
    assert verify(journal, store, workers=workers) == []


def test_the_command_line_names_corrupt_objects_store_26(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, cli: Cli
) -> None:
    """STORE-26: ``healthlog verify`` prints each corrupt object's key as ``corrupt`` and
    exits 1."""
    d = damaged(journal, store, epoch)

    run = cli("verify", "--data", tmp_path)

    assert run.code == 1
    assert run.lines() == [
        f"corrupt\t{key.metric}\t{key.layer}\t{format_instant(key.hour)}\n".encode()
        for key in (d.junk, d.other)
    ]


def test_a_killed_rebuild_leaves_no_worker_and_its_scratch_goes_store_29(tmp_path: Path) -> None:
    """STORE-29: `healthlog reindex` killed with SIGKILL while its worker processes fold: the
    workers exit within seconds; its scratch directory is left, and the next reindex removes
    it, but not the scratch directory of a rebuild still running (its lock is held)."""
    data = DataDir(tmp_path / "data")
    with data.open_journal() as journal:
        journal.append_many(
            [NewDelivery(body=big_body(n, target_bytes=12 * 2**20), client="t") for n in range(3)]
        )
    command = [sys.executable, "-m", "healthlog.cli", "reindex", "--data", str(data.path)]
    with subprocess.Popen(command, stderr=subprocess.DEVNULL) as killed:
        deadline = time.monotonic() + 60
        # Not the first child seen: importing trio runs ldconfig once, as a child of its own.
        while not (workers := children_of(killed.pid)) or not any(
            data.path.glob(".rebuild-*/.partitions-*/*/part-*.sqlite")
        ):
            assert killed.poll() is None, "the reindex ended before its workers were seen"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        killed.kill()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the killed reindex"
        time.sleep(0.05)
    left = list(data.path.glob(".rebuild-*"))
    assert len(left) == 1
    busy = data.path / ".rebuild-busy"
    busy.mkdir()
    with open(busy / "owner.lock", "wb") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)
        done = subprocess.run(command, capture_output=True, check=False, timeout=120)
        assert done.returncode == 0, done.stderr
    assert list(data.path.glob(".rebuild-*")) == [busy]


def test_a_starting_service_removes_what_a_killed_rebuild_left_store_63(tmp_path: Path) -> None:
    """STORE-63: the scratch directory of a rebuild that was killed (its lock gone with its
    process) is removed when a runtime (``serve``, ``import``, ``seal``) opens the data
    directory, not only by the next reindex; that of a rebuild still running is kept."""
    data = DataDir(tmp_path / "data")
    with data.open_journal(), data.open_store():
        pass
    stale = data.path / f"{rebuild.SCRATCH_PREFIX}stale"
    stale.mkdir()
    (stale / rebuild.SCRATCH_OWNER).touch()
    (stale / "store.sqlite").write_bytes(bytes(2**20))
    busy = data.path / f"{rebuild.SCRATCH_PREFIX}busy"
    busy.mkdir()

    async def start_and_stop() -> None:
        async with open_runtime(config(data.path)):
            pass

    with open(busy / rebuild.SCRATCH_OWNER, "wb") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)
        trio.run(start_and_stop)
    assert list(data.path.glob(f"{rebuild.SCRATCH_PREFIX}*")) == [busy]


def test_a_rebuild_stopped_with_its_process_group_exits_143_store_30(tmp_path: Path) -> None:
    """STORE-30: SIGTERM to the whole process group of `healthlog reindex` once its workers
    fold into their scratch files (as a service manager's stop sends it): the command stops at
    its next report with exit 143 and one line saying so, no error, the lease is released, and
    its workers are gone."""
    data = DataDir(tmp_path / "data")
    with data.open_journal() as journal:
        journal.append_many(
            [NewDelivery(body=big_body(n, target_bytes=12 * 2**20), client="t") for n in range(3)]
        )
    command = [sys.executable, "-m", "healthlog.cli", "reindex", "--data", str(data.path)]
    with subprocess.Popen(command, stderr=subprocess.PIPE, start_new_session=True) as stopped:
        deadline = time.monotonic() + 60
        while not (workers := children_of(stopped.pid)) or not any(
            data.path.glob(".rebuild-*/.partitions-*/*/part-*.sqlite")
        ):
            assert stopped.poll() is None, "the reindex ended before its workers folded"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.killpg(stopped.pid, signal.SIGTERM)
        _, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 143, err.decode()
    assert err.decode().splitlines()[-1] == "healthlog: interrupted"
    assert "Traceback" not in err.decode()
    assert "level=ERROR" not in err.decode()
    with data.open_store() as store:
        assert store.lease().holder is None
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the stopped reindex"
        time.sleep(0.05)


def test_a_link_planted_in_the_scratch_directory_is_not_opened_cli_128(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """CLI-128: a link to another file planted at the name of the scratch directory's lock
    file (``owner.lock.new``) the instant the directory is given to the data directory's owner
    (the fault point ``rebuild.scratch``; as root, the data directory 65534's, as the service's
    account would, racing a `reindex` run as root) is never opened: the file it names keeps its
    bytes and its owner, and the reindex succeeds. (Before, the directory was given first, and
    such a link had the file truncated and, under root, given to that account.)"""
    append(journal, delivery(body({"hr": [point(1, 60)]})))
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(b"root:precious\n")
    victim.chmod(0o644)
    owner = victim.stat().st_uid
    if os.geteuid() == 0:
        os.chown(tmp_path, 65534, 65534)
    planted: list[Path] = []

    def plant(_point: str) -> None:
        (scratch,) = tmp_path.glob(f"{rebuild.SCRATCH_PREFIX}*")
        link = scratch / f"{rebuild.SCRATCH_OWNER}.new"
        link.symlink_to(victim)
        planted.append(link)

    plan = faults.Plan(actions={"rebuild.scratch": faults.Action(frozenset({1}), plant)})
    with faults.loaded(plan):
        assert reindex(journal, store, "reindex") == 1
    assert planted
    assert victim.read_bytes() == b"root:precious\n"
    assert victim.stat().st_uid == owner
    assert list(tmp_path.glob(f"{rebuild.SCRATCH_PREFIX}*")) == []


def _parts_given_to(data: Path, uid: int) -> bool:
    """Whether the workers of a rebuild in ``data`` have made part files, each given to
    ``uid`` (a part file is the worker's for the instant between its making and its giving)."""
    parts = list(data.glob(".rebuild-*/.partitions-*/*/part-*.sqlite"))
    try:
        return bool(parts) and all(part.lstat().st_uid == uid for part in parts)
    except FileNotFoundError:
        return False


def test_a_rebuild_killed_as_root_leaves_what_the_service_s_user_removes_cli_108() -> None:
    """CLI-108: `reindex` run as root on the data directory of a service that runs as another
    user (which it runs as since CLI-146), killed (SIGKILL to its process group) once its
    workers fold, leaves a scratch directory whose every directory and file is that user's,
    which a runtime started as that
    user (`import`) removes, saying so. (Before, it was root's, mode 0700: the service's
    user could neither remove nor enter it, and a second store's room stayed taken, 3.6 MB
    here, without a word.)"""
    if os.geteuid() != 0:
        pytest.skip("only root makes files another user owns")
    with reachable_home("healthlog-cli-108-") as home:
        data = DataDir(home / "data")
        with data.open_journal() as journal:
            journal.append_many(
                [
                    NewDelivery(body=big_body(n, target_bytes=12 * 2**20), client="t")
                    for n in range(3)
                ]
            )
        small = home / "small.json"
        small.write_bytes(body({"heart_rate": [point(0, 1)]}))
        subprocess.run(["chown", "-R", "65534:65534", data.path, small], check=True)
        command = [python_for_all(), "-m", "healthlog.cli", "reindex", "--data", str(data.path)]
        with subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True) as run:
            deadline = time.monotonic() + 60
            while not _parts_given_to(data.path, 65534):
                assert run.poll() is None, "the reindex ended before its workers folded"
                assert time.monotonic() < deadline
                time.sleep(0.005)
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=60)
        (scratch,) = data.path.glob(f"{rebuild.SCRATCH_PREFIX}*")
        owners = {
            path.relative_to(data.path).as_posix(): path.lstat().st_uid
            for path in [scratch, *scratch.rglob("*")]
        }
        assert any(name.endswith(".sqlite") for name in owners), owners
        assert {name: uid for name, uid in owners.items() if uid != 65534} == {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
        started = subprocess.run(
            [
                *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
                *(sys.executable, "-m", "healthlog.cli", "import", "--no-wait"),
                *("--data", str(data.path), str(small)),
            ],
            capture_output=True,
            text=True,
            env={**env, "HEALTHLOG_LOG_LEVEL": "INFO"},
            cwd=home,
            timeout=60,
            check=False,
        )
        assert started.returncode == 0, started.stderr
        assert f"removed {scratch.name}, left by a rebuild that was stopped" in started.stderr
        assert not scratch.exists()


def test_verify_holds_no_summary_of_every_object_in_memory_store_47(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-47: verify of a store of 6,000 objects (60 small deliveries) peaks at less memory
    than a summary of each object would take (it held the live and the rebuilt summaries in
    memory: 674 MB for 2.5 years); it still finds the one object damaged behind its hash."""
    for n in range(60):
        metric, first_hour = f"m{n % 10}", n // 10 * 100
        points = [point(60 * (first_hour + h), h) for h in range(100)]
        append(journal, delivery(body({metric: points})))
    run_pass(journal, store, epoch)
    damaged = ObjectKey("m3", "minutes", BASE_US + 3600 * 10**6)
    with closing(sqlite3.connect(store.path)) as conn, conn:
        conn.execute(
            "UPDATE objects SET points = points + 1 WHERE metric = ? AND hour = ?",
            (damaged.metric, damaged.hour),
        )
    objects_count = len(rows(store.path)["objects"])
    assert objects_count == 6000
    tracemalloc.start()
    try:
        found = verify(journal, store, workers=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(d.key, d.corrupt) for d in found] == [(damaged, True)]
    assert peak < objects_count * SUMMARY_BYTES, peak


def test_verify_compares_the_outcomes_in_sqlite_not_in_memory_store_83(
    journal: Journal, store: Store, epoch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORE-83: verify of 1,000 and then 3,000 folded deliveries, one of them recorded
    otherwise than a rebuild records it, names that one, and its peak of allocated memory grows
    by less than 150 bytes per delivery more (81: the set of folded ids): the live and rebuilt
    statuses are compared in SQLite, a row at a time (held in two dicts, it grew by 329)."""
    monkeypatch.setattr(rebuild, "PAGE", 64, raising=False)
    peaks = []
    for count in (1000, 2000):
        journal.append_many([delivery(body({"hr": [point(n, n)]})) for n in range(count)])
        assert run_pass(journal, store, epoch).reached_end
        with closing(sqlite3.connect(store.path)) as conn, conn:
            conn.execute("UPDATE outcomes SET reason = 'an older wording' WHERE delivery_id = 7")
        tracemalloc.start()
        try:
            found = rebuild.verify_all(journal, store, workers=1)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert found.objects == []
        assert [(d.delivery_id, d.live, d.rebuilt) for d in found.outcomes] == [
            (7, "parsed", "parsed")
        ]
    assert (peaks[1] - peaks[0]) / 2000 < 150, peaks


@pytest.mark.parametrize("room", [4096, 64 * 2**10])
def test_a_verify_the_disk_cannot_hold_names_the_error_and_the_file_store_55(
    journal: Journal, store: Store, epoch: int, tmp_path: Path, room: int
) -> None:
    """STORE-55: a verify whose copy of the live summaries the disk refuses (before its table
    is made, or while its 6,000 rows go in) fails with SQLite's disk error naming the copy's
    file, not a raw sqlite3 error and not the live store's file, which it only read."""
    for n in range(60):
        metric, first_hour = f"m{n % 10}", n // 10 * 100
        points = [point(60 * (first_hour + h), h) for h in range(100)]
        append(journal, delivery(body({metric: points})))
    rebuild_into(journal, tmp_path / "fresh.sqlite", workers=1)
    store.swap_in(tmp_path / "fresh.sqlite", epoch)

    with pytest.raises(StorageError) as refused, files_limited_to(room):
        verify(journal, store, workers=1)

    assert re.fullmatch(
        rf"StorageError: {DISK_ERROR} \({rebuild.LIVE_SUMMARIES}\)", describe(refused.value)
    ), describe(refused.value)


def test_swap_into_an_empty_store_holds_no_list_of_the_changes_store_50(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STORE-50: swapping a rebuild of 6,000 objects into an empty store (a restore) announces
    each object and peaks at less memory than a row per object would take: the changed rows
    wait in a temporary table (a list of them took 120 MB of a reindex of 2.5 years)."""
    for n in range(60):
        metric, first_hour = f"m{n % 10}", n // 10 * 100
        points = [point(60 * (first_hour + h), h) for h in range(100)]
        append(journal, delivery(body({metric: points})))
    rebuild_into(journal, tmp_path / "fresh.sqlite", workers=1)
    tracemalloc.start()
    try:
        changed = store.swap_in(tmp_path / "fresh.sqlite", epoch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert changed == 6000
    events = rows(store.path)["events"]
    assert len([e for e in events if e[2] == "object.changed"]) == 6000
    assert len(rows(store.path)["objects"]) == 6000
    assert peak < changed * SUMMARY_BYTES, peak


def test_a_swap_the_disk_cannot_hold_names_the_error_and_the_next_goes_through_store_54(
    journal: Journal, store: Store, epoch: int, tmp_path: Path
) -> None:
    """STORE-54: a swap of 6,000 objects whose writes the disk refuses while its events are
    written fails with SQLite's disk error and leaves the store as it was; once there is
    room, the same swap goes through on the same store."""
    for n in range(60):
        metric, first_hour = f"m{n % 10}", n // 10 * 100
        points = [point(60 * (first_hour + h), h) for h in range(100)]
        append(journal, delivery(body({metric: points})))
    rebuild_into(journal, tmp_path / "fresh.sqlite", workers=1)
    before = rows(store.path)
    largest = max(path.stat().st_size for path in tmp_path.glob("store.sqlite*"))

    with pytest.raises(StorageError) as refused, files_limited_to(largest + 256 * 2**10):
        store.swap_in(tmp_path / "fresh.sqlite", epoch)

    assert re.fullmatch(rf"StorageError: {DISK_ERROR}.*", describe(refused.value)), describe(
        refused.value
    )
    assert rows(store.path) == before
    assert store.swap_in(tmp_path / "fresh.sqlite", epoch) == 6000
    assert len(rows(store.path)["objects"]) == 6000


@pytest.mark.parametrize("room", [150_000, 300_000])
def test_a_rebuild_the_disk_cannot_hold_says_so_store_64(tmp_path: Path, room: int) -> None:
    """STORE-64: on a real file system (a 1 MiB tmpfs) left with too little room for a second
    store, `healthlog reindex` and `healthlog verify` each exit 3 with one line saying that the
    disk is full, how much is free, and that a rebuild needs room for a second store beside
    ``store.sqlite`` (its size), and leave no scratch directory; with the room back, both
    exit 0. With less room the scratch store cannot be made (SQLite's ``database or disk is
    full``), with more a fold into it fails (``delivery 1 could not be rebuilt
    (unwritten)``): both are said so."""
    payload = tmp_path / "body.json"
    payload.write_bytes(
        body({f"m{n}": [point(m, n + m / 7) for m in range(1200)] for n in range(4)})
    )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        'cd "$1" || exit 98\n'
        '"$PY" -m healthlog.cli import --aggregation minutes --data data "$2" 2> /dev/null'
        " || exit 98\n"
        "free=$(df -B1 --output=avail . | tail -1)\n"
        "head -c $((free - ROOM)) /dev/zero > fill\n"
        "for command in reindex verify; do\n"
        '  "$PY" -m healthlog.cli $command --data data 2> "$3"\n'
        '  echo "$command exit $?" >&2\n'
        '  grep -v ": [0-9]*/[0-9]*$" "$3" >&2\n'
        "  echo \"scratch $(ls -a data | grep -c '^\\.rebuild-')\" >&2\n"
        "done\n"
        "rm fill\n"
        "for command in reindex verify; do\n"
        '  "$PY" -m healthlog.cli $command --data data > /dev/null 2>&1\n'
        '  echo "$command afterwards exit $?" >&2\n'
        "done\n"
    ).replace("ROOM", str(room))
    stderr = in_full_file_system(script, point_dir, payload, tmp_path / "err")
    said = (
        r"healthlog: the disk is full \([0-9,]+ bytes free in \S+/data as the rebuild began, full"
        r" with no delivery folded\): a rebuild writes a second store beside store\.sqlite"
        r" \([0-9,]+ bytes\) until it is done, about [0-9,]+ bytes here; make that much room"
        r" and run it again \(nothing was changed\)"
    )
    for command in ("reindex", "verify"):
        assert re.search(
            rf"^{command} exit 3\n(time=.*\n)*{said}\nscratch 0\n", stderr, re.MULTILINE
        ), stderr
        assert f"{command} afterwards exit 0\n" in stderr, stderr


def test_a_partitioned_rebuild_the_disk_cannot_hold_rebuilds_in_one_process_store_130(
    tmp_path: Path,
) -> None:
    """STORE-130: a journal whose bodies reach ``PARALLEL_MIN_BYTES`` (ten days of minute
    points of six metrics, ten deliveries) is rebuilt in partitions, whose scratch files hold
    their objects uncompressed: 18.5 MB beside a store of 2.5 MB, where one process needs 3 MB.
    On a real file system (a tmpfs) left with three times the store's size free, `healthlog
    reindex` that runs out of room in partitions rebuilds in one process, with one WARNING
    saying so, and exits 0 with every point kept; left with three quarters of it, it exits 3
    with the line saying that the disk is full and how much a rebuild needs, leaves no scratch
    directory and changes nothing. (Before, with three times the store free: exit 3,
    `healthlog: partitioned rebuild failed: database error: database or disk is full`; with
    three quarters: the same, or that line naming a partition's scratch file gone by then:
    never how much room a rebuild needs.)"""
    files = []
    for day in range(10):
        files.append(tmp_path / f"day-{day}.json")
        write_minute_body(files[-1], metrics=6, points=1440, first_day=day)
    assert sum(f.stat().st_size for f in files) >= rebuild.PARALLEL_MIN_BYTES
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        'cd "$1" || exit 98\n'
        'out="$2"\n'
        "shift 2\n"
        '"$PY" -m healthlog.cli import --aggregation minutes --data data "$@" 2> /dev/null'
        " || exit 98\n"
        '"$PY" -m healthlog.cli export --data data > "$out/before" || exit 96\n'
        "store=$(stat -c %s data/store.sqlite)\n"
        "for share in 3 3/4; do\n"
        "  free=$(df -B1 --output=avail . | tail -1)\n"
        "  head -c $((free - store * $share)) /dev/zero > fill\n"
        '  "$PY" -m healthlog.cli reindex --data data 2> "$out/err"\n'
        '  echo "reindex $share exit $?" >&2\n'
        '  grep -v ": [0-9]*/[0-9]*$" "$out/err" >&2\n'
        "  echo \"scratch $(ls -a data | grep -c '^\\.rebuild-')\" >&2\n"
        "  rm fill\n"
        '  "$PY" -m healthlog.cli export --data data | cmp -s - "$out/before"'
        " && echo unchanged >&2\n"
        "done\n"
    )
    stderr = in_full_file_system(script, point_dir, tmp_path, *files, size="16m")
    fallback = (
        r"time=\S+ level=WARNING logger=healthlog\.rebuild msg=\"rebuilding in \d+ partitions"
        r" ran out of room \(StorageError: SQLITE_FULL: database or disk is full"
        r" \(part-\d+\.sqlite\)\): rebuilding in one process, which needs less room\""
    )
    assert re.search(
        rf"^reindex 3 exit 0\n{fallback}\nreindex: done, 0 objects changed\nscratch 0\n"
        r"unchanged\n",
        stderr,
        re.MULTILINE,
    ), stderr
    said = (
        r"healthlog: the disk is full \([0-9,]+ bytes free in \S+/data as the rebuild began, full"
        r" with (no delivery|[0-9,]+ of 10 deliveries) folded\): a rebuild writes a second store"
        r" beside store\.sqlite \([0-9,]+ bytes\) until it is done, about [0-9,]+ bytes here;"
        r" make that much room and run it again \(nothing was changed\)"
    )
    assert re.search(
        rf"^reindex 3/4 exit 3\n(time=.*\n)*{said}\nscratch 0\nunchanged\n$", stderr, re.MULTILINE
    ), stderr


def test_a_rebuild_the_disk_cannot_hold_says_the_room_it_needs_store_135(tmp_path: Path) -> None:
    """STORE-135: on a real file system (a 48 MiB tmpfs) holding 12 days of minute-level
    data (6.2 MB of bodies, so worker processes fold it, and run out of room: STORE-130) and
    left with the room of ``store.sqlite`` (what STORE-64's line asked for), `healthlog
    reindex` and `healthlog verify` each exit 3 with one line saying that the disk is full,
    how much was free as the rebuild began, how far it came and about how much room it needs,
    and leave no scratch directory; given that much room, each exits 0. (Before, the line
    asked for the store's size, on which the one-process rebuild fails again: its ``-wal`` is
    on the disk beside the store it is copied into, 5.2 MB free too little beside a 2.3 MB
    store.)"""
    for day in range(12):
        (tmp_path / f"day{day:02d}.json").write_bytes(
            body(
                {f"m{n}": [point(day * 1440 + m, n + m / 7) for m in range(1440)] for n in range(6)}
            )
        )
    point_dir = tmp_path / "mnt"
    point_dir.mkdir()
    script = (
        'cd "$1" || exit 98\n'
        '"$PY" -m healthlog.cli import --aggregation minutes --data data "$2"/day*.json'
        " 2> /dev/null || exit 98\n"
        "fill() {\n"
        "  free=$(df -B1 --output=avail . | tail -1)\n"
        "  head -c $((free - $1)) /dev/zero > fill\n"
        "}\n"
        "for command in reindex verify; do\n"
        "  fill $(stat -c %s data/store.sqlite)\n"
        '  "$PY" -m healthlog.cli $command --data data 2> "$3"\n'
        '  echo "$command exit $?" >&2\n'
        '  grep -v ": [0-9]*/[0-9]*$" "$3" >&2\n'
        "  echo \"scratch $(ls -a data | grep -c '^\\.rebuild-')\" >&2\n"
        "  rm fill\n"
        "  need=$(sed -n 's/.*, about \\([0-9,]*\\) bytes here.*/\\1/p' \"$3\" | tr -d ,)\n"
        "  fill ${need:-0}\n"
        '  "$PY" -m healthlog.cli $command --data data > /dev/null 2>&1\n'
        '  echo "$command given $need bytes exit $?" >&2\n'
        "  rm fill\n"
        "done\n"
    )
    stderr = in_full_file_system(script, point_dir, tmp_path, tmp_path / "err", size="48m")
    said = (
        r"healthlog: the disk is full \([0-9,]+ bytes free in \S+/data as the rebuild began, full"
        r" with [0-9,]+ of 12 deliveries folded\): a rebuild writes a second store beside"
        r" store\.sqlite \([0-9,]+ bytes\) until it is done, about [0-9,]+ bytes here; make that"
        r" much room and run it again \(nothing was changed\)"
    )
    for command in ("reindex", "verify"):
        assert re.search(
            rf"^{command} exit 3\n(time=.*\n)*{said}\nscratch 0\n{command} given [0-9]+ bytes"
            r" exit 0\n",
            stderr,
            re.MULTILINE,
        ), stderr


def test_a_verify_on_a_read_only_file_system_says_so_store_76(tmp_path: Path) -> None:
    """STORE-76: on a file system mounted read-only (as the kernel remounts one after disk
    errors) under a data directory whose databases stay readable (a process holding them was
    killed, leaving their ``-wal`` and ``-shm`` files), `healthlog verify` says in one line
    that the file system of the data directory is mounted read-only and where it rebuilds
    instead (CLI-114), not the name of a scratch directory it could not make, and exits 0."""
    payload = tmp_path / "body.json"
    payload.write_bytes(body({"hr": [point(1, 60)]}))
    stderr = on_remounted_read_only(
        tmp_path,
        payload,
        "verify",
        'echo "scratch $(ls -a "$1/data" | grep -c \'^\\.rebuild-\')" >&2\n',
    )
    assert re.search(
        r"^verify: the file system of \S+/data is mounted read-only \(as the kernel remounts"
        r" one after disk errors: see `dmesg`\): rebuilding into a scratch directory in \S+"
        r" instead, which needs room for a second store \([0-9,]+ bytes, as store\.sqlite\)"
        r" until it is done\n(verify: .*\n)*verify exit 0\nscratch 0\n",
        stderr,
        re.MULTILINE,
    ), stderr
    assert "Errno" not in stderr


def test_a_warning_of_the_rebuilds_store_names_its_file_store_77(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """STORE-77: a verify whose rebuilt store the disk refuses (files limited to 160 KiB: the
    copy of the live summaries fits, the rebuilt objects do not) logs the fold's WARNING
    naming the rebuilt store's own file, not ``store.sqlite``, which it only read."""
    append(
        journal,
        delivery(body({f"m{n}": [point(m, n + m / 7) for m in range(1200)] for n in range(4)})),
    )
    run_pass(journal, store, epoch)

    with pytest.raises(RebuildError), files_limited_to(160 * 2**10):
        verify(journal, store, workers=1)

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings
    for warning in warnings:
        assert re.fullmatch(
            rf"delivery 1: fold not written: StorageError: {DISK_ERROR}"
            r" \(rebuilt\.sqlite\)",
            warning,
        ), warning


def _at(minute: int) -> str:
    """A time on 2024-03-01 in the app's shape, ``minute`` minutes after midnight UTC, written
    at +14:00 or -12:00 on odd minutes."""
    moment = BASE_US // 1_000_000 + minute * 60
    offset = (14 if minute % 4 == 1 else -12) * 3600 if minute % 2 else 0
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(moment + offset)) + (
        " +1400" if offset > 0 else " -1200" if offset < 0 else " +0000"
    )


_MINUTES = st.sampled_from([0, 1, 2, 30, 61, 119])
_ODD_VALUES = st.sampled_from(
    [
        None,
        "",
        0,
        -0.0,
        1e308,
        5e-324,
        12345678901234567890,
        [],
        {},
        "2024-02-30 00:00:00 +0000",
        "2024-03-01 7:57:00 k\u0131 +1000",
    ]
)
_HOSTILE_POINTS = st.one_of(
    st.builds(
        lambda minute, qty, rich: {"date": _at(minute), "qty": qty, **rich},
        _MINUTES,
        st.sampled_from([1, 2, 2.0000000000001, -0.0, 12345678901234567890]),
        st.sampled_from([{}, {"source": "Watch"}, {"source": "Watch", "context": "run"}]),
    ),
    st.builds(
        lambda minute, length: {
            "startDate": _at(minute),
            "endDate": _at(minute + length),
            "value": "Core",
        },
        _MINUTES,
        st.sampled_from([0, 1, 30]),
    ),
    st.builds(
        lambda minute, qty: {
            "date": _at(minute),
            "start": _at(minute),
            "end": _at(minute + 60),
            "qty": qty,
        },
        _MINUTES,
        st.integers(0, 2),
    ),
    st.builds(lambda minute, odd: {"date": _at(minute), "qty": odd}, _MINUTES, _ODD_VALUES),
    st.builds(lambda odd: {"date": odd, "qty": 1}, _ODD_VALUES),
    _ODD_VALUES,
)
_HOSTILE_DELIVERIES = st.tuples(
    st.lists(
        st.tuples(
            st.sampled_from(["hr", "steps", "workouts"]),
            st.sampled_from(["count", "kg", "", None]),
            st.lists(_HOSTILE_POINTS, max_size=5),
        ),
        max_size=3,
    ),
    st.lists(
        st.builds(
            lambda start: {"name": "Walk", "start": _at(start), "end": _at(start + 30)}, _MINUTES
        ),
        max_size=2,
    ),
    st.sampled_from([None, None, "minutes", "Hours", "fortnights"]),
    st.sampled_from(["A", "B", None]),
    st.none() | st.integers(0, 4),
    st.sampled_from(["wrapped", "bare", "listed"]),
)


def _hostile_body(
    metrics: list[tuple[str, str | None, list[Any]]], workouts: list[dict[str, Any]], shape: str
) -> bytes:
    """A body of ``metrics`` (name, units or none, points) and ``workouts``, in the app's
    ``data`` wrapper, without it, or in an array."""
    sections: dict[str, Any] = {
        "metrics": [
            {"name": name, "data": data, **({} if units is None else {"units": units})}
            for name, units, data in metrics
        ]
    }
    if workouts:
        sections["workouts"] = workouts
    if shape == "bare":
        return orjson.dumps(sections)
    if shape == "listed":
        return orjson.dumps([{"data": sections}])
    return orjson.dumps({"data": sections})


@settings(max_examples=20, deadline=None)
@given(st.lists(_HOSTILE_DELIVERIES, min_size=1, max_size=5), st.sampled_from([1, 2]))
def test_hostile_deliveries_folded_live_equal_their_rebuild_merge_30(
    specs: list[tuple[Any, ...]], workers: int
) -> None:
    """MERGE-30: deliveries of any envelope shape, with or without a known header, of two
    automations or none, backfilled or not, holding metric points, sleep segments, hourly
    points with start and end, workouts, points rejected for any reason and values at the
    edges, at +14:00 and -12:00, folded live one by one, verify clean against their rebuild
    (objects and outcomes), by one worker and by two."""
    with scratch_data() as (_, journal, store):
        for metrics, workouts, aggregation, automation, offset, shape in specs:
            append(
                journal,
                delivery(
                    _hostile_body(metrics, workouts, shape),
                    received_at=None if offset is None else BASE_US + offset,
                    aggregation=aggregation,
                    automation=automation,
                ),
            )
        assert fold_live(journal, store).stopped_because == "empty"

        verification = verify_all(journal, store, workers=workers)
        assert (verification.objects, verification.outcomes) == ([], [])


_TRAVEL_START = datetime(2024, 2, 6, 15, tzinfo=UTC)


def _travelled(hours: int, *, late_keys: bool = False) -> list[bytes]:
    """Aggregated sleep and a workout with a route, every date written at UTC+``hours`` (the
    same instants whatever ``hours``); their first keys `date` and `end`, or, ``late_keys``,
    `totalSleep` and `id`, which sort after those."""

    def written(moment: datetime) -> str:
        zone = timezone(timedelta(hours=hours))
        return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %z")

    bed, wake = _TRAVEL_START - timedelta(hours=9), _TRAVEL_START - timedelta(hours=2)
    sleep = {
        "date": written(_TRAVEL_START),
        "totalSleep": 7.0,
        "sleepStart": written(bed),
        "sleepEnd": written(wake),
        "inBedStart": written(bed),
        "inBedEnd": written(wake),
    }
    workout = {
        "end": written(_TRAVEL_START + timedelta(minutes=5)),
        "id": "W1",
        "start": written(_TRAVEL_START),
        "route": [
            {"latitude": 49.2827, "timestamp": written(_TRAVEL_START + timedelta(seconds=s))}
            for s in range(2)
        ],
    }
    if late_keys:
        sleep = {"totalSleep": sleep.pop("totalSleep"), **sleep}
        workout = {"id": workout.pop("id"), **workout}
    return [orjson.dumps(sleep), orjson.dumps(workout)]


def test_re_sends_in_other_offsets_keep_what_a_store_folded_before_holds_merge_33(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MERGE-33: a delivery at -0800, its re-send at +0900 (the same instants), then one
    delivery holding it at +0000 and at +0500, folded live into real SQLite files: no WARN,
    no overwrite, and each object holds the bytes the rules before MERGE-31 kept (the later
    delivery's, and within one the greater canonical form with `sleepStart` and `timestamp`
    as written: the +0500 one, whose raw bytes are the smaller), so that a store those rules
    folded verifies clean against a rebuild by these; and it does here."""
    later, smaller = _travelled(5), _travelled(0, late_keys=True)
    assert all(a < b for a, b in zip(later, smaller, strict=True))
    with scratch_data() as (tmp, journal, store):
        for versions in ([_travelled(-8)], [_travelled(9)], [smaller, later]):
            sleeps, workouts = zip(*versions, strict=True)
            payload = b'{"data":{"metrics":[{"name":"sleep_analysis","units":"hr","data":[%s]}],'
            payload += b'"workouts":[%s]}}'
            append(
                journal,
                delivery(payload % (b",".join(sleeps), b",".join(workouts)), aggregation="days"),
            )
        caplog.set_level(logging.DEBUG)
        assert fold_live(journal, store).stopped_because == "empty"

        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        with closing(sqlite3.connect(tmp / "store.sqlite")) as conn:
            kept = sorted(
                raw
                for (body,) in conn.execute("SELECT body FROM objects")
                for raw in objects.decode(bytes(body)).values()
            )
            counters = [
                orjson.loads(row)
                for (row,) in conn.execute("SELECT counters FROM outcomes ORDER BY delivery_id")
            ]
        assert kept == sorted(later)
        assert [c["overwrites"] for c in counters] == [0, 0, 0]
        assert [c["points_unchanged"] for c in counters] == [0, 2, 2]
        verification = verify_all(journal, store, workers=1)
        assert (verification.objects, verification.outcomes) == ([], [])


def test_records_of_one_moment_fold_live_as_a_rebuild_does_merge_35() -> None:
    """MERGE-35: three symptoms of one cycle day and two doses taken at once, then the day's
    symptoms again with one severity changed, folded live into real SQLite files: each record is
    kept, the changed one replaced alone, and rebuilds by one worker and by two find no object
    and no outcome differing."""
    day = b'"start":"2024-02-06 00:00:00 -0800","end":"2024-02-07 00:00:00 -0800"'
    dose = b'"start":"2024-02-06 08:00:00 -0800","end":"2024-02-06 08:00:00 -0800"'
    symptoms = [
        b'{%s,"name":"%s","severity":"Mild"}' % (day, name) for name in (b"Bloating", b"Headache")
    ]
    doses = [b'{%s,"displayText":"%s","dosage":1}' % (dose, name) for name in (b"A", b"B")]
    first = b'{"data":{"symptoms":[%s],"medications":[%s]}}' % (
        b",".join([*symptoms, b'{%s,"name":"Acne","severity":"Mild"}' % day]),
        b",".join(doses),
    )
    changed = symptoms[1].replace(b"Mild", b"Severe")
    with scratch_data() as (tmp, journal, store):
        append(journal, delivery(first))
        append(journal, delivery(b'{"symptoms":[%s]}' % changed))
        assert fold_live(journal, store).stopped_because == "empty"

        with closing(sqlite3.connect(tmp / "store.sqlite")) as conn:
            kept = {
                metric: [
                    line.split(b"\t", 2)[2] for line in gzip.decompress(bytes(body)).splitlines()
                ]
                for metric, body in conn.execute("SELECT metric, body FROM objects")
            }
        assert kept == {
            "medications": doses,
            "symptoms": [b'{%s,"name":"Acne","severity":"Mild"}' % day, symptoms[0], changed],
        }
        for workers in (1, 2):
            verification = verify_all(journal, store, workers=workers)
            assert (verification.objects, verification.outcomes) == ([], [])


def test_a_store_folded_before_merge_35_advises_a_reindex_until_one_runs_store_127_store_129(
    journal: Journal, tmp_path: Path
) -> None:
    """STORE-127, STORE-129: a store an older healthlog folded three symptoms of one day and two
    doses taken at once into (one of each kept, its schema one version older), opened by this
    one: the migration marks it, `reindex_advised` is `records_of_one_moment`, and changes no
    object, outcome or event; verify finds the two objects and leaves the mark; the reindex
    brings the five records back and takes the mark away, and it stays away when reopened."""
    path = tmp_path / "store.sqlite"
    append(journal, delivery(ONE_MOMENT_RECORDS))
    append(journal, delivery(body({"steps": [point(1, 10)]})))
    with Store(path) as store:
        assert fold_live(journal, store).stopped_because == "empty"
    fold_as_before_merge_35(path)
    older = rows(path)

    with Store(path) as store:
        assert {s.key.metric: s.points for s in summaries(store).values()} == {
            "medications": 1,
            "symptoms": 1,
            "steps": 1,
        }
        assert store.reindex_advised() == ["records_of_one_moment"]
        upgraded = rows(path)
        assert {name: upgraded[name] for name in older if name != "marks"} == {
            name: older[name] for name in older if name != "marks"
        }
        assert [key for key, _ in upgraded["marks"] if (key, _) not in older["marks"]] == [
            "reindex_advised"
        ]
        differences = verify_all(journal, store, workers=1).objects
        assert sorted(d.key.metric for d in differences) == ["medications", "symptoms"]
        assert store.reindex_advised() == ["records_of_one_moment"]
        assert reindex(journal, store, "reindex", workers=1) == 2
        assert store.reindex_advised() == []
        assert verify_all(journal, store, workers=1).objects == []
        assert {s.key.metric: s.points for s in summaries(store).values()} == {
            "medications": 2,
            "symptoms": 3,
            "steps": 1,
        }
    with Store(path) as store:
        assert store.reindex_advised() == []


# The days the Buddhist-era steps were taken on, in the Gregorian calendar.
LIVED_DAYS = ("--from", "2024-03-01T00:00:00Z", "--to", "2024-03-04T00:00:00Z")


def test_a_store_holding_points_of_another_calendar_advises_a_reindex_store_156(
    tmp_path: Path, cli: Cli
) -> None:
    """STORE-156: a store an older healthlog folded before PARSE-41 (steps a phone set to the
    Buddhist calendar dated 2567, stored 543 years late; and before MERGE-35 too), opened by this
    one: the migration marks it, `reindex_advised` is `records_of_one_moment` and
    `other_calendars`, no object, outcome or event changed; `status` says why with the command,
    export over the days lived finds none of those steps; the reindex brings them to 2024 and
    takes the mark away. (Before, nothing said so: measured on a store 28d646e folded, 864
    points stayed in 2567, export over 2024-02-29 to 2024-03-03 gave 0 lines, status and serve
    advised nothing, verify exited 1 on 192 objects without saying why.)"""
    data = DataDir(tmp_path / "data")
    path = data.store_path
    with data.open_journal() as live:
        append(live, delivery(ONE_MOMENT_RECORDS))
        append(live, delivery(BUDDHIST_ERA_STEPS))
        append(live, delivery(body({"steps": [point(1, 10)]})))
    with data.open_journal() as live, data.open_store() as store:
        assert fold_live(live, store).stopped_because == "empty"
        lived = {s.key.hour for s in summaries(store).values() if s.key.metric == "thai_steps"}
    fold_as_before_parse_41(path, ["thai_steps"])
    fold_as_before_merge_35(path)
    older = rows(path)

    with data.open_journal() as live, data.open_store() as store:
        assert store.reindex_advised() == ["records_of_one_moment", "other_calendars"]
        upgraded = rows(path)
        assert {name: upgraded[name] for name in older if name != "marks"} == {
            name: older[name] for name in older if name != "marks"
        }
        late = {s.key.hour for s in summaries(store).values() if s.key.metric == "thai_steps"}
        assert min(late) > max(lived) + 500 * 365 * 86400 * 10**6
        status = cli("status", "--data", data.path)
        assert status.code == 0, status.err
        assert "dated in a calendar other than the Gregorian" in status.out.decode()
        assert f"`healthlog reindex --data {data.path}`" in status.out.decode()
        during = cli("export", "--data", data.path, "--metric", "thai_steps", *LIVED_DAYS)
        assert (during.code, during.out) == (0, b"")
        # The two records' objects, and two hours of steps gone from 2567 and made in 2024.
        assert reindex(live, store, "reindex", workers=1) == 6
        assert store.reindex_advised() == []
        assert verify_all(live, store, workers=1).objects == []
        assert {
            s.key.hour for s in summaries(store).values() if s.key.metric == "thai_steps"
        } == lived
    after = cli("export", "--data", data.path, "--metric", "thai_steps", *LIVED_DAYS)
    assert [line["point"]["qty"] for line in after.json_lines()] == [120, 88]


def test_a_store_without_records_of_one_moment_is_never_advised_a_reindex_store_128(
    journal: Journal, tmp_path: Path
) -> None:
    """STORE-128: a store of the older schema holding no object of symptoms, medications or
    cycle-tracking entries (steps alone) gets no mark when it is opened; nor does a store this
    healthlog made new, whatever it folds since, those records included."""
    append(journal, delivery(body({"steps": [point(1, 10)]})))
    older = tmp_path / "older.sqlite"
    with Store(older) as store:
        assert fold_live(journal, store).stopped_because == "empty"
    fold_as_before_merge_35(older)
    with Store(older) as store:
        assert store.reindex_advised() == []
        assert "reindex_advised" not in dict(rows(older)["marks"])

    append(journal, delivery(ONE_MOMENT_RECORDS))
    with Store(tmp_path / "new.sqlite") as store:
        assert fold_live(journal, store).stopped_because == "empty"
        assert store.reindex_advised() == []
    with Store(tmp_path / "new.sqlite") as store:
        assert store.reindex_advised() == []
