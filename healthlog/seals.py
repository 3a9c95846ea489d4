"""Seals (S9): the user's word that what ended by an instant is final.

A seal is journaled like a delivery, so that it takes its place in journal order and a rebuild
folds it where the live folder did. It covers every object whose longest period has ended at or
before ``before`` (optionally of one metric, one layer): an hourly object's hour, a daily total's
day wherever its user lives (:data:`SPANS`); from its place on, a covered object is
sealed: the seal marks those already stored, and a later write to a covered object (stored or
new) is still saved but counted and logged as a sealed write.

A journaled seal is told from a delivery by its client and content type together; the client
name is one that no token can have (token names beginning ``cli:`` are reserved).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import msgspec

from healthlog.objects import ObjectKey
from healthlog.timestamps import US_PER_HOUR, TimestampError, format_instant, parse_instant

SEAL_CLIENT = "cli:seal"
SEAL_CONTENT_TYPE = "application/vnd.healthlog.seal+json"

_DAY = 24 * US_PER_HOUR
SPANS = {
    "days": 25 * US_PER_HOUR,
    "weeks": 7 * _DAY + US_PER_HOUR,
    "months": 31 * _DAY + US_PER_HOUR,
    "years": 366 * _DAY + US_PER_HOUR,
}
"""How long after its hour's start the longest period an object of each layer can hold ends
(every other layer's: :data:`US_PER_HOUR`). The app stamps a daily or longer total at the
user's local midnight, the UTC hour of which is all the object keeps: a day of 25 h (DST), a
week of 7 such days, a month of 31 and a year of 366. By the hour alone (before SEAL-22),
a seal before midnight UTC covered the next day's total east of UTC, still being counted,
and west of UTC a day hours before it ended."""


def span(layer: str) -> int:
    """The longest period of ``layer`` (:data:`SPANS`)."""
    return SPANS.get(layer, US_PER_HOUR)


class SealError(ValueError):
    """A seal body that cannot be read; the message quotes nothing of it."""


@attrs.frozen
class Seal:
    """The objects whose longest period (:func:`span`) ends at or before ``before`` (UTC
    microseconds), of ``metric`` and ``layer`` when given."""

    before: int
    metric: str | None = None
    layer: str | None = None

    def covers(self, key: ObjectKey) -> bool:
        return (
            key.hour + span(key.layer) <= self.before
            and (self.metric is None or key.metric == self.metric)
            and (self.layer is None or key.layer == self.layer)
        )

    def encode(self) -> bytes:
        """The journaled body."""
        return msgspec.json.encode(
            {
                "seal": {
                    "before": format_instant(self.before),
                    "metric": self.metric,
                    "layer": self.layer,
                }
            }
        )


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    before: str
    metric: str | None = None
    layer: str | None = None


def is_seal(client: str, content_type: str | None) -> bool:
    """Whether a journal entry with this client and content type is a seal."""
    return client == SEAL_CLIENT and content_type == SEAL_CONTENT_TYPE


def decode(body: bytes) -> Seal:
    """The seal a journaled body holds; :class:`SealError` when it holds none."""
    try:
        read = msgspec.json.decode(body, type=dict[str, _Body])
    except (msgspec.DecodeError, RecursionError):
        raise SealError("seal body is not a seal document") from None
    if read.keys() != {"seal"}:
        raise SealError("seal body is not a seal document")
    inner = read["seal"]
    try:
        before = parse_instant(inner.before)
    except TimestampError:
        raise SealError("seal body has an unreadable instant") from None
    if inner.metric == "" or inner.layer == "":
        raise SealError("seal body names an empty metric or layer")
    return Seal(before, inner.metric, inner.layer)


def covered(seals: Sequence[Seal], key: ObjectKey) -> bool:
    """Whether any of ``seals`` covers ``key``."""
    return any(seal.covers(key) for seal in seals)


def folded_into(kept: tuple[Seal, ...], seal: Seal) -> tuple[Seal, ...]:
    """``kept`` (at most one seal per metric and layer) with ``seal`` folded in: in place of
    the one of its metric and layer if that ends no later, else unchanged. What they cover
    together is what every seal folded so far covers (SEAL-18)."""
    if any(
        (other.metric, other.layer) == (seal.metric, seal.layer) and other.before > seal.before
        for other in kept
    ):
        return kept
    others = (other for other in kept if (other.metric, other.layer) != (seal.metric, seal.layer))
    return (*others, seal)
