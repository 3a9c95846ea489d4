"""One delivery against the stored objects it touches (pure: no I/O of its own).

The storage layer drives a :class:`DeliveryFold` inside its write transaction: it hands in
the body and a :class:`Projection` to read stored objects from, writes every object the
fold yields, and records :attr:`DeliveryFold.outcome` once the iteration ends. A metric's
points are read once for their coordinates and then folded hour by hour, so only one hour's
points are held as bytes at a time; a point's content is decoded only where it meets another.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

import attrs

from healthlog import hae, layers, objects
from healthlog.merge import (
    Collision,
    Counters,
    Incoming,
    merge_points,
    reduce_delivery,
)
from healthlog.objects import HourlyObject, ObjectKey
from healthlog.points import Coordinates, named_at
from healthlog.timestamps import format_instant, hour_of

log = logging.getLogger("healthlog.fold")

PARSED = "parsed"
PARTIAL = "partial"
FAILED = "failed"
# The reason of a delivery with points and no layer (P5): it depends on what its automation
# folded before it, so on the order of folding, as an object does.
NO_LAYER = "layer not derivable: no header, no dense metric, no history"
# Said after NO_LAYER when the delivery had an automation-aggregation header naming no layer.
UNKNOWN_HEADER = "its automation-aggregation header names no layer"


class BudgetExceeded(Exception):
    """The fold ran past its time budget (F5): the delivery is failed, not deferred."""


@attrs.frozen
class DeliveryInfo:
    """What the fold needs to know about a delivery besides its body."""

    id: int
    received_at: int
    aggregation: str | None = None


@attrs.define
class Outcome:
    """The recorded result of folding one delivery (P7)."""

    status: str
    reason: str | None
    layer: str | None
    counters: Counters


class Projection(Protocol):
    """Read access to the projection, as the fold needs it."""

    def load(self, key: ObjectKey) -> HourlyObject | None:
        """The stored object at key, if any."""

    def inherited_layer(self) -> str | None:
        """The layer of the preceding delivery of the same automation in journal order."""

    def sealed(self, key: ObjectKey) -> bool:
        """Whether a seal folded before this delivery covers the object's hour (S9)."""


class Unstored:
    """A projection with nothing stored, under a given inherited layer: what a fold decides,
    and writes, from the body alone."""

    def __init__(self, layer: str | None) -> None:
        self._layer = layer

    def load(self, key: ObjectKey) -> HourlyObject | None:
        return None

    def inherited_layer(self) -> str | None:
        return self._layer

    def sealed(self, key: ObjectKey) -> bool:
        return False


class DeliveryFold:
    """Fold one delivery (its body, or its envelope already read): iterate :meth:`writes`,
    then read :attr:`outcome`.

    Collisions, unit mismatches and sealed writes are logged at WARNING, or at DEBUG when
    ``warn`` is off (a rebuild, which would only repeat what the live fold said). With
    ``measure`` on, :attr:`spacing` is the smallest spacing of the delivery's metrics even when
    the layer did not need it (a partitioned rebuild checks the layers it assumed). With
    ``plain`` on, the objects it loads and yields hold plain bodies (a partitioned rebuild's
    scratch files, which compress each object once, at the end).
    """

    def __init__(
        self,
        body: bytes | hae.Envelope,
        info: DeliveryInfo,
        projection: Projection,
        check_budget: Callable[[], None] = lambda: None,
        *,
        warn: bool = True,
        measure: bool = False,
        plain: bool = False,
    ) -> None:
        self._body = body
        self._warn_level = logging.WARNING if warn else logging.DEBUG
        self._info = info
        self._projection = projection
        self._check_budget = check_budget
        self._counters = Counters()
        self._rejections: Counter[str] = Counter()
        self._layer: str | None = None
        self._measure = measure
        self._plain = plain
        self.spacing: int | None = None
        self.outcome: Outcome | None = None

    def writes(self) -> Iterator[HourlyObject]:
        """Yield every object whose content changes; set :attr:`outcome` at the end."""
        if isinstance(self._body, hae.Envelope):
            envelope = self._body
        else:
            try:
                envelope = hae.read_envelope(self._body)
            except hae.EnvelopeError as exc:
                self._finish(failure=f"undecodable body: {exc}")
                return
        self._body = b""
        self._counters.unknown_sections = envelope.unknown_sections
        self._counters.entries_rejected = envelope.rejected_entries
        for problem in envelope.problems:
            self._rejections[problem] += 1
        read: dict[str, hae.Series] = {}
        if any(group.points for group in envelope.metrics.values()):
            self._layer = self._resolve_layer(envelope, read)
            # Without a layer, ``read`` holds every metric: if none has a point to store (every
            # element rejected), only the sections are folded, which need no layer (P5).
            if self._layer is None and any(series.accepted for series in read.values()):
                unknown = self._info.aggregation is not None
                self._finish(failure=f"{NO_LAYER}; {UNKNOWN_HEADER}" if unknown else NO_LAYER)
                return
        self._counters.metrics = len(envelope.metrics)
        if self._layer is None:
            for unread in read.values():
                self._count_rejected(unread)
        else:
            for name in sorted(envelope.metrics):
                group = envelope.metrics.pop(name)
                series = read.pop(name, None)
                if series is None:
                    series = hae.read_series(group.arrays, spacing=self._measure)
                    self._measured(series)
                units = self._units(name, group.units)
                yield from self._fold_series(name, self._layer, units, series)
        for section in sorted(envelope.sections):
            self._counters.sections += 1
            series = hae.read_series(envelope.sections.pop(section), spacing=False)
            yield from self._fold_series(section, layers.RECORDS, None, series)
        self._finish(failure=None)

    def _resolve_layer(self, envelope: hae.Envelope, read: dict[str, hae.Series]) -> str | None:
        """The layer; without a header, every metric is read here, and kept for its fold."""
        layer = layers.layer_from_header(self._info.aggregation)
        if layer is not None:
            return layer
        for name, group in envelope.metrics.items():
            read[name] = hae.read_series(group.arrays, spacing=True)
            self._measured(read[name])
        layer = layers.layer_from_spacing(self.spacing)
        if layer is not None:
            return layer
        return self._projection.inherited_layer()

    def _measured(self, series: hae.Series) -> None:
        if series.spacing and (self.spacing is None or series.spacing < self.spacing):
            self.spacing = series.spacing

    def _units(self, metric: str, entries: list[str | None]) -> str | None:
        """The units of a metric's entries: the smallest in string order; every other entry
        counts as a mismatch, and a metric with any says so once (S7)."""
        present = sorted({u for u in entries if u is not None})
        if not present:
            return None
        mismatches = sum(1 for u in entries if u not in (None, present[0]))
        if mismatches:
            self._counters.unit_mismatches += mismatches
            log.log(
                self._warn_level,
                "unit mismatch within the delivery, the first units in string order kept"
                " metric=%s layer=%s delivery=%d",
                metric,
                self._layer,
                self._info.id,
            )
        return present[0]

    def _count_rejected(self, series: hae.Series) -> None:
        for reason, count in series.rejections.items():
            self._counters.points_rejected += count
            self._rejections[f"point rejected: {reason}"] += count

    def _fold_series(
        self, metric: str, layer: str, units: str | None, series: hae.Series
    ) -> Iterator[HourlyObject]:
        def on_collision(coords: Coordinates, kind: Collision) -> None:
            self._warn(kind, metric, layer, hour_of(coords[0]))

        self._count_rejected(series)
        self._counters.points += series.accepted
        named = _named(metric, layer)
        for hour, keys, raws in series.hours():
            self._check_budget()
            if named is not None:
                keys = [
                    named_at(key[0], key[1], raw, named)
                    for key, raw in zip(keys, raws, strict=True)
                ]
            incoming = reduce_delivery(keys, raws, self._counters, on_collision)
            written = self._fold_object(ObjectKey(metric, layer, hour), units, incoming)
            if written is not None:
                yield written

    def _fold_object(
        self, key: ObjectKey, units: str | None, incoming: Incoming
    ) -> HourlyObject | None:
        def on_collision(coords: Coordinates, kind: Collision) -> None:
            self._warn(kind, key.metric, key.layer, key.hour)

        stored = self._projection.load(key)
        sealed = self._projection.sealed(key)
        if stored is None:
            points: dict[Coordinates, bytes] = {}
            created_by, object_units = self._info.id, units
        else:
            points = objects.decode(
                stored.body, compressed=not self._plain, named=_named(key.metric, key.layer)
            )
            created_by, sealed = stored.created_by, sealed or stored.sealed
            object_units = stored.units if stored.units is not None else units
            if units is not None and units != object_units:
                self._counters.unit_mismatches += 1
                self._warn("unit mismatch, stored units kept", key.metric, key.layer, key.hour)
        changed = merge_points(points, incoming, self._counters, on_collision)
        if not changed and (stored is None or stored.units == object_units):
            self._counters.objects_unchanged += 1
            return None
        if sealed:
            self._counters.sealed_writes += 1
            self._warn("write to a sealed object", key.metric, key.layer, key.hour)
        self._counters.objects_written += 1
        return objects.encode(
            key, object_units, points, created_by, sealed, compressed=not self._plain
        )

    def _warn(self, what: str | Collision, metric: str, layer: str, hour: int) -> None:
        """Log ``what`` about an object, a collision by its kind; nothing is formatted when the
        level is off, since a re-send has a collision for about every point it carries."""
        if not log.isEnabledFor(self._warn_level):
            return
        log.log(
            self._warn_level,
            "%s metric=%s layer=%s hour=%s delivery=%d",
            f"point collision kind={what.value}" if isinstance(what, Collision) else what,
            metric,
            layer,
            format_instant(hour),
            self._info.id,
        )

    def _finish(self, failure: str | None) -> None:
        rejected = self._counters.points_rejected + self._counters.entries_rejected
        if failure is None and rejected and not self._counters.points:
            failure = "nothing could be read"
        if failure is not None:
            status = FAILED
        elif rejected:
            status = PARTIAL
        else:
            status = PARSED
        self.outcome = Outcome(
            status=status,
            reason=_reason(failure, self._rejections),
            layer=self._layer,
            counters=self._counters,
        )


def _named(metric: str, layer: str) -> str | None:
    """The field that tells the records of one moment apart in this object, if any (MERGE-35)."""
    return hae.RECORD_NAMES.get(metric) if layer == layers.RECORDS else None


def _reason(failure: str | None, rejections: Counter[str]) -> str | None:
    parts = [failure] if failure else []
    parts.extend(f"{text} (x{count})" for text, count in rejections.most_common(5))
    if len(rejections) > 5:
        parts.append(f"and {len(rejections) - 5} more kinds")
    return "; ".join(parts) or None
