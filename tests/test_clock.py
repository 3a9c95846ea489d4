"""The wall clock and its injected jumps (specs/chaos.md)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from healthlog import clock, faults
from healthlog.storage import faultplan
from healthlog.storage.journal import Journal, NewDelivery

HOUR_US = 3600 * 10**6
# How far apart two readings of the clocks may be, taken one after the other.
SLACK_US = 10**6


def offset_us() -> int:
    """How far the process's wall clock is from the system's."""
    return clock.now_us() - time.time_ns() // 1000


def test_clock_fault_jumps_the_wall_clock_and_journal_stamps_stay_ordered_chaos_4(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """CHAOS-4: a ``clock`` fault steps the process's wall clock by its signed seconds at the
    named hit; deliveries journaled after a backward step are stamped no earlier than those
    before it."""
    caplog.set_level(logging.INFO, logger="healthlog.faults")
    plan = faultplan.from_spec(
        {
            "lease.renew": {"hits": [2], "do": "clock", "seconds": 3600},
            "journal.append": {"hits": [2], "do": "clock", "seconds": -7200},
        }
    )
    with Journal(tmp_path / "journal.sqlite") as journal, faults.loaded(plan):
        try:
            faults.point("lease.renew")
            assert abs(offset_us()) < SLACK_US
            faults.point("lease.renew")
            assert abs(offset_us() - HOUR_US) < SLACK_US
            stamps = []
            for n in range(3):
                faults.point("journal.append")
                stamps.append(journal.append(NewDelivery(b"{}", f"c{n}")).received_at)
            assert abs(offset_us() + HOUR_US) < SLACK_US
        finally:
            clock.jump(3600)
    assert stamps == sorted(stamps)
    assert abs(offset_us()) < SLACK_US
    assert [r.getMessage() for r in caplog.records if r.name == "healthlog.faults"] == [
        "fault injected at lease.renew (hit 2)",
        "fault injected at journal.append (hit 2)",
    ]
    # The step back put the clock behind the last stamp: said once (JOURNAL-44).
    behind = [r for r in caplog.records if "behind the journal's last stamp" in r.getMessage()]
    assert len(behind) == 1
