"""The content digest of a delivery with an idempotency key (I1).

Two bodies have the same content when they are the same bytes, or the same JSON once decoded
and encoded again with sorted keys and no whitespace (the app does not keep key order): the
digest is the sha256 of that canonical text, or the raw sha256 of a body that is not JSON or
that cannot be canonicalised (integers beyond 64 bits, nesting deeper than 254 levels).

A body is never decoded whole, since that takes about six times its size in memory (an array
of tiny values thirty times): the canonical text is hashed as it is produced, from pieces of
at most ``WINDOW_BYTES`` decoded one at a time (a number larger than that is decoded whole: it
becomes one number). A value that fits the window is decoded and encoded at once. A larger
array is read as runs of whole elements that fit the window (a run's end is found by checking
its structure: a cut inside a string or a nested value never passes), an element larger than
the window on its own; a larger object member by member, its members then written in key
order, each value found again by its place in the body; a longer string in chunks cut where no
escape or character is split. The text is the same, byte for byte, as the
whole body's encoding would be, wherever the pieces fall.

Where a value ends is found by msgspec's check of structure alone (it says where the content
after a complete value begins); what is written is decoded in full, and so is a duplicate
key's earlier value, which is not written but must be JSON, as in a whole decoding.

Bounds that the whole encoding does not have, reached only by bodies no app sends: an object
larger than the window with more than ``MAX_MEMBERS`` members (duplicates counted), values
larger than the window nested more than ``MAX_LARGE_DEPTH`` deep, a key larger than the window
or more than 8 MiB of keys in such objects, a string larger than it with a run of 64
backslashes where a chunk would end, or more than ``MAX_STEPS`` array elements that could not
be read in runs make a body's digest its raw sha256. The decoder's own nesting limit (about
1,000 levels, less the caller's stack) falls a little lower for a value read deep inside a large
body than for the whole body.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable

import msgspec
import orjson

WINDOW_BYTES = 2**20
MAX_MEMBERS = 4096
MAX_LARGE_DEPTH = 64
MAX_STEPS = 1_000_000
# A run is looked for among at most this many cuts, and checked at most this many times.
_CUTS = 64
_TRIES = 4
_SMALLEST_SPAN = 256
_FIRST_PROBE = 4096
_LONGEST_PAUSE = 1024
# How far back from a window's end a string's chunk may end (see ``_string_cut``).
_CUT_SEARCH = 64
_NUMBER_START = b"-0123456789"
# The bytes of keys held for objects larger than the window, at most (decoded, a key may take
# four times its bytes).
_KEY_BYTES = 8 * 2**20

_decoder = msgspec.json.Decoder()
_string_decoder = msgspec.json.Decoder(str)
_structure = msgspec.json.Decoder(msgspec.Raw)
_SPACE = re.compile(rb"[ \t\n\r]*")
# Where msgspec's message places an error: for content after a complete value, the byte after
# the first one of it; for any other error, the offset of the byte at fault (the text's length
# when it stops inside a value).
_AT_BYTE = re.compile(r"\(byte (\d+)\)")
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


def content_digest(body: bytes, raw_sha256: bytes, *, window: int = WINDOW_BYTES) -> bytes:
    """sha256 of the canonical JSON text of ``body``, or ``raw_sha256`` when it has none;
    ``window`` bounds the piece decoded at once (tests make it small; at least 16)."""
    digest = hashlib.sha256()
    try:
        _Canonical(body, digest.update, max(16, window)).document()
    except _NotCanonical:
        return raw_sha256
    return digest.digest()


class _NotCanonical(Exception):
    """The body is not JSON, or cannot be canonicalised."""


class _Canonical:
    """Writes the canonical text of one body to ``write``, a piece at a time.

    Reading a large value (:meth:`_value`) finds where it ends and remembers how it is made:
    the runs and large elements of an array, the members of an object by key, the chunks of a
    string. Writing (:meth:`_write`) then decodes each piece, in canonical order. A value is
    written at its ``depth`` (the number of arrays and objects around it): a piece is encoded
    inside as many arrays, so that orjson refuses exactly the nesting it refuses in a whole
    body.
    """

    def __init__(self, body: bytes, write: Callable[[bytes | memoryview], object], window: int):
        self._body = body
        self._view = memoryview(body)
        self._write_out = write
        self._window = window
        self._span = window - 2
        self._steps = 0
        # Elements read on their own before a run is looked for again: doubled each time none
        # is found, so that an array whose cuts all look unbalanced is not searched per element.
        self._pause = 0
        self._paused = 0
        self._arrays: dict[int, list[tuple[int, int, bool]]] = {}
        self._objects: dict[int, list[tuple[str, tuple[int, int]]]] = {}
        self._strings: dict[int, list[int]] = {}
        self._key_bytes = 0

    def document(self) -> None:
        body = self._body
        start = self._skip(0)
        if start == len(body):
            raise _NotCanonical
        if len(body) - start <= self._window:
            self._write(start, len(body), 0)
            return
        stop = self._value(start, 0)
        if self._skip(stop) != len(body):
            raise _NotCanonical
        self._write(start, stop, 0)

    # -- reading ----------------------------------------------------------------------------

    def _skip(self, at: int) -> int:
        match = _SPACE.match(self._body, at)
        assert match is not None
        return match.end()

    def _value(self, at: int, depth: int) -> int:
        """Where the value starting at ``at`` ends (whitespace after it may be included); a
        large one is remembered."""
        if at >= len(self._body):
            raise _NotCanonical
        end = self._small_end(at)
        if end is not None:
            return end
        first = self._body[at]
        if first == ord('"'):
            return self._string(at)
        number = _NUMBER.match(self._body, at)
        if number is not None:
            return number.end()
        if depth >= MAX_LARGE_DEPTH:
            raise _NotCanonical
        if first == ord("["):
            return self._array(at, depth)
        if first == ord("{"):
            return self._object(at, depth)
        raise _NotCanonical

    def _small_end(self, at: int) -> int | None:
        """Where the value at ``at`` ends if it fits the window, else None.

        The structure check reads one value and reports where any content after it begins; a
        probe grows from a small one, so that an element read on its own costs about its
        size, not the window's. A number cut by the probe reads as complete, so a scalar that
        reaches the probe's end is probed again, larger.
        """
        body = self._body
        size = _FIRST_PROBE
        while True:
            stop = min(len(body), at + min(size, self._window))
            after = _after_value(self._view[at:stop])
            if isinstance(after, int):
                return at + after
            if stop == len(body):
                if after is _CUT:
                    raise _NotCanonical
                return stop
            if after is None and body[at] not in _NUMBER_START:
                return stop
            if size >= self._window:
                return None
            size *= 8

    def _string(self, at: int) -> int:
        """Read a string larger than the window in chunks, each cut where no escape and no
        character is split; remember the cuts."""
        body = self._body
        cuts = [at + 1]
        while True:
            start = cuts[-1]
            stop = min(len(body), start + self._window - 2)
            after = _after_value(b"".join((b'"', self._view[start:stop])))
            if after is _CUT:
                if stop == len(body):
                    raise _NotCanonical
                cuts.append(self._string_cut(start, stop))
                continue
            end = start + after - 1 if isinstance(after, int) else stop
            close = body.rfind(b'"', start, end)
            cuts.append(close)
            self._strings[at] = cuts
            return close + 1

    def _string_cut(self, start: int, stop: int) -> int:
        """The last place in a string's bytes ``start:stop`` (where a chunk began) at which the
        chunk may end: not inside a character, not after a backslash that escapes,
        not inside the four digits of a ``\\u`` escape, and not between the two escapes of a
        surrogate pair; each chunk then decodes on its own to its part of the string."""
        body = self._body
        for cut in range(stop, max(start, stop - _CUT_SEARCH), -1):
            if body[cut] & 0xC0 == 0x80 or self._escaped(start, cut):
                continue
            escape = body.rfind(b"\\u", max(start, cut - 6), cut)
            if escape >= 0 and not self._escaped(start, escape):
                if cut - escape < 6:
                    continue
                if _HIGH_SURROGATE.fullmatch(body, escape, cut) and _LOW_SURROGATE.match(body, cut):
                    continue
            return cut
        raise _NotCanonical

    def _escaped(self, start: int, at: int) -> bool:
        """Whether the byte at ``at`` follows a backslash that escapes it: an odd run of
        backslashes before it, counted back to ``start`` (where no escape is open), at most
        ``_CUT_SEARCH`` of them."""
        low = max(start, at - _CUT_SEARCH)
        run = at - low - len(self._body[low:at].rstrip(b"\\"))
        if run == at - low and low > start:
            raise _NotCanonical
        return run % 2 == 1

    def _array(self, at: int, depth: int) -> int:
        """Read a large array as runs of whole elements and large elements on their own."""
        pieces: list[tuple[int, int, bool]] = []
        item = self._skip(at + 1)
        if self._body[item : item + 1] == b"]":
            self._arrays[at] = pieces
            return item + 1
        while True:
            end = None
            if self._paused:
                self._paused -= 1
            else:
                end = self._run(item)
            if end is None:
                self._step()
                end = self._value(item, depth + 1)
                if end - item > self._window - 2:
                    pieces.append((item, end, True))
                elif pieces and not pieces[-1][2] and end - pieces[-1][0] <= self._window - 2:
                    pieces[-1] = (pieces[-1][0], end, False)
                else:
                    pieces.append((item, end, False))
            else:
                pieces.append((item, end, False))
            after = self._skip(end)
            following = self._body[after : after + 1]
            if following == b"]":
                self._arrays[at] = pieces
                return after + 1
            if following != b",":
                raise _NotCanonical
            item = self._skip(after + 1)

    def _run(self, item: int) -> int | None:
        """The end of a run of whole elements from ``item`` that fits the span: the last of at
        most ``_CUTS`` cuts (a comma or a closing bracket) whose run passes the structure
        check, or None when none does (the element at ``item`` is then read on its own). A cut
        whose run has unbalanced brackets or quotes is passed over unchecked."""
        body = self._body
        high = min(len(body), item + self._span)
        tally = _tally(body, item, high)
        comma, bracket = body.rfind(b",", item, high), body.rfind(b"]", item, high)
        cuts = tries = 0
        while cuts < _CUTS and tries < _TRIES:
            cut = max(comma, bracket)
            if cut <= item:
                break
            if cut == comma:
                comma = body.rfind(b",", item, cut)
            else:
                bracket = body.rfind(b"]", item, cut)
            cuts += 1
            braces, brackets, quotes = _tally(body, cut, high)
            tally = (tally[0] - braces, tally[1] - brackets, tally[2] - quotes)
            high = cut
            if tally[0] or tally[1] or tally[2] % 2:
                continue
            tries += 1
            try:
                _structure.decode(b"".join((b"[", self._view[item:cut], b"]")))
            except (msgspec.DecodeError, RecursionError):
                continue
            self._span = min(self._window - 2, self._span * 2)
            self._pause = 0
            return cut
        self._span = max(min(_SMALLEST_SPAN, self._window - 2), self._span // 2)
        self._pause = min(_LONGEST_PAUSE, max(1, self._pause * 2))
        self._paused = self._pause
        return None

    def _object(self, at: int, depth: int) -> int:
        """Read a large object member by member; a later duplicate key wins, as in a whole
        decoding, and the value it replaces is decoded all the same."""
        members: dict[str, tuple[int, int]] = {}
        count = 0
        key_at = self._skip(at + 1)
        if self._body[key_at : key_at + 1] == b"}":
            self._objects[at] = []
            return key_at + 1
        while True:
            count += 1
            if count > MAX_MEMBERS or self._body[key_at : key_at + 1] != b'"':
                raise _NotCanonical
            key_end = self._small_end(key_at)
            self._key_bytes += 0 if key_end is None else key_end - key_at
            if key_end is None or self._key_bytes > _KEY_BYTES:
                raise _NotCanonical
            try:
                key = _string_decoder.decode(self._view[key_at:key_end])
            except msgspec.DecodeError:
                raise _NotCanonical from None
            colon = self._skip(key_end)
            if self._body[colon : colon + 1] != b":":
                raise _NotCanonical
            value = self._skip(colon + 1)
            end = self._value(value, depth + 1)
            if key in members:
                self._validate(*members[key])
            members[key] = (value, end)
            after = self._skip(end)
            following = self._body[after : after + 1]
            if following == b"}":
                self._objects[at] = sorted(members.items())
                return after + 1
            if following != b",":
                raise _NotCanonical
            key_at = self._skip(after + 1)

    def _step(self) -> None:
        self._steps += 1
        if self._steps > MAX_STEPS:
            raise _NotCanonical

    def _validate(self, start: int, end: int) -> None:
        """Decode a value that is not written (a duplicate key's earlier value), as a whole
        decoding would."""
        if start in self._arrays:
            for first, last, alone in self._arrays[start]:
                if alone:
                    self._validate(first, last)
                else:
                    self._run_values(first, last)
        elif start in self._objects:
            for _, (first, last) in self._objects[start]:
                self._validate(first, last)
        elif start in self._strings:
            for first, last in itertools.pairwise(self._strings[start]):
                self._chunk(first, last)
        else:
            self._decode(start, end)

    def _run_values(self, start: int, end: int) -> object:
        """The elements at ``start:end`` of an array, decoded as one array."""
        try:
            return _decoder.decode(b"".join((b"[", self._view[start:end], b"]")))
        except (msgspec.DecodeError, RecursionError):
            raise _NotCanonical from None

    def _chunk(self, start: int, end: int) -> str:
        """A chunk of a large string's bytes, decoded."""
        try:
            return _string_decoder.decode(b"".join((b'"', self._view[start:end], b'"')))
        except msgspec.DecodeError:
            raise _NotCanonical from None

    def _decode(self, start: int, end: int) -> object:
        try:
            return _decoder.decode(self._view[start:end])
        except (msgspec.DecodeError, RecursionError):
            raise _NotCanonical from None

    # -- writing ----------------------------------------------------------------------------

    def _write(self, start: int, end: int, depth: int) -> None:
        """Write the canonical text of the value at ``start:end``."""
        if start in self._arrays:
            self._write_out(b"[")
            for n, (first, last, alone) in enumerate(self._arrays[start]):
                if n:
                    self._write_out(b",")
                if alone:
                    self._write(first, last, depth + 1)
                else:
                    self._encode(self._run_values(first, last), depth, depth + 1)
            self._write_out(b"]")
        elif start in self._objects:
            self._write_out(b"{")
            for n, (key, (first, last)) in enumerate(self._objects[start]):
                if n:
                    self._write_out(b",")
                self._encode(key, 0, 0)
                self._write_out(b":")
                self._write(first, last, depth + 1)
            self._write_out(b"}")
        elif start in self._strings:
            self._write_out(b'"')
            for first, last in itertools.pairwise(self._strings[start]):
                self._encode(self._chunk(first, last), 0, 1)
            self._write_out(b'"')
        else:
            self._encode(self._decode(start, end), depth, depth)

    def _encode(self, value: object, depth: int, strip: int) -> None:
        """Encode ``value`` inside ``depth`` arrays and write it without ``strip`` bytes on
        either side."""
        for _ in range(depth):
            value = [value]
        try:
            text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except (orjson.JSONEncodeError, RecursionError):
            raise _NotCanonical from None
        self._write_out(memoryview(text)[strip : len(text) - strip])


class _Cut:
    """A text that stops inside a value (see :func:`_after_value`)."""


_CUT = _Cut()


def _after_value(text: bytes | memoryview) -> int | _Cut | None:
    """Check the structure of the JSON value ``text`` begins with: None when ``text`` is that
    value alone (with whitespace), the index where the content after it begins, or ``_CUT``
    when ``text`` stops inside it (truncated, or a number cut at its end); raise
    ``_NotCanonical`` when it is not JSON."""
    try:
        _structure.decode(text)
    except msgspec.DecodeError as exc:
        message = str(exc)
        at = _AT_BYTE.search(message)
        if "trailing characters" in message and at is not None:
            return int(at[1]) - 1
        if "truncated" in message or (at is not None and int(at[1]) >= len(text)):
            return _CUT
        raise _NotCanonical from None
    except RecursionError:
        raise _NotCanonical from None
    return None


def _tally(body: bytes, start: int, end: int) -> tuple[int, int, int]:
    """Braces opened less closed, brackets opened less closed, and unescaped quotes, in
    ``body[start:end]`` (brackets and quotes inside strings count too: a wrong tally only
    costs a run that is not tried)."""
    return (
        body.count(b"{", start, end) - body.count(b"}", start, end),
        body.count(b"[", start, end) - body.count(b"]", start, end),
        body.count(b'"', start, end) - body.count(b'\\"', start, end),
    )
