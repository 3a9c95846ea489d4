"""Signed snapshots built from a real store, every check ``validate`` makes, and the files a
running service keeps and serves, and the temporary files of builds that fail, are killed or
run beside another, and the memory a build and a fetch take (specs/stream.md, STREAM-16,
STREAM-17, STREAM-34, STREAM-46, STREAM-47, STREAM-53)."""

from __future__ import annotations

import base64
import errno
import fcntl
import gc
import gzip
import hashlib
import io
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import orjson
import pytest
import trio
from _bodies import BASE_US, body, delivery, point
from _runtime_helpers import config
from _service_helpers import Service, serving
from _stream_helpers import HOURS, event_tag, fold_metrics, post_small, prune, validate
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from actors.runtime import open_runtime
from healthlog import faults, snapshots
from healthlog.documents import Manifest
from healthlog.objects import HourlyObject, to_wire
from healthlog.seals import SEAL_CLIENT, SEAL_CONTENT_TYPE, Seal
from healthlog.snapshots import SCHEMA, SnapshotError
from healthlog.storage import snapshot_files
from healthlog.storage.datadir import DataDir
from healthlog.storage.faultplan import PLAN_ENV
from healthlog.storage.journal import NewDelivery
from healthlog.storage.replica import Replica
from transport.snapshots import SnapshotBody

NOW_US = 1_709_251_200_000_000
HOUR_US = 3600 * 10**6
TTL_US = 15_000_000
URL = "/v1/snapshots"


@attrs.frozen
class Attempt:
    """A snapshot file, its manifest, and what a client checks them against."""

    manifest: Manifest
    data: bytes
    key: Ed25519PrivateKey
    instance: str
    stream: str | None
    after: int

    def validate(self) -> list[HourlyObject]:
        return validate(
            self.manifest,
            self.data,
            public_key=snapshots.public_key_text(self.key),
            instance=self.instance,
            stream=self.stream,
            after=self.after,
        )

    def validate_lazily(self) -> Iterator[HourlyObject]:
        """The objects as a follower reads them into its replica: checked first, then read one
        at a time."""
        digest = hashlib.sha256(self.data).hexdigest()
        snapshots.check(
            self.manifest,
            digest,
            public_key=snapshots.public_key_text(self.key),
            instance=self.instance,
            stream=self.stream,
            after=self.after,
        )
        return snapshots.read(io.BytesIO(self.data), self.manifest)

    def resigned(self, data: bytes) -> Attempt:
        """Another file under a manifest correctly signed with the instance's key."""
        manifest = snapshots.sign(
            self.key,
            hashlib.sha256(data).hexdigest(),
            url=self.manifest.url,
            instance=self.manifest.instance,
            stream=self.manifest.stream,
            seq=self.manifest.seq,
        )
        return attrs.evolve(self, manifest=manifest, data=data)


@pytest.fixture
def store_objects(tmp_path: Path) -> tuple[Attempt, list[HourlyObject]]:
    """Three deliveries and a seal folded into a real store, a snapshot of it at its head
    (checked as a client bound to that instance and stream at that sequence would), and the
    store's objects."""
    data = DataDir(tmp_path)
    deliveries = [
        body({"heart_rate": [point(1, 60), point(61, 62)]}),
        body({"heart_rate": [point(2, 61)], "step_count": [point(3, 120)]}),
        body({"step_count": [point(125, 80)]}),
    ]
    with data.open_journal() as journal, data.open_store() as store:
        epoch = store.acquire_lease("test", now=NOW_US, ttl=TTL_US)
        assert epoch is not None
        # The last one seals the first hour of heart_rate.
        seal = NewDelivery(
            Seal(BASE_US + HOUR_US, "heart_rate").encode(),
            SEAL_CLIENT,
            content_type=SEAL_CONTENT_TYPE,
        )
        for new in [*(delivery(content) for content in deliveries), seal]:
            meta = journal.get_meta(journal.append(new).delivery_id)
            assert meta is not None
            store.fold(journal, meta, epoch)
        manifest = snapshot_files.build(data.snapshot_dir, journal, store, data.signing_key(), URL)
        objects = list(store.iter_objects())
        assert (manifest.instance, manifest.stream) == (journal.instance_id(), store.stream_id())
        assert manifest.seq == store.event_window()[1]
    path = snapshot_files.find(data.snapshot_dir, manifest.stream, manifest.seq)
    assert path is not None
    attempt = Attempt(
        manifest,
        path.read_bytes(),
        data.signing_key(),
        manifest.instance,
        manifest.stream,
        manifest.seq,
    )
    return attempt, objects


def test_snapshot_round_trip(store_objects: tuple[Attempt, list[HourlyObject]]) -> None:
    """STREAM-16: a snapshot of a real store validates and holds exactly its objects."""
    attempt, objects = store_objects
    assert len(objects) == 4
    assert [(o.key.metric, o.key.hour - BASE_US) for o in objects if o.sealed] == [
        ("heart_rate", 0)
    ]
    assert attempt.manifest.schema == SCHEMA
    assert attempt.manifest.url == f"{URL}/{attempt.manifest.seq}"
    assert attempt.validate() == objects
    assert attrs.evolve(attempt, stream=None, after=0).validate() == objects


def flipped(data: bytes) -> bytes:
    """``data`` with one bit of its middle byte flipped."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]


def with_header(data: bytes, **changes: int) -> bytes:
    """The same snapshot file with header fields changed."""
    header, rest = gzip.decompress(data).split(b"\n", 1)
    fields = {**orjson.loads(header), **changes}
    return gzip.compress(orjson.dumps(fields) + b"\n" + rest, mtime=0)


def other_key_signature(a: Attempt) -> Attempt:
    m = a.manifest
    other = Ed25519PrivateKey.generate()
    forged = snapshots.sign(
        other,
        hashlib.sha256(a.data).hexdigest(),
        url=m.url,
        instance=m.instance,
        stream=m.stream,
        seq=m.seq,
    )
    return attrs.evolve(a, manifest=forged)


def other_file_same_signature(a: Attempt) -> Attempt:
    """Another file (its last object left out), its sha256 in the manifest, the signature kept."""
    data = with_header(a.data, objects=3)
    data = gzip.compress(b"".join(gzip.decompress(data).splitlines(keepends=True)[:-1]), mtime=0)
    digest = hashlib.sha256(data).hexdigest()
    return attrs.evolve(a, manifest=attrs.evolve(a.manifest, sha256=digest), data=data)


def damaged_signature(a: Attempt) -> Attempt:
    raw = flipped(base64.b64decode(a.manifest.signature))
    return attrs.evolve(
        a, manifest=attrs.evolve(a.manifest, signature=base64.b64encode(raw).decode())
    )


TAMPERED: list[tuple[str, Callable[[Attempt], Attempt], str]] = [
    ("flipped-byte", lambda a: attrs.evolve(a, data=flipped(a.data)), "sha256"),
    ("damaged-signature", damaged_signature, "signature"),
    (
        "signature-not-base64",
        lambda a: attrs.evolve(a, manifest=attrs.evolve(a.manifest, signature="%%%")),
        "signature",
    ),
    ("signed-by-another-key", other_key_signature, "signature"),
    (
        "seq-changed-after-signing",
        lambda a: attrs.evolve(a, manifest=attrs.evolve(a.manifest, seq=a.manifest.seq + 1)),
        "signature",
    ),
    (
        "instance-changed-after-signing",
        lambda a: attrs.evolve(
            a,
            manifest=attrs.evolve(a.manifest, instance="another-instance"),
            instance="another-instance",
        ),
        "signature",
    ),
    (
        "stream-changed-after-signing",
        lambda a: attrs.evolve(
            a, manifest=attrs.evolve(a.manifest, stream="another-stream"), stream="another-stream"
        ),
        "signature",
    ),
    ("file-and-sha256-changed-after-signing", other_file_same_signature, "signature"),
    ("other-instance", lambda a: attrs.evolve(a, instance="another-instance"), "another instance"),
    ("other-stream", lambda a: attrs.evolve(a, stream="another-stream"), "another stream"),
    ("older-than-cursor", lambda a: attrs.evolve(a, after=a.after + 1), "older than the cursor"),
    (
        "unknown-schema",
        lambda a: attrs.evolve(a, manifest=attrs.evolve(a.manifest, schema="snapshot.v9")),
        "schema",
    ),
    (
        "header-seq-differs",
        lambda a: a.resigned(with_header(a.data, seq=a.manifest.seq - 1)),
        "header does not match",
    ),
    (
        "header-object-count-differs",
        lambda a: a.resigned(with_header(a.data, objects=5)),
        "header does not match",
    ),
    (
        "header-counts-fewer-objects",
        lambda a: a.resigned(with_header(a.data, objects=3)),
        "header does not match",
    ),
    ("not-a-snapshot", lambda a: a.resigned(b"plain text"), "cannot be decoded"),
    (
        "broken-deflate",
        lambda a: a.resigned(gzip.compress(b"")[:10] + b"\xff" * 20),
        "cannot be decoded",
    ),
    (
        "deflate-byte-flipped",
        lambda a: a.resigned(a.data[:12] + bytes([a.data[12] ^ 0xFF]) + a.data[13:]),
        "cannot be decoded",
    ),
    ("header-not-an-object", lambda a: a.resigned(gzip.compress(b"[]\n")), "cannot be decoded"),
    (
        "object-line-not-an-object",
        lambda a: a.resigned(with_objects(a.data, b"5")),
        "cannot be decoded",
    ),
]


def with_objects(data: bytes, *lines: bytes) -> bytes:
    """The same snapshot file with its object lines replaced by ``lines``."""
    header = orjson.loads(gzip.decompress(data).split(b"\n", 1)[0])
    header["objects"] = len(lines)
    return gzip.compress(b"\n".join([orjson.dumps(header), *lines]) + b"\n", mtime=0)


@pytest.mark.parametrize(
    ("tamper", "check"), [pytest.param(t, c, id=name) for name, t, c in TAMPERED]
)
def test_tampered_snapshot_refused(
    store_objects: tuple[Attempt, list[HourlyObject]],
    tamper: Callable[[Attempt], Attempt],
    check: str,
) -> None:
    """STREAM-17: each tampering, and content that is not a snapshot (a broken deflate stream,
    a header or object line that is not an object), is refused with a SnapshotError naming
    the failed check."""
    attempt, _ = store_objects
    with pytest.raises(SnapshotError, match=check):
        tamper(attempt).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("hour", 2**64 - 1, id="hour-past-sqlite"),
        pytest.param("hour", "2024-03-01T10:00:00Z", id="hour-text"),
        pytest.param("hour", [1], id="hour-array"),
        pytest.param("metric", 5, id="metric-number"),
        pytest.param("layer", None, id="layer-null"),
        pytest.param("first", 2**64 - 1, id="first-past-sqlite"),
    ],
)
def test_an_object_line_of_other_types_is_refused_stream_201(
    store_objects: tuple[Attempt, list[HourlyObject]], tmp_path: Path, field: str, value: object
) -> None:
    """STREAM-201: GIVEN a replica holding a snapshot's objects WHEN a correctly signed snapshot
    has an object line whose metric or layer is not a string, or whose hour or a number is not
    an integer of SQLite's THEN its restore is refused with a SnapshotError (cannot be decoded)
    and the replica holds what it held. (Before, an hour of 2**64 - 1 raised OverflowError out
    of the restore, an array was said as a database error of the replica, and an hour written
    as text or a number as metric was restored as it came, under no hour a query finds; found
    writing ``scripts/fuzz/follow.py``.)"""
    attempt, objects = store_objects
    lines = [
        orjson.dumps(
            {"metric": o.key.metric, "layer": o.key.layer, "hour": o.key.hour, **to_wire(o)}
        )
        for o in objects
    ]
    bad = orjson.loads(lines[-1])
    bad[field] = value
    hostile = attempt.resigned(with_objects(attempt.data, *lines[:-1], orjson.dumps(bad)))
    with Replica(tmp_path / "replica") as replica:
        replica.restore(attempt.manifest.stream, attempt.manifest.seq, attempt.validate())
        before = list(replica.iter_objects())
        with pytest.raises(SnapshotError, match="cannot be decoded"):
            replica.restore(
                attempt.manifest.stream, attempt.manifest.seq, hostile.validate_lazily()
            )
        assert list(replica.iter_objects()) == before == objects


@pytest.mark.parametrize("seq", [2**64, -(2**64), 10**30, 2**63, -1])
def test_sequence_out_of_range_refused_stream_46(
    store_objects: tuple[Attempt, list[HourlyObject]], seq: int
) -> None:
    """STREAM-46: a manifest whose sequence is outside SQLite's integers (0 to 2**63 - 1),
    beyond what JSON encoders take (2**64, -2**64, 10**30) or just outside (2**63, -1), is
    refused with a SnapshotError naming the check, like every other failed check."""
    attempt, _ = store_objects
    out_of_range = attrs.evolve(attempt, manifest=attrs.evolve(attempt.manifest, seq=seq))
    with pytest.raises(SnapshotError, match="sequence is out of range"):
        out_of_range.validate()


@pytest.mark.parametrize("field", ["instance", "stream"])
def test_field_that_cannot_be_encoded_refused_stream_46(
    store_objects: tuple[Attempt, list[HourlyObject]], field: str
) -> None:
    """STREAM-46: a manifest field holding a lone surrogate (which Python's JSON parser takes,
    as ``follow`` reads it) cannot have been signed: refused as a signature that does not
    verify."""
    attempt, _ = store_objects
    manifest = attrs.evolve(attempt.manifest, **{field: "\ud800"})
    with pytest.raises(SnapshotError, match="signature does not verify"):
        attrs.evolve(attempt, manifest=manifest).validate()


async def newer_snapshot(service: Service, *minutes: int) -> dict[str, str | int]:
    """Fold more deliveries, prune the events so the kept snapshot no longer covers the window,
    and return the manifest of the snapshot the service builds then."""
    await post_small(service, *minutes)
    await prune(service.data, keep=2)
    response = await service.get("/v1/snapshots")
    assert response.status_code == 200, response.text
    manifest: dict[str, str | int] = response.json()
    return manifest


async def test_previous_snapshot_stays_fetchable_stream_34(tmp_path: Path) -> None:
    """STREAM-34: a snapshot reference handed out before a newer snapshot was built still answers
    200 with its file; once two newer ones exist its file is gone and it answers 404 `NOT_FOUND`
    in JSON; the service keeps two files."""
    async with serving(tmp_path / "data") as service:
        first = await newer_snapshot(service, 0, 20, 40)
        second = await newer_snapshot(service, 60, 80)
        assert int(second["seq"]) > int(first["seq"])
        for manifest in (first, second):
            response = await service.get(str(manifest["url"]))
            assert response.status_code == 200
            assert hashlib.sha256(response.content).hexdigest() == manifest["sha256"]
        third = await newer_snapshot(service, 100, 120)
        gone = await service.get(str(first["url"]))
        assert gone.status_code == 404
        assert gone.json() == {"error": "NOT_FOUND"}
        for manifest in (second, third):
            assert (await service.get(str(manifest["url"]))).status_code == 200
        kept = {path.name for path in service.data.snapshot_dir.iterdir()}
    stream = third["stream"]
    assert kept == {f"snapshot-{stream}-{m['seq']}.snap" for m in (second, third)}


async def test_a_link_at_a_snapshot_s_name_is_not_served_serve_88(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SERVE-88: a link to another file planted in `snapshots/` at the name of a snapshot of
    the current stream (by whoever may write there: the service's account when `serve` runs as
    root) answers 404 `NOT_FOUND` without a byte of the file it names, with one WARNING; a
    snapshot the service built is still served."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root:precious\n")
    async with serving(tmp_path / "data") as service:
        built = await newer_snapshot(service, 0, 20)
        stream, seq = built["stream"], int(built["seq"])
        directory = service.data.snapshot_dir
        (directory / f"snapshot-{stream}-{seq + 1000}.snap").symlink_to(victim)
        with caplog.at_level(logging.WARNING, "healthlog.storage.snapshot_files"):
            refused = await service.get(f"/v1/snapshots/{seq + 1000}")
        assert refused.status_code == 404
        assert refused.json() == {"error": "NOT_FOUND"}
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == [
            f"not serving snapshot {seq + 1000}: a link is at its name, not a file a build made"
        ]
        served = await service.get(str(built["url"]))
        assert served.status_code == 200
        assert hashlib.sha256(served.content).hexdigest() == built["sha256"]


async def test_a_link_at_the_kept_snapshot_s_name_is_built_anew_serve_95(tmp_path: Path) -> None:
    """SERVE-95: GIVEN the snapshot the service built last replaced by a link at its name (to a
    copy of that very file, elsewhere) WHEN `/v1/snapshots` is asked THEN a new snapshot is
    built at that name and its `url` answers 200 with the file its manifest signs. (Before,
    the link counted as the kept file: the manifest was offered again and again and its `url`
    answered 404 `NOT_FOUND` each time, SERVE-88, so a follower sent there never restored.)"""
    async with serving(tmp_path / "data") as service:
        built = await newer_snapshot(service, 0, 20)
        name = f"snapshot-{built['stream']}-{built['seq']}.snap"
        planted = service.data.snapshot_dir / name
        elsewhere = tmp_path / name
        original = planted.read_bytes()
        planted.rename(elsewhere)
        planted.symlink_to(elsewhere)
        response = await service.get("/v1/snapshots")
        assert response.status_code == 200, response.text
        offered = response.json()
        assert offered["seq"] == built["seq"]
        fetched = await service.get(str(offered["url"]))
        assert fetched.status_code == 200, fetched.text
        assert hashlib.sha256(fetched.content).hexdigest() == offered["sha256"]
        assert not planted.is_symlink()
        assert elsewhere.read_bytes() == original


_BUILD = """
import os, resource, signal, sys
from healthlog.storage import snapshot_files
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery
from healthlog.storage.replica import Replica
from healthlog.storage.faultplan import load_environment
load_environment()
data = DataDir(sys.argv[1])
key = data.signing_key()
with data.open_journal() as journal, data.open_store() as store:
    if int(sys.argv[2]):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
    try:
        manifest = snapshot_files.build(data.snapshot_dir, journal, store, key, "/v1/snapshots")
    except OSError as exc:
        print(exc.errno)
        sys.exit(3)
print(manifest.seq)
"""
FILE_LIMIT = 64
BUILD_HOLD_S = 3.0


def build_process(
    data: DataDir, file_limit: int = 0, plan: dict[str, object] | None = None
) -> subprocess.Popen[bytes]:
    """``snapshot_files.build`` in a process of its own: its files limited to ``file_limit``
    bytes (a real EFBIG on write, as a full disk gives ENOSPC), under a fault ``plan``."""
    env = {**os.environ, PLAN_ENV: orjson.dumps(plan).decode()} if plan else None
    return subprocess.Popen(
        [sys.executable, "-c", _BUILD, str(data.path), str(file_limit)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def build_here(data: DataDir) -> Manifest:
    with data.open_journal() as journal, data.open_store() as store:
        return snapshot_files.build(data.snapshot_dir, journal, store, data.signing_key(), URL)


def leftovers(data: DataDir) -> list[str]:
    return sorted(path.name for path in data.snapshot_dir.glob("*.tmp"))


def test_failed_and_killed_builds_leave_no_temporary_file_stream_47(
    store_objects: tuple[Attempt, list[HourlyObject]], tmp_path: Path
) -> None:
    """STREAM-47: a build whose write fails (the file size limit, EFBIG) removes its temporary
    file; the temporary file of a build killed (SIGKILL) after writing it, at an earlier head, is
    removed by the next build, which succeeds and keeps the snapshot files it keeps otherwise."""
    data = DataDir(tmp_path)
    before = sorted(path.name for path in data.snapshot_dir.iterdir())
    failing = build_process(data, FILE_LIMIT)
    out, err = failing.communicate(timeout=60)
    assert (failing.returncode, out.strip()) == (3, str(errno.EFBIG).encode()), err
    assert leftovers(data) == []
    kill = {"snapshot.write": {"hits": [1], "do": "kill"}}
    killed = build_process(data, plan=kill)
    _, err = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, err
    [left] = leftovers(data)
    # As if it was killed at an earlier head: the next build's own temporary file has another
    # name, so only the removal of what a stopped build left takes this one away.
    stream, seq = left.removeprefix("snapshot-").removesuffix(".tmp").split("-")
    os.rename(data.snapshot_dir / left, data.snapshot_dir / f"snapshot-{stream}-{int(seq) - 1}.tmp")
    manifest = build_here(data)
    assert leftovers(data) == []
    assert sorted(path.name for path in data.snapshot_dir.iterdir()) == before
    path = snapshot_files.find(data.snapshot_dir, manifest.stream, manifest.seq)
    assert path is not None
    attempt, objects = store_objects
    assert attrs.evolve(attempt, manifest=manifest, data=path.read_bytes()).validate() == objects


def test_a_concurrent_build_keeps_its_temporary_file_stream_47(
    store_objects: tuple[Attempt, list[HourlyObject]], tmp_path: Path
) -> None:
    """STREAM-47: while a build in another process holds its written temporary file (3 s
    between the write and the rename), a build here waits for it instead of removing that
    file; both succeed and no temporary file is left."""
    data = DataDir(tmp_path)
    hold = {"snapshot.write": {"hits": [1], "do": "delay", "seconds": BUILD_HOLD_S}}
    other = build_process(data, plan=hold)
    deadline = time.monotonic() + 60
    while not leftovers(data):
        assert other.poll() is None, other.communicate()
        assert time.monotonic() < deadline, "the other build wrote no temporary file"
        time.sleep(0.01)
    manifest = build_here(data)
    out, err = other.communicate(timeout=60)
    assert (other.returncode, out.strip()) == (0, str(manifest.seq).encode()), err
    assert leftovers(data) == []
    path = snapshot_files.find(data.snapshot_dir, manifest.stream, manifest.seq)
    assert path is not None
    attempt, objects = store_objects
    assert attrs.evolve(attempt, manifest=manifest, data=path.read_bytes()).validate() == objects


def test_a_link_planted_at_a_build_s_temporary_name_is_refused_store_98(
    store_objects: tuple[Attempt, list[HourlyObject]], tmp_path: Path
) -> None:
    """STORE-98: a link to another file planted at the name of a build's temporary file once
    the build has removed what stopped builds left (the fault point ``snapshot.open``, as an
    account that may write in ``snapshots/`` would, racing it) makes the build fail with
    FileExistsError: the file it names keeps its bytes and its owner (run as root, with
    ``snapshots/`` another user's, the build used to give it to that user); the link is gone,
    and the next build succeeds."""
    data = DataDir(tmp_path)
    attempt, objects = store_objects
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_bytes(b"root:precious\n")
    victim.chmod(0o644)
    owner = victim.stat().st_uid
    if os.geteuid() == 0:
        os.chown(data.snapshot_dir, 65534, 65534)
    tmp = data.snapshot_dir / f"snapshot-{attempt.manifest.stream}-{attempt.manifest.seq}.tmp"

    def plant(_point: str) -> None:
        tmp.symlink_to(victim)

    plan = faults.Plan(actions={"snapshot.open": faults.Action(frozenset({1}), plant)})
    with faults.loaded(plan), pytest.raises(FileExistsError):
        build_here(data)
    assert victim.read_bytes() == b"root:precious\n"
    assert victim.stat().st_uid == owner
    assert not tmp.is_symlink()
    manifest = build_here(data)
    path = snapshot_files.find(data.snapshot_dir, manifest.stream, manifest.seq)
    assert path is not None
    assert attrs.evolve(attempt, manifest=manifest, data=path.read_bytes()).validate() == objects


_TAKE_KEY = """
import sys, time
from healthlog.snapshots import public_key_text
from healthlog.storage.datadir import DataDir
from healthlog.storage.journal import NewDelivery
from healthlog.storage.replica import Replica
start = float(sys.argv[2])
while time.time() < start:
    pass
print(public_key_text(DataDir(sys.argv[1]).signing_key()))
"""


@pytest.mark.parametrize("attempt", range(5))
def test_processes_starting_together_share_one_signing_key_stream_44(
    tmp_path: Path, attempt: int
) -> None:
    """STREAM-44: four processes asking a new data directory for its signing key at the same
    moment all get the one key the file holds, and leave no file of their own behind."""
    data = tmp_path / f"data-{attempt}"
    start = time.time() + 0.5
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKE_KEY, str(data), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    said = [child.communicate(timeout=60) for child in children]
    assert [child.returncode for child in children] == [0] * 4, said
    on_disk = snapshots.public_key_text(DataDir(data).signing_key())
    assert {out.decode().strip() for out, _ in said} == {on_disk}
    assert sorted(path.name for path in data.iterdir()) == ["signing.key"]


def test_a_signing_key_is_made_where_hard_links_are_not_stream_44(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STREAM-44: on a filesystem without hard links (FAT or exFAT on a USB disk, where link()
    fails with EPERM; none can be mounted here, so link() is made to fail so) a new data
    directory still gets its key, the same one on every later call, and no other file. The
    first creator wins: another process that creates the key in the instant between this one's
    look for it and its own creation (here, from within the failing link()) keeps its key."""
    data = DataDir(tmp_path / "data")
    links: list[object] = []
    raced: list[str] = []

    def no_links(source: object, target: object) -> None:
        links.append(source)
        if len(links) == 1:
            raced.append(snapshots.public_key_text(DataDir(data.path).signing_key()))
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first = snapshots.public_key_text(data.signing_key())
    assert raced == [first]
    assert snapshots.public_key_text(data.signing_key()) == first
    assert sorted(path.name for path in data.path.iterdir()) == ["signing.key"]
    assert (data.path / "signing.key").stat().st_mode & 0o777 == 0o600


def encoded_before_streaming(
    objects: list[HourlyObject], *, instance: str, stream: str, seq: int, tag: str | None
) -> bytes:
    """The decompressed content ``snapshots.encode`` gave a snapshot file before builds
    streamed: every line built, joined and compressed at once; with the header's ``tag``
    added since (STREAM-116)."""
    header: dict[str, object] = {
        "schema": SCHEMA,
        "instance": instance,
        "stream": stream,
        "seq": seq,
        "objects": len(objects),
    }
    if tag is not None:
        header["tag"] = tag
    lines = [orjson.dumps(header)]
    lines.extend(
        orjson.dumps(
            {"metric": o.key.metric, "layer": o.key.layer, "hour": o.key.hour, **to_wire(o)}
        )
        for o in objects
    )
    return b"\n".join(lines) + b"\n"


BUILD_PEAK_BYTES = 2_000_000


def test_a_build_holds_one_object_at_a_time_stream_53(tmp_path: Path) -> None:
    """STREAM-53: building the snapshot of a store of 1,000 objects and of one of 4,000 takes
    the same peak of Python memory (traced in this process), well under the smaller store's
    file content; each file's lines are those ``encode`` wrote before builds streamed, byte for
    byte, and each validates."""
    peaks = []
    for metrics in (2, 8):
        data = DataDir(tmp_path / f"data-{metrics}")
        fold_metrics(data, metrics)
        with data.open_journal() as journal, data.open_store() as store:
            tracemalloc.start()
            try:
                manifest = snapshot_files.build(
                    data.snapshot_dir, journal, store, data.signing_key(), URL
                )
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
            objects = list(store.iter_objects())
        assert len(objects) == metrics * HOURS
        path = snapshot_files.find(data.snapshot_dir, manifest.stream, manifest.seq)
        assert path is not None
        content = path.read_bytes()
        assert gzip.decompress(content) == encoded_before_streaming(
            objects,
            instance=manifest.instance,
            stream=manifest.stream,
            seq=manifest.seq,
            tag=event_tag(data, manifest.seq),
        )
        attempt = Attempt(manifest, content, data.signing_key(), manifest.instance, None, 0)
        assert attempt.validate() == objects
    assert peaks[1] < BUILD_PEAK_BYTES
    assert peaks[1] < 1.5 * peaks[0]


def test_a_snapshot_is_read_beside_the_store_stream_53(tmp_path: Path) -> None:
    """STREAM-53: while a snapshot's objects are being read, the store answers reads and folds
    a delivery on its own connection; the snapshot holds the objects and head sequence of
    before that fold, and as many objects as its count."""
    data = DataDir(tmp_path)
    fold_metrics(data, 2)
    with data.open_journal() as journal, data.open_store() as store:
        before = list(store.iter_objects())
        head = store.event_window()[1]
        with store.snapshot_at_head() as snapshot:
            first = next(snapshot.objects)
            epoch = store.acquire_lease("test", now=NOW_US, ttl=TTL_US)
            assert epoch is not None
            new = delivery(body({"metric_new": [point(1, 1)]}))
            meta = journal.get_meta(journal.append(new).delivery_id)
            assert meta is not None
            store.fold(journal, meta, epoch)
            assert store.event_window()[1] > head
            read = [first, *snapshot.objects]
        assert (snapshot.seq, snapshot.count) == (head, len(before))
        assert read == before
        assert len(list(store.iter_objects())) == len(before) + 1


def test_a_snapshot_body_never_entered_closes_its_file_stream_53(tmp_path: Path) -> None:
    """STREAM-53: a snapshot file's response body that is dropped before it is sent (its client
    went away between the handler and the send) closes its file when it is collected, without
    an unclosed-file warning (which this suite turns into a failure)."""
    path = tmp_path / "snapshot.snap"
    path.write_bytes(b"\x1f\x8b" * 100)
    file = open(path, "rb")  # noqa: SIM115 (the body owns it)
    body = SnapshotBody(file)
    assert body.size == 200
    del body
    gc.collect()
    assert file.closed


async def test_a_snapshot_file_is_served_in_chunks_stream_53(tmp_path: Path) -> None:
    """STREAM-53: a snapshot file is served with its length and its bytes, without the service
    holding the whole file in memory: the peak of Python memory traced in the process while a
    client streams it is under half the file's size."""
    fold_metrics(DataDir(tmp_path / "data"), 16)
    async with serving(tmp_path / "data") as service:
        response = await service.get("/v1/snapshots")
        assert response.status_code == 200, response.text
        manifest = response.json()
        path = snapshot_files.find(service.data.snapshot_dir, manifest["stream"], manifest["seq"])
        assert path is not None
        size = path.stat().st_size
        digest = hashlib.sha256()
        tracemalloc.start()
        try:
            async with service.client.stream("GET", manifest["url"], headers=service.auth) as got:
                assert got.status_code == 200
                assert got.headers["content-length"] == str(size)
                async for chunk in got.aiter_raw():
                    digest.update(chunk)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert digest.hexdigest() == manifest["sha256"]
    assert peak < size / 2


async def test_a_snapshot_does_not_begin_a_moved_data_directory_anew_run_45(
    tmp_path: Path,
) -> None:
    """RUN-45: a snapshot asked for while the service's data directory is moved away answers
    503 ``SNAPSHOT_UNAVAILABLE`` and makes nothing at the old path, nor in an empty directory
    left there (an unmounted disk's mount point); with the directory back, the snapshot is
    built."""
    data, moved = tmp_path / "data", tmp_path / "moved"
    async with serving(data) as service:
        await service.wait_folded()
        data.rename(moved)
        refused = await service.get("/v1/snapshots")
        assert (refused.status_code, refused.json()) == (503, {"error": "SNAPSHOT_UNAVAILABLE"})
        assert not data.exists()
        # An empty mount point left at the path, the disk unmounted.
        data.mkdir()
        refused = await service.get("/v1/snapshots")
        assert (refused.status_code, refused.json()) == (503, {"error": "SNAPSHOT_UNAVAILABLE"})
        assert list(data.iterdir()) == []
        data.rmdir()
        moved.rename(data)
        assert (await service.get("/v1/snapshots")).status_code == 200


def test_a_starting_runtime_removes_what_a_killed_build_left_store_87(
    store_objects: tuple[Attempt, list[HourlyObject]], tmp_path: Path
) -> None:
    """STORE-87: the temporary file of a snapshot build killed (SIGKILL) after writing it is
    removed when a runtime (``serve``, ``import``, ``seal``) opens the data directory, with no
    build since; one that a build in another process holds the lock for is kept, and that
    build succeeds."""
    data = DataDir(tmp_path)
    killed = build_process(data, plan={"snapshot.write": {"hits": [1], "do": "kill"}})
    _, err = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, err
    [left] = leftovers(data)
    assert (data.snapshot_dir / left).stat().st_size > 0

    async def start_and_stop() -> None:
        async with open_runtime(config(data.path)):
            pass

    trio.run(start_and_stop)
    assert leftovers(data) == []
    hold = {"snapshot.write": {"hits": [1], "do": "delay", "seconds": BUILD_HOLD_S}}
    other = build_process(data, plan=hold)
    deadline = time.monotonic() + 60
    while not leftovers(data):
        assert other.poll() is None, other.communicate()
        assert time.monotonic() < deadline, "the other build wrote no temporary file"
        time.sleep(0.01)
    trio.run(start_and_stop)
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0, err
    assert snapshot_files.find(data.snapshot_dir, store_objects[0].manifest.stream, int(out)), out
    assert leftovers(data) == []


def test_a_starting_runtime_removes_a_killed_key_making_s_temporary_file_store_92(
    tmp_path: Path,
) -> None:
    """STORE-92: a ``.signing-*`` file left by a process killed while making ``signing.key``
    (a private key, mode 0600, as the code writes it before linking it into place) is removed
    when a runtime opens the data directory; one whose maker holds its lock is kept."""
    data = DataDir(tmp_path)
    key = data.signing_key()

    def temporary_key() -> tuple[int, Path]:
        fd, name = tempfile.mkstemp(prefix=".signing-", dir=tmp_path)
        os.write(fd, b"-----BEGIN PRIVATE KEY-----\n")
        return fd, Path(name)

    fd, killed = temporary_key()
    os.close(fd)
    held, making = temporary_key()
    fcntl.flock(held, fcntl.LOCK_EX)

    async def start_and_stop() -> None:
        async with open_runtime(config(data.path)):
            pass

    try:
        trio.run(start_and_stop)
        assert not killed.exists()
        assert making.exists()
    finally:
        os.close(held)
    trio.run(start_and_stop)
    assert sorted(p.name for p in tmp_path.glob(".signing-*")) == []
    assert data.signing_key().private_bytes_raw() == key.private_bytes_raw()
