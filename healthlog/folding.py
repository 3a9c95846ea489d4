"""The folding pass as a state machine (F2 to F4, F7), with no I/O of its own.

Whoever drives a pass (the synchronous ``storage.passes.run_pass`` or the folding actor)
asks :meth:`FoldPass.next` for the delivery to fold, folds it however it likes, and hands
the :class:`FoldReport` to :meth:`FoldPass.record`. The table below is the whole policy:

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
    """One pass over the deliveries visible at selection, in journal order."""

    def __init__(self, queue: Sequence[Q]) -> None:
        self._queue = queue
        self._cursor = 0
        self.folded = 0
        self.unwritten: list[int] = []
        self.stopped_because: str | None = None
        self.deferred_at: int | None = None

    @property
    def total(self) -> int:
        return len(self._queue)

    @property
    def position(self) -> int:
        return self._cursor

    def next(self) -> Q | None:
        """The delivery to fold now, or None once the pass has ended."""
        if self.stopped_because is None and self._cursor >= len(self._queue):
            self.stopped_because = "unwritten" if self.unwritten else "empty"
        if self.stopped_because is not None:
            return None
        return self._queue[self._cursor]

    def record(self, report: FoldReport) -> None:
        """Take the report of the delivery :meth:`next` returned."""
        current = self._queue[self._cursor]
        if report.delivery_id != current.id:
            raise ValueError(f"report for {report.delivery_id}, expected {current.id}")
        stop = _STOPS.get(report.outcome_class)
        if stop is not None:
            self.stopped_because = stop
            if report.outcome_class is OutcomeClass.DEFERRED:
                self.deferred_at = current.id
            return
        if report.outcome_class is OutcomeClass.DONE:
            self.folded += 1
        else:
            self.unwritten.append(current.id)
        self._cursor += 1

    def cancel(self) -> None:
        """An external cancellation: the current delivery is deferred, the pass ends."""
        if self.stopped_because is None and self._cursor < len(self._queue):
            self.deferred_at = self._queue[self._cursor].id
        self.stopped_because = "cancelled"

    @property
    def reached_end(self) -> bool:
        """True when the pass got through the whole queue (F7's first-pass condition)."""
        return self.stopped_because in ("empty", "unwritten")
