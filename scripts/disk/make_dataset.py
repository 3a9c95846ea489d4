#!/usr/bin/env python3
"""Write the README's disk data set: 912 days of 36 metrics as Health Auto Export bodies.

Heart rate and active energy every minute, 17 metrics hourly, 17 daily; four deliveries a
day, each of the last 24 hours (3,649 deliveries, about 984 MB of JSON). Every point's value
comes from a generator seeded by --seed, the metric and the moment, so a delivery repeats the
points an earlier one sent for the same hours. Usage: make_dataset.py OUT_DIR [--seed N]
"""

import argparse
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

START = datetime(2024, 1, 1, tzinfo=UTC)
DELIVERIES = 3649
MINUTE = {"heart_rate": "count/min", "active_energy": "kcal"}
HOURLY = [f"hourly_metric_{i}" for i in range(17)]
DAILY = [f"daily_metric_{i}" for i in range(17)]


def point(seed: int, name: str, moment: datetime) -> dict[str, Any]:
    rng = random.Random(f"{seed}:{name}{moment.isoformat()}")
    shown = (moment + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M:%S") + " +0100"
    data: dict[str, Any] = {"date": shown, "source": "Watch"}
    if name == "heart_rate":
        low = round(rng.uniform(45, 70), 3)
        data.update(Min=low, Avg=round(low + rng.uniform(0, 20), 3), Max=low + 25)
    else:
        data["qty"] = round(rng.uniform(0, 120), 6)
    return data


def series(seed: int, name: str, moments: list[datetime]) -> list[dict[str, Any]]:
    return [point(seed, name, m) for m in sorted(moments) if m >= START]


def delivery(seed: int, n: int) -> bytes:
    end = START + timedelta(hours=6 * (n + 1))
    begin = end - timedelta(hours=24)
    metrics = []
    for name, units in MINUTE.items():
        minutes = [begin + timedelta(minutes=i) for i in range(24 * 60)]
        metrics.append({"name": name, "units": units, "data": series(seed, name, minutes)})
    for name in HOURLY:
        hours = [begin + timedelta(hours=i) for i in range(24)]
        metrics.append({"name": name, "units": "count", "data": series(seed, name, hours)})
    last_day = end.replace(hour=0) - timedelta(days=0 if end.hour else 1)
    days = [d for d in {begin.replace(hour=0), last_day} if d < end]
    for name in DAILY:
        metrics.append({"name": name, "units": "count", "data": series(seed, name, days)})
    return orjson.dumps({"data": {"metrics": metrics}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deliveries", type=int, default=DELIVERIES)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for n in range(args.deliveries):
        (args.out / f"{n:05d}.json").write_bytes(delivery(args.seed, n))


if __name__ == "__main__":
    main()
