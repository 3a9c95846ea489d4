"""The partitioned rebuild: disjoint sets of metrics folded side by side in worker processes.

An hourly object depends only on the points of its own metric (or record section) in journal
order, so a rebuild can fold disjoint sets of those *units* in separate processes, each into
a scratch file of its own, and gather the files into the rebuild target at the end.

This process reads every body once, in journal order, and decides what the fold decides for
a delivery as a whole: its layer (P5: the header, else the spacing of all its metrics, else
the layer of its automation's predecessor in journal order) and whether it can be folded at
all. It then cuts the envelope into one share per partition, holding only that partition's
units (their arrays still raw JSON), and hands the shares to the partition's worker, which
folds them with the live fold's code under that layer. A unit belongs to the partition that
first meets it, the one with the least work so far once every worker has one. A seal (S9) is
folded by the target in its place; each share carries the seals that came before it (the
latest of each metric and layer, which cover all the others do), so that a worker counts sealed
writes as the live fold does, and the objects gathered at the end are marked as the seals cover
them.

The spacing of a delivery without a header costs a reading of every timestamp, which the
workers do anyway. So this process assumes such a delivery has the layer its automation's
last delivery had (an automation keeps its grouping), reads the spacing only of the first, and
has the workers report the spacing of what they fold. Once all is folded, the layers are
worked out again in journal order from the reported spacings; if any differs from the one
assumed, everything is folded once more under the layers now known.

A scratch file keeps its objects' bodies plain while the partition folds, since every
delivery that touches an object rewrites it; once all is folded, the workers compress each
object once, or, where the live store holds the same bytes, take the live body as it is.

A delivery's counters are the sum over its partitions plus what its envelope says. One with
nothing rejected is ``parsed`` without a reason; the status and reason of any other come
from folding its whole body once more, in a worker, against an empty projection, since they
depend on the body alone. A delivery that cannot be folded (a corrupt or undecodable body,
no derivable layer) writes no object: the target folds it itself, in its place in journal
order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Set
from pathlib import Path

import attrs

from healthlog import hae, layers, objects
from healthlog.fold import PARSED, DeliveryFold, DeliveryInfo, Outcome, Unstored
from healthlog.merge import Counters
from healthlog.objects import HourlyObject, ObjectKey
from healthlog.orphans import exit_when_orphaned
from healthlog.seals import Seal, SealError, covered, folded_into, is_seal
from healthlog.seals import decode as decode_seal
from healthlog.storage import _objects
from healthlog.storage._sqlite import (
    StorageError,
    classify,
    connect,
    give_to_directory_owner,
    write_transaction,
)
from healthlog.storage.journal import CorruptBody, DeliveryMeta, Journal
from healthlog.storage.passes import Progress
from healthlog.storage.store import SCRATCH_MIGRATIONS, Store, automation_of

log = logging.getLogger("healthlog.partition")

# (is a record section, name): a metric and a section of the same name are different units.
Unit = tuple[bool, str]
# (delivery id, counters, smallest spacing of the share's metrics when measured)
Folded = list[tuple[int, Counters, int | None]]

# Sub-bodies read ahead of the workers, at most (or one larger delivery): the memory this
# process holds for them.
AHEAD_BYTES = 32 * 2**20
# Shares read ahead of the workers, at most, however small (STORE-82): a share of a small
# delivery takes a few times its bytes in memory, and 32 MiB of them were every delivery.
AHEAD_SHARES = 1024
# A task takes what waits for its partition up to this many bytes (at least one delivery),
# so that progress moves and a stopped rebuild waits for little.
TASK_BYTES = 4 * 2**20
# How often this process wakes while it waits for workers: progress, and the lease renewal.
POLL_S = 1.0

# Judgements (see :func:`judge`) running or waiting in the pool at a time, at most.
JUDGING = 256

_ENVELOPE_COUNTERS = ("metrics", "sections", "unknown_sections", "entries_rejected")
_SUMMED_COUNTERS = tuple(
    field.name for field in attrs.fields(Counters) if field.name not in _ENVELOPE_COUNTERS
)
_COUNTERS = (*_ENVELOPE_COUNTERS, *_SUMMED_COUNTERS)
_POINTS_REJECTED = _COUNTERS.index("points_rejected")
_ENTRIES = _COUNTERS.index("entries_rejected")
_ZERO = array("q", [0])
# A layer as kept per delivery: its index here (every layer the fold infers, or None).
_LAYERS: tuple[str | None, ...] = (None, *layers.LAYERS)
_LAYER_CODE = {layer: code for code, layer in enumerate(_LAYERS)}


class Queue:
    """The deliveries a rebuild folds, in journal order: those journaled when it starts (ids
    up to the journal's last id then, STORE-80), or of those the ones in ``only``. Read from the
    journal ``page`` at a time each time it is iterated, so that only a page of their metadata
    is held (837 bytes a delivery with the phone's headers). Their number (``len``) and bytes
    are the journal's count, or with ``only`` those of a first reading."""

    def __init__(self, journal: Journal, *, only: Set[int] | None, page: int) -> None:
        if page < 1:
            raise ValueError("a page holds at least one delivery")
        self.page = page
        self._journal = journal
        self._only = only
        self._through, self._count, self.bytes = journal.last_and_count()
        if only is not None:
            self._count, self.bytes = 0, 0
            for meta in self:
                self._count += 1
                self.bytes += meta.bytes

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[DeliveryMeta]:
        after: tuple[int, int] | None = None
        while True:
            read = self._journal.iter_order(after=after, limit=self.page, through=self._through)
            for meta in read:
                if self._only is None or meta.id in self._only:
                    yield meta
            if len(read) < self.page:
                return
            after = (read[-1].received_at, read[-1].id)


class PartitionFailed(Exception):
    """A partition's fold broke with an error that is not a storage error."""


@attrs.frozen
class Planned:
    """What a worker needs to fold its share of one delivery; ``measure`` when the layer is
    assumed and the spacing of the share is to be reported."""

    delivery_id: int
    received_at: int
    layer: str | None
    measure: bool = False
    seals: tuple[Seal, ...] = ()


def fold_chunk(scratch_path: str, chunk: list[tuple[Planned, hae.Envelope]]) -> Folded:
    """Fold shares of deliveries in order into a partition's scratch file, in a worker process;
    each plan carries the seals folded before its delivery."""
    with _Scratch(scratch_path, durable=False) as scratch:
        try:
            return scratch.fold(chunk)
        except StorageError:
            raise
        except Exception as exc:
            raise PartitionFailed(type(exc).__name__) from exc


def settle(scratch_path: str, reference: str | None) -> None:
    """Compress the objects of a partition's scratch file, in a worker process, once all is
    folded (they are kept plain while folding). An object that the ``reference`` store (the
    live projection) holds with the same content keeps the reference's body instead: after a
    rebuild most objects are unchanged, and compressing them again was about a fifth of the
    rebuild's work."""
    with _Scratch(scratch_path, durable=False) as scratch:
        try:
            scratch.settle(reference)
        except sqlite3.Error as exc:
            raise classify(exc) from exc


def judge(journal_path: str, plan: Planned) -> tuple[str, str | None]:
    """Status and reason of a delivery, from its whole body against an empty projection."""
    with Journal(journal_path) as journal:
        fold = DeliveryFold(
            journal.read_body(plan.delivery_id),
            DeliveryInfo(plan.delivery_id, plan.received_at, plan.layer),
            Unstored(plan.layer),
            warn=False,
        )
        try:
            for _ in fold.writes():
                pass
        except Exception as exc:
            raise PartitionFailed(type(exc).__name__) from exc
    assert fold.outcome is not None
    return fold.outcome.status, fold.outcome.reason


class _Scratch(_objects.ObjectDatabase):
    """A partition's scratch file: the store's schema but ``objects_unsealed`` (SEAL-31), of
    which only ``objects`` is used.

    Its objects' bodies stay plain until :func:`settle`; they are rewritten with every delivery
    that touches them, so the file has large pages and no journal (a rebuild that fails throws
    its scratch files away).
    """

    MIGRATIONS = SCRATCH_MIGRATIONS
    PAGE_SIZE = 64 * 2**10
    JOURNAL_MODE = "OFF"

    def fold(self, chunk: list[tuple[Planned, hae.Envelope]]) -> Folded:
        folded = []
        with self._lock, write_transaction(self._conn):
            for plan, share in chunk:
                fold = DeliveryFold(
                    share,
                    DeliveryInfo(plan.delivery_id, plan.received_at, plan.layer),
                    _ScratchProjection(self._conn, plan.layer, plan.seals),
                    warn=False,
                    measure=plan.measure,
                    plain=True,
                )
                for written in fold.writes():
                    _objects.write(self._conn, written)
                assert fold.outcome is not None
                folded.append((plan.delivery_id, fold.outcome.counters, fold.spacing))
        return folded

    def settle(self, reference: str | None) -> None:
        live = None if reference is None else connect(reference, readonly=True)
        try:
            with self._lock, write_transaction(self._conn):
                for metric, layer, hour, digest in self._keys():
                    where = (metric, layer, hour)
                    (plain,) = self._conn.execute(
                        f"SELECT body FROM objects {_AT}", where
                    ).fetchone()
                    same = None
                    if live is not None:
                        same = live.execute(
                            f"SELECT body FROM objects {_AT} AND hash = ?", (*where, digest)
                        ).fetchone()
                    body = same[0] if same and objects.holds(same[0], plain) else None
                    self._conn.execute(
                        f"UPDATE objects SET body = ? {_AT}",
                        (objects.compress(plain) if body is None else body, *where),
                    )
        finally:
            if live is not None:
                live.close()

    def _keys(self) -> Iterator[tuple[str, str, int, bytes]]:
        """The key and hash of every object, read :data:`_objects.PAGE` at a time in key order:
        read all at once, they were held until all were settled, 6.1 MB for 20,000 objects
        (STORE-146)."""
        last: tuple[str, str, int] | None = None
        while True:
            after = "" if last is None else "WHERE (metric, layer, hour) > (?, ?, ?)"
            page = self._conn.execute(
                f"SELECT metric, layer, hour, hash FROM objects {after}"
                f" ORDER BY metric, layer, hour LIMIT {_objects.PAGE}",
                () if last is None else last,
            ).fetchall()
            if not page:
                return
            yield from page
            metric, layer, hour, _ = page[-1]
            last = (metric, layer, hour)


_AT = "WHERE metric = ? AND layer = ? AND hour = ?"


class _ScratchProjection:
    """Objects as the partition has folded them so far; the layer is always the header."""

    def __init__(
        self, conn: sqlite3.Connection, layer: str | None, seals: tuple[Seal, ...]
    ) -> None:
        self._conn = conn
        self._layer = layer
        self._seals = seals

    def load(self, key: ObjectKey) -> HourlyObject | None:
        return _objects.load(self._conn, key)

    def inherited_layer(self) -> str | None:
        return self._layer

    def sealed(self, key: ObjectKey) -> bool:
        return covered(self._seals, key)


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _context() -> multiprocessing.context.BaseContext:
    """Fork on Linux: a worker needs nothing of this process but the code, and a spawned one
    would import the command line's whole program first (half a second each). The executor
    starts every worker before its own thread; a worker opens only files of its own, never
    touches the connections it inherits, and ends with ``os._exit``, which closes none."""
    return multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")


def _worker_started(parent: int) -> None:
    """In each worker process: SIGINT, SIGTERM and SIGHUP are left to the rebuilding process
    (a terminal's Ctrl-C or hangup, or a service manager's stop, reaches the whole group; the
    rebuilding process stops at its next report and shuts the pool down, where a worker dying
    at once would break the pool and turn the stop into a failure), and the worker exits once
    ``parent`` is gone (a rebuild killed with SIGKILL would otherwise leave it waiting
    forever)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    exit_when_orphaned(parent)


def rebuild(
    journal: Journal,
    queue: Queue,
    target: Store,
    epoch: int,
    *,
    workers: int,
    fold_alone: Callable[[DeliveryMeta], None],
    alone: frozenset[int] = frozenset(),
    progress: Progress | None,
    reference: str | None,
) -> None:
    """Fold ``queue`` into the empty store ``target`` under ``epoch`` with ``workers`` processes;
    objects the store at ``reference`` holds with the same content take its bodies (see
    :func:`settle`).

    ``fold_alone`` folds a delivery that writes no object into the target, in its place, and
    every delivery in ``alone``, which is not read here.
    Raises :class:`PartitionFailed` when a partition's fold broke (the caller rebuilds in one
    process, where the live fold's handling of a broken delivery applies), and
    :class:`StorageError` when the journal could not be read or a scratch file written.
    """
    reported = 0

    def onwards(done: int, total: int) -> None:
        """Progress that never goes back, over a second pass too."""
        nonlocal reported
        reported = max(reported, done)
        if progress is not None:
            progress(reported, total)

    with (
        tempfile.TemporaryDirectory(prefix=".partitions-", dir=Path(target.path).parent) as tmp,
        concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=_context(), initializer=_worker_started, initargs=(os.getpid(),)
        ) as pool,
    ):
        give_to_directory_owner(tmp, Path(target.path).parent)
        try:
            run = _Run(
                pool,
                Path(tmp) / "assumed",
                workers,
                len(queue),
                onwards,
                alone,
                known=None,
                reference=reference,
            )
            run.fold(journal, queue)
            known = run.misassumed()
            if known is not None:
                log.debug("layers were not those assumed; folding again under the known layers")
                run.settled_all()
                shutil.rmtree(Path(tmp) / "assumed")
                run = _Run(
                    pool,
                    Path(tmp) / "known",
                    workers,
                    len(queue),
                    onwards,
                    alone,
                    known=known,
                    reference=reference,
                )
                run.fold(journal, queue)
            run.judge(journal.path, queue)
            # The partitions settle meanwhile (STORE-42): the outcomes are recorded, a page at
            # a time, and each partition's objects gathered as soon as it is settled.
            batch: list[tuple[DeliveryMeta, Outcome]] = []
            for position, meta in enumerate(queue):
                outcome = run.outcome(position)
                if outcome is not None:
                    batch.append((meta, outcome))
                if outcome is None or len(batch) == queue.page:
                    target.record_outcomes(batch, epoch)
                    batch = []
                if outcome is None:
                    fold_alone(meta)
            target.record_outcomes(batch, epoch)
            for part in run.settled():
                target.absorb_objects(part.scratch, epoch)
        finally:
            pool.shutdown(cancel_futures=True)
        target.seal_covered(epoch)
    if progress is not None:
        progress(len(queue), len(queue))


@attrs.define(eq=False)
class _Part:
    """One partition: its scratch file, the shares waiting for it, its running task."""

    scratch: Path
    load: int = 0
    waiting: list[tuple[Planned, hae.Envelope, int]] = attrs.Factory(list)
    waiting_bytes: int = 0
    running: concurrent.futures.Future[Folded] | None = None
    # Queue positions of the deliveries handed to it and not folded yet, oldest first.
    positions: deque[int] = attrs.Factory(deque)


class _Run:
    """Reads the journal in order and keeps the partitions' workers busy.

    With ``known`` layers (by queue position) it folds under those; without, it assumes them
    as the module says, and :meth:`misassumed` tells whether it was right.

    What it keeps of a delivery until the outcomes are recorded is kept by its position in
    the queue, in arrays (STORE-81): its layer, its counters, the spacing the workers measured,
    its status and reason when judged; and, for one with points, what decides its layer (P5).
    """

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        tmp: Path,
        workers: int,
        total: int,
        progress: Progress,
        alone: frozenset[int],
        *,
        known: array[int] | None,
        reference: str | None,
    ) -> None:
        tmp.mkdir()
        give_to_directory_owner(tmp, tmp.parent)
        self._reference = reference
        # Partitions whose every share is folded, settling (see :func:`settle`).
        self._settling: dict[concurrent.futures.Future[None], _Part] = {}
        self._pool = pool
        self._tmp = tmp
        self._workers = workers
        self._total = total
        self._progress = progress
        self._known = known
        self._read = 0
        self._last: dict[str | None, str] = {}
        self._automations: dict[str | None, int] = {None: 0}
        # Per delivery with points, in journal order: its position, the codes of the layer
        # used and of its header's, its automation's number, its spacing (0: none, or
        # measured by the workers) and whether the workers measure it.
        self._layering = array("q")
        # Per position: 0 for a delivery the target folds alone, else 1 + its layer's code.
        self._layers = array("B", bytes(total))
        self._counters = _ZERO * (total * len(_COUNTERS))
        self._spacings = _ZERO * total
        # Per position: 0, or 1 + the index of its judged status and reason in ``_verdicts``.
        self._judged = array("I", bytes(4 * total))
        self._verdicts: dict[tuple[str, str | None], int] = {}
        self._reasons: list[tuple[str, str | None]] = []
        self._seals: tuple[Seal, ...] = ()
        self._owner: dict[Unit, _Part] = {}
        self.parts: list[_Part] = []
        self._alone = alone

    def fold(self, journal: Journal, queue: Queue) -> None:
        """Read and hand out every delivery of ``queue``, and wait until all is folded."""
        for position, meta in enumerate(queue):
            self.read(journal, meta, position)
        self.finish()

    def read(self, journal: Journal, meta: DeliveryMeta, position: int) -> None:
        """Decide a delivery's layer and hand its shares to the partitions."""
        self._read = position + 1
        if meta.id in self._alone:
            return
        if is_seal(meta.client, meta.content_type):
            # One that cannot be read fails in the target, as it does live, and seals nothing.
            with contextlib.suppress(CorruptBody, SealError):
                self._seals = folded_into(self._seals, decode_seal(journal.read_body(meta.id)))
            return
        try:
            envelope = hae.read_envelope(journal.read_body(meta.id))
        except (CorruptBody, hae.EnvelopeError):
            return
        has_points = any(group.points for group in envelope.metrics.values())
        layer, measure = self._layer(meta, envelope, position) if has_points else (None, False)
        if has_points and layer is None and any(map(_readable, envelope.metrics.values())):
            # It fails for want of a layer and writes nothing: the target folds it in its place.
            # One whose every metric element is rejected needs no layer (P5): its shares fold
            # as a delivery without points does, its sections written by the partitions.
            return
        self._layers[position] = 1 + _LAYER_CODE[layer]
        at = position * len(_COUNTERS)
        self._counters[at : at + len(_ENVELOPE_COUNTERS)] = array(
            "q",
            (
                len(envelope.metrics),
                len(envelope.sections),
                envelope.unknown_sections,
                envelope.rejected_entries,
            ),
        )
        plan = Planned(meta.id, meta.received_at, layer, measure, self._seals)
        for part, (share, size) in self._cut(envelope).items():
            part.waiting.append((plan, share, size))
            part.waiting_bytes += size
            part.positions.append(position)
        self._pump()

    def _layer(
        self, meta: DeliveryMeta, envelope: hae.Envelope, position: int
    ) -> tuple[str | None, bool]:
        """The layer to fold under, and whether it is assumed (the workers then measure).

        A delivery whose metrics hold a point each at most has no spacing: its layer is
        inherited (from the layer used for its predecessor, which the check confirms)."""
        if self._known is not None:
            return _LAYERS[self._known[position]], False
        automation = automation_of(meta)
        header = layers.layer_from_header(meta.automation_aggregation)
        last = self._last.get(automation)
        spacing = None
        measured = False
        layer: str | None
        if header is not None:
            layer = header
        elif all(group.points < 2 for group in envelope.metrics.values()):
            layer = last if automation is not None else None
        elif last is not None:
            layer, measured = last, True
        else:
            spacing = min(filter(None, map(_spacing, envelope.metrics.values())), default=None)
            layer = layers.layer_from_spacing(spacing)
        number = self._automations.setdefault(automation, len(self._automations))
        self._layering.extend(
            (
                position,
                _LAYER_CODE[layer],
                _LAYER_CODE[header],
                number,
                spacing or 0,
                measured,
            )
        )
        if layer is not None:
            self._last[automation] = layer
        return layer, measured

    def misassumed(self) -> array[int] | None:
        """None when every layer used is the one P5 gives in journal order, with the spacings
        the workers measured; otherwise the codes of the layers P5 gives, by queue position."""
        inherited: dict[int, str] = {}
        layers_now = array("B", bytes(self._total))
        wrong = False
        steps = self._layering
        for at in range(0, len(steps), 6):
            position, used, header, automation, spacing, measured = steps[at : at + 6]
            if measured:
                spacing = self._spacings[position]
            layer = _LAYERS[header] or layers.layer_from_spacing(spacing or None)
            if layer is None and automation:
                layer = inherited.get(automation)
            if layer is not None and automation:
                inherited[automation] = layer
            layers_now[position] = _LAYER_CODE[layer]
            wrong = wrong or layer != _LAYERS[used]
        return layers_now if wrong else None

    def _cut(self, envelope: hae.Envelope) -> dict[_Part, tuple[hae.Envelope, int]]:
        """One share of the envelope per partition the delivery touches, with its size in
        bytes. The partition of its first metric with points also takes the metrics without
        any: they write nothing, but their units still count (``unit_mismatches``). A share
        holds copies of its arrays, not slices of the body, so that its size is what it keeps
        in memory while it waits: a partition that lags behind held a whole body per share
        (STORE-145)."""
        weights: dict[Unit, int] = {}
        for name, group in envelope.metrics.items():
            if group.points:
                weights[(False, name)] = sum(map(len, group.arrays))
        for name, arrays in envelope.sections.items():
            weights[(True, name)] = sum(map(len, arrays))
        for unit in sorted(weights, key=lambda u: (-weights[u], u)):
            owner = self._owner.get(unit)
            if owner is None:
                owner = self._owner[unit] = self._lightest()
            owner.load += weights[unit]
        first = min(weights, default=None)
        host = self._owner[first] if first is not None and not first[0] else None
        shares: dict[_Part, tuple[hae.Envelope, int]] = {}
        for name, group in envelope.metrics.items():
            part = self._owner[(False, name)] if group.points else host
            if part is not None:
                share, size = shares.setdefault(part, (hae.Envelope(), 0))
                share.metrics[name] = attrs.evolve(group, arrays=hae.detached(group.arrays))
                shares[part] = share, size + weights.get((False, name), 0)
        for name, arrays in envelope.sections.items():
            part = self._owner[(True, name)]
            share, size = shares.setdefault(part, (hae.Envelope(), 0))
            share.sections[name] = hae.detached(arrays)
            shares[part] = share, size + weights[(True, name)]
        return shares

    def _lightest(self) -> _Part:
        if len(self.parts) < self._workers:
            self.parts.append(_Part(self._tmp / f"part-{len(self.parts)}.sqlite"))
            return self.parts[-1]
        return min(self.parts, key=lambda part: part.load)

    def finish(self) -> None:
        """Wait until every share handed out is folded; once all are read, a partition whose
        every share is folded starts settling at once, while the others still fold."""
        self._pump()
        self._settle_idle()
        while any(part.running is not None for part in self.parts):
            self._wait()
            self._pump()
            self._settle_idle()

    def _settle_idle(self) -> None:
        settling = set(self._settling.values())
        for part in self.parts:
            if part.running is None and not part.waiting and part not in settling:
                future = self._pool.submit(settle, os.fspath(part.scratch), self._reference)
                self._settling[future] = part

    def _pump(self) -> None:
        """Start a task for each idle partition with anything waiting; hold reading back while
        too much waits (in bytes or in shares)."""
        while True:
            self._reap(
                [part for part in self.parts if part.running is not None and part.running.done()]
            )
            for part in self.parts:
                if part.running is None and part.waiting:
                    self._start(part)
            if (
                sum(part.waiting_bytes for part in self.parts) <= AHEAD_BYTES
                and sum(len(part.waiting) for part in self.parts) <= AHEAD_SHARES
            ):
                break
            self._wait()
        self._report()

    def _start(self, part: _Part) -> None:
        taken, size = 0, 0
        while taken < len(part.waiting) and (not taken or size < TASK_BYTES):
            size += part.waiting[taken][2]
            taken += 1
        chunk = [(plan, share) for plan, share, _ in part.waiting[:taken]]
        part.waiting = part.waiting[taken:]
        part.waiting_bytes -= size
        part.running = self._pool.submit(fold_chunk, os.fspath(part.scratch), chunk)

    def _wait(self) -> None:
        running = {part.running: part for part in self.parts if part.running is not None}
        done, _ = concurrent.futures.wait(running, POLL_S, concurrent.futures.FIRST_COMPLETED)
        self._reap(running[future] for future in done)
        self._report()

    def _reap(self, parts: Iterable[_Part]) -> None:
        """Take the results of the partitions' finished tasks, leaving them idle."""
        for part in parts:
            assert part.running is not None
            for _, counters, spacing in part.running.result():
                position = part.positions.popleft()
                at = position * len(_COUNTERS) + len(_ENVELOPE_COUNTERS)
                for offset, name in enumerate(_SUMMED_COUNTERS, start=at):
                    self._counters[offset] += getattr(counters, name)
                if spacing is not None:
                    measured = self._spacings[position]
                    self._spacings[position] = min(spacing, measured) if measured else spacing
            part.running = None

    def _report(self) -> None:
        oldest = [part.positions[0] for part in self.parts if part.positions]
        self._progress(min(oldest, default=self._read), self._total)

    def settled(self) -> Iterator[_Part]:
        """Every partition, each once it is settled, in the order they finish."""
        pending = set(self._settling)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, POLL_S, concurrent.futures.FIRST_COMPLETED
            )
            self._report()
            for future in done:
                future.result()
                yield self._settling[future]

    def settled_all(self) -> None:
        """Wait until no partition settles any more (their files are then thrown away)."""
        for _ in self.settled():
            pass

    def judge(self, journal_path: str, queue: Queue) -> None:
        """Have the workers judge the status and reason of the deliveries the partitions folded
        with something rejected, at most :data:`JUDGING` at a time, in journal order."""
        if not any(map(self._rejected, range(self._total))):
            return
        judging: deque[tuple[int, concurrent.futures.Future[tuple[str, str | None]]]] = deque()
        for position, meta in enumerate(queue):
            code = self._layers[position]
            if self._rejected(position):
                plan = Planned(meta.id, meta.received_at, _LAYERS[code - 1])
                judging.append((position, self._pool.submit(judge, journal_path, plan)))
            if len(judging) == JUDGING:
                self._verdict(*judging.popleft())
        while judging:
            self._verdict(*judging.popleft())

    def _rejected(self, position: int) -> bool:
        """Whether the partitions folded the delivery at ``position`` with something rejected."""
        at = position * len(_COUNTERS)
        return bool(
            self._layers[position]
            and (self._counters[at + _POINTS_REJECTED] or self._counters[at + _ENTRIES])
        )

    def _verdict(
        self, position: int, future: concurrent.futures.Future[tuple[str, str | None]]
    ) -> None:
        while concurrent.futures.wait([future], POLL_S).not_done:
            self._report()
        verdict = future.result()
        if verdict not in self._verdicts:
            self._verdicts[verdict] = len(self._verdicts)
            self._reasons.append(verdict)
        self._judged[position] = self._verdicts[verdict] + 1

    def outcome(self, position: int) -> Outcome | None:
        """The outcome of the delivery at ``position`` when the partitions folded it, once
        :meth:`judge` is done; None for one the target folds alone."""
        code = self._layers[position]
        if not code:
            return None
        at = position * len(_COUNTERS)
        values = self._counters[at : at + len(_COUNTERS)]
        counters = Counters(**dict(zip(_COUNTERS, values, strict=True)))
        judged = self._judged[position]
        status, reason = (PARSED, None) if not judged else self._reasons[judged - 1]
        return Outcome(status, reason, _LAYERS[code - 1], counters)


def _readable(group: hae.MetricGroup) -> bool:
    """Whether any point of the metric can be read (only asked of a delivery without a
    layer, which the fold would fail unless none can)."""
    return hae.read_series(group.arrays, spacing=False).accepted > 0


def _spacing(group: hae.MetricGroup) -> int | None:
    """The metric's spacing, read as the fold reads it (only the first delivery of each
    automation is read here, so the reading need not be a cheaper one of its own)."""
    return hae.read_series(group.arrays, spacing=True).spacing
