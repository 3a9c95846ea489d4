"""``healthlog chaos``: the fault-injection harness (X1 to X4) against real ``serve`` processes.

Each run starts ``healthlog serve`` on a fresh data directory with a seeded fault plan,
posts a seeded workload (one minute-level body of 1 to 62 MiB and a short window it
overlaps, with re-sends that are identical, poorer, richer and conflicting; idempotent
retries; concurrent posts), injects faults (SQLITE_BUSY and I/O errors at fault points,
delays, jumps of the service's wall clock, a real second process holding the store's write
lock, SIGKILL of the service at a fault point, a concurrent ``reindex`` stealing the lease,
follower websocket drops, posts and followers cancelled part-way), restarts the service
after a crash, waits for quiescence and checks every invariant:

- every delivery answered 200 is in the journal, at the id its receipt names, with the sha256
  of the bytes posted, hashed here (else: lost);
- an idempotency key journals exactly one delivery, the one its receipts name;
- journal stamps never go back: ``received_at`` is non-decreasing in append order;
- every journaled delivery is folded;
- the live objects equal a fresh rebuild (else: mismatched); a run whose service logged an
  out-of-order fold (possible after an I/O error, F4) is reindexed first, as the warning says,
  and only then must they be equal;
- the live folder's folds followed journal order, or the service said otherwise (the F9
  warning);
- the follower's replica equals the server's objects;
- no ERROR record, and no point value, device name or token in any record above DEBUG, in the
  service's log and in the output of the concurrent ``reindex`` and ``seal``.

A fault kind is counted only where it took effect: a planned fault when its firing is logged, a
held lock when the holder has taken it, a steal when the concurrent ``reindex`` swapped in, a
drop when the dropped follower had received events in that session.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import trio

from healthlog import workload
from healthlog.fold import DeliveryFold, DeliveryInfo, Unstored
from healthlog.objects import ObjectKey
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV
from healthlog.storage.journal import DeliveryMeta
from healthlog.storage.rebuild import verify
from healthlog.storage.replica import Replica
from healthlog.storage.store import Event, Store
from transport.follow import Endpoints, Follower

KINDS = ("busy", "ioerror", "delay", "clock", "kill", "lock", "steal", "drop", "cancel")
FOLD_POINTS = ("fold.begin", "fold.object_write", "fold.outcome_write", "fold.before_commit")
KILL_POINTS = (*FOLD_POINTS, "fold.after_commit", "journal.append")
# The share of runs that also seal the first hours of their window (specs/seal.md).
SEALED_SHARE = 1 / 3
START_TIMEOUT_S = 30.0
# The service's graceful timeout (2 s, below) and the 10 s a commit in flight has after it, and
# as much again.
STOP_TIMEOUT_S = 24.0
QUIET_TIMEOUT_S = 60.0
POST_ATTEMPTS = 8
UPLOAD_CHUNK = 256 * 1024
# Clock jumps of one minute to four hours, either way.
JUMP_S = (60.0, 4 * 3600.0)
# Events a reindex's swap writes: they follow the rebuild's order, not the live folder's.
REINDEX_EVENT = "reindex."


@attrs.define
class RunResult:
    """The figures of one run, and every invariant it broke."""

    seed: int
    faults: Counter[str] = attrs.Factory(Counter)
    crashes: int = 0
    deliveries: int = 0
    bytes: int = 0
    largest: int = 0
    lost: int = 0
    mismatched: int = 0
    reordered: int = 0
    sealed: bool = False
    broken: list[str] = attrs.Factory(list)


@attrs.frozen
class _Accepted:
    """A post answered 200: the sha256 of the bytes posted (hashed here, not taken from the
    answer), the delivery id its receipt names, and its idempotency key."""

    sha256: str
    delivery_id: int
    key: str | None


class _Service:
    """One ``healthlog serve`` process on a data directory."""

    def __init__(self, data: Path, log: Path, plan: str | None) -> None:
        env = {
            **os.environ,
            "HEALTHLOG_WAKE_PERIOD_S": "0.3",
            "HEALTHLOG_LEASE_TTL_S": "1.5",
            "HEALTHLOG_LEASE_RENEW_S": "0.3",
            "HEALTHLOG_GRACEFUL_TIMEOUT_S": "2",
            # The checks read the service's log as key=value lines, whatever the caller's is.
            "HEALTHLOG_LOG_FORMAT": "kv",
            "HEALTHLOG_LOG_LEVEL": "info",
        }
        env.pop(PLAN_ENV, None)
        if plan is not None:
            env[PLAN_ENV] = plan
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "healthlog.cli", "serve", "--data", str(data), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self.url = ""

    async def started(self) -> str:
        assert self.process.stdout is not None
        stdout = self.process.stdout
        with trio.fail_after(START_TIMEOUT_S):
            line = await trio.to_thread.run_sync(stdout.readline)
        if not line.startswith(b"healthlog serving on "):
            raise RuntimeError("the service did not start")
        self.url = line.split()[3].decode()
        return self.url

    def alive(self) -> bool:
        return self.process.poll() is None

    async def stop(self) -> None:
        """SIGTERM, and wait for the service to end, also when the harness is stopped (a
        signal cancels the run): left to itself, the service served on for good, its data
        directory in a temporary directory nobody removed (CLI-169). One that has not ended
        within ``STOP_TIMEOUT_S`` is killed."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(self.process.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                await trio.to_thread.run_sync(self.process.wait)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._log.close()


def _plan(rng: random.Random, kinds: set[str]) -> dict[str, Any]:
    """A fault plan with every planned kind of ``kinds`` at a point of its own (a plan holds one
    action per point, so a kind sharing a point would silently replace another)."""
    plan: dict[str, Any] = {}

    def free(points: tuple[str, ...]) -> str:
        return rng.choice([point for point in points if point not in plan])

    if "delay" in kinds:
        plan["journal.append"] = {"hits": sorted(rng.sample(range(1, 6), 2)), "do": "delay"}
    if "busy" in kinds:
        plan[free(FOLD_POINTS)] = {"hits": sorted(rng.sample(range(1, 12), 3)), "do": "busy"}
    if "ioerror" in kinds:
        point = free((*FOLD_POINTS, "journal.append"))
        plan[point] = {"hits": [rng.randint(1, 6)], "do": "ioerror"}
    if "kill" in kinds:
        plan[free(KILL_POINTS)] = {"hits": [rng.randint(1, 4)], "do": "kill"}
    if "clock" in kinds:
        low, high = JUMP_S
        size = low * (high / low) ** rng.random()
        # With a kill, forward at the first acquisition: the killed holder leaves an expiry
        # far ahead for the restarted service (FENCE-11). Otherwise either way, a bit later.
        if "kill" in kinds:
            hit, seconds = 1, size
        else:
            hit, seconds = rng.randint(1, 4), size * rng.choice((1, -1))
        plan["lease.renew"] = {"hits": [hit], "do": "clock", "seconds": seconds}
    return plan


class Run:
    """One seeded run on its own data directory."""

    def __init__(self, seed: int, root: Path) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.data = DataDir(root / f"run-{seed}")
        self.log = root / f"run-{seed}.log"
        self.result = RunResult(seed)
        self.kinds = set(self.rng.sample(KINDS, self.rng.randint(1, 3)))
        self.result.sealed = self.rng.random() < SEALED_SHARE
        self.accepted: list[_Accepted] = []
        self.bodies: list[bytes] = []
        self.tool_output: list[str] = []
        with self.data.open_tokens() as tokens:
            self.token = tokens.add(CLIENT)
        self.service: _Service | None = None
        self.planned: dict[str, str] = {}
        self.reindex_failure: str | None = None
        self._applied = 0
        self._restarting = trio.Lock()

    def _cli(self, command: str) -> list[str]:
        return [sys.executable, "-m", "healthlog.cli", command, "--data", str(self.data.path)]

    async def start_service(self, with_faults: bool) -> None:
        plan = _plan(self.rng, self.kinds) if with_faults else {}
        self.planned.update({point: entry["do"] for point, entry in plan.items()})
        text = orjson.dumps(plan).decode() if plan else None
        self.service = _Service(self.data.path, self.log, text)
        await self.service.started()

    async def execute(self) -> RunResult:
        bodies = self.bodies = await trio.to_thread.run_sync(self._bodies)
        await self.start_service(with_faults=True)
        try:
            async with trio.open_nursery() as nursery:
                if self.kinds & {"drop", "cancel"}:
                    nursery.start_soon(self._interrupted_follower)
                if "lock" in self.kinds:
                    nursery.start_soon(self._hold_lock)
                # The concurrent reindex and seal are workload: quiescence is only judged once
                # they are over. A seal journaled after a quiet status is unfolded when the
                # check runs, and a reindex still running holds the fold lease, so what it
                # fenced stays pending until it ends.
                async with trio.open_nursery() as workload:
                    if "steal" in self.kinds:
                        workload.start_soon(self._steal)
                    if self.result.sealed:
                        workload.start_soon(self._seal)
                    await self._post_workload(bodies)
                await self._quiesce()
                nursery.cancel_scope.cancel()
            await self._check()
        finally:
            if self.service is not None:
                await self.service.stop()
        self._check_logs()
        return self.result

    def _bodies(self) -> list[bytes]:
        """A short window and 4 to 8 re-sends of it, and one large body that overlaps them."""
        base = workload.window(self.seed, first_minute=0, minutes=self.rng.randint(30, 240))
        documents = [base]
        for n in range(self.rng.randint(4, 8)):
            documents.append(workload.variant(base, self.rng.choice(workload.VARIANTS), n))
        bodies = [workload.encode(doc, self.seed + n) for n, doc in enumerate(documents)]
        size = workload.body_bytes(self.rng)
        large = workload.big_body(self.seed + len(bodies), target_bytes=size)
        bodies.insert(self.rng.randint(0, len(bodies)), large)
        return bodies

    async def _post_workload(self, bodies: list[bytes]) -> None:
        async with httpx.AsyncClient(timeout=30) as client, trio.open_nursery() as nursery:
            for n, body in enumerate(bodies):
                key = f"k{self.seed}-{n}" if self.rng.random() < 0.5 else None
                # Where a cancelled first attempt stops: a fraction of the body, or 1.0 for
                # all of it (cancelled while waiting for the reply).
                stop = self.rng.choice((self.rng.random(), 1.0))
                cancel = stop if "cancel" in self.kinds and self.rng.random() < 0.5 else None
                nursery.start_soon(self._post, client, body, key, cancel)
                if self.rng.random() < 0.5:
                    await trio.sleep(self.rng.uniform(0, 0.2))

    async def _post(
        self, client: httpx.AsyncClient, body: bytes, key: str | None, cancel: float | None
    ) -> None:
        headers = {"Authorization": f"Bearer {self.token}", "automation-aggregation": "minutes"}
        if key is not None:
            headers["Idempotency-Key"] = key
        sent = hashlib.sha256(body).hexdigest()
        for attempt in range(POST_ATTEMPTS):
            service = await self._running()
            if cancel is not None:
                await self._cancelled_post(service.url, body, headers, cancel)
                cancel = None
                continue
            try:
                response = await client.post(
                    service.url + "/v1/deliveries", content=body, headers=headers
                )
            except httpx.TransportError:
                await trio.sleep(0.2 * (attempt + 1))
                continue
            if response.status_code in (409, 503):
                await trio.sleep(0.2 * (attempt + 1))
                continue
            if response.status_code != 200:
                self.result.broken.append(f"a delivery was answered {response.status_code}")
                return
            receipt = response.json()
            if receipt["sha256"] != sent:
                self.result.broken.append("a receipt names other bytes than those posted")
            self.accepted.append(_Accepted(sent, receipt["delivery_id"], key))
            self.result.deliveries += 1
            self.result.bytes += len(body)
            self.result.largest = max(self.result.largest, len(body))
            return
        self.result.broken.append("a delivery was never accepted")

    async def _cancelled_post(
        self, url: str, body: bytes, headers: dict[str, str], stop: float
    ) -> None:
        """A post given up part-way, as by a phone that loses its network: the upload is
        cancelled after ``stop`` of its chunks, or once all were sent, before the reply."""
        chunks = range(0, len(body), UPLOAD_CHUNK)
        sent = int(stop * len(chunks))
        with trio.CancelScope() as scope:

            async def upload() -> AsyncIterator[bytes]:
                for n, start in enumerate(chunks):
                    if n == sent:
                        scope.cancel()
                        await trio.lowlevel.checkpoint()
                    yield body[start : start + UPLOAD_CHUNK]
                scope.cancel()

            async with httpx.AsyncClient(timeout=30) as client:
                with contextlib.suppress(httpx.TransportError):
                    await client.post(
                        url + "/v1/deliveries",
                        content=upload(),
                        headers={**headers, "Content-Length": str(len(body))},
                    )
        self.result.faults["cancel"] += 1

    async def _running(self) -> _Service:
        """The service, restarted (without faults) if a fault killed it."""
        async with self._restarting:
            assert self.service is not None
            if not self.service.alive():
                self.result.crashes += 1
                await self.service.stop()
                await self.start_service(with_faults=False)
            assert self.service is not None
            return self.service

    async def _hold_lock(self) -> None:
        await trio.sleep(self.rng.uniform(0, 0.5))
        seconds = self.rng.uniform(0.3, 1.5)
        script = (
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)\n"
            "c.execute('BEGIN EXCLUSIVE')\n"
            "print('held', flush=True)\n"
            f"time.sleep({seconds})\n"
            "c.execute('COMMIT')\n"
        )
        done = await trio.run_process(
            [sys.executable, "-c", script, str(self.data.store_path)],
            check=False,
            capture_stdout=True,
        )
        if done.stdout.startswith(b"held"):
            self.result.faults["lock"] += 1

    async def _steal(self) -> None:
        await trio.sleep(self.rng.uniform(0.2, 1.0))
        with trio.move_on_after(QUIET_TIMEOUT_S):
            done = await trio.run_process(self._cli("reindex"), check=False, capture_stderr=True)
            output = done.stderr.decode(errors="replace")
            self.tool_output.append(output)
            if done.returncode != 0:
                self.reindex_failure = output
            elif "reindex: done" in output:
                self.result.faults["steal"] += 1
            return
        self.result.broken.append("the concurrent reindex did not end within the quiet timeout")

    async def _seal(self) -> None:
        """Seal the first hours of the window with ``healthlog seal`` while the workload is
        posted (it journals beside the service, as ``import`` does)."""
        await trio.sleep(self.rng.uniform(0.1, 1.0))
        before = workload.EPOCH + timedelta(hours=self.rng.randint(1, 3))
        command = [*self._cli("seal"), "--before", before.isoformat(), "--no-wait"]
        done = await trio.run_process(command, check=False, capture_stderr=True)
        self.tool_output.append(done.stderr.decode(errors="replace"))
        if done.returncode != 0:
            self.result.broken.append("healthlog seal failed")

    async def _interrupted_follower(self) -> None:
        """A follower whose sessions end part-way and resume from its replica: dropped on a
        timer, or cancelled right after it applied its n-th event, before acknowledging it."""
        replica = self.data.path.parent / f"replica-{self.seed}"
        with Replica(replica) as store:
            while True:
                service = await self._running()
                cancelling = "cancel" in self.kinds and (
                    "drop" not in self.kinds or self.rng.random() < 0.5
                )
                if cancelling:
                    await self._follow(store, service.url, self.rng.randint(1, 40))
                else:
                    with trio.move_on_after(self.rng.uniform(0.1, 0.8)):
                        await self._follow(store, service.url, None)
                if self._applied:
                    self.result.faults["cancel" if cancelling else "drop"] += 1
                await trio.sleep(self.rng.uniform(0, 0.3))

    async def _follow(self, store: Replica, url: str, cancel_after: int | None) -> None:
        """Follow until cancelled from outside, or until ``cancel_after`` events applied;
        ``_applied`` counts the events applied in this session."""
        self._applied = applied = 0
        with trio.CancelScope() as scope:

            def on_event(seq: int) -> None:
                nonlocal applied
                applied += 1
                self._applied = applied
                if applied == cancel_after:
                    scope.cancel()

            follower = Follower(Endpoints.parse(url), self.token, store, "chaos", on_event=on_event)
            await follower.run()

    async def _quiesce(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        async with httpx.AsyncClient(timeout=30) as client:
            with trio.move_on_after(QUIET_TIMEOUT_S):
                while True:
                    service = await self._running()
                    try:
                        status = (
                            await client.get(service.url + "/v1/status", headers=headers)
                        ).json()
                        if status["deliveries"]["pending"] == 0:
                            return
                    except (httpx.TransportError, ValueError):
                        pass
                    await trio.sleep(0.2)
        self.result.broken.append("deliveries still pending after the quiet timeout")

    async def _check(self) -> None:
        self.check_folds(self.check_journal())
        await self._compare_projection()
        await self._compare_replica()

    def check_folds(self, metas: list[DeliveryMeta]) -> None:
        """Every delivery of ``metas`` (the journal, in order) is folded; the run counts as
        reordered when the live folder's folds left journal order (a reindex's swap events are
        left out)."""
        with self.data.open_store() as store:
            folded = store.folded_ids()
            if any(m.id not in folded for m in metas):
                self.result.broken.append("journaled deliveries left unfolded")
            order = [
                e.payload["delivery_id"]
                for e in _all_events(store)
                if e.kind == "delivery.folded" and not e.id.startswith(REINDEX_EVENT)
            ]
        position = {m.id: i for i, m in enumerate(metas)}
        if any(position[a] > position[b] for a, b in itertools.pairwise(order)):
            self.result.reordered += 1

    def check_journal(self) -> list[DeliveryMeta]:
        """Every post answered 200 is journaled at the id its receipt names with the bytes
        posted; every idempotency key journaled exactly one delivery, the one its receipts
        name; journal stamps never go back in append order. Returns the journal, in order."""
        with self.data.open_journal() as journal:
            ordered = journal.iter_order()
            keyed = journal.keyed()
        metas = {m.id: m for m in ordered}
        stamps = [metas[n].received_at for n in sorted(metas)]
        if any(a > b for a, b in itertools.pairwise(stamps)):
            self.result.broken.append("journal stamps went back in append order")
        self.result.lost = sum(
            1
            for accepted in self.accepted
            if accepted.delivery_id not in metas
            or metas[accepted.delivery_id].sha256 != accepted.sha256
        )
        if self.result.lost:
            self.result.broken.append(f"{self.result.lost} accepted deliveries not journaled")
        journaled: dict[str, list[int]] = {}
        for client, key, delivery_id in keyed:
            if client == CLIENT:
                journaled.setdefault(key, []).append(delivery_id)
        for accepted in self.accepted:
            if accepted.key is not None and journaled.get(accepted.key) != [accepted.delivery_id]:
                self.result.broken.append(
                    f"idempotency key {accepted.key} journaled {journaled.get(accepted.key, [])}"
                    f" for a receipt naming {accepted.delivery_id}"
                )
        return ordered

    async def _compare_projection(self) -> None:
        logged = self.log.read_text(errors="replace")
        warned = [int(match.group(1)) for match in _OUT_OF_ORDER.finditer(logged)]
        if warned:
            # Before the repair, objects may differ from a rebuild only where a delivery the
            # warning names writes. The service stops meanwhile: a clock it jumped alone would
            # take the reindex's lease (see _check_logs); it comes back with the true clock
            # for the follower.
            unexplained = await trio.to_thread.run_sync(self._unexplained, warned)
            if unexplained:
                self.result.broken.append(
                    f"{unexplained} objects differ from a rebuild where no delivery the"
                    " out-of-order warning names writes"
                )
            assert self.service is not None
            await self.service.stop()
            done = await trio.run_process(self._cli("reindex"), check=False, capture_stderr=True)
            self.tool_output.append(done.stderr.decode(errors="replace"))
            if done.returncode != 0:
                self.result.broken.append("the reindex the service asked for failed")
            await self.start_service(with_faults=False)
        elif self.result.reordered:
            self.result.broken.append("folds left journal order without a warning")
        with self.data.open_journal() as journal, self.data.open_store() as store:
            differences = await trio.to_thread.run_sync(verify, journal, store)
        self.result.mismatched = len(differences)
        if differences:
            self.result.broken.append(f"{len(differences)} objects differ from a rebuild")

    def _unexplained(self, warned: list[int]) -> int:
        """How many objects differ from a rebuild outside those the deliveries ``warned`` write
        (folded against nothing stored, under the layer they were folded under)."""
        with self.data.open_journal() as journal, self.data.open_store() as store:
            differences = verify(journal, store)
            touched: set[ObjectKey] = set()
            for delivery_id in warned:
                meta, outcome = journal.get_meta(delivery_id), store.outcome(delivery_id)
                if meta is None or outcome is None:
                    continue
                fold = DeliveryFold(
                    journal.read_body(delivery_id),
                    DeliveryInfo(delivery_id, meta.received_at, outcome.layer),
                    Unstored(outcome.layer),
                    warn=False,
                )
                touched.update(written.key for written in fold.writes())
        return sum(1 for difference in differences if difference.key not in touched)

    async def _compare_replica(self) -> None:
        replica = self.data.path.parent / f"replica-{self.seed}"
        service = await self._running()
        with Replica(replica) as store:
            follower = Follower(
                Endpoints.parse(service.url), self.token, store, "chaos", until_caught_up=True
            )
            with trio.move_on_after(QUIET_TIMEOUT_S):
                await follower.run()
        self.check_replica(replica)

    def check_replica(self, replica: Path) -> None:
        """The run is broken unless the replica holds the live store's objects, whole rows
        (body, units, times, point count, provenance, seal), not only their hashes, which the
        replica copies from the server's frames."""
        with Replica(replica) as store:
            mine = {o.key: o for o in store.iter_objects()}
        with self.data.open_store() as live:
            theirs = {o.key: o for o in live.iter_objects()}
        if mine != theirs:
            self.result.broken.append("the follower's replica differs from the server")

    def _check_logs(self) -> None:
        service_log = self.log.read_text(errors="replace").splitlines()
        for line in service_log:
            if match := _FIRED.search(line):
                self.result.faults[self.planned[match.group(1)]] += 1
        for line in itertools.chain(service_log, *(o.splitlines() for o in self.tool_output)):
            if "level=DEBUG" in line:
                continue
            if SEVERE.search(line):
                self.result.broken.append(f"ERROR logged: {line[:160]}")
            if _LEAK.search(line) or self.token in line or self._holds_a_value(line):
                self.result.broken.append("a value or token reached a log record")
        # The service's clock jumps alone, so a forward jump beyond the reindex's term makes
        # its lease look expired there (as a machine-wide step would), and a backward one can
        # cut its expiry; the reindex then loses the lease and fails before its swap, safely.
        lost_to_a_jump = self.result.faults["clock"] > 0 and "lease" in (self.reindex_failure or "")
        if self.reindex_failure is not None and not lost_to_a_jump:
            self.result.broken.append("a concurrent reindex failed")

    def _holds_a_value(self, line: str) -> bool:
        """Whether the line holds a number with three or more decimals that is a point value
        of a body posted (healthlog logs no such number: the workload's values have them)."""
        return any(
            re.search(rb"[:,\[]" + re.escape(number.encode()) + rb"[,}\]]", body)
            for number in _DECIMAL.findall(line)
            for body in self.bodies
        )


CLIENT = "chaos"
"""The token name, and so the client name, the workload is posted under."""
_FIRED = re.compile(r"fault injected at ([a-z_.]+) ")
# A record at ERROR or above. A traceback alone is not one: a fold worker orphaned by a SIGKILL
# of the service while it starts prints multiprocessing's own (EOFError, its parent gone).
SEVERE = re.compile(r"\blevel=(ERROR|CRITICAL)\b")


def _leak_pattern(marker: str) -> re.Pattern[str]:
    """The device name ``marker`` as a log line could carry it: each character that is not
    ASCII as itself or escaped (JSON's or Python's ``\\uXXXX``, a bytes repr's ``\\xNN`` for
    each UTF-8 byte), behind any number of backslashes (a formatter escapes them again)."""
    parts = []
    for char in marker:
        if char.isascii():
            parts.append(re.escape(char))
            continue
        utf8 = "".join(rf"\\+x{byte:02x}" for byte in char.encode())
        parts.append(f"(?:{re.escape(char)}|\\\\+u{ord(char):04x}|{utf8})")
    return re.compile("".join(parts), re.IGNORECASE)


_LEAK = _leak_pattern(workload.LEAK_MARKER)
_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.\d{3,}(?![\w.])")
# The out-of-order warning (F9) as the service logs it, the only record that excuses folds
# out of journal order, and live objects that differ from a rebuild until a reindex.
_OUT_OF_ORDER = re.compile(
    r'level=WARNING logger=healthlog\.store msg="delivery (\d+) folded after a later delivery'
)


def _all_events(store: Store) -> list[Event]:
    events: list[Event] = []
    after = 0
    while batch := store.events_after(after, 1000):
        events.extend(batch)
        after = batch[-1].seq
    return events


@attrs.define
class Summary:
    runs: list[RunResult]

    @property
    def ok(self) -> bool:
        return all(not r.broken for r in self.runs)

    def table(self) -> str:
        lines = [
            f"{'seed':>10} {'faults':<40} {'crashes':>7} {'deliv':>5} {'bytes':>10}"
            f" {'max MiB':>7} {'lost':>4} {'mism':>4} {'reord':>5}  result"
        ]
        for r in self.runs:
            faults = ",".join(f"{k}={v}" for k, v in sorted(r.faults.items())) or "-"
            lines.append(
                f"{r.seed:>10} {faults:<40} {r.crashes:>7} {r.deliveries:>5} {r.bytes:>10}"
                f" {r.largest / 2**20:>7.1f} {r.lost:>4} {r.mismatched:>4} {r.reordered:>5}  "
                + ("ok" if not r.broken else "; ".join(r.broken)[:200])
            )
        by_kind: Counter[str] = Counter()
        for r in self.runs:
            by_kind.update(r.faults)
        lines.append("faults by kind: " + ", ".join(f"{k} {by_kind[k]}" for k in KINDS))
        largest = [r.largest for r in self.runs if r.largest]
        if largest:
            lines.append(
                f"largest body per run: {min(largest) / 2**20:.1f} to"
                f" {max(largest) / 2**20:.1f} MiB"
            )
        lines.append(f"runs with a seal: {sum(r.sealed for r in self.runs)}")
        lines.append(
            f"chaos: runs {len(self.runs)}, faults injected {sum(by_kind.values())},"
            f" crashes {sum(r.crashes for r in self.runs)},"
            f" deliveries {sum(r.deliveries for r in self.runs)},"
            f" lost {sum(r.lost for r in self.runs)},"
            f" mismatched {sum(r.mismatched for r in self.runs)}"
        )
        return "\n".join(lines)


async def run_chaos(seed: int, runs: int, minutes: float | None, keep: Path | None) -> Summary:
    """Run the harness; stop starting new runs once ``minutes`` have passed."""
    results = []
    deadline = None if minutes is None else trio.current_time() + minutes * 60
    with tempfile.TemporaryDirectory(prefix="healthlog-chaos-", dir=keep) as tmp:
        for n in range(runs):
            if deadline is not None and trio.current_time() > deadline:
                break
            run = Run(seed * 100_000 + n, Path(tmp))
            results.append(await run.execute())
            # Dropped when stderr cannot be written (its reader gone, `2>&1 | head -1`): the
            # write's BrokenPipeError ended the harness after one run, exit 0 (CLI-170).
            with contextlib.suppress(OSError):
                print(_progress(results[-1]), file=sys.stderr, flush=True)
    return Summary(results)


def _progress(result: RunResult) -> str:
    faults = ",".join(f"{k}={v}" for k, v in sorted(result.faults.items())) or "none"
    sealed = ", sealed" if result.sealed else ""
    return f"chaos: run {result.seed} {'ok' if not result.broken else 'BROKEN'} ({faults}{sealed})"
