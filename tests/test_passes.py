"""Folding passes against real SQLite files (specs/folding.md, FOLD-n)."""

from __future__ import annotations

import gc
import logging
import sqlite3
import threading
import tracemalloc
from contextlib import closing
from pathlib import Path

import pytest
from _bodies import BASE_US, NOW, TTL, append, body, delivery, pending, point, rows

from healthlog import faults
from healthlog.folding import FoldPass
from healthlog.storage._sqlite import Deferred, StorageError
from healthlog.storage.journal import DeliveryMeta, Journal
from healthlog.storage.passes import (
    FIRST_PASS_MARK,
    LAG_MARK,
    PAGE,
    Budget,
    run_pass,
    write_marks,
)
from healthlog.storage.status import collect_status
from healthlog.storage.store import Store


def ended(folding: FoldPass[DeliveryMeta]) -> tuple[int, list[int], str | None]:
    """What a pass did: (folded, unwritten ids, stopped_because)."""
    return folding.folded, folding.unwritten, folding.stopped_because


def three(journal: Journal) -> list[DeliveryMeta]:
    """Three deliveries of distinct points, journaled in journal order."""
    return [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + n))
        for n in range(3)
    ]


def folded_in_order(store: Store) -> list[int]:
    """Delivery ids in the order of their ``delivery.folded`` events."""
    return [
        e.payload["delivery_id"] for e in store.events_after(0, 1000) if e.kind == "delivery.folded"
    ]


def plan(**actions: tuple[set[int], type[Exception]]) -> faults.Plan:
    """A fault plan; keyword names use ``__`` for the dot of a fault point name."""
    return faults.Plan(
        actions={
            name.replace("__", "."): faults.Action(frozenset(hits), faults.raise_fault(error))
            for name, (hits, error) in actions.items()
        }
    )


def test_pending_deliveries_fold_one_at_a_time_in_journal_order_fold_1(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """FOLD-1: deliveries fold in (received_at, id) order, not insertion order, one at a time;
    the checkpoint follows each commit."""
    stamps = [BASE_US + 30, BASE_US + 10, BASE_US + 20, BASE_US + 10, None]
    metas = [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=stamp))
        for n, stamp in enumerate(stamps)
    ]
    order = [metas[i].id for i in (1, 3, 2, 0, 4)]
    seen: list[tuple[int, tuple[int | None, int | None, int], int]] = []

    def progress(done: int) -> None:
        seen.append((done, store.checkpoint(), len(store.folded_ids())))

    report = run_pass(journal, store, epoch, progress=progress)

    assert ended(report) == (5, [], "empty")
    assert folded_in_order(store) == order
    by_id = {m.id: m for m in metas}
    assert seen == [(n, (by_id[i].received_at, i, epoch), n) for n, i in enumerate(order, start=1)]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_deferred_delivery_stops_the_pass_fold_2(
    journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-2: a deferred delivery stops the pass, its successors stay unfolded, and the next
    pass starts from it."""
    first, second, third = three(journal)

    with faults.loaded(plan(fold__begin=({2}, Deferred))):
        report = run_pass(journal, store, epoch)

    assert ended(report) == (1, [], "deferred")
    assert store.folded_ids() == {first.id}
    assert [m.id for m in pending(journal, store)] == [second.id, third.id]

    assert ended(run_pass(journal, store, epoch)) == (2, [], "empty")
    assert folded_in_order(store) == [first.id, second.id, third.id]


def test_busy_store_stops_the_pass_at_its_head_fold_3(
    journal: Journal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """FOLD-3: while another connection holds the store's write lock the pass defers at the
    head of the queue and folds nothing; the lag mark cannot be written there either, which is
    logged. After the lock is released a pass folds everything."""
    metas = three(journal)
    with Store(tmp_path / "store.sqlite", busy_timeout_ms=50) as store:
        epoch = store.acquire_lease("folder", now=NOW, ttl=TTL)
        assert epoch is not None
        with closing(sqlite3.connect(store.path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            report = run_pass(journal, store, epoch)
            holder.execute("ROLLBACK")

        assert ended(report) == (0, [], "deferred")
        assert store.mark(LAG_MARK) is None
        assert (
            "folding pass: lag mark not written: Deferred: SQLITE_BUSY: database is locked"
            " (store.sqlite)" in caplog.messages
        )
        assert ended(run_pass(journal, store, epoch)) == (3, [], "empty")
        assert folded_in_order(store) == [m.id for m in metas]


@pytest.mark.parametrize(
    "faulted",
    [
        plan(fold__outcome_write=({2}, StorageError)),
        plan(fold__begin=({2}, faults.InjectedFault), fold__outcome_write=({2}, StorageError)),
    ],
    ids=["outcome_write", "failed_outcome_write"],
)
def test_unwritten_delivery_does_not_stop_the_pass_fold_4(
    journal: Journal,
    store: Store,
    epoch: int,
    caplog: pytest.LogCaptureFixture,
    faulted: faults.Plan,
) -> None:
    """FOLD-4: a delivery whose outcome cannot be written stays pending, its successors fold,
    and the next pass retries it."""
    first, second, third = three(journal)

    with faults.loaded(faulted):
        report = run_pass(journal, store, epoch, now=lambda: second.received_at)

    assert ended(report) == (2, [second.id], "unwritten")
    assert store.folded_ids() == {first.id, third.id}
    assert store.mark(LAG_MARK) == {
        "oldest_pending_id": second.id,
        "waited_s": 0.0,
        "stopped_because": "unwritten",
    }
    assert store.mark(FIRST_PASS_MARK) is True
    caplog.clear()

    assert ended(run_pass(journal, store, epoch)) == (1, [], "empty")
    outcome = store.outcome(second.id)
    assert outcome is not None
    assert outcome.status == "parsed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert f"delivery {second.id} " in warnings[0]
    assert "healthlog reindex" in warnings[0]


def test_fold_over_budget_is_failed_and_the_queue_moves_on_fold_5(
    journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-5: a delivery over its fold budget is failed, not deferred; the pass goes on."""
    heavy = append(journal, delivery(body({"hr": [point(1, 60)]})))
    empty = append(journal, delivery(b'{"data": {}}'))

    report = run_pass(journal, store, epoch, budget=Budget(base_s=0, per_mib_s=0))

    assert ended(report) == (2, [], "empty")
    failed = store.outcome(heavy.id)
    assert failed is not None
    assert failed.status == "failed"
    assert failed.reason is not None
    assert "budget" in failed.reason
    parsed = store.outcome(empty.id)
    assert parsed is not None
    assert parsed.status == "parsed"
    assert rows(store.path)["objects"] == []
    assert pending(journal, store) == []


def test_lag_mark_and_first_pass_flag_on_an_empty_selection_fold_6(
    journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-6: a pass over an empty queue writes the lag mark and sets the first-pass flag."""
    assert store.mark(FIRST_PASS_MARK) is None

    assert ended(run_pass(journal, store, epoch)) == (0, [], "empty")

    assert store.mark(LAG_MARK) == {
        "oldest_pending_id": None,
        "waited_s": 0.0,
        "stopped_because": "empty",
    }
    assert store.mark(FIRST_PASS_MARK) is True


def test_lag_mark_at_a_deferred_barrier_fold_7(journal: Journal, store: Store, epoch: int) -> None:
    """FOLD-7: a pass stopped by a deferral records the stuck delivery and its wait since it
    was journaled (not since its historical `received_at`), and does not set the first-pass
    flag; a later pass that reaches the end does."""
    _, second, _ = three(journal)

    with faults.loaded(plan(fold__begin=({2}, Deferred))):
        run_pass(journal, store, epoch, now=lambda: second.journaled_at + 90_000_000)

    assert store.mark(LAG_MARK) == {
        "oldest_pending_id": second.id,
        "waited_s": 90.0,
        "stopped_because": "deferred",
    }
    assert store.mark(FIRST_PASS_MARK) is None

    run_pass(journal, store, epoch)
    assert store.mark(LAG_MARK)["oldest_pending_id"] is None
    assert store.mark(FIRST_PASS_MARK) is True


BACKLOG = 4000


def test_lag_mark_names_the_oldest_without_holding_the_backlog_store_71(
    journal: Journal, store: Store, epoch: int
) -> None:
    """STORE-71: with 4,000 deliveries waiting behind one folded, the lag mark written at a
    pass's end names the oldest of them and its wait while holding less than 256 KiB of Python
    memory at its peak, however many wait. (Before, it built the metadata of every waiting
    delivery to take the first: 2.7 MB at its peak here, at the end of every pass.)"""
    first = append(journal, delivery(body({"hr": [point(0, 1)]})))
    run_pass(journal, store, epoch)
    journal.append_many([delivery(body({"hr": [point(n, n)]})) for n in range(1, BACKLOG + 1)])
    oldest = journal.iter_order(after=(first.received_at, first.id), limit=1)[0]
    folding: FoldPass[DeliveryMeta] = FoldPass([])
    assert folding.next() is None
    tracemalloc.start()
    try:
        write_marks(journal, store, folding, lambda: oldest.received_at + 5_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.mark(LAG_MARK) == {
        "oldest_pending_id": oldest.id,
        "waited_s": 5.0,
        "stopped_because": "empty",
    }
    assert len(pending(journal, store)) == BACKLOG
    assert peak < 256 * 2**10, peak


@pytest.mark.parametrize(
    "unreadable",
    [
        "journal",
        "store",
        "once",
    ],
)
def test_failed_selection_logs_error_and_ends_the_pass_fold_8(
    journal: Journal,
    store: Store,
    epoch: int,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    unreadable: str,
) -> None:
    """FOLD-8: when the selection cannot be read (journal or store side, for good or just this
    once, when the marks could still be written) the pass logs an ERROR and ends, folding
    nothing and writing no mark."""
    three(journal)
    if unreadable == "once":
        with faults.loaded(plan(fold__select=({1}, StorageError))):
            report = run_pass(journal, store, epoch)
    else:
        (journal if unreadable == "journal" else store).close()
        report = run_pass(journal, store, epoch)

    assert ended(report) == (0, [], "selection_failed")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1
    assert errors[0].startswith("folding pass: selection failed")
    with Store(tmp_path / "store.sqlite") as reopened:
        assert reopened.folded_ids() == set()
        assert reopened.mark(LAG_MARK) is None
        assert reopened.mark(FIRST_PASS_MARK) is None


def test_takeover_mid_pass_stops_it_fold_9(journal: Journal, store: Store, epoch: int) -> None:
    """FOLD-9: once another holder takes the lease over, the pass stops at its next delivery
    and writes no mark."""
    first, _, _ = three(journal)

    with Store(store.path) as other:

        def take_over(done: int) -> None:
            other.acquire_lease("other", now=NOW, ttl=TTL, force=True)

        report = run_pass(journal, store, epoch, progress=take_over)

    assert ended(report) == (1, [], "fenced")
    assert store.folded_ids() == {first.id}
    assert store.mark(LAG_MARK) is None
    assert store.mark(FIRST_PASS_MARK) is None


def test_selection_reads_past_the_checkpoint_and_behind_it_when_something_is_missing_fold_12(
    journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-12: with everything up to the checkpoint folded, the selection is what came after
    it; a backfill journaled behind the checkpoint, or a delivery behind it left unwritten, is
    selected too, in journal order."""
    first, second, third = three(journal)
    assert ended(run_pass(journal, store, epoch)) == (3, [], "empty")
    later = [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + n))
        for n in (10, 11)
    ]
    assert [m.id for m in pending(journal, store)] == [m.id for m in later]

    backfill = append(journal, delivery(body({"hr": [point(5, 5)]}), received_at=BASE_US + 5))
    assert [m.id for m in pending(journal, store)] == [backfill.id, *[m.id for m in later]]

    with faults.loaded(plan(fold__outcome_write=({1}, StorageError))):
        assert ended(run_pass(journal, store, epoch)) == (2, [backfill.id], "unwritten")
    assert store.checkpoint()[1] == later[-1].id
    assert [m.id for m in pending(journal, store)] == [backfill.id]
    assert ended(run_pass(journal, store, epoch)) == (1, [], "empty")
    assert pending(journal, store) == []
    assert store.folded_ids() == {
        first.id,
        second.id,
        third.id,
        backfill.id,
        *(m.id for m in later),
    }


def test_status_counts_each_delivery_once_while_folds_commit_fold_13(
    tmp_path: Path, journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-13: read while another connection folds, pending plus parsed, partial and failed is
    always the number journaled, and pending only goes down."""
    journaled = [
        append(
            journal,
            delivery(body({"hr": [point(n, n)]}) if n % 3 else b"{", received_at=BASE_US + n),
        )
        for n in range(150)
    ]

    def fold_elsewhere() -> None:
        with (
            Journal(tmp_path / "journal.sqlite") as theirs,
            Store(tmp_path / "store.sqlite") as folder,
        ):
            run_pass(theirs, folder, epoch)

    folding = threading.Thread(target=fold_elsewhere)
    folding.start()
    readings = []
    while folding.is_alive() or not readings:
        d = collect_status(journal, store).deliveries
        readings.append((d.pending, d.pending + d.parsed + d.partial + d.failed))
    folding.join()
    final = collect_status(journal, store).deliveries
    assert (final.pending, final.parsed, final.failed) == (0, 100, 50)
    assert {total for _, total in readings} == {len(journaled)}
    assert [p for p, _ in readings] == sorted((p for p, _ in readings), reverse=True)
    assert len({p for p, _ in readings}) > 10, "the readings did not overlap the folds"


def test_status_journal_figures_count_the_same_deliveries_fold_14(
    tmp_path: Path, journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-14: read while another connection journals deliveries, the journal's number of
    deliveries is always pending plus parsed, partial and failed."""
    for n in range(20):
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + n))
    run_pass(journal, store, epoch)

    def journal_elsewhere() -> None:
        with Journal(tmp_path / "journal.sqlite") as theirs:
            for n in range(20, 220):
                append(theirs, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + n))

    journaling = threading.Thread(target=journal_elsewhere)
    journaling.start()
    readings = []
    while journaling.is_alive() or not readings:
        status = collect_status(journal, store)
        d = status.deliveries
        readings.append((status.journal.deliveries, d.pending + d.parsed + d.partial + d.failed))
    journaling.join()
    assert [journaled for journaled, total in readings if journaled != total] == []
    assert len({journaled for journaled, _ in readings}) > 10, "the readings did not overlap"


def metas_alive() -> int:
    """How many :class:`DeliveryMeta` objects this process holds."""
    return sum(1 for held in gc.get_objects() if type(held) is DeliveryMeta)


def test_a_pass_holds_a_page_of_its_queue_not_the_whole_queue_fold_15(
    journal: Journal, store: Store, epoch: int
) -> None:
    """FOLD-15: with 500 more deliveries waiting than a page holds, a pass folds them all in
    journal order while holding the metadata of at most a page of them. (Before, it held every
    waiting delivery's for the whole pass: 837 bytes each, 84 MB at 100,000.)"""
    waiting = PAGE + 500
    journal.append_many(
        [
            delivery(body({"hr": [point(n % 1440, n)]}), received_at=BASE_US + n)
            for n in range(waiting)
        ]
    )
    held: list[int] = []
    every_100th = faults.Action(
        frozenset(range(1, waiting + 1, 100)), lambda _: held.append(metas_alive())
    )

    with faults.loaded(faults.Plan(actions={"fold.begin": every_100th})):
        report = run_pass(journal, store, epoch)

    assert ended(report) == (waiting, [], "empty")
    assert len(held) == 16
    assert 0 < max(held) <= PAGE, held
    assert len(store.folded_ids()) == waiting


def test_a_paged_pass_folds_what_was_pending_at_its_start_in_journal_order_fold_16(
    journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """FOLD-16: a pass reading 4 deliveries at a time folds exactly those pending at its start,
    in journal order, across page boundaries: a backfill behind the checkpoint (the whole
    journal is read, the folded ones left out page by page) and one journaled behind later
    deliveries, first of the second page. A delivery journaled during the pass, and a backfill
    whose stamp puts it in a page not read yet, are the next pass's: the lag mark and the status
    count them. The checkpoint follows each fold."""
    live = [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + 10 * n))
        for n in range(3)
    ]
    assert ended(run_pass(journal, store, epoch)) == (3, [], "empty")
    waiting = [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + 10 * n))
        for n in range(3, 13)
    ]
    behind = append(journal, delivery(body({"hr": [point(50, 1)]}), received_at=BASE_US + 5))
    between = append(journal, delivery(body({"hr": [point(51, 1)]}), received_at=BASE_US + 65))
    expected = [behind, *waiting[:4], between, *waiting[4:]]
    during: list[DeliveryMeta] = []
    seen: list[tuple[int, int | None]] = []

    def journal_during(done: int) -> None:
        seen.append((done, store.checkpoint()[1]))
        if done == 2:
            stamps = [None, BASE_US + 95]  # live, and a backfill between the 9th and the 10th
            during.extend(
                append(journal, delivery(body({"hr": [point(60 + n, 1)]}), received_at=stamp))
                for n, stamp in enumerate(stamps)
            )

    report = run_pass(journal, store, epoch, progress=journal_during, page=4)

    assert ended(report) == (len(expected), [], "empty")
    folded = [m.id for m in live] + [m.id for m in expected]
    assert folded_in_order(store) == folded
    assert seen == [(n, meta.id) for n, meta in enumerate(expected, start=1)]
    late, backfill = during
    assert [m.id for m in pending(journal, store)] == [backfill.id, late.id]
    assert store.mark(LAG_MARK)["oldest_pending_id"] == late.id  # the one journaled first
    assert collect_status(journal, store).deliveries.pending == 2

    assert ended(run_pass(journal, store, epoch, page=4)) == (2, [], "empty")
    assert folded_in_order(store) == [*folded, backfill.id, late.id]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [message.split(" folded after")[0] for message in warned] == [
        f"delivery {behind.id}",
        f"delivery {backfill.id}",
    ]


def test_a_page_that_cannot_be_read_ends_the_pass_fold_17(
    tmp_path: Path, journal: Journal, store: Store, epoch: int, caplog: pytest.LogCaptureFixture
) -> None:
    """FOLD-17: when a later page of the selection cannot be read (the journal closed under the
    pass), the pass keeps what it folded, logs one ERROR, ends `selection_failed` and writes no
    mark; the next pass folds the rest in journal order."""
    metas = [
        append(journal, delivery(body({"hr": [point(n, n)]}), received_at=BASE_US + n))
        for n in range(5)
    ]

    def close_after_the_first_page(done: int) -> None:
        if done == 2:
            journal.close()

    report = run_pass(journal, store, epoch, progress=close_after_the_first_page, page=2)

    assert ended(report) == (2, [], "selection_failed")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1
    assert errors[0].startswith("folding pass: selection failed")
    assert store.mark(LAG_MARK) is None
    assert store.mark(FIRST_PASS_MARK) is None
    with Journal(tmp_path / "journal.sqlite") as reopened:
        assert ended(run_pass(reopened, store, epoch, page=2)) == (3, [], "empty")
    assert folded_in_order(store) == [m.id for m in metas]
