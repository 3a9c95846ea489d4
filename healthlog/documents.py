"""Typed documents the service reads and writes (T3), with one cattrs converter for the wire."""

from __future__ import annotations

from typing import Any

import attrs
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
    manifest binds, and how many object lines follow."""

    schema: str
    instance: str
    stream: str
    seq: int
    objects: int


def dumps(document: Any) -> bytes:
    """A document as compact JSON."""
    return converter.dumps(document)
