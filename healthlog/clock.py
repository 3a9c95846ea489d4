"""The one wall-clock source: microseconds since the epoch, as the operating system says.

Journal stamps, lease expiries, event times, lag and retention read the wall clock through
:func:`now_us`, so that the fault harness can make it jump forward and back (X2), as an NTP
step does, with :func:`jump`. The offset is per process and zero unless a fault moved it.
Durations are never measured with it: they use the monotonic clock.
"""

from __future__ import annotations

import time

_offset_us = 0


def now_us() -> int:
    """The wall clock in microseconds since the Unix epoch, including any injected jump."""
    return time.time_ns() // 1000 + _offset_us


def jump(seconds: float) -> None:
    """Step this process's wall clock by ``seconds`` (negative: backwards), for good."""
    global _offset_us
    _offset_us += round(seconds * 1_000_000)
