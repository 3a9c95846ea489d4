"""What a user's deliveries come out as, end to end through a real ``healthlog serve``.

Scenarios: PARSE-42 and PARSE-43 in specs/parsing.md. Every section the app sends and every
metric shape, in the odd offsets, across the end of daylight saving time, on a leap day and in
the phone's 12-hour clock (in other languages too) and Buddhist calendar, is posted over HTTP;
``GET /v1/points`` must give each point exactly once, verbatim, sorted, at its UTC coordinates;
re-sends that differ only in how they are written must change nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _service_helpers import Service, serving

from healthlog.storage.journal import Journal

MINUTES = {"automation-aggregation": "minutes", "automation-id": "A"}
DAYS = {"automation-aggregation": "days", "automation-id": "B"}

# Points as the phone writes them, and their starts in UTC.
HEART_RATE = [
    b'{"date":"2024-02-06 07:00:00 +0545","Min":50,"Avg":60.5,"Max":70,"source":"A|B"}',
    b'{"date":"2024-02-06 07:01:00 +1245","Min":51,"Avg":61,"Max":71}',
    b'{"date":"2024-02-06 07:02:00 -0930","Min":52,"Avg":62,"Max":72,"source":""}',
    b'{"date":"2024-11-03 01:30:00 -0400","Min":53,"Avg":63,"Max":73}',
    b'{"date":"2024-11-03 01:30:00 -0500","Min":54,"Avg":64,"Max":74}',
    b'{"date":"2024-02-29 23:59:59 +0000","Min":55,"Avg":65,"Max":75}',
    b'{"date":"2024-03-01 00:00:00 +0000","Min":56,"Avg":66,"Max":76}',
    b'{"date":"2024-09-21 7:57:00\\u202fpm +1000","Min":57,"Avg":67,"Max":77}',
    b'{"date":"2567-02-29 10:00:00 +0700","Min":58,"Avg":68,"Max":78,"source":"Caf\xc3\xa9"}',
]
HEART_RATE_AT = [
    "2024-02-06T01:15:00Z",
    "2024-02-05T18:16:00Z",
    "2024-02-06T16:32:00Z",
    "2024-11-03T05:30:00Z",
    "2024-11-03T06:30:00Z",
    "2024-02-29T23:59:59Z",
    "2024-03-01T00:00:00Z",
    "2024-09-21T09:57:00Z",
    "2024-02-29T03:00:00Z",
]
# Two sleep segments sharing a start: (point, end in UTC).
SLEEP_SEGMENTS = [
    (
        b'{"startDate":"2024-03-01 01:00:00 +0000","endDate":"2024-03-01 02:00:00 +0000",'
        b'"value":"Core","qty":1}',
        "2024-03-01T02:00:00Z",
    ),
    (
        b'{"startDate":"2024-03-01 01:00:00 +0000","endDate":"2024-03-01 01:30:00 +0000",'
        b'"value":"Deep","qty":0.5}',
        "2024-03-01T01:30:00Z",
    ),
]
DAILY = [
    (
        "blood_pressure",
        "mmHg",
        b'{"date":"2024-02-06 00:00:00 -0800","systolic":120,"diastolic":80}',
        "2024-02-06T08:00:00Z",
        "2024-02-06T08:00:00Z",
    ),
    (
        "sleep_analysis",
        "hr",
        b'{"date":"2024-02-06","totalSleep":7.1,"core":3,"deep":1,"rem":2,"inBed":0,'
        b'"sleepStart":"2024-02-05 23:00:00 -0800","sleepEnd":"2024-02-06 06:30:00 -0800"}',
        "2024-02-06T00:00:00Z",
        "2024-02-06T00:00:00Z",
    ),
]
RECORDS = [
    (
        "workouts",
        b'{"id":"W1","name":"Walk","start":"2024-02-06 07:00:00 -0800",'
        b'"end":"2024-02-06 08:00:00 -0800","route":[{"latitude":1.5,"longitude":2.5,'
        b'"timestamp":"2024-02-06 07:00:01 -0800"}],"heartRateData":[{"date":'
        b'"2024-02-06 07:00:00 -0800","Min":80,"Avg":90,"Max":100,"units":"count/min"}]}',
        "2024-02-06T15:00:00Z",
        "2024-02-06T16:00:00Z",
    ),
    (
        "symptoms",
        b'{"start":"2024-02-06 07:00:00 -0800","end":"2024-02-06 07:00:00 -0800",'
        b'"name":"Headache","severity":"Mild"}',
        "2024-02-06T15:00:00Z",
        "2024-02-06T15:00:00Z",
    ),
    (
        "ecg",
        b'{"start":"2024-02-06 07:10:00 -0800","end":"2024-02-06 07:10:30 -0800",'
        b'"classification":"Sinus Rhythm","voltageMeasurements":[{"date":'
        b'"2024-02-06 07:10:00 -0800","voltage":0.1}]}',
        "2024-02-06T15:10:00Z",
        "2024-02-06T15:10:30Z",
    ),
    (
        "stateOfMind",
        b'{"start":"2024-02-06 07:20:00 -0800","end":"2024-02-06 07:20:00 -0800",'
        b'"valence":0.5,"labels":["Calm"],"note":"a \\"b\\" <&> \\/ \\u00e9"}',
        "2024-02-06T15:20:00Z",
        "2024-02-06T15:20:00Z",
    ),
    (
        "medications",
        b'{"start":"2024-02-06 07:30:00 -0800","displayText":"X","dosage":1}',
        "2024-02-06T15:30:00Z",
        "2024-02-06T15:30:00Z",
    ),
    ("cycleTracking", b'{"date":"2024-02-06","flow":"light"}', "2024-02-06T00:00:00Z", None),
    (
        "heartRateNotifications",
        b'{"start":"2024-02-06 07:40:00 -0800","end":"2024-02-06 07:50:00 -0800","threshold":120}',
        "2024-02-06T15:40:00Z",
        "2024-02-06T15:50:00Z",
    ),
]

# The same points written otherwise: keys reordered, another offset, escapes for characters,
# a number spelled otherwise, the Gregorian year, an accented name written as an escape.
HEART_RATE_AGAIN = [
    b'{"Max":70,"Avg":60.50,"Min":5e1,"date":"2024-02-06 01:15:00 +0000","source":"A|B"}',
    b'{"date":"2024-02-06 07:01:00 +1245","Min":51,"Avg":61.000000000000001,"Max":71}',
    b'{"date":"2024-02-06 07:02:00 -0930","Min":52,"Avg":62,"Max":72}',
    b'{"date":"2024-11-03 05:30:00 +0000","Min":53,"Avg":63,"Max":73}',
    b'{"date":"2024-11-03 01:30:00 -0500","Min":54,"Avg":64,"Max":74}',
    b'{"date":"2024-02-29T23:59:59Z","Min":55,"Avg":65,"Max":75}',
    b'{"date":"2024-03-01 00:00:00 +0000","Min":56,"Avg":66,"Max":76}',
    b'{"date":"2024-09-21 19:57:00 +1000","Min":57,"Avg":67,"Max":77}',
    b'{"date":"2024-02-29 10:00:00 +0700","Min":58,"Avg":68,"Max":78,"source":"Caf\\u00e9"}',
]
STATE_OF_MIND_AGAIN = (
    b'{"note":"a \\"b\\" \\u003c\\u0026\\u003e / \xc3\xa9","labels":["Calm"],"valence":5e-1,'
    b'"end":"2024-02-06 15:20:00 +0000","start":"2024-02-06 15:20:00 +0000"}'
)


def envelope(
    sections: dict[str, list[bytes]], metrics: list[tuple[str, str, list[bytes]]]
) -> bytes:
    """A ``{"data": {...}}`` body holding the raw points given, as the app writes it."""
    parts = [
        b'{"name":%s,"units":%s,"data":[%s]}'
        % (json.dumps(name).encode(), json.dumps(units).encode(), b",".join(points))
        for name, units, points in metrics
    ]
    fields = [b'"metrics":[%s]' % b",".join(parts)] if parts else []
    fields += [b'"%s":[%s]' % (name.encode(), b",".join(raws)) for name, raws in sections.items()]
    return b'{"data":{%s}}' % b",".join(fields)


def line(
    metric: str, layer: str, units: str | None, raw: bytes, start: str, end: str | None
) -> bytes:
    """The line ``GET /v1/points`` gives for a point: the point embedded byte for byte."""
    head = json.dumps(
        {"metric": metric, "layer": layer, "start": start, "end": end or start, "units": units},
        separators=(",", ":"),
    ).encode()
    return head[:-1] + b',"point":' + raw + b"}"


def expected_lines() -> list[bytes]:
    heart_rate = [
        line("heart_rate", "minutes", "count/min", raw, at, None)
        for raw, at in zip(HEART_RATE, HEART_RATE_AT, strict=True)
    ]
    sleep = [
        line("sleep_analysis", "minutes", "hr", raw, "2024-03-01T01:00:00Z", end)
        for raw, end in SLEEP_SEGMENTS
    ]
    daily = [line(name, "days", units, raw, s, e) for name, units, raw, s, e in DAILY]
    records = [line(name, "records", None, raw, s, e) for name, raw, s, e in RECORDS]
    every = heart_rate + sleep + daily + records

    def order(found: bytes) -> tuple[Any, ...]:
        document = json.loads(found)
        return tuple(document[key] for key in ("metric", "layer", "start", "end"))

    return sorted(every, key=order)


async def points(service: Service, **params: str) -> list[bytes]:
    response = await service.get("/v1/points", **params)
    assert response.status_code == 200, response.text
    return response.content.splitlines()


async def post_folded(service: Service, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    response = await service.post(body, headers)
    assert response.status_code == 200, response.text
    await service.wait_folded()
    outcome = await service.get(f"/v1/deliveries/{response.json()['delivery_id']}")
    document: dict[str, Any] = outcome.json()
    return document


async def test_every_section_and_shape_comes_out_once_verbatim_parse_42(tmp_path: Path) -> None:
    """PARSE-42: every section and metric shape a phone sends, in any offset, calendar and
    clock, comes out of ``GET /v1/points`` exactly once, byte for byte, sorted by metric,
    layer, start and end; re-sends that differ only in how they are written change nothing."""
    minutes = envelope(
        {name: [raw] for name, raw, _, _ in RECORDS},
        [
            ("heart_rate", "count/min", HEART_RATE),
            ("sleep_analysis", "hr", [raw for raw, _ in SLEEP_SEGMENTS]),
        ],
    )
    days = envelope({}, [(name, units, [raw]) for name, units, raw, _, _ in DAILY])
    again = envelope(
        {"stateOfMind": [STATE_OF_MIND_AGAIN]},
        [("heart_rate", "count/min", HEART_RATE_AGAIN)],
    )
    async with serving(tmp_path / "data") as service:
        first = await post_folded(service, minutes, MINUTES)
        daily = await post_folded(service, days, DAYS)
        assert (first["status"], daily["status"]) == ("parsed", "parsed")
        assert first["counters"]["points_new"] + daily["counters"]["points_new"] == 20
        stored = await points(service)
        assert stored == expected_lines()

        resent = await post_folded(service, again, MINUTES)

        assert resent["status"] == "parsed"
        assert changed_counters(resent) == {"points_unchanged": 10}
        assert await points(service) == stored
        records = await points(service, layer="RECORDS", format="jsonl")
        assert [json.loads(found)["metric"] for found in records] == sorted(
            name for name, _, _, _ in RECORDS
        )


# Heart rate as phones on 12-hour clocks in other languages write it (specs/timestamps.md rule
# 5): the date as written, the same time on the 24-hour clock, and its start in UTC.
TWELVE_HOUR = [
    ("2024-09-21 \uc624\uc804 7:57:00 +0900", "2024-09-21 07:57:00 +0900", "2024-09-20T22:57:00Z"),
    ("2024-09-21 \uc624\ud6c4 7:57:00 +0900", "2024-09-21 19:57:00 +0900", "2024-09-21T10:57:00Z"),
    ("2024-09-21 \u5348\u524d0:05:00 +0900", "2024-09-21 00:05:00 +0900", "2024-09-20T15:05:00Z"),
    ("2024-09-21 \u5348\u5f8c0:05:00 +0900", "2024-09-21 12:05:00 +0900", "2024-09-21T03:05:00Z"),
    ("2024-09-21 \u4e0a\u534812:06:00 +0800", "2024-09-21 00:06:00 +0800", "2024-09-20T16:06:00Z"),
    ("2024-09-21 \u4e0b\u534812:06:00 +0800", "2024-09-21 12:06:00 +0800", "2024-09-21T04:06:00Z"),
    (
        "2024-09-21 7:57:00\u202fp.\u00a0m. -0500",
        "2024-09-21 19:57:00 -0500",
        "2024-09-22T00:57:00Z",
    ),
    (
        "2024-09-21 7:58:00\u202f\u03c0.\u03bc. +0300",
        "2024-09-21 07:58:00 +0300",
        "2024-09-21T04:58:00Z",
    ),
    ("2024-09-21 7:59:00 \u0645 +0300", "2024-09-21 19:59:00 +0300", "2024-09-21T16:59:00Z"),
    ("2024-09-21 \u00d6S\u202f8:00:00 +0300", "2024-09-21 20:00:00 +0300", "2024-09-21T17:00:00Z"),
    ("2024-09-21 8:01:00\u202fSA +0700", "2024-09-21 08:01:00 +0700", "2024-09-21T01:01:00Z"),
    ("2024-09-21 8:02:00\u202fPTG +0800", "2024-09-21 20:02:00 +0800", "2024-09-21T12:02:00Z"),
    (
        "2024-09-21 \u0baa\u0bbf\u0bb1\u0bcd\u0baa\u0b95\u0bb2\u0bcd 8:03:00 +0530",
        "2024-09-21 20:03:00 +0530",
        "2024-09-21T14:33:00Z",
    ),
]


def changed_counters(outcome: dict[str, Any]) -> dict[str, int]:
    """The point counters of a delivery's outcome that are not zero (the counts of metrics,
    sections, points and unchanged objects left out): what a re-send changed."""
    return {
        name: count
        for name, count in outcome["counters"].items()
        if count and name not in ("metrics", "sections", "points", "objects_unchanged")
    }


def heart_rate_point(n: int, date: str) -> bytes:
    """A heart-rate point as the app writes it: UTF-8 as is, not escaped."""
    return b'{"date":%s,"Min":%d,"Avg":%d,"Max":%d}' % (
        json.dumps(date, ensure_ascii=False).encode(),
        40 + n,
        50 + n,
        60 + n,
    )


async def test_twelve_hour_clocks_of_other_languages_come_out_once_parse_43(
    tmp_path: Path,
) -> None:
    """PARSE-43: heart rate written on the 12-hour clocks of Korean, Japanese, Chinese,
    Spanish, Greek, Arabic, Turkish, Vietnamese, Malay and Tamil phones, with the marker before
    or after the time, is ``parsed`` and comes out of ``GET /v1/points`` once each, byte for byte,
    at its UTC start; the same points re-sent on the 24-hour clock are unchanged."""
    await _twelve_hour_points_come_out_once(tmp_path, TWELVE_HOUR)


# Heart rate as phones set to calendars other than the Gregorian write 2024-09-21 (specs/
# parsing.md rule 11): Islamic Umm al-Qura (Saudi Arabia), Persian (Iran) and the Japanese era.
OTHER_CALENDARS = [
    "1446-03-18 07:57:00 +0300",
    "1403-06-31 07:57:00 +0330",
    "0006-09-21 07:57:00 +0900",
    "1446-03-18",
]


async def test_a_calendar_other_than_the_gregorian_is_named_and_kept_parse_44(
    tmp_path: Path,
) -> None:
    """PARSE-44: points dated in the Islamic, Persian or Japanese-era calendar, beside one dated
    in the Gregorian, are rejected, and ``GET /v1/deliveries/{id}`` says why without quoting a
    value; the journal keeps them as sent for a later reindex."""
    written = [heart_rate_point(n, date) for n, date in enumerate(OTHER_CALENDARS)]
    gregorian = heart_rate_point(9, "2024-09-21 07:57:00 +0300")
    body = envelope({}, [("heart_rate", "count/min", [*written, gregorian])])
    async with serving(tmp_path / "data") as service:
        outcome = await post_folded(service, body, MINUTES)
        assert outcome["status"] == "partial"
        assert outcome["counters"]["points_rejected"] == len(OTHER_CALENDARS)
        assert outcome["reason"] == (
            "point rejected: unparseable date: timestamp year is before 1900: a date in a "
            "calendar other than the Gregorian (Islamic, Persian, Japanese era) is not read "
            f"(x{len(OTHER_CALENDARS)})"
        )
        assert await points(service) == [
            line("heart_rate", "minutes", "count/min", gregorian, "2024-09-21T04:57:00Z", None)
        ]
        delivery_id = outcome["delivery_id"]
        journal_path = service.data.journal_path
    with Journal(journal_path, create=False, reading=True) as journal:
        assert journal.read_body(delivery_id) == body


# Heart rate as phones whose locale writes other digits write it (specs/timestamps.md rule 3):
# the date as written, the same time in ASCII on the 24-hour clock, and its start in UTC.
LOCALE_DIGITS = [
    (  # Arabic of Egypt, 12-hour clock
        "\u0662\u0660\u0662\u0664-\u0660\u0669-\u0662\u0661 \u0667:\u0665\u0667:\u0660\u0660 "
        "\u0645 +0300",
        "2024-09-21 19:57:00 +0300",
        "2024-09-21T16:57:00Z",
    ),
    (  # Persian on the Gregorian calendar, with the LRM of its signs
        "\u06f2\u06f0\u06f2\u06f4-\u06f0\u06f9-\u06f2\u06f1 \u06f0\u06f7:\u06f5\u06f8:\u06f0\u06f0 "
        "\u200e+\u200e0330",
        "2024-09-21 07:58:00 +0330",
        "2024-09-21T04:28:00Z",
    ),
    (  # Bengali, 12-hour clock
        "\u09e8\u09e6\u09e8\u09ea-\u09e6\u09ef-\u09e8\u09e7 \u09ed:\u09eb\u09ef:\u09e6\u09e6 "
        "PM +0600",
        "2024-09-21 19:59:00 +0600",
        "2024-09-21T13:59:00Z",
    ),
    (  # Marathi
        "\u0968\u0966\u0968\u096a-\u0966\u096f-\u0968\u0967 \u0966\u096e:\u0966\u0966:\u0966\u0966 "
        "+0530",
        "2024-09-21 08:00:00 +0530",
        "2024-09-21T02:30:00Z",
    ),
    (  # Burmese
        "\u1042\u1040\u1042\u1044-\u1040\u1049-\u1042\u1041 \u1040\u1048:\u1040\u1041:\u1040\u1040 "
        "+0630",
        "2024-09-21 08:01:00 +0630",
        "2024-09-21T01:31:00Z",
    ),
    (  # Thai digits on the Buddhist calendar (2567)
        "\u0e52\u0e55\u0e56\u0e57-\u0e50\u0e59-\u0e52\u0e51 \u0e50\u0e58:\u0e50\u0e52:\u0e50\u0e50 "
        "+0700",
        "2024-09-21 08:02:00 +0700",
        "2024-09-21T01:02:00Z",
    ),
]
# Arabic of Saudi Arabia: its digits and the Islamic Umm al-Qura calendar (1446-03-18).
SAUDI = (
    "\u0661\u0664\u0664\u0666-\u0660\u0663-\u0661\u0668 \u0660\u0667:\u0665\u0667:\u0660\u0660 "
    "+0300"
)


async def test_digits_of_the_phones_locale_come_out_once_parse_45(tmp_path: Path) -> None:
    """PARSE-45: heart rate dated in the digits of Egyptian Arabic, Persian, Bengali, Marathi,
    Burmese and Thai phones is read at its UTC start and comes out of ``GET /v1/points`` once
    each, byte for byte; a Saudi phone's date, in Arabic-Indic digits and the Islamic calendar,
    is rejected with the reason that names the calendar; the same points re-sent in ASCII are
    unchanged."""
    written = [heart_rate_point(n, date) for n, (date, _, _) in enumerate(LOCALE_DIGITS)]
    again = [heart_rate_point(n, date) for n, (_, date, _) in enumerate(LOCALE_DIGITS)]
    expected = sorted(
        (at, line("heart_rate", "minutes", "count/min", raw, at, None))
        for raw, (_, _, at) in zip(written, LOCALE_DIGITS, strict=True)
    )
    saudi = heart_rate_point(9, SAUDI)
    async with serving(tmp_path / "data") as service:
        first = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", [*written, saudi])]), MINUTES
        )
        assert first["status"] == "partial"
        assert first["reason"] == (
            "point rejected: unparseable date: timestamp year is before 1900: a date in a "
            "calendar other than the Gregorian (Islamic, Persian, Japanese era) is not read (x1)"
        )
        assert first["counters"]["points_new"] == len(LOCALE_DIGITS)
        stored = await points(service)
        assert stored == [found for _, found in expected]

        resent = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", again)]), MINUTES
        )

        assert resent["status"] == "parsed"
        assert changed_counters(resent) == {"points_unchanged": len(LOCALE_DIGITS)}
        assert await points(service) == stored


async def test_mainland_chinese_offset_written_twice_parse_46(tmp_path: Path) -> None:
    """PARSE-46: heart rate a mainland Chinese phone on the 12-hour clock writes with the offset
    twice is read at its UTC start and comes out once, byte for byte; one whose two offsets
    differ is rejected with the reason that says so; the first re-sent on the 24-hour clock is
    unchanged."""
    twice = heart_rate_point(0, "2024-09-21 +0800 \u4e0b\u53487:57:00 +0800")
    differ = heart_rate_point(1, "2024-09-21 +0800 \u4e0b\u53487:58:00 +0900")
    again = heart_rate_point(0, "2024-09-21 19:57:00 +0800")
    async with serving(tmp_path / "data") as service:
        first = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", [twice, differ])]), MINUTES
        )
        assert first["status"] == "partial"
        assert first["reason"] == (
            "point rejected: unparseable date: timestamp UTC offset before the time differs "
            "from the one after it (x1)"
        )
        stored = await points(service)
        assert stored == [
            line("heart_rate", "minutes", "count/min", twice, "2024-09-21T11:57:00Z", None)
        ]

        resent = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", [again])]), MINUTES
        )

        assert resent["status"] == "parsed"
        assert resent["counters"]["points_unchanged"] == 1
        assert await points(service) == stored


async def test_a_hebrew_year_is_named_not_read_as_buddhist_era_parse_47(tmp_path: Path) -> None:
    """PARSE-47: a point dated in the Hebrew calendar (5785 for 2024) is rejected with the
    reason that names the calendar, not read as a Buddhist-era year (5242); a Buddhist-era one
    beside it (2567) is still read as 2024."""
    hebrew = heart_rate_point(0, "5785-01-18 07:57:00 +0300")
    buddhist = heart_rate_point(1, "2567-09-21 07:57:00 +0700")
    body = envelope({}, [("heart_rate", "count/min", [hebrew, buddhist])])
    async with serving(tmp_path / "data") as service:
        outcome = await post_folded(service, body, MINUTES)
        assert outcome["status"] == "partial"
        assert outcome["reason"] == (
            "point rejected: unparseable date: timestamp year is 3000 or later: a date in a "
            "calendar other than the Gregorian (Hebrew) is not read (x1)"
        )
        assert await points(service) == [
            line("heart_rate", "minutes", "count/min", buddhist, "2024-09-21T00:57:00Z", None)
        ]


async def _twelve_hour_points_come_out_once(
    tmp_path: Path, dates: list[tuple[str, str, str]]
) -> None:
    """Heart rate dated as ``dates`` writes it (as the phone does, as the 24-hour clock does, its
    UTC start) is ``parsed``, comes out once each, byte for byte, at its UTC start, and is
    unchanged when re-sent on the 24-hour clock."""
    written = [heart_rate_point(n, date) for n, (date, _, _) in enumerate(dates)]
    again = [heart_rate_point(n, date) for n, (_, date, _) in enumerate(dates)]
    expected = sorted(
        (at, line("heart_rate", "minutes", "count/min", raw, at, None))
        for raw, (_, _, at) in zip(written, dates, strict=True)
    )
    async with serving(tmp_path / "data") as service:
        first = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", written)]), MINUTES
        )
        assert first["status"] == "parsed", first["reason"]
        assert first["counters"]["points_new"] == len(dates)
        stored = await points(service)
        assert stored == [found for _, found in expected]
        resent = await post_folded(
            service, envelope({}, [("heart_rate", "count/min", again)]), MINUTES
        )
        assert resent["status"] == "parsed"
        assert changed_counters(resent) == {"points_unchanged": len(dates)}
        assert await points(service) == stored


# Heart rate as Traditional Chinese and Burmese phones on the 12-hour clock date it, with a day
# period (specs/timestamps.md rule 5), Burmese in its own digits.
DAY_PERIODS = [
    ("2024-09-21 \u665a\u4e0a7:57:00 +0800", "2024-09-21 19:57:00 +0800", "2024-09-21T11:57:00Z"),
    ("2024-09-21 \u51cc\u666812:00:00 +0800", "2024-09-21 00:00:00 +0800", "2024-09-20T16:00:00Z"),
    ("2024-09-21 \u4e2d\u534812:30:00 +0800", "2024-09-21 12:30:00 +0800", "2024-09-21T04:30:00Z"),
    ("2024-09-21 \u6e05\u66685:01:00 +0800", "2024-09-21 05:01:00 +0800", "2024-09-20T21:01:00Z"),
    (
        "\u1042\u1040\u1042\u1044-\u1040\u1049-\u1042\u1041 \u100a \u1047:\u1045\u1047:\u1040\u1040"
        " +0630",
        "2024-09-21 19:57:00 +0630",
        "2024-09-21T13:27:00Z",
    ),
    (
        "2024-09-21 \u1014\u1031\u1037\u101c\u101a\u103a 3:58:00 +0630",
        "2024-09-21 15:58:00 +0630",
        "2024-09-21T09:28:00Z",
    ),
    (
        "2024-09-21 \u1019\u103d\u1014\u103a\u1038\u1010\u100a\u1037\u103a 12:00:00 +0630",
        "2024-09-21 12:00:00 +0630",
        "2024-09-21T05:30:00Z",
    ),
]


async def test_day_periods_come_out_once_parse_48(tmp_path: Path) -> None:
    """PARSE-48: heart rate dated as Traditional Chinese (`晚上7:57:00`, `凌晨12:00:00`,
    `中午12:30:00`, `清晨5:01:00`) and Burmese phones (`ည` in Burmese digits, noon) on the
    12-hour clock write it is ``parsed`` and comes out once each, byte for byte, at its UTC
    start; the same points re-sent on the 24-hour clock are unchanged."""
    await _twelve_hour_points_come_out_once(tmp_path, DAY_PERIODS)


# Heart rate as Persian (its digits, the LRM of its plus sign), Pashto, Nepali (its digits),
# Assamese (its digits, the marker before the time), Central Kurdish, Sindhi and Dzongkha phones
# on the 12-hour clock date it (specs/timestamps.md rule 5).
MORE_MARKERS = [
    (
        "\u06f2\u06f0\u06f2\u06f4-\u06f0\u06f9-\u06f2\u06f1 \u06f7:\u06f5\u06f7:\u06f0\u06f0"
        " \u0628.\u0638. \u200e+0330",
        "2024-09-21 19:57:00 +0330",
        "2024-09-21T16:27:00Z",
    ),
    (
        "2024-09-21 7:58:00 \u063a.\u0645. +0430",
        "2024-09-21 07:58:00 +0430",
        "2024-09-21T03:28:00Z",
    ),
    (
        "\u0968\u0966\u0968\u096a-\u0966\u096f-\u0968\u0967 \u096d:\u096b\u096f:\u0966\u0966"
        " \u0905\u092a\u0930\u093e\u0939\u094d\u0928 +0545",
        "2024-09-21 19:59:00 +0545",
        "2024-09-21T14:14:00Z",
    ),
    (
        "\u09e8\u09e6\u09e8\u09ea-\u09e6\u09ef-\u09e8\u09e7"
        " \u09aa\u09c2\u09f0\u09cd\u09ac\u09be\u09b9\u09cd\u09a8"
        " \u09e7\u09e8:\u09e6\u09eb:\u09e6\u09e6 +0530",
        "2024-09-21 00:05:00 +0530",
        "2024-09-20T18:35:00Z",
    ),
    ("2024-09-21 8:00:00 \u062f.\u0646 +0300", "2024-09-21 20:00:00 +0300", "2024-09-21T17:00:00Z"),
    (
        "2024-09-21 8:01:00 \u0635\u0628\u062d\u060c\u202f\u0645\u0646\u062c\u0647\u0646\u062f"
        " +0500",
        "2024-09-21 08:01:00 +0500",
        "2024-09-21T03:01:00Z",
    ),
    (
        "2024-09-21 8:02:00 \u0f55\u0fb1\u0f72\u0f0b\u0f46\u0f0b +0600",
        "2024-09-21 20:02:00 +0600",
        "2024-09-21T14:02:00Z",
    ),
]


async def test_markers_of_more_languages_come_out_once_parse_49(tmp_path: Path) -> None:
    """PARSE-49: heart rate dated as Persian, Pashto, Nepali, Assamese, Central Kurdish, Sindhi
    and Dzongkha phones on the 12-hour clock write it, in their digits, is ``parsed`` and comes
    out once each, byte for byte, at its UTC start; the same points re-sent on the 24-hour clock
    are unchanged."""
    await _twelve_hour_points_come_out_once(tmp_path, MORE_MARKERS)


# Heart rate as Hebrew, Ukrainian, Czech, Swedish, Hungarian (the marker before the time), Serbian
# (a U+202F inside its marker), Kannada, Lao and Yoruba phones on the 12-hour clock date it
# (specs/timestamps.md rule 5).
OTHER_MARKERS = [
    (
        "2024-09-21 7:57:00 \u05d0\u05d7\u05d4\u05f4\u05e6 +0300",
        "2024-09-21 19:57:00 +0300",
        "2024-09-21T16:57:00Z",
    ),
    (
        "2024-09-21 7:58:00\u202f\u0434\u043f +0300",
        "2024-09-21 07:58:00 +0300",
        "2024-09-21T04:58:00Z",
    ),
    ("2024-09-21 12:05:00\u202fodp. +0200", "2024-09-21 12:05:00 +0200", "2024-09-21T10:05:00Z"),
    ("2024-09-21 12:06:00\u202ffm +0200", "2024-09-21 00:06:00 +0200", "2024-09-20T22:06:00Z"),
    ("2024-09-21 du.\u202f8:00:00 +0200", "2024-09-21 20:00:00 +0200", "2024-09-21T18:00:00Z"),
    (
        "2024-09-21 8:01:00\u202fpo\u202fpodne +0200",
        "2024-09-21 20:01:00 +0200",
        "2024-09-21T18:01:00Z",
    ),
    (
        "2024-09-21 8:02:00 \u0c85\u0caa\u0cb0\u0cbe\u0cb9\u0ccd\u0ca8 +0530",
        "2024-09-21 20:02:00 +0530",
        "2024-09-21T14:32:00Z",
    ),
    (
        "2024-09-21 8:03:00 \u0e81\u0ec8\u0ead\u0e99\u0e97\u0ec8\u0ebd\u0e87 +0700",
        "2024-09-21 08:03:00 +0700",
        "2024-09-21T01:03:00Z",
    ),
    (
        "2024-09-21 8:04:00\u202f\u1ecc\u0300s\xe1n +0100",
        "2024-09-21 20:04:00 +0100",
        "2024-09-21T19:04:00Z",
    ),
]


async def test_markers_of_the_other_languages_come_out_once_parse_50(tmp_path: Path) -> None:
    """PARSE-50: heart rate dated as Hebrew, Ukrainian, Czech, Swedish, Hungarian, Serbian, Kannada,
    Lao and Yoruba phones on the 12-hour clock write it is ``parsed`` and comes out once each, byte
    for byte, at its UTC start; the same points re-sent on the 24-hour clock are unchanged."""
    await _twelve_hour_points_come_out_once(tmp_path, OTHER_MARKERS)


# Heart rate as Ewe phones on the 12-hour clock date it: Ghana's and Togo's, whose `le` follows
# the time (specs/timestamps.md rule 5).
EWE_MARKERS = [
    ("2024-09-21 \u014bdi ga 7:57:00 +0000", "2024-09-21 07:57:00 +0000", "2024-09-21T07:57:00Z"),
    (
        "2024-09-21 \u0263etr\u0254 ga 7:58:00 +0000",
        "2024-09-21 19:58:00 +0000",
        "2024-09-21T19:58:00Z",
    ),
    (
        "2024-09-21 \u0263etr\u0254 ga 12:05:00 le +0000",
        "2024-09-21 12:05:00 +0000",
        "2024-09-21T12:05:00Z",
    ),
    (
        "2024-09-21 \u014bdi ga 12:06:00 le +0000",
        "2024-09-21 00:06:00 +0000",
        "2024-09-21T00:06:00Z",
    ),
]


async def test_ewe_markers_come_out_once_time_42(tmp_path: Path) -> None:
    """TIME-42: heart rate dated as Ewe phones on the 12-hour clock write it (`ŋdi ga 7:57:00`,
    Togo's `... 12:05:00 le +0000`) is ``parsed`` and comes out once each, byte for byte, at its
    UTC start; the same points re-sent on the 24-hour clock are unchanged."""
    await _twelve_hour_points_come_out_once(tmp_path, EWE_MARKERS)


# Records of one moment, as the Health app logs them: cycle-day symptoms span the whole day, so
# every symptom of a day shares its start and end; a schedule's doses logged at once share their
# time.
DAY_START, DAY_END = "2024-02-06 00:00:00 -0800", "2024-02-07 00:00:00 -0800"
DOSE = "2024-02-06 08:00:00 -0800"
SYMPTOMS = [
    b'{"start":"%s","end":"%s","name":"%s","severity":"Mild","source":"Health"}'
    % (DAY_START.encode(), DAY_END.encode(), name)
    for name in (b"Abdominal Cramps", b"Bloating", b"Headache")
]
DOSES = [
    b'{"start":"%s","end":"%s","displayText":"%s","status":"Taken","dosage":1}'
    % (DOSE.encode(), DOSE.encode(), name)
    for name in (b"Lisinopril 10 mg", b"Metformin 500 mg")
]


async def test_records_of_one_moment_are_each_kept_merge_35(tmp_path: Path) -> None:
    """MERGE-35: symptoms of one cycle day and doses of medications taken at once share their
    start and end; each is kept and comes out once, byte for byte. A re-send in another key
    order and offset changes nothing; one whose severity changed replaces that symptom alone."""
    body = envelope({"symptoms": SYMPTOMS, "medications": DOSES}, [])
    async with serving(tmp_path / "data") as service:
        first = await post_folded(service, body, {})
        assert (first["status"], changed_counters(first)) == (
            "parsed",
            {"points_new": 5, "objects_written": 2},
        )
        stored = await points(service)
        assert [json.loads(found)["point"] for found in stored] == [
            json.loads(raw) for raw in DOSES + SYMPTOMS
        ]
        assert {json.loads(found)["end"] for found in stored[2:]} == {"2024-02-07T08:00:00Z"}

        again = [
            json.dumps(
                {**dict(reversed(json.loads(raw).items())), "start": start, "end": end}
            ).encode()
            for raw, start, end in [
                (raw, "2024-02-06 08:00:00 +0000", "2024-02-07 08:00:00 +0000") for raw in SYMPTOMS
            ]
        ]
        resent = await post_folded(service, envelope({"symptoms": again}, []), {})
        assert (resent["status"], changed_counters(resent)) == ("parsed", {"points_unchanged": 3})
        assert await points(service) == stored

        worse = SYMPTOMS[1].replace(b'"Mild"', b'"Severe"')
        changed = await post_folded(service, envelope({"symptoms": [worse]}, []), {})
        assert changed_counters(changed) == {
            "points_erased": 1,
            "overwrites": 1,
            "objects_written": 1,
        }
        after = await points(service)
        assert [json.loads(found)["point"]["severity"] for found in after[2:]] == [
            "Mild",
            "Severe",
            "Mild",
        ]
