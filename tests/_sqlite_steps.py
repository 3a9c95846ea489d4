"""How many steps of SQLite's virtual machine a call takes on a connection: how the scale
scenarios show that a read visits a few rows, not every row of a file, without building years
of data in a test."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def counted_steps(
    conn: sqlite3.Connection, call: Callable[[], T], *, every: int = 100
) -> tuple[T, int]:
    """``call()``'s result, and how many times SQLite's progress handler ran on ``conn``
    meanwhile (once every ``every`` steps)."""
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    conn.set_progress_handler(step, every)
    try:
        result = call()
    finally:
        conn.set_progress_handler(None, 0)
    return result, steps
