"""The status document, read from the journal and the projection, and the list of the
deliveries whose fold failed (or rejected part of them)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Collection, Sequence

from healthlog import clock
from healthlog.documents import (
    DeliveryCounts,
    DeliveryList,
    JournalFigures,
    Lag,
    LeaseInfo,
    ListedDelivery,
    Status,
    StreamInfo,
)
from healthlog.storage._sqlite import file_size
from healthlog.storage.journal import Journal
from healthlog.storage.passes import FIRST_PASS_MARK, LAG_MARK, counted, waited_s
from healthlog.storage.store import LISTED_OUTCOMES, REINDEX_REASONS, Store
from healthlog.timestamps import format_instant

# The statuses a delivery list may ask for, in the order the list document names them: a
# failed delivery stored no point, a partial one some (the others were rejected). The store
# indexes the outcomes of these statuses for the lists.
LISTED_STATUSES = LISTED_OUTCOMES
# How many deliveries a list holds unless asked for fewer or more, and at most.
DEFAULT_LISTED = 20
MAX_LISTED = 1000
# Why the last pass stopped, before any pass has run.
NO_PASS_YET = "no_pass_yet"


def collect_status(
    journal: Journal,
    store: Store,
    public_key: str | None = None,
    *,
    stopped_because: str | None = None,
    first_pass_completed: bool | None = None,
) -> Status:
    """Journal size, deliveries by status, lag, lease, first-pass flag, subscriber cursors,
    and why a reindex is advised, if it is.

    Why the last pass stopped is the lag mark's, unless ``stopped_because`` (the folder of
    this process knows why its last pass ended, which the mark could not record: STORE-66).
    The first-pass flag is the store's mark (some process once folded to the end of the
    queue), unless ``first_pass_completed``: a service says whether its own folder has, as its
    ``/readyz`` does, since the mark of a process before it says nothing of this one (SERVE-118).

    The deliveries by status, pending included, come from one snapshot of the store, so each
    journaled delivery is counted once; the journal's figures are read with the pending ones,
    so they count the same deliveries.
    """
    read = counted(journal, store)
    counts, (deliveries, size) = read.counts, read.journal
    mark = store.mark(LAG_MARK) or {}
    lease = store.lease()
    now = clock.now_us()
    window_start, head = store.event_window()
    acks = store.subscriber_acks()
    return Status(
        journal=JournalFigures(deliveries, size),
        deliveries=DeliveryCounts(
            pending=read.pending,
            parsed=counts.get("parsed", 0),
            partial=counts.get("partial", 0),
            failed=counts.get("failed", 0),
        ),
        lag=Lag(
            oldest_pending_id=read.oldest[1] if read.oldest else None,
            waited_s=round(waited_s(read.oldest, now), 3),
            stopped_because=stopped_because or str(mark.get("stopped_because", NO_PASS_YET)),
        ),
        lease=LeaseInfo(lease.holder, lease.epoch),
        first_pass_completed=(
            bool(store.mark(FIRST_PASS_MARK))
            if first_pass_completed is None
            else first_pass_completed
        ),
        subscribers={name: acked for name, (acked, _) in acks.items()},
        stream=StreamInfo(
            id=store.stream_id(),
            instance=journal.instance_id(),
            head=head,
            oldest_cursor=window_start,
            public_key=public_key,
        ),
        subscribers_last_ack={name: format_instant(at) for name, (_, at) in acks.items()},
        reindex_advised=store.reindex_advised(),
    )


def database_sizes(journal: Journal, store: Store) -> dict[str, int]:
    """The size of each database of the data directory and of its ``-wal``, by file name, 0
    for one not there: a ``-wal`` that a reader keeps from being checkpointed grows with every
    write (RUN-63), and the journal is never pruned, so these are what a disk alert watches."""
    return {
        os.path.basename(path) + suffix: file_size(path + suffix)
        for path in (journal.path, store.path)
        for suffix in ("", "-wal")
    }


def reindex_advice(codes: Sequence[str], data: str | os.PathLike[str]) -> str:
    """What ``serve``, ``status`` and ``verify`` say while a reindex is advised (``codes`` of
    ``REINDEX_REASONS``, a code this healthlog does not know as it is): why, and the command,
    with the data directory ``data``, quoted as a shell reads it (a path with a space, a NAS
    share's, was read as two words: STORE-150). It names sections, never a record's name or
    value."""
    why = "; ".join(REINDEX_REASONS.get(code, code) for code in codes)
    return (
        f"a reindex is advised: {why}; `healthlog reindex --data {shlex.quote(os.fspath(data))}`"
        " rebuilds the objects from the journal (safe while serve runs)"
    )


def list_deliveries(store: Store, statuses: Collection[str], limit: int) -> DeliveryList:
    """The newest ``limit`` deliveries (last in journal order first) whose outcome is one of
    ``statuses`` (of :data:`LISTED_STATUSES`), with their stamp, status and reason, and how
    many such deliveries there are. A reason names what was wrong, never a value (fold.py)."""
    asked = [status for status in LISTED_STATUSES if status in statuses]
    if not asked or len(asked) != len(set(statuses)):
        raise ValueError(f"statuses are among {', '.join(LISTED_STATUSES)}")
    if not 1 <= limit <= MAX_LISTED:
        raise ValueError(f"a list holds 1 to {MAX_LISTED} deliveries")
    total, rows = store.newest_outcomes(asked, limit)
    return DeliveryList(
        statuses=asked,
        total=total,
        limit=limit,
        deliveries=[
            ListedDelivery(
                delivery_id=row.delivery_id,
                received_at=format_instant(row.received_at),
                status=row.status,
                reason=row.reason,
            )
            for row in rows
        ],
    )
