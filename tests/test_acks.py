"""The acknowledgeable cursor never passes a gap (specs/stream.md, STREAM-18)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from healthlog.acks import AckTracker


@st.composite
def completions(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """A start cursor, a last sequence n, and every sequence start+1..n made durable in some
    order, some of them more than once (and some at or below the start, as replays are)."""
    start = draw(st.integers(min_value=0, max_value=5))
    n = draw(st.integers(min_value=start, max_value=start + 60))
    wanted = list(range(start + 1, n + 1))
    repeats = draw(st.lists(st.integers(min_value=max(start - 3, 0), max_value=n), max_size=20))
    return start, n, draw(st.permutations(wanted + repeats))


@given(completions())
def test_ack_never_passes_a_gap(case: tuple[int, int, list[int]]) -> None:
    """STREAM-18: never past the smallest missing sequence, never backwards, ends at n."""
    start, n, order = case
    tracker = AckTracker(start)
    durable: set[int] = set()
    previous = start
    for seq in order:
        durable.add(seq)
        returned = tracker.durable(seq)
        smallest_missing = next(s for s in range(start + 1, n + 2) if s not in durable)
        assert returned == tracker.contiguous
        assert tracker.contiguous == smallest_missing - 1
        assert tracker.contiguous >= previous
        assert tracker.pending == len({s for s in durable if s > tracker.contiguous})
        previous = tracker.contiguous
    assert tracker.contiguous == n
    assert tracker.pending == 0
