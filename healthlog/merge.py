"""Merge by completeness (S5), as pure functions over points keyed by coordinates.

The table, for a point arriving at coordinates already stored:

================================  ==========================  ==================
incoming against stored           result                      counter
================================  ==========================  ==================
same canonical form               stored kept, nothing moves  points_unchanged
same value, other date offsets    incoming replaces stored    points_unchanged
more complete                     incoming replaces stored    points_replaced
less complete                     stored kept                 points_held
equally complete, different       incoming replaces stored    points_erased
================================  ==========================  ==================

"Same value, other date offsets": the canonical forms differ only by dates under
``OTHER_DATE_KEYS`` that are the same instants in other offsets (equal instant forms,
MERGE-31). It is no collision, but its bytes are kept as the erased row's are, which is what
an earlier version kept, so that a store folded by it rebuilds the same.

Within one delivery, points at equal coordinates are first reduced to one: the more
complete wins, then the greater canonical form, then the greater raw bytes, so the result
never depends on array order. Every collision between different values (different instant
forms) counts one overwrite; within a delivery, a coordinate with n distinct values counts
n - 1 and logs one warning, whatever the array order.

Points come as raw bytes and are decoded (canonical form, completeness) only where they meet
another point: most of a large delivery lands on free coordinates and needs neither.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from enum import Enum
from typing import Any

import attrs

from healthlog.points import (
    Coordinates,
    Point,
    all_same_content,
    decode_all,
    field_count,
    numbers_differ,
    point_at,
    points_at,
    same_content,
    same_value,
)


class Collision(Enum):
    """How an incoming point met a stored one with a different canonical form."""

    WITHIN_DELIVERY = "within_delivery"
    REPLACED = "replaced"
    HELD = "held"
    ERASED = "erased"


@attrs.define
class Counters:
    """Per-delivery fold counters; every field is a count."""

    metrics: int = 0
    sections: int = 0
    points: int = 0
    points_new: int = 0
    points_unchanged: int = 0
    points_replaced: int = 0
    points_held: int = 0
    points_erased: int = 0
    overwrites: int = 0
    unit_mismatches: int = 0
    sealed_writes: int = 0
    points_rejected: int = 0
    entries_rejected: int = 0
    unknown_sections: int = 0
    objects_written: int = 0
    objects_unchanged: int = 0


OnCollision = Callable[[Coordinates, Collision], None]


def _rank(point: Point) -> tuple[int, bytes, bytes]:
    return point.completeness, point.canonical, point.raw


@attrs.define
class Incoming:
    """One delivery's points of one object, reduced to one per coordinates.

    ``raws`` holds every point's bytes, ``decoded`` those points already decoded (they met
    another point of the delivery), so that no point is decoded twice.
    """

    raws: dict[Coordinates, bytes]
    decoded: dict[Coordinates, Point]

    def points(self, keys: list[Coordinates], values: list[Any] | None = None) -> list[Point]:
        """The points at ``keys``, decoding together those not decoded yet, or taking them
        from ``values``, the JSON values of the points at ``keys`` when decoded already."""
        at = [n for n, key in enumerate(keys) if key not in self.decoded]
        missing = [keys[n] for n in at]
        fresh = dict(
            zip(
                missing,
                points_at(
                    [self.raws[key] for key in missing],
                    missing,
                    None if values is None else [values[n] for n in at],
                ),
                strict=True,
            )
        )
        return [self.decoded.get(key) or fresh[key] for key in keys]


def reduce_delivery(
    keys: list[Coordinates],
    raws: list[bytes],
    counters: Counters,
    on_collision: OnCollision,
) -> Incoming:
    """Reduce the points of one delivery to one per coordinates, independent of their order.

    Point ``i`` is at ``keys[i]`` with the bytes ``raws[i]``. Only points that share their
    coordinates are decoded here: their completeness and canonical form decide.
    """
    reduced = dict(zip(keys, raws, strict=True))
    if len(reduced) == len(keys):
        return Incoming(reduced, {})
    shared = {key for key, count in Counter(keys).items() if count > 1}
    kept: dict[Coordinates, Point] = {}
    forms: dict[Coordinates, set[bytes]] = {}
    for i, key in enumerate(keys):
        if key not in shared:
            continue
        point = point_at(raws[i], key[0], key[1])
        seen = kept.get(key)
        if seen is None:
            kept[key] = point
            continue
        if key in forms or not same_content(seen, point):
            forms.setdefault(key, {seen.instant_form}).add(point.instant_form)
        if _rank(point) > _rank(seen):
            kept[key] = point
    for key in sorted(forms):
        if len(forms[key]) > 1:
            counters.overwrites += len(forms[key]) - 1
            on_collision(key, Collision.WITHIN_DELIVERY)
    for key, point in kept.items():
        reduced[key] = point.raw
    return Incoming(reduced, kept)


def merge_points(
    stored: dict[Coordinates, bytes],
    incoming: Incoming,
    counters: Counters,
    on_collision: OnCollision,
) -> bool:
    """Merge one delivery's reduced points into stored raw points, in place.

    Returns whether anything stored changed.
    """
    if not stored:
        stored.update(incoming.raws)
        counters.points_new += len(incoming.raws)
        return bool(incoming.raws)
    changed = False
    meeting: list[Coordinates] = []
    for key, raw in incoming.raws.items():
        old_raw = stored.get(key)
        if old_raw is None:
            stored[key] = raw
            counters.points_new += 1
            changed = True
        elif old_raw == raw:
            counters.points_unchanged += 1
        else:
            meeting.append(key)
    if not meeting:
        return changed
    old_raws = [stored[key] for key in meeting]
    new_raws = [incoming.raws[key] for key in meeting]
    old_values = new_values = None
    # The same points with their keys in another order have, pair by pair, the same length:
    # only then are the meetings worth settling at once.
    if list(map(len, old_raws)) == list(map(len, new_raws)):
        old_values, new_values = decode_all(old_raws), decode_all(new_raws)
        if (
            old_values is not None
            and new_values is not None
            and all_same_content(old_values, new_values)
        ):
            counters.points_unchanged += len(meeting)
            return changed
    elif not incoming.decoded:
        old_values, new_values = decode_all(old_raws), decode_all(new_raws)
    if (
        not incoming.decoded
        and old_values is not None
        and new_values is not None
        and set(map(type, old_values)) == set(map(type, new_values)) == _OBJECTS
    ):
        return (
            _settle_meetings(
                stored,
                meeting,
                (old_raws, old_values),
                (new_raws, new_values),
                counters,
                on_collision,
            )
            or changed
        )
    olds = points_at(old_raws, meeting, old_values)
    for key, old, point in zip(meeting, olds, incoming.points(meeting, new_values), strict=True):
        if same_content(old, point):
            counters.points_unchanged += 1
            continue
        if point.completeness == old.completeness and same_value(old, point):
            # No collision, but the bytes kept are the erased row's (see the table).
            counters.points_unchanged += 1
            stored[key] = point.raw
            changed = True
            continue
        counters.overwrites += 1
        if point.completeness > old.completeness:
            counters.points_replaced += 1
            collision = Collision.REPLACED
        elif point.completeness < old.completeness:
            counters.points_held += 1
            on_collision(key, Collision.HELD)
            continue
        else:
            counters.points_erased += 1
            collision = Collision.ERASED
        on_collision(key, collision)
        stored[key] = point.raw
        changed = True
    return changed


_OBJECTS = {dict}


def _settle_meetings(
    stored: dict[Coordinates, bytes],
    meeting: list[Coordinates],
    olds: tuple[list[bytes], list[Any]],
    news: tuple[list[bytes], list[Any]],
    counters: Counters,
    on_collision: OnCollision,
) -> bool:
    """The meetings of :func:`merge_points` whose points are all decoded objects (``olds`` and
    ``news``: the raw bytes and decoded values of the stored and incoming points, pair by pair),
    settled as its loop settles them; a pair of a different completeness is decided by the two
    counts alone, without building either point (MERGE-26). Returns whether anything stored
    changed."""
    old_raws, old_values = olds
    new_raws, new_values = news
    changed = False
    unchanged = replaced = held = erased = 0
    for n, key in enumerate(meeting):
        old_value, new_value = old_values[n], new_values[n]
        old_count, new_count = field_count(old_value), field_count(new_value)
        if new_count > old_count:
            replaced += 1
            collision = Collision.REPLACED
        elif new_count < old_count:
            held += 1
            on_collision(key, Collision.HELD)
            continue
        else:
            # As same_content decides it: the raw bytes differ (else they would not meet) and
            # so does a number, or the points are compared as same_content compares them.
            if not numbers_differ(old_value, new_value):
                start, end = key[0], key[1]
                old = Point(start, end, old_raws[n], old_count, old_value, None)
                point = Point(start, end, new_raws[n], new_count, new_value, None)
                if same_content(old, point):
                    unchanged += 1
                    continue
                if same_value(old, point):
                    unchanged += 1
                    stored[key] = new_raws[n]
                    changed = True
                    continue
            erased += 1
            collision = Collision.ERASED
        on_collision(key, collision)
        stored[key] = new_raws[n]
        changed = True
    counters.points_unchanged += unchanged
    counters.points_replaced += replaced
    counters.points_held += held
    counters.points_erased += erased
    counters.overwrites += replaced + held + erased
    return changed
