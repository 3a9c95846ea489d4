"""Layer resolution (P5): the time grouping of the automation that sent a delivery.

Order: the ``automation-aggregation`` header; else the spacing of the delivery's dense
metrics; else the layer of the preceding delivery of the same automation in journal
order (the caller looks it up); else the layer is not derivable.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import islice

import msgspec

from healthlog.points import instant_of
from healthlog.timestamps import TimestampError

LAYERS = ("seconds", "minutes", "hours", "days", "weeks", "months", "years", "default")
RECORDS = "records"
STORED_LAYERS = (*LAYERS, RECORDS)
"""Every layer an object can be stored under: an automation's, or the sections' ``records``."""
STORED_LAYERS_TEXT = ", ".join(STORED_LAYERS)

_SECOND = 1_000_000
_DAY = 86_400 * _SECOND
# Upper bounds of the smallest spacing between consecutive points for each layer. Days are
# bounded well above 25 h so that DST days (23 h and 25 h) stay days; sparse minute data
# still has some points one minute apart.
_SPACING_BOUNDS = (
    (30 * _SECOND, "seconds"),
    (30 * 60 * _SECOND, "minutes"),
    (12 * 3600 * _SECOND, "hours"),
    (4 * _DAY, "days"),
    (20 * _DAY, "weeks"),
    (200 * _DAY, "months"),
)


class _Stamps(msgspec.Struct):
    start: object = msgspec.UNSET
    startDate: object = msgspec.UNSET
    date: object = msgspec.UNSET


def layer_from_header(value: str | None) -> str | None:
    """The layer named by an ``automation-aggregation`` header, or None if absent or unknown."""
    if value is None:
        return None
    layer = value.strip().lower()
    return layer if layer in LAYERS else None


def stored_layer(value: str) -> str | None:
    """The stored layer ``value`` names in any case (``Minutes``, ``RECORDS``), or None."""
    layer = value.strip().lower()
    return layer if layer in STORED_LAYERS else None


def layer_from_spacing(smallest: int | None) -> str | None:
    """The layer whose grouping matches the smallest spacing (microseconds) between points."""
    if smallest is None:
        return None
    for bound, layer in _SPACING_BOUNDS:
        if smallest < bound:
            return layer
    return "years"


def smallest_spacing(starts: Sequence[int]) -> int | None:
    """Smallest positive gap between consecutive starts (microseconds) of one metric.

    Starts mostly come in order already; then no sorted copy is made.
    """
    ordered = starts if all(map(operator.le, starts, islice(starts, 1, None))) else sorted(starts)
    return min(filter(None, map(operator.sub, islice(ordered, 1, None), ordered)), default=None)


def spacing_start(raw: bytes | msgspec.Raw) -> int | None:
    """The start one point brings to its metric's spacing, read from its bytes alone.

    Only points stamped by ``start`` or ``date`` count: segment records stamped by
    ``startDate`` (unaggregated sleep) have no regular spacing. This reading asks nothing
    else of the point, so a point rejected for another reason may still count.
    """
    try:
        stamp = msgspec.json.decode(raw, type=_Stamps)
    except (msgspec.DecodeError, RecursionError):
        return None
    return _stamp_start(stamp)


def _stamp_start(stamp: _Stamps) -> int | None:
    if stamp.start is not msgspec.UNSET:
        value = stamp.start
    elif stamp.startDate is not msgspec.UNSET:
        return None
    else:
        value = stamp.date
    try:
        return instant_of(value)
    except TimestampError:
        return None
