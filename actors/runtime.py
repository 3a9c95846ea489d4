"""The runtime: one root nursery supervising the journal, lease, folding and retention actors,
and intake, which submits in its callers' tasks.

``async with open_runtime(config) as runtime:`` is the one entry point that the service,
the CLI and the tests start. Actors share nothing but the channels wired here; SQLite
work runs in worker threads, one CapacityLimiter per connection.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol, TypeVar

import attrs
import trio

from actors import threads
from actors._supervisor import HEALTHY_S, Crashes, supervise
from actors.folding import UPGRADED, Executor, FoldingActor, FoldingStatistics
from actors.intake import Intake, IntakeStatistics
from actors.journal import JournalActor, JournalActorStatistics, Request
from actors.lease import LeaseActor, LeaseStatistics
from actors.retention import RetentionActor, RetentionStatistics
from healthlog import faults
from healthlog.config import ServeConfig
from healthlog.storage import snapshot_files
from healthlog.storage._sqlite import StorageError, damage_met, is_damage, make_directory
from healthlog.storage.checked import CheckedRecord
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal, NewDelivery, Receipt
from healthlog.storage.passes import (
    PAGE,
    STORE_DAMAGED,
    STORE_FOLDED_ELSEWHERE,
    Budget,
    FoldedElsewhere,
    check_before_folding,
    check_same_journal,
    check_unless_unchanged,
)
from healthlog.storage.rebuild import remove_stale_scratch
from healthlog.storage.store import Store, default_holder, serve_holder

T = TypeVar("T")

log = logging.getLogger("healthlog.runtime")

SUBMISSION_BUFFER = 256
INTERRUPT_S = 0.01
"""How often a store check stopped by a signal is interrupted until it has let go (RUN-162)."""
WAIT_POLL_S = 0.05


class NotFolded(Exception):
    """A delivery waited for that this process cannot fold (:meth:`Runtime.wait_folded`)."""

    def __init__(self, delivery_id: int, why: str) -> None:
        super().__init__(delivery_id, why)
        self.delivery_id = delivery_id
        self.why = why


class Actor(Protocol):
    async def run(self) -> None: ...


@attrs.frozen
class RuntimeConfig:
    """What a runtime needs; every interval in seconds. ``fold`` off starts only intake and
    the journal (``import --no-wait``): nothing touches the projection."""

    data_dir: Path = attrs.field(converter=Path)
    holder: str = attrs.Factory(default_holder)
    wake_period_s: float = 60.0
    lease_ttl_s: float = 15.0
    lease_renew_s: float = 5.0
    budget: Budget = attrs.Factory(Budget)
    executor: Executor = Executor.PROCESS
    busy_timeout_ms: int = 5000
    fold: bool = True
    window_events: int = 100_000
    window_age_s: float = 30 * 86400.0
    retention_period_s: float = 60.0
    healthy_s: float = HEALTHY_S
    """How long an actor restarted after a crash must run well to count as up (``Crashes``)."""
    pass_page: int = PAGE
    """How many pending deliveries a folding pass reads and holds at a time."""
    store_checked_beside: bool = False
    """Whether the store is checked beside intake, which then journals from the start, rather
    than before anything starts (``serve``: RUN-162)."""


def configured(
    data_dir: Path, config: ServeConfig, *, fold: bool = True, serve: bool = False
) -> RuntimeConfig:
    """The runtime that a data directory's settings (``healthlog.toml``, ``HEALTHLOG_*``) ask
    for: the service's, and that of the commands that fold without it (``import``, ``seal``),
    so that a fold has the same budget and the event window the same bounds whoever runs it.
    The service's (``serve``) holds the fold lease under a name that says it is a service's."""
    return RuntimeConfig(
        data_dir,
        holder=serve_holder(data_dir) if serve else default_holder(data_dir),
        wake_period_s=config.wake_period_s,
        lease_ttl_s=config.lease_ttl_s,
        lease_renew_s=config.lease_renew_s,
        budget=Budget(config.fold_budget_s, config.fold_budget_per_mib_s),
        fold=fold,
        window_events=config.stream_window_events,
        window_age_s=config.stream_window_days * 86400,
        store_checked_beside=serve,
    )


@attrs.frozen
class RuntimeStatistics:
    journal: JournalActorStatistics
    intake: IntakeStatistics
    lease: LeaseStatistics
    folding: FoldingStatistics
    retention: RetentionStatistics
    crashes: dict[str, int]
    """Crashes by actor name."""
    down: tuple[str, ...]
    """The actors that crashed and have not run well since (see ``Crashes``)."""


class Runtime:
    """Handles for whoever started the runtime: submit deliveries, read state, wait."""

    def __init__(
        self,
        journal: Journal,
        store: Store,
        journal_limiter: trio.CapacityLimiter,
        store_limiter: trio.CapacityLimiter,
        actors: tuple[JournalActor, Intake, LeaseActor, FoldingActor, RetentionActor],
        crashes: Crashes,
        healthy_s: float = HEALTHY_S,
    ) -> None:
        self._store_checked = trio.Event()
        self._store_unfit: str | None = None
        self.journal = journal
        self.store = store
        self._journal_limiter = journal_limiter
        self._store_limiter = store_limiter
        self._actors = actors
        self._crashes = crashes
        self._healthy_s = healthy_s

    async def store_checked(self) -> bool:
        """Once the store has been checked (RUN-162): whether it was found fit to fold into."""
        await self._store_checked.wait()
        return self._store_unfit is None

    def checked_store(self, unfit: str | None = None) -> None:
        """The store has been checked: fit to fold into, or not, and why (``unfit``, one of
        ``STORE_UNFIT``)."""
        self._store_unfit = unfit
        self._store_checked.set()

    def store_unfit(self) -> str | None:
        """Why the store was found unfit to fold into and to read (one of ``STORE_UNFIT``):
        ``serve`` then journals and folds nothing until it is started again (STORE-142); None
        while it is being checked and once it was found fit."""
        return self._store_unfit

    async def submit(self, delivery: NewDelivery) -> Receipt:
        """Journal a delivery through intake; raises what the journal refused with."""
        result = await self._actors[1].submit(delivery)
        if isinstance(result, Exception):
            raise result
        return result

    async def read_store(self, fn: Callable[[Store], T]) -> T:
        """Run ``fn(store)`` in the projection's worker thread (reads, and cursor writes)."""
        return await threads.run_sync(fn, self.store, limiter=self._store_limiter)

    async def read_journal(self, fn: Callable[[Journal], T]) -> T:
        """Run ``fn(journal)`` in the journal's worker thread (reads: appends go via intake)."""
        return await threads.run_sync(fn, self.journal, limiter=self._journal_limiter)

    async def wait_folded(self, ids: Iterable[int], *, give_up: bool = False) -> None:
        """Return once every delivery in ``ids`` has an outcome (folded here or elsewhere).

        With ``give_up``, raise :class:`NotFolded` for the first of them this process's folder
        could not write, or for the first of them all while its lease cannot be written: on a
        full disk or a store it may not write, ``import`` waited for good (CLI-200, CLI-201);
        and for the first of them all once healthlog was upgraded under this process, which
        then folds nothing (CLI-285).

        Each poll looks up only the deliveries still waited for: reading every outcome id,
        0.4 s at 500,000, twenty times a second, kept a core busy while ``import`` or ``seal``
        waited for the service's next pass (FOLD-19)."""
        waiting = set(ids)
        while waiting := await self.read_store(
            functools.partial(Store.unfolded, delivery_ids=waiting)
        ):
            if give_up:
                self._check_foldable(waiting)
            await trio.sleep(WAIT_POLL_S)

    def _check_foldable(self, waiting: set[int]) -> None:
        """Raise :class:`NotFolded` when this process cannot fold the deliveries ``waiting``."""
        _, _, lease, folding, _ = self._actors
        unwritten = folding.unwritten()
        for delivery_id in sorted(waiting):
            if delivery_id in unwritten:
                raise NotFolded(delivery_id, unwritten[delivery_id])
        refused = lease.refused()
        if refused is not None:
            raise NotFolded(min(waiting), f"the fold lease cannot be written: {refused}")
        if folding.statistics().upgraded:
            # Nothing folds in this process any more: ``import`` waited for good (CLI-285).
            raise NotFolded(min(waiting), UPGRADED)

    async def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run`` in the caller's task under the supervision the actors have, with theirs:
        after a crash one ERROR naming ``name`` and the exception type, the crash counted in
        ``statistics().crashes``, the task down (``statistics().down``, the runtime not ready)
        until it has run well for ``healthy_s`` after its restart, which comes after a growing
        backoff; a cancellation ends it. For a long-lived task the service starts beside the
        runtime's actors (the replay stream's event hub)."""
        await supervise(name, run, self._crashes, healthy_s=self._healthy_s)

    def ready(self) -> bool:
        """True once this process's folding actor has completed a pass to the end of the queue,
        unless an actor is down after a crash or healthlog was upgraded under this process
        (STORE-157)."""
        folding = self._actors[3].statistics()
        return folding.first_pass_completed and not folding.upgraded and not self._crashes.down()

    def statistics(self) -> RuntimeStatistics:
        journal, intake, lease, folding, retention = self._actors
        return RuntimeStatistics(
            journal.statistics(),
            intake.statistics(),
            lease.statistics(),
            folding.statistics(),
            retention.statistics(),
            dict(self._crashes.counts),
            tuple(self._crashes.down()),
        )


@asynccontextmanager
async def open_runtime(config: RuntimeConfig) -> AsyncIterator[Runtime]:
    """Start every actor under supervision; cancel and shut them down on exit."""
    data = DataDir(config.data_dir)
    make_directory(data.path)
    checked = CheckedRecord(data.path)
    databases = (data.journal_path.name, data.store_path.name)
    unchanged = await trio.to_thread.run_sync(checked.unchanged, databases)
    journal = Journal(data.journal_path, busy_timeout_ms=config.busy_timeout_ms)
    try:
        store = Store(data.store_path, busy_timeout_ms=config.busy_timeout_ms)
    except BaseException:
        journal.close()
        raise
    try:
        # In a thread: the checks read every page of a file not found unchanged, seconds for
        # gigabytes on a NAS's disk, and a signal is heard meanwhile.
        if config.store_checked_beside:
            await _interruptibly(
                journal,
                "journal.check",
                functools.partial(check_unless_unchanged, journal, unchanged),
            )
            await trio.to_thread.run_sync(checked.hold, databases[:1])
        else:
            await trio.to_thread.run_sync(check_before_folding, journal, store, unchanged)
            await trio.to_thread.run_sync(checked.hold, databases)
        await trio.to_thread.run_sync(remove_stale_scratch, data.path)
        await trio.to_thread.run_sync(data.remove_left_over_keys)
        await trio.to_thread.run_sync(snapshot_files.remove_left_over, data.snapshot_dir)
        await trio.to_thread.run_sync(data.warn_of_open_modes)
        journal_limiter = trio.CapacityLimiter(1)
        store_limiter = trio.CapacityLimiter(1)
        request_send, request_receive = trio.open_memory_channel[Request](SUBMISSION_BUFFER)
        wake_send, wake_receive = trio.open_memory_channel[None](1)
        lease_send, lease_receive = trio.open_memory_channel[int | None](0)
        journal_actor = JournalActor(journal, request_receive, journal_limiter)
        intake = Intake(request_send, wake_send.clone())
        lease = LeaseActor(
            store,
            store_limiter,
            config.holder,
            lease_send,
            ttl_s=config.lease_ttl_s,
            renew_s=config.lease_renew_s,
        )
        folding = FoldingActor(
            data.path,
            journal,
            store,
            store_limiter,
            wake_receive,
            wake_send,
            lease_receive,
            period_s=config.wake_period_s,
            budget=config.budget,
            executor=config.executor,
            busy_timeout_ms=config.busy_timeout_ms,
            page=config.pass_page,
        )
        retention = RetentionActor(
            store,
            store_limiter,
            keep=config.window_events,
            max_age_s=config.window_age_s,
            period_s=config.retention_period_s,
            watched=[(journal, journal_limiter), (store, store_limiter)],
        )
        crashes = Crashes()
        runtime = Runtime(
            journal,
            store,
            journal_limiter,
            store_limiter,
            (journal_actor, intake, lease, folding, retention),
            crashes,
            config.healthy_s,
        )
        async with trio.open_nursery() as nursery:

            def start(actors: list[tuple[str, Actor]]) -> None:
                for name, actor in actors:
                    nursery.start_soon(
                        functools.partial(supervise, healthy_s=config.healthy_s),
                        name,
                        actor.run,
                        crashes,
                    )

            start([("journal", journal_actor)])
            folders: list[tuple[str, Actor]] = [
                ("lease", lease),
                ("folding", folding),
                ("retention", retention),
            ]
            if not config.store_checked_beside:
                runtime.checked_store()
                if config.fold:
                    start(folders)
            elif config.fold:
                nursery.start_soon(_fold_once_checked, runtime, checked, unchanged, start, folders)
            try:
                yield runtime
            finally:
                intake.close()
                nursery.cancel_scope.cancel()
    finally:
        store.close()
        journal.close()
        if not damage_met():
            # In this thread, everything else stopped: a few hundred bytes written, where a
            # worker thread may not start (a service stopped at its process limit exited 1 on
            # `can't start new thread`, RUN-73).
            checked.record()


async def _fold_once_checked(
    runtime: Runtime,
    checked: CheckedRecord,
    unchanged: Collection[str],
    start: Callable[[list[tuple[str, Actor]]], None],
    folders: list[tuple[str, Actor]],
) -> None:
    """``serve``'s store check, beside intake (RUN-162): the journal alone, checked already,
    takes deliveries, so ``serve`` answers them while it reads the store, 13 s of the 18 s it
    took to answer after a power cut on 4 years of data. Only then does anything fold.

    A damaged store (STORE-53), or one folded from another journal (CLI-52), is said at ERROR
    with what to do, and nothing folds: intake goes on journaling, every delivery answered 200
    durable in the intact journal, and ``/readyz`` answers 503 (STORE-142). Exiting 3 instead,
    as the commands do, let a supervisor start it again into the same damage every few
    seconds, refusing the phone's deliveries between two lives. Any other error stops
    ``serve`` (exit 3) as it did before it listened.

    A signal stops the check at once (:func:`_interruptibly`, RUN-162)."""

    def check() -> None:
        check_unless_unchanged(runtime.store, unchanged)
        check_same_journal(runtime.journal, runtime.store)

    try:
        await _interruptibly(runtime.store, "store.check", check)
    except StorageError as error:
        if not (is_damage(error) or isinstance(error, FoldedElsewhere)):
            raise
        log.error(
            "%s. Until serve is started again with it moved away, it journals deliveries and"
            " folds none (/readyz answers 503)",
            error,
        )
        unfit = STORE_FOLDED_ELSEWHERE if isinstance(error, FoldedElsewhere) else STORE_DAMAGED
        await trio.to_thread.run_sync(checked.found_unfit, Path(runtime.store.path).name, unfit)
        runtime.checked_store(unfit)
        return
    await trio.to_thread.run_sync(checked.hold, [Path(runtime.store.path).name])
    runtime.checked_store()
    start(folders)


async def _interruptibly(database: Journal | Store, point: str, check: Callable[[], None]) -> None:
    """Run ``check``, which reads ``database`` whole, in a thread (after the fault point
    ``point``); a cancellation (a signal) stops it at once: SQLite is interrupted until the
    thread has let go of the file, within milliseconds of a check reading gigabytes from the
    disk, before the file is closed. ``serve``'s store check (RUN-162) and its journal check,
    2.9 s at 4 years read from the disk, before it listens (RUN-163)."""
    stop = threading.Event()
    guard = threading.Lock()
    started = threading.Event()
    finished = threading.Event()

    def run() -> None:
        faults.point(point)
        with guard:
            if stop.is_set():
                return
            started.set()
        try:
            check()
        finally:
            finished.set()

    try:
        await trio.to_thread.run_sync(run, abandon_on_cancel=True)
    except trio.Cancelled:
        with guard:
            stop.set()
        # Shielded: the file is closed next, once the thread has let go of it; one interrupt
        # made before its statement began would be forgotten as the statement begins.
        with trio.CancelScope(shield=True):
            while started.is_set() and not finished.is_set():
                database.interrupt()
                await trio.sleep(INTERRUPT_S)
        raise
