"""Health Auto Export-like bodies for tests, generated from a seed (no real data involved).

``make_body`` writes a delivery in the app's shape::

    {"data": {"metrics": [{"name": ..., "units": ..., "data": [point, ...]}, ...]}}

with dates as ``yyyy-MM-dd HH:mm:ss ±hhmm`` and the keys of every point in a seeded random
order, as the app does. The same seed gives the same bytes.

The re-send helpers take a body and return another delivery of the same points:

- ``resend``: the same content in other bytes (array order, key order, last-digit float noise,
  optionally every timestamp in another UTC offset); equal canonical forms.
- ``poorer``: without the optional fields (``source``, ``context``): less complete.
- ``richer``: with an extra ``metadata`` field: more complete.
- ``conflicting``: every number changed, same fields: equally complete, different content.

``MemoryProjection`` and ``fold`` drive a :class:`~healthlog.fold.DeliveryFold` the way storage
does, against a dict of stored objects.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from healthlog.fold import DeliveryFold, DeliveryInfo, Outcome
from healthlog.objects import HourlyObject, ObjectKey
from healthlog.points import TIMESTAMP_KEYS
from healthlog.seals import Seal, covered

APP_FORMAT = "%Y-%m-%d %H:%M:%S %z"
DEFAULT_START = datetime(2024, 2, 6, 7, 0, tzinfo=timezone(timedelta(hours=-8)))
DEFAULT_METRICS = ("heart_rate", "step_count")
DEFAULT_SOURCE = "Anna\u2019s Apple\u00a0Watch|iPhone"
OPTIONAL_FIELDS = ("source", "context")
LAYER_SECONDS = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86_400}
UNITS = {
    "heart_rate": "count/min",
    "step_count": "count",
    "blood_pressure": "mmHg",
    "sleep_analysis": "hr",
}
SLEEP_STAGES = ("Core", "Deep", "REM", "Awake")
CONTEXTS = ("resting", "walking", "workout")


def app_date(moment: datetime) -> str:
    """A timestamp in the app's main shape, e.g. ``2024-02-06 07:00:00 -0800``."""
    return moment.strftime(APP_FORMAT)


def _values(metric: str, rng: random.Random) -> dict[str, Any]:
    if metric == "heart_rate":
        low = round(rng.uniform(45, 70), 3)
        return {
            "Min": low,
            "Avg": round(low + rng.uniform(1, 20), 3),
            "Max": round(low + rng.uniform(25, 90), 3),
        }
    if metric == "blood_pressure":
        return {"systolic": rng.randint(105, 140), "diastolic": rng.randint(60, 90)}
    if metric == "step_count":
        return {"qty": rng.randint(1, 120)}
    return {"qty": round(rng.uniform(0, 500), 3)}


def _point(metric: str, moment: datetime, step: int, rng: random.Random) -> dict[str, Any]:
    if metric == "sleep_analysis":
        end = moment + timedelta(seconds=step)
        return {
            "startDate": app_date(moment),
            "endDate": app_date(end),
            "value": rng.choice(SLEEP_STAGES),
            "qty": round(step / 3600, 6),
        }
    return {"date": app_date(moment), **_values(metric, rng)}


def make_body(
    seed: int,
    *,
    metrics: Sequence[str] = DEFAULT_METRICS,
    layer: str = "minutes",
    start: datetime = DEFAULT_START,
    hours: int = 1,
    source: str = DEFAULT_SOURCE,
    richness: int = 1,
    noise: bool = False,
) -> bytes:
    """A delivery of ``hours`` worth of points per metric, spaced by ``layer``.

    Shapes by metric name: ``heart_rate`` Min/Avg/Max, ``blood_pressure`` systolic/diastolic,
    ``sleep_analysis`` startDate/endDate segments, anything else ``qty``. ``richness`` 0 gives
    bare points, 1 adds ``source``, 2 adds ``source`` and ``context``. ``noise`` moves every
    float by one unit in the last place (the app's ``46.00000000000001``). Days start at the
    local midnight of ``start``.
    """
    rng = random.Random(seed)
    step = LAYER_SECONDS[layer]
    if layer == "days":
        start = start.replace(hour=0, minute=0, second=0)
    count = max(1, hours * 3600 // step)
    entries = []
    for metric in metrics:
        data = []
        for index in range(count):
            point = _point(metric, start + timedelta(seconds=index * step), step, rng)
            if richness >= 1:
                point["source"] = source
            if richness >= 2:
                point["context"] = rng.choice(CONTEXTS)
            data.append(point)
        entries.append({"name": metric, "units": UNITS.get(metric, "count"), "data": data})
    body = {"data": {"metrics": entries}}
    if noise:
        body = _map_numbers(body, _noisy)
    return dump(body, rng)


def dump(value: Any, rng: random.Random) -> bytes:
    """JSON bytes with every object's keys in a random order; UTF-8, nothing escaped."""
    return json.dumps(shuffled(value, rng), ensure_ascii=False).encode()


def shuffled(value: Any, rng: random.Random) -> Any:
    """``value`` with every object's keys in a random order, at every depth."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


def _noisy(number: float) -> float:
    """One unit in the last place up; zero stays zero (its next double is subnormal)."""
    return math.nextafter(float(number), math.inf) if number else number


def _map_numbers(value: Any, change: Callable[[float], float]) -> Any:
    if isinstance(value, dict):
        return {k: _map_numbers(v, change) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_numbers(v, change) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return change(value)
    return value


def _points(body: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    envelope = json.loads(body)
    return envelope, [p for m in envelope["data"]["metrics"] for p in m["data"]]


def resend(body: bytes, seed: int, *, offset: timedelta | None = None) -> bytes:
    """The same points in other bytes: shuffled arrays and keys, float noise, another offset."""
    rng = random.Random(seed)
    envelope = _map_numbers(json.loads(body), _noisy)
    for metric in envelope["data"]["metrics"]:
        rng.shuffle(metric["data"])
        if offset is not None:
            zone = timezone(offset)
            for point in metric["data"]:
                for key in TIMESTAMP_KEYS & point.keys():
                    moment = datetime.strptime(point[key], APP_FORMAT)
                    point[key] = app_date(moment.astimezone(zone))
    return dump(envelope, rng)


def poorer(body: bytes, seed: int) -> bytes:
    """The same points without their optional fields (needs richness 1 or more)."""
    envelope, points = _points(body)
    for point in points:
        for key in OPTIONAL_FIELDS:
            point.pop(key, None)
    return dump(envelope, random.Random(seed))


def richer(body: bytes, seed: int) -> bytes:
    """The same points with one more field."""
    envelope, points = _points(body)
    for point in points:
        point["metadata"] = {"HKWasUserEntered": 0, "note": "re-sent"}
    return dump(envelope, random.Random(seed))


def conflicting(body: bytes, seed: int) -> bytes:
    """The same points and fields with every number changed: equally complete, new content."""
    envelope = _map_numbers(json.loads(body), lambda number: round(number + 1.25, 3))
    return dump(envelope, random.Random(seed))


class MemoryProjection:
    """Stored objects in a dict, read the way the fold reads the projection."""

    def __init__(self, inherited: str | None = None) -> None:
        self.objects: dict[ObjectKey, HourlyObject] = {}
        self.inherited = inherited
        self.seals: list[Seal] = []

    def load(self, key: ObjectKey) -> HourlyObject | None:
        return self.objects.get(key)

    def inherited_layer(self) -> str | None:
        return self.inherited

    def sealed(self, key: ObjectKey) -> bool:
        return covered(self.seals, key)


def fold(
    body: bytes,
    projection: MemoryProjection,
    *,
    delivery_id: int = 1,
    aggregation: str | None = None,
) -> tuple[list[HourlyObject], Outcome]:
    """Fold one delivery like storage does: store every yielded object, then read the outcome."""
    run = DeliveryFold(body, DeliveryInfo(delivery_id, delivery_id, aggregation), projection)
    written = []
    for obj in run.writes():
        projection.objects[obj.key] = obj
        written.append(obj)
    assert run.outcome is not None
    return written, run.outcome
