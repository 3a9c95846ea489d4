"""Fuzz the request headers intake reads (requirement X, specs/proof.md): what a phone, or
anyone holding a token, may put in ``authorization``, ``api-key``, ``content-encoding``,
``expect``, ``content-type``, ``idempotency-key`` and the ``automation-*`` headers.

An input is a list of raw header lines (``name: value``, the bytes HTTP/1.1 and HTTP/2 let
through: no NUL, CR or LF). They go through the functions intake reads them with
(``transport/intake.py``, ``transport/auth.py``), then, as intake would journal them, into a
real journal (an SQLite file) and back, and the delivery is folded with its
``automation-aggregation``. Every value must come back from the journal as it went in, and the
fold must end in an outcome; a refusal (401, 415, 400 for a key too long) is an outcome too.
Anything raised is a finding.

Run: ``.venv/bin/python scripts/fuzz/headers.py -max_total_time=600``.
"""

from __future__ import annotations

import sys
import tempfile

import _common
import atheris

with atheris.instrument_imports():
    from healthlog import layers
    from healthlog.fold import DeliveryFold, DeliveryInfo, Unstored
    from healthlog.storage.datadir import DataDir
    from healthlog.storage.journal import IdempotencyCollision, NewDelivery
    from healthlog.storage.store import automation_of
    from healthlog.storage.tokens import authenticate, token_hash
    from transport import auth, intake

TOKEN = "hl_fuzz-token"
HASHES = {token_hash(TOKEN): "phone"}
BODY = (
    b'{"data":{"metrics":[{"name":"step_count","units":"count","data":['
    b'{"date":"2024-03-01 10:00:00 +0000","qty":7},{"date":"2024-03-01 10:01:00 +0000","qty":8}'
    b"]}]}}"
)
_FORBIDDEN = {0, 10, 13}
_JOURNAL_ROUNDS = 2000

_directory = tempfile.TemporaryDirectory(prefix="fuzz-headers-")
_appended = 0
_journal = DataDir(_directory.name).open_journal()


def raw_headers(data: bytes) -> list[tuple[bytes, bytes]]:
    headers = []
    for line in data.split(b"\n"):
        name, colon, value = line.partition(b":")
        if not colon or not name.strip() or _FORBIDDEN & set(line):
            continue
        headers.append((name.strip(), value.strip(b" \t")))
    return headers


def journaled(delivery: NewDelivery) -> None:
    global _appended, _journal
    _appended += 1
    if _appended % _JOURNAL_ROUNDS == 0:
        # A fresh journal now and then: what is fuzzed is the headers, not a growing file.
        _journal.close()
        _journal = DataDir(tempfile.mkdtemp(dir=_directory.name)).open_journal()
    try:
        receipt = _journal.append(delivery)
    except IdempotencyCollision:
        return
    meta = _journal.get_meta(receipt.delivery_id)
    assert meta is not None
    if receipt.replayed:
        return
    sent = (
        delivery.content_type,
        delivery.automation_name,
        delivery.automation_id,
        delivery.automation_aggregation,
        delivery.automation_period,
        delivery.session_id,
    )
    kept = (
        meta.content_type,
        meta.automation_name,
        meta.automation_id,
        meta.automation_aggregation,
        meta.automation_period,
        meta.session_id,
    )
    assert kept == sent, "a header came back from the journal changed"
    automation_of(meta)
    run = DeliveryFold(
        BODY, DeliveryInfo(meta.id, meta.received_at, meta.automation_aggregation), Unstored(None)
    )
    for _ in run.writes():
        pass
    assert run.outcome is not None
    header_layer = layers.layer_from_header(meta.automation_aggregation)
    assert run.outcome.layer in (header_layer, "minutes" if header_layer is None else header_layer)


def test(data: bytes) -> None:
    raw = raw_headers(data)
    scope = {"method": "POST", "headers": raw, "http_version": "1.1"}
    headers = intake._headers(raw)
    presented = auth.presented_token(headers.get("authorization"), headers.get("api-key"))
    name = None if presented is None else authenticate(presented, HASHES)
    if name is None:
        return
    intake._waits_to_continue(scope)
    if intake._encoded(raw):
        return
    key = headers.get("idempotency-key") or None
    if key is not None and len(key) > intake.MAX_IDEMPOTENCY_KEY:
        return
    journaled(intake.delivery_of(headers, BODY, name, key))


def seeds() -> list[bytes]:
    bearer = f"Authorization: Bearer {TOKEN}".encode()
    app = (
        b"Content-Type: application/json\nAutomation-Name: Health\nAutomation-Id: 1F2E\n"
        b"Automation-Aggregation: minutes\nAutomation-Period: Since Last Sync\n"
        b"Session-Id: 5C3A"
    )
    return [
        bearer + b"\n" + app,
        f"api-key: {TOKEN}".encode() + b"\n" + app.replace(b"minutes", b"Default"),
        bearer + b"\nIdempotency-Key: k1\nContent-Encoding: identity\nExpect: 100-continue",
        bearer + b"\nContent-Encoding: identity, gzip\nAutomation-Aggregation: Days ",
        f"authorization: bearer  {TOKEN} ".encode() + b"\nautomation-aggregation: \xe9t\xe9",
    ]


if __name__ == "__main__":
    _common.run("headers", test, seeds)
    sys.exit(0)
