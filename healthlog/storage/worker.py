"""Folding deliveries in a worker process (the event loop's process never parses a body).

A worker keeps its journal and store connections open between calls; killing the worker in
the middle of a fold rolls its transaction back, as any interrupted SQLite writer does. It opens
only the files the service opened before it and creates none: a data directory moved or
unmounted under the running service is not begun anew, empty, at its old path (where the worker
would fold nothing and a restart would find an empty journal). A file it cannot open defers
the fold, with a WARNING naming the file: the pass stops there, skipping nothing, and the next
pass tries again, until the directory is back.

A worker also remembers the process that started it (the service). When the service is killed
outright, its workers are orphaned and handed to another parent; a worker that finds its parent
changed stops its run before the next delivery instead of folding the rest of it for nobody.

And a worker runs only the code the service runs: a worker that imported other code (healthlog
upgraded in place under the running service, :mod:`healthlog.sources`) refuses each run with
:class:`CodeChanged` before it opens any file, and ends (STORE-157).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from healthlog import faults, sources
from healthlog.folding import FoldReport, OutcomeClass
from healthlog.logs import LOG_FORMAT_ENV, LOG_LEVEL_ENV, setup_logging
from healthlog.storage import faultplan
from healthlog.storage._sqlite import StorageError, describe
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import Journal
from healthlog.storage.passes import Budget
from healthlog.storage.store import Store

log = logging.getLogger("healthlog.worker")

RETIRE_AFTER_BYTES = 8 * 2**20
"""A worker that has folded a body of at least this many raw bytes ends after its run
(:func:`retire`): the memory a large fold took (23 MiB more than before it, after a 50 MiB
body) goes back to the system with the process, instead of staying with the worker for as
long as deliveries keep it busy; the next run starts a new worker (RUN-59)."""

CODE = sources.source_digest()
"""The digest of healthlog's code as this process imported it: taken with this module's import,
at the service's start in the service, and at a worker's start in the worker."""


class CodeChanged(Exception):
    """The code this worker imported is not the code of the service that started it."""


_handles: dict[str, tuple[Journal, Store]] = {}
_largest = 0
"""The largest body, in raw bytes, whose fold this worker has done (its outcome written). One
whose fold was not written is tried again by the same worker: a new one for each try would
cost a start each time, and would meet again a fault that a seeded plan injects at a hit of
the worker's own count (a plan counts hits per process), so the try would never pass."""
_probe = False
"""Whether this worker ran :func:`ready`, and ends."""
_stale = False
"""Whether this worker refused a run for :class:`CodeChanged`, and ends."""
_service_pid: int | None = None
"""The parent of this worker when it first opened its handles: the service that started it."""


def _open(data_dir: str, busy_timeout_ms: int) -> tuple[Journal, Store]:
    global _service_pid
    handles = _handles.get(data_dir)
    if handles is None:
        if not _handles:
            _service_pid = os.getppid()
            setup_logging(
                os.environ.get(LOG_FORMAT_ENV, "kv"), os.environ.get(LOG_LEVEL_ENV, "info")
            )
            faultplan.load_environment()
        data = DataDir(data_dir)
        journal = data.open_journal(busy_timeout_ms, create=False)
        try:
            handles = journal, data.open_store(busy_timeout_ms, create=False)
        except BaseException:
            journal.close()
            raise
        _handles[data_dir] = handles
    return handles


def fold_run(
    code: str,
    data_dir: str,
    delivery_ids: Sequence[int],
    epoch: int,
    budget: Budget,
    busy_timeout_ms: int,
) -> list[FoldReport]:
    """Fold the journaled deliveries ``delivery_ids`` of ``data_dir`` in order under lease
    epoch ``epoch``, each in its own transaction.

    It stops after the first report that is not DONE, which the pass has to judge first; so a
    run of small deliveries costs one round trip to the worker instead of one each, and one
    read of their metadata.

    Before each delivery it checks that the service which started this worker is still its
    parent. If it is not, the service is gone (killed, and the worker orphaned), so nobody is
    waiting for the reports: it stops there and returns the reports so far, a prefix of the run
    like any other, leaving the rest for the next holder of the lease.

    ``code`` is the service's :data:`CODE`: when this worker's is another, it raises
    :class:`CodeChanged` having opened nothing, since the code it imported may migrate the
    databases to a schema the service does not know (STORE-157).
    """
    global _largest, _stale
    if code != CODE:
        _stale = True
        raise CodeChanged(f"this worker runs code {CODE[:12]}, the service {code[:12]}")
    try:
        journal, store = _open(data_dir, busy_timeout_ms)
    except StorageError as exc:
        log.warning("delivery %d: fold deferred, cannot open: %s", delivery_ids[0], describe(exc))
        return [FoldReport(delivery_ids[0], OutcomeClass.DEFERRED)]
    try:
        faults.point("fold.run_lookup")
        metas = journal.get_metas(delivery_ids)
    except StorageError as exc:
        # Raised out of the worker, it crashed the folding actor (FOLD-20): deferred instead,
        # like a fold that meets a storage error, the pass stops here and the next tries again.
        log.warning(
            "delivery %d: fold deferred, run not readable: %s", delivery_ids[0], describe(exc)
        )
        return [FoldReport(delivery_ids[0], OutcomeClass.DEFERRED)]
    reports: list[FoldReport] = []
    for position, delivery_id in enumerate(delivery_ids):
        if os.getppid() != _service_pid:
            left = delivery_ids[position:]
            log.warning(
                "service process %s is gone: worker stops its run, %d of %d deliveries left"
                " unfolded (ids %s)",
                _service_pid,
                len(left),
                len(delivery_ids),
                ",".join(map(str, left)),
            )
            break
        meta = metas.get(delivery_id)
        if meta is None:
            reports.append(
                FoldReport(delivery_id, OutcomeClass.UNWRITTEN, reason="not in the journal")
            )
        else:
            check = budget.checker(meta.bytes)
            reports.append(store.fold(journal, meta, epoch, check_budget=check))
            if reports[-1].outcome_class is OutcomeClass.DONE:
                _largest = max(_largest, meta.bytes)
        if reports[-1].outcome_class is not OutcomeClass.DONE:
            break
    return reports


def ready() -> None:
    """Nothing, in a worker that then ends: the task that tells a worker process that starts
    from one that cannot (the folding actor runs it in a new worker after one died folding,
    RUN-66). The fold tried again then starts a worker of its own, as it did before."""
    global _probe
    _probe = True


def retire() -> bool:
    """Whether this worker ends after the run it has just answered: once it has folded a body
    of :data:`RETIRE_AFTER_BYTES` or more (RUN-59), run :func:`ready`, or found its code
    changed (STORE-157)."""
    return _probe or _stale or _largest >= RETIRE_AFTER_BYTES
