"""The highest contiguous durable sequence (R3): an ACK never passes a gap."""

from __future__ import annotations


class AckTracker:
    """Sequences made durable in any order; :attr:`contiguous` is what may be acknowledged."""

    def __init__(self, start: int) -> None:
        self.contiguous = start
        self._ahead: set[int] = set()

    def durable(self, seq: int) -> int:
        """Record ``seq`` as durable; return the new contiguous cursor."""
        if seq <= self.contiguous:
            return self.contiguous
        self._ahead.add(seq)
        while self.contiguous + 1 in self._ahead:
            self.contiguous += 1
            self._ahead.remove(self.contiguous)
        return self.contiguous

    @property
    def pending(self) -> int:
        """How many durable sequences wait behind a gap."""
        return len(self._ahead)
