"""The runtime's actors: journal, intake, lease, supervision, statistics, shutdown
(specs/runtime.md, RUN-1 to RUN-13). Real SQLite files in tmp_path, folds in worker threads."""

from __future__ import annotations

import base64
import errno
import itertools
import logging
import os
import random
import re
import sqlite3
import threading
import time
import weakref
from contextlib import closing
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing
from _disk import unwritable
from _runtime_helpers import (
    EVERY_HIT,
    HOLDER,
    HOUR_US,
    action,
    config,
    folded_ids,
    hold_at,
    journaled,
    lease_row,
    logged,
    new_delivery,
    passes_ended,
    run_in_child,
    sha256,
    table,
    until,
    wait_folded,
)

from actors._supervisor import Crashes, supervise
from actors.lease import LeaseActor
from actors.runtime import Runtime, open_runtime
from healthlog import faults
from healthlog.storage._sqlite import WAL_SIZE_LIMIT, Deferred, StorageError
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery, Receipt
from healthlog.storage.store import Store
from transport.intake import IntakeRefusals
from transport.metrics import render_metrics
from transport.stream import HandshakeRefusals


def assert_receipt_iff_journaled(got: dict[str, int | None], rows: dict[int, str]) -> None:
    """``got`` maps each submitted body's sha256 to the id its receipt named (None: no receipt).
    A receipt names a journaled row of that body; a body without a receipt is not journaled."""
    for digest, delivery_id in got.items():
        if delivery_id is None:
            assert digest not in rows.values(), "journaled, but the caller got no receipt"
        else:
            assert rows.get(delivery_id) == digest
    assert set(rows.values()) <= set(got)


# -- journal and intake -------------------------------------------------------------------------


async def test_concurrent_submits_share_commits_and_each_gets_its_receipt_run_1_run_2(
    tmp_path: Path,
) -> None:
    """RUN-1, RUN-2: 40 concurrent submits commit in fewer than 40 transactions; every caller
    gets the receipt of its own body, and its row is readable from the journal file through
    another connection the moment submit returns."""
    deliveries = [new_delivery(n) for n in range(40)]
    receipts: dict[int, Receipt] = {}
    on_return: dict[int, list[tuple[int, bytes]]] = {}
    journal_path = DataDir(tmp_path).journal_path

    async def submit(runtime: Runtime, n: int) -> None:
        receipt = await runtime.submit(deliveries[n])
        on_return[n] = table(
            journal_path, "SELECT id, sha256 FROM deliveries WHERE id = ?", receipt.delivery_id
        )
        receipts[n] = receipt

    async with open_runtime(config(tmp_path)) as runtime:
        async with trio.open_nursery() as nursery:
            for n in range(len(deliveries)):
                nursery.start_soon(submit, runtime, n)
        stats = runtime.statistics().journal

    assert stats.appended == 40
    assert 1 <= stats.groups < 40
    assert stats.largest_group > 1
    for n, receipt in receipts.items():
        assert receipt.sha256 == sha256(deliveries[n])
        assert on_return[n] == [(receipt.delivery_id, bytes.fromhex(receipt.sha256))]
    assert len({r.delivery_id for r in receipts.values()}) == 40
    assert journaled(tmp_path) == {r.delivery_id: r.sha256 for r in receipts.values()}


async def test_submits_made_together_are_journaled_in_one_group_journal_56(
    tmp_path: Path,
) -> None:
    """JOURNAL-56: GIVEN a running runtime whose journal is idle WHEN eight deliveries are
    submitted in one turn of the scheduler (the uploads of eight connections read together)
    THEN they are journaled by one group commit, and each caller gets the receipt of its own
    body. (Before, a relaying intake task handed them to the journal actor a turn apart, and
    its group, which takes what is queued one turn after the first, held one or two.)"""
    deliveries = [new_delivery(n) for n in range(8)]
    receipts: dict[int, Receipt] = {}

    async def submit(runtime: Runtime, n: int) -> None:
        receipts[n] = await runtime.submit(deliveries[n])

    async with open_runtime(config(tmp_path, fold=False)) as runtime:
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            for n in range(len(deliveries)):
                nursery.start_soon(submit, runtime, n)
        journal = runtime.statistics().journal

    assert (journal.appended, journal.groups, journal.largest_group) == (8, 1, 8)
    assert {n: r.sha256 for n, r in receipts.items()} == {
        n: sha256(d) for n, d in enumerate(deliveries)
    }
    assert journaled(tmp_path) == {r.delivery_id: r.sha256 for r in receipts.values()}


async def test_a_delivery_is_let_go_once_journaled_run_120(tmp_path: Path) -> None:
    """RUN-120: GIVEN a running runtime WHEN a delivery has been submitted and answered, and
    every task waits again THEN nothing in the runtime holds the delivery (its body with it)
    while no other comes. (Before, the intake and journal actors' loops held the last one until
    the next: after one incompressible 60 MiB upload, `serve` stayed at 190 MiB at rest where
    it had started at 64 MiB; 128 MiB now.)"""
    delivery = new_delivery(0)
    held = weakref.ref(delivery)
    async with open_runtime(config(tmp_path)) as runtime:
        receipt = await runtime.submit(delivery)
        del delivery
        await trio.testing.wait_all_tasks_blocked()
        kept = held() is not None
    assert receipt.delivery_id == 1
    assert not kept


async def test_a_group_holds_at_most_64_deliveries_run_43(tmp_path: Path) -> None:
    """RUN-43: with one group commit held and 99 submits queued behind it, the queue is
    journaled in groups of at most 64: 64, then 35."""
    entered, release = trio.Event(), threading.Event()
    with faults.loaded(faults.Plan(actions={"journal.append": hold_at(entered, release)})):
        async with open_runtime(config(tmp_path, fold=False)) as runtime:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.submit, new_delivery(0))
                await entered.wait()
                for n in range(1, 100):
                    nursery.start_soon(runtime.submit, new_delivery(n))
                await until(lambda: runtime.statistics().journal.queued == 99)
                release.set()
            journal = runtime.statistics().journal

    assert (journal.appended, journal.groups, journal.largest_group) == (100, 3, 64)


async def test_a_journal_that_cannot_commit_refuses_the_submit_run_3(tmp_path: Path) -> None:
    """RUN-3: while another connection holds the journal's write lock, submit raises Deferred
    after the busy timeout, nothing is journaled and the folder is not woken for it; once the
    lock is gone, submit works."""
    refused, accepted = new_delivery(0), new_delivery(1)
    async with open_runtime(config(tmp_path, busy_timeout_ms=50)) as runtime:
        journal_path = DataDir(tmp_path).journal_path
        with closing(sqlite3.connect(journal_path, isolation_level=None)) as holder:
            holder.execute("BEGIN EXCLUSIVE")
            with pytest.raises(Deferred):
                await runtime.submit(refused)
            assert journaled(tmp_path) == {}
            holder.execute("ROLLBACK")
        receipt = await runtime.submit(accepted)
        await wait_folded(tmp_path, [receipt.delivery_id])
        stats = runtime.statistics()

    assert journaled(tmp_path) == {receipt.delivery_id: sha256(accepted)}
    assert (stats.journal.errors, stats.journal.appended) == (1, 1)
    assert (stats.intake.refused, stats.intake.accepted) == (1, 1)
    assert stats.intake.wakes_sent + stats.intake.wakes_dropped == 1


async def test_a_full_wake_channel_drops_wakes_and_every_delivery_still_folds_run_4(
    tmp_path: Path,
) -> None:
    """RUN-4: with the folder busy in a pass, a burst of submits finds the wake channel full;
    the dropped wakes are counted, never an error, and every delivery folds."""
    entered, release = trio.Event(), threading.Event()
    with faults.loaded(faults.Plan(actions={"fold.begin": hold_at(entered, release)})):
        async with open_runtime(config(tmp_path)) as runtime:
            first = await runtime.submit(new_delivery(0))
            await entered.wait()
            receipts: list[Receipt] = []

            async def submit(n: int) -> None:
                receipts.append(await runtime.submit(new_delivery(n)))

            async with trio.open_nursery() as nursery:
                for n in range(1, 11):
                    nursery.start_soon(submit, n)
            intake = runtime.statistics().intake
            release.set()
            await wait_folded(tmp_path, [first.delivery_id, *(r.delivery_id for r in receipts)])

    assert len(receipts) == 10
    assert intake.accepted == 11
    assert intake.wakes_dropped > 0
    assert intake.wakes_sent + intake.wakes_dropped == 11


# -- supervision ----------------------------------------------------------------------------------


async def test_a_crashing_actor_restarts_with_doubling_backoff_up_to_the_cap_run_5(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-5: each crash logs one ERROR and is counted; restarts wait 1, 2, 4, then the cap 4;
    the actor is down from its first crash until it has run well for ``healthy_s`` after its
    last restart, and up after that."""
    starts: list[float] = []
    crashes = Crashes()
    down_at_start: list[list[str]] = []

    async def run() -> None:
        starts.append(trio.current_time())
        down_at_start.append(crashes.down())
        if len(starts) <= 5:
            raise RuntimeError("boom")

    await supervise("worker", run, crashes, backoff_start_s=1, backoff_max_s=4, healthy_s=10)

    assert [b - a for a, b in itertools.pairwise(starts)] == [1, 2, 4, 4, 4]
    assert crashes.counts == {"worker": 5}
    assert down_at_start == [[]] + [["worker"]] * 5
    assert logged(caplog, logging.ERROR) == [
        f"actor worker crashed (RuntimeError); restarting in {s:.1f} s" for s in (1, 2, 4, 4, 4)
    ]
    await trio.sleep(9.9)
    assert crashes.down() == ["worker"]
    await trio.sleep(0.2)
    assert crashes.down() == []


async def test_the_default_backoff_doubles_from_half_a_second_up_to_thirty_run_42(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-42: supervised with the defaults, an actor that crashes eight times is restarted
    after 0.5, 1, 2, 4, 8, 16, 30 and 30 s, and is down until it has run for five minutes
    after its last restart."""
    starts: list[float] = []
    crashes = Crashes()

    async def run() -> None:
        starts.append(trio.current_time())
        if len(starts) <= 8:
            raise RuntimeError("boom")

    await supervise("worker", run, crashes)

    delays = [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert [b - a for a, b in itertools.pairwise(starts)] == delays
    assert logged(caplog, logging.ERROR) == [
        f"actor worker crashed (RuntimeError); restarting in {s:.1f} s" for s in delays
    ]
    await trio.sleep(299.9)
    assert crashes.down() == ["worker"]
    await trio.sleep(0.2)
    assert crashes.down() == []


async def test_an_actor_crashing_at_each_of_its_runs_stays_down_run_35(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """RUN-35: an actor that crashes at the end of each run of a minute (its own period) is
    down from its first crash on, whenever it is looked at, though each run resets its
    backoff."""
    crashes = Crashes()

    async def minute_then_crash() -> None:
        await trio.sleep(60)
        raise RuntimeError("boom")

    looked: list[list[str]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervise, "retention", minute_then_crash, crashes)
        await trio.sleep(61)
        for _ in range(600):
            looked.append(crashes.down())
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert crashes.counts["retention"] >= 9
    assert looked == [["retention"]] * 600


async def test_a_crash_inside_the_actors_nursery_names_the_exception_run_5(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-5: a crash raised by a task of the actor's own nursery (an exception group) is named
    by the types of the exceptions in the group, not as a group."""
    runs = 0

    async def boom(error: Exception) -> None:
        raise error

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs > 1:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(boom, KeyError("k"))
            nursery.start_soon(boom, ValueError("v"))

    await supervise("worker", run, Crashes(), backoff_start_s=1)

    assert logged(caplog, logging.ERROR) == [
        "actor worker crashed (KeyError, ValueError); restarting in 1.0 s"
    ]


async def test_a_crash_on_an_os_error_names_its_errno_in_words_run_69(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-69: a crash on an OSError (descriptors or processes running out) is named by its
    type, its errno's name and the system's text for it, never the file it names; a group's
    too. (Before: `actor worker crashed (OSError)`, the type alone.)"""
    errors: list[BaseException] = [
        OSError(errno.EMFILE, os.strerror(errno.EMFILE), "/srv/healthlog/Kim.json"),
        BlockingIOError(errno.EAGAIN, "fork failed"),
        ExceptionGroup("nursery", [OSError(errno.ENFILE, "x"), KeyError("k")]),
        OSError("no errno"),
    ]

    async def run() -> None:
        if errors:
            raise errors.pop(0)

    await supervise("worker", run, Crashes(), backoff_start_s=1, backoff_max_s=1)

    assert logged(caplog, logging.ERROR) == [
        "actor worker crashed (OSError: EMFILE, Too many open files); restarting in 1.0 s",
        "actor worker crashed (BlockingIOError: EAGAIN, Resource temporarily unavailable);"
        " restarting in 1.0 s",
        "actor worker crashed (KeyError, OSError: ENFILE, Too many open files in system);"
        " restarting in 1.0 s",
        "actor worker crashed (OSError); restarting in 1.0 s",
    ]


async def long_third_run(starts: list[float]) -> None:
    """Three supervised runs that crash, the third after 10 s, and a fourth that returns."""
    starts.append(trio.current_time())
    if len(starts) == 3:
        await trio.sleep(10)
    if len(starts) <= 3:
        raise RuntimeError("boom")


async def test_a_long_run_resets_the_backoff_run_5(autojump_clock: trio.testing.MockClock) -> None:
    """RUN-5: after a run that lasted longer than the current backoff, the restart waits the
    first backoff again."""
    starts: list[float] = []
    await supervise("worker", partial(long_third_run, starts), Crashes(), backoff_start_s=1)

    assert [b - a for a, b in itertools.pairwise(starts)] == [1, 2, 10 + 1]


async def test_the_crash_error_names_the_delay_actually_waited_run_5(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-5: the ERROR of a crash after a long run names the delay it then waits."""
    starts: list[float] = []
    await supervise("worker", partial(long_third_run, starts), Crashes(), backoff_start_s=1)

    assert starts[3] - starts[2] == 10 + 1
    assert logged(caplog, logging.ERROR)[2].endswith("restarting in 1.0 s")


async def test_a_cancelled_actor_is_not_a_crash_run_6(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-6: cancelling a supervised actor (a plain one, one with a nursery of its own, or one
    waiting out its backoff) logs no ERROR beyond its real crashes and does not restart it."""

    async def plain() -> None:
        await trio.sleep_forever()

    async def with_nursery() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)

    runs = 0

    async def crash_once() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("boom")

    crashes = Crashes()
    for run in (plain, with_nursery):
        with trio.move_on_after(5) as scope:
            await supervise(run.__name__, run, crashes)
        assert scope.cancelled_caught
    assert (crashes.counts, logged(caplog, logging.ERROR)) == ({}, [])

    with trio.move_on_after(0.1):
        await supervise("crash_once", crash_once, crashes, backoff_start_s=1)
    assert (runs, crashes.counts, len(logged(caplog, logging.ERROR))) == (1, {"crash_once": 1}, 1)


def test_a_journal_actor_crash_answers_its_callers_run_7(tmp_path: Path) -> None:
    """RUN-7: when a group commit fails with an unexpected exception, its caller gets an error
    (not silence), the next submit is journaled, and the runtime still shuts down."""
    first, second = run_in_child("journal_actor_crash", tmp_path)

    assert first not in ("no answer", "receipt")
    assert second == "receipt"
    assert journaled(tmp_path) == {1: sha256(new_delivery(1))}


# -- lease ----------------------------------------------------------------------------------------


async def test_the_lease_is_held_renewed_yielded_retaken_and_released_run_8_run_9_run_10(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """RUN-8, RUN-9, RUN-10: the lease actor holds epoch 1 from the start and renewals keep it;
    a forced takeover by another holder is reported as None and nothing folds meanwhile; after
    that holder releases, the lease is retaken at epoch 3 and the waiting delivery folds under
    it; leaving the runtime releases the lease."""
    async with open_runtime(config(tmp_path)) as runtime:

        def held() -> tuple[int | None, int | None]:
            stats = runtime.statistics()
            return stats.lease.epoch, stats.folding.epoch

        await until(lambda: held() == (1, 1))
        assert lease_row(tmp_path) == (HOLDER, 1)
        await until(lambda: runtime.statistics().lease.renewals >= 2)
        assert held() == (1, 1)
        assert runtime.statistics().lease.acquisitions == 1
        assert lease_row(tmp_path) == (HOLDER, 1)

        with Store(DataDir(tmp_path).store_path) as other:
            now = time.time_ns() // 1000
            assert other.acquire_lease("intruder", now=now, ttl=HOUR_US, force=True) == 2
            await until(lambda: held() == (None, None))
            assert runtime.statistics().lease.losses == 1
            receipt = await runtime.submit(new_delivery())
            await trio.sleep(3 * 5.0)
            assert folded_ids(tmp_path) == set()
            other.release_lease("intruder", 2)

        await wait_folded(tmp_path, [receipt.delivery_id])
        lease = runtime.statistics().lease
        assert (lease.epoch, lease.acquisitions, lease.losses) == (3, 2, 1)
        assert (await runtime.read_store(Store.checkpoint))[1:] == (receipt.delivery_id, 3)

    assert lease_row(tmp_path) == (None, 3)


async def test_a_lease_taken_and_given_back_between_renewals_is_said_run_97(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-97: a lease actor (renewed every 5 s) holding epoch 1 whose lease another process
    forces and releases between two renewals (a short `healthlog reindex`) takes it at epoch 3
    at its next renewal and says in that INFO line that another process held it since epoch 1.
    (Before, the line was `fold lease held at epoch 3` alone, after `held at epoch 1` with no
    line between: the jump said nothing of why.)"""
    start_us = 1_000_000_000_000

    def now() -> int:
        return start_us + int(autojump_clock.current_time() * 1_000_000)

    caplog.set_level(logging.INFO, "healthlog.lease")
    with DataDir(tmp_path).open_store() as store, Store(DataDir(tmp_path).store_path) as other:
        send, receive = trio.open_memory_channel[int | None](0)
        actor = LeaseActor(
            store, trio.CapacityLimiter(1), "serve", send, ttl_s=15, renew_s=5, clock=now
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            assert await receive.receive() == 1
            assert other.acquire_lease("reindex", now=now(), ttl=15_000_000, force=True) == 2
            other.release_lease("reindex", 2)
            assert await receive.receive() == 3
            nursery.cancel_scope.cancel()

    assert logged(caplog, logging.INFO) == [
        "fold lease held at epoch 1",
        "fold lease held at epoch 3: another process (a reindex, say) held it since epoch 1",
    ]


@pytest.mark.parametrize(
    ("ours", "theirs", "warned"),
    [
        ("serve:here:1:aa", "serve:there:4242:bb", 1),
        ("serve:here:1:aa", "there:4242:bb", 0),
        ("serve:here:1:aa", "reindex:there:4242:bb", 0),
        ("here:1:aa", "serve:there:4242:bb", 0),
    ],
)
async def test_a_serve_beside_another_serve_warns_once_run_142(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    ours: str,
    theirs: str,
    warned: int,
) -> None:
    """RUN-142: a lease actor (term 15 s, renewed every 5 s) whose lease another holder keeps
    renewing for two minutes says at WARNING once, after 30 s, naming that holder's host and
    process, when both are a `serve`'s; never when the other is an `import` or `seal`
    (`HOST:PID:...`) or a reindex, which fold a while and let go, nor when this actor is an
    `import`'s or `seal`'s, which wait for the service by design."""
    start_us = 1_000_000_000_000

    def now() -> int:
        return start_us + int(autojump_clock.current_time() * 1_000_000)

    renewals = 24
    renewed = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def renew_theirs(_: str) -> None:
        """Before each of this actor's renewals, the other holder renews its lease too."""
        with Store(DataDir(tmp_path).store_path) as other:
            assert other.acquire_lease(theirs, now=now(), ttl=15_000_000) == 1
        nonlocal renewals
        renewals -= 1
        if renewals == 0:
            trio.from_thread.run_sync(renewed.set, trio_token=token)

    caplog.set_level(logging.INFO, "healthlog.lease")
    with DataDir(tmp_path).open_store() as store:
        send, _ = trio.open_memory_channel[int | None](0)
        actor = LeaseActor(
            store, trio.CapacityLimiter(1), ours, send, ttl_s=15, renew_s=5, clock=now
        )
        plan = faults.Plan(actions={"lease.renew": action(range(1, 25), renew_theirs)})
        with faults.loaded(plan):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(actor.run)
                await renewed.wait()
                nursery.cancel_scope.cancel()
    said = [r for r in logged(caplog, logging.WARNING) if "another healthlog serve" in r]
    assert len(said) == warned
    if warned:
        assert said[0].startswith(
            "another healthlog serve (host there, pid 4242) has held the fold lease of this"
            " data directory for 35 s"
        )


async def test_a_failed_renewal_says_why_and_where_run_33(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-33: a lease renewal that fails with a storage error other than a busy store logs a
    WARNING with SQLite's reason and the store's file name (an operator's only clue to a store
    the service's user cannot write), and the next renewal succeeds."""
    readonly = StorageError("database error: attempt to write a readonly database")
    readonly.kind = "SQLITE_READONLY: attempt to write a readonly database"
    plan = faults.Plan(actions={"lease.renew": action({2}, faults.raise_fault(lambda _: readonly))})
    with faults.loaded(plan), caplog.at_level(logging.WARNING, "healthlog.lease"):
        async with open_runtime(config(tmp_path, lease_renew_s=0.2)) as runtime:
            await until(lambda: runtime.statistics().lease.renewals >= 1)
    assert logged(caplog, logging.WARNING) == [
        "lease renewal failed: StorageError: SQLITE_READONLY: attempt to write a readonly"
        " database (store.sqlite)"
    ]


async def test_a_failed_renewal_logs_the_error_s_kind_never_its_message_run_165(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-165: a lease renewal failing with a storage error whose message quotes what SQLite
    was given (a device's name here) logs a WARNING with the error's kind, SQLite's error name
    and meaning, and the store's file, as every other storage WARNING does, never the message.
    (Before, the message itself was logged at WARNING.)"""
    quoting = StorageError("database error: CHECK constraint failed: device = 'Ann's iPhone'")
    quoting.kind = "SQLITE_CONSTRAINT_CHECK: constraint failed"
    plan = faults.Plan(actions={"lease.renew": action({2}, faults.raise_fault(lambda _: quoting))})
    with faults.loaded(plan), caplog.at_level(logging.WARNING, "healthlog.lease"):
        async with open_runtime(config(tmp_path, lease_renew_s=0.2)) as runtime:
            await until(lambda: runtime.statistics().lease.renewals >= 1)
    assert logged(caplog, logging.WARNING) == [
        "lease renewal failed: StorageError: SQLITE_CONSTRAINT_CHECK: constraint failed"
        " (store.sqlite)"
    ]


async def test_failing_renewals_keep_the_epoch_only_until_the_lease_would_expire_run_40(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-40: with a TTL of 3 s renewed every second, the lease is acquired and renewed twice,
    then every renewal fails: the first failure keeps epoch 1, the second (after which the lease
    renewed last would expire before the next renewal) gives it up, for the lease holder and the
    folder, as one loss. SERVE-162: `/metrics` counts the failed renewals and the loss."""
    broken = StorageError("disk I/O error")
    plan = faults.Plan(
        actions={"lease.renew": action(EVERY_HIT - {1, 2, 3}, faults.raise_fault(lambda _: broken))}
    )
    with faults.loaded(plan):
        async with open_runtime(config(tmp_path, lease_ttl_s=3, lease_renew_s=1)) as runtime:
            await until(lambda: runtime.statistics().folding.epoch == 1)
            await until(lambda: runtime.statistics().lease.failures == 1)
            kept = runtime.statistics()
            await until(lambda: runtime.statistics().lease.epoch is None)
            lost = runtime.statistics().lease
            # Read in the same instant as the statistics render_metrics reads first.
            counted = runtime.statistics().lease
            exposed = await render_metrics(runtime, 0, HandshakeRefusals(), IntakeRefusals(), 0)
            await until(lambda: runtime.statistics().folding.epoch is None)

    assert (kept.lease.epoch, kept.folding.epoch, kept.lease.losses) == (1, 1, 0)
    assert (lost.renewals, lost.failures, lost.losses, lost.acquisitions) == (2, 2, 1, 1)
    # SERVE-162: what an owner alerts on is in /metrics, counted as the statistics count it.
    assert counted.losses == 1
    failures = f"\nhealthlog_fold_lease_renewal_failures_total {counted.failures:.1f}\n"
    assert failures.encode() in exposed
    assert b"\nhealthlog_fold_lease_losses_total 1.0\n" in exposed
    assert "fold lease lost (epoch 1)" in logged(caplog, logging.WARNING)


async def test_a_store_it_could_not_write_is_folded_into_once_mended_run_38(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-38: a runtime started on a store it may not write (created by another user) takes
    deliveries but folds none and is not ready, its renewals failing with SQLite's reason; once
    the file is writable again, with no restart, it takes the lease, folds what waited and is
    ready."""
    data = DataDir(tmp_path)
    data.open_store().close()
    with (
        caplog.at_level(logging.WARNING, "healthlog.lease"),
        unwritable(data.store_path) as mend,
    ):
        async with open_runtime(config(tmp_path, lease_renew_s=0.2)) as runtime:
            receipt = await runtime.submit(new_delivery(0))
            await until(lambda: runtime.statistics().lease.failures >= 2)
            assert not runtime.ready()
            assert runtime.statistics().lease.epoch is None
            assert folded_ids(tmp_path) == set()
            mend()
            await wait_folded(tmp_path, [receipt.delivery_id])
            await until(runtime.ready)
            assert runtime.statistics().lease.epoch == 1
    failures = logged(caplog, logging.WARNING)
    assert len(failures) >= 2
    assert set(failures) == {
        "lease renewal failed: StorageError: SQLITE_READONLY: attempt to write a readonly"
        " database (store.sqlite)"
    }


async def test_a_renewal_that_finds_the_store_busy_holds_no_read_behind_it_run_44(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-44: while another connection holds the store's write lock for longer than the
    lease's term, every renewal is deferred after a brief wait, so reads of the store never
    wait long behind one; the deferrals are INFO until the store has been busy for a term, then
    WARNING; the epoch is kept throughout and renewed once the lock goes."""
    term_s, hold_s = 1.0, 2.0
    with caplog.at_level(logging.INFO, "healthlog.lease"):
        async with open_runtime(config(tmp_path, lease_renew_s=0.2, lease_ttl_s=term_s)) as runtime:
            await until(lambda: runtime.statistics().lease.epoch == 1)
            with closing(
                sqlite3.connect(DataDir(tmp_path).store_path, isolation_level=None)
            ) as lock:
                lock.execute("BEGIN IMMEDIATE")
                held, slowest = time.monotonic(), 0.0
                while time.monotonic() - held < hold_s:
                    started = time.monotonic()
                    await runtime.read_store(Store.lease)
                    slowest = max(slowest, time.monotonic() - started)
                    await trio.sleep(0.02)
                deferred = runtime.statistics().lease.failures
                lock.execute("ROLLBACK")
            renewals = runtime.statistics().lease.renewals
            await until(lambda: runtime.statistics().lease.renewals > renewals)
            assert runtime.statistics().lease.epoch == 1
    assert slowest < 0.75, slowest
    assert deferred >= 4
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "renewal" in r.getMessage()]
    infos = [m for level, m in said if level == logging.INFO]
    warnings = [m for level, m in said if level == logging.WARNING]
    assert set(infos) == {"lease renewal deferred: the store is busy; the epoch is kept"}
    assert warnings
    for warning in warnings:
        assert re.fullmatch(
            r"lease renewal deferred: the store has been busy for \d s; the epoch is kept", warning
        ), warning
    assert len(infos) + len(warnings) == deferred
    assert not logged(caplog, logging.ERROR)
    assert "fold lease lost" not in caplog.text


async def test_a_runtime_that_never_held_the_lease_says_its_first_take_waits_run_151(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-151: a runtime started while another connection holds the store's write lock for
    longer than the lease's term (as a fold worker left by a killed service, or a `reindex`'s
    swap, does) holds no lease: its deferred tries say `fold lease not taken yet: the store is
    busy` at INFO, then at WARNING how long, and never that an epoch is kept, which it has
    none of; once the lock goes it takes the lease at epoch 1. (Before, they said `lease
    renewal deferred ...; the epoch is kept`.)"""
    term_s, hold_s = 1.0, 2.0
    path = DataDir(tmp_path).store_path
    Store(path).close()
    settings = {"lease_renew_s": 0.2, "lease_ttl_s": term_s}
    with (
        caplog.at_level(logging.INFO, "healthlog.lease"),
        closing(sqlite3.connect(path, isolation_level=None)) as lock,
    ):
        lock.execute("BEGIN IMMEDIATE")
        async with open_runtime(config(tmp_path, **settings)) as runtime:
            await until(lambda: runtime.statistics().lease.failures >= 1)
            await trio.sleep(hold_s)
            deferred = runtime.statistics().lease.failures
            assert runtime.statistics().lease.epoch is None
            lock.execute("ROLLBACK")
            await until(lambda: runtime.statistics().lease.epoch == 1)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "busy" in r.getMessage()]
    infos = [m for level, m in said if level == logging.INFO]
    warnings = [m for level, m in said if level == logging.WARNING]
    assert set(infos) == {"fold lease not taken yet: the store is busy"}
    assert warnings
    for warning in warnings:
        assert re.fullmatch(
            r"fold lease not taken yet: the store has been busy for \d s", warning
        ), warning
    assert len(infos) + len(warnings) == deferred
    assert "epoch is kept" not in caplog.text


async def test_retention_that_finds_the_store_busy_holds_no_read_behind_it_run_74(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-74: while another connection holds the store's write lock (BEGIN IMMEDIATE, as a fold
    worker on a large delivery does), each retention run gives up on the lock after a brief wait
    and is deferred, so a read of the store does not wait behind it for the busy timeout (5 s);
    a deferral is INFO until the store has been busy for a retention period, then WARNING saying
    how long; once the lock goes, the next run prunes."""
    period_s = 0.2
    settings = {"retention_period_s": period_s, "lease_renew_s": 0.5}
    with caplog.at_level(logging.INFO, "healthlog.retention"):
        async with open_runtime(config(tmp_path, **settings)) as runtime:
            await until(lambda: runtime.statistics().retention.runs >= 1)
            with closing(
                sqlite3.connect(DataDir(tmp_path).store_path, isolation_level=None)
            ) as lock:
                lock.execute("BEGIN IMMEDIATE")
                # A retention run is waiting for the lock when the read starts.
                await trio.sleep(period_s * 1.5)
                started = time.monotonic()
                await runtime.read_store(Store.lease)
                print(f"a store read waited {time.monotonic() - started:.3f} s behind retention")
                await until(lambda: len(deferrals(caplog)) >= 3, timeout=4.0)
                lock.execute("ROLLBACK")
            runs = runtime.statistics().retention.runs
            await until(lambda: runtime.statistics().retention.runs > runs)
    said = deferrals(caplog)
    assert said[0] == (logging.INFO, "event pruning deferred: the store is busy")
    # Runs are a period apart at least (the actor sleeps one between them): the second deferral
    # already finds the store busy for a period.
    assert said[1][0] == logging.WARNING, said
    for level, message in said[1:]:
        assert level in (logging.INFO, logging.WARNING), message
        if level == logging.WARNING:
            assert re.fullmatch(
                r"event pruning deferred: the store has been busy for \d+ s", message
            ), message
    assert not logged(caplog, logging.ERROR)


def deferrals(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """What retention said of its deferred runs."""
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "healthlog.retention" and "deferred" in r.getMessage()
    ]


# -- statistics -----------------------------------------------------------------------------------


async def test_statistics_reflect_queues_passes_outcomes_and_the_lease_run_11(
    tmp_path: Path,
) -> None:
    """RUN-11: with a group commit held, the journal actor's queue depth shows the requests
    behind it; afterwards the counters show two groups, four folds and the held lease."""
    entered, release = trio.Event(), threading.Event()
    with faults.loaded(faults.Plan(actions={"journal.append": hold_at(entered, release)})):
        async with open_runtime(config(tmp_path)) as runtime:
            await until(lambda: runtime.statistics().folding.epoch == 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.submit, new_delivery(0))
                await entered.wait()
                for n in range(1, 4):
                    nursery.start_soon(runtime.submit, new_delivery(n))
                await until(lambda: runtime.statistics().journal.queued == 3)
                during = runtime.statistics()
                release.set()
            await wait_folded(tmp_path, journaled(tmp_path))
            await until(lambda: not runtime.statistics().folding.running)
            after = runtime.statistics()

    assert (during.journal.queued, during.journal.appended, during.journal.groups) == (3, 0, 0)
    assert during.intake.accepted == 0
    assert during.folding.outcomes_by_class == {}
    assert (during.lease.holder, during.lease.epoch, during.lease.acquisitions) == (HOLDER, 1, 1)

    journal = after.journal
    assert (journal.queued, journal.appended, journal.groups, journal.largest_group) == (0, 4, 2, 3)
    assert journal.errors == 0
    assert (after.intake.accepted, after.intake.refused) == (4, 0)
    assert after.intake.wakes_sent + after.intake.wakes_dropped == 4
    folding = after.folding
    assert (folding.epoch, folding.folded, folding.running) == (1, 4, False)
    assert folding.outcomes_by_class == {"done": 4}
    assert (folding.folds_timed, folding.first_pass_completed) == (4, True)
    assert set(folding.passes_by_stop) == {"empty"}
    assert folding.passes == folding.passes_by_stop["empty"] >= 1
    assert (after.lease.epoch, after.lease.acquisitions, after.lease.losses) == (1, 1, 0)
    assert after.crashes == {}


# -- shutdown -------------------------------------------------------------------------------------


def test_a_submit_in_flight_at_shutdown_gets_its_receipt_if_journaled_run_12(
    tmp_path: Path,
) -> None:
    """RUN-12: leaving the runtime while a submit's commit is in flight: the commit finishes,
    and the submit returns the receipt of the committed row. In a child, as a caller left
    without an answer hangs its runtime's shutdown."""
    got = run_in_child("submit_in_flight_at_shutdown", tmp_path)

    assert got == 1
    assert journaled(tmp_path) == {1: sha256(new_delivery())}


def test_a_group_waiting_for_the_journal_at_shutdown_is_committed_and_answered_run_41(
    tmp_path: Path,
) -> None:
    """RUN-41: leaving the runtime while a submit's group waits for the journal's connection
    (a read holds it): once the read ends the group commits, the submit gets its receipt and
    the runtime exits."""
    got = run_in_child("submit_behind_a_read_at_shutdown", tmp_path)

    assert got == [1]
    assert journaled(tmp_path) == {1: sha256(new_delivery())}


def test_leaving_the_runtime_with_submits_queued_exits_and_keeps_receipts_exact_run_13(
    tmp_path: Path,
) -> None:
    """RUN-13: leaving the runtime while submits wait behind a group commit ends promptly; every
    submit that returned a receipt is journaled, and no other submit is."""
    got = run_in_child("shutdown_with_submits_queued", tmp_path)

    by_digest = {
        sha256(new_delivery(int(n))): value if isinstance(value, int) else None
        for n, value in got.items()
    }
    assert_receipt_iff_journaled(by_digest, journaled(tmp_path))
    assert lease_row(tmp_path)[0] is None


async def test_leaving_an_idle_runtime_releases_the_lease_run_10(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-10: an idle runtime shuts down without an ERROR, releasing the lease; its files can
    be reopened and a new runtime takes the lease at the next epoch."""
    async with open_runtime(config(tmp_path)) as runtime:
        receipt = await runtime.submit(new_delivery())
        await wait_folded(tmp_path, [receipt.delivery_id])
        await passes_ended(runtime, 1)
    assert lease_row(tmp_path) == (None, 1)

    async with open_runtime(config(tmp_path, holder="next")) as runtime:
        await until(lambda: runtime.statistics().lease.epoch == 2)
    assert lease_row(tmp_path) == (None, 2)
    assert logged(caplog, logging.ERROR) == []


async def test_a_wal_a_reader_keeps_from_being_checkpointed_is_said_run_63(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RUN-63: while another program keeps a read transaction open on journal.sqlite, its
    -wal grows past WAL_SIZE_LIMIT with every delivery; the retention pass says so in one
    WARNING naming the file and its size (said once while it lasts, none for store.sqlite),
    and once the reader ends, one INFO says it is checkpointed again."""
    caplog.set_level(logging.INFO)
    path = DataDir(tmp_path).journal_path
    noise = random.Random(63)
    async with open_runtime(config(tmp_path, retention_period_s=0.05)) as runtime:
        await runtime.submit(new_delivery(0))
        with closing(sqlite3.connect(path, isolation_level=None)) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM deliveries").fetchone()
            while os.stat(f"{path}-wal").st_size <= WAL_SIZE_LIMIT:
                # Incompressible: each adds its size to the -wal.
                body = base64.b64encode(noise.randbytes(2**20))
                await runtime.submit(NewDelivery(body, "phone", content_type="text/plain"))
            await until(lambda: any("cannot be checkpointed" in m for m in caplog.messages))
            reader.execute("COMMIT")
        await until(lambda: any("checkpointed again" in m for m in caplog.messages))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    [said] = [m for m in warnings if "checkpoint" in m]
    match = re.search(r"-wal is (\d+) bytes", said)
    assert match is not None, said
    size = int(match[1])
    assert size > WAL_SIZE_LIMIT
    assert said.startswith(f"{path}-wal is {size} bytes and cannot be checkpointed:")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [m for m in infos if "checkpointed again" in m] == [f"{path}-wal is checkpointed again"]
