"""Points: coordinates, canonical form and completeness (S1, S4, S5).

A point is one element of a metric's ``data`` array or one section record. It is kept
verbatim (``raw``: the compact JSON bytes as they arrived) and compared by its canonical
form, which decides which bytes a merge keeps, and by its instant form, which decides whether
two points collide (MERGE-31); never by the raw bytes.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import orjson

from healthlog.timestamps import TimestampError, latin_digits, parse_instant

TIMESTAMP_KEYS = frozenset({"date", "start", "end", "startDate", "endDate"})
OTHER_DATE_KEYS = frozenset({"sleepStart", "sleepEnd", "inBedStart", "inBedEnd", "timestamp"})
"""Keys under which the app writes dates in the phone's offset besides the timestamps
(aggregated sleep's, a workout route point's). The canonical form keeps their text as written:
it decides which bytes a merge keeps, and reading them as instants there would keep other bytes
than a store folded before holds, which its rebuild (``healthlog verify``) would then show. The
instant form (:func:`instant_form`) reads them as instants, for whether two points are the same
value (MERGE-31)."""
_INSTANT_KEYS = TIMESTAMP_KEYS | OTHER_DATE_KEYS

Coordinates = tuple[int, int] | tuple[int, int, str]
"""Where a point is: its start and end; a record of a section that names what it records
(:func:`named_at`) has its name as well."""

_decoder = msgspec.json.Decoder()
_sorted_encoder = msgspec.json.Encoder(order="sorted")
_NESTED = frozenset({dict, list})


MAX_NESTING = 64
"""The deepest a point may nest objects and arrays (its own object is level 1). A deeper one is
rejected by :func:`nesting`, which uses no recursion, before anything recursive reads it: so
whether a point is taken never depends on how deep the call stack reading it is (a fold
worker's, a rebuild's), which decides where recursion runs out."""

_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def nesting(raw: bytes) -> int:
    """How deep the JSON text ``raw`` nests arrays and objects, counted without recursion;
    brackets inside strings do not count."""
    return _depth(_structure(raw))


def body_nesting(body: bytes) -> int:
    """:func:`nesting` of a whole body, read a piece of about ``_BODY_PIECE`` bytes at a time, so
    that no copy of the body is made: only its quotes and brackets are kept."""
    pieces = []
    at = 0
    while at < len(body):
        end = at + _BODY_PIECE
        # A run of backslashes stays in one piece, so its escapes pair up as in the whole.
        while end < len(body) and body[end - 1] == _BACKSLASH:
            end += 1
        pieces.append(_structure(body[at:end]))
        at = end
    return _depth(b"".join(pieces))


_BODY_PIECE = 2**20
_BACKSLASH = ord("\\")


def _structure(raw: bytes) -> bytes:
    """The quotes and brackets of ``raw`` outside its escapes, two adjacent quotes dropped: a
    string holding no bracket leaves nothing, and the quotes keep their parity."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return raw.translate(None, _NOT_STRUCTURE).replace(b'""', b"")


def _depth(plain: bytes) -> int:
    """The nesting of the quotes and brackets :func:`_structure` keeps of a JSON text."""
    # When no quote is left, no string held a bracket; else each string is cut out (a piece
    # per string).
    outside = plain
    if b'"' in outside:
        outside = b"".join(plain.split(b'"')[::2])
    # Each opening bracket a step of 1, each closing one of -1 (the signed byte 0xff).
    steps = memoryview(outside.translate(_STEP)).cast("b")
    return max(itertools.accumulate(steps), default=0)


class PointError(ValueError):
    """A point that cannot be folded; the message never carries a value."""


class Point:
    """One decoded point of one delivery, ready to merge.

    The canonical form is computed on first use: a meeting of two points is mostly decided by
    their raw bytes, their completeness or their plain content (see :func:`same_content`).
    """

    __slots__ = ("_canonical", "_instants", "_value", "completeness", "end", "raw", "start")

    def __init__(
        self,
        start: int,
        end: int,
        raw: bytes,
        completeness: int,
        value: dict[str, Any] | None,
        canonical: bytes | None,
    ) -> None:
        self.start = start
        self.end = end
        self.raw = raw
        self.completeness = completeness
        self._value = value
        self._canonical = canonical
        self._instants: bytes | None = None

    @property
    def canonical(self) -> bytes:
        """The canonical bytes (S4), computed on first use. A point nests at most
        ``MAX_NESTING`` levels, so the recursion runs out only on a call stack already near its
        limit, and then raises :class:`PointError`."""
        if self._canonical is None:
            self._canonical = self._form(canonical_form)
        return self._canonical

    @property
    def instant_form(self) -> bytes:
        """:func:`instant_form`, computed on first use, as :attr:`canonical` is."""
        if self._instants is None:
            self._instants = self._form(instant_form)
        return self._instants

    def _form(self, form: Callable[[dict[str, Any]], bytes]) -> bytes:
        assert self._value is not None
        try:
            return form(self._value)
        except RecursionError:
            raise PointError("point is not valid JSON") from None


def instant_of(value: object) -> int:
    """The instant of a point's timestamp: ``parse_instant``, fast for the app's own shape
    ``yyyy-MM-dd HH:mm:ss ±hhmm``, with a Buddhist-era year read as its Gregorian year.

    Minute-level bodies bring a new timestamp on almost every point but few distinct hours,
    so the instant of the hour (date, hour and offset) is cached and the minutes and seconds
    are added from a table, which also validates them. Anything else, and any hour that does
    not parse, goes through ``parse_instant`` (and its error message). No hour made Gregorian
    is near the end of ``parse_instant``'s range (9999), so the minutes never carry past it.

    A year from ``BUDDHIST_ERA_FROM`` until ``BUDDHIST_ERA_UNTIL`` is a Buddhist-era year,
    written by a phone set to the Buddhist calendar (the app writes dates in the phone's
    calendar, as it writes its 12-hour clock): its Gregorian year is 543 less; month, day and
    time are the same (PARSE-41). It is made Gregorian where an hour is first parsed, so a
    cached hour costs nothing more. A year
    before ``GREGORIAN_FROM`` or from ``BUDDHIST_ERA_UNTIL`` on is refused there too, as another
    calendar's (PARSE-44, PARSE-47).
    """
    if type(value) is str and len(value) == _APP_SHAPE_LENGTH:
        within = _WITHIN_HOUR.get(value[13:19])
        if within is not None:
            key = value[:13] + value[19:]
            hour = _hours.get(key)
            if hour is None:
                hour = _hour_instant(key)
            if hour is not None:
                return hour + within
        elif not value.isascii():
            # The app's shape in the digits of the phone's locale: the hours of its ASCII
            # spelling are cached the same (TIME-30).
            text = latin_digits(value)
            if len(text) == _APP_SHAPE_LENGTH and text.isascii():
                return instant_of(text)
    return parse_instant(gregorian(value) if type(value) is str else value)


BUDDHIST_ERA_FROM = "2500"
"""The first Buddhist-era year read as one (1957 of the Gregorian calendar): no Gregorian year
from it on can date a health record."""
_BUDDHIST_ERA_OFFSET = 543
GREGORIAN_FROM = "1900"
"""The first year read as Gregorian. A year before it is one of another calendar, written by a
phone set to it (for 2024: 1446 of the Islamic calendar, Saudi Arabia's default; 1403 of the
Persian one, Iran's and Afghanistan's; 6 of the Japanese era, written 0006): no Gregorian year
before 1900 can date a health record, and no point is stored centuries early (PARSE-44)."""
_OTHER_CALENDAR = (
    "timestamp year is before 1900: a date in a calendar other than the Gregorian "
    "(Islamic, Persian, Japanese era) is not read"
)
BUDDHIST_ERA_UNTIL = "3000"
"""The first year past those read as Buddhist era (2457 of the Gregorian calendar). A year from
it on is one of another calendar a phone can be set to (5785 of the Hebrew calendar for 2024),
which read as Buddhist era would store a point in 5242 (PARSE-47)."""
_LATER_CALENDAR = (
    "timestamp year is 3000 or later: a date in a calendar other than the Gregorian "
    "(Hebrew) is not read"
)


def gregorian(value: str) -> str:
    """``value`` with a Buddhist-era year (its first four characters after any whitespace, before
    a ``-``) replaced by its Gregorian year, four digits as well; any other value unchanged, but
    for one not in ASCII, which is first written with ASCII digits (``latin_digits``). A year
    before ``GREGORIAN_FROM``, or from ``BUDDHIST_ERA_UNTIL`` on, is another calendar's:
    :class:`TimestampError`."""
    if GREGORIAN_FROM <= value < BUDDHIST_ERA_FROM:
        return value
    if not value.isascii():
        value = latin_digits(value)
    text = value.lstrip()
    year = text[:4]
    if not (year.isascii() and year.isdigit() and text[4:5] == "-"):
        return value
    if year < GREGORIAN_FROM:
        raise TimestampError(_OTHER_CALENDAR)
    if year >= BUDDHIST_ERA_UNTIL:
        raise TimestampError(_LATER_CALENDAR)
    if year >= BUDDHIST_ERA_FROM:
        lead = len(value) - len(text)
        return f"{value[:lead]}{int(year) - _BUDDHIST_ERA_OFFSET:04d}{text[4:]}"
    return value


def _hour_instant(key: str) -> int | None:
    try:
        hour = parse_instant(gregorian(key[:13] + ":00:00" + key[13:]))
    except TimestampError:
        return None
    if len(_hours) >= _HOURS_LIMIT:
        _hours.clear()
    _hours[key] = hour
    return hour


_APP_SHAPE_LENGTH = len("2024-02-06 07:00:00 -0800")
_WITHIN_HOUR = {f":{m:02d}:{s:02d}": (m * 60 + s) * 1_000_000 for m in range(60) for s in range(60)}
_hours: dict[str, int] = {}
_HOURS_LIMIT = 1 << 12


def coordinates(value: dict[str, Any]) -> tuple[int, int]:
    """Start and end of a point (P3): the first start key present decides, no fallback.

    Start keys in order: ``start``, ``startDate``, ``date``; end keys: ``end``, ``endDate``.
    """
    if "start" in value:
        key = "start"
    elif "startDate" in value:
        key = "startDate"
    elif "date" in value:
        key = "date"
    else:
        raise PointError("no start, startDate or date")
    start = _instant_at(value, key)
    if "end" in value:
        end = _instant_at(value, "end")
    elif "endDate" in value:
        end = _instant_at(value, "endDate")
    else:
        return start, start
    if end < start:
        raise PointError("end before start")
    return start, end


def _instant_at(value: dict[str, Any], key: str) -> int:
    try:
        return instant_of(value[key])
    except TimestampError as exc:
        raise PointError(f"unparseable {key}: {exc}") from None


def point_object(raw: bytes | msgspec.Raw) -> dict[str, Any]:
    """The JSON object of one verbatim point."""
    try:
        value = _decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise PointError("point is not valid JSON") from None
    if type(value) is not dict:
        raise PointError(f"point is a JSON {type(value).__name__}, not an object")
    return value


def point_at(raw: bytes, start: int, end: int) -> Point:
    """Decode one verbatim point whose coordinates are known already (stored, or read)."""
    return _lazy_point(point_object(raw), start, end, raw)


def points_at(
    raws: list[bytes], keys: list[Coordinates], values: list[Any] | None = None
) -> list[Point]:
    """:func:`point_at` of many points, decoded together as one array (:func:`decode_all`),
    or from their ``values`` so decoded already; if they do not decode so, each is decoded
    on its own and the first that cannot be raises its :class:`PointError`."""
    if values is None:
        values = decode_all(raws)
    if values is None:
        return [point_at(raw, key[0], key[1]) for raw, key in zip(raws, keys, strict=True)]
    points = []
    for value, raw, key in zip(values, raws, keys, strict=True):
        if type(value) is not dict:
            raise PointError(f"point is a JSON {type(value).__name__}, not an object")
        points.append(_lazy_point(value, key[0], key[1], raw))
    return points


def named_at(start: int, end: int, raw: bytes, field: str | None) -> Coordinates:
    """The coordinates of a point, with the string under ``field`` when it has one that is not
    empty: records of a section where one moment holds several (the symptoms of a cycle day,
    which all span that day; the doses of a schedule logged at once) are told apart by what they
    record, and are the same record again wherever it is re-sent (MERGE-35)."""
    if field is None:
        return start, end
    try:
        name = point_object(raw).get(field)
    except PointError:
        return start, end
    return (start, end, name) if type(name) is str and name else (start, end)


def decode_all(raws: list[bytes]) -> list[Any] | None:
    """The JSON values of verbatim points, decoded together as one JSON array (each point is
    one JSON value, so the array decodes exactly when every point does), or None when it
    does not decode."""
    try:
        values = _decoder.decode(b"[%s]" % b",".join(raws))
    except (msgspec.DecodeError, RecursionError):
        return None
    return values if len(values) == len(raws) else None


def all_same_content(olds: list[Any], news: list[Any]) -> bool:
    """Whether decoded points have, pair by pair, the same canonical form, settled for all
    pairs at once: equal decoded values (keys sorted, every number and string as it came)
    have equal canonical forms, as in :func:`same_content`. False says nothing of any one
    pair. A re-sent window mostly holds the same points, in another key order."""
    try:
        return _sorted_encoder.encode(olds) == _sorted_encoder.encode(news)
    except (msgspec.EncodeError, OverflowError, RecursionError):
        return False


def _lazy_point(value: dict[str, Any], start: int, end: int, raw: bytes) -> Point:
    """A point that counts its fields without normalising them and leaves its canonical form
    for its first use: most meetings are decided without it (see :func:`same_content`)."""
    return Point(start, end, raw, field_count(value), value, None)


def field_count(value: dict[str, Any]) -> int:
    """The completeness of a decoded point (the number of fields its canonical form keeps),
    counted without normalising it."""
    values = list(value.values())
    # A field normalises to nothing only when null or "" (rule 3: 0 and false count), or when
    # it is an object or array that normalises to nothing (see :func:`_counts`).
    count = len(values) - values.count(None) - values.count("")
    if not is_flat(values):
        for item in values:
            if type(item) in _NESTED and not _counts(item):
                count -= 1
    return count


def _counts(field: dict[str, Any] | list[Any]) -> bool:
    """Whether an object or array field is left in the canonical form: an array that is not
    empty, or an object with a field that is (a string that is not empty, any number or bool,
    or such an object or array). Walked without recursion."""
    pending: list[Any] = [field]
    while pending:
        item = pending.pop()
        if type(item) is dict:
            pending.extend(item.values())
        elif item is not None and item != "" and item != []:
            return True
    return False


def is_flat(values: Iterable[object]) -> bool:
    """Whether a point's field values hold no object and no array."""
    return _NESTED.isdisjoint(map(type, values))


def same_content(a: Point, b: Point) -> bool:
    """Whether two points have the same canonical form, decided as cheaply as possible.

    Equal raw bytes, or equal decoded values (keys sorted, every number and string as it
    came), have equal canonical forms; a different completeness, or a field whose numbers
    differ at 12 significant digits, means different forms. Only what is left compares the
    canonical forms themselves.
    """
    if a.raw == b.raw:
        return True
    if a.completeness != b.completeness:
        return False
    if a._value is not None and b._value is not None:
        if numbers_differ(a._value, b._value):
            return False
        if _sorted_encoder.encode(a._value) == _sorted_encoder.encode(b._value):
            return True
    return a.canonical == b.canonical


def numbers_differ(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether some key holds a number in both whose canonical values differ."""
    for key, left in a.items():
        right: Any = b.get(key)
        if (
            type(left) in _NUMBERS
            and type(right) in _NUMBERS
            and left != right
            and _number_text(left) != _number_text(right)
        ):
            return True
    return False


_NUMBERS = frozenset({int, float})


def same_value(a: Point, b: Point) -> bool:
    """Whether two points of different canonical forms are the same value all the same: their
    forms differ only by dates under ``OTHER_DATE_KEYS`` that are the same instants written in
    other offsets (MERGE-31)."""
    # Without such a key in either, the instant forms are the canonical forms, which differ: most
    # points carry none, and a meeting of changed values then costs no second form.
    if _OTHER_DATE_KEY.search(a.raw) is None and _OTHER_DATE_KEY.search(b.raw) is None:
        return False
    return a.instant_form == b.instant_form


# A key of ``OTHER_DATE_KEYS`` in a point's raw bytes, or a backslash, behind which an escape
# could spell one.
_OTHER_DATE_KEY = re.compile(
    rb'\\|"(?:%s)"' % b"|".join(key.encode() for key in sorted(OTHER_DATE_KEYS))
)


def completeness(value: dict[str, Any]) -> int:
    """Number of significant fields: those left in the canonical form."""
    return len(_normalise_object(value, TIMESTAMP_KEYS))


def canonical_form(value: dict[str, Any]) -> bytes:
    """The canonical bytes of a point (S4).

    Keys sorted, empty values left out, numbers as ``%.12g`` doubles (integers beyond that
    precision keep their digits), timestamp fields as their UTC instant in microseconds,
    compact UTF-8 JSON.
    """
    return _encode(_normalise_object(value, TIMESTAMP_KEYS))


def instant_form(value: dict[str, Any]) -> bytes:
    """The canonical form with the string values of ``OTHER_DATE_KEYS`` read as instants too,
    as those of the timestamp keys are (a text that is no date kept as it is)."""
    return _encode(_normalise_object(value, _INSTANT_KEYS))


def _encode(normal: dict[str, object]) -> bytes:
    encoded = orjson.dumps(normal, option=orjson.OPT_SORT_KEYS)
    # orjson may hand back a buffer of several KiB for a short result; a point keeps its
    # canonical form for the whole fold, so keep a right-sized copy.
    return bytes(memoryview(encoded))


_TWELVE_DIGITS = 10**12
_LARGEST_DOUBLE = int(sys.float_info.max)


def _number(value: int | float) -> orjson.Fragment:
    """A number as the canonical form writes it (:func:`_number_text`)."""
    return orjson.Fragment(_number_text(value))


def _number_text(value: int | float) -> bytes:
    """A number printed as a double with 12 significant digits (``%.12g``: ``46``, ``0.3``,
    ``5e-05``, ``1e+12``); an integer beyond that precision (more than 12 significant digits,
    or past the largest double) keeps every digit, so ``10**12`` is ``1e+12`` like the double
    and ``10**12 + 1`` stays exact. Zero is ``0`` whatever its sign: a JSON decoder keeps no
    sign on an integer zero, so ``-0`` and ``-0.0`` would otherwise differ."""
    if (
        type(value) is int
        and abs(value) >= _TWELVE_DIGITS
        and (abs(value) > _LARGEST_DOUBLE or len(str(abs(value)).rstrip("0")) > 12)
    ):
        return b"%d" % value
    return b"%.12g" % value if value else b"0"


def _normalise_object(value: dict[str, Any], dates: frozenset[str]) -> dict[str, object]:
    """``value`` normalised for the canonical form, the string values of the keys ``dates``
    (at any depth) read as instants where they are dates."""
    out: dict[str, object] = {}
    for key, item in value.items():
        kind = type(item)
        if kind is str:
            if not item:
                continue
            if key in dates:
                try:
                    out[key] = instant_of(item)
                except TimestampError:
                    out[key] = item
            else:
                out[key] = item
        elif kind is float or kind is int:
            out[key] = _number(item)
        elif kind is bool:
            out[key] = item
        elif kind is dict:
            nested = _normalise_object(item, dates)
            if nested:
                out[key] = nested
        elif kind is list:
            items = [_normalise_item(i, dates) for i in item]
            if items:
                out[key] = items
    return out


def _normalise_item(item: object, dates: frozenset[str]) -> object:
    if isinstance(item, bool) or item is None or isinstance(item, str):
        return item
    if isinstance(item, int | float):
        return _number(item)
    if isinstance(item, dict):
        return _normalise_object(item, dates)
    if isinstance(item, list):
        return [_normalise_item(i, dates) for i in item]
    return item
