"""Rebuilding the projection from the journal: ``reindex`` and ``verify``.

A rebuild folds deliveries in journal order into a fresh store file, with the same fold
code the live folder uses and without the out-of-order guard; a large one folds disjoint
sets of metrics side by side in worker processes (``_partition``). ``reindex`` takes the fold
lease at a higher epoch (fencing the live folder), rebuilds, swaps the result in, and
releases. ``verify`` rebuilds exactly the deliveries the live store has folded, into a
temporary file, and compares the two object by object.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import attrs

from healthlog import clock, faults, objects
from healthlog.folding import OutcomeClass
from healthlog.objects import ObjectKey
from healthlog.storage import _partition, holders
from healthlog.storage._sqlite import (
    COMPANIONS,
    Deferred,
    StorageError,
    bytes_in_use,
    connect,
    describe,
    disk_error,
    free_bytes,
    free_when_full,
    give_to_directory_owner,
    is_damage,
    is_full,
    mounted_read_only,
    read_transaction,
)
from healthlog.storage.journal import DeliveryMeta, Journal
from healthlog.storage.passes import Progress
from healthlog.storage.store import Store, default_holder, process_of

log = logging.getLogger("healthlog.rebuild")

LEASE_TTL_US = 300 * 1_000_000
LEASE_RENEW_S = 30.0
MAX_WORKERS = 4
SCRATCH_PREFIX = ".rebuild-"
SCRATCH_OWNER = "owner.lock"
# A scratch directory without its lock file this long is left over, not being set up.
UNLOCKED_STALE_S = 3600.0
PARALLEL_MIN_BYTES = 4 * 2**20
PAGE = 1024
"""How many deliveries' metadata a rebuild reads and holds at a time (STORE-80)."""
# The live summaries a verify compares with, in its scratch directory.
LIVE_SUMMARIES = "live.sqlite"
# The rebuilt store, in its scratch directory: a name of its own, so that what is logged of
# its writes (a full disk) is not taken for the live store's (STORE-77).
SCRATCH_STORE = "rebuilt.sqlite"
_SAME_KEY = "n.metric = l.metric AND n.layer = l.layer AND n.hour = l.hour"
_AGREE = "n.hash IS NOT NULL AND l.hash = n.hash AND l.sealed = n.sealed"
_COLUMNS = "(l.units IS NOT n.units OR l.points != n.points)"
_PROVENANCE = "l.created_by != n.created_by"
# Every live summary that differs from the rebuild (``agree`` 0), or agrees but with other
# columns (``columns`` 1), another creating delivery (``provenance`` 1) or a live body that is
# not the rebuilt one (``now`` and ``fresh``, for the caller to decompress and compare), then
# every rebuilt object the live store lacks.
_DIFFERENCES = (
    f"SELECT l.metric, l.layer, l.hour, l.hash, n.hash, {_AGREE}, {_COLUMNS}, {_PROVENANCE},"
    " o.body, n.body"
    " FROM live.summaries AS l"
    f" LEFT JOIN main.objects AS n ON {_SAME_KEY}"
    " LEFT JOIN store.objects AS o ON o.metric = l.metric AND o.layer = l.layer"
    f" AND o.hour = l.hour AND {_AGREE} AND o.hash = l.hash AND o.body != n.body"
    f" WHERE NOT ({_AGREE}) OR {_COLUMNS} OR {_PROVENANCE} OR o.body IS NOT NULL"
    " UNION ALL"
    " SELECT n.metric, n.layer, n.hour, NULL, n.hash, 0, 0, 0, NULL, NULL FROM main.objects AS n"
    f" WHERE NOT EXISTS (SELECT 1 FROM live.summaries AS l WHERE {_SAME_KEY})"
    " ORDER BY 1, 2, 3"
)

_OUTCOME_DIFFERENCES = (
    "SELECT n.delivery_id, l.status, n.status FROM main.outcomes AS n"
    " JOIN live.outcomes AS l ON l.delivery_id = n.delivery_id"
    " WHERE l.status != n.status OR l.reason IS NOT n.reason ORDER BY n.delivery_id"
)


class RebuildError(Exception):
    """A rebuild could not fold every delivery it was asked to."""


class RebuildUnwritten(RebuildError):
    """A rebuild whose writes into its scratch store failed (a full disk, a failing one)."""


class ReindexRunning(RebuildError):
    """Another reindex holds the fold lease and may still be running (FENCE-31): taken from
    it by force, its rebuild (a minute for years of data) was thrown away at its swap."""

    def __init__(self, holder: str, expires_at: int) -> None:
        left = max(0, expires_at - clock.now_us()) / 1e6
        super().__init__(
            f"another reindex holds the fold lease ({holder}, {left:.0f} s more unless it"
            " renews it): it rebuilds this same journal and swaps it in; nothing was changed"
        )


REINDEX_PREFIX = "reindex:"


def reindex_holder(directory: Path | None = None) -> str:
    """The lease holder name of a reindex run by this process on the data directory
    ``directory``: ``reindex:`` and :func:`default_holder`."""
    return REINDEX_PREFIX + default_holder(directory)


def running_reindex(holder: str, directory: Path | None = None) -> bool:
    """Whether ``holder``, the lease holder of the data directory ``directory``, names a
    reindex that may still be running: any but one whose process is known to have ended
    (:func:`holders.ended`). A reindex killed (SIGKILL, the out-of-memory killer) on this
    machine, in this pid namespace or in a container's, is taken over at once (FENCE-32,
    FENCE-43), not after its five minutes, even when its process id has come back as another
    process's (FENCE-40); one of another machine (a data directory shared over the network)
    cannot be looked at from here and keeps its lease until it expires."""
    return process_of(holder, REINDEX_PREFIX) is not None and not holders.ended(holder, directory)


@attrs.frozen
class Difference:
    """One object that differs between the live store and a rebuild: by its hashes (None
    where the object is missing), by its seal, with ``corrupt`` by a live row damaged behind
    its hash (a body that does not hold the bytes its hash names, units or a point count that
    are not the rebuild's), or, with ``provenance``, by the delivery that created it alone (a
    backfill of the same points folded after a later delivery): its points are the rebuild's."""

    key: ObjectKey
    live: bytes | None
    rebuilt: bytes | None
    corrupt: bool = False
    provenance: bool = False


@attrs.frozen
class OutcomeDifference:
    """A folded delivery whose recorded status or reason is not the one a rebuild records
    (a rule changed by an upgrade, say): :func:`reindex` records it anew."""

    delivery_id: int
    live: str
    rebuilt: str


@attrs.frozen
class Verification:
    """What :func:`verify_all` found: the objects that differ, and the outcomes."""

    objects: list[Difference]
    outcomes: list[OutcomeDifference]
    bodies_lost: list[int]
    """Of those, the deliveries whose bodies the journal lost (:meth:`Store.bodies_lost`),
    which :func:`reindex` refuses to record failed (STORE-56)."""


def rebuild_into(
    journal: Journal,
    path: Path,
    *,
    only: set[int] | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
    reference: Path | None = None,
    given_up: Mapping[int, str] | None = None,
) -> None:
    """Fold the journal (or the deliveries in ``only``) in journal order into a new store,
    reading the journal :data:`PAGE` deliveries at a time.

    An object that the store at ``reference`` (the live projection) holds with the same
    content may take that store's body rather than a new compression of its own. The
    deliveries in ``given_up`` are recorded failed with the reason it gives, as the live fold
    decided for a cause of the machine's (its time budget, a worker that died, memory; see
    ``store.GIVEN_UP``), instead of folded.

    ``workers`` processes fold disjoint sets of metrics side by side (see ``_partition``);
    by default one more than there are cores (at most ``MAX_WORKERS``), so that the scheduler
    evens out partitions of unequal weight, once the bodies to fold reach
    ``PARALLEL_MIN_BYTES``, below which one process is quicker than starting more.
    """
    given_up = {} if given_up is None else given_up
    queue = _partition.Queue(journal, only=only, page=PAGE)
    if workers is None:
        cores = _partition.available_cores()
        enough = cores > 1 and queue.bytes >= PARALLEL_MIN_BYTES
        workers = min(MAX_WORKERS, cores + 1) if enough else 1
    try:
        _fold_into(journal, path, queue, progress, workers, reference, given_up)
    except _PartitionsOutOfRoom as exc:
        # The partitions' scratch files hold their objects uncompressed (18.5 MB beside a
        # store of 2.5 MB of minute points, where one process needs 3 MB): on a disk with
        # room for one process's, the rebuild failed for want of room, and never said how
        # much it needs (STORE-130). Their files are gone by now.
        log.warning(
            "rebuilding in %d partitions ran out of room (%s): rebuilding in one process,"
            " which needs less room",
            workers,
            describe(exc.error),
        )
        for name in (path.name, *(path.name + suffix for suffix in COMPANIONS)):
            (path.parent / name).unlink(missing_ok=True)
        queue = _partition.Queue(journal, only=only, page=PAGE)
        if progress is not None:
            # Starting over: a full disk's line says how far the one-process rebuild came,
            # not the partitions (STORE-135).
            progress(0, len(queue))
        _fold_into(journal, path, queue, progress, 1, reference, given_up)


class _PartitionsOutOfRoom(Exception):
    """A rebuild in partitions that met a disk error (a full disk, most likely)."""

    def __init__(self, error: StorageError) -> None:
        super().__init__(error)
        self.error = error


def _fold_into(
    journal: Journal,
    path: Path,
    queue: _partition.Queue,
    progress: Progress | None,
    workers: int,
    reference: Path | None,
    given_up: Mapping[int, str],
) -> None:
    """:func:`rebuild_into` with ``workers`` processes, into a new store at ``path``."""
    with Store(path, durable=False) as target:
        epoch = target.acquire_lease("rebuild", now=clock.now_us(), ttl=LEASE_TTL_US, force=True)
        assert epoch is not None

        def fold(meta: DeliveryMeta) -> None:
            if meta.id in given_up:
                report = target.fail(meta, epoch, given_up[meta.id], live=False)
            else:
                report = target.fold(journal, meta, epoch, guard=False)
            if report.outcome_class is not OutcomeClass.DONE:
                error = (
                    RebuildUnwritten
                    if report.outcome_class is OutcomeClass.UNWRITTEN
                    else RebuildError
                )
                raise error(
                    f"delivery {meta.id} could not be rebuilt ({report.outcome_class.value})"
                )

        if workers > 1:
            try:
                _partition.rebuild(
                    journal,
                    queue,
                    target,
                    epoch,
                    workers=workers,
                    fold_alone=fold,
                    alone=frozenset(given_up),
                    progress=progress,
                    reference=None if reference is None else str(reference),
                )
                return
            except _partition.PartitionFailed as exc:
                log.warning("partitioned rebuild broke (%s); rebuilding in one process", exc)
            except (StorageError, BrokenProcessPool) as exc:
                if isinstance(exc, StorageError) and disk_error(exc):
                    raise _PartitionsOutOfRoom(exc) from exc
                raise RebuildUnwritten(f"partitioned rebuild failed: {exc}") from exc
        for done, meta in enumerate(queue, start=1):
            fold(meta)
            if progress is not None:
                progress(done, len(queue))


WAL_ROOM = 5 * 2**20
"""The room of a one-process rebuild's ``-wal`` beside its store: SQLite copies it into the
store at 1,000 pages of 4 KiB (its automatic checkpoint), both on the disk meanwhile, and
reuses it; the last delivery's pages past those stay in it too (4,288,512 bytes for 60 days of
minute points)."""


@attrs.define
class _Room:
    """The room a rebuild had beside ``near`` as it began (None where it cannot be read), how
    far it came, and the room it needs (STORE-135).

    The rebuild that fails for want of room is one process's: partitions that run out of room
    give way to it (STORE-130), their scratch files removed, so the room it had is the room
    there was as the rebuild began."""

    near: Path
    free: int | None
    done: int = 0
    total: int = 0

    def tracking(self, progress: Progress | None) -> Progress:
        """``progress``, keeping how many of how many deliveries were folded."""

        def tracked(done: int, total: int) -> None:
            self.done, self.total = done, total
            if progress is not None:
                progress(done, total)

        return tracked

    def needed(self) -> int:
        """About what the rebuild in one process takes: a store holding what ``near`` holds
        in use, and its ``-wal`` beside it, twice the store at most (all of a small store's
        rebuild stays in it, with every page's rewrites: 3.4 MB beside a store of 2.3 MB) and
        :data:`WAL_ROOM` at the most. Measured: 12 days of minute points, a store of 2.3 MB,
        went through with 5.8 MB free and not 5.2 MB; 60 days, a store of 5.9 MB, with 12.0 MB
        and not 10.1 MB."""
        used = bytes_in_use(self.near)
        return used + min(2 * used, WAL_ROOM)


@contextlib.contextmanager
def _scratch(near: Path, elsewhere: Path | None = None) -> Iterator[tuple[Path, _Room]]:
    """A scratch store in a directory of its own next to ``near`` (or in ``elsewhere``, for a
    verify of a directory that cannot be written: CLI-114), locked while in use, with the
    :class:`_Room` its rebuild keeps; what killed rebuilds left there is removed first. A
    :class:`RebuildError` saying so where the file system is mounted read-only."""
    parent = near.parent if elsewhere is None else elsewhere
    if elsewhere is None:
        remove_stale_scratch(parent)
    room = _Room(near, free_bytes(parent))
    try:
        scratch = tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=parent)
    except OSError as exc:
        read_only = mounted_read_only(parent)
        if read_only is None:
            raise
        # Not the scratch directory's own name, which the user never made (STORE-76).
        raise RebuildError(
            f"{read_only}: `verify` and `reindex` rebuild into a second store beside"
            f" {near.name}, which cannot be written there (nothing was changed)"
        ) from exc
    with (
        scratch as tmp,
        open(Path(tmp) / f"{SCRATCH_OWNER}.new", "wb") as owner,
    ):
        give_to_directory_owner(owner.fileno(), parent)
        # Locked before it takes its name, so that no rebuild ever finds it unlocked.
        fcntl.flock(owner, fcntl.LOCK_EX)
        os.replace(Path(tmp) / f"{SCRATCH_OWNER}.new", Path(tmp) / SCRATCH_OWNER)
        # Given to the data directory's owner (CLI-108) only once its lock file is made in it:
        # given before, that owner could plant a link at the lock file's name, which root then
        # opened, truncated and gave to it (CLI-128).
        give_to_directory_owner(tmp, parent)
        faults.point("rebuild.scratch")
        try:
            yield Path(tmp) / SCRATCH_STORE, room
        except (StorageError, RebuildUnwritten) as exc:
            if isinstance(exc, Deferred) or (isinstance(exc, StorageError) and is_damage(exc)):
                raise
            no_room = _no_room(Path(tmp), room, exc)
            if no_room is None:
                raise
            raise no_room from exc


def _filled(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it was raised from is SQLite's ``database or disk is
    full`` or the system's ENOSPC, whatever room the disk has once it is reported."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, StorageError) and is_full(seen):
            return True
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _no_room(scratch: Path, room: _Room, exc: BaseException) -> RebuildError | None:
    """The error of a rebuild into ``scratch`` that failed for want of room (STORE-64): the
    disk full now, or a failure that says it filled (STORE-135); None otherwise. SQLite's own
    line named neither the file nor the cause (``database error: database or disk is full``,
    ``delivery 1 could not be rebuilt (unwritten)``), nor how much room the rebuild takes,
    where the line asked for the store's size, on which a one-process rebuild fails again: its
    ``-wal`` is on the disk beside the store it is copied into (:meth:`_Room.needed`)."""
    free = free_when_full(scratch)
    if free is None and not _filled(exc):
        return None
    try:
        needed = room.needed()
        size = room.near.stat().st_size
    except OSError:
        return None
    began = room.free if room.free is not None else free
    folded = f"{room.done:,} of {room.total:,} deliveries" if room.done else "no delivery"
    return RebuildError(
        f"the disk is full ({began:,} bytes free in {scratch.parent} as the rebuild began, full"
        f" with {folded} folded): a rebuild writes a second store beside {room.near.name}"
        f" ({size:,} bytes) until it is done, about {needed:,} bytes here; make that much room"
        " and run it again (nothing was changed)"
    )


def remove_stale_scratch(directory: Path) -> None:
    """Remove the scratch directories of rebuilds that were killed: their lock died with their
    process. One without a lock file is another's only for a moment after it is made. The next
    rebuild calls it, and so does a runtime as it opens (STORE-63): a scratch directory holds
    a second store, and with nobody reindexing it would take that room for good."""
    for scratch in directory.glob(f"{SCRATCH_PREFIX}*"):
        if not _in_use(scratch):
            shutil.rmtree(scratch, ignore_errors=True)
            log.info("removed %s, left by a rebuild that was stopped", scratch.name)


def _in_use(scratch: Path) -> bool:
    try:
        with open(scratch / SCRATCH_OWNER, "rb") as owner:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        try:
            return time.time() - scratch.stat().st_mtime < UNLOCKED_STALE_S
        except OSError:
            return True
    except OSError:
        return True
    return False


def verify(
    journal: Journal,
    store: Store,
    *,
    progress: Progress | None = None,
    workers: int | None = None,
) -> list[Difference]:
    """Objects that differ between the live store and a rebuild of what it has folded: in
    content (hash), in whether a seal covers them, in a live row damaged behind an intact
    hash (a body that does not decompress to the rebuilt bytes, or units or a point count that
    are not the rebuild's), or in the creating delivery alone (its provenance)."""
    return verify_all(journal, store, progress=progress, workers=workers).objects


def verify_all(
    journal: Journal,
    store: Store,
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    elsewhere: Path | None = None,
) -> Verification:
    """:func:`verify`'s objects, and the folded deliveries whose recorded status or reason a
    rebuild records otherwise (their counters are not compared: they depend on what was
    stored when each was folded, which a backfill changes).

    The live summaries are copied into a file beside the rebuild and compared with it in
    SQLite, a row at a time: held in memory, those of 2.5 years (439,008 objects) took 674 MB
    of a NAS's memory, twice over.

    With ``elsewhere`` (a directory of ``store`` that cannot be written: read-only media, a
    backup user's), the rebuild goes into a scratch directory there, in one process: fold
    workers open the journal to write."""
    with _scratch(Path(store.path), elsewhere) as (path, room):
        live = path.with_name(LIVE_SUMMARIES)
        folded, given_up = store.snapshot_into(live)
        rebuild_into(
            journal,
            path,
            only=folded,
            progress=room.tracking(progress),
            workers=workers if elsewhere is None else 1,
            reference=Path(store.path),
            given_up=given_up,
        )
        objects = list(_differences(path, live, store))
        outcomes = list(_outcome_differences(path, live))
        lost = store.bodies_lost(path)
    return Verification(objects, outcomes, lost)


def _outcome_differences(rebuilt: Path, live: Path) -> Iterator[OutcomeDifference]:
    """The folded deliveries whose status or reason in the live outcomes copied at ``live``
    is not the rebuilt store's, by id, compared in SQLite a row at a time (STORE-83): held in
    two dicts, those of 100,000 deliveries took 39 MB."""
    conn = connect(rebuilt, readonly=True)
    try:
        conn.execute("ATTACH DATABASE ? AS live", (live.resolve().as_uri() + "?mode=ro",))
        with read_transaction(conn):
            for delivery_id, recorded, rebuilt_status in conn.execute(_OUTCOME_DIFFERENCES):
                yield OutcomeDifference(delivery_id, recorded, rebuilt_status)
    finally:
        conn.close()


def _differences(rebuilt: Path, live: Path, store: Store) -> Iterator[Difference]:
    """The objects that differ between the live summaries at ``live`` and the rebuilt store,
    sorted by key: by hash or seal, or, where those agree, by a row damaged behind the hash:
    units or a point count that are not the rebuild's, or a body in the live store (as it is
    now) that does not hold the rebuilt object's bytes; else by a creating delivery that is
    not the rebuild's (its provenance, which a backfill folded late changes). An object that
    changed since the summaries were copied is not what the rebuild stands for, and its body
    is passed over; a body equal to the rebuilt one (taken from the live store) is not
    decompressed."""
    conn = connect(rebuilt, readonly=True)
    try:
        conn.execute("ATTACH DATABASE ? AS live", (live.resolve().as_uri() + "?mode=ro",))
        conn.execute("ATTACH DATABASE ? AS store", (store.reading_uri(),))
        with read_transaction(conn):
            for (
                metric,
                layer,
                hour,
                live_hash,
                fresh_hash,
                agree,
                columns,
                provenance,
                now,
                fresh,
            ) in conn.execute(_DIFFERENCES):
                key = ObjectKey(metric, layer, hour)
                if not agree:
                    yield Difference(key, live_hash, fresh_hash)
                elif columns or (
                    now is not None and not objects.holds(now, objects.decompress(fresh))
                ):
                    yield Difference(key, live_hash, fresh_hash, corrupt=True)
                elif provenance:
                    yield Difference(key, live_hash, fresh_hash, provenance=True)
    finally:
        conn.close()


def _take_over(store: Store, holder: str, waiting: Callable[[float], None] | None) -> int:
    """The lease, taken by force at the next epoch from anyone but a running reindex."""
    began = time.monotonic()
    while True:
        try:
            epoch = store.acquire_lease(
                holder,
                now=clock.now_us(),
                ttl=LEASE_TTL_US,
                force=True,
                brief=waiting is not None,
                spare=running_reindex,
            )
        except Deferred:
            if waiting is None:
                raise
            waiting(time.monotonic() - began)
            continue
        if epoch is not None:
            return epoch
        lease = store.lease()
        # Released or run out since (it swapped in, or was killed): try again.
        if (
            lease.holder is not None
            and lease.expires_at > clock.now_us()
            and running_reindex(lease.holder, Path(store.path).parent)
        ):
            raise ReindexRunning(lease.holder, lease.expires_at)


def reindex(
    journal: Journal,
    store: Store,
    holder: str,
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    waiting: Callable[[float], None] | None = None,
) -> int:
    """Rebuild the projection from the whole journal and swap it in; returns objects changed.

    The lease is taken at a higher epoch (fencing the live folder) and renewed as the rebuild
    reports progress (at least once a second while worker processes fold), so a reindex
    killed on the way fences the folder for one TTL at most. Another reindex still running
    keeps it: :class:`ReindexRunning`.

    With ``waiting``, a store another process writes (the service's fold of a large delivery
    holds the write lock for as long as it folds) is waited for: ``waiting`` is called with
    the seconds waited so far every ``BRIEF_WAIT_MS`` (to say so, or to stop). Without it, the
    busy timeout's :class:`Deferred` is raised.
    """
    epoch = _take_over(store, holder, waiting)
    renewed = time.monotonic()

    def renewing(done: int, total: int) -> None:
        nonlocal renewed
        if time.monotonic() - renewed > LEASE_RENEW_S:
            if store.acquire_lease(holder, now=clock.now_us(), ttl=LEASE_TTL_US) != epoch:
                raise RebuildError(f"the fold lease was lost during the reindex (epoch {epoch})")
            renewed = time.monotonic()
        if progress is not None:
            progress(done, total)

    try:
        with _scratch(Path(store.path)) as (path, room):
            rebuild_into(
                journal,
                path,
                progress=room.tracking(renewing),
                workers=workers,
                reference=Path(store.path),
            )
            lost = store.bodies_lost(path)
            if lost:
                raise RebuildError(
                    f"{os.path.basename(journal.path)} no longer holds the bodies of"
                    f" {len(lost)} deliveries that {os.path.basename(store.path)} folded"
                    f" (delivery {', '.join(map(str, lost[:5]))}{', ...' if len(lost) > 5 else ''}:"
                    " they do not match their sha256), and a reindex would drop their points"
                    " from it; nothing was changed. Restore the journal from a backup taken with"
                    " `sqlite3 .backup`, a filesystem snapshot, or with healthlog stopped"
                )
            changed = store.swap_in(path, epoch)
    finally:
        store.release_lease(holder, epoch)
    log.info("reindex swapped in at epoch %d, %d objects changed", epoch, changed)
    return changed
