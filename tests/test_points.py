"""Points: coordinates and canonical form (specs/parsing.md, specs/merge.md)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from _bodies import read_point
from hypothesis import example, given
from hypothesis import strategies as st

from healthlog.points import (
    PointError,
    all_same_content,
    body_nesting,
    canonical_form,
    completeness,
    coordinates,
    decode_all,
    instant_form,
    nesting,
    point_at,
    same_content,
)
from healthlog.timestamps import parse_instant

FEB_6_15H = parse_instant("2024-02-06 15:00:00 +0000")
FEB_6_16H = parse_instant("2024-02-06 16:00:00 +0000")


def test_start_and_end_win_over_date() -> None:
    """PARSE-13: `start`/`end` next to `date` give the coordinates."""
    point = {
        "date": "2024-02-06 00:00:00 +0000",
        "start": "2024-02-06 15:00:00 +0000",
        "end": "2024-02-06 16:00:00 +0000",
    }
    assert coordinates(point) == (FEB_6_15H, FEB_6_16H)


def test_date_only_is_an_instant() -> None:
    """PARSE-13: a point with `date` only has end equal to start."""
    assert coordinates({"date": "2024-02-06 07:00:00 -0800", "qty": 1}) == (FEB_6_15H, FEB_6_15H)


def test_aggregated_sleep_takes_its_date() -> None:
    """PARSE-13: sleepStart/sleepEnd of aggregated sleep do not give coordinates."""
    point = {
        "date": "2024-02-06 07:00:00 -0800",
        "sleepStart": "2024-02-05 22:05:47 -0800",
        "sleepEnd": "2024-02-06 05:31:32 -0800",
        "totalSleep": 6.4,
    }
    assert coordinates(point) == (FEB_6_15H, FEB_6_15H)


def test_segments_with_one_start_keep_their_ends() -> None:
    """PARSE-12: startDate/endDate segments sharing a start differ by their end."""
    first = {"startDate": "2024-02-06 07:00:00 -0800", "endDate": "2024-02-06 08:00:00 -0800"}
    second = {"startDate": "2024-02-06 07:00:00 -0800", "endDate": "2024-02-06 07:30:00 -0800"}
    assert coordinates(first)[0] == coordinates(second)[0]
    assert coordinates(first) != coordinates(second)


@pytest.mark.parametrize(
    "point",
    [
        {"start": "not a date", "date": "2024-02-06 07:00:00 -0800"},
        {"start": None, "startDate": "2024-02-06 07:00:00 -0800"},
        {"startDate": "2024-02-31 07:00:00 -0800", "date": "2024-02-06 07:00:00 -0800"},
    ],
    ids=["start garbage", "start null", "startDate impossible"],
)
def test_first_start_key_decides_without_fallback(point: dict[str, Any]) -> None:
    """PARSE-14: an unparseable value in the first present start key rejects the point."""
    with pytest.raises(PointError):
        coordinates(point)


@pytest.mark.parametrize(
    "raw",
    [
        b"3",
        b'"2024-02-06 07:00:00 -0800"',
        b'["2024-02-06 07:00:00 -0800"]',
        b"null",
        b'{"date": 1707231600, "qty": 1}',
        b'{"qty": 1, "source": "x"}',
        b'{"start": "2024-02-06 08:00:00 -0800", "end": "2024-02-06 07:00:00 -0800"}',
        b'{"date": "2024-02-06 07:00:00 -0800", "end": "soon"}',
        b'{"date": "2024-02-06 07:00:00 -0800"',
    ],
    ids=[
        "number",
        "string",
        "array",
        "null",
        "date as number",
        "no start key",
        "end before start",
        "end unparseable",
        "truncated",
    ],
)
def test_not_a_point(raw: bytes) -> None:
    """PARSE-15: a point that is not an object or has no usable coordinates is rejected."""
    with pytest.raises(PointError):
        read_point(raw)


def test_qty_as_string_is_kept() -> None:
    """PARSE-16: field values are not interpreted; a string `qty` is a point like any other."""
    raw = b'{"date":"2024-02-06 07:00:00 -0800","qty":"12"}'
    point = read_point(raw)
    assert point.raw == raw
    assert point.canonical == b'{"date":%d,"qty":"12"}' % FEB_6_15H


def test_big_integer_keeps_its_digits() -> None:
    """PARSE-17, MERGE-3: 2**70 is kept exactly, verbatim and in the canonical form."""
    raw = b'{"date":"2024-02-06 07:00:00 -0800","qty":%d}' % 2**70
    point = read_point(raw)
    assert point.raw == raw
    assert b"1180591620717411303424" in point.canonical
    assert json.loads(point.canonical)["qty"] == 2**70


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"", 0),
        (b'{"a":1}', 1),
        (b'{"a":"[[{{","b":"]}"}', 1),
        (b'{"a":"\\"[[","b":[]}', 2),
        (b'{"a":"\\\\","b":[[]]}', 3),
        (b'{"a":[{"b":[]}],"c":{}}', 4),
    ],
    ids=["empty", "flat", "brackets in strings", "escaped quote", "escaped backslash", "nested"],
)
def test_nesting_counts_brackets_outside_strings(raw: bytes, depth: int) -> None:
    """PARSE-18: the depth a point is judged by counts only the brackets outside its strings,
    a string ending at its first quote that no backslash escapes."""
    assert nesting(raw) == depth


@pytest.mark.parametrize("shift", range(-3, 4))
def test_body_nesting_counts_across_pieces_parse_40(shift: int) -> None:
    """PARSE-40: the nesting of a body, counted a piece of 1 MiB at a time, is that of the whole
    text, also where a piece would end in a run of backslashes inside a string that holds
    brackets and an escaped quote."""
    head = b'{"a":["'
    tricky = b'\\\\\\"[[{{\\\\"'
    body = head + b"x" * (2**20 - len(head) - 3 + shift) + tricky + b",[[1]]]}"
    assert json.loads(body)["a"][0].endswith('\\"[[{{\\')
    assert body_nesting(body) == nesting(body) == 4


def test_canonical_sorts_keys() -> None:
    """MERGE-2: key order never matters and the keys come out sorted."""
    first = {"qty": 1, "date": "2024-02-06 07:00:00 -0800", "source": "A"}
    second = {"source": "A", "qty": 1, "date": "2024-02-06 07:00:00 -0800"}
    assert canonical_form(first) == canonical_form(second)
    assert canonical_form(first) == b'{"date":%d,"qty":1,"source":"A"}' % FEB_6_15H


@pytest.mark.parametrize("empty", ["", None, [], {}])
def test_canonical_drops_empty_values(empty: object) -> None:
    """MERGE-2: `"source": ""`, null, [] and {} equal an absent key."""
    bare = {"date": "2024-02-06 07:00:00 -0800", "qty": 46}
    assert canonical_form({**bare, "source": empty}) == canonical_form(bare)


def test_canonical_normalises_nested_objects() -> None:
    """MERGE-2: nested objects get sorted keys, dropped empties and normalised numbers."""
    first = {
        "start": "2024-02-06 07:00:00 -0800",
        "distance": {"units": "mi", "qty": 2.0, "note": None},
        "route": [{"timestamp": "x", "speed": 1.10000000000001, "extra": {"a": ""}}],
        "laps": [2.0, 1.10000000000001],
    }
    second = {
        "laps": [2, 1.1],
        "route": [{"speed": 1.1, "timestamp": "x"}],
        "distance": {"qty": 2, "units": "mi"},
        "start": "2024-02-06 15:00:00 +0000",
    }
    assert canonical_form(first) == canonical_form(second)
    assert canonical_form(first) == (
        b'{"distance":{"qty":2,"units":"mi"},"laps":[2,1.1],'
        b'"route":[{"speed":1.1,"timestamp":"x"}],"start":%d}' % FEB_6_15H
    )


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (46, 46.0),
        (46, 46.00000000000001),
        (0.1 + 0.2, 0.3),
        (-0.0, 0),
        (97.51367874145501, 97.513678741455),
    ],
)
def test_canonical_numbers_equal(left: float, right: float) -> None:
    """MERGE-3: numbers compare at 12 significant digits."""
    assert canonical_form({"qty": left}) == canonical_form({"qty": right})


@pytest.mark.parametrize(
    ("left", "right"),
    [(1.5, 1.6), (2**70, 2**70 + 1), (97.5136787414, 97.5136787415)],
)
def test_canonical_numbers_differ(left: float, right: float) -> None:
    """MERGE-3: different values at 12 significant digits stay different."""
    assert canonical_form({"qty": left}) != canonical_form({"qty": right})


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.00005, b"5e-05"),
        (1.5e-7, b"1.5e-07"),
        (0.0001, b"0.0001"),
        (123456.7890123456, b"123456.789012"),
        (1e12, b"1e+12"),
        (-2.5e21, b"-2.5e+21"),
        (-0.0, b"0"),
        (0, b"0"),
    ],
)
def test_canonical_numbers_print_as_twelve_digit_doubles(value: float, text: bytes) -> None:
    """MERGE-3: a number is printed as C's `%.12g` prints the double (exponents with two
    digits at least), zero without a sign."""
    assert canonical_form({"qty": value}) == b'{"qty":%s}' % text


def test_canonical_integer_forms() -> None:
    """MERGE-3: whole doubles print as integers; integers of 13 significant digits or more keep
    every digit; a larger integer that 12 significant digits hold prints as the equal double."""
    assert canonical_form({"qty": 46.0}) == b'{"qty":46}'
    assert canonical_form({"qty": 1_234_567_890_123}) == b'{"qty":1234567890123}'
    assert canonical_form({"qty": -(2**70)}) == b'{"qty":-1180591620717411303424}'
    for whole in (10**12, 1_707_231_600_000, -(10**15), 10**300):
        assert canonical_form({"qty": whole}) == canonical_form({"qty": float(whole)})
    assert canonical_form({"qty": 1_707_231_600_000}) == b'{"qty":1.7072316e+12}'


@pytest.mark.parametrize("key", ["date", "start", "end", "startDate", "endDate"])
def test_canonical_timestamps_are_instants(key: str) -> None:
    """MERGE-4: each timestamp field compares as its UTC instant."""
    forms = {
        canonical_form({key: text, "qty": 1})
        for text in (
            "2024-02-06 07:00:00 -0800",
            "2024-02-06 15:00:00 +0000",
            "2024-02-06 20:30:00 +0530",
            "2024-02-06T15:00:00Z",
        )
    }
    assert len(forms) == 1
    assert b'"%s":%d' % (key.encode(), FEB_6_15H) in forms.pop()


def test_canonical_other_dates_stay_as_written() -> None:
    """MERGE-4: a date string under another key, or an unparseable timestamp, is kept as is."""
    value = {"sleepStart": "2024-02-05 22:05:47 -0800", "date": "yesterday"}
    assert canonical_form(value) == b'{"date":"yesterday","sleepStart":"2024-02-05 22:05:47 -0800"}'


@pytest.mark.parametrize("key", ["sleepStart", "sleepEnd", "inBedStart", "inBedEnd", "timestamp"])
def test_the_instant_form_reads_the_other_dates_as_instants_merge_31(key: str) -> None:
    """MERGE-31: under `sleepStart`, `sleepEnd`, `inBedStart`, `inBedEnd` and `timestamp`, at
    the top or in a route's points, the same instant in other offsets gives one instant form,
    while the canonical forms keep the texts; a text that is no date stays a text."""
    texts = ("2024-02-06 07:00:00 -0800", "2024-02-06 15:00:00 +0000", "2024-02-06 20:30:00 +0530")
    for shape in ({key: ""}, {"route": [{key: ""}]}):
        values = [json.loads(json.dumps(shape).replace('""', json.dumps(t))) for t in texts]
        assert len({instant_form(v) for v in values}) == 1
        assert len({canonical_form(v) for v in values}) == 3
        assert b"%d" % FEB_6_15H in instant_form(values[0])
    assert instant_form({key: "yesterday"}) == canonical_form({key: "yesterday"})


def test_canonical_text_is_raw_utf8() -> None:
    """MERGE-5: non-ASCII and HTML characters are not escaped."""
    text = "Anna\u2019s Apple\u00a0Watch \U0001f496 & <b>"
    assert canonical_form({"source": text}) == b'{"source":"' + text.encode() + b'"}'


def test_completeness_counts_significant_fields() -> None:
    """MERGE-7: completeness counts the top-level fields left in the canonical form."""
    value = {
        "date": "x",
        "qty": 0,
        "flag": False,
        "source": "",
        "context": None,
        "tags": [],
        "meta": {"a": 1},
        "hollow": {"a": None, "b": ""},
    }
    assert completeness(value) == 4


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(["", "A|B", "2024-02-06 07:00:00 -0800", "2024-02-06 15:00:00 +0000"]),
    st.sampled_from([0, 1, 46, 46.0, 46.00000000000001, -0.0, 0.1 + 0.2, 0.3, 2**70, 1e20]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=2)
        | st.dictionaries(st.sampled_from(["qty", "date", "x"]), inner, max_size=2)
    ),
    max_leaves=4,
)
_FIELDS = st.dictionaries(
    st.sampled_from(["qty", "source", "context", "end", "meta", "date"]), _VALUES, max_size=4
)


# Values Python calls equal whose canonical forms differ (a bool and its number, an integer
# beyond twelve digits and its double), and two spellings of one canonical value.
_PYTHON_EQUAL = [
    ({"qty": True}, {"qty": 1}),
    ({"meta": {"x": False}}, {"meta": {"x": 0}}),
    ({"qty": 2**70}, {"qty": float(2**70)}),
]
_RESPELLED = [({"qty": 46}, {"qty": 46.0}), ({"qty": 46}, {"qty": 46.00000000000001})]


@given(_FIELDS, _FIELDS, st.randoms(use_true_random=False))
@example(*_PYTHON_EQUAL[0], random.Random(0))
@example(*_PYTHON_EQUAL[1], random.Random(0))
@example(*_PYTHON_EQUAL[2], random.Random(0))
@example(*_RESPELLED[0], random.Random(0))
@example(*_RESPELLED[1], random.Random(0))
def test_meeting_decided_as_canonical_forms_decide(
    left: dict[str, Any], right: dict[str, Any], rng: Any
) -> None:
    """MERGE-23: the cheap answers agree with the canonical forms, in either key order, also
    for values Python calls equal and numbers in other spellings."""
    left, right = dict(left), dict(right)
    for fields in (left, right):
        fields["start"] = "2024-02-06 15:00:00 +0000"
        fields.pop("end", None)
    shuffled = dict(rng.sample(list(left.items()), len(left)))
    for a, b in ((left, right), (left, shuffled), (shuffled, left)):
        first = point_at(json.dumps(a).encode(), FEB_6_15H, FEB_6_15H)
        second = point_at(json.dumps(b).encode(), FEB_6_15H, FEB_6_15H)
        assert first.completeness == completeness(a)
        assert same_content(first, second) == (canonical_form(a) == canonical_form(b))


@given(st.lists(st.tuples(_FIELDS, _FIELDS, st.booleans()), min_size=1, max_size=4))
@example([(*pair, False) for pair in _PYTHON_EQUAL])
def test_meetings_settled_at_once_only_when_every_pair_is_the_same_merge_24(
    pairs: list[tuple[dict[str, Any], dict[str, Any], bool]],
) -> None:
    """MERGE-24: a whole object's meetings are settled at once exactly when the decoded
    values agree, and then every pair's canonical forms are equal."""
    lefts, rights = [], []
    for left, right, same in pairs:
        lefts.append(left)
        rights.append(dict(reversed(left.items())) if same else right)
    olds = decode_all([json.dumps(value).encode() for value in lefts])
    news = decode_all([json.dumps(value).encode() for value in rights])
    assert olds == lefts
    assert news == rights
    settled = all_same_content(olds, news)
    if settled:
        assert all(
            canonical_form(a) == canonical_form(b) for a, b in zip(lefts, rights, strict=True)
        )
    if all(same for _, _, same in pairs):
        assert settled
