"""Hostile clients against a real ``healthlog serve`` process (specs/service.md): what they can
make the service hold (memory, read from ``/proc``) or write to its log."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import h2.config
import h2.connection
import h2.settings
import httpx
import pytest
from _baseline import severe_lines
from _service_helpers import FOLD_LIMIT_S, POLL_S, write_minute_body
from wsproto import ConnectionType, WSConnection
from wsproto.events import CloseConnection, Request, TextMessage

from healthlog.storage.datadir import DataDir
from transport.refusals import Bucket, FaultLog

MiB = 2**20
STOP_LIMIT_S = 60.0

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads Linux's /proc/PID/status"
)


@attrs.frozen
class Served:
    """A ``healthlog serve`` process, its port, a client token and the file of its log."""

    process: subprocess.Popen[bytes]
    port: int
    token: str
    log: Path

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def rss_mib(self) -> float:
        """The process's resident memory now (not its peak)."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


@contextlib.contextmanager
def served(data: Path) -> Iterator[Served]:
    """``healthlog serve`` on a free port over ``data``, with a token made first, logging into
    ``serve.log`` beside ``data``; stopped on exit."""
    with DataDir(data).open_tokens() as tokens:
        token = tokens.add("phone")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    command = [sys.executable, "-m", "healthlog.cli", "serve", "--port", "0", "--data", str(data)]
    log = data.parent / "serve.log"
    with (
        log.open("wb") as stderr,
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr) as process,
    ):
        try:
            assert process.stdout is not None
            line = process.stdout.readline().decode()
            found = re.search(r"healthlog serving on http://127\.0\.0\.1:(\d+) ", line)
            assert found, line
            yield Served(process, int(found.group(1)), token, log)
        finally:
            process.terminate()
            process.wait(timeout=STOP_LIMIT_S)


def wait_folded(client: httpx.Client, auth: dict[str, str]) -> None:
    deadline = time.monotonic() + FOLD_LIMIT_S
    while time.monotonic() < deadline:
        status = client.get("/v1/status", headers=auth).json()
        if not status["deliveries"]["pending"] and status["first_pass_completed"]:
            return
        time.sleep(POLL_S)
    raise AssertionError("not folded in time")


def served_points(tmp_path: Path) -> contextlib.AbstractContextManager[Served]:
    """:func:`served` over about 20 MB of `/v1/points` lines, folded."""
    body = tmp_path / "body.json"
    write_minute_body(body, metrics=4, points=15 * 24 * 60)

    @contextlib.contextmanager
    def points() -> Iterator[Served]:
        with served(tmp_path / "data") as service:
            base = f"http://127.0.0.1:{service.port}"
            with httpx.Client(base_url=base, timeout=FOLD_LIMIT_S) as client:
                posted = client.post(
                    "/v1/deliveries", content=body.read_bytes(), headers=service.auth
                )
                assert posted.status_code == 200, posted.text
                wait_folded(client, service.auth)
            yield service

    return points()


HELD_REQUESTS = 6
IGNORED_BODY_BYTES = 16 * MiB
"""quart's own limit on a request body it keeps (``MAX_CONTENT_LENGTH``, 16 MiB by default)."""


def test_a_body_sent_with_a_slowly_read_points_request_is_not_kept_serve_60(
    tmp_path: Path,
) -> None:
    """SERVE-60: GIVEN about 20 MB of points folded WHEN six clients each ask `/v1/points` for
    all of them with a body of 16 MiB that no route reads, and read nothing of the answer THEN
    the service's memory grows by less than 32 MiB while the answers wait. (Before, quart kept
    each body whole for as long as its answer lasted: 96 MiB more for the six.)"""
    with served_points(tmp_path) as service:
        before = service.rss_mib()
        with contextlib.ExitStack() as stack:
            for _ in range(HELD_REQUESTS):
                conn = stack.enter_context(socket.socket())
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                conn.connect(("127.0.0.1", service.port))
                conn.settimeout(FOLD_LIMIT_S)
                conn.sendall(
                    b"GET /v1/points HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                    b"Content-Length: %d\r\n\r\n" % (service.token.encode(), IGNORED_BODY_BYTES)
                )
                conn.sendall(bytes(IGNORED_BODY_BYTES))
            time.sleep(1.0)
            grown_mib = service.rss_mib() - before
    assert grown_mib < 32, grown_mib


SHUT_STREAMS = 10
SHUT_WINDOW_WAIT_S = 5.0


def test_points_to_a_peer_with_its_window_shut_are_not_buffered_serve_63(
    tmp_path: Path,
) -> None:
    """SERVE-63: GIVEN about 20 MB of points folded WHEN an h2c peer sets its flow control
    window to zero and asks `/v1/points` for all of them on ten streams THEN the service's
    memory grows by less than 48 MiB in the 5 s after. (Before, hypercorn let the app go on
    sending while the peer took nothing, so that each stream's whole export was built and held:
    1.4 GiB more within a minute for a hundred streams of 137 MB.)"""
    with served_points(tmp_path) as service:
        before = service.rss_mib()
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        for _ in range(SHUT_STREAMS):
            peer.send_headers(
                peer.get_next_available_stream_id(),
                [
                    (":method", "GET"),
                    (":path", "/v1/points"),
                    (":scheme", "http"),
                    (":authority", "127.0.0.1"),
                    ("authorization", f"Bearer {service.token}"),
                ],
                end_stream=True,
            )
        with socket.create_connection(("127.0.0.1", service.port)) as conn:
            conn.sendall(peer.data_to_send())
            time.sleep(SHUT_WINDOW_WAIT_S)
            grown_mib = service.rss_mib() - before
    assert grown_mib < 48, grown_mib


IGNORED_CLOSE_BYTES = 48 * MiB


def test_a_subscriber_going_on_past_the_message_limit_is_not_buffered_stream_94(
    tmp_path: Path,
) -> None:
    """STREAM-94: WHEN a subscriber with the token sends one text frame of 48 MiB, whole,
    without answering the close 1009 its first 64 KiB bring THEN the service's memory grows by
    less than 16 MiB. (Before, hypercorn went on writing the frame into the message's buffer
    after the limit: 48 MiB more.)"""
    with served(tmp_path / "data") as service:
        before = service.rss_mib()
        with socket.create_connection(("127.0.0.1", service.port)) as conn:
            conn.settimeout(FOLD_LIMIT_S)
            conn.sendall(
                b"GET /v1/stream?after=0 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer %s\r\n\r\n"
                % service.token.encode()
            )
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 101 "), answer
            # FIN, text, masked with the key 0 (which leaves the payload as it is), 64-bit length.
            head = bytes([0x81, 0x80 | 127]) + IGNORED_CLOSE_BYTES.to_bytes(8, "big") + bytes(4)
            conn.sendall(head)
            for _ in range(IGNORED_CLOSE_BYTES // MiB):
                conn.sendall(b" " * MiB)
            time.sleep(1.0)
            grown_mib = service.rss_mib() - before
    assert grown_mib < 16, grown_mib


UPGRADE_WITH_TRAILING_BYTES = (
    b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: bKdPyn3u98cTfZJSh4TNeQ==\r\n\r\nx\n"
)
BROKEN_HANDSHAKES = 200
FAULT_LINES = ("stream: the websocket handshake failed", "a connection failed inside hypercorn")


def test_broken_handshakes_in_a_flood_log_a_few_lines_serve_61(tmp_path: Path) -> None:
    """SERVE-61: WHEN a peer without a token makes 200 websocket handshakes, each followed at
    once by trailing bytes THEN the log gets at most a dozen lines about them (each kind a few a
    minute, the next one saying how many were not logged), and the service answers after them.
    (Before, two lines for each: 400 in the test, 2.2 MB in 10 s from one client.)"""
    with served(tmp_path / "data") as service:
        for _ in range(BROKEN_HANDSHAKES):
            with socket.create_connection(("127.0.0.1", service.port)) as conn:
                conn.settimeout(FOLD_LIMIT_S)
                conn.sendall(UPGRADE_WITH_TRAILING_BYTES)
                with contextlib.suppress(ConnectionResetError):
                    while conn.recv(4096):
                        pass
        base = f"http://127.0.0.1:{service.port}"
        with httpx.Client(base_url=base, timeout=FOLD_LIMIT_S) as client:
            assert client.get("/v1/status", headers=service.auth).status_code == 200
    lines = [
        line
        for line in service.log.read_text().splitlines()
        if any(fault in line for fault in FAULT_LINES)
    ]
    assert 2 <= len(lines) <= 12, lines
    assert all("level=ERROR" not in line for line in lines), lines


REFUSED_CLOSERS = 40


def refused_closing_at_once(port: int) -> bytes:
    """A subscriber with a wrong token that closes its side as soon as the refusal's frame
    arrives (as a browser's ``onmessage`` calling ``close()`` does); what the service sent."""
    ws = WSConnection(ConnectionType.CLIENT)
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=FOLD_LIMIT_S) as conn:
        request = Request(
            host="127.0.0.1",
            target="/v1/stream?after=0",
            extra_headers=[(b"authorization", b"Bearer hl_wrong")],
        )
        conn.sendall(ws.send(request))
        with contextlib.suppress(ConnectionResetError):
            while data := conn.recv(2**16):
                received += data
                ws.receive_data(data)
                if any(isinstance(event, TextMessage) for event in ws.events()):
                    conn.sendall(ws.send(CloseConnection(code=1000)))
    return received


def test_subscribers_closing_as_they_are_refused_log_no_failure_serve_73(tmp_path: Path) -> None:
    """SERVE-73: 40 subscribers of a `healthlog serve` process with a wrong token, each closing
    its side as soon as the refusal's frame arrives, each get the frame, and the log holds no
    line of a connection failing inside hypercorn and nothing at ERROR. (Before, hypercorn's
    answer to the client's close met its own half-close of the socket, `BusyResourceError`,
    logged at WARNING as a failure: 23 of 160 such subscribers in a loop.)"""
    with served(tmp_path / "data") as service:
        for _ in range(REFUSED_CLOSERS):
            assert b'"UNAUTHORIZED"' in refused_closing_at_once(service.port)
        base = f"http://127.0.0.1:{service.port}"
        with httpx.Client(base_url=base, timeout=FOLD_LIMIT_S) as client:
            assert client.get("/v1/status", headers=service.auth).status_code == 200
    log = service.log.read_text()
    assert [line for line in log.splitlines() if "failed inside hypercorn" in line] == []
    assert severe_lines(log) == []


def test_a_fault_log_says_how_many_lines_it_held_back_serve_61(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SERVE-61: a fault log lets five lines through at once and one more every twelve seconds;
    the first after a held-back spell says how many were not logged."""
    now = [0.0]
    faults = FaultLog(
        logging.getLogger("healthlog.http"), logging.WARNING, Bucket(clock=lambda: now[0])
    )
    with caplog.at_level(logging.WARNING, "healthlog.http"):
        for n in range(20):
            faults("broken %d", n)
        now[0] = 12.0
        faults("broken %d", 20)
    assert [r.getMessage() for r in caplog.records] == [
        *(f"broken {n}" for n in range(5)),
        "broken 20; 15 more like it were not logged before this one",
    ]
