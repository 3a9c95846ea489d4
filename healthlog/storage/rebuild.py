"""Rebuilding the projection from the journal: ``reindex`` and ``verify``.

A rebuild folds deliveries in journal order into a fresh store file, with the same fold
code the live folder uses and without the out-of-order guard. ``reindex`` takes the fold
lease at a higher epoch (fencing the live folder), rebuilds, swaps the result in, and
releases. ``verify`` rebuilds exactly the deliveries the live store has folded, into a
temporary file, and compares the two object by object.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from healthlog.folding import OutcomeClass
from healthlog.objects import ObjectKey
from healthlog.storage.journal import Journal
from healthlog.storage.passes import Progress
from healthlog.storage.store import Store

log = logging.getLogger("healthlog.rebuild")

LEASE_TTL_US = 300 * 1_000_000
LEASE_RENEW_S = 30.0


class RebuildError(Exception):
    """A rebuild could not fold every delivery it was asked to."""


@attrs.frozen
class Difference:
    """One object that differs between the live store and a rebuild."""

    key: ObjectKey
    live: bytes | None
    rebuilt: bytes | None


def _now() -> int:
    return time.time_ns() // 1000


def rebuild_into(
    journal: Journal,
    path: Path,
    *,
    only: set[int] | None = None,
    progress: Progress | None = None,
) -> None:
    """Fold the journal (or the deliveries in ``only``) in journal order into a new store."""
    with Store(path, durable=False) as target:
        epoch = target.acquire_lease("rebuild", now=_now(), ttl=LEASE_TTL_US, force=True)
        assert epoch is not None
        queue = [m for m in journal.iter_order() if only is None or m.id in only]
        for done, meta in enumerate(queue, start=1):
            report = target.fold(journal, meta, epoch, guard=False)
            if report.outcome_class is not OutcomeClass.DONE:
                raise RebuildError(
                    f"delivery {meta.id} could not be rebuilt ({report.outcome_class.value})"
                )
            if progress is not None:
                progress(done, len(queue))


@contextlib.contextmanager
def _scratch(near: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=".rebuild-", dir=near.parent) as tmp:
        yield Path(tmp) / "store.sqlite"


def verify(journal: Journal, store: Store, *, progress: Progress | None = None) -> list[Difference]:
    """Objects that differ between the live store and a rebuild of what it has folded."""
    folded, live = store.snapshot()
    with _scratch(Path(store.path)) as path:
        rebuild_into(journal, path, only=folded, progress=progress)
        with Store(path, durable=False) as rebuilt:
            fresh = rebuilt.summaries()
    return [
        Difference(
            key, live[key].hash if key in live else None, fresh[key].hash if key in fresh else None
        )
        for key in sorted(live.keys() | fresh.keys(), key=attrs.astuple)
        if key not in live or key not in fresh or live[key].hash != fresh[key].hash
    ]


def reindex(
    journal: Journal, store: Store, holder: str, *, progress: Progress | None = None
) -> int:
    """Rebuild the projection from the whole journal and swap it in; returns objects changed.

    The lease is taken at a higher epoch (fencing the live folder) and renewed between
    deliveries, so a reindex killed on the way fences the folder for one TTL at most.
    """
    epoch = store.acquire_lease(holder, now=_now(), ttl=LEASE_TTL_US, force=True)
    assert epoch is not None
    renewed = time.monotonic()

    def renewing(done: int, total: int) -> None:
        nonlocal renewed
        if time.monotonic() - renewed > LEASE_RENEW_S:
            if store.acquire_lease(holder, now=_now(), ttl=LEASE_TTL_US) != epoch:
                raise RebuildError(f"the fold lease was lost during the reindex (epoch {epoch})")
            renewed = time.monotonic()
        if progress is not None:
            progress(done, total)

    try:
        with _scratch(Path(store.path)) as path:
            rebuild_into(journal, path, progress=renewing)
            changed = store.swap_in(path, epoch)
    finally:
        store.release_lease(holder, epoch)
    log.info("reindex swapped in at epoch %d, %d objects changed", epoch, changed)
    return changed
