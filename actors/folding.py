"""The folding actor: one pass at a time, in journal order, under the lease it is told of.

A pass starts on a wake signal from intake or on the periodic timer (F6), and when the
lease is (re)acquired. Each delivery folds in a worker process (or, for tests and small
machines, a worker thread); a change of lease epoch cancels the pass in flight, and the
fold transaction's own epoch check fences whatever was already running (L2). A run of small
deliveries goes to the worker process in one call (still one transaction each), since the
round trip would otherwise cost the event loop about as much as the fold costs the worker.
Folding is background work: its worker processes run nicer than the service, so that on a busy
machine intake (what a phone waits for) gets the CPU first and the projection catches up after.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import gc
import logging
import multiprocessing
import multiprocessing.spawn
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, TypeVarTuple, Unpack

import attrs
import trio
import trio_parallel

from actors import threads
from actors.journal import GONE
from healthlog import faults
from healthlog.clock import now_us
from healthlog.folding import FoldPass, FoldReport, OutcomeClass
from healthlog.orphans import exit_when_orphaned
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.journal import DeliveryMeta, Journal
from healthlog.storage.passes import Budget, Selection, take_page, write_marks
from healthlog.storage.store import WORKER_DIED, OutcomeRow, Store
from healthlog.storage.worker import CODE, CodeChanged, fold_run, ready, retire
from healthlog.storage.worker import log as worker_log

log = logging.getLogger("healthlog.folding")

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

DURATION_BOUNDS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)
RUN_MAX = 32
RUN_BYTES = 1 << 20
"""A run handed to one worker call holds at most ``RUN_MAX`` deliveries of ``RUN_BYTES`` raw
bytes together (a larger delivery goes alone)."""
WORKER_DEATHS = 2
"""A delivery whose fold loses this many worker processes in a row (killed by the kernel's
out-of-memory killer, say) is recorded ``failed``, so that it does not hold the queue for ever;
one death alone may have another cause, and the delivery is folded again."""
WORKER_START_S = 60.0
"""How long a fresh worker may take to answer an empty task (a start takes 0.5 s here) before
the folder takes it for one that cannot start."""
START_BACKOFF_S = 1.0
"""While no worker can start, the folder waits this long after a pass before the next one,
twice as long each time, up to its period."""
SHORT_OF = {
    errno.EAGAIN: "the process limit reached?",
    errno.EMFILE: "the open file limit reached?",
    errno.ENFILE: "the system's open file table full?",
    errno.ENOMEM: "memory exhausted?",
}
"""What a ``fork`` or ``pipe`` refused with when a fold worker could not be made says of its
likely cause: something the machine is short of, which ends on its own (SERVE-76, RUN-68)."""
UPGRADED = "healthlog was upgraded under this process"
"""Why a delivery is deferred once a fold worker found healthlog's code changed (STORE-157), or
a pass found the journal or the store migrated by a newer healthlog (STORE-158)."""
WORKER_NICENESS = 10
"""How much nicer than the service the fold worker processes run (folding is background work):
under contention a worker gets about a tenth of a core beside one busy task of the service's,
enough to fold a 62 MiB delivery in about half a minute; nice 19 would be a seventieth. (The fold's
budget counts its CPU time, which waiting for a core does not use up: FOLD-18.)"""


def _start_worker() -> None:
    """In each fold worker process: nicer than the service, and deaf to SIGINT, SIGTERM and
    SIGHUP. A service manager stopping the service (systemd's default), a terminal's Ctrl-C or
    its hangup (a shell signals its jobs as it exits) signals the whole process group; the
    service then stops its workers itself (a cancelled fold kills its worker, an idle one ends
    with the worker cache), where a worker dying of the signal first was a lost worker, logged
    as the folding actor's crash. Since nothing stops it when the service is killed alone, it
    ends by itself once the service is gone (RUN-170)."""
    os.nice(WORKER_NICENESS)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    exit_when_orphaned(os.getppid(), worker_log)


class Executor(enum.Enum):
    """Where a delivery's fold runs."""

    PROCESS = "process"
    THREAD = "thread"


# How long after its hour ended an object was changed: a minute to a month (S9).
LATE_BOUNDS_S = (60.0, 300.0, 900.0, 1800.0, 3600.0, 21600.0, 86400.0, 604800.0, 2592000.0)


@attrs.define
class _Histogram:
    """Observations counted in buckets by upper bound, with their number and sum."""

    bounds: tuple[float, ...]
    counts: list[int] = attrs.field(init=False)
    observed: int = 0
    total: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.observed += 1
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        """(bound, observations at most that) for every bound."""
        return tuple((bound, sum(self.counts[: i + 1])) for i, bound in enumerate(self.bounds))


@attrs.frozen
class FoldingStatistics:
    epoch: int | None
    passes: int
    passes_by_stop: dict[str, int]
    outcomes_by_class: dict[str, int]
    folded: int
    running: bool
    first_pass_completed: bool
    duration_buckets: tuple[tuple[float, int], ...]
    folds_timed: int
    duration_sum_s: float
    late_buckets: tuple[tuple[float, int], ...]
    late_changes: int
    late_sum_s: float
    workers_lost: int
    dying: int
    upgraded: bool
    """Whether healthlog was upgraded under this process: a fold worker found its code changed
    (STORE-157), or a pass found a database migrated by a newer healthlog (STORE-158). Nothing
    folds, and the runtime is not ready, until the service is restarted."""
    unrecorded_stop: str | None
    """Why this folder's last pass ended when the store's lag mark does not say it: the mark
    could not be written (a full disk), or the selection failed (which writes none); None once
    a pass's mark is written, after a fenced pass, or before any pass (STORE-66)."""


class FoldingActor:
    """Folds pending deliveries while it holds the lease."""

    def __init__(
        self,
        data_dir: Path,
        journal: Journal,
        store: Store,
        limiter: trio.CapacityLimiter,
        wake: trio.MemoryReceiveChannel[None],
        poke: trio.MemorySendChannel[None],
        lease_updates: trio.MemoryReceiveChannel[int | None],
        *,
        period_s: float,
        budget: Budget,
        executor: Executor,
        busy_timeout_ms: int,
        page: int,
    ) -> None:
        self._busy_timeout_ms = busy_timeout_ms
        self._page = page
        self._data_dir = data_dir
        self._journal = journal
        self._store = store
        self._limiter = limiter
        self._wake = wake
        self._poke = poke
        self._lease_updates = lease_updates
        self._period_s = period_s
        self._budget = budget
        self._executor = executor
        self._epoch: int | None = None
        self._pass_scope: trio.CancelScope | None = None
        self._passes = 0
        self._stops: Counter[str] = Counter()
        self._classes: Counter[str] = Counter()
        self._durations = _Histogram(DURATION_BOUNDS_S)
        self._late = _Histogram(LATE_BOUNDS_S)
        self._deaths: Counter[int] = Counter()
        self._workers_lost = 0
        self._unrecorded_stop: str | None = None
        self._unwritten: dict[int, str] = {}
        self._cannot_start = False
        self._short_of = False
        self._backoff_s = START_BACKOFF_S
        self._upgraded = False

    def statistics(self) -> FoldingStatistics:
        return FoldingStatistics(
            epoch=self._epoch,
            passes=self._passes,
            passes_by_stop=dict(self._stops),
            outcomes_by_class=dict(self._classes),
            folded=self._classes[OutcomeClass.DONE.value],
            running=self._pass_scope is not None,
            first_pass_completed=self._stops["empty"] + self._stops["unwritten"] > 0,
            duration_buckets=self._durations.cumulative(),
            folds_timed=self._durations.observed,
            duration_sum_s=self._durations.total,
            late_buckets=self._late.cumulative(),
            late_changes=self._late.observed,
            late_sum_s=self._late.total,
            workers_lost=self._workers_lost,
            dying=len(self._deaths),
            upgraded=self._upgraded,
            unrecorded_stop=self._unrecorded_stop,
        )

    def unwritten(self) -> dict[int, str]:
        """The deliveries this folder's pass in flight or last pass could not write, by id,
        with why (SQLite's error and the file): a command waiting for them (``import``,
        ``seal``) says so and ends, where it waited for good, its folder trying again each
        period (CLI-200)."""
        return dict(self._unwritten)

    async def run(self) -> None:
        # A run after a crash starts with a pass: the wake that came before the crash was
        # taken by the run that crashed, and a delivery journaled then waited for the period
        # (a minute), though the cause was gone (a fold worker that could not start while
        # connections held every file descriptor, SERVE-76). A first run has no epoch yet
        # and waits for the lease, which wakes it.
        with contextlib.suppress(*GONE):
            self._poke.send_nowait(None)
        workers = trio_parallel.cache_scope(init=_start_worker, retire=retire)
        try:
            async with workers, trio.open_nursery() as nursery:
                nursery.start_soon(self._follow_lease)
                await self._passes_forever()
        except RuntimeError as exc:
            if not threads.start_refused(exc):
                raise
        # Only a worker cache that could not end gets here: trio-parallel ends its idle workers
        # in a thread, and none could be started (RUN-73); they end as their pipes close, with
        # the cache or this process. Its error took the place of what ended the run, as a rule
        # a cancellation (the service stopping), which this checkpoint raises again.
        await trio.lowlevel.checkpoint()
        raise threads.refused()

    async def _passes_forever(self) -> None:
        """A pass at each wake, timer or lease, until cancelled."""
        while True:
            with trio.move_on_after(self._period_s):
                await self._wake.receive()
            while True:
                try:
                    self._wake.receive_nowait()
                except trio.WouldBlock:
                    break
            epoch = self._epoch
            if epoch is None:
                continue
            threadless = False
            try:
                with trio.CancelScope() as scope:
                    self._pass_scope = scope
                    await self._pass(epoch)
            except threads.NoThread:
                # Said once for the process (RUN-70); what was pending stays so, and the
                # next pass comes after the backoff, as for a worker that cannot be made.
                threadless = True
            finally:
                self._pass_scope = None
            if threadless or self._cannot_start:
                if self._cannot_start and self._short_of:
                    await _close_unmade()
                await trio.sleep(self._backoff_s)
                self._backoff_s = min(self._backoff_s * 2, self._period_s)
                if threadless or self._short_of:
                    # What the machine is short of (processes, descriptors) comes back on
                    # its own: try again then, not at the next wake or timer (SERVE-76).
                    with contextlib.suppress(*GONE):
                        self._poke.send_nowait(None)

    async def _follow_lease(self) -> None:
        async for epoch in self._lease_updates:
            if epoch != self._epoch and self._pass_scope is not None:
                self._pass_scope.cancel()
            self._epoch = epoch
            if epoch is not None:
                with contextlib.suppress(*GONE):
                    self._poke.send_nowait(None)

    async def _pass(self, epoch: int) -> None:
        if not self._upgraded:
            await self._check_versions()
        if self._upgraded:
            return
        self._passes += 1
        self._unwritten = {}
        selection = Selection(self._journal, self._store, page=self._page)
        folding: FoldPass[DeliveryMeta] = FoldPass(more=True)
        try:
            while True:
                if folding.wants_page:
                    await threads.run_sync(take_page, selection, folding, limiter=self._limiter)
                if folding.next() is None:
                    break
                started = trio.current_time()
                reports = await self._fold(self._run(folding), epoch)
                each = (trio.current_time() - started) / len(reports)
                for report in reports:
                    self._durations.observe(each)
                    for seconds in report.late_s:
                        self._late.observe(seconds)
                    self._classes[report.outcome_class.value] += 1
                    if report.outcome_class is OutcomeClass.DONE:
                        self._deaths.pop(report.delivery_id, None)
                    elif report.outcome_class is OutcomeClass.UNWRITTEN:
                        self._unwritten[report.delivery_id] = report.reason or "not written"
                    folding.record(report)
        except trio.Cancelled:
            folding.cancel()
            self._stops["cancelled"] += 1
            raise
        assert folding.stopped_because is not None
        self._stops[folding.stopped_because] += 1
        if folding.stopped_because == "fenced" and self._epoch == epoch:
            # The epoch is lost: wait for the lease actor to report one again rather than fold
            # under it on every wake, each time fenced again after reading a body.
            self._epoch = None
        written = await threads.run_sync(
            write_marks, self._journal, self._store, folding, now_us, limiter=self._limiter
        )
        fenced = folding.stopped_because == "fenced"
        self._unrecorded_stop = None if written or fenced else folding.stopped_because

    async def _check_versions(self) -> None:
        """Stop folding when a newer healthlog migrated the journal or the store since this
        process opened them: a command run from files upgraded under the running service
        (``status``, ``reindex``) migrates them, and this process's folds, its workers already
        started included, would then write rows of its own schema's shape into the newer one,
        which a table the newer code keeps in step with them (counter totals, say) would miss
        (STORE-158). An error reading a version is left to the pass, which meets it too."""

        def newer() -> list[str]:
            files = ((self._journal.path, self._journal), (self._store.path, self._store))
            return [
                f"{Path(path).name} is at schema version {version}"
                for path, database in files
                if (version := database.newer_version()) is not None
            ]

        try:
            found = await threads.run_sync(newer, limiter=self._limiter)
        except StorageError:
            return
        if found:
            self._upgraded = True
            log.warning(
                "%s (%s, by a newer healthlog's command since this process opened it): this"
                " process's folds would write rows of its own schema into it; nothing folds"
                " until healthlog is restarted (serve answers /readyz 503 meanwhile), and the"
                " deliveries journaled meanwhile fold then",
                UPGRADED,
                "; ".join(found),
            )

    def _run(self, folding: FoldPass[DeliveryMeta]) -> list[DeliveryMeta]:
        """The deliveries to fold in one call, from the one ``folding`` is at on, within the
        page it holds.

        One at a time in a thread: a thread cannot be stopped between two folds on cancel.
        """
        run = list(folding.upcoming(1))
        if self._executor is Executor.PROCESS:
            size = run[0].bytes
            for meta in folding.upcoming(RUN_MAX)[1:]:
                size += meta.bytes
                if size > RUN_BYTES:
                    break
                run.append(meta)
        return run

    async def _fold(self, run: list[DeliveryMeta], epoch: int) -> list[FoldReport]:
        """Reports for a prefix of ``run``, in order: the worker stops after one not DONE."""
        if self._executor is Executor.PROCESS:
            if self._upgraded:
                return [FoldReport(run[0].id, OutcomeClass.DEFERRED, reason=UPGRADED)]
            try:
                reports = await _in_worker(
                    fold_run,
                    CODE,
                    str(self._data_dir),
                    [meta.id for meta in run],
                    epoch,
                    self._budget,
                    self._busy_timeout_ms,
                )
            except trio_parallel.BrokenWorkerError:
                return await self._worker_lost(run, epoch)
            except CodeChanged as exc:
                self._upgraded = True
                log.warning(
                    "%s (%s): a fold worker, a new process importing healthlog from disk, would"
                    " run the new code under this one and migrate the databases to a schema it"
                    " does not know; nothing folds until healthlog is restarted (serve answers"
                    " /readyz 503 meanwhile), and the deliveries journaled meanwhile fold then",
                    UPGRADED,
                    exc,
                )
                return [FoldReport(run[0].id, OutcomeClass.DEFERRED, reason=UPGRADED)]
            except OSError as exc:
                if exc.errno not in SHORT_OF:
                    raise
                # No worker could be made (a process or open file limit): the delivery stays
                # pending, as when one cannot start (RUN-68).
                self._cannot_start_for(_not_made(exc), short_of=True)
                return [FoldReport(run[0].id, OutcomeClass.DEFERRED, reason=WORKER_DIED)]
            self._workers_start()
            return reports
        [meta] = run

        def fold() -> FoldReport:
            # The budget counts the CPU time of the thread that folds (FOLD-18).
            check = self._budget.checker(meta.bytes)
            return self._store.fold(self._journal, meta, epoch, check_budget=check)

        return [await threads.run_sync(fold, limiter=self._limiter)]

    async def _worker_lost(self, run: list[DeliveryMeta], epoch: int) -> list[FoldReport]:
        """Reports for ``run`` after its worker process died: the deliveries it committed
        stand, and the first without an outcome is the one it was folding. That one is
        deferred (the pass stops there, the next pass folds it again in a new worker) until
        it has lost ``WORKER_DEATHS`` workers, and then recorded ``failed``."""
        self._workers_lost += 1

        def outcomes_of_run() -> list[OutcomeRow | None]:
            faults.point("fold.run_lookup")
            return [self._store.outcome(meta.id) for meta in run]

        try:
            outcomes = await threads.run_sync(outcomes_of_run, limiter=self._limiter)
        except StorageError as exc:
            # Which delivery the worker was folding is unknown: no death is counted, and the
            # pass stops at the run's first; the next pass skips what the worker committed.
            log.warning(
                "delivery %d: its fold worker died and the outcomes of its run cannot be read:"
                " %s; folding it again",
                run[0].id,
                describe(exc),
            )
            return [FoldReport(run[0].id, OutcomeClass.DEFERRED, reason=WORKER_DIED)]
        reports = []
        for meta, outcome in zip(run, outcomes, strict=True):
            if outcome is None:
                reports.append(await self._fold_killed(meta, epoch))
                break
            reports.append(FoldReport(meta.id, OutcomeClass.DONE, outcome.status, outcome.reason))
        return reports

    async def _fold_killed(self, meta: DeliveryMeta, epoch: int) -> FoldReport:
        """The report for ``meta``, whose worker died folding it: counted against it only if a
        new worker runs an empty task; if that one dies too (the interpreter gone or not
        executable for the service's user, its packages gone), the machine is at fault, not
        the delivery, which stays pending until a worker starts again."""
        cause = await self._start_failure()
        if cause is not None:
            self._cannot_start_for(cause, short_of=False)
            return FoldReport(meta.id, OutcomeClass.DEFERRED, reason=WORKER_DIED)
        self._workers_start()
        self._deaths[meta.id] += 1
        if self._deaths[meta.id] < WORKER_DEATHS:
            log.warning("delivery %d: its fold worker died; folding it again", meta.id)
            return FoldReport(meta.id, OutcomeClass.DEFERRED, reason=WORKER_DIED)
        del self._deaths[meta.id]
        log.error(
            "delivery %d: its fold worker died %d times in a row; recorded failed",
            meta.id,
            WORKER_DEATHS,
        )
        return await threads.run_sync(
            self._store.fail, meta, epoch, WORKER_DIED, limiter=self._limiter
        )

    def _cannot_start_for(self, cause: str, *, short_of: bool) -> None:
        """No fold worker can start, for ``cause``: one ERROR while it lasts, DEBUG after."""
        if not self._cannot_start:
            log.error(
                "fold workers cannot start: %s; deliveries stay pending until one does, "
                "tried again %s",
                cause,
                f"after {START_BACKOFF_S:.0f} s, then less often"
                if short_of
                else "at the next wake or timer",
            )
        else:
            log.debug("fold workers still cannot start: %s", cause)
        self._cannot_start = True
        self._short_of = short_of

    async def _start_failure(self) -> str | None:
        """Why a new fold worker cannot run an empty task, or None if one does."""
        try:
            with trio.fail_after(WORKER_START_S):
                await _in_worker(ready)
        except trio.TooSlowError:
            return f"a new worker process did not answer within {WORKER_START_S:.0f} s"
        except OSError as exc:
            return f"a new worker process could not be started ({exc.strerror or exc})"
        except trio_parallel.BrokenWorkerError as exc:
            return _died_starting(exc)
        return None

    def _workers_start(self) -> None:
        """A worker ran: after workers could not start, say that they do again."""
        if self._cannot_start:
            log.info("fold workers start again; pending deliveries fold")
        self._cannot_start = False
        self._backoff_s = START_BACKOFF_S


async def _close_unmade() -> None:
    """Close the descriptors of the fold workers that could not be made. trio-parallel opens a
    worker's two pipes (4 descriptors) before it makes its process; when that fails they stay
    in a reference cycle with the error's traceback until the garbage collector runs, which
    may be long after (40 held after 10 tries under a process limit), and they are what a
    descriptor shortage is short of (RUN-72). Trio lets go of the error at its next turn; a
    collection then closes them (some 40 ms, a second or more apart)."""
    await trio.lowlevel.checkpoint()
    gc.collect()


async def _in_worker(fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
    """``fn(*args)`` in a fold worker process, killed on cancel, raising
    :class:`threads.NoThread` when the thread that starts a new worker cannot be started."""
    try:
        result: T = await trio_parallel.run_sync(fn, *args, kill_on_cancel=True)
    except RuntimeError as exc:
        if not threads.start_refused(exc):
            raise
        raise threads.refused() from None
    return result


def _not_made(exc: OSError) -> str:
    """Why no worker process could be made, from what ``fork`` or ``pipe`` refused with."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    return f"a new worker process could not be made: {name}, {exc.strerror} ({SHORT_OF[code]})"


def _died_starting(exc: trio_parallel.BrokenWorkerError) -> str:
    """What is known of why a new worker process ended before it ran an empty task."""
    executable = os.fsdecode(multiprocessing.spawn.get_executable())
    if not os.access(executable, os.X_OK):
        return f"{executable} cannot be run by uid {os.getuid()} (missing, or not executable)"
    process = exc.args[-1] if exc.args else None
    code = process.exitcode if isinstance(process, multiprocessing.process.BaseProcess) else None
    if code is None:
        return "a new worker process ended before it ran anything"
    if code < 0:
        try:
            killer = signal.Signals(-code).name
        except ValueError:
            killer = f"signal {-code}"
        return f"a new worker process was killed by {killer}"
    return f"a new worker process exited with status {code} before it ran anything"
