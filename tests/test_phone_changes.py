"""What the phone side changing over the years does to the points, through a real ``serve``.

Scenarios: MERGE-40 (specs/merge.md), TIME-50 (specs/timestamps.md), PARSE-55 and PARSE-56
(specs/parsing.md). Each delivers the bodies a user's phone sends around one change (a new
iPhone beside the old one, a trip, an app update, a headerless "Default" grouping) over HTTP
and reads ``GET /v1/points`` as the user does. They hold the figures the README's "When the
phone side changes" gives, so that a change to the rules behind them shows here first.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from _service_helpers import Service, serving


async def post_folded(
    service: Service, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """POST ``body`` with the app's ``headers``, wait until it is folded, return its outcome."""
    response = await service.post(json.dumps(body).encode(), headers)
    assert response.status_code == 200, response.text
    await service.wait_folded()
    outcome = await service.get(f"/v1/deliveries/{response.json()['delivery_id']}")
    document: dict[str, Any] = outcome.json()
    return document


async def read_points(service: Service, **params: str) -> list[dict[str, Any]]:
    response = await service.get("/v1/points", **params)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.content.splitlines()]


def metric(name: str, units: str, data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"data": {"metrics": [{"name": name, "units": units, "data": data}]}}


def changed(outcome: dict[str, Any]) -> dict[str, int]:
    """The counters of an outcome that are not zero, but for the counts of what it carried."""
    return {
        name: count
        for name, count in outcome["counters"].items()
        if count and name not in ("metrics", "sections", "points", "objects_unchanged")
    }


async def test_a_new_iphone_beside_the_old_one_merge_40(tmp_path: Path) -> None:
    """MERGE-40: the old and the new iPhone send the same hour of minute steps, each under its
    own device names; the points stay single, and each turn of the other phone replaces all of
    them (erased, one object written)."""

    def hour(phone: str) -> dict[str, Any]:
        source = f"Anna\u2019s {phone}|Anna\u2019s Apple Watch"
        return metric(
            "step_count",
            "count",
            [
                {
                    "date": f"2026-04-01 10:{minute:02d}:00 +0200",
                    "qty": 5 + minute % 7,
                    "source": source,
                }
                for minute in range(60)
            ],
        )

    def headers(automation: str) -> dict[str, str]:
        return {"automation-aggregation": "Minutes", "automation-id": automation}

    async with serving(tmp_path / "data") as service:
        first = await post_folded(service, hour("iPhone 12"), headers("old"))
        assert changed(first) == {"points_new": 60, "objects_written": 1}
        for phone, automation in [("iPhone 16", "new"), ("iPhone 12", "old"), ("iPhone 16", "new")]:
            turn = await post_folded(service, hour(phone), headers(automation))
            assert changed(turn) == {"points_erased": 60, "overwrites": 60, "objects_written": 1}
        stored = await read_points(service)
        assert len(stored) == 60
        assert {found["point"]["source"] for found in stored} == {
            "Anna\u2019s iPhone 16|Anna\u2019s Apple Watch"
        }


async def test_a_day_resent_after_a_trip_is_a_second_point_time_50(tmp_path: Path) -> None:
    """TIME-50: a week of daily steps stamped at local midnight -07:00, re-sent after the phone
    moved to +09:00, is stored under both midnights (14 points); minute points re-sent in the
    new offset are the same instants and change nothing."""

    def week(offset: str) -> dict[str, Any]:
        return metric(
            "step_count",
            "count",
            [
                {"date": f"2026-04-{day:02d} 00:00:00 {offset}", "qty": 1000 + day}
                for day in range(1, 8)
            ],
        )

    def minutes(hour: str) -> dict[str, Any]:
        return metric(
            "heart_rate",
            "count/min",
            [
                {"date": hour.replace("MM", f"{minute:02d}"), "Min": 50, "Avg": 60, "Max": 70}
                for minute in range(3)
            ],
        )

    async with serving(tmp_path / "data") as service:
        days = {"automation-aggregation": "Days", "automation-id": "D"}
        assert changed(await post_folded(service, week("-0700"), days))["points_new"] == 7
        assert changed(await post_folded(service, week("+0900"), days))["points_new"] == 7
        stored = await read_points(service, layer="days")
        assert len(stored) == 14
        assert [found["start"] for found in stored[:2]] == [
            "2026-03-31T15:00:00Z",
            "2026-04-01T07:00:00Z",
        ]

        at_minutes = {"automation-aggregation": "Minutes", "automation-id": "M"}
        await post_folded(service, minutes("2026-04-07 10:MM:00 -0700"), at_minutes)
        again = await post_folded(service, minutes("2026-04-08 02:MM:00 +0900"), at_minutes)
        assert changed(again) == {"points_unchanged": 3}
        assert len(await read_points(service, layer="minutes")) == 3


async def test_an_app_update_that_writes_dates_otherwise_parse_55(tmp_path: Path) -> None:
    """PARSE-55: aggregated sleep dated by a date alone, then the same nights dated at local
    midnight with the offset; hourly points stamped by ``date``, then the same hours with
    ``start`` and ``end`` beside it: each is stored twice."""

    def nights(date: str) -> dict[str, Any]:
        return metric(
            "sleep_analysis",
            "hr",
            [
                {
                    "date": date % day,
                    "totalSleep": 7 + day / 10,
                    "sleepStart": f"2026-03-{day - 1:02d} 22:00:00 -0600",
                    "sleepEnd": f"2026-03-{day:02d} 05:00:00 -0600",
                }
                for day in range(24, 31)
            ],
        )

    def hours(interval: bool) -> dict[str, Any]:
        return metric(
            "heart_rate",
            "count/min",
            [
                {
                    "date": f"2026-03-14 {hour:02d}:00:00 +0000",
                    "Min": 50,
                    "Avg": 60 + hour,
                    "Max": 70,
                }
                | (
                    {
                        "start": f"2026-03-14 {hour:02d}:00:00 +0000",
                        "end": f"2026-03-14 {hour + 1:02d}:00:00 +0000",
                    }
                    if interval
                    else {}
                )
                for hour in range(6)
            ],
        )

    async with serving(tmp_path / "data") as service:
        days = {"automation-aggregation": "Days", "automation-id": "S"}
        await post_folded(service, nights("2026-03-%02d"), days)
        updated = await post_folded(service, nights("2026-03-%02d 00:00:00 -0600"), days)
        assert changed(updated) == {"points_new": 7, "objects_written": 7}
        sleep = await read_points(service, metric="sleep_analysis")
        assert [found["start"] for found in sleep[:2]] == [
            "2026-03-24T00:00:00Z",
            "2026-03-24T06:00:00Z",
        ]
        assert round(sum(found["point"]["totalSleep"] for found in sleep), 1) == 135.8

        hourly = {"automation-aggregation": "Hours", "automation-id": "H"}
        await post_folded(service, hours(interval=False), hourly)
        assert changed(await post_folded(service, hours(interval=True), hourly))["points_new"] == 6
        assert len(await read_points(service, metric="heart_rate")) == 12


async def test_a_headerless_default_grouping_lands_in_two_layers_parse_56(
    tmp_path: Path,
) -> None:
    """PARSE-56: without the aggregation header, a "Default" grouping's delivery is `seconds`
    when its heart rate has samples under 30 s apart and `minutes` when it has none, so the
    same minutes of steps are stored in both layers, and in `default` once the header comes."""
    heart_rate = {
        "name": "heart_rate",
        "units": "count/min",
        "data": [
            {"date": f"2026-03-14 10:00:{second:02d} +0100", "Min": 70, "Avg": 70, "Max": 70}
            for second in (0, 5)
        ],
    }
    steps = {
        "name": "step_count",
        "units": "count",
        "data": [
            {"date": f"2026-03-14 10:{minute:02d}:00 +0100", "qty": 10 + minute}
            for minute in range(10)
        ],
    }
    named = {"automation-name": "Health"}
    async with serving(tmp_path / "data") as service:
        await post_folded(service, {"data": {"metrics": [heart_rate, steps]}}, named)
        await post_folded(service, {"data": {"metrics": [steps]}}, named)
        await post_folded(
            service,
            {"data": {"metrics": [heart_rate, steps]}},
            {**named, "automation-aggregation": "Default"},
        )
        layers = collections.Counter(
            found["layer"] for found in await read_points(service, metric="step_count")
        )
        assert layers == {"seconds": 10, "minutes": 10, "default": 10}
