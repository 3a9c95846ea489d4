"""Typed documents the service reads and writes (T3), with one cattrs converter for the wire."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.preconf.orjson import make_converter

converter = make_converter()


@attrs.frozen
class JournalFigures:
    deliveries: int
    bytes: int


@attrs.frozen
class DeliveryCounts:
    pending: int
    parsed: int
    partial: int
    failed: int


@attrs.frozen
class Lag:
    oldest_pending_id: int | None
    waited_s: float
    stopped_because: str


@attrs.frozen
class LeaseInfo:
    holder: str | None
    epoch: int


@attrs.frozen
class StreamInfo:
    """The replay stream: its name, the instance it belongs to, and the online window."""

    id: str
    instance: str
    head: int
    oldest_cursor: int
    public_key: str | None


@attrs.frozen
class Status:
    """The ``status --json`` document (and ``GET /v1/status``)."""

    journal: JournalFigures
    deliveries: DeliveryCounts
    lag: Lag
    lease: LeaseInfo
    first_pass_completed: bool
    subscribers: dict[str, int]
    stream: StreamInfo
    subscribers_last_ack: dict[str, str]
    """When each subscriber's last ACK was stored: one silent for ``stream_window_days`` whose
    cursor is older than the window is removed (STORE-89)."""
    reindex_advised: list[str]
    """Why ``healthlog reindex`` is advised (codes of ``store.REINDEX_REASONS``; empty: it is
    not): the store holds objects an older healthlog folded otherwise (CLI-183)."""


@attrs.frozen
class DeliveryStatus:
    """The ``GET /v1/deliveries/{id}`` document: status and counters, never values."""

    delivery_id: int
    received_at: str
    status: str
    reason: str | None
    counters: dict[str, int]


@attrs.frozen
class ListedDelivery:
    """One delivery of a :class:`DeliveryList`: its id, stamp, status and reason, no counters
    (``GET /v1/deliveries/{id}`` has them), never a value."""

    delivery_id: int
    received_at: str
    status: str
    reason: str | None


@attrs.frozen
class DeliveryList:
    """The ``status --failed --json`` document: the newest ``limit`` deliveries whose outcome
    is one of ``statuses``, last in journal order first, of ``total`` such deliveries."""

    statuses: list[str]
    total: int
    limit: int
    deliveries: list[ListedDelivery]


@attrs.frozen
class Manifest:
    """The signed reference to a snapshot file (R4): the ``snapshot`` of a ``CURSOR_TOO_OLD``
    error frame and the ``GET /v1/snapshots`` document. Its signature covers the schema,
    instance, stream, sequence and sha256 (``healthlog/snapshots.py``)."""

    url: str
    seq: int
    sha256: str
    schema: str
    instance: str
    stream: str
    signature: str


@attrs.frozen
class SnapshotHeader:
    """The first line of a snapshot file: the schema, instance, stream and sequence its
    manifest binds, how many object lines follow, and the tag of the event at the sequence
    (left out when it has none), which a client restoring the file resumes with (STREAM-116)."""

    schema: str
    instance: str
    stream: str
    seq: int
    objects: int
    tag: str | None = None


converter.register_unstructure_hook(
    SnapshotHeader,
    make_dict_unstructure_fn(SnapshotHeader, converter, tag=override(omit_if_default=True)),
)


@attrs.frozen
class ObjectChanged:
    """An ``object.changed`` event (R1), as stored and as its frame carries it: the object's
    key (its hour as ISO text), hash and point count (no hash and 0 points: the object is
    gone), and the delivery whose fold changed it (None: a rebuild or a seal's marking)."""

    KIND: ClassVar[str] = "object.changed"

    metric: str
    layer: str
    hour: str
    hash: str | None
    points: int
    delivery_id: int | None


@attrs.frozen
class DeliveryFolded:
    """A ``delivery.folded`` event (R1), as stored and as its frame carries it: the delivery,
    its status, and its counters as its outcome stores them (a name for each count)."""

    KIND: ClassVar[str] = "delivery.folded"

    delivery_id: int
    status: str
    counters: dict[str, int]


@attrs.define
class EventFrame:
    """A server-to-client event frame of the replay stream: ``{"type": "event", "seq", "id",
    "tag", "kind", ...}`` (``tag`` only for an event that has one), the stored event's fields
    (:class:`ObjectChanged`, :class:`DeliveryFolded`) after the head, and last, for an
    ``object.changed`` event only, ``object``: the object's current state
    (``healthlog.objects.to_wire``), None once it is gone.

    ``event`` is the event as stored, handed on as it was read: replay does not build a class
    instance for each stored event only to take it apart again. Not frozen: one is built for
    every event replayed, and a frozen class's ``__init__`` costs three times as much."""

    type: str = attrs.field(default="event", init=False)
    seq: int
    id: str
    kind: str
    event: Mapping[str, Any]
    object: dict[str, Any] | None = None
    # The event's random tag, which a subscriber resumes with (STREAM-111); None (left out of
    # the frame) for an event written before events had tags.
    tag: str | None = None


def _unstructure_event_frame(frame: EventFrame) -> dict[str, Any]:
    if frame.tag is None:
        document = {
            "type": frame.type,
            "seq": frame.seq,
            "id": frame.id,
            "kind": frame.kind,
            **frame.event,
        }
    else:
        document = {
            "type": frame.type,
            "seq": frame.seq,
            "id": frame.id,
            "tag": frame.tag,
            "kind": frame.kind,
            **frame.event,
        }
    if frame.kind == ObjectChanged.KIND:
        document["object"] = frame.object
    return document


converter.register_unstructure_hook(EventFrame, _unstructure_event_frame)


@attrs.frozen
class ErrorFrame:
    """A server-to-client error frame: ``{"type": "error", "code"}``, and the field its
    code carries: ``head`` (``CURSOR_IN_FUTURE``), ``sent`` (``ACK_BEYOND_SENT``),
    ``parameter`` (``REPEATED_PARAMETER``, STREAM-127) or ``snapshot`` (``CURSOR_TOO_OLD``),
    with ``diverged`` true when the cursor is not one of this stream's history (its event is
    another, STREAM-111); a field that is None is left out."""

    type: str = attrs.field(default="error", init=False)
    code: str
    head: int | None = None
    sent: int | None = None
    snapshot: Manifest | None = None
    diverged: bool | None = None
    parameter: str | None = None


converter.register_unstructure_hook(
    ErrorFrame,
    make_dict_unstructure_fn(
        ErrorFrame,
        converter,
        _cattrs_omit_if_default=True,
        _cattrs_include_init_false=True,
        type=override(omit_if_default=False),
    ),
)


@attrs.frozen
class AckFrame:
    """A client-to-server frame: ``{"type": "ack", "seq"}``, the highest contiguous sequence
    the client has made durable (R3)."""

    type: str = attrs.field(default="ack", init=False)
    seq: int


def _structure_ack_frame(document: Any, _: type) -> AckFrame:
    """An ACK only when it is a JSON object of type ``ack`` whose ``seq`` is a JSON integer of
    at least 0 (not ``true``, not ``2.0``); ValueError otherwise."""
    if not isinstance(document, dict) or document.get("type") != "ack":
        raise ValueError("not an ACK frame")
    seq = document.get("seq")
    if type(seq) is not int or seq < 0:
        raise ValueError("an ACK whose seq is not a cursor")
    return AckFrame(seq)


converter.register_unstructure_hook(
    AckFrame, make_dict_unstructure_fn(AckFrame, converter, _cattrs_include_init_false=True)
)
converter.register_structure_hook(AckFrame, _structure_ack_frame)


def dumps(document: Any) -> bytes:
    """A document as compact JSON."""
    return converter.dumps(document)
