"""The lease-holder actor: acquires and renews the fold lease, and says which epoch it holds.

It sends the folding actor every change of the epoch it holds (``None`` when it holds none).
A renewal waits for the store's write lock only briefly (``brief``), so that the store's reads,
which share its connection, do not wait behind it while another process writes (a fold worker
on a large delivery, a reindex). One refused because the store is busy keeps the epoch: nobody
can take the lease over without the write lock either (often held by our own long fold), and
the epoch check inside every fold transaction fences a stale holder anyway; it is logged at
INFO, and at WARNING once the store has been busy for longer than the lease's term. A renewal
that fails otherwise keeps the epoch only until the lease would have expired; a takeover by
someone else is seen at the next renewal. On shutdown it releases.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from actors import threads
from healthlog import faults
from healthlog.clock import now_us
from healthlog.storage._sqlite import Deferred, StorageError, describe, mounted_read_only
from healthlog.storage.store import Store, serve_of

log = logging.getLogger("healthlog.lease")

# How many renewal periods (and at least a lease term) another serve holds the lease, unbroken,
# before a serve says at WARNING that it runs beside it: 30 s by default, past a restart's
# overlap (the old one stopping releases the lease within graceful_timeout_s, 20 s) and past a
# killed one's lease, which runs out within a term unrenewed (the INFO line of _held_elsewhere
# says that case).
BESIDE_RENEWALS = 6


@attrs.frozen
class LeaseStatistics:
    holder: str
    epoch: int | None
    acquisitions: int
    renewals: int
    losses: int
    failures: int


class LeaseActor:
    """Holds the fold lease for ``holder`` while it runs."""

    def __init__(
        self,
        store: Store,
        limiter: trio.CapacityLimiter,
        holder: str,
        updates: trio.MemorySendChannel[int | None],
        *,
        ttl_s: float,
        renew_s: float,
        clock: Callable[[], int] = now_us,
    ) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError("the renew interval must be positive and shorter than the TTL")
        self._store = store
        self._limiter = limiter
        self._holder = holder
        self._updates = updates
        self._ttl_us = int(ttl_s * 1_000_000)
        self._renew_s = renew_s
        self._clock = clock
        self._epoch: int | None = None
        self._valid_until = 0.0
        # When the renewals began to find the store busy, while they do.
        self._busy_since: float | None = None
        # The other holder last said to hold the lease (_held_elsewhere).
        self._told_holder: str | None = None
        # The other serve holding the lease while this serve runs, and since when it has been
        # seen holding it, unbroken (_beside_serve); whether that was said at WARNING.
        self._beside: str | None = None
        self._beside_since = 0.0
        self._beside_told = False
        # How long after this renewal the next one comes: sooner while another holder's lease
        # expires before then (_held_elsewhere).
        self._next_try_s = renew_s
        # Why the last renewal could not write the lease while this actor holds none (a full
        # disk, a store it may not write), None once one is written or found held elsewhere.
        self._refused: str | None = None
        self._acquisitions = 0
        self._renewals = 0
        self._losses = 0
        self._failures = 0

    def statistics(self) -> LeaseStatistics:
        return LeaseStatistics(
            self._holder,
            self._epoch,
            self._acquisitions,
            self._renewals,
            self._losses,
            self._failures,
        )

    def refused(self) -> str | None:
        """Why this actor holds no lease and cannot take one (SQLite's error and the file):
        a command waiting for its own folds (``import``, ``seal``) says so and ends, where it
        waited for good, a WARNING every renewal period (CLI-201). None while it holds the
        lease, another holder does, or the store is only busy."""
        return self._refused

    async def run(self) -> None:
        try:
            while True:
                await self._renew()
                await trio.sleep(self._next_try_s)
        finally:
            with trio.CancelScope(shield=True):
                await self._release()

    async def _renew(self) -> None:
        self._next_try_s = self._renew_s

        def acquire() -> int | None:
            faults.point("lease.renew")
            return self._store.acquire_lease(
                self._holder, now=self._clock(), ttl=self._ttl_us, brief=True
            )

        try:
            epoch = await threads.run_sync(acquire, limiter=self._limiter)
        except Deferred:
            self._failures += 1
            self._deferred()
            return
        except StorageError as exc:
            self._failures += 1
            self._busy_since = None
            # The error's kind, SQLite's error name and meaning, never its message, which may
            # quote what SQLite was given (RUN-165); with the file, it tells an operator what to
            # fix (a store the service's user cannot write, a full disk).
            said = describe(exc)
            if exc.file is None:
                said = f"{said} ({os.path.basename(self._store.path)})"
            # A file system the kernel took read-only after disk errors is said, or the line
            # read as a file of the wrong owner (CLI-202).
            read_only = mounted_read_only(Path(self._store.path).parent)
            cause = "" if read_only is None else f": {read_only}"
            # No thread to renew in is said once for the process, not at every renewal (RUN-71).
            level = logging.DEBUG if isinstance(exc, threads.NoThread) else logging.WARNING
            log.log(level, "lease renewal failed: %s%s", said, cause)
            if self._epoch is not None and trio.current_time() >= self._valid_until:
                await self._publish(None)
            if self._epoch is None and not isinstance(exc, threads.NoThread):
                self._refused = describe(exc)
            return
        self._busy_since = None
        self._refused = None
        if epoch is not None:
            self._valid_until = trio.current_time() + self._ttl_us / 1e6 - self._renew_s
        elif self._epoch is None:
            await self._held_elsewhere()
        if epoch is not None:
            self._beside = None
        await self._publish(epoch)

    async def _held_elsewhere(self) -> None:
        """Another holder's lease keeps this actor from folding: try again as it expires when
        that comes before the next renewal, and say once for each holder that it holds the
        lease, and until when. A service started again after it was killed (SIGKILL, the
        out-of-memory killer, a power cut) found the lease of its dead self held, and was not
        ready, folding nothing, for the lease's term (15 s) without a word (RUN-78), and up to
        a renewal period (5 s) after it expired (RUN-79)."""
        try:
            lease = await threads.run_sync(self._store.lease, limiter=self._limiter)
        except StorageError:
            return
        left_s = max(0.0, (lease.expires_at - self._clock()) / 1e6)
        self._next_try_s = min(self._renew_s, left_s)
        self._beside_serve(lease.holder)
        if lease.holder is None or lease.holder == self._told_holder:
            return
        self._told_holder = lease.holder
        log.info(
            "fold lease held by %s for %.0f s more: folding waits until it releases the lease"
            " or the lease expires (a process that was killed, by SIGKILL, the out-of-memory"
            " killer or a power cut, does not release it)",
            lease.holder,
            left_s,
        )

    def _beside_serve(self, holder: str | None) -> None:
        """Say once at WARNING when another ``serve`` has held the lease for longer than
        ``BESIDE_RENEWALS`` renewal periods and a lease term while this one, a ``serve`` too,
        runs: two services on one data directory (a second unit, a container beside a host
        install) both answer 200 and journal, but only the holder folds, the other's
        deliveries at its next pass, a minute later, and the other's ``/readyz`` stays 503
        unless it completed a folding pass before it lost the lease (RUN-152). The INFO line
        of ``_held_elsewhere`` was all that said so (RUN-140). An ``import`` or
        ``seal`` (or a reindex) holds the lease for its own fold and lets go: it is not said,
        nor is anything when this actor is theirs."""
        other = serve_of(holder)
        if serve_of(self._holder) is None or other is None:
            self._beside = None
            return
        now = trio.current_time()
        if holder != self._beside:
            self._beside, self._beside_since, self._beside_told = holder, now, False
        held_s = now - self._beside_since
        patience_s = max(BESIDE_RENEWALS * self._renew_s, self._ttl_us / 1e6)
        if self._beside_told or held_s <= patience_s:
            return
        self._beside_told = True
        host, pid = other
        log.warning(
            "another healthlog serve (host %s, pid %s) has held the fold lease of this data"
            " directory for %.0f s: this one journals what it is sent but folds nothing while"
            " that one runs (its /readyz answers 503 until it has completed a folding pass);"
            " run one serve per data directory"
            " (stop this one or the other: a second systemd unit, a container beside a host"
            " install)",
            host,
            pid,
            held_s,
        )

    def _deferred(self) -> None:
        """Say that a renewal found the store busy: at INFO for a moment (a fold worker's
        transaction, the common case), at WARNING once it has been busy for longer than the
        lease's term (a writer that does not let go). An actor that holds no lease says that
        its first is not taken yet: a service started again while the fold worker of the
        killed one still wrote said that the epoch it never had was kept (RUN-151)."""
        now = trio.current_time()
        if self._busy_since is None:
            self._busy_since = now
        busy_s = now - self._busy_since
        if self._epoch is None:
            what, kept = "fold lease not taken yet", ""
        else:
            what, kept = "lease renewal deferred", "; the epoch is kept"
        if busy_s >= self._ttl_us / 1e6:
            log.warning("%s: the store has been busy for %.0f s%s", what, busy_s, kept)
        else:
            log.info("%s: the store is busy%s", what, kept)

    async def _publish(self, epoch: int | None) -> None:
        if epoch == self._epoch:
            if epoch is not None:
                self._renewals += 1
            return
        if epoch is None:
            self._losses += 1
            log.warning("fold lease lost (epoch %s)", self._epoch)
        elif self._epoch is not None:
            # Another process forced the lease and gave it back between two renewals (a
            # reindex shorter than a renewal period): the folder was fenced meanwhile, and a
            # jump of the epoch alone would not say why.
            self._acquisitions += 1
            log.info(
                "fold lease held at epoch %d: another process (a reindex, say) held it since"
                " epoch %d",
                epoch,
                self._epoch,
            )
        else:
            self._acquisitions += 1
            log.info("fold lease held at epoch %d", epoch)
        self._epoch = epoch
        await self._updates.send(epoch)

    async def _release(self) -> None:
        if self._epoch is None:
            return
        try:
            await threads.run_sync(
                self._store.release_lease, self._holder, self._epoch, limiter=self._limiter
            )
        except StorageError as exc:
            log.warning("lease release failed: %s", describe(exc))
