"""The content digest of a delivery with an idempotency key (I1).

Two bodies have the same content when they are the same bytes, or the same JSON once decoded
and encoded again with sorted keys and no whitespace (the app does not keep key order): the
digest is the sha256 of that canonical text, or the raw sha256 of a body that is not JSON or
that cannot be canonicalised (integers beyond 64 bits, nesting deeper than 254 levels).

A body is never decoded whole, since that takes about six times its size in memory (an array
of tiny values thirty times): the canonical text is hashed as it is produced, a piece of at
most ``WINDOW_BYTES`` at a time. A value that fits the window is decoded and encoded at once.
A larger array is read as runs of whole elements that fit the window (a run's end is found by
decoding it: a cut inside a string or a nested value never decodes), an element larger than
the window on its own; a larger object member by member, its members then written in key
order, each value found again by its place in the body. The text is the same, byte for byte,
as the whole body's encoding would be, wherever the pieces fall.

Bounds that the whole encoding does not have, reached only by bodies no app sends: an object
larger than the window with more than ``MAX_MEMBERS`` members, values larger than the window
nested more than ``MAX_LARGE_DEPTH`` deep, or more than ``MAX_STEPS`` elements that could not
be read in runs make a body's digest its raw sha256.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import msgspec
import orjson

WINDOW_BYTES = 2**20
MAX_MEMBERS = 4096
MAX_LARGE_DEPTH = 64
MAX_STEPS = 1_000_000
# The deepest nesting orjson encodes: the whole body's encoding fails beyond it.
_MAX_NESTING = 254
# A run is looked for among at most this many cuts, and decoded at most this many times.
_CUTS = 64
_TRIES = 4
_SMALLEST_SPAN = 256
_FIRST_PROBE = 4096
_LONGEST_PAUSE = 1024

_decoder = msgspec.json.Decoder()
_key_decoder = msgspec.json.Decoder(str)
_structure = msgspec.json.Decoder(msgspec.Raw)
_SPACE = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(rb"[^ \t\n\r,\]}]+")


def content_digest(body: bytes, raw_sha256: bytes, *, window: int = WINDOW_BYTES) -> bytes:
    """sha256 of the canonical JSON text of ``body``, or ``raw_sha256`` when it has none;
    ``window`` bounds the piece decoded at once (tests make it small)."""
    digest = hashlib.sha256()
    try:
        _Canonical(body, digest.update, window).document()
    except _NotCanonical:
        return raw_sha256
    return digest.digest()


class _NotCanonical(Exception):
    """The body is not JSON, or cannot be canonicalised."""


class _Canonical:
    """Writes the canonical text of one body to ``write``, a piece at a time.

    Reading a large value (:meth:`_value`) finds where it ends and remembers how it is made:
    the runs and large elements of an array, the members of an object by key. Writing
    (:meth:`_write`) then decodes each piece again, in canonical order. A value is written at
    its ``depth`` (the number of arrays and objects around it): a piece is encoded inside as
    many arrays, so that orjson refuses exactly the nesting it refuses in a whole body.
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

    def document(self) -> None:
        start = self._skip(0)
        end = len(self._body.rstrip(b" \t\n\r"))
        if start >= end:
            raise _NotCanonical
        if end - start > self._window and self._value(start, 0) != end:
            raise _NotCanonical
        self._write(start, end, 0)

    # -- reading ----------------------------------------------------------------------------

    def _skip(self, at: int) -> int:
        match = _SPACE.match(self._body, at)
        assert match is not None
        return match.end()

    def _value(self, at: int, depth: int) -> int:
        """Where the value starting at ``at`` ends; a large one is remembered."""
        if at >= len(self._body):
            raise _NotCanonical
        first = self._body[at]
        if first not in b"[{":
            match = (_STRING if first == ord('"') else _SCALAR).match(self._body, at)
            if match is None:
                raise _NotCanonical
            _skim(self._view[at : match.end()])
            return match.end()
        end = self._small_end(at)
        if end is not None:
            return end
        if depth >= MAX_LARGE_DEPTH or depth >= _MAX_NESTING:
            raise _NotCanonical
        if first == ord("["):
            return self._array(at, depth)
        return self._object(at, depth)

    def _small_end(self, at: int) -> int | None:
        """Where the array or object at ``at`` ends if it fits the window, else None.

        orjson reports where the content after a value begins (as a character offset). It
        checks the UTF-8 of all it is given first, so a probe ends on a character, and grows
        from a small one: an element read on its own costs its size, not the window's.
        """
        body = self._body
        size = _FIRST_PROBE
        while True:
            stop = min(len(body), at + min(size, self._window))
            while at < stop < len(body) and body[stop] & 0xC0 == 0x80:
                stop -= 1
            try:
                orjson.loads(self._view[at:stop])
                end = stop
                break
            except orjson.JSONDecodeError as exc:
                if 0 < exc.pos < len(exc.doc) and exc.doc[exc.pos] in ",]}":
                    end = at + len(exc.doc[: exc.pos].encode())
                    break
                if stop == len(body):
                    raise _NotCanonical from None
                if size >= self._window:
                    return None
                size *= 8
        while body[end - 1] in b" \t\n\r":
            end -= 1
        _skim(self._view[at:end])
        return end

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
        """The end of the longest run of whole elements from ``item`` that fits the span, found
        by decoding it, or None when none was found (the element at ``item`` is then read on
        its own). Cuts whose piece has unbalanced brackets or quotes are passed over undecoded.
        """
        body = self._body
        high = min(len(body), item + self._span)
        tally = _tally(body, item, high)
        cuts = tries = 0
        while cuts < _CUTS and tries < _TRIES:
            cut = max(body.rfind(b",", item, high), body.rfind(b"]", item, high))
            if cut <= item:
                break
            cuts += 1
            braces, brackets, quotes = _tally(body, cut, high)
            tally = (tally[0] - braces, tally[1] - brackets, tally[2] - quotes)
            high = cut
            if tally[0] or tally[1] or tally[2] % 2:
                continue
            tries += 1
            try:
                _skim(b"".join((b"[", self._view[item:cut], b"]")))
            except _NotCanonical:
                continue
            self._span = min(self._window - 2, self._span * 2)
            self._pause = 0
            return cut
        self._span = max(_SMALLEST_SPAN, self._span // 2)
        self._pause = min(_LONGEST_PAUSE, max(1, self._pause * 2))
        self._paused = self._pause
        return None

    def _object(self, at: int, depth: int) -> int:
        """Read a large object member by member; a later duplicate key wins, as in a whole
        decoding."""
        members: dict[str, tuple[int, int]] = {}
        key_at = self._skip(at + 1)
        if self._body[key_at : key_at + 1] == b"}":
            self._objects[at] = []
            return key_at + 1
        while True:
            match = _STRING.match(self._body, key_at)
            if match is None:
                raise _NotCanonical
            try:
                key = _key_decoder.decode(self._view[key_at : match.end()])
            except msgspec.DecodeError:
                raise _NotCanonical from None
            colon = self._skip(match.end())
            if self._body[colon : colon + 1] != b":":
                raise _NotCanonical
            value = self._skip(colon + 1)
            end = self._value(value, depth + 1)
            if key in members:
                self._validate(*members[key])
            members[key] = (value, end)
            if len(members) > MAX_MEMBERS:
                raise _NotCanonical
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
        else:
            self._decode(start, end)

    def _run_values(self, start: int, end: int) -> object:
        """The elements at ``start:end`` of an array, decoded as one array."""
        try:
            return _decoder.decode(b"".join((b"[", self._view[start:end], b"]")))
        except (msgspec.DecodeError, RecursionError):
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
                self._write_out(orjson.dumps(key))
                self._write_out(b":")
                self._write(first, last, depth + 1)
            self._write_out(b"}")
        else:
            self._encode(self._decode(start, end), depth, depth)

    def _encode(self, value: object, depth: int, strip: int) -> None:
        """Encode ``value`` inside ``depth`` arrays and write it without ``strip`` brackets
        on either side."""
        for _ in range(depth):
            value = [value]
        try:
            text = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        except (orjson.JSONEncodeError, RecursionError):
            raise _NotCanonical from None
        self._write_out(memoryview(text)[strip : len(text) - strip])


def _skim(text: bytes | memoryview) -> None:
    """Check that ``text`` is one JSON value by its structure alone (brackets, commas, colons,
    string escapes and number syntax), without building it: enough to know where a value
    ends. Its strings' UTF-8 and its numbers' range are checked when it is decoded to be
    written (or, for a duplicate key's earlier value, validated)."""
    try:
        _structure.decode(text)
    except (msgspec.DecodeError, RecursionError):
        raise _NotCanonical from None


def _tally(body: bytes, start: int, end: int) -> tuple[int, int, int]:
    """Braces opened less closed, brackets opened less closed, and unescaped quotes, in
    ``body[start:end]`` (brackets and quotes inside strings count too: a wrong tally only
    costs a run that is not tried)."""
    return (
        body.count(b"{", start, end) - body.count(b"}", start, end),
        body.count(b"[", start, end) - body.count(b"]", start, end),
        body.count(b'"', start, end) - body.count(b'\\"', start, end),
    )
