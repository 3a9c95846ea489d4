"""Named fault points (X1): inert unless a fault plan is loaded; each firing is logged at INFO.

Code calls :func:`point` at a named step (``fault.point("fold.object_write")``). With no
plan loaded that is one dictionary lookup. A plan maps point names to actions: raise a
given exception on the n-th hit, or call a function (a delay, a kill) there.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator

import attrs

log = logging.getLogger("healthlog.faults")

POINTS = (
    "journal.append",
    "journal.read_body",
    "fold.select",
    "fold.run_lookup",
    "fold.begin",
    "fold.object_write",
    "fold.outcome_write",
    "fold.before_commit",
    "fold.after_commit",
    "lease.renew",
    "retention.prune",
    "stream.head",
    "stream.send",
    "stream.page",
    "stream.ack",
    "snapshot.build",
    "snapshot.open",
    "rebuild.scratch",
    "snapshot.write",
    "follow.download",
    "follow.restore",
    "follow.restore_object",
    "schema.migrate",
    "tokens.read",
    "store.check",
    "journal.check",
)


class InjectedFault(Exception):
    """The default exception a fault plan raises."""


@attrs.define
class Action:
    """What happens at a fault point: on hits whose number is in ``on_hits`` (1-based)."""

    on_hits: frozenset[int]
    run: Callable[[str], None]


@attrs.define
class Plan:
    """A loaded fault plan with its hit counts."""

    actions: dict[str, Action] = attrs.Factory(dict)
    hits: Counter[str] = attrs.Factory(Counter)
    fired: Counter[str] = attrs.Factory(Counter)


_plan: Plan | None = None


def point(name: str) -> None:
    """A fault point; does nothing unless a plan names it."""
    if _plan is None:
        return
    _plan.hits[name] += 1
    action = _plan.actions.get(name)
    if action is not None and _plan.hits[name] in action.on_hits:
        _plan.fired[name] += 1
        log.info("fault injected at %s (hit %d)", name, _plan.hits[name])
        for handler in logging.getLogger().handlers:
            handler.flush()
        action.run(name)


def raise_fault(exc: Callable[[str], BaseException] = InjectedFault) -> Callable[[str], None]:
    """An action that raises ``exc(point_name)``."""

    def run(name: str) -> None:
        raise exc(name)

    return run


def _check(plan: Plan) -> None:
    if unknown := set(plan.actions) - set(POINTS):
        raise ValueError(f"unknown fault points: {sorted(unknown)}")


def install(plan: Plan | None) -> None:
    """Load a plan for the rest of the process (the harness's service and workers); None
    makes every fault point inert again."""
    global _plan
    if plan is not None:
        _check(plan)
    _plan = plan


@contextlib.contextmanager
def loaded(plan: Plan) -> Iterator[Plan]:
    """Load a plan for the duration of the block."""
    global _plan
    _check(plan)
    previous, _plan = _plan, plan
    try:
        yield plan
    finally:
        _plan = previous
