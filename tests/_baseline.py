"""The folded baseline that hostile bodies are sent over (test_bad_input.py, CLI-20 to CLI-22;
test_hostile.py, PROOF-4 to PROOF-7), and the ERROR records a hostile body must not cause.

``BASELINE`` holds two heart-rate points (the first with HTML characters in its source, which
must export byte for byte) and one workout: ``BASELINE_LINES`` export lines in all.
"""

from __future__ import annotations

import logging

import pytest
from _cli_bodies import body, compact, metric, point

from transport.chaos import SEVERE

BASELINE = body(
    metric(
        "heart_rate",
        "count/min",
        point("2024-02-06 15:00:00 +0000", qty=61, source="Watch <Ultra> & co"),
        point("2024-02-06 15:01:00 +0000", qty=62),
    ),
    workouts=[
        compact(
            {
                "name": "Walk",
                "start": "2024-02-06 16:00:00 +0000",
                "end": "2024-02-06 16:30:00 +0000",
            }
        )
    ],
)
BASELINE_LINES = 3


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages of the records logged at ERROR or above."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def severe_lines(text: str) -> list[str]:
    """The records of a process's log output (key=value lines) at ERROR or above, as the chaos
    harness finds them."""
    return [line for line in text.splitlines() if SEVERE.search(line)]
