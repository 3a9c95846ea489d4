"""The retention actor: keeps the replay stream's online window bounded (R4, R5).

Events beyond the newest ``keep`` that are also older than ``max_age_s`` are dropped from
the projection; the journal is never touched, so nothing true is lost. Then the subscribers
that are gone are removed: their last ACK is older than ``max_age_s`` and their cursor older
than the window, so they could only resume from a snapshot; their next ACK stores them again.
Neither is done while the clock reads more than a day behind the oldest event held: it has not
been set since boot, or was set back, and every event would count as old (STREAM-185).
Last, each file's ``-wal`` that a reader of another program keeps from being checkpointed is
said, once while it lasts (RUN-63).

Its writes wait for the store's write lock only briefly: the store's reads (status, stream pages,
ACKs, lease renewals) share its connection and would wait behind it for the whole busy timeout
while another process writes, a fold worker on a large delivery say. A run deferred so is said at
INFO, and at WARNING once the store has been busy for longer than a retention period (RUN-74).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Protocol

import attrs
import trio

from actors import threads
from healthlog import faults
from healthlog.clock import now_us
from healthlog.storage._sqlite import Deferred, StorageError, describe
from healthlog.storage.store import Store
from healthlog.timestamps import format_instant

log = logging.getLogger("healthlog.retention")

PRUNE_BATCH = 8_192
"""Events dropped per transaction: dropping 321,000 in such batches kept ``store.sqlite-wal`` at
10 MB, where one transaction wrote 137 MB to it (STORE-88)."""


class Checkpointed(Protocol):
    """A file of the data directory whose ``-wal`` is watched (the journal, the store)."""

    path: str

    def wal_held_back(self) -> int: ...


@attrs.frozen
class RetentionStatistics:
    runs: int
    pruned: int
    removed: int
    """Subscribers removed as gone."""
    held_back: frozenset[str]
    """The files whose ``-wal`` a reader kept from being checkpointed at the last look (RUN-63),
    until a look finds it checkpointed again: ``healthlog_wal_held_back`` of ``/metrics``."""


class RetentionActor:
    def __init__(
        self,
        store: Store,
        limiter: trio.CapacityLimiter,
        *,
        keep: int,
        max_age_s: float,
        period_s: float,
        watched: Sequence[tuple[Checkpointed, trio.CapacityLimiter]] = (),
    ) -> None:
        self._store = store
        self._limiter = limiter
        self._keep = keep
        self._max_age_us = int(max_age_s * 1_000_000)
        self._period_s = period_s
        self._runs = 0
        self._pruned = 0
        self._removed = 0
        self._watched = watched
        self._held_back: set[str] = set()
        # Whether the clock was last seen behind the oldest event held (said once).
        self._clock_behind = False
        # When the runs began to find the store busy, while they do.
        self._busy_since: float | None = None

    def statistics(self) -> RetentionStatistics:
        return RetentionStatistics(
            self._runs, self._pruned, self._removed, frozenset(self._held_back)
        )

    async def run(self) -> None:
        while True:
            await trio.sleep(self._period_s)
            await self._prune()
            for database, limiter in self._watched:
                await self._watch_wal(database, limiter)

    async def _prune(self) -> None:
        now = now_us()
        try:
            ahead = await threads.run_sync(
                self._store.oldest_event_ahead, now, limiter=self._limiter
            )
        except StorageError as exc:
            self._deferred("event pruning", exc)
            return
        if self._waits_for_the_clock(now, ahead):
            self._runs += 1
            return
        cutoff = now - self._max_age_us
        prune = functools.partial(
            self._store.prune_events,
            keep=self._keep,
            older_than_us=cutoff,
            at_most=PRUNE_BATCH,
            brief=True,
        )
        try:
            faults.point("retention.prune")
            # A batch per transaction and per turn of the store's thread, so that the -wal
            # stays small and folds, ACKs and reads go on between them (STORE-88).
            while (pruned := await threads.run_sync(prune, limiter=self._limiter)) > 0:
                self._pruned += pruned
                if pruned < PRUNE_BATCH:
                    break
        except StorageError as exc:
            self._deferred("event pruning", exc)
            return
        self._runs += 1
        try:
            remove = functools.partial(
                self._store.remove_gone_subscribers, older_than_us=cutoff, brief=True
            )
            removed = await threads.run_sync(remove, limiter=self._limiter)
        except StorageError as exc:
            self._deferred("removal of gone subscribers", exc)
            return
        self._busy_since = None
        self._removed += removed
        if removed:
            # How many, never their names (a name is often a device's).
            log.info(
                "removed %d gone subscriber(s) (last ACK and cursor older than the window)",
                removed,
            )

    def _waits_for_the_clock(self, now: int, oldest: int | None) -> bool:
        """Whether this run waits because the clock reads more than a day behind the oldest
        event held (``oldest``, else None), saying so once while it lasts. Run with such a
        clock, every event would count as old: a service started on a NAS that booted at 1970
        dropped all but the newest ``keep`` events, and removed the subscribers behind them,
        at its first run, a minute before NTP set the clock (STREAM-185)."""
        if oldest is None:
            if self._clock_behind:
                self._clock_behind = False
                log.info("the clock reads past the oldest event's stamp: retention resumes")
            return False
        if not self._clock_behind:
            self._clock_behind = True
            log.warning(
                "the clock reads %s, %s s behind the oldest event's stamp %s (not set since"
                " boot, or set back?): no event is dropped and no subscriber removed until it"
                " reads past it",
                format_instant(now),
                f"{(oldest - now) / 1e6:,.0f}",
                format_instant(oldest),
            )
        return True

    def _deferred(self, what: str, exc: StorageError) -> None:
        """Say that ``what`` was deferred by ``exc``: a busy store at INFO for a moment (a fold
        worker's transaction, the common case), at WARNING once it has been busy for longer than
        a retention period (a writer that does not let go)."""
        if not isinstance(exc, Deferred):
            self._busy_since = None
            log.log(_level(exc), "%s deferred: %s", what, describe(exc))
            return
        now = trio.current_time()
        if self._busy_since is None:
            self._busy_since = now
        busy_s = now - self._busy_since
        if busy_s >= self._period_s:
            log.warning("%s deferred: the store has been busy for %.0f s", what, busy_s)
        else:
            log.info("%s deferred: the store is busy", what)

    async def _watch_wal(self, database: Checkpointed, limiter: trio.CapacityLimiter) -> None:
        """Say once, while it lasts, that a reader keeps ``database``'s ``-wal`` from being
        checkpointed, and when it is checkpointed again."""
        try:
            size = await threads.run_sync(database.wal_held_back, limiter=limiter)
        except StorageError as exc:
            # The folds and the journal say what is wrong with the file; this only looked.
            log.debug("checkpoint of %s not tried: %s", database.path, describe(exc))
            return
        if size and database.path not in self._held_back:
            self._held_back.add(database.path)
            log.warning(
                "%s-wal is %d bytes and cannot be checkpointed: a read transaction is kept open"
                " on %s (by another program, such as a database browser, a script or a backup"
                " through SQLite, or by a long verify or snapshot build), and every write is"
                " added to the -wal until it ends",
                database.path,
                size,
                database.path,
            )
        elif not size and database.path in self._held_back:
            self._held_back.discard(database.path)
            log.info("%s-wal is checkpointed again", database.path)


def _level(exc: StorageError) -> int:
    """How loud a deferral for ``exc`` is: no thread to run in is said once for the process
    (RUN-71), not at every run; another error, at each."""
    return logging.DEBUG if isinstance(exc, threads.NoThread) else logging.WARNING
