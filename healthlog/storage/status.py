"""The status document, read from the journal and the projection."""

from __future__ import annotations

from healthlog import clock
from healthlog.documents import (
    DeliveryCounts,
    JournalFigures,
    Lag,
    LeaseInfo,
    Status,
    StreamInfo,
)
from healthlog.storage.journal import Journal
from healthlog.storage.passes import FIRST_PASS_MARK, LAG_MARK, counted
from healthlog.storage.store import Store


def collect_status(journal: Journal, store: Store, public_key: str | None = None) -> Status:
    """Journal size, deliveries by status, lag, lease, first-pass flag, subscriber cursors.

    The deliveries by status, pending included, come from one snapshot of the store, so each
    journaled delivery is counted once; the journal's figures are read with the pending ones,
    so they count the same deliveries.
    """
    read = counted(journal, store)
    waiting, counts, (deliveries, size) = read.pending, read.counts, read.journal
    oldest = waiting[0] if waiting else None
    mark = store.mark(LAG_MARK) or {}
    lease = store.lease()
    now = clock.now_us()
    window_start, head = store.event_window()
    return Status(
        journal=JournalFigures(deliveries, size),
        deliveries=DeliveryCounts(
            pending=len(waiting),
            parsed=counts.get("parsed", 0),
            partial=counts.get("partial", 0),
            failed=counts.get("failed", 0),
        ),
        lag=Lag(
            oldest_pending_id=oldest.id if oldest else None,
            waited_s=round(max(0, now - oldest.received_at) / 1e6, 3) if oldest else 0.0,
            stopped_because=str(mark.get("stopped_because", "no_pass_yet")),
        ),
        lease=LeaseInfo(lease.holder, lease.epoch),
        first_pass_completed=bool(store.mark(FIRST_PASS_MARK)),
        subscribers=store.subscribers(),
        stream=StreamInfo(
            id=store.stream_id(),
            instance=journal.instance_id(),
            head=head,
            oldest_cursor=window_start,
            public_key=public_key,
        ),
    )
