"""Seeded fault plans for the harness, as data that crosses process boundaries.

A plan is JSON in the ``HEALTHLOG_FAULT_PLAN`` environment variable, read by every process
that has fault points (the service and its fold workers):
``{"fold.object_write": {"hits": [3], "do": "busy"}, "journal.append": {"hits": [2, 5],
"do": "delay", "seconds": 0.2}}``. Kinds: ``busy`` (an injected SQLITE_BUSY), ``ioerror``,
``delay``, ``kill`` (SIGKILL of the serving process, named by ``HEALTHLOG_SERVE_PID``), and
``clock`` (the process's wall clock jumps by a signed ``seconds``, as an NTP step does).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from healthlog import clock, faults
from healthlog.storage._sqlite import Deferred, StorageError

PLAN_ENV = "HEALTHLOG_FAULT_PLAN"
SERVE_PID_ENV = "HEALTHLOG_SERVE_PID"
KINDS = ("busy", "ioerror", "delay", "kill", "clock")


class InjectedIOError(StorageError):
    """An injected I/O error, as SQLite would report a failed write."""


def _kill(name: str) -> None:
    target = int(os.environ.get(SERVE_PID_ENV, os.getpid()))
    os.kill(target, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _action(spec: Mapping[str, Any]) -> Callable[[str], None]:
    kind = spec["do"]
    if kind == "busy":
        return faults.raise_fault(lambda name: Deferred(f"injected busy at {name}"))
    if kind == "ioerror":
        return faults.raise_fault(lambda name: InjectedIOError(f"injected I/O error at {name}"))
    if kind == "delay":
        seconds = float(spec.get("seconds", 0.1))
        return lambda name: time.sleep(seconds)
    if kind == "kill":
        return _kill
    if kind == "clock":
        shift = float(spec["seconds"])
        return lambda name: clock.jump(shift)
    raise ValueError(f"unknown fault kind {kind!r}; choose from {', '.join(KINDS)}")


def from_spec(spec: Mapping[str, Mapping[str, Any]]) -> faults.Plan:
    """A plan from its JSON form."""
    return faults.Plan(
        actions={
            point: faults.Action(frozenset(int(h) for h in entry["hits"]), _action(entry))
            for point, entry in spec.items()
        }
    )


def load_environment() -> faults.Plan | None:
    """Load the plan named by the environment, once per process; None when there is none."""
    text = os.environ.get(PLAN_ENV)
    if not text:
        return None
    plan = from_spec(orjson.loads(text))
    faults.install(plan)
    return plan
