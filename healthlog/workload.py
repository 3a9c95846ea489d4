"""A seeded generator of Health Auto Export deliveries, for the harness and the benchmarks.

Bodies are minute-level metrics in the app's shape, with keys in a random order; re-sends of
a window come identical (other bytes, same content), poorer (optional fields dropped), richer
(an extra field) or conflicting (every value changed). The same seed gives the same bytes.
Every point carries a distinctive ``source`` so that logs can be searched for leaked values.
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

METRICS = {"heart_rate": "count/min", "step_count": "count", "active_energy": "kcal"}
LEAK_MARKER = "Chaos\u2019s Watch \u231a"
VARIANTS = ("identical", "poorer", "richer", "conflicting")
EPOCH = datetime(2025, 3, 1, tzinfo=UTC)
LARGEST_MIB = 62


def _stamp(moment: datetime, offset_hours: int) -> str:
    """The app's ``yyyy-MM-dd HH:mm:ss ±hhmm`` in the phone's offset."""
    local = moment + timedelta(hours=offset_hours)
    sign = "+" if offset_hours >= 0 else "-"
    return local.strftime("%Y-%m-%d %H:%M:%S") + f" {sign}{abs(offset_hours):02d}00"


def _point(metric: str, moment: datetime, rng: random.Random, offset: int) -> dict[str, Any]:
    point: dict[str, Any] = {"date": _stamp(moment, offset), "source": LEAK_MARKER}
    if metric == "heart_rate":
        low = round(rng.uniform(45, 70), 3)
        point.update(Min=low, Avg=round(low + rng.uniform(0, 20), 3), Max=low + 25)
    else:
        point["qty"] = round(rng.uniform(0, 120), 6)
    if rng.random() < 0.3:
        point["context"] = rng.choice(("resting", "walking"))
    return point


def window(seed: int, *, first_minute: int, minutes: int) -> dict[str, Any]:
    """A delivery document covering ``minutes`` minutes from ``first_minute`` after the epoch."""
    rng = random.Random(seed)
    offset = rng.choice((-8, -5, 0, 1, 10))
    metrics = []
    for name, units in METRICS.items():
        data = [
            _point(name, EPOCH + timedelta(minutes=first_minute + i), rng, offset)
            for i in range(minutes)
            if rng.random() < 0.9
        ]
        metrics.append({"name": name, "units": units, "data": data})
    return {"data": {"metrics": metrics}}


def variant(document: dict[str, Any], kind: str, seed: int) -> dict[str, Any]:
    """A re-send of ``document``: identical, poorer, richer or conflicting content."""
    rng = random.Random(seed)
    metrics = []
    for entry in document["data"]["metrics"]:
        data = []
        for point in entry["data"]:
            changed = dict(point)
            if kind == "poorer":
                changed.pop("context", None)
                changed.pop("source", None)
            elif kind == "richer":
                changed["metadata"] = {"resent": True}
            elif kind == "conflicting":
                for key, value in point.items():
                    if isinstance(value, float):
                        changed[key] = round(value + rng.uniform(0.5, 5), 6)
            data.append(changed)
        metrics.append({**entry, "data": data})
    return {"data": {"metrics": metrics}}


def encode(document: Any, seed: int) -> bytes:
    """JSON bytes with every object's keys in a seeded random order, as the app sends them."""
    return orjson.dumps(_shuffled(document, random.Random(seed)))


def _shuffled(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {key: _shuffled(value[key], rng) for key in keys}
    if isinstance(value, list):
        return [_shuffled(item, rng) for item in value]
    return value


def big_body(seed: int, *, target_bytes: int) -> bytes:
    """A minute-level body of about ``target_bytes`` (the benchmarks' large case)."""
    per_minute = len(encode(window(seed, first_minute=0, minutes=60), seed)) / 60
    minutes = max(1, int(target_bytes / per_minute))
    return encode(window(seed, first_minute=0, minutes=minutes), seed)


def body_bytes(rng: random.Random) -> int:
    """A seeded body size from 1 to 62 MiB for a run, the large ones rare: ``62 ** (u ** 3)``
    MiB for a uniform ``u``, so half are under 1.7 MiB, one in five over 8 and one in
    seventeen over 31 (a few MiB on average, which keeps a 20-run harness short)."""
    return round(2**20 * math.pow(LARGEST_MIB, rng.random() ** 3))
