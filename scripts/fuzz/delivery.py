"""Fuzz a delivery's body as the fold sees it (requirement X, specs/proof.md).

The first byte of an input picks the ``automation-aggregation`` header, the rest is the body.
Every input is folded by the real :class:`healthlog.fold.DeliveryFold`, and must end in an
outcome (parsed, partial or failed: a fold has no documented exception); then:

- folding it again into nothing gives the same objects and outcome (deterministic);
- folding it again into what it wrote changes nothing (idempotent), and so does folding the
  same body with every object's keys in the reverse order (a re-send: same canonical forms);
  a copy with every number one more, folded twice, writes nothing the second time;
- each point's canonical form, decoded and formed again, is a fixed point after one pass (a
  first pass prints timestamps as integer instants, a second as the numbers they became);
- the content digest is the same read in 32-byte windows as read whole (content.py), and is
  the canonical JSON text's wherever msgspec decodes the body and orjson encodes it.

Run: ``.venv/bin/python scripts/fuzz/delivery.py -max_total_time=600``.
"""

from __future__ import annotations

import hashlib
import re
import sys
from typing import Any

import _common
import atheris
import msgspec
import orjson

with atheris.instrument_imports():
    from healthlog import content, layers, objects, points
    from healthlog.fold import FAILED, PARSED, PARTIAL, DeliveryFold, DeliveryInfo, Outcome
    from healthlog.objects import HourlyObject, ObjectKey

HEADERS = (None, "minutes", "hours", "days", "seconds", "Default", "weeks", " Bogus ")
WINDOW = 32
_BACKSLASHES = re.compile(rb"\\{60,}")
_LONG_KEY = re.compile(rb'"(?:[^"\\]|\\.){%d,}"\s*:' % (WINDOW - 4))


class Store:
    """Stored objects in a dict, under an inherited layer."""

    def __init__(self, inherited: str | None) -> None:
        self.objects: dict[ObjectKey, HourlyObject] = {}
        self.inherited = inherited

    def load(self, key: ObjectKey) -> HourlyObject | None:
        return self.objects.get(key)

    def inherited_layer(self) -> str | None:
        return self.inherited

    def sealed(self, key: ObjectKey) -> bool:
        return False


def fold(body: bytes, header: str | None, store: Store) -> tuple[list[HourlyObject], Outcome]:
    run = DeliveryFold(body, DeliveryInfo(1, 1, header), store)
    written = []
    for obj in run.writes():
        store.objects[obj.key] = obj
        written.append(obj)
    assert run.outcome is not None
    return written, run.outcome


def summary(outcome: Outcome) -> tuple[Any, ...]:
    return outcome.status, outcome.reason, outcome.layer, repr(outcome.counters)


def reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: reversed_keys(value[key]) for key in reversed(value)}
    if isinstance(value, list):
        return [reversed_keys(item) for item in value]
    return value


def numbers_changed(value: Any) -> Any:
    """``value`` with every number one more: the same points in conflict with those stored."""
    if isinstance(value, dict):
        return {key: numbers_changed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [numbers_changed(item) for item in value]
    if type(value) in (int, float):
        return value + 1
    return value


def check_canonical(raw: bytes) -> None:
    value = points.point_object(raw)
    first = points.canonical_form(value)
    assert points.canonical_form(reversed_keys(value)) == first, "canonical form of key order"
    second = points.canonical_form(points.point_object(first))
    assert points.canonical_form(points.point_object(second)) == second, "canonical not stable"


def check_digest(body: bytes) -> None:
    raw = hashlib.sha256(body).digest()
    whole = content.content_digest(body, raw)
    # The documented bounds of the windowed reading (content.py's docstring): deep nesting,
    # a key larger than the window, runs of backslashes where a chunk would end.
    bounded = _LONG_KEY.search(body) or _BACKSLASHES.search(body)
    if points.body_nesting(body) <= 60 and not bounded:
        windowed = content.content_digest(body, raw, window=WINDOW)
        assert windowed == whole, "windowed digest differs"
    try:
        text = orjson.dumps(msgspec.json.decode(body), option=orjson.OPT_SORT_KEYS)
    except (msgspec.DecodeError, orjson.JSONEncodeError, RecursionError):
        return
    assert whole == hashlib.sha256(text).digest(), "digest is not the canonical text's"


def test(data: bytes) -> None:
    if not data:
        return
    header = HEADERS[data[0] % len(HEADERS)]
    body = data[1:]
    inherited = "minutes" if data[0] & 0x80 else None
    store = Store(inherited)
    written, outcome = fold(body, header, store)
    assert outcome.status in (PARSED, PARTIAL, FAILED)
    assert outcome.layer is None or outcome.layer in layers.STORED_LAYERS
    again, same = fold(body, header, Store(inherited))
    assert summary(same) == summary(outcome), "outcome not deterministic"
    assert [(o.key, o.hash) for o in again] == [(o.key, o.hash) for o in written]
    _, refold = fold(body, header, store)
    assert refold.counters.objects_written == 0, "a second fold of a body wrote"
    for obj in written:
        for _, _, raw in objects.entries(obj.body):
            check_canonical(raw)
    try:
        resent = msgspec.json.encode(reversed_keys(msgspec.json.decode(body)))
    except (msgspec.DecodeError, msgspec.EncodeError, RecursionError):
        resent = None
    if resent is not None and outcome.layer is not None:
        _, refold = fold(resent, header, store)
        assert refold.counters.objects_written == 0, "a re-send in another key order wrote"
        changed = msgspec.json.encode(numbers_changed(msgspec.json.decode(body)))
        fold(changed, header, store)
        _, refold = fold(changed, header, store)
        assert refold.counters.objects_written == 0, "a conflicting copy wrote twice"
    check_digest(body)


def seeds() -> list[bytes]:
    bodies = _common.delivery_seeds()
    return [bytes([n % len(HEADERS)]) + body for n, body in enumerate(bodies)]


if __name__ == "__main__":
    _common.run("delivery", test, seeds)
    sys.exit(0)
