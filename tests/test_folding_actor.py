"""The folding actor inside a running runtime: the scenarios of seed 000 and the lease
(specs/runtime.md, RUN-14 to RUN-28). Real SQLite files in tmp_path, folds in worker threads
unless a test says otherwise."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import re
import resource
import socket
import sqlite3
import subprocess
import sys
import sysconfig
import time
import venv
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import httpx
import orjson
import pytest
import trio
import trio_parallel
from _cli_bodies import body, metric, point
from _disk import files_limited_to
from _runtime_helpers import (
    CLIENT,
    EVERY_HIT,
    HISTORY_US,
    HOLDER,
    HOUR_US,
    action,
    config,
    folded_ids,
    folded_in_order,
    journal_directly,
    lease_row,
    logged,
    mark,
    new_delivery,
    outcome_epochs,
    passes_ended,
    table,
    until,
    wait_folded,
)

from actors.folding import Executor
from actors.runtime import open_runtime
from healthlog import clock, faults, workload
from healthlog.folding import OutcomeClass
from healthlog.storage._sqlite import Deferred, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV, SERVE_PID_ENV
from healthlog.storage.journal import DeliveryMeta, NewDelivery, Receipt
from healthlog.storage.passes import FIRST_PASS_MARK, LAG_MARK, PAGE, Budget
from healthlog.storage.rebuild import verify
from healthlog.storage.store import Store, default_holder
from healthlog.storage.worker import CODE, RETIRE_AFTER_BYTES, fold_run
from transport.intake import IntakeRefusals
from transport.metrics import render_metrics
from transport.stream import HandshakeRefusals


def deferred_at(hit: int) -> faults.Plan:
    """A plan deferring the fold whose ``fold.begin`` is hit number ``hit``."""
    return faults.Plan(actions={"fold.begin": action({hit}, faults.raise_fault(Deferred))})


async def test_visible_deliveries_fold_in_journal_order_one_at_a_time_run_14(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-14: deliveries pending before a pass fold in (received_at, id) order, not in the
    order they were inserted, each fold ending before the next begins; a delivery without a
    layer of its own inherits the layer of its predecessor in journal order."""
    ids = journal_directly(
        tmp_path,
        [
            new_delivery(0, received_at=HISTORY_US + 30),
            new_delivery(1, received_at=HISTORY_US + 10, aggregation="minutes"),
            new_delivery(2, received_at=HISTORY_US + 20, aggregation=None),
            new_delivery(3, received_at=HISTORY_US + 10, aggregation="hours"),
            new_delivery(4),
        ],
    )
    trail: list[str] = []
    plan = faults.Plan(
        actions={
            "fold.begin": action(EVERY_HIT, trail.append),
            "fold.after_commit": action(EVERY_HIT, trail.append),
        }
    )
    with faults.loaded(plan):
        async with open_runtime(config(tmp_path)) as runtime:
            await wait_folded(tmp_path, ids)
            await passes_ended(runtime, 1)
            stats = runtime.statistics().folding

    assert folded_in_order(tmp_path) == [ids[i] for i in (1, 3, 2, 0, 4)]
    assert trail == ["fold.begin", "fold.after_commit"] * 5
    assert stats.passes_by_stop == {"empty": 1}
    layer = table(
        DataDir(tmp_path).store_path, "SELECT layer FROM outcomes WHERE delivery_id = ?", ids[2]
    )
    assert layer == [("hours",)]
    assert logged(caplog, logging.WARNING) == logged(caplog, logging.ERROR) == []


async def test_a_busy_store_holds_the_queue_at_its_head_run_15(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-15: while another connection holds store.sqlite's write lock, every pass defers at
    the head of the queue and folds none of its successors; after the lock is released, the
    next wake folds them all in journal order."""
    # A short period: a pass a wake started before the count below was read is followed by
    # another soon, so waiting for one more pass to end never waits on the 60 s default.
    async with open_runtime(config(tmp_path, busy_timeout_ms=50, wake_period_s=0.2)) as runtime:
        first = await runtime.submit(new_delivery(0))
        await wait_folded(tmp_path, [first.delivery_id])
        store_path = DataDir(tmp_path).store_path
        with closing(sqlite3.connect(store_path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            held = [(await runtime.submit(new_delivery(n))).delivery_id for n in (1, 2, 3)]
            # A pass starting after the last submit selects all three.
            await passes_ended(runtime, runtime.statistics().folding.passes + 1)
            during = runtime.statistics().folding
            assert folded_ids(tmp_path) == {first.delivery_id}
            holder.execute("ROLLBACK")
        last = await runtime.submit(new_delivery(4))
        await wait_folded(tmp_path, [*held, last.delivery_id])

    assert during.passes_by_stop["deferred"] >= 1
    assert during.outcomes_by_class["deferred"] == during.passes_by_stop["deferred"]
    assert folded_in_order(tmp_path) == [first.delivery_id, *held, last.delivery_id]
    assert (
        "folding pass: lag mark not written: Deferred: SQLITE_BUSY: database is locked"
        " (store.sqlite)" in logged(caplog, logging.WARNING)
    )


@pytest.mark.parametrize(
    "plan",
    [
        {"fold.object_write": action({2}, faults.raise_fault(StorageError))},
        {
            "fold.begin": action({2}, faults.raise_fault()),
            "fold.outcome_write": action({2}, faults.raise_fault(StorageError)),
        },
    ],
    ids=["fold_not_written", "failed_outcome_not_written"],
)
async def test_an_unwritten_delivery_stays_pending_and_the_pass_goes_on_run_16(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, plan: dict[str, faults.Action]
) -> None:
    """RUN-16: a delivery whose fold, and even whose failed outcome, cannot be written stays
    pending without stopping the pass; the lag mark names it, the first-pass flag is set, and
    the next pass folds it (warning that a later delivery was folded first)."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(3)])
    with faults.loaded(faults.Plan(actions=plan)):
        async with open_runtime(config(tmp_path)) as runtime:
            await passes_ended(runtime, 1)
            first_pass = runtime.statistics().folding
            assert folded_ids(tmp_path) == {ids[0], ids[2]}
            assert mark(tmp_path, LAG_MARK)["oldest_pending_id"] == ids[1]
            assert mark(tmp_path, LAG_MARK)["stopped_because"] == "unwritten"
            assert mark(tmp_path, FIRST_PASS_MARK) is True
            caplog.clear()
            later = await runtime.submit(new_delivery(3))
            await wait_folded(tmp_path, [ids[1], later.delivery_id])

    assert first_pass.passes_by_stop == {"unwritten": 1}
    assert first_pass.outcomes_by_class == {"done": 2, "unwritten": 1}
    assert folded_in_order(tmp_path) == [ids[0], ids[2], ids[1], later.delivery_id]
    (warning,) = logged(caplog, logging.WARNING)
    assert f"delivery {ids[1]} " in warning
    assert "reindex" in warning


async def test_a_fold_over_its_budget_is_failed_and_the_queue_moves_run_17(tmp_path: Path) -> None:
    """RUN-17: with a zero fold budget every delivery with points is failed (not deferred), an
    empty one still parses, and the pass reaches the end of the queue."""
    ids = journal_directly(
        tmp_path, [new_delivery(0), NewDelivery(b'{"data": {}}', "phone"), new_delivery(1)]
    )
    zero = Budget(base_s=0, per_mib_s=0)
    async with open_runtime(config(tmp_path, budget=zero)) as runtime:
        await wait_folded(tmp_path, ids)
        await passes_ended(runtime, 1)
        stats = runtime.statistics().folding

    store_path = DataDir(tmp_path).store_path
    over = ("failed", "fold over its time budget")
    outcomes = table(store_path, "SELECT delivery_id, status, reason FROM outcomes")
    assert {i: (status, reason) for i, status, reason in outcomes} == {
        ids[0]: over,
        ids[1]: ("parsed", None),
        ids[2]: over,
    }
    assert stats.passes_by_stop == {"empty": 1}
    assert stats.outcomes_by_class == {"done": 3}
    assert table(store_path, "SELECT count(*) FROM objects") == [(0,)]


async def test_the_periodic_wake_retries_a_delivery_left_pending_run_18(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """RUN-18: a delivery deferred by the first pass, with no traffic after it, folds on the
    periodic wake, one wake period later."""
    ids = journal_directly(tmp_path, [new_delivery()])
    with faults.loaded(deferred_at(1)):
        async with open_runtime(config(tmp_path, wake_period_s=10)) as runtime:
            started = trio.current_time()
            await until(lambda: runtime.statistics().folding.passes_by_stop == {"deferred": 1})
            assert folded_ids(tmp_path) == set()
            await wait_folded(tmp_path, ids)
            waited = trio.current_time() - started
            await passes_ended(runtime, 2)
            stats = runtime.statistics()

    assert waited >= 10
    assert stats.folding.outcomes_by_class == {"deferred": 1, "done": 1}
    assert (stats.intake.accepted, stats.lease.acquisitions) == (0, 1)


async def test_an_empty_pass_writes_the_lag_mark_and_the_first_pass_flag_run_19(
    tmp_path: Path,
) -> None:
    """RUN-19: the first pass over an empty journal reaches the end: it writes a lag mark with
    no pending delivery and sets the first-pass flag."""
    async with open_runtime(config(tmp_path)) as runtime:
        await passes_ended(runtime, 1)

    assert mark(tmp_path, LAG_MARK) == {
        "oldest_pending_id": None,
        "waited_s": 0.0,
        "stopped_because": "empty",
    }
    assert mark(tmp_path, FIRST_PASS_MARK) is True


async def test_a_deferred_barrier_writes_the_lag_mark_but_not_the_first_pass_flag_run_20(
    tmp_path: Path,
) -> None:
    """RUN-20: a pass stopped by a deferral writes the lag mark naming the stuck delivery and
    how long it has waited, and leaves the first-pass flag unset; the pass that later reaches
    the end of the queue clears the mark and sets the flag."""
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(3)]
    )
    with faults.loaded(deferred_at(2)):
        async with open_runtime(config(tmp_path)) as runtime:
            await passes_ended(runtime, 1)
            stuck = mark(tmp_path, LAG_MARK)
            assert mark(tmp_path, FIRST_PASS_MARK) is None
            assert runtime.statistics().folding.first_pass_completed is False
            later = await runtime.submit(new_delivery(3))
            await wait_folded(tmp_path, [*ids, later.delivery_id])
            await passes_ended(runtime, 2)
            assert runtime.statistics().folding.first_pass_completed is True

    assert stuck["oldest_pending_id"] == ids[1]
    assert stuck["stopped_because"] == "deferred"
    # Since it was journaled, moments before the pass (not since its received_at, 2024).
    with DataDir(tmp_path).open_journal() as journal:
        meta = journal.get_meta(ids[1])
    assert meta is not None
    assert 0 <= stuck["waited_s"] <= (clock.now_us() - meta.journaled_at) / 1e6
    assert mark(tmp_path, LAG_MARK)["oldest_pending_id"] is None
    assert mark(tmp_path, FIRST_PASS_MARK) is True


async def test_a_failed_selection_ends_the_pass_not_the_loop_run_21(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-21: when the pass cannot read its selection it logs one ERROR and ends, writing no
    mark; the folding loop goes on and the next wake folds everything."""
    ids = journal_directly(tmp_path, [new_delivery(0)])

    def disk_error(_: str) -> None:
        raise StorageError("database error: disk I/O error")

    with faults.loaded(faults.Plan(actions={"fold.select": action({1}, disk_error)})) as plan:
        async with open_runtime(config(tmp_path)) as runtime:
            await passes_ended(runtime, 1)
            assert runtime.statistics().folding.passes_by_stop == {"selection_failed": 1}
            assert (mark(tmp_path, LAG_MARK), mark(tmp_path, FIRST_PASS_MARK)) == (None, None)
            later = await runtime.submit(new_delivery(1))
            await wait_folded(tmp_path, [*ids, later.delivery_id])
            await passes_ended(runtime, 2)
            stats = runtime.statistics()

    assert plan.fired == {"fold.select": 1}
    assert logged(caplog, logging.ERROR) == ["folding pass: selection failed: StorageError"]
    assert stats.folding.passes_by_stop["selection_failed"] == 1
    assert stats.crashes == {}
    assert mark(tmp_path, FIRST_PASS_MARK) is True


async def test_why_a_pass_ended_is_kept_while_its_mark_cannot_say_it_store_66(
    tmp_path: Path,
) -> None:
    """STORE-66: while the disk takes no write, the folder keeps why its last pass ended
    (`unwritten`), which the store's lag mark, left from the pass before, does not say; once
    there is room, the next pass folds the delivery, writes its mark, and the folder keeps
    nothing. A failed selection, which writes no mark, is kept likewise until a pass writes
    one."""
    async with open_runtime(config(tmp_path, wake_period_s=0.05)) as runtime:
        await passes_ended(runtime, 1)
        assert runtime.statistics().folding.unrecorded_stop is None
        # Journaled without yielding to the event loop: no pass folds it before the limit.
        ids = journal_directly(tmp_path, [new_delivery(0)])
        with files_limited_to(4096):
            await until(lambda: runtime.statistics().folding.unrecorded_stop == "unwritten")
            assert mark(tmp_path, LAG_MARK)["stopped_because"] == "empty"
        await wait_folded(tmp_path, ids)
        await until(lambda: runtime.statistics().folding.unrecorded_stop is None)
        assert mark(tmp_path, LAG_MARK)["stopped_because"] == "empty"

        def disk_error(_: str) -> None:
            raise StorageError("database error: disk I/O error")

        with faults.loaded(faults.Plan(actions={"fold.select": action(EVERY_HIT, disk_error)})):
            await until(lambda: runtime.statistics().folding.unrecorded_stop == "selection_failed")
        await until(lambda: runtime.statistics().folding.unrecorded_stop is None)


async def test_leaving_the_runtime_mid_pass_is_no_error_run_22(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-22: leaving the runtime while a pass folds stops it as a normal stop: no ERROR, the
    fold in flight finishes, no later fold starts, and the lease is released."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(4)])
    second_fold = trio.Event()

    def signal(_: str) -> None:
        trio.from_thread.run_sync(second_fold.set)

    with faults.loaded(faults.Plan(actions={"fold.begin": action({2}, signal)})):
        async with open_runtime(config(tmp_path)) as runtime:
            await second_fold.wait()
        stats = runtime.statistics().folding

    assert logged(caplog, logging.ERROR) == []
    assert stats.passes_by_stop == {"cancelled": 1}
    assert folded_ids(tmp_path) == set(ids[:2])
    assert lease_row(tmp_path) == (None, 1)


async def test_a_backfill_folded_after_a_later_delivery_warns_once_run_23(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-23: a backfilled delivery whose received_at lies before an already parsed one is
    folded with exactly one WARNING, naming its id and `healthlog reindex`."""
    async with open_runtime(config(tmp_path)) as runtime:
        live = await runtime.submit(new_delivery(0))
        await wait_folded(tmp_path, [live.delivery_id])
        backfill = await runtime.submit(new_delivery(1, received_at=live.received_at - 60_000_000))
        await wait_folded(tmp_path, [backfill.delivery_id])

    (warning,) = logged(caplog, logging.WARNING)
    assert f"delivery {backfill.delivery_id} " in warning
    assert "reindex" in warning
    assert folded_in_order(tmp_path) == [live.delivery_id, backfill.delivery_id]


CHECKPOINTS = (
    "lease.renew",
    "fold.begin",
    "fold.object_write",
    "fold.outcome_write",
    "fold.before_commit",
    "fold.after_commit",
)
FOLDS = 5
POINTS_PER_FOLD = len(CHECKPOINTS) - 1
HITS = 1 + FOLDS * POINTS_PER_FOLD


@pytest.mark.parametrize("k", range(1, HITS + 1))
async def test_cancelling_at_any_checkpoint_leaves_each_delivery_folded_or_pending_run_24(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, k: int
) -> None:
    """RUN-24: the runtime is cancelled at the k-th checkpoint (the lease's first renewal, then
    every fault point of five folds). No ERROR; the fold in flight finishes and no later one
    starts, so every delivery is either folded with its object or pending without one; the
    lease is released; a new runtime folds the rest and the store equals a rebuild."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(FOLDS)])
    seen = 0
    scope = trio.CancelScope()

    def count(_: str) -> None:
        nonlocal seen
        seen += 1
        if seen == k:
            trio.from_thread.run_sync(scope.cancel)

    plan = faults.Plan(actions={name: action(EVERY_HIT, count) for name in CHECKPOINTS})
    with faults.loaded(plan), scope:
        async with open_runtime(config(tmp_path)):
            await trio.sleep_forever()

    in_flight = math.ceil((k - 1) / POINTS_PER_FOLD)
    assert seen >= k
    assert logged(caplog, logging.ERROR) == []
    assert folded_ids(tmp_path) == set(ids[:in_flight])
    created = table(DataDir(tmp_path).store_path, "SELECT created_by FROM objects")
    assert sorted(created) == [(i,) for i in ids[:in_flight]]
    assert lease_row(tmp_path)[0] is None

    async with open_runtime(config(tmp_path)):
        await wait_folded(tmp_path, ids)
    assert folded_in_order(tmp_path) == ids
    data = DataDir(tmp_path)
    with data.open_journal() as journal, data.open_store() as store:
        assert verify(journal, store) == []


async def test_a_takeover_mid_pass_fences_the_folder_until_it_holds_the_lease_again_run_25(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-25: another holder takes the lease at a higher epoch and releases it (as reindex
    does) between two folds: the next fold is fenced and writes nothing, the pass stops, and
    once the lease actor retakes the lease the rest folds under the new epoch."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(3)])
    with Store(DataDir(tmp_path).store_path) as other:

        def reindex(_: str) -> None:
            now = time.time_ns() // 1000
            epoch = other.acquire_lease("reindex", now=now, ttl=HOUR_US, force=True)
            assert epoch is not None
            other.release_lease("reindex", epoch)

        plan = faults.Plan(actions={"fold.after_commit": action({1}, reindex)})
        with faults.loaded(plan):
            settings = config(tmp_path, lease_renew_s=0.5, lease_ttl_s=5)
            async with open_runtime(settings) as runtime:
                await wait_folded(tmp_path, ids)
                await passes_ended(runtime, 2)
                stats = runtime.statistics()

    assert outcome_epochs(tmp_path) == {ids[0]: 1, ids[1]: 3, ids[2]: 3}
    assert folded_in_order(tmp_path) == ids
    assert stats.folding.passes_by_stop["fenced"] == 1
    assert stats.folding.outcomes_by_class == {"done": 3, "fenced": 1}
    assert (stats.lease.epoch, stats.lease.acquisitions) == (3, 2)
    assert f"delivery {ids[1]}: fold fenced, lease epoch 1 lost" in logged(caplog, logging.WARNING)


async def test_a_fenced_folder_waits_for_its_lease_actor_run_32(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-32: after a fold is fenced, the folder forgets its epoch: deliveries submitted before
    its lease actor renews wake no pass under the lost epoch, so one fold is fenced, not one per
    wake."""
    settings = config(tmp_path, lease_renew_s=10, lease_ttl_s=30)
    async with open_runtime(settings) as runtime:
        first = await runtime.submit(new_delivery(0))
        await wait_folded(tmp_path, [first.delivery_id])
        with Store(DataDir(tmp_path).store_path) as other:
            now = time.time_ns() // 1000
            assert other.acquire_lease("other", now=now, ttl=HOUR_US, force=True) == 2
            await runtime.submit(new_delivery(1))
            await until(lambda: runtime.statistics().folding.outcomes_by_class.get("fenced") == 1)
            for n in range(2, 4):
                await runtime.submit(new_delivery(n))
                await trio.sleep(0.3)
            stats = runtime.statistics()
    assert stats.folding.epoch is None
    assert stats.folding.outcomes_by_class == {"done": 1, "fenced": 1}
    assert stats.folding.passes_by_stop["fenced"] == 1
    fenced = [r for r in logged(caplog, logging.WARNING) if "fold fenced" in r]
    assert len(fenced) == 1


async def test_a_fold_holding_the_store_past_the_lease_ttl_is_not_fenced_fence_12(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """FENCE-12: a fold that takes longer than the lease's TTL (renewals wait for it) leaves
    the runtime at its epoch: nothing is fenced, every delivery folds under epoch 1."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(3)])
    slow = faults.Plan(actions={"fold.begin": action({1}, lambda _: time.sleep(2.5))})
    with faults.loaded(slow):
        async with open_runtime(config(tmp_path, lease_ttl_s=2, lease_renew_s=0.5)) as runtime:
            await wait_folded(tmp_path, ids)
            # The last outcome is in the store before the actor has counted its report.
            await until(lambda: not runtime.statistics().folding.running)
            stats = runtime.statistics()
    assert outcome_epochs(tmp_path) == dict.fromkeys(ids, 1)
    assert stats.folding.outcomes_by_class == {"done": 3}
    assert stats.lease.acquisitions == 1
    assert [r for r in logged(caplog, logging.WARNING) if "fenced" in r] == []


def test_each_runtime_has_a_holder_name_of_its_own_fence_12() -> None:
    """FENCE-12: default holder names are the host and process with a random part, different
    for each runtime even in one process (a process id comes back after a restart)."""
    first, second = default_holder(), default_holder()
    assert first != second
    assert first.startswith(f"{socket.gethostname()}:{os.getpid()}:")


async def test_folds_run_in_worker_processes_end_to_end_run_26(tmp_path: Path) -> None:
    """RUN-26: with the process executor, journaled and submitted deliveries fold in journal
    order in worker processes, each commit checkpointed under the runtime's lease epoch."""
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(2)]
    )
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS)) as runtime:
        live = await runtime.submit(new_delivery(2))
        await wait_folded(tmp_path, [*ids, live.delivery_id], timeout=30)
        checkpoint = await runtime.read_store(Store.checkpoint)

    assert folded_in_order(tmp_path) == [*ids, live.delivery_id]
    assert outcome_epochs(tmp_path) == dict.fromkeys([*ids, live.delivery_id], 1)
    assert checkpoint == (live.received_at, live.delivery_id, 1)
    data = DataDir(tmp_path)
    with data.open_journal() as journal, data.open_store() as store:
        assert verify(journal, store) == []


async def test_a_run_of_deliveries_folds_each_alone_and_stops_after_a_report_not_done_run_27(
    tmp_path: Path,
) -> None:
    """RUN-27: ``fold_run`` (in a worker process) folds in order, one transaction each, and
    stops after the first report that is not DONE (here a delivery missing from the journal)."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(3)])
    with DataDir(tmp_path).open_store() as store:
        epoch = store.acquire_lease(HOLDER, now=time.time_ns() // 1000, ttl=60_000_000)
    assert epoch is not None
    missing = ids[-1] + 1

    async def fold(run: list[int]) -> list[tuple[int, OutcomeClass]]:
        reports = await trio_parallel.run_sync(
            fold_run, CODE, str(tmp_path), run, epoch, Budget(), 5000, kill_on_cancel=True
        )
        return [(r.delivery_id, r.outcome_class) for r in reports]

    done, unwritten = OutcomeClass.DONE, OutcomeClass.UNWRITTEN
    assert await fold([ids[0], missing, ids[1]]) == [(ids[0], done), (missing, unwritten)]
    assert folded_in_order(tmp_path) == [ids[0]]
    assert await fold(ids[1:]) == [(ids[1], done), (ids[2], done)]
    assert folded_in_order(tmp_path) == ids


async def test_many_small_deliveries_fold_in_runs_in_journal_order_run_27(
    tmp_path: Path,
) -> None:
    """RUN-27: forty small deliveries, pending together, fold through worker calls of several
    each, in journal order, every outcome under the lease epoch and timed one by one: a call's
    time shared among its deliveries, so that the fold times add up to no more than the time
    the runtime ran."""
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(40)]
    )
    started = trio.current_time()
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS)) as runtime:
        await wait_folded(tmp_path, ids, timeout=60)
        await until(lambda: not runtime.statistics().folding.running)
        folding = runtime.statistics().folding
        ran = trio.current_time() - started

    assert folded_in_order(tmp_path) == ids
    assert outcome_epochs(tmp_path) == dict.fromkeys(ids, 1)
    assert (folding.folded, folding.folds_timed) == (40, 40)
    assert 0 < folding.duration_sum_s <= ran


def metas_alive() -> int:
    """How many :class:`DeliveryMeta` objects this process holds."""
    return sum(1 for held in gc.get_objects() if type(held) is DeliveryMeta)


async def test_the_folder_holds_a_page_of_its_queue_not_the_whole_queue_run_61(
    tmp_path: Path,
) -> None:
    """RUN-61: with 476 more deliveries waiting than a page holds, the runtime's first pass
    folds them all in journal order while the service holds the metadata of at most a page of
    them. (Before, it held every waiting delivery's for the whole pass: 178 MB resident against
    64 MB for an empty service, with 100,000 waiting.)"""
    waiting = PAGE + 476
    with DataDir(tmp_path).open_journal() as journal:
        receipts = journal.append_many(
            [new_delivery(n, received_at=HISTORY_US + n) for n in range(waiting)]
        )
    ids = [receipt.delivery_id for receipt in receipts if isinstance(receipt, Receipt)]
    held: list[int] = []
    every_100th = action(range(1, waiting + 1, 100), lambda _: held.append(metas_alive()))

    with faults.loaded(faults.Plan(actions={"fold.begin": every_100th})):
        async with open_runtime(config(tmp_path)) as runtime:
            await wait_folded(tmp_path, ids, timeout=120)
            await passes_ended(runtime, 1)
            folding = runtime.statistics().folding

    assert folded_in_order(tmp_path) == ids
    assert folding.passes_by_stop == {"empty": 1}
    assert len(held) == 15
    assert 0 < max(held) <= PAGE, held


async def test_runs_of_small_deliveries_fold_page_by_page_in_journal_order_run_62(
    tmp_path: Path,
) -> None:
    """RUN-62: with the process executor and a page of 8, twenty small deliveries journaled
    out of order fold in one pass, in journal order, through runs of the pages."""
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + (n * 7) % 20) for n in range(20)]
    )
    order = [ids[n] for n in sorted(range(20), key=lambda n: (n * 7) % 20)]
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS, pass_page=8)) as runtime:
        await wait_folded(tmp_path, ids, timeout=60)
        await passes_ended(runtime, 1)
        folding = runtime.statistics().folding

    assert folded_in_order(tmp_path) == order
    assert outcome_epochs(tmp_path) == dict.fromkeys(ids, 1)
    assert (folding.folded, folding.passes_by_stop) == (20, {"empty": 1})


def worker_processes() -> dict[int, int]:
    """This process's trio-parallel worker children (pid -> niceness)."""
    pids = [
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    found = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            if b"spawn_main" in command and b"resource_tracker" not in command:
                found[pid] = os.getpriority(os.PRIO_PROCESS, pid)
    return found


async def test_fold_workers_run_nicer_than_the_service_run_28(tmp_path: Path) -> None:
    """RUN-28: the worker processes a runtime folds in run 10 (WORKER_NICENESS) nicer than it,
    at most at 19."""
    ids = journal_directly(tmp_path, [new_delivery(0)])
    before = worker_processes()
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS)):
        await wait_folded(tmp_path, ids, timeout=30)
        started = {pid: nice for pid, nice in worker_processes().items() if pid not in before}

    assert started
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(started.values()) == {min(19, own + 10)}


def large_delivery() -> NewDelivery:
    """A minute-level delivery 1 MiB over ``RETIRE_AFTER_BYTES``, whose fold ends its worker."""
    return NewDelivery(
        workload.big_body(1, target_bytes=RETIRE_AFTER_BYTES + 2**20),
        CLIENT,
        content_type="application/json",
        automation_id="A",
        automation_aggregation="minutes",
    )


async def test_a_fold_worker_ends_after_a_large_body_run_59(tmp_path: Path) -> None:
    """RUN-59: the worker that folded a small delivery folds the next one too, and the worker
    that folded a body of RETIRE_AFTER_BYTES (8 MiB) or more ends after it, so that what the
    fold took goes back to the system (23 MiB more than before it stayed with the worker after
    a 50 MiB body, for as long as deliveries kept it busy); a new worker folds the next one.
    (Before, the worker that had folded the large body lived on.)"""
    before = set(worker_processes())
    large = large_delivery()
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS)) as runtime:
        small = await runtime.submit(new_delivery(0))
        await wait_folded(tmp_path, [small.delivery_id], timeout=60)
        first = set(worker_processes()) - before
        assert len(first) == 1
        again = await runtime.submit(new_delivery(1))
        await wait_folded(tmp_path, [again.delivery_id], timeout=60)
        assert first <= set(worker_processes())

        big = await runtime.submit(large)
        await wait_folded(tmp_path, [big.delivery_id], timeout=120)
        await until(lambda: not first & set(worker_processes()), timeout=30)
        later = await runtime.submit(new_delivery(2))
        await wait_folded(tmp_path, [later.delivery_id], timeout=60)
        assert set(worker_processes()) - before - first

    assert folded_in_order(tmp_path) == [
        small.delivery_id,
        again.delivery_id,
        big.delivery_id,
        later.delivery_id,
    ]


async def test_a_large_fold_not_written_is_tried_again_by_the_same_worker_run_60(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RUN-60: a fold of a body of RETIRE_AFTER_BYTES or more that is not written (an I/O error
    at its first object write) is tried again by the same worker, which ends only once the
    fold is written. (Before, the worker ended after the failed try too, and the new one met
    the seeded plan's fault again at its own first hit, so the delivery was never folded: 54
    I/O errors in one chaos run.)"""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    plan = {"fold.object_write": {"hits": [1], "do": "ioerror"}}
    monkeypatch.setenv(PLAN_ENV, orjson.dumps(plan).decode())
    before = set(worker_processes())
    large = large_delivery()
    settings = {"executor": Executor.PROCESS, "wake_period_s": 0.2}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        big = await runtime.submit(large)
        await wait_folded(tmp_path, [big.delivery_id], timeout=120)
        await until(lambda: not set(worker_processes()) - before, timeout=30)
        stats = runtime.statistics()

    assert stats.folding.workers_lost == 0
    statuses = table(DataDir(tmp_path).store_path, "SELECT status FROM outcomes")
    assert statuses == [("parsed",)]


def test_fold_workers_start_without_the_web_stack_run_29() -> None:
    """RUN-29: re-running the ``healthlog`` console script as ``__mp_main__``, as the spawn of
    every fold worker does, imports neither quart nor hypercorn."""
    script = Path(sys.executable).with_name("healthlog")
    probe = (
        "import runpy, sys\n"
        f"runpy.run_path({str(script)!r}, run_name='__mp_main__')\n"
        "import healthlog.storage.worker\n"
        "print(sorted({'quart', 'hypercorn'} & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def kill_worker_at(*hits: int) -> str:
    """A fault plan whose fold worker kills itself at those hits of ``fold.begin`` (no serving
    process is named, so the SIGKILL takes the worker alone, as the OOM killer would)."""
    return orjson.dumps({"fold.begin": {"hits": list(hits), "do": "kill"}}).decode()


async def test_a_lost_lease_cancels_the_pass_in_flight_run_39(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-39: the lease actor reports that another holder took the lease while a worker
    process folds a run (slowed after its first commit): the pass is cancelled there and the
    worker killed, so the first delivery keeps its outcome, no later fold of the run starts
    (none is fenced) and the pass ends ``cancelled``."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    slow = {"fold.after_commit": {"hits": [1], "do": "delay", "seconds": 3}}
    monkeypatch.setenv(PLAN_ENV, orjson.dumps(slow).decode())
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(3)]
    )
    settings = config(tmp_path, executor=Executor.PROCESS, lease_renew_s=0.1, lease_ttl_s=5)
    async with open_runtime(settings) as runtime:
        await wait_folded(tmp_path, ids[:1], timeout=60)
        with Store(DataDir(tmp_path).store_path) as other:
            now = time.time_ns() // 1000
            assert other.acquire_lease("other", now=now, ttl=HOUR_US, force=True) == 2
            await until(lambda: runtime.statistics().folding.epoch is None)
            await until(lambda: not runtime.statistics().folding.running)
            stats = runtime.statistics().folding

    assert stats.passes_by_stop == {"cancelled": 1}
    assert stats.outcomes_by_class == {}
    assert folded_ids(tmp_path) == {ids[0]}
    assert [r for r in logged(caplog, logging.WARNING) if "fold fenced" in r] == []


async def test_a_fold_worker_standing_still_past_its_budget_folds_fold_18(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FOLD-18, in a fold worker process: a fold of two hours that stands still at the first
    hour's object write for twice its budget of wall time (as a worker frozen or waiting for a
    core does) uses none of the budget meanwhile: the delivery is parsed, both objects stored,
    not failed over its budget at the second hour's check."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    still = {"fold.object_write": {"hits": [1], "do": "delay", "seconds": 1.0}}
    monkeypatch.setenv(PLAN_ENV, orjson.dumps(still).decode())
    hours = body(
        metric(
            "step_count",
            "count",
            point("2024-02-06 07:00:00 +0000", qty=1),
            point("2024-02-06 08:00:00 +0000", qty=2),
        )
    )
    delivery = NewDelivery(hours, "phone", "application/json", automation_aggregation="minutes")
    [delivery_id] = journal_directly(tmp_path, [delivery])
    half = Budget(base_s=0.5, per_mib_s=0)
    async with open_runtime(config(tmp_path, executor=Executor.PROCESS, budget=half)):
        await wait_folded(tmp_path, [delivery_id], timeout=60)

    outcomes = table(DataDir(tmp_path).store_path, "SELECT status, reason FROM outcomes")
    assert outcomes == [("parsed", None)]
    assert table(DataDir(tmp_path).store_path, "SELECT count(*) FROM objects") == [(2,)]


async def test_waiting_for_folds_reads_only_the_deliveries_waited_for_fold_19(
    tmp_path: Path,
) -> None:
    """FOLD-19: with 20,000 other outcomes stored, a wait for one folded delivery (what
    `import` and `seal` do until their deliveries fold) takes a handful of SQLite's steps on
    the store's connection, not one per outcome: it read every outcome id at each poll, 0.4 s
    at 500,000, twenty times a second."""
    [delivery_id] = journal_directly(tmp_path, [new_delivery()])
    store_path = DataDir(tmp_path).store_path
    Store(store_path).close()
    others = 20_000
    with closing(sqlite3.connect(store_path)) as conn, conn:
        conn.executemany(
            "INSERT INTO outcomes (delivery_id, received_at, status, counters, epoch)"
            " VALUES (?, 0, 'parsed', '{}', 0)",
            ((10**9 + n,) for n in range(others)),
        )
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    async with open_runtime(config(tmp_path, wake_period_s=3600)) as runtime:
        await wait_folded(tmp_path, [delivery_id])
        # The pass has written its marks (which read every outcome here, none being in the
        # journal), and the next is an hour away: only the wait reads meanwhile.
        await passes_ended(runtime, 1)
        await runtime.read_store(lambda store: store._conn.set_progress_handler(step, 100))
        try:
            await runtime.wait_folded([delivery_id])
        finally:
            await runtime.read_store(lambda store: store._conn.set_progress_handler(None, 100))

    assert steps < 50, steps


async def test_a_fold_worker_that_dies_defers_its_delivery_run_30(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-30, RUN-37: a run's worker killed at its second fold: the first delivery stands, the
    second is folded again in a new worker, whose own second fold dies too; every delivery folds
    in journal order, nothing is failed and the actor never crashes; once they have folded, the
    folder keeps no count of deaths for them. SERVE-162: `/metrics` counts the two workers
    lost."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    monkeypatch.setenv(PLAN_ENV, kill_worker_at(2))
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(3)]
    )
    settings = {"executor": Executor.PROCESS, "wake_period_s": 0.2}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        await wait_folded(tmp_path, ids, timeout=60)
        # The outcomes are in the store before the folder has taken the worker's reports.
        await until(lambda: runtime.statistics().folding.folded >= len(ids))
        stats = runtime.statistics()
        exposed = await render_metrics(runtime, 0, HandshakeRefusals(), IntakeRefusals(), 0)

    assert folded_in_order(tmp_path) == ids
    statuses = table(DataDir(tmp_path).store_path, "SELECT status FROM outcomes")
    assert statuses == [("parsed",)] * 3
    assert (stats.folding.workers_lost, stats.folding.dying, stats.crashes) == (2, 0, {})
    # SERVE-162: what an owner alerts on (workers the OOM killer takes) is in /metrics.
    assert b"\nhealthlog_fold_workers_lost_total 2.0\n" in exposed
    assert logged(caplog, logging.WARNING) == [
        f"delivery {ids[1]}: its fold worker died; folding it again",
        f"delivery {ids[2]}: its fold worker died; folding it again",
    ]
    assert logged(caplog, logging.ERROR) == []


async def test_a_run_whose_metadata_cannot_be_read_is_deferred_not_a_crash_fold_20(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FOLD-20: the fold worker's read of its run's metadata fails (an I/O error at the first hit
    of ``fold.run_lookup``): the pass ends ``deferred``, the folding actor does not crash, and
    the next pass folds every delivery in journal order."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    plan = {"fold.run_lookup": {"hits": [1], "do": "ioerror"}}
    monkeypatch.setenv(PLAN_ENV, orjson.dumps(plan).decode())
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(2)]
    )
    settings = {"executor": Executor.PROCESS, "wake_period_s": 0.2}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        await wait_folded(tmp_path, ids, timeout=60)
        # The worker's commits are seen before its pass ends and the runtime is ready.
        await until(runtime.ready, timeout=60)
        stats = runtime.statistics()

    assert folded_in_order(tmp_path) == ids
    assert stats.crashes == {}
    assert stats.folding.passes_by_stop.get("deferred") == 1


async def test_outcomes_unreadable_after_a_worker_died_defer_the_run_fold_21(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FOLD-21: a run's worker is killed at its first fold, and the folder's read of the run's
    outcomes then fails (an I/O error at the service's first hit of ``fold.run_lookup``): the
    pass ends ``deferred`` with one WARNING, no death is counted against the delivery, the
    folding actor does not crash, and the next pass folds both deliveries."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    monkeypatch.setenv(PLAN_ENV, kill_worker_at(1))
    ids = journal_directly(
        tmp_path, [new_delivery(n, received_at=HISTORY_US + n) for n in range(2)]
    )
    unreadable = faults.Action(frozenset({1}), faults.raise_fault(StorageError))
    settings = {"executor": Executor.PROCESS, "wake_period_s": 0.2}
    with faults.loaded(faults.Plan({"fold.run_lookup": unreadable})):
        async with open_runtime(config(tmp_path, **settings)) as runtime:
            await until(lambda: runtime.statistics().folding.workers_lost >= 1, timeout=60)
            monkeypatch.delenv(PLAN_ENV)
            await wait_folded(tmp_path, ids, timeout=60)
            # The worker's commits are seen before its pass ends and the runtime is ready.
            await until(runtime.ready, timeout=60)
            stats = runtime.statistics()

    assert folded_in_order(tmp_path) == ids
    assert (stats.crashes, stats.folding.dying) == ({}, 0)
    assert stats.folding.passes_by_stop.get("deferred") == 1
    assert logged(caplog, logging.WARNING) == [
        f"delivery {ids[0]}: its fold worker died and the outcomes of its run cannot be read:"
        " StorageError; folding it again"
    ]


async def test_a_delivery_that_kills_every_worker_is_failed_and_the_queue_moves_on_run_30(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-30: a delivery whose fold kills WORKER_DEATHS (2) workers in a row is recorded failed
    (`fold worker died`) with one ERROR, and the delivery after it folds."""
    monkeypatch.delenv(SERVE_PID_ENV, raising=False)
    monkeypatch.setenv(PLAN_ENV, kill_worker_at(1))
    [poison] = journal_directly(tmp_path, [new_delivery(0, received_at=HISTORY_US)])
    settings = {"executor": Executor.PROCESS, "wake_period_s": 0.2}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        await wait_folded(tmp_path, [poison], timeout=60)
        monkeypatch.delenv(PLAN_ENV)
        later = await runtime.submit(new_delivery(1))
        await wait_folded(tmp_path, [later.delivery_id], timeout=60)
        stats = runtime.statistics()
        failed = await runtime.read_store(lambda store: store.outcome(poison))
        parsed = await runtime.read_store(lambda store: store.outcome(later.delivery_id))

    assert failed is not None
    assert (failed.status, failed.reason) == ("failed", "fold worker died")
    assert parsed is not None
    assert parsed.status == "parsed"
    assert (stats.folding.workers_lost, stats.crashes) == (2, {})
    assert logged(caplog, logging.ERROR) == [
        f"delivery {poison}: its fold worker died 2 times in a row; recorded failed"
    ]


async def test_a_body_that_cannot_be_read_is_failed_and_the_queue_moves_on_run_34(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-34: a delivery whose body cannot be read for a reason that is not a storage error
    (no memory to inflate it: the fault point ``journal.read_body`` raises MemoryError at the
    second delivery's read) is recorded failed with one ERROR, the delivery after it folds,
    and no actor crashes: the folder does not restart on it for ever."""
    ids = journal_directly(tmp_path, [new_delivery(n) for n in range(3)])
    no_memory = faults.Action(frozenset({2}), faults.raise_fault(lambda _: MemoryError()))
    with faults.loaded(faults.Plan({"journal.read_body": no_memory})):
        async with open_runtime(config(tmp_path)) as runtime:
            await wait_folded(tmp_path, ids)
            await until(lambda: not runtime.statistics().folding.running)
            stats = runtime.statistics()
            ready = runtime.ready()

    statuses = table(DataDir(tmp_path).store_path, "SELECT status, reason FROM outcomes")
    assert statuses == [
        ("parsed", None),
        ("failed", "internal error: MemoryError"),
        ("parsed", None),
    ]
    assert (stats.crashes, ready) == ({}, True)
    assert logged(caplog, logging.ERROR) == [f"delivery {ids[1]}: body not read: MemoryError"]


async def test_an_actor_down_after_a_crash_makes_the_runtime_not_ready_run_35(
    tmp_path: Path,
) -> None:
    """RUN-35: a ready runtime whose retention actor crashes at every run (the fault point
    ``retention.prune`` raises) is not ready while it is down (statistics name it), and ready
    again once it has run well for ``healthy_s``."""
    journal_directly(tmp_path, [new_delivery(0)])
    async with open_runtime(config(tmp_path, retention_period_s=0.05, healthy_s=1.0)) as runtime:
        await until(runtime.ready)
        every_run = faults.Action(
            frozenset(range(1, 10_000)), faults.raise_fault(lambda _: RuntimeError("boom"))
        )
        with faults.loaded(faults.Plan({"retention.prune": every_run})):
            await until(lambda: runtime.statistics().crashes.get("retention", 0) >= 2)
            assert not runtime.ready()
            assert runtime.statistics().down == ("retention",)
        await until(runtime.ready)
        assert runtime.statistics().down == ()


# How much later a restarted task's run begins than the supervisor's restart (its crash is
# recorded, then it sleeps out its backoff, then the run is called).
RESTART_SLACK_S = 0.05


async def test_a_task_supervised_by_the_runtime_is_down_like_an_actor_run_36(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-36: a task run beside a ready runtime under ``Runtime.supervise`` (as the service
    runs its event hub) that crashes twice is supervised as an actor: one ERROR each naming it
    and the type only, restarts after 0.5 s then 1 s, its crashes counted and itself down (the
    runtime not ready) until it has run well for ``healthy_s``; cancelled, it ends without an
    ERROR."""
    started: list[float] = []

    async def task() -> None:
        started.append(trio.current_time())
        if len(started) <= 2:
            raise KeyError("secret")
        await trio.sleep_forever()

    journal_directly(tmp_path, [new_delivery(0)])
    async with open_runtime(config(tmp_path, healthy_s=1.0)) as runtime:
        await until(runtime.ready)
        with caplog.at_level(logging.ERROR, "healthlog.supervisor"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.supervise, "helper", task)
                await until(lambda: runtime.statistics().crashes.get("helper", 0) == 2)
                assert not runtime.ready()
                assert runtime.statistics().down == ("helper",)
                await until(lambda: len(started) == 3)
                assert not runtime.ready()
                assert runtime.statistics().down == ("helper",)
                await until(runtime.ready)
                ready_at = trio.current_time()
                assert runtime.statistics().down == ()
                nursery.cancel_scope.cancel()
    # Restarted after 0.5 s, then 1 s; down until it has run well for healthy_s (1 s).
    first, second, third = started
    assert second - first >= 0.5
    assert third - second >= 1.0
    assert ready_at - third >= 1.0 - RESTART_SLACK_S
    assert logged(caplog, logging.ERROR) == [
        f"actor helper crashed (KeyError); restarting in {delay}" for delay in ("0.5 s", "1.0 s")
    ]
    assert runtime.statistics().crashes == {"helper": 2}


async def test_a_data_directory_moved_away_is_not_begun_anew_by_a_fold_worker_run_45(
    tmp_path: Path,
) -> None:
    """RUN-45: the data directory of a runtime folding in worker processes is moved away
    before any worker opened it, a delivery journaled and waiting for the fold lease, which
    another holder had; a delivery submitted then is refused (the journal is no longer at its
    path), the pass that the freed lease starts ends ``deferred``, and nothing appears at the
    old path (no directory, no journal or store); once the directory is back, a later pass
    folds the waiting delivery."""
    data, moved = tmp_path / "data", tmp_path / "moved"
    with DataDir(data).open_store() as store:
        epoch = store.acquire_lease("elsewhere", now=clock.now_us(), ttl=3600 * 10**6)
        assert epoch is not None
    settings = config(
        data, executor=Executor.PROCESS, wake_period_s=0.2, lease_ttl_s=1.0, lease_renew_s=0.2
    )
    async with open_runtime(settings) as runtime:
        receipt = await runtime.submit(new_delivery(0))
        data.rename(moved)
        with pytest.raises(StorageError, match=r"journal\.sqlite is not at its path"):
            await runtime.submit(new_delivery(1))
        with DataDir(moved).open_store() as store:
            store.release_lease("elsewhere", epoch)
        await until(
            lambda: runtime.statistics().folding.passes_by_stop.get("deferred", 0) >= 1,
            timeout=30,
        )
        assert not data.exists()
        moved.rename(data)
        await wait_folded(data, [receipt.delivery_id], timeout=30)

    assert folded_in_order(data) == [receipt.delivery_id]


WORKER_START_RETRIES = 2
"""RUN-66: tries to fold a delivery again while no fold worker can start, after the first:
three in all, one more than the ``WORKER_DEATHS`` that recorded such a delivery failed."""
HEART_RATE = body(
    metric(
        "heart_rate",
        "count/min",
        point("2024-03-01 10:00:00 +0000", qty=61),
        point("2024-03-01 10:01:00 +0000", qty=62),
    )
)


def removable_interpreter(where: Path) -> Path:
    """A virtual environment in ``where`` that runs this interpreter with this one's packages
    (through ``outer.pth`` in its own site-packages); its ``bin/python``, a symbolic link, and
    that file may be moved away and back."""
    venv.EnvBuilder(symlinks=True, with_pip=False).create(where)
    [site] = (where / "lib").glob("python3*/site-packages")
    outer = sysconfig.get_paths()["purelib"]
    (site / "outer.pth").write_text(f"import site; site.addsitedir({outer!r})\n")
    return where / "bin" / "python"


def folded_while_away(tmp_path: Path, python: Path, away: Path) -> tuple[str, str, list[str]]:
    """A delivery to `healthlog serve` run by ``python``, with ``away`` moved away once it
    serves: its status once the folder has tried to fold it three times (or recorded it
    failed), its status once ``away`` is back and it is no longer pending (or a minute has
    passed), and what the folding actor logged above DEBUG."""
    data = tmp_path / "data"
    with DataDir(data).open_tokens() as tokens:
        token = tokens.add("phone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    env |= {"HEALTHLOG_WAKE_PERIOD_S": "0.5", "HEALTHLOG_LOG_LEVEL": "debug"}
    command = [str(python), "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(data)]
    log = tmp_path / "serve.log"
    headers = {"Authorization": f"Bearer {token}", "automation-aggregation": "minutes"}
    moved = away.with_name(away.name + ".away")
    with (
        log.open("wb") as stderr,
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path
        ) as process,
    ):
        try:
            assert process.stdout is not None
            line = process.stdout.readline().decode()
            found = re.search(r"healthlog serving on (http://127\.0\.0\.1:\d+) ", line)
            assert found, line + log.read_text()
            away.rename(moved)
            with httpx.Client(base_url=found.group(1), headers=headers, timeout=30) as client:
                assert client.post("/v1/deliveries", content=HEART_RATE).status_code == 200
                deadline = time.monotonic() + 60
                while (
                    log.read_text().count("fold workers still cannot start") < WORKER_START_RETRIES
                    and "recorded failed" not in log.read_text()
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.1)
                while_away = client.get("/v1/deliveries/1").json()["status"]
                moved.rename(away)
                deadline = time.monotonic() + 60
                while (back := client.get("/v1/deliveries/1").json()["status"]) == "pending" and (
                    time.monotonic() < deadline
                ):
                    time.sleep(0.1)
        finally:
            process.terminate()
            process.wait(timeout=60)
    records = [line for line in log.read_text().splitlines() if "level=DEBUG" not in line]
    said = [line.split(" ", 1)[1] for line in records if "logger=healthlog.folding" in line]
    return while_away, back, said


def workers_cannot_start(cause: str) -> list[str]:
    """What the folding actor says while no fold worker starts for ``cause``, and after."""
    return [
        f'level=ERROR logger=healthlog.folding msg="fold workers cannot start: {cause}; '
        'deliveries stay pending until one does, tried again at the next wake or timer"',
        'level=INFO logger=healthlog.folding msg="fold workers start again; pending '
        'deliveries fold"',
    ]


def test_a_fold_worker_that_cannot_start_leaves_the_delivery_pending_run_66(
    tmp_path: Path,
) -> None:
    """RUN-66: a `healthlog serve` whose interpreter is removed while it runs (a virtual
    environment built anew, a Python upgraded under the service): a delivery answered 200 then
    stays pending through three tries, one ERROR names the interpreter and none blames the
    delivery; once the interpreter is back it folds `parsed`, and one INFO says so."""
    python = removable_interpreter(tmp_path / "venv")
    while_away, back, said = folded_while_away(tmp_path, python, python)
    assert (while_away, back) == ("pending", "parsed"), said
    cause = f"{python} cannot be run by uid {os.getuid()} (missing, or not executable)"
    assert said == workers_cannot_start(cause)


def test_a_fold_worker_without_its_packages_leaves_the_delivery_pending_run_67(
    tmp_path: Path,
) -> None:
    """RUN-67: a `healthlog serve` whose interpreter is there but whose packages are not (a
    virtual environment built anew, between `python -m venv` and `pip install`): a delivery
    answered 200 stays pending through three tries, one ERROR gives the new worker's exit status;
    once the packages are back it folds `parsed`, and one INFO says so."""
    python = removable_interpreter(tmp_path / "venv")
    [packages] = (tmp_path / "venv" / "lib").glob("python3*/site-packages/outer.pth")
    while_away, back, said = folded_while_away(tmp_path, python, packages)
    assert (while_away, back) == ("pending", "parsed"), said
    cause = "a new worker process exited with status 1 before it ran anything"
    assert said == workers_cannot_start(cause)


DESCRIPTORS = 256
"""RUN-68: the soft open file limit the test lowers this process's to while it holds every
descriptor below it."""


@contextlib.contextmanager
def descriptors_exhausted(free: int = 0) -> Iterator[Callable[[], None]]:
    """Every file descriptor of this process but ``free`` taken for the block, under a soft
    limit of ``DESCRIPTORS`` (with none free no ``pipe`` or ``open`` succeeds); its
    ``release()`` frees them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []

    def release() -> None:
        while held:
            os.close(held.pop())

    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        for _ in range(free):
            os.close(held.pop())
        yield release
    finally:
        release()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_fold_worker_that_cannot_be_made_is_said_once_in_words_run_68(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-68: while no fold worker can be made (every descriptor taken: its pipes cannot be
    opened; a process limit alike) a delivery stays pending, the folding actor does not crash,
    and one ERROR names the cause in words, its later tries at DEBUG; once descriptors are
    free again it folds with one INFO. (Before, the actor crashed at each try, each time one
    ERROR naming only the exception's type: `actor folding crashed (OSError)`.)"""
    caplog.set_level(logging.DEBUG, logger="healthlog.folding")
    settings = {"executor": Executor.PROCESS, "wake_period_s": 60.0}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        await until(runtime.ready)
        with descriptors_exhausted() as release:
            receipt = await runtime.submit(new_delivery(0))
            await until(lambda: runtime.statistics().folding.passes_by_stop.get("deferred", 0) >= 2)
            release()
            await wait_folded(tmp_path, [receipt.delivery_id], timeout=60)
            # The worker commits before it answers, and the folder says so once answered.
            await until(lambda: "fold workers start again" in caplog.text)
        stats = runtime.statistics()

    assert stats.crashes == {}
    assert logged(caplog, logging.ERROR) == [
        "fold workers cannot start: a new worker process could not be made: EMFILE, Too many"
        " open files (the open file limit reached?); deliveries stay pending until one does,"
        " tried again after 1 s, then less often"
    ]
    assert "fold workers still cannot start" in caplog.text
    assert logged(caplog, logging.INFO)[-1:] == [
        "fold workers start again; pending deliveries fold"
    ]


WORKER_PIPES = 4
"""RUN-72: the descriptors of a fold worker's two pipes, which trio-parallel opens before it
makes the worker's process."""


def free_descriptors() -> int:
    """How many descriptors below ``DESCRIPTORS`` are free (asked without opening one)."""
    free = 0
    for fd in range(DESCRIPTORS):
        try:
            os.fstat(fd)
        except OSError:
            free += 1
    return free


async def test_a_fold_worker_that_cannot_be_made_releases_its_descriptors_at_once_run_72(
    tmp_path: Path,
) -> None:
    """RUN-72: with just the descriptors of a new fold worker's pipes free, its process cannot
    be made (``spawn`` needs more); after the folder's try they are free again before the next
    one, though the garbage collector is switched off here (it may not run for a long while
    in the service), and once the test's are freed the delivery folds. (Before, the worker
    that could not be made held its 4 in a reference cycle with the error until a collection:
    no later try could even open its pipes, and the descriptors stayed short though nothing
    used them.)"""
    settings = {"executor": Executor.PROCESS, "wake_period_s": 60.0}
    async with open_runtime(config(tmp_path, **settings)) as runtime:
        await until(runtime.ready)
        gc.collect()
        gc.disable()
        try:
            with descriptors_exhausted(free=WORKER_PIPES) as release:
                receipt = await runtime.submit(new_delivery(0))
                await until(
                    lambda: runtime.statistics().folding.passes_by_stop.get("deferred", 0) >= 1
                )
                await until(lambda: free_descriptors() == WORKER_PIPES, timeout=30)
                release()
        finally:
            gc.enable()
        await wait_folded(tmp_path, [receipt.delivery_id], timeout=60)
