"""The limit on replay stream subscribers a serving process serves at once
(``stream_max_subscribers``, specs/stream.md, STREAM-103 to STREAM-107), a token not valid
refused before it (STREAM-106), the follower's wait on its refusal and a signal ending it
(STREAM-110), and the gauge and the refusal counter in ``/metrics`` (specs/service.md, SERVE-69,
SERVE-65), against a real ``healthlog serve`` with real websocket clients and the reference
follower."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import orjson
import pytest
import trio
from _runtime_helpers import hold_at
from _service_helpers import POLL_S, Service, serving
from _stream_helpers import (
    FRAME_LIMIT_S,
    SECONDS,
    bearer,
    connect,
    consecutive,
    noisy,
    post,
    post_small,
    receive,
    receive_through,
    refusal,
    replica_export,
    resource,
    server_export,
    serving_process,
    stalled,
    stamped,
    step_until,
    stream_handlers,
    subscribe,
)
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import ConnectionRejected

from healthlog import faults
from healthlog.logs import LOG_LEVEL_ENV
from healthlog.storage.datadir import DataDir
from healthlog.storage.replica import Replica
from transport.follow import follow
from transport.stream import RETRY_AFTER_S

# As STREAM-12's: some 10 MB of event frames, each carrying one large object.
NOISY_POINTS = 2000
NOISY_ADDITIONS = 36
REFUSED = "refused 503 GET /v1/stream from 127.0.0.1: 2 stream subscribers are served, as many as"
REFUSED_FOLLOW = "follow: connection lost (ConnectionLost: the server refused the stream (503))"


async def refused(service: Service) -> ConnectionRejected:
    """The answer to a subscriber the service refuses before the upgrade."""
    rejected: list[ConnectionRejected] = []
    try:
        async with subscribe(service):
            pass
    except* ConnectionRejected as group:
        rejected.extend(e for e in group.exceptions if isinstance(e, ConnectionRejected))
    assert rejected, "the subscriber was served"
    return rejected[0]


def assert_too_many(rejected: ConnectionRejected) -> None:
    assert rejected.status_code == 503
    assert (b"retry-after", b"30") in rejected.headers
    assert rejected.body is not None
    assert orjson.loads(rejected.body) == {"error": "TOO_MANY_SUBSCRIBERS"}


async def until_handlers(count: int) -> None:
    """Wait until ``count`` stream handlers run in this trio run."""
    with trio.fail_after(FRAME_LIMIT_S):
        while stream_handlers() != count:
            await trio.sleep(POLL_S)


async def test_subscribers_over_the_limit_are_refused_503_stream_103(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-103: with ``stream_max_subscribers = 2`` two subscribers are served and a third is
    refused before the upgrade: 503 ``TOO_MANY_SUBSCRIBERS`` with ``Retry-After: 30``, while the
    store's reader is held (the refusal reads nothing of it), logged as refusals are; once one
    of the two has closed, a new one is served from its cursor."""
    async with serving(tmp_path, stream_max_subscribers=2) as service:
        total = await post_small(service, 0)
        async with subscribe(service) as kept:
            assert consecutive(await receive(kept, total), 0)
            async with subscribe(service) as leaving:
                assert consecutive(await receive(leaving, total), 0)
                entered, release = trio.Event(), threading.Event()
                plan = faults.Plan(actions={"stream.page": hold_at(entered, release)})
                with faults.loaded(plan), caplog.at_level(logging.INFO, logger="healthlog.http"):
                    with trio.fail_after(FRAME_LIMIT_S):
                        await entered.wait()
                    try:
                        for _ in range(12):
                            assert_too_many(await refused(service))
                    finally:
                        release.set()
            lines = [r.getMessage() for r in caplog.records if r.name == "healthlog.http"]
            assert lines
            assert all(line.startswith(REFUSED) for line in lines)
            assert len(lines) < 12
            assert all(r.levelno < logging.WARNING for r in caplog.records)
            await until_handlers(1)
            async with subscribe(service) as third:
                assert consecutive(await receive(third, total), 0)
                assert_too_many(await refused(service))


@pytest.mark.parametrize("presented", ["unknown", "revoked", "none"])
async def test_a_token_not_valid_is_refused_4401_not_503_when_full_stream_106(
    tmp_path: Path, presented: str, caplog: pytest.LogCaptureFixture
) -> None:
    """STREAM-106: with ``stream_max_subscribers = 1`` and its slot taken, a subscriber with an
    unknown token, a revoked one or none gets ``UNAUTHORIZED`` and close 4401 (for good), not
    the 503 that tells it to come back in 30 s, logged as a refused token; the one served goes on
    and a subscriber with a live token is still refused 503."""
    with DataDir(tmp_path).open_tokens() as tokens:
        revoked = tokens.add("old phone")
        tokens.revoke("old phone")
    headers = {
        "unknown": bearer("hl_not_a_token_a1b2c3"),
        "revoked": bearer(revoked),
        "none": [],
    }[presented]
    async with serving(tmp_path, stream_max_subscribers=1) as service:
        total = await post_small(service, 0, 1)
        async with subscribe(service, after=total - 1) as served:
            assert consecutive(await receive(served, 1), total - 1)
            with caplog.at_level(logging.INFO, logger="healthlog.http"):
                async with connect(service.port, resource(0), headers) as ws:
                    assert await refusal(ws) == ({"type": "error", "code": "UNAUTHORIZED"}, 4401)
            assert_too_many(await refused(service))
            await post_small(service, 2)
            assert consecutive(await receive(served, 1), total)
        lines = [r.getMessage() for r in caplog.records if r.name == "healthlog.http"]
        assert lines[0].startswith("refused 4401 GET /v1/stream from 127.0.0.1: ")
        assert revoked not in caplog.text
        assert "a1b2c3" not in caplog.text


async def fill(service: Service) -> int:
    """Some 10 MB of event frames (as STREAM-12's): a subscriber that never reads stalls in a
    send. The head after them."""
    await post(service, noisy(0, NOISY_POINTS), SECONDS)
    for n in range(NOISY_ADDITIONS):
        await post(service, noisy(NOISY_POINTS + n, 1), SECONDS)
    return int((await service.wait_folded())["stream"]["head"])


@pytest.mark.parametrize(("ending", "send_timeout_s"), [("closes", 30.0), ("cut-off", 1.0)])
async def test_a_stalled_subscriber_gives_its_slot_back_stream_104(
    tmp_path: Path, ending: str, send_timeout_s: float
) -> None:
    """STREAM-104: with ``stream_max_subscribers = 1`` a subscriber that never reads holds the
    slot, its handler waiting in a send, and another is refused 503; WHEN the stalled one closes
    its connection, or is cut off (``stream_send_timeout_s = 1``) while it keeps it open, THEN
    the next subscriber is served every event."""
    async with serving(
        tmp_path, stream_max_subscribers=1, stream_send_timeout_s=send_timeout_s
    ) as service:
        total = await fill(service)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(stalled(service))
            await until_handlers(1)
            assert_too_many(await refused(service))
            if ending == "closes":
                await stack.aclose()
            await until_handlers(0)
            async with subscribe(service) as ws:
                assert consecutive(await receive_through(ws, total), 0)


RETRYING_AS_ASKED = "follow: retrying in 30.0 s, as the server asks (Retry-After: 30 s)"


async def test_follow_waits_what_a_full_stream_asks_then_catches_up_stream_105_107(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """STREAM-105, STREAM-107: with ``stream_max_subscribers = 1`` and its slot taken, ``follow
    --until-caught-up`` is refused 503, logs it at INFO as a lost connection, says in one line
    that it retries in 30 s as the server's ``Retry-After`` asks, and connects again no sooner
    (in trio's time, a MockClock moved on a second at a time); once the slot is free it catches
    up, equal to the service, having logged nothing at WARNING or above."""
    mock_clock.rate = 1.0
    async with serving_process(tmp_path / "server", stream_max_subscribers=1) as service:
        total = await post_small(service, 0, 60)
        with Replica(tmp_path / "replica") as replica, stamped("healthlog.follow") as follower:
            followed = trio.Event()

            async def following() -> None:
                await follow(service.url, service.token, replica, until_caught_up=True)
                followed.set()

            async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as holder:
                await holder.enter_async_context(subscribe(service, after=total))
                nursery.start_soon(following)
                await step_until(mock_clock, lambda: len(follower.at(REFUSED_FOLLOW)) == 2)
                await holder.aclose()
                await step_until(mock_clock, followed.is_set)
            assert replica.binding().cursor == total
            assert await replica_export(replica) == await server_export(service)
    refusals = follower.at(REFUSED_FOLLOW)
    assert refusals[1] - refusals[0] >= RETRY_AFTER_S
    assert follower.messages("follow: retrying") == [RETRYING_AS_ASKED] * len(refusals)
    assert follower.messages(level=logging.WARNING) == []


async def connections(service: Service) -> float:
    """``healthlog_stream_connections`` of ``/metrics``."""
    response = await service.client.get("/metrics")
    assert response.status_code == 200
    (value,) = [
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "healthlog_stream_connections"
    ]
    return value


async def test_metrics_show_the_stream_connections_served_serve_69(tmp_path: Path) -> None:
    """SERVE-69: ``healthlog_stream_connections`` is 0 with no subscriber, 2 with two served
    (the limit), still 2 after a third was refused, and 1 once one of the two has closed."""
    async with serving(tmp_path, stream_max_subscribers=2) as service:
        total = await post_small(service, 0)
        assert await connections(service) == 0
        async with subscribe(service) as kept:
            assert consecutive(await receive(kept, total), 0)
            async with subscribe(service) as leaving:
                assert consecutive(await receive(leaving, total), 0)
                assert await connections(service) == 2
                assert_too_many(await refused(service))
                assert await connections(service) == 2
            await until_handlers(1)
            assert await connections(service) == 1


async def refusals(service: Service) -> dict[str, float]:
    """``healthlog_stream_refused_total`` of ``/metrics``, by its labels."""
    response = await service.client.get("/metrics")
    assert response.status_code == 200
    return {
        ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "healthlog_stream_refused_total"
    }


async def test_metrics_count_the_stream_connections_refused_serve_65(tmp_path: Path) -> None:
    """SERVE-65: ``healthlog_stream_refused_total`` counts the connections refused at the
    handshake by its one label ``reason``: none at first, then two refused 503 over
    ``stream_max_subscribers = 1``, and one refused 4401 for a token that is not a client's
    (whether or not a slot is free); no label holds a token, a name or an address."""
    async with serving(tmp_path, stream_max_subscribers=1) as service:
        total = await post_small(service, 0)
        assert await refusals(service) == {
            "reason=too_many_subscribers": 0,
            "reason=unauthorized": 0,
            "reason=repeated_parameter": 0,
        }
        async with subscribe(service) as served:
            assert consecutive(await receive(served, total), 0)
            for _ in range(2):
                assert_too_many(await refused(service))
            async with connect(service.port, resource(0), bearer("hl_not_a_token")) as ws:
                assert await refusal(ws) == ({"type": "error", "code": "UNAUTHORIZED"}, 4401)
            assert await refusals(service) == {
                "reason=too_many_subscribers": 2,
                "reason=unauthorized": 1,
                "reason=repeated_parameter": 0,
            }
        text = (await service.client.get("/metrics")).text
        assert service.token not in text
        assert "127.0.0.1" not in text


async def test_metrics_count_repeated_parameters_refused_stream_128(tmp_path: Path) -> None:
    """STREAM-128: ``healthlog_stream_refused_total{reason="repeated_parameter"}`` counts each
    handshake refused 4400 ``REPEATED_PARAMETER``: a token given twice as the `token` query
    parameter (the client's own, and one that is no client's) and `after` given twice with a
    live token, three in all, and nothing under the other reasons. (Before, a repeated `token`,
    refused before any token is checked, was counted nowhere: a follower or scanner sending it
    showed in no figure.)"""
    async with serving(tmp_path) as service:
        await post_small(service, 0)
        for path, headers in (
            (f"/v1/stream?after=0&token={service.token}&token={service.token}", []),
            ("/v1/stream?after=0&token=no&token=no", []),
            ("/v1/stream?after=1&after=0", bearer(service.token)),
        ):
            async with connect(service.port, path, headers) as ws:
                frame, code = await refusal(ws)
            assert (frame["code"], code) == ("REPEATED_PARAMETER", 4400), path
        assert await refusals(service) == {
            "reason=too_many_subscribers": 0,
            "reason=unauthorized": 0,
            "reason=repeated_parameter": 3,
        }


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_signal_ends_the_wait_a_full_stream_asks_for_stream_110(
    tmp_path: Path, signum: int
) -> None:
    """STREAM-110: ``healthlog follow``, a real process refused by a full stream and waiting
    the 30 s its ``Retry-After`` asks for, stops on SIGINT or SIGTERM well before they are
    over (within 15 s), with exit 0 and its last line naming its replica's sequence, no
    traceback, and no token in anything it wrote."""
    async with serving(tmp_path / "server", stream_max_subscribers=1) as service:
        total = await post_small(service, 0)
        async with subscribe(service, after=total):
            command = [
                *(sys.executable, "-m", "healthlog.cli", "follow", "--url", service.url),
                *("--token", service.token, "--replica", str(tmp_path / "replica")),
            ]
            env = {**os.environ, LOG_LEVEL_ENV: "INFO"}
            stderr = tmp_path / "stderr"
            with open(stderr, "wb") as err:
                process = await trio.lowlevel.open_process(command, stderr=err, env=env)
                try:
                    with trio.fail_after(FRAME_LIMIT_S):
                        while RETRYING_AS_ASKED not in stderr.read_text():
                            await trio.sleep(POLL_S)
                    process.send_signal(signum)
                    with trio.fail_after(FRAME_LIMIT_S):
                        await process.wait()
                finally:
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
    assert FRAME_LIMIT_S < RETRY_AFTER_S
    assert process.returncode == 0
    lines = stderr.read_text().splitlines()
    assert lines[-1] == "follow: replica at seq 0"
    assert "Traceback" not in stderr.read_text()
    assert service.token not in stderr.read_text()
