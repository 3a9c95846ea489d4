"""The folding pass as a state machine (F2 to F4, F7), with no I/O of its own.

Whoever drives a pass (the synchronous ``storage.passes.run_pass`` or the folding actor)
hands it the queue a page at a time (:meth:`FoldPass.add_page`), asks :meth:`FoldPass.next`
for the delivery to fold, folds it however it likes, and hands the :class:`FoldReport` to
:meth:`FoldPass.record`. The table below is the whole policy:

=============  ==================================  =======================
outcome class  meaning                             the pass
=============  ==================================  =======================
DONE           a status was written                moves on
UNWRITTEN      not even the outcome was written    moves on (retried next pass)
DEFERRED       database busy, external cancel      stops here, never skips
FENCED         the lease epoch changed             stops here
=============  ==================================  =======================
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import attrs


class OutcomeClass(enum.Enum):
    """What one fold attempt amounted to (F2)."""

    DONE = "done"
    DEFERRED = "deferred"
    UNWRITTEN = "unwritten"
    FENCED = "fenced"


@attrs.frozen
class FoldReport:
    """The result of one fold attempt."""

    delivery_id: int
    outcome_class: OutcomeClass
    status: str | None = None
    # The outcome's reason when DONE; when UNWRITTEN, why nothing could be written (SQLite's
    # error and the file, no value), for whoever waits for the delivery (CLI-200).
    reason: str | None = None
    out_of_order: bool = False
    # For each object the fold changed whose hour had ended when the delivery was received:
    # how long after, in seconds (S9: how late hours still change).
    late_s: tuple[float, ...] = ()


class Queued(Protocol):
    @property
    def id(self) -> int: ...


Q = TypeVar("Q", bound=Queued)

_STOPS = {OutcomeClass.DEFERRED: "deferred", OutcomeClass.FENCED: "fenced"}


class FoldPass(Generic[Q]):
    """One pass over the deliveries visible at selection, in journal order.

    The pass holds one page of its queue at a time, never the whole queue: a backlog of any
    length costs the memory of a page (FOLD-15). The driver hands it the first page and each
    next one when :attr:`wants_page` says so, with ``more`` False for the last; a complete
    queue is one page with ``more`` False.
    """

    def __init__(self, page: Sequence[Q] = (), *, more: bool = False) -> None:
        self._page = page
        self._more = more
        self._cursor = 0
        self._taken = 0
        self.folded = 0
        self.unwritten: list[int] = []
        self.stopped_because: str | None = None

    @property
    def position(self) -> int:
        """How many deliveries the pass has moved past (folded or left unwritten)."""
        return self._taken

    @property
    def wants_page(self) -> bool:
        """True when the page held is done and the selection has more: the driver must
        :meth:`add_page` (or :meth:`selection_failed`) before :meth:`next`."""
        return self.stopped_because is None and self._more and self._cursor >= len(self._page)

    def add_page(self, page: Sequence[Q], *, more: bool) -> None:
        """The next page of the queue, in journal order after the last; ``more`` False when
        no page follows it."""
        if not self.wants_page:
            raise ValueError("the pass wants no page now")
        self._page, self._more, self._cursor = page, more, 0

    def selection_failed(self) -> None:
        """A page could not be read: the pass ends here (F8)."""
        self.stopped_because = "selection_failed"

    def next(self) -> Q | None:
        """The delivery to fold now, or None once the pass has ended."""
        if self.wants_page:
            raise ValueError("the pass wants its next page first")
        if self.stopped_because is None and self._cursor >= len(self._page):
            self.stopped_because = "unwritten" if self.unwritten else "empty"
        if self.stopped_because is not None:
            return None
        return self._page[self._cursor]

    def upcoming(self, limit: int) -> Sequence[Q]:
        """The delivery :meth:`next` returned and those after it in the page held, at most
        ``limit`` in all."""
        return self._page[self._cursor : self._cursor + limit]

    def record(self, report: FoldReport) -> None:
        """Take the report of the delivery :meth:`next` returned."""
        current = self._page[self._cursor]
        if report.delivery_id != current.id:
            raise ValueError(f"report for {report.delivery_id}, expected {current.id}")
        stop = _STOPS.get(report.outcome_class)
        if stop is not None:
            self.stopped_because = stop
            return
        if report.outcome_class is OutcomeClass.DONE:
            self.folded += 1
        else:
            self.unwritten.append(current.id)
        self._cursor += 1
        self._taken += 1
        if self._more and self._cursor >= len(self._page):
            # Done with: not held while the next page is read.
            self._page, self._cursor = (), 0

    def cancel(self) -> None:
        """An external cancellation: the current delivery is deferred, the pass ends."""
        self.stopped_because = "cancelled"

    @property
    def reached_end(self) -> bool:
        """True when the pass got through the whole queue (F7's first-pass condition)."""
        return self.stopped_because in ("empty", "unwritten")
