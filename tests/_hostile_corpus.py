"""The hostile corpus (specs/proof.md, PROOF-4 to PROOF-7): bodies a server must survive.

:func:`corpus` returns every :class:`Case`: the generated classes below, then the hand-written
files of ``tests/hostile/``, each named ``NAME.STATUS.EXT`` after the outcome it must get.
A generated case stores its points (if any) under a metric of its own, so what it adds can be
compared with what it sent, point by point, whatever order the corpus is folded in.

:class:`Oversized` is a body of any size made on the fly from one reused chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
from _cli_bodies import compact

HOSTILE_DIR = Path(__file__).parent / "hostile"
STATUSES = ("parsed", "partial", "failed")
DEPTH = 10_000
BIG = 2**70

# The valid small body that is cut at every structural position.
VALID = (
    b'{"data":{"metrics":[{"name":"hostile","units":"count","data":['
    b'{"date":"2024-03-01 10:00:00 +0000","qty":7,"source":"Watch"},'
    b'{"date":"2024-03-01 10:01:00 +0000","qty":8}]}],'
    b'"workouts":[{"name":"Walk","start":"2024-03-01 11:00:00 +0000",'
    b'"end":"2024-03-01 11:30:00 +0000"}]}}'
)
STRUCTURAL = b'{[,:"'
# One value of each JSON type: every field the corpus mistypes is replaced by each in turn.
WRONG = {
    "string": b'"wrong"',
    "number": b"-1.5e3",
    "null": b"null",
    "bool": b"true",
    "array": b'[1,"a"]',
    "object": b'{"k":"v"}',
}
DATE = b'"2024-03-01 10:00:00 +0000"'
SECOND = b'{"date":"2024-03-01 10:01:00 +0000","qty":8}'
AT_10 = "2024-03-01T10:00:00Z"
AT_1001 = "2024-03-01T10:01:00Z"
NON_NUMBERS = ("NaN", "Infinity", "-Infinity")


@attrs.frozen
class Case:
    """A body, the outcome it must get and, when checked, the points it must add.

    ``kept`` lists ``(start, raw point)`` in export order under ``metric``; None when only the
    status is checked: bodies without a metric of their own (envelope-level bodies, workout
    records, the hand-written files). ``units`` are those the kept points export with."""

    name: str
    body: bytes
    status: str
    metric: str | None = None
    kept: tuple[tuple[str, bytes], ...] | None = None
    units: str | None = "count"


def metric_of(name: str) -> str:
    return f"hostile.{name}"


def envelope(name: str, *points: bytes, units: bytes = b'"count"') -> bytes:
    return b'{"data":{"metrics":[{"name":%s,"units":%s,"data":[%s]}]}}' % (
        compact(metric_of(name)),
        units,
        b",".join(points),
    )


def first_point(*, date: bytes = DATE, qty: bytes = b"7", source: bytes = b'"Watch"') -> bytes:
    return b'{"date":%s,"qty":%s,"source":%s}' % (date, qty, source)


def truncated() -> Iterator[Case]:
    """VALID cut right after each ``{ [ , : "``: never JSON, so failed."""
    for i, byte in enumerate(VALID[:-1]):
        if byte in STRUCTURAL:
            yield Case(f"truncated-{i:03d}", VALID[: i + 1], "failed")


def kept_both(mutated: bytes) -> tuple[tuple[str, bytes], ...]:
    return ((AT_10, mutated), (AT_1001, SECOND))


def dated(name: str, mutated: bytes, start: str | None) -> Case:
    """``mutated`` beside SECOND: kept at ``start`` (parsed), or rejected when None (partial).
    The case of most mutations of the first point, not only of its date."""
    kept = ((start, mutated),) if start is not None else ()
    return Case(
        name,
        envelope(name, mutated, SECOND),
        "parsed" if start is not None else "partial",
        metric_of(name),
        tuple(sorted((*kept, (AT_1001, SECOND)))),
    )


def wrong_point_types() -> Iterator[Case]:
    """Each field of the first point as each type: a ``date`` that is not a timestamp rejects
    its point (partial); ``qty`` and ``source`` are not interpreted (parsed, kept verbatim)."""
    for kind, value in WRONG.items():
        yield dated(f"point-date-{kind}", first_point(date=value), None)
        for field in ("qty", "source"):
            yield dated(f"point-{field}-{kind}", first_point(**{field: value}), AT_10)


def wrong_entry_types() -> Iterator[Case]:
    """Each field of the metric entry as each type: ``units`` that are not a string become
    null; a name that is not a string, or ``data`` that is not an array of objects, leaves
    nothing to read (failed)."""
    for kind, value in WRONG.items():
        name = f"entry-units-{kind}"
        yield Case(
            name,
            envelope(name, first_point(), SECOND, units=value),
            "parsed",
            metric_of(name),
            kept_both(first_point()),
            "wrong" if kind == "string" else None,
        )
        name = f"entry-name-{kind}"
        named = kind == "string"
        yield Case(
            name,
            b'{"data":{"metrics":[{"name":%s,"units":"count","data":[%s,%s]}]}}'
            % (compact(metric_of(name)) if named else value, first_point(), SECOND),
            "parsed" if named else "failed",
            metric_of(name),
            kept_both(first_point()) if named else (),
        )
        name = f"entry-data-{kind}"
        yield Case(
            name,
            b'{"data":{"metrics":[{"name":%s,"units":"count","data":%s}]}}'
            % (compact(metric_of(name)), value),
            "failed",
            metric_of(name),
            (),
        )


def wrong_envelope_types() -> Iterator[Case]:
    """The root, ``data`` and ``metrics`` as each type: only an object (an envelope without
    known sections) is read, and it holds nothing."""
    for kind, value in WRONG.items():
        readable = "parsed" if kind == "object" else "failed"
        yield Case(f"root-{kind}", value, readable)
        yield Case(f"envelope-data-{kind}", b'{"data":%s}' % value, readable)
        yield Case(f"envelope-metrics-{kind}", b'{"data":{"metrics":%s}}' % value, "failed")


def wrong_record_types() -> Iterator[Case]:
    """Each field of a workout as each type, beside a good workout: a ``start`` or ``end`` that
    is not a timestamp rejects the record (partial); ``name`` is not interpreted (parsed).
    Records share the pseudo-metric ``workouts``, so each case has a day of its own and only
    its status is checked."""
    for n, (kind, value) in enumerate(WRONG.items()):
        for m, field in enumerate(("start", "end", "name")):
            day = b"2024-04-%02d" % (1 + 3 * n + m)
            record = {
                b"name": b'"Walk"',
                b"start": b'"%s 08:00:00 +0000"' % day,
                b"end": b'"%s 08:30:00 +0000"' % day,
            }
            record[field.encode()] = value
            good = b'{"name":"Run","start":"%s 18:00:00 +0000"}' % day
            fields = b",".join(b'"%s":%s' % item for item in record.items())
            yield Case(
                f"record-{field}-{kind}",
                b'{"data":{"workouts":[{%s},%s]}}' % (fields, good),
                "parsed" if field == "name" else "partial",
            )


def non_numbers() -> Iterator[Case]:
    """NaN and Infinity are not JSON: wherever they stand, the body is undecodable."""
    for literal in NON_NUMBERS:
        raw = literal.encode()
        name = f"{literal.lower()}-qty"
        yield Case(
            name, envelope(name, first_point(qty=raw), SECOND), "failed", metric_of(name), ()
        )
        name = f"{literal.lower()}-date"
        yield Case(
            name, envelope(name, first_point(date=raw), SECOND), "failed", metric_of(name), ()
        )
        yield Case(f"{literal.lower()}-root", raw, "failed")
        yield Case(f"{literal.lower()}-data", b'{"data":%s}' % raw, "failed")
        yield Case(f"{literal.lower()}-unknown-section", b'{"data":{"extra":%s}}' % raw, "failed")


def big_numbers() -> Iterator[Case]:
    """Integers past 64 bits keep their digits, and so do long fractions, -0 and a number too
    small for a double; a number too large for a double rejects its point; an integer is not a
    timestamp."""
    for name, qty in (
        ("int-2**70", b"%d" % BIG),
        ("int--2**70", b"%d" % -BIG),
        ("int-2**64", b"%d" % 2**64),
        ("int-400-digits", b"9" * 400),
        ("int-2**70-fraction", b"%d.5" % BIG),
        ("int-2**70-exponent", b"%dE2" % BIG),
        ("long-fraction", b"0.10000000000000000000000000001"),
        ("minus-zero", b"-0"),
        ("underflow", b"1e-400"),
    ):
        yield dated(name, first_point(qty=qty), AT_10)
    yield dated("overflow", first_point(qty=b"1E400"), None)
    yield dated("int-2**70-date", first_point(date=b"%d" % BIG), None)
    name = "int-2**70-units"
    yield Case(
        name,
        envelope(name, first_point(), SECOND, units=b"%d" % BIG),
        "parsed",
        metric_of(name),
        kept_both(first_point()),
        None,
    )
    yield Case("int-2**70-unknown-section", b'{"data":{"extra":%d}}' % BIG, "parsed")


def deep() -> Iterator[Case]:
    """10,000 levels of nesting anywhere: deeper than the body decoder goes, so failed."""
    arrays = b"[" * DEPTH + b"]" * DEPTH
    objects = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH
    yield Case("deep-root-arrays", arrays, "failed")
    yield Case("deep-root-objects", objects, "failed")
    yield Case("deep-root-unclosed", b"[" * DEPTH, "failed")
    for where, nested in (("arrays", arrays), ("objects", objects)):
        name = f"deep-qty-{where}"
        yield Case(
            name, envelope(name, first_point(qty=nested), SECOND), "failed", metric_of(name), ()
        )
        yield Case(f"deep-unknown-section-{where}", b'{"data":{"extra":%s}}' % nested, "failed")
    name = "deep-units"
    yield Case(
        name, envelope(name, first_point(), SECOND, units=arrays), "failed", metric_of(name), ()
    )


def invalid_utf8() -> Iterator[Case]:
    """Bytes that are not UTF-8 in a point reject that point; outside strings they are not JSON."""
    for where, mutated in (
        ("value", first_point(source=b'"W\xff\xfe"')),
        ("key", b'{"date":%s,"qty":7,"sou\xffrce":"Watch"}' % DATE),
        ("date", first_point(date=b'"2024-03-01 10:00:00 \xff0000"')),
        ("overlong", first_point(source=b'"W\xc0\xaf"')),
        ("surrogate", first_point(source=b'"W\xed\xa0\x80"')),
        ("cut-sequence", first_point(source=b'"W\xe2\x80"')),
        ("continuation", first_point(source=b'"\x80W"')),
    ):
        yield dated(f"utf8-point-{where}", mutated, None)
    yield Case("utf8-before-root", b"\xff" + envelope("utf8-before-root", SECOND), "failed")
    yield Case("utf8-after-root", envelope("utf8-after-root", SECOND) + b"\xff", "failed")
    yield Case("utf8-between-tokens", b'{"data":\xff{"metrics":[]}}', "failed")
    yield Case("utf8-envelope-key", b'{"da\xffta":{"metrics":[]}}', "failed")
    yield Case("utf8-section-key", b'{"data":{"metr\xffics":[]}}', "failed")
    name = "utf8-metric-name"
    yield Case(
        name,
        b'{"data":{"metrics":[{"name":"hostile.\xff","units":"count","data":[%s]}]}}' % SECOND,
        "failed",
        metric_of(name),
        (),
    )
    name = "utf8-units"
    yield Case(
        name,
        envelope(name, SECOND, units=b'"co\xffunt"'),
        "parsed",
        metric_of(name),
        ((AT_1001, SECOND),),
        None,
    )


def byte_order_marks() -> Iterator[Case]:
    """A leading UTF-8 BOM is ignored; UTF-16 and UTF-32 bodies, or a BOM elsewhere, are not
    JSON; a BOM inside a string is a character like any other."""
    name = "bom-utf8"
    yield Case(
        name,
        b"\xef\xbb\xbf" + envelope(name, first_point(), SECOND),
        "parsed",
        metric_of(name),
        kept_both(first_point()),
    )
    text = envelope("bom-utf16", first_point(), SECOND).decode()
    yield Case("bom-utf16-le", b"\xff\xfe" + text.encode("utf-16-le"), "failed")
    yield Case("bom-utf16-be", b"\xfe\xff" + text.encode("utf-16-be"), "failed")
    yield Case("bom-utf32", text.encode("utf-32"), "failed")
    yield Case("bom-utf8-twice", b"\xef\xbb\xbf" * 2 + envelope("bom-twice", SECOND), "failed")
    yield Case("bom-utf8-after-brace", b"{\xef\xbb\xbf" + envelope("bom-in", SECOND)[1:], "failed")
    yield dated("bom-in-a-string", first_point(source=b'"\xef\xbb\xbfWatch"'), AT_10)


def duplicate_keys() -> Iterator[Case]:
    """Duplicate keys: points keep them verbatim, envelope keys take the last one."""
    name = "dup-qty"
    mutated = b'{"date":%s,"qty":7,"qty":9}' % DATE
    yield Case(name, envelope(name, mutated), "parsed", metric_of(name), ((AT_10, mutated),))
    name = "dup-source"
    mutated = b'{"date":%s,"source":"A","qty":7,"source":"B"}' % DATE
    yield Case(name, envelope(name, mutated), "parsed", metric_of(name), ((AT_10, mutated),))
    name = "dup-data"
    yield Case(
        name,
        b'{"data":{"metrics":[]},' + envelope(name, SECOND)[1:],
        "parsed",
        metric_of(name),
        ((AT_1001, SECOND),),
    )
    name = "dup-metrics"
    inner = envelope(name, SECOND)
    yield Case(
        name,
        b'{"data":{"metrics":[],' + inner[len(b'{"data":{') :],
        "parsed",
        metric_of(name),
        ((AT_1001, SECOND),),
    )
    name = "dup-date"
    mutated = b'{"date":%s,"date":"2024-03-01 10:30:00 +0000","qty":7}' % DATE
    yield Case(
        name,
        envelope(name, mutated),
        "parsed",
        metric_of(name),
        (("2024-03-01T10:30:00Z", mutated),),
    )
    name = "dup-point"
    yield Case(
        name, envelope(name, SECOND, SECOND), "parsed", metric_of(name), ((AT_1001, SECOND),)
    )
    name = "dup-name"
    yield Case(
        name,
        b'{"data":{"metrics":[{"name":"ignored","name":%s,"units":"count","data":[%s]}]}}'
        % (compact(metric_of(name)), SECOND),
        "parsed",
        metric_of(name),
        ((AT_1001, SECOND),),
    )


def stamped(text: str) -> bytes:
    return first_point(date=compact(text))


def dates() -> Iterator[Case]:
    """12-hour times with U+202F, U+00A0 or a plain space; Buddhist-era years (2567), which are
    read as their Gregorian years (2024, where 29 February exists; PARSE-41);
    ``start`` decides over ``date`` wherever it stands; an end that is null or before the start,
    a date of more than 64 characters or with a NUL reject the point."""
    yield dated(
        "12h-narrow-nbsp-pm", stamped("2024-03-01 1:05:00\u202fPM +0000"), "2024-03-01T13:05:00Z"
    )
    yield dated("12h-space-pm", stamped("2024-03-01 1:05:00 PM +0000"), "2024-03-01T13:05:00Z")
    yield dated("12h-nbsp-am", stamped("2024-03-01 9:05:00\u00a0am +0000"), "2024-03-01T09:05:00Z")
    yield dated(
        "12h-midnight", stamped("2024-03-01 12:05:00\u202fa.m. +0000"), "2024-03-01T00:05:00Z"
    )
    yield dated("12h-hour-13", stamped("2024-03-01 13:05:00\u202fPM +0000"), None)
    yield dated("12h-hour-0", stamped("2024-03-01 0:05:00 AM +0000"), None)
    yield dated("buddhist-era", stamped("2567-03-01 10:00:00 +0700"), "2024-03-01T03:00:00Z")
    yield dated(
        "buddhist-era-12h", stamped("2567-03-01 1:05:00\u202fPM +0700"), "2024-03-01T06:05:00Z"
    )
    yield dated(
        "buddhist-era-29-february", stamped("2567-02-29 10:00:00 +0700"), "2024-02-29T03:00:00Z"
    )
    yield dated("buddhist-era-date-only", stamped("2567-03-01"), "2024-03-01T00:00:00Z")
    yield dated("too-long", stamped("2024-03-01 10:00:00 +0000" + " " * 40), None)
    yield dated("nul-escape", b'{"date":"2024-03-01\\u0000 10:00:00 +0000","qty":7}', None)
    yield dated("end-null", b'{"date":%s,"end":null,"qty":7}' % DATE, None)
    yield dated("end-before-start", b'{"date":%s,"end":"2024-03-01 09:00:00 +0000"}' % DATE, None)
    yield dated("start-beats-date", b'{"start":%s,"date":"x","qty":7}' % DATE, AT_10)
    yield dated("date-then-start", b'{"date":"x","start":%s,"qty":7}' % DATE, AT_10)


def html() -> Iterator[Case]:
    """``& < >`` stay exactly as sent, in values, keys, units and names, escaped or not."""
    for where, mutated in (
        ("source", first_point(source=b'"<script>alert(1)</script> & <b>"')),
        ("key", b'{"date":%s,"<k>&amp;":"&lt;v&gt;","qty":7}' % DATE),
        ("escaped", first_point(source=b'"\\u003cb\\u003e \\u0026 \\/"')),
    ):
        yield dated(f"html-{where}", mutated, AT_10)
    name = "html-units"
    yield Case(
        name,
        envelope(name, SECOND, units=b'"<&>"'),
        "parsed",
        metric_of(name),
        ((AT_1001, SECOND),),
        "<&>",
    )
    metric = "hostile.<b>&amp;</b>"
    yield Case(
        "html-metric-name",
        b'{"data":{"metrics":[{"name":%s,"units":"count","data":[%s]}]}}'
        % (compact(metric), SECOND),
        "parsed",
        metric,
        ((AT_1001, SECOND),),
    )


def entry(name: bytes, *points: bytes, units: bytes = b'"count"') -> bytes:
    """A metric entry whose ``name`` is given as raw JSON."""
    return b'{"name":%s,"units":%s,"data":[%s]}' % (name, units, b",".join(points))


def nul_characters() -> Iterator[Case]:
    """U+0000 in a metric name, as the escape ``\\u0000`` (the whole name, or at its start,
    middle or end), rejects that entry: alone it leaves nothing to read (failed), beside a
    good metric of the same name without it the good points are kept (partial). As a raw byte
    in a name or in units it is no JSON (failed); of two ``name`` keys the last decides; in
    units the escape is kept as a character (parsed)."""
    for where in ("whole", "start", "middle", "end"):
        for beside in (False, True):
            name = f"nul-name-{where}" + ("-beside" if beside else "")
            metric = metric_of(name).encode()
            nul = {
                "whole": b'"\\u0000"',
                "start": b'"\\u0000%s"' % metric,
                "middle": b'"hostile.\\u0000%s"' % metric[len(b"hostile.") :],
                "end": b'"%s\\u0000"' % metric,
            }[where]
            entries = [entry(nul, first_point())]
            if beside:
                entries.append(entry(compact(metric_of(name)), SECOND))
            yield Case(
                name,
                b'{"data":{"metrics":[%s]}}' % b",".join(entries),
                "partial" if beside else "failed",
                metric_of(name),
                ((AT_1001, SECOND),) if beside else (),
            )
    name = "nul-name-raw"
    yield Case(
        name,
        b'{"data":{"metrics":[%s]}}' % entry(b'"hostile.nul\x00raw"', SECOND),
        "failed",
        metric_of(name),
        (),
    )
    for order, last_has_nul in (("nul-last", True), ("nul-first", False)):
        name = f"nul-name-duplicate-{order}"
        plain, nul = compact(metric_of(name)), b'"%s\\u0000"' % metric_of(name).encode()
        first, last = (plain, nul) if last_has_nul else (nul, plain)
        yield Case(
            name,
            b'{"data":{"metrics":[{"name":%s,"name":%s,"units":"count","data":[%s]}]}}'
            % (first, last, SECOND),
            "failed" if last_has_nul else "parsed",
            metric_of(name),
            () if last_has_nul else ((AT_1001, SECOND),),
        )
    name = "nul-units-escape"
    yield Case(
        name,
        envelope(name, first_point(), SECOND, units=b'"co\\u0000unt"'),
        "parsed",
        metric_of(name),
        kept_both(first_point()),
        "co\x00unt",
    )
    name = "nul-units-raw"
    yield Case(name, envelope(name, SECOND, units=b'"co\x00unt"'), "failed", metric_of(name), ())


def empty_units() -> Iterator[Case]:
    """Units that are the empty string are null, like missing ones; the points are kept."""
    name = "entry-units-empty"
    yield Case(
        name,
        envelope(name, first_point(), SECOND, units=b'""'),
        "parsed",
        metric_of(name),
        kept_both(first_point()),
        None,
    )


def empty() -> Iterator[Case]:
    yield Case("empty", b"", "failed")
    yield Case("whitespace", b" \r\n\t", "failed")
    yield Case("empty-object", b"{}", "parsed")
    yield Case("empty-array", b"[]", "parsed")


def dense() -> Iterator[Case]:
    """Bodies over 1 MiB holding more than one value per 8 bytes (PARSE-39), one of them with
    valid points among its values, are failed whole; one value per 8 bytes is read."""
    count = 2**21 // 2
    yield Case("dense-digits", envelope("dense-digits", *[b"7"] * count), "failed")
    yield Case(
        "dense-among-points",
        envelope("dense-among-points", first_point(), *[b"[]"] * count, SECOND),
        "failed",
    )
    yield Case(
        "dense-at-the-limit", envelope("dense-at-the-limit", *[b"1234567"] * 2**18), "failed"
    )


def hand_written() -> Iterator[Case]:
    """The files of ``tests/hostile/``, named ``NAME.STATUS.EXT``."""
    for path in sorted(HOSTILE_DIR.iterdir()):
        name, status, _ = path.name.split(".")
        assert status in STATUSES, path.name
        yield Case(f"file-{name}", path.read_bytes(), status)


def corpus() -> list[Case]:
    cases = [
        *truncated(),
        *wrong_point_types(),
        *wrong_entry_types(),
        *wrong_envelope_types(),
        *wrong_record_types(),
        *non_numbers(),
        *big_numbers(),
        *deep(),
        *invalid_utf8(),
        *byte_order_marks(),
        *duplicate_keys(),
        *dates(),
        *html(),
        *nul_characters(),
        *empty_units(),
        *empty(),
        *dense(),
        *hand_written(),
    ]
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    checked = [case.metric for case in cases if case.kept is not None]
    assert len(set(checked)) == len(checked), "a checked case needs a metric of its own"
    return cases


class Oversized(httpx.AsyncByteStream):
    """``size`` bytes of a metric's points, made on the fly from one reused chunk.

    An iterator class, not an async generator, so an upload the server cuts off leaves no
    unfinished generator behind (see ``Drip`` in tests/_service_helpers.py)."""

    HEAD = b'{"data":{"metrics":[{"name":"oversized","units":"count","data":['
    POINT = b'{"date":"2024-03-01 10:00:00 +0000","qty":1},'
    CHUNK = POINT * (2**20 // len(POINT))

    def __init__(self, size: int) -> None:
        self.size = size
        self._sent = 0

    def __aiter__(self) -> Oversized:
        return self

    async def __anext__(self) -> bytes:
        if self._sent >= self.size:
            raise StopAsyncIteration
        chunk = self.HEAD if self._sent == 0 else self.CHUNK
        chunk = chunk[: self.size - self._sent]
        self._sent += len(chunk)
        return chunk
