"""A folding pass (F1 to F5, F7): pending deliveries folded one at a time in journal order,
read a page at a time.

The pass is synchronous; the folding actor runs it in a worker and decides when. It stops at
the first deferred delivery (never skipping it), moves past an unwritten one (its strictly
increasing cursor goes on, the next pass retries it), and stops at once when fenced.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection

import attrs

from healthlog import clock, faults
from healthlog.fold import BudgetExceeded
from healthlog.folding import FoldPass
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.journal import DeliveryMeta, Journal
from healthlog.storage.store import FoldedView, Store

log = logging.getLogger("healthlog.pass")

LAG_MARK = "lag"
FIRST_PASS_MARK = "first_pass_completed"

Progress = Callable[[int, int], None]


@attrs.frozen
class Budget:
    """The fold's own deadline (F5): a base plus a share per MiB of body, in CPU time of the
    thread that folds.

    The budget bounds what a delivery costs to fold. Counted in wall time, it also counted the
    time a process stood still: a service frozen mid-fold (SIGSTOP, ``docker pause``, a cgroup
    freezer) for longer than the budget recorded a good delivery ``failed`` when it resumed,
    its points unstored until a reindex (FOLD-18).
    """

    base_s: float = 60.0
    per_mib_s: float = 1.0

    def checker(self, body_bytes: int) -> Callable[[], None]:
        """The check of a fold of ``body_bytes`` raw bytes, for the thread that calls this and
        then folds."""
        deadline = time.thread_time() + self.base_s + self.per_mib_s * body_bytes / 2**20

        def check() -> None:
            if time.thread_time() > deadline:
                raise BudgetExceeded

        return check


PAGE = 1024
"""How many pending deliveries a pass reads and holds at a time (FOLD-15): about 1 MB of
metadata (837 bytes a delivery), where a pass holding its whole queue held 84 MB at 100,000."""


class Selection:
    """The deliveries a pass folds: those journaled and without an outcome when it starts,
    in journal order, read ``page`` at a time.

    The first :meth:`page` takes the store's snapshot, then the journal's last id: what the
    pass folds is fixed there. A delivery journaled later, even one whose historical
    ``received_at`` puts it among those still to be read (a backfill), has a greater id and is
    the next pass's (FOLD-16).

    Usually every delivery up to the checkpoint has its outcome (the same number and the same
    sum of ids on both sides), and only the journal past it is read: a pass then costs what is
    new, not the whole journal. Otherwise (one left unwritten, a backfill journaled behind the
    checkpoint, a checkpoint moved back) the whole journal is read, a page at a time.

    The journal is read after the store's snapshot, so a delivery it holds that the snapshot
    has no outcome for is pending.
    """

    def __init__(self, journal: Journal, store: Store, *, page: int = PAGE) -> None:
        if page < 1:
            raise ValueError("a page holds at least one delivery")
        self._journal = journal
        self._store = store
        self._size = page
        self._view: FoldedView | None = None
        self._through = 0
        self._after: tuple[int, int] | None = None
        self.more = True
        """Whether a delivery may follow the last page read."""

    def page(self) -> list[DeliveryMeta]:
        """The next at most ``page`` pending deliveries in journal order; after the last,
        :attr:`more` is False."""
        if self._view is None:
            faults.point("fold.select")
            view = self._store.folded_view(_agrees(self._journal))
            self._through = self._journal.last_id()
            self._view, self._after = view, view.after
        held: list[DeliveryMeta] = []
        while self.more and len(held) < self._size:
            wanted = self._size - len(held)
            read = self._journal.iter_order(after=self._after, limit=wanted, through=self._through)
            self.more = len(read) == wanted
            if read:
                self._after = (read[-1].received_at, read[-1].id)
            held.extend(meta for meta in read if meta.id not in self._view.folded)
        return held


def take_page(selection: Selection, folding: FoldPass[DeliveryMeta]) -> None:
    """Hand ``folding`` the next page of ``selection``; when it cannot be read, the pass ends
    ``selection_failed`` after one ERROR (F8)."""
    try:
        page = selection.page()
    except StorageError as exc:
        log.error("folding pass: selection failed: %s", describe(exc))
        folding.selection_failed()
    else:
        folding.add_page(page, more=selection.more)


def oldest_pending(journal: Journal, store: Store) -> tuple[int, int] | None:
    """Of the deliveries a :class:`Selection` would select, the ``(journaled_at, id)`` of the one
    journaled first (the first in journal order of those journaled at the same instant); None
    when none is pending. Found a row at a time, without building their metadata (STORE-71).

    Its wait is the lag (F7): how long a delivery has waited for the fold since it was
    journaled. A backfill takes its place in journal order by a historical ``received_at``
    (J3), so neither the head of the queue nor its ``received_at`` says that (CLI-95).
    """
    view = store.folded_view(_agrees(journal))
    return journal.oldest_waiting(view.folded, after=view.after)


def waited_s(oldest: tuple[int, int] | None, now: int) -> float:
    """How long the delivery journaled at ``oldest`` (``(journaled_at, id)``) has waited at
    ``now`` (µs), in seconds: 0 when nothing waits, or when it was journaled at a later stamp
    than ``now`` (JOURNAL-44)."""
    return max(0, now - oldest[0]) / 1e6 if oldest else 0.0


def check_before_folding(
    journal: Journal, store: Store, unchanged: Collection[str] = frozenset()
) -> None:
    """What is checked before anything folds into ``store`` or rebuilds it (``serve``,
    ``import``, ``seal``, ``reindex``, ``verify``): that neither file is damaged (a torn copy:
    JOURNAL-39, STORE-53), which reads every page of each, unless its name is in ``unchanged``
    (found whole and written by healthlog alone since: JOURNAL-50, STORE-140), and that the
    store was folded from this journal (:func:`check_same_journal`)."""
    for database in (journal, store):
        check_unless_unchanged(database, unchanged)
    check_same_journal(journal, store)


def check_unless_unchanged(database: Journal | Store, unchanged: Collection[str]) -> None:
    """Check ``database`` whole (JOURNAL-39, STORE-53) unless its name is in ``unchanged``
    (JOURNAL-50, STORE-140)."""
    name = os.path.basename(database.path)
    if name in unchanged:
        log.debug("%s: unchanged since it was last found whole, not read again", name)
    else:
        database.check_intact()


STORE_DAMAGED = "store_damaged"
STORE_FOLDED_ELSEWHERE = "store_folded_from_another_journal"
STORE_UNFIT = (STORE_DAMAGED, STORE_FOLDED_ELSEWHERE)
"""Why ``serve`` found its store unfit to fold into (STORE-142), as its status and
``healthlog status`` say why nothing folds (``lag.stopped_because``, SERVE-150)."""


class FoldedElsewhere(StorageError):
    """A store folded from another journal (:func:`check_same_journal`)."""


def check_same_journal(journal: Journal, store: Store) -> None:
    """Raise a :class:`StorageError` unless the delivery at the store's checkpoint is in
    ``journal``, at the same position.

    A store folded from another journal (the journal restored from an older backup, replaced or
    emptied) has outcomes under ids that this journal gives again: a new delivery would take the
    id of one the store has folded, count as folded and never be folded; and a ``reindex`` into
    it would keep the change events of those deliveries, whose ids the new deliveries' events
    collide with. A new store, folded from this journal, mends it."""
    received_at, delivery_id, _ = store.checkpoint()
    if delivery_id is None:
        return
    meta = journal.get_meta(delivery_id)
    if meta is not None and meta.received_at == received_at:
        return
    store_file, journal_file = os.path.basename(store.path), os.path.basename(journal.path)
    error = FoldedElsewhere(
        f"{store_file} was folded from another journal: {journal_file} lacks its delivery"
        f" {delivery_id} (a journal restored from an older backup, or emptied); move"
        f" {store_file} and its -wal and -shm files away, then `healthlog reindex` (or `serve`)"
        " folds this journal into a new store"
    )
    error.file = store_file
    raise error


@attrs.frozen
class Counted:
    """How many deliveries wait, the ``(journaled_at, id)`` of the one of them journaled first
    (:func:`oldest_pending`), the outcomes by status, and the journal's (number of deliveries,
    raw bytes), as :func:`counted` read them."""

    pending: int
    oldest: tuple[int, int] | None
    counts: dict[str, int]
    journal: tuple[int, int]


def counted(journal: Journal, store: Store) -> Counted:
    """What a :class:`Selection` would select, counted, with the outcomes by status from the same
    snapshot of the store (a delivery folded meanwhile is counted either as pending or by its
    status), and the journal's figures from the same read as the pending deliveries (a delivery
    journaled meanwhile is in both or in neither). Nothing of the waiting deliveries is kept
    but their number and the oldest one's stamp and id (STORE-70)."""
    view = store.folded_view(_agrees(journal), counts=True)
    waiting, oldest, figures = journal.waiting_and_count(view.folded, after=view.after)
    return Counted(waiting, oldest, view.counts, figures)


def _agrees(journal: Journal) -> Callable[[tuple[int, int], tuple[int, int]], bool]:
    """Whether the journal holds exactly ``through`` (number, sum of ids) deliveries at or
    before ``position``, as the store's outcomes do."""
    return lambda position, through: journal.span_through(position) == through


def run_pass(
    journal: Journal,
    store: Store,
    epoch: int,
    *,
    budget: Budget = Budget(),
    progress: Callable[[int], None] | None = None,
    now: Callable[[], int] = clock.now_us,
    page: int = PAGE,
) -> FoldPass[DeliveryMeta]:
    """Fold every pending delivery in journal order until the end, a deferral or a fence,
    reading them ``page`` at a time; ``progress`` is told after each delivery the pass moved
    past how many it has."""
    selection = Selection(journal, store, page=page)
    folding: FoldPass[DeliveryMeta] = FoldPass(more=True)
    while True:
        if folding.wants_page:
            take_page(selection, folding)
        if (meta := folding.next()) is None:
            break
        check = budget.checker(meta.bytes)
        folding.record(store.fold(journal, meta, epoch, check_budget=check))
        if progress is not None:
            progress(folding.position)
    write_marks(journal, store, folding, now)
    return folding


def write_marks(
    journal: Journal, store: Store, folding: FoldPass[DeliveryMeta], now: Callable[[], int]
) -> bool:
    """The lag mark at every pass end (F7), the first-pass flag only at the end of the queue.

    Whether the lag mark was written: on a full disk it is not (a WARNING says so), and the
    mark then says why an earlier pass stopped, not this one (STORE-66)."""
    if folding.stopped_because in ("fenced", "selection_failed"):
        return False
    written = False
    try:
        oldest = oldest_pending(journal, store)
        store.set_mark(
            LAG_MARK,
            {
                "oldest_pending_id": oldest[1] if oldest else None,
                "waited_s": waited_s(oldest, now()),
                "stopped_because": folding.stopped_because,
            },
        )
        written = True
        if folding.reached_end:
            store.set_mark(FIRST_PASS_MARK, True)
    except StorageError as exc:
        log.warning("folding pass: lag mark not written: %s", describe(exc))
    return written
