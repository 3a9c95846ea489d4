"""Prometheus text exposition of the runtime's statistics and the store's figures."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import attrs
from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from actors.runtime import Runtime, RuntimeStatistics
from healthlog.documents import Status
from healthlog.storage.journal import Journal
from healthlog.storage.rebuild import REINDEX_PREFIX
from healthlog.storage.status import collect_status, database_sizes
from healthlog.storage.store import Store, serve_of
from transport.intake import IntakeRefusals
from transport.stream import HandshakeRefusals

# The fold counters a user watches: what re-sends overwrote or kept, what was rejected, and
# what reached an object a seal had made final or came in other units than the stored ones,
# both of which a fold otherwise says in a WARNING line alone.
COUNTERS = (
    "points_held",
    "points_erased",
    "overwrites",
    "points_rejected",
    "sealed_writes",
    "unit_mismatches",
)


# The kinds of fold lease holder, a fixed label set: the holder's name carries a host name and a
# process id, which a label would make a series of every process ever started (RUN-141).
HOLDER_KINDS = ("this_process", "serve", "reindex", "command", "none")


def _holder_kind(holder: str | None, ours: str) -> str:
    """Which of ``HOLDER_KINDS`` the lease holder ``holder`` is, seen from the holder ``ours``."""
    if holder is None:
        return "none"
    if holder == ours:
        return "this_process"
    if serve_of(holder) is not None:
        return "serve"
    if holder.startswith(REINDEX_PREFIX):
        return "reindex"
    return "command"


@attrs.frozen(eq=False)
class _Snapshot(Collector):
    status: Status
    statistics: RuntimeStatistics
    totals: dict[str, int]
    sizes: dict[str, int]
    """The size of each database and of its ``-wal``, by file name (``database_sizes``)."""
    databases: tuple[str, ...]
    """The path of each database, by which retention says the ``-wal`` files it finds held."""
    stream_connections: int
    stream_refused: HandshakeRefusals
    intake_refused: IntakeRefusals
    intake_held: int

    def collect(self) -> Iterator[Metric]:
        deliveries = GaugeMetricFamily(
            "healthlog_deliveries", "Journaled deliveries by fold status", labels=["status"]
        )
        for name, value in attrs.asdict(self.status.deliveries).items():
            deliveries.add_metric([name], value)
        yield deliveries
        yield GaugeMetricFamily(
            "healthlog_journal_bytes", "Raw bytes journaled", value=self.status.journal.bytes
        )
        sizes = GaugeMetricFamily(
            "healthlog_database_bytes",
            "Size of each database of the data directory and of its -wal, on disk",
            labels=["file"],
        )
        for name, size in self.sizes.items():
            sizes.add_metric([name], size)
        yield sizes
        held = GaugeMetricFamily(
            "healthlog_wal_held_back",
            "1 while a read transaction kept open on the database (by another program, a long"
            " verify or snapshot build) keeps its -wal from being checkpointed, so that every"
            " write adds to it; as the last retention pass found it",
            labels=["database"],
        )
        for path in self.databases:
            # By the file's name, never its directory's path.
            held.add_metric(
                [os.path.basename(path)], int(path in self.statistics.retention.held_back)
            )
        yield held
        yield GaugeMetricFamily(
            "healthlog_pending_deliveries",
            "Deliveries journaled but not folded",
            value=self.status.deliveries.pending,
        )
        yield GaugeMetricFamily(
            "healthlog_lag_seconds",
            "How long the oldest pending delivery has waited since it was journaled",
            value=self.status.lag.waited_s,
        )
        yield GaugeMetricFamily(
            "healthlog_lease_epoch", "Epoch of the fold lease", value=self.status.lease.epoch
        )
        yield GaugeMetricFamily(
            "healthlog_fold_lease_held",
            "1 while this process holds the fold lease and so folds; 0 while another does",
            value=int(self.statistics.lease.epoch is not None),
        )
        holder = GaugeMetricFamily(
            "healthlog_fold_lease_holder",
            "1 for the kind of process that the fold lease names: this process, another serve,"
            " a reindex, another command (import, seal), or none",
            labels=["kind"],
        )
        kind = _holder_kind(self.status.lease.holder, self.statistics.lease.holder)
        for each in HOLDER_KINDS:
            holder.add_metric([each], int(each == kind))
        yield holder
        yield GaugeMetricFamily(
            "healthlog_first_pass_completed",
            "1 once a folding pass of this process reached the end of the queue (/readyz)",
            value=int(self.status.first_pass_completed),
        )
        yield GaugeMetricFamily(
            "healthlog_websocket_subscribers",
            "Named replay subscribers with a stored cursor",
            value=len(self.status.subscribers),
        )
        head = self.status.stream.head
        yield GaugeMetricFamily(
            "healthlog_stream_head", "Seq of the newest change event of the stream", value=head
        )
        # The furthest behind, not one series per subscriber: a subscriber's name is the
        # client's to choose, and a label of it would make a series of every name ever sent.
        yield GaugeMetricFamily(
            "healthlog_subscriber_lag_events",
            "Events the named subscriber furthest behind has not acknowledged (0 without one)",
            value=max([0, *(head - acked for acked in self.status.subscribers.values())]),
        )
        yield GaugeMetricFamily(
            "healthlog_stream_connections",
            "Replay stream subscribers this process serves now (at most stream_max_subscribers)",
            value=self.stream_connections,
        )
        refused = CounterMetricFamily(
            "healthlog_stream_refused",
            "Replay stream connections this process refused at the handshake, by reason",
            labels=["reason"],
        )
        for reason, count in attrs.asdict(self.stream_refused).items():
            refused.add_metric([reason], count)
        yield refused
        points = CounterMetricFamily(
            "healthlog_points", "Fold counters over every outcome", labels=["counter"]
        )
        for name, value in self.totals.items():
            points.add_metric([name], value)
        yield points
        folding = self.statistics.folding
        buckets = [(str(bound), count) for bound, count in folding.duration_buckets]
        yield HistogramMetricFamily(
            "healthlog_fold_duration_seconds",
            "Time to fold one delivery, in this process",
            buckets=[*buckets, ("+Inf", folding.folds_timed)],
            sum_value=folding.duration_sum_s,
        )
        late = [(str(bound), count) for bound, count in folding.late_buckets]
        yield HistogramMetricFamily(
            "healthlog_late_change_seconds",
            "How long after its end (its hour's; a daily or longer total's longest period, as a"
            " seal counts it) an object was changed, by the folds of this process (objects not"
            " yet ended are not counted): the horizon for healthlog seal",
            buckets=[*late, ("+Inf", folding.late_changes)],
            sum_value=folding.late_sum_s,
        )
        yield CounterMetricFamily(
            "healthlog_intake_accepted",
            "Deliveries journaled",
            value=self.statistics.intake.accepted,
        )
        intake_refused = CounterMetricFamily(
            "healthlog_intake_refused",
            "Uploads this process did not journal, by reason: refused (401, 413, 415, 400, 408,"
            " 503 for memory), or the client left before its body was whole",
            labels=["reason"],
        )
        for reason, count in attrs.asdict(self.intake_refused).items():
            intake_refused.add_metric([reason], count)
        yield intake_refused
        yield GaugeMetricFamily(
            "healthlog_intake_held_bytes",
            "Bytes the uploads in flight hold in memory until journaled, bounded by"
            " intake_memory_mib (an upload over it is refused 503 INTAKE_BUSY)",
            value=self.intake_held,
        )
        yield CounterMetricFamily(
            "healthlog_journal_commit_failures",
            "Journal commits that failed (each refused its deliveries with 503)",
            value=self.statistics.journal.errors,
        )
        # What an owner alerts on beside a growing lag: the fold's worker processes the kernel
        # killed (the OOM killer on a small NAS), and a lease this process could not renew (a
        # store it may not write, a full disk) or lost (SERVE-162).
        yield CounterMetricFamily(
            "healthlog_fold_workers_lost",
            "Fold worker processes that died while folding (killed by the out-of-memory killer,"
            " a crash); their delivery is folded again, recorded failed if they keep dying on it",
            value=self.statistics.folding.workers_lost,
        )
        yield CounterMetricFamily(
            "healthlog_fold_lease_renewal_failures",
            "Fold lease renewals that failed (a busy store, one the service may not write, a"
            " full disk)",
            value=self.statistics.lease.failures,
        )
        yield CounterMetricFamily(
            "healthlog_fold_lease_losses",
            "Times this process lost the fold lease it held (renewals failed until it would"
            " expire, or another process took it)",
            value=self.statistics.lease.losses,
        )
        yield CounterMetricFamily(
            "healthlog_actor_crashes",
            "Actor crashes",
            value=sum(self.statistics.crashes.values()),
        )
        yield GaugeMetricFamily(
            "healthlog_actors_down",
            "Actors that crashed and have not run well since",
            value=len(self.statistics.down),
        )


def _read(
    journal: Journal, store: Store, first_pass_completed: bool
) -> tuple[Status, dict[str, int], dict[str, int]]:
    status = collect_status(journal, store, first_pass_completed=first_pass_completed)
    return status, store.counter_totals(COUNTERS), database_sizes(journal, store)


async def render_metrics(
    runtime: Runtime,
    stream_connections: int,
    stream_refused: HandshakeRefusals,
    intake_refused: IntakeRefusals,
    intake_held: int,
) -> bytes:
    """The exposition text, from one read of status and counters in the store's worker thread,
    with the serving process's own figures (``process_*``: RSS, open files, CPU), Python's
    version (``python_info``), the ``stream_connections`` it serves now and the stream
    connections it refused at the handshake, the uploads it did not journal and the bytes
    those in flight hold."""
    statistics = runtime.statistics()
    status, totals, sizes = await runtime.read_store(
        functools.partial(
            _read,
            runtime.journal,
            first_pass_completed=statistics.folding.first_pass_completed,
        )
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        _Snapshot(
            status,
            statistics,
            totals,
            sizes,
            (runtime.journal.path, runtime.store.path),
            stream_connections,
            stream_refused,
            intake_refused,
            intake_held,
        )
    )
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return generate_latest(registry)
