"""Commands run by root on a data directory another account owns run as that account
(CLI-146 to CLI-150): root never opens a file by a name that account may replace."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_bodies import body, metric, point, write
from _disk import python_for_all, python_in, reachable_home

LIMIT_S = 60.0
OWNER_UID = 65534
HR = "heart_rate"

# `python -c PLANTING DATA VICTIM UID ARGS...`: `healthlog ARGS` as root, where, the instant its
# scratch directory is ready (the fault point `rebuild.scratch`, CLI-128's), the data
# directory's owner account plants a link to VICTIM at the name of the scratch store, as that
# account would, racing the command. The link is planted by a child process that runs as
# that account, UID (it is so already when the command switched).
PLANTING = """
import os, sys
from pathlib import Path
from healthlog import faults
from healthlog.cli import main
from healthlog.storage import rebuild

data, victim, uid = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def plant(_name):
    (scratch,) = data.glob(rebuild.SCRATCH_PREFIX + "*")
    child = os.fork()
    if child == 0:
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.symlink(victim, scratch / rebuild.SCRATCH_STORE)
        finally:
            os._exit(0)
    os.waitpid(child, 0)

faults.install(faults.Plan(actions={"rebuild.scratch": faults.Action(frozenset({1}), plant)}))
sys.exit(main(sys.argv[4:]))
"""


def healthlog(*args: str | os.PathLike[str]) -> list[str]:
    """``healthlog ARGS`` under a Python the data directory's owner may run (CLI-146)."""
    return [python_for_all(), "-m", "healthlog.cli", *map(os.fspath, args)]


def run(command: list[str], cwd: Path, *, level: str = "info") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**env, "HEALTHLOG_LOG_LEVEL": level},
        cwd=cwd,
        timeout=LIMIT_S,
        check=False,
    )


def owners(data: Path) -> dict[str, tuple[int, int]]:
    """Each path under ``data`` and its owner and group."""
    return {
        path.relative_to(data).as_posix(): (path.lstat().st_uid, path.lstat().st_gid)
        for path in data.rglob("*")
    }


def switched_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "not as root" in line]


@pytest.fixture
def home() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("only root runs a command as another account")
    with reachable_home("healthlog-run-as-") as directory:
        yield directory


def service_directory(home: Path) -> Path:
    """A data directory holding a journal and a store, its every file ``nobody``'s."""
    data = home / "data"
    hr = write(
        home / "hr.json", body(metric(HR, "count/min", point("2024-02-06 07:00:00 -0800", qty=1.5)))
    )
    done = run(healthlog("import", "--aggregation", "minutes", "--data", data, hr), home)
    assert done.returncode == 0, done.stderr
    subprocess.run(["chown", "-R", f"{OWNER_UID}:{OWNER_UID}", data], check=True)
    return data


def _unnamed_uid() -> int:
    """A uid that no account of this machine has."""
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return next(n for n in range(40000, 50000) if n not in taken)


def _refused_untouched(
    done: subprocess.CompletedProcess[str], victim: Path, guarded: Path
) -> list[str]:
    """Assert that the command exited 3 with one line besides log records, and that the
    root-owned ``victim`` a link pointed at, alone in ``guarded``, kept its empty content and its
    owner; that line."""
    assert victim.read_bytes() == b""
    assert (victim.stat().st_uid, victim.stat().st_gid) == (0, 0)
    assert sorted(path.name for path in guarded.iterdir()) == ["victim"]
    assert done.returncode == 3, done.stderr
    said = [line for line in done.stderr.splitlines() if not line.startswith("time=")]
    assert len(said) == 1, done.stderr
    return said


def test_a_link_planted_in_a_root_run_reindex_s_scratch_is_not_written_through_cli_147(
    home: Path,
) -> None:
    """CLI-147: `reindex` run by root on a data directory another account owns, that account
    planting a link to a root-owned file in a directory only root may write, at the name of the
    scratch store (`rebuilt.sqlite`) the instant the scratch directory is ready (CLI-128's
    fault point `rebuild.scratch`): the linked file keeps its bytes and its owner, nothing is
    made beside it, the command (run as that account: CLI-146) exits 3 with one line, its
    scratch directory gone, and the next `reindex` succeeds, every file still that account's.
    (Before, CLI-128 kept the lock file's name, but root's SQLite opened the scratch store
    through the link: a 77,824-byte store was written into the root-owned file.)"""
    data = service_directory(home)
    guarded = home / "root-only"
    guarded.mkdir(mode=0o755)
    victim = guarded / "victim"
    victim.write_bytes(b"")
    victim.chmod(0o644)
    done = run(
        [python_for_all(), "-c", PLANTING, data, victim, str(OWNER_UID), "reindex", "--data", data],
        home,
    )
    said = _refused_untouched(done, victim, guarded)
    assert said[0].startswith("healthlog: "), done.stderr
    assert len(switched_lines(done.stderr)) == 1, done.stderr
    assert list(data.glob(".rebuild-*")) == []
    again = run(healthlog("reindex", "--data", data), home)
    assert again.returncode == 0, again.stderr
    assert {name: ids for name, ids in owners(data).items() if ids[0] != OWNER_UID} == {}


def test_a_command_run_by_root_runs_as_the_data_directory_s_owner_cli_146(home: Path) -> None:
    """CLI-146: `token add`, `import`, `status`, `export` and `verify` run by root on a data
    directory `nobody` owns each exit 0 and log one INFO line saying they run as that user (the
    directory named by its absolute path, given relative or not), and every file they make is
    `nobody`'s (its primary group's); on a directory root owns nothing is
    said; on one owned by a uid without an account here the command runs as that uid and the
    directory's group. (Before, each ran as root, opening every file there with root's rights,
    and gave what it made to the directory's owner.)"""
    data = service_directory(home)
    hr = write(
        home / "more.json",
        body(metric(HR, "count/min", point("2024-02-06 08:00:00 -0800", qty=2.5))),
    )
    for args in (
        ("token", "add", "phone"),
        ("import", "--aggregation", "minutes", hr),
        ("status",),
        ("export",),
        ("verify",),
    ):
        done = run(healthlog(*args, "--data", data), home)
        assert done.returncode == 0, (args, done.stderr)
        (said,) = switched_lines(done.stderr)
        assert "level=INFO logger=healthlog.cli" in said, said
        assert (
            f"running as user nobody (uid {OWNER_UID}, gid {OWNER_UID}), the owner of {data},"
            " not as root: what it makes there is that user's, and it opens nothing there with"
            " root's rights" in said
        ), said
    relative = run(healthlog("status", "--data", data.name), home)
    assert relative.returncode == 0, relative.stderr
    (said,) = switched_lines(relative.stderr)
    assert f"the owner of {data}, not as root" in said, said
    assert {"tokens.sqlite", "signing.key", "journal.sqlite", "store.sqlite"} <= set(owners(data))
    assert {name: ids for name, ids in owners(data).items() if ids != (OWNER_UID, OWNER_UID)} == {}

    own = home / "root-s"
    own.mkdir()
    done = run(healthlog("token", "add", "phone", "--data", own), home)
    assert done.returncode == 0, done.stderr
    assert switched_lines(done.stderr) == []
    assert owners(own)["tokens.sqlite"] == (0, 0)

    uid = _unnamed_uid()
    unnamed = home / "unnamed"
    unnamed.mkdir()
    os.chown(unnamed, uid, uid + 1)
    done = run(healthlog("token", "add", "phone", "--data", unnamed), home)
    assert done.returncode == 0, done.stderr
    assert len(switched_lines(done.stderr)) == 1, done.stderr
    assert f"running as user {uid} (uid {uid}, gid {uid + 1})" in done.stderr
    assert owners(unnamed)["tokens.sqlite"] == (uid, uid + 1)


def test_a_root_that_may_not_switch_stops_before_opening_anything_cli_148(home: Path) -> None:
    """CLI-148: `status`, `token add` and `import` run by root without the rights to change its
    user (CAP_SETUID and CAP_SETGID dropped, as in a container) on a data directory `nobody`
    owns exit 3 with one line saying whose the directory is, why, and what to do, and make and
    change nothing there; so does `status` run by root under a Python only root may run."""
    data = service_directory(home)
    before = owners(data)
    sizes = {path.name: path.stat().st_size for path in data.iterdir()}
    no_switch = "-setuid,-setgid"
    prefix = ["setpriv", f"--bounding-set={no_switch}", f"--inh-caps={no_switch}"]
    for args in (("status",), ("token", "add", "phone"), ("import", home / "hr.json")):
        done = run([*prefix, *healthlog(*args, "--data", data)], home)
        assert done.returncode == 3, (args, done.stderr)
        assert done.stderr.splitlines() == [
            f"healthlog: {data} is nobody's, and a command run by root on it runs as that user,"
            " which this process may not become (Operation not permitted); run it as nobody"
            f" (`sudo -u nobody healthlog ...`, or `setpriv --reuid={OWNER_UID}"
            f" --regid={OWNER_UID} --clear-groups healthlog ...`); nothing was opened"
        ], done.stderr
        assert done.stdout == ""
    assert owners(data) == before
    assert {path.name: path.stat().st_size for path in data.iterdir()} == sizes

    private = home / "root-only"
    private.mkdir(mode=0o700)
    python = python_in(private)
    done = run([python, "-m", "healthlog.cli", "status", "--data", data], home)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: {data} is nobody's, and a command run by root on it runs as that user, who"
        f" may not run {python} (Permission denied): install healthlog where every user may"
        " read it (the README's /opt/healthlog), its .venv made from a Python every user may run"
        " (`/usr/bin/python3 -m venv .venv`, then install), as the service's is; nothing was"
        " opened"
    ], done.stderr
    assert owners(data) == before


def test_a_venv_linking_to_a_python_under_root_says_how_to_make_it_cli_235(home: Path) -> None:
    """CLI-235: the README's install followed on a machine whose root `python3` is pyenv's
    under /root makes /opt/healthlog's `.venv` link to that interpreter; `status` run by root on
    the service's data directory then exits 3 naming the `.venv`'s Python, where its link leads,
    and the `/usr/bin/python3 -m venv` that makes one the service's user may run. (Before, the
    line named the `.venv`'s Python alone and said to "install healthlog where that user may run
    it", though healthlog lay in /opt, where every user may read.)"""
    data = service_directory(home)
    private = home / "root-only"
    private.mkdir(mode=0o700)
    interpreter = private / "python3"
    reachable = home / "opt"
    reachable.mkdir()
    python = Path(python_in(reachable))
    shutil.copy2(python.resolve(), interpreter)
    python.unlink()
    python.symlink_to(interpreter)
    before = owners(data)
    done = run([os.fspath(python), "-m", "healthlog.cli", "status", "--data", data], home)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: {data} is nobody's, and a command run by root on it runs as that user, who"
        f" may not run {python}, a link to {interpreter} (Permission denied): install healthlog"
        " where every user may read it (the README's /opt/healthlog), its .venv made from a"
        " Python every user may run (`/usr/bin/python3 -m venv .venv`, then install), as the"
        " service's is; nothing was opened"
    ], done.stderr
    assert done.stdout == ""
    assert owners(data) == before


def test_serve_run_by_root_serves_as_the_owner_cli_149(home: Path) -> None:
    """CLI-149: `serve` run by root on a data directory `nobody` owns serves as `nobody`
    (its process's user and groups, read from /proc), saying so in one INFO line, and stops
    cleanly; on a port below the first one every user may listen on it exits 3 with one line
    naming the port, why, and what to do, and opens nothing in the directory. (Before, it
    served as root, every file of the directory opened with root's rights.)"""
    data = service_directory(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "HEALTHLOG_LOG_LEVEL": "info"},
        cwd=home,
        text=True,
    ) as served:
        try:
            assert served.stdout is not None
            assert "healthlog serving on" in served.stdout.readline()
            status = Path(f"/proc/{served.pid}/status").read_text().splitlines()
        finally:
            served.send_signal(signal.SIGTERM)
            _, err = served.communicate(timeout=LIMIT_S)
    assert served.returncode == 0, err
    ids = {line.split(":")[0]: line.split(":")[1].split() for line in status if ":" in line}
    assert ids["Uid"] == [str(OWNER_UID)] * 4
    assert ids["Gid"] == [str(OWNER_UID)] * 4
    assert ids["Groups"] == []
    assert len(switched_lines(err)) == 1, err
    assert {name: uid for name, (uid, _) in owners(data).items() if uid != OWNER_UID} == {}

    first = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    assert first > 0, "every user may listen on every port here: nothing to refuse"
    before = sorted(path.name for path in data.iterdir())
    done = run(healthlog("serve", "--port", str(first - 1), "--data", data), home, level="warning")
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: [Errno 13] cannot listen on 127.0.0.1:{first - 1}: Permission denied; run by"
        f" root, serve runs as nobody, the owner of {data}, who may not listen on a port below"
        " 1024 (`sysctl net.ipv4.ip_unprivileged_port_start`): choose a port of 1024 or above"
        " (a reverse proxy in front of it for 443)"
    ], done.stderr
    assert sorted(path.name for path in data.iterdir()) == before


def test_import_run_by_root_of_a_file_only_root_may_read_says_why_cli_150(home: Path) -> None:
    """CLI-150: `import` run by root on a data directory `nobody` owns, of a file in a
    directory only root may enter, exits 2 with one line naming the file, the user it reads as
    and why, and what to do, journaling nothing; the file copied where `nobody` may read it is
    journaled. (Before, root read it: a link `nobody` planted at a name an administrator
    imports had root read any file of the machine into the journal, which `nobody` reads.)"""
    data = service_directory(home)
    private = home / "root-only"
    private.mkdir(mode=0o700)
    hr = write(
        private / "hr.json",
        body(metric(HR, "count/min", point("2024-02-06 09:00:00 -0800", qty=3.5))),
    )
    done = run(healthlog("import", "--data", data, hr), home, level="warning")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: cannot read {hr}: Permission denied (read as nobody: run by root, import"
        " runs as the data directory's owner, and reads as that user, who could otherwise have"
        " root read for it any file it links there; make the file readable by that user, or"
        " copy it where that user may read it)"
    ]
    status = run(healthlog("status", "--json", "--data", data), home, level="warning")
    assert '"deliveries":1' in status.stdout.replace(" ", ""), status.stdout
    copy = home / "hr-copy.json"
    shutil.copy(hr, copy)
    copy.chmod(0o644)
    again = run(healthlog("import", "--data", data, copy), home, level="warning")
    assert again.returncode == 0, again.stderr


def test_follow_run_by_root_writes_through_no_link_in_the_owner_s_replica_cli_151(
    home: Path,
) -> None:
    """CLI-151: `follow` run by root on a replica directory another account owns, that account
    having planted at `replica.sqlite` a link to a root-owned empty file in a directory only
    root may write, runs as that account (CLI-146's INFO line, the replica directory named):
    the file keeps its bytes and its owner, nothing is made beside it, and it exits 3 with one
    line; the link removed, it follows to the head, the replica that account's, and `export
    --replica` run by root runs as that account too and exports the point. (Before, root's
    SQLite made a replica in the linked file: 16,384 bytes, and a `-wal` and `-shm` of root's
    beside it, before it even reached the service.)"""
    data = home / "served"
    hr = write(
        home / "hr.json",
        body(metric(HR, "count/min", point("2024-02-06 07:00:00 -0800", qty=1.5))),
    )
    assert (
        run(healthlog("import", "--aggregation", "minutes", "--data", data, hr), home).returncode
        == 0
    )
    added = run(healthlog("token", "add", "follower", "--data", data), home, level="warning")
    assert added.returncode == 0, added.stderr
    replica = home / "replica"
    replica.mkdir()
    os.chown(replica, OWNER_UID, OWNER_UID)
    guarded = home / "root-only"
    guarded.mkdir(mode=0o755)
    victim = guarded / "victim"
    victim.write_bytes(b"")
    victim.chmod(0o644)
    link = replica / "replica.sqlite"
    as_owner = ["setpriv", f"--reuid={OWNER_UID}", f"--regid={OWNER_UID}", "--clear-groups"]
    subprocess.run([*as_owner, "ln", "-s", victim, link], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=home,
        text=True,
    ) as served:
        try:
            assert served.stdout is not None
            line = served.stdout.readline()
            url = line.split()[3]
            assert url.startswith("http://127.0.0.1:"), line
            follow = healthlog("follow", "--url", url, "--replica", replica, "--until-caught-up")
            token = {"HEALTHLOG_TOKEN": added.stdout.strip()}
            refused = subprocess.run(
                follow,
                capture_output=True,
                text=True,
                env={**env, **token, "HEALTHLOG_LOG_LEVEL": "info"},
                cwd=home,
                timeout=LIMIT_S,
                check=False,
            )
            link.unlink()
            followed = subprocess.run(
                follow,
                capture_output=True,
                text=True,
                env={**env, **token},
                cwd=home,
                timeout=LIMIT_S,
                check=False,
            )
        finally:
            served.send_signal(signal.SIGTERM)
            served.communicate(timeout=LIMIT_S)
    _refused_untouched(refused, victim, guarded)
    (switched,) = switched_lines(refused.stderr)
    assert (
        f"running as user nobody (uid {OWNER_UID}, gid {OWNER_UID}), the owner of {replica},"
        in switched
    )
    assert followed.returncode == 0, followed.stderr
    assert {name: uid for name, (uid, _) in owners(replica).items() if uid != OWNER_UID} == {}
    exported = run(healthlog("export", "--replica", replica), home)
    assert exported.returncode == 0, exported.stderr
    assert len(switched_lines(exported.stderr)) == 1, exported.stderr
    assert '"metric":"heart_rate"' in exported.stdout, exported.stdout


def test_an_unnamed_owner_of_root_s_group_is_not_given_that_group_cli_158(home: Path) -> None:
    """CLI-158: `token add` run by root on a data directory owned by a uid without an account
    here and by group root (a `chown UID` that left the group) exits 3 with one line saying so
    and what to do, and makes nothing there; the same directory given a group of its own runs
    as that uid and group (CLI-146). (Before, the command ran as that uid with group root, so
    that a link the account planted there had it write any file group root may write.)"""
    uid = _unnamed_uid()
    data = home / "unnamed"
    data.mkdir()
    os.chown(data, uid, 0)
    done = run(healthlog("token", "add", "phone", "--data", data), home)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: {data} is uid {uid}'s, which has no account here, and group root's: a"
        f" command run by root on it runs as that uid, and would take group root with it; give"
        f" the directory a group of its own (`chgrp -R GROUP {data}`), or run it as that uid"
        f" (`setpriv --reuid={uid} --regid=GID --clear-groups healthlog ...`); nothing was"
        " opened"
    ], done.stderr
    assert done.stdout == ""
    assert list(data.iterdir()) == []
    os.chown(data, uid, uid)
    done = run(healthlog("token", "add", "phone", "--data", data), home)
    assert done.returncode == 0, done.stderr
    assert owners(data)["tokens.sqlite"] == (uid, uid)


def test_a_data_directory_not_made_yet_in_an_unnamed_owner_s_directory_names_that_one_cli_164(
    home: Path,
) -> None:
    """CLI-164: `token add` run by root on a data directory not made yet, in a directory of a uid
    without an account here and of group root, exits 3 with CLI-158's line naming the directory
    that is there, and the `chgrp` of that one alone (`chgrp GROUP PARENT`, not `-R`: it may hold
    other programs' files), and makes nothing; after that `chgrp`, it runs as that uid and makes
    the data directory. (Before, the line said the data directory not made yet was the uid's and
    told `chgrp -R GROUP DATA`, which fails: `No such file or directory`.)"""
    uid = _unnamed_uid()
    parent = home / "volumes"
    parent.mkdir()
    os.chown(parent, uid, 0)
    data = parent / "data"
    done = run(healthlog("token", "add", "phone", "--data", data), home)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"healthlog: {parent} is uid {uid}'s, which has no account here, and group root's: a"
        f" command run by root on {data} runs as that uid, and would take group root with it;"
        f" give that directory a group of its own (`chgrp GROUP {parent}`), or run it as that"
        f" uid (`setpriv --reuid={uid} --regid=GID --clear-groups healthlog ...`); nothing was"
        " opened"
    ], done.stderr
    assert list(parent.iterdir()) == []
    done = subprocess.run(["chgrp", str(uid), parent], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    done = run(healthlog("token", "add", "phone", "--data", data), home)
    assert done.returncode == 0, done.stderr
    assert owners(data)["tokens.sqlite"] == (uid, uid)


def test_root_s_environment_is_not_carried_to_the_owner_cli_159(home: Path) -> None:
    """CLI-159: `serve` run by root on a data directory `nobody` owns, with a variable of root's
    in its environment (`ROOT_SECRET`, as a root shell exports a cloud or database credential),
    serves as `nobody` with an environment holding healthlog's `HEALTHLOG_*` settings, the
    locale and `PATH`, and not that variable. (Before, the whole environment was carried into
    the process started anew as `nobody`, which that account may read in /proc/PID/environ.)"""
    data = service_directory(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    with subprocess.Popen(
        healthlog("serve", "--port", "0", "--data", data),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "HEALTHLOG_LOG_LEVEL": "info", "ROOT_SECRET": "s3cr3t", "LC_TIME": "C"},
        cwd=home,
        text=True,
    ) as served:
        try:
            assert served.stdout is not None
            assert "healthlog serving on" in served.stdout.readline()
            environ = Path(f"/proc/{served.pid}/environ").read_bytes().split(b"\0")
        finally:
            served.send_signal(signal.SIGTERM)
            _, err = served.communicate(timeout=LIMIT_S)
    assert served.returncode == 0, err
    assert len(switched_lines(err)) == 1, err
    names = {item.partition(b"=")[0].decode() for item in environ if item}
    assert "ROOT_SECRET" not in names, names
    assert {"HEALTHLOG_LOG_LEVEL", "LC_TIME", "PATH"} <= names, names


def test_verify_run_by_root_rebuilds_in_the_temporary_directory_it_was_given_cli_163(
    home: Path,
) -> None:
    """CLI-163: `verify` run by root with `TMPDIR` set, on a data directory `nobody` owns and may
    not write in (mode 0500, as a copy on read-only media), runs as `nobody` and rebuilds in a
    scratch directory in that `TMPDIR` (README: `TMPDIR`, else `/tmp`), exit 0; `TMP` and `TEMP`,
    which Python takes when `TMPDIR` is unset, are carried alike. (Before, CLI-159's environment
    filter dropped `TMPDIR`: it rebuilt in `/tmp`, which can lack the room for a second store.)"""
    data = service_directory(home)
    data.chmod(0o500)
    scratch = home / "big"
    scratch.mkdir()
    scratch.chmod(0o1777)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEALTHLOG_")}
    for variable in ("TMPDIR", "TMP", "TEMP"):
        done = subprocess.run(
            healthlog("verify", "--data", data),
            capture_output=True,
            text=True,
            env={
                **{k: v for k, v in env.items() if k not in ("TMPDIR", "TMP", "TEMP")},
                variable: os.fspath(scratch),
            },
            cwd=home,
            timeout=LIMIT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"rebuilding into a scratch directory in {scratch} instead" in done.stderr, (
            variable,
            done.stderr,
        )


def test_a_data_directory_not_made_yet_is_made_by_its_parent_s_owner_cli_160(home: Path) -> None:
    """CLI-160: `token add` run by root on a data directory not made yet, in a directory `nobody`
    owns, runs as `nobody` (CLI-146's INFO line, naming the new directory) and makes the
    directory and its files as `nobody`'s; where the nearest directory that is there is root's
    (`home` here), it runs as root, as before. (Before, root made it: `nobody`, who may write in
    the parent, could make it first, racing the command, and plant there the links CLI-146
    keeps root from opening.)"""
    parent = home / "service"
    parent.mkdir()
    os.chown(parent, OWNER_UID, OWNER_UID)
    data = parent / "data"
    done = run(healthlog("token", "add", "phone", "--data", data), home)
    assert done.returncode == 0, done.stderr
    (said,) = switched_lines(done.stderr)
    assert f"running as user nobody (uid {OWNER_UID}, gid {OWNER_UID}), the owner of {data}" in said
    assert (data.stat().st_uid, data.stat().st_gid) == (OWNER_UID, OWNER_UID)
    assert owners(data)["tokens.sqlite"] == (OWNER_UID, OWNER_UID)

    own = home / "made" / "data"
    done = run(healthlog("token", "add", "phone", "--data", own), home)
    assert done.returncode == 0, done.stderr
    assert switched_lines(done.stderr) == []
    assert owners(own)["tokens.sqlite"] == (0, 0)


def test_import_run_by_root_reads_a_process_substitution_cli_161(home: Path) -> None:
    """CLI-161: `import <(cat FILE)` run by root's shell on a data directory `nobody` owns (the
    pipe is root's, mode 0600, and `/dev/fd/N` names it) exits 0 and journals the body, read
    through the descriptor the command was given; `import /dev/stdin` alike. (Before, CLI-130's
    process substitution was refused there, exit 2, `cannot read /dev/fd/63: Permission denied
    (read as nobody: ...)`: the command, run as `nobody`, opened the name anew.)"""
    data = service_directory(home)
    hr = write(
        home / "late.json",
        body(metric(HR, "count/min", point("2024-02-06 09:00:00 -0800", qty=3.5))),
    )
    command = " ".join(healthlog("import", "--aggregation", "minutes", "--data", data))
    done = run(["bash", "-c", f"{command} <(cat {hr})"], home)
    assert done.returncode == 0, done.stderr
    assert "journaled /dev/fd/" in done.stderr, done.stderr
    done = run(["bash", "-c", f"cat {hr} | {command} /dev/stdin"], home)
    assert done.returncode == 0, done.stderr
    assert "journaled /dev/stdin" in done.stderr, done.stderr


def test_a_file_root_copied_into_the_owner_s_directory_is_mended_by_the_chown_it_names_cli_166(
    home: Path,
) -> None:
    """CLI-166: a data directory `nobody` owns where root copied the journal and the tokens in
    (a restore by `cp -a`, the files root's, mode 0600): `reindex` and `token add` run by root,
    and `status` run as `nobody`, each exit 3 with one line naming the file, root's, and the
    `chown` that mends it, and never tell to run the command as root (`sudo -u root`), which
    runs it as the directory's owner again (CLI-146) and meets the same file; once that `chown`
    is run, `reindex` exits 0. (Before, the line told `sudo -u root healthlog ...` too.)"""
    data = service_directory(home)
    added = run(healthlog("token", "add", "phone", "--data", data), home)
    assert added.returncode == 0, added.stderr
    for name in ("journal.sqlite", "tokens.sqlite"):
        os.chown(data / name, 0, 0)
    for command in (
        healthlog("reindex", "--data", data),
        healthlog("token", "add", "tablet", "--data", data),
        [
            "setpriv",
            f"--reuid={OWNER_UID}",
            f"--regid={OWNER_UID}",
            "--clear-groups",
            *healthlog("status", "--data", data),
        ],
    ):
        done = run(command, home)
        assert done.returncode == 3, (command, done.stderr)
        said = [line for line in done.stderr.splitlines() if not line.startswith("time=")]
        assert len(said) == 1, done.stderr
        assert "(it is root's, mode 0600)" in said[0], said
        assert f"`chown -R nobody: {data} && chmod -R u+rwX {data}`" in said[0], said
        assert "sudo -u root" not in said[0], said
    subprocess.run(["chown", "-R", f"{OWNER_UID}:{OWNER_UID}", data], check=True)
    mended = run(healthlog("reindex", "--data", data), home)
    assert mended.returncode == 0, mended.stderr


def test_a_data_directory_its_user_may_not_make_is_said_with_the_install_that_makes_it_store_116(
    home: Path,
) -> None:
    """STORE-116: `token add` run as `nobody` with `--data` a new directory in one root owns
    (`/srv/healthlog` where the service's account was made without `--create-home`) exits 3
    with one line after the `making a new one` line: the directory, that `nobody` may not make
    files in the one above it, whose it is and its mode, and the `install -d` that makes it
    `nobody`'s, which run, the same `token add` exits 0. (Before, the line was Python's
    `[Errno 13] Permission denied: 'DIR'`, saying nothing of what to do.)"""
    parent = home / "srv"
    parent.mkdir(mode=0o755)
    data = parent / "healthlog"
    as_nobody = ["setpriv", f"--reuid={OWNER_UID}", f"--regid={OWNER_UID}", "--clear-groups"]
    done = run([*as_nobody, *healthlog("token", "add", "phone", "--data", data)], home)
    assert done.returncode == 3, done.stderr
    group = grp.getgrgid(pwd.getpwuid(OWNER_UID).pw_gid).gr_name
    assert done.stderr.splitlines() == [
        f"healthlog: no data directory at {data}: making a new one",
        f"healthlog: {data} cannot be made: user nobody may not make files in {parent} (it is"
        f" root's, mode 0755); make it for nobody as root: `sudo install -d -o nobody -g {group}"
        f" -m 700 {data}`",
    ], done.stderr
    assert not data.exists()
    subprocess.run(["install", "-d", "-o", "nobody", "-g", group, "-m", "700", data], check=True)
    again = run([*as_nobody, *healthlog("token", "add", "phone", "--data", data)], home)
    assert again.returncode == 0, again.stderr
