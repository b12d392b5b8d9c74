"""Found by the fifteenth review: process records (``handoffs/.meta/procs/<id>.json``) were trusted
as read.

* A planted record naming an unrelated process group (its leader's pid and start time, which
  anyone reads from /proc) had the daemon SIGKILL that group when a handoff of that id ran
  (``killed 1 process(es) left over by attempt 0``); naming the daemon's own group killed the
  daemon and its supervisor. A record now holds only a digest of the run token, bound to the
  handoff id and attempt; a process is the attempt's only if its environment carries a token
  with that digest, a group only if one of its members is, and never the daemon's own group.
* A record whose fields had the wrong types (``"attempt": "zero"``) made every sweep's recovery
  of that handoff fail with a TypeError: the claim stayed in in-progress/ for good. A record's
  fields are now checked (types and bounds); a malformed one is ignored with one line.

Every test starts its own victim processes and kills only those, by pid."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, alive, exe, new_workspace, wait_until

from handoffd.core import procrecords, procs
from handoffd.core.documents import hostname

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")

OK = [sys.executable, "-c", "import sys; sys.stdin.read(); print('{\"status\": \"completed\"}')"]
# attempt 1 sleeps (its daemon is killed meanwhile), a later attempt answers at once
SLOW_ONCE = [sys.executable, "-c",
             "import os, sys, time; sys.stdin.read(); "
             "time.sleep(60 if os.environ['HANDOFF_ATTEMPT'] == '1' else 0); "
             "print('{\"status\": \"completed\"}')"]
CONFIG = f"""
[daemon]
settle_seconds = 0.1
claim_grace_seconds = 1.0
sweep_seconds = 0.5
rescan_seconds = 0.5
lease_seconds = 3.0

[retry]
max_retries = 2
retry_delay_seconds = 0.1
backoff_multiplier = 1.0

[specialists."@ok"]
command = {json.dumps(OK)}

[specialists."@slow-once"]
command = {json.dumps(SLOW_ONCE)}
timeout_seconds = 120
"""


@pytest.fixture
def rws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


class Victims:
    """Processes the test starts (each leading a session and group of its own); whatever is
    still alive at teardown is killed, by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, token: str | None = None, *, argv: list[str] | None = None) -> int:
        env = dict(os.environ)
        env.pop(procs.TOKEN_ENV, None)
        if token is not None:
            env[procs.TOKEN_ENV] = token
        proc = subprocess.Popen(argv or [sys.executable, "-c", "import time; time.sleep(120)"],
                                env=env, start_new_session=True)
        self.procs.append(proc)
        wait_until(lambda: procs.start_time(proc.pid) is not None, timeout=10, what="started")
        return proc.pid

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def victims() -> Iterator[Victims]:
    found = Victims()
    yield found
    found.cleanup()


def folder(root: Path) -> Path:
    path = root / "handoffs" / ".meta" / "procs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def plant(root: Path, handoff_id: str, **fields: Any) -> None:
    """A record as the review planted it: the local host, boot and namespace, attempt 0."""
    data = {"handoff_id": handoff_id, "token": "feed", "attempt": 0, "host": hostname(),
            "boot_id": procrecords.boot_id(), "pid_namespace": procrecords.pid_namespace(),
            "daemon_pid": 1, "pgid": None, "leader_start": None, "started_at": 0}
    data.update(fields)
    (folder(root) / f"{handoff_id}.json").write_text(json.dumps(data))


def run_one(ws: Workspace, handoff_id: str) -> subprocess.CompletedProcess[str]:
    ws.create("--from", "@a", "--to", "@ok", "--id", handoff_id, "--data", "{}")
    proc = ws.handoffd("run", "-v", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ws.state_of(handoff_id) == ["completed"], proc.stderr
    assert "Traceback" not in proc.stderr and "left over" not in proc.stderr, proc.stderr
    return proc


# ---------------------------------------------------------------- 1. forged records kill nothing

def test_the_reviews_planted_record_kills_no_unrelated_group(rws: Workspace,
                                                             victims: Victims) -> None:
    """The reproduction: the victim's pid and start time as pgid and leader_start."""
    victim = victims.start()
    plant(rws.root, "victim", pgid=victim, leader_start=procs.start_time(victim))
    run_one(rws, "victim")
    assert alive(victim), "a planted record had an unrelated process group killed"


def test_a_record_in_handoffds_own_format_naming_another_group_kills_nothing(
        rws: Workspace, victims: Victims) -> None:
    """Written through write_record itself (so well-formed), for a token the victim does not
    carry: the leader's pid and start time no longer vouch for the group."""
    victim = victims.start()
    record = procrecords.RunRecord.new("victim", "feed", 0)
    record.pgid, record.leader_start = victim, procs.start_time(victim)
    procrecords.write_record(rws.root, record)
    assert procrecords.read_record(rws.root, "victim") is not None  # a well-formed record
    run_one(rws, "victim")
    assert alive(victim)
    assert procrecords.read_record(rws.root, "victim") is None  # (its attempt over: the record goes)


def test_a_running_attempts_record_copied_under_another_id_reaches_nothing(
        rws: Workspace, victims: Victims) -> None:
    """A record is readable (mode 0644): copied under another id, it once led the daemon to the
    running attempt's processes. It holds no token, and its digest is bound to its id."""
    token = procs.new_token()
    running = victims.start(token)  # an attempt of "other", running
    record = procrecords.RunRecord.new("other", token, 1)
    record.pgid, record.leader_start = running, procs.start_time(running)
    procrecords.write_record(rws.root, record)
    text = (folder(rws.root) / "other.json").read_text()
    assert token not in text  # the token itself is never written to the workspace
    data = json.loads(text)
    data["handoff_id"], data["attempt"] = "thief", 0
    (folder(rws.root) / "thief.json").write_text(json.dumps(data))
    run_one(rws, "thief")
    assert alive(running), "a copied record had another handoff's running attempt killed"
    # the genuine record still finds the attempt's processes (a recovery of "other")
    assert procs.kill_leftovers(rws.root, "other", attempt=1, wait_seconds=10) >= 1
    wait_until(lambda: not alive(running), timeout=10, what="the genuine leftover is killed")


HELPER = r"""
import os, subprocess, sys, time
sys.path[:0] = sys.argv[2:]
from handoffd.core import procrecords, procs
sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # our group
print(sibling.pid, flush=True)
try:
    procs.kill_run("no-such-token", os.getpgrp(), group_known=True, wait_seconds=1)
    time.sleep(0.2)
    print("alive" if sibling.poll() is None else "sibling killed", flush=True)
finally:
    sibling.kill()
    sibling.wait()
"""


def test_kill_run_never_kills_its_own_process_group() -> None:
    """Even told the group is an attempt's, the daemon's own group (its supervisor's, often) is
    never killed. Run in a helper that leads a session of its own: if it were, only the
    helper and its sibling would die."""
    paths = [p for p in sys.path if p]
    helper = subprocess.Popen([sys.executable, "-c", HELPER, "x", *paths], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = helper.communicate(timeout=60)
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait(timeout=10)
    lines = out.split()
    for pid in lines[:1]:  # the sibling, if the helper died before killing it
        if alive(int(pid)):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert helper.returncode == 0 and lines[1:] == ["alive"], (helper.returncode, out, err)


WRAPPER = r"""
import os, subprocess, sys, time
go = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(subprocess.run(sys.argv[2:], timeout=120).returncode)
"""


def test_a_record_naming_the_daemons_own_group_kills_nothing(rws: Workspace) -> None:
    """The daemon runs under a supervisor that leads their process group (here a wrapper in a
    session of its own, so that nothing else could die): a record naming that group, with the
    supervisor's pid and start time, once had the daemon kill its supervisor and itself."""
    go = rws.root.parent / "go"
    argv = [exe("handoffd"), "run", "-v", "--root", str(rws.root)]
    supervisor = subprocess.Popen([sys.executable, "-c", WRAPPER, str(go), *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        wait_until(lambda: procs.start_time(supervisor.pid) is not None, timeout=10,
                   what="started")
        plant(rws.root, "self", pgid=supervisor.pid,
              leader_start=procs.start_time(supervisor.pid))
        rws.create("--from", "@a", "--to", "@ok", "--id", "self", "--data", "{}")
        go.write_text("")
        _, err = supervisor.communicate(timeout=150)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)  # its group: the wrapper and its daemon
            supervisor.wait(timeout=10)
    assert supervisor.returncode == 0, (supervisor.returncode, err)
    assert rws.state_of("self") == ["completed"], err


# ---------------------------------------------------------------- legitimate leftovers

def test_a_genuine_leftover_group_is_still_killed_with_its_unmarked_members(
        tmp_path: Path, victims: Victims) -> None:
    """What a record is for: the attempt's group (its leader carries the token) is killed, with
    a member that dropped its environment but stayed in the group; so is a token carrier in a
    session of its own (a grandchild that called setsid)."""
    token = procs.new_token()
    code = ("import os, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env={}); "
            "print(c.pid, flush=True); time.sleep(120)")
    env = dict(os.environ, **{procs.TOKEN_ENV: token})
    leader = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    victims.procs.append(leader)  # type: ignore[arg-type]
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    setsid = victims.start(token)
    try:
        record = procrecords.RunRecord.new("h1", token, 1)
        record.pgid, record.leader_start = leader.pid, procs.start_time(leader.pid)
        procrecords.write_record(tmp_path, record)
        assert procs.kill_leftovers(tmp_path, "h1", attempt=2, wait_seconds=10) >= 3
        leader.wait(timeout=10)
        wait_until(lambda: not alive(member) and not alive(setsid), timeout=10,
                   what="the group's unmarked member and the setsid carrier are killed")
        assert procrecords.read_record(tmp_path, "h1") is None
    finally:
        if alive(member):
            os.kill(member, signal.SIGKILL)


# ---------------------------------------------------------------- 2. malformed records

GOOD: dict[str, Any] = {"attempt": 0, "pgid": None, "leader_start": None, "daemon_pid": 1, "started_at": 0}
BAD: dict[str, dict[str, Any]] = {
    "attempt is a string": {"attempt": "zero"},
    "attempt is a bool": {"attempt": True},
    "attempt is a float": {"attempt": 1.5},
    "attempt negative": {"attempt": -1},
    "attempt huge": {"attempt": 10 ** 30},
    "pgid is a string": {"pgid": "123"},
    "pgid zero (killpg(0): our own group)": {"pgid": 0},
    "pgid one": {"pgid": 1},
    "pgid negative": {"pgid": -5},
    "pgid beyond any pid": {"pgid": 1 << 40},
    "leader_start a list": {"leader_start": [1]},
    "daemon_pid a string": {"daemon_pid": "1"},
    "daemon_pid zero": {"daemon_pid": 0},
    "started_at a string": {"started_at": "now"},
    "host an int": {"host": 5},
    "boot_id null": {"boot_id": None},
    "another handoff's id": {"handoff_id": "someone-else"},
    "an unknown field": {"extra": 1},
}


def write_raw(root: Path, handoff_id: str, data: Any) -> None:
    (folder(root) / f"{handoff_id}.json").write_text(json.dumps(data))


def genuine(root: Path, handoff_id: str) -> dict[str, Any]:
    """What write_record writes for ``handoff_id`` (attempt 0, no process), as a dict."""
    procrecords.write_record(root, procrecords.RunRecord.new(handoff_id, procs.new_token(), 0))
    return dict(json.loads((folder(root) / f"{handoff_id}.json").read_text()))


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_record_is_ignored_with_one_line(tmp_path: Path, case: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    for shape in ("current", "planted"):
        hid = f"m{list(BAD).index(case)}-{shape}"  # (each id's refusal is said once a process)
        caplog.clear()
        if shape == "current":
            data = {**genuine(tmp_path, hid), **BAD[case]}
        else:  # as the review planted it
            data = {"handoff_id": hid, "token": "feed", "host": hostname(),
                    "boot_id": procrecords.boot_id(), "pid_namespace": procrecords.pid_namespace(),
                    **GOOD, **BAD[case]}
        write_raw(tmp_path, hid, data)
        with caplog.at_level(logging.WARNING, logger="handoffd"):
            assert procrecords.read_record(tmp_path, hid) is None, shape
            assert procrecords.read_record(tmp_path, hid) is None  # said once, not at every read
            assert procs.kill_leftovers(tmp_path, hid, attempt=1) == 0
            procs.prune_records(tmp_path)
        lines = [r.getMessage() for r in caplog.records if f"{hid}.json" in r.getMessage()]
        assert len(lines) == 1 and "not a process record" in lines[0], (shape, lines)


@pytest.mark.parametrize("raw", [b"[]", b"null", b"\xff\xfe", b"{\"handoff_id\": \"m2\"", b""])
def test_a_record_that_is_no_json_object_is_ignored(tmp_path: Path, raw: bytes) -> None:
    (folder(tmp_path) / "m2.json").write_bytes(raw)
    assert procrecords.read_record(tmp_path, "m2") is None
    assert procs.kill_leftovers(tmp_path, "m2", attempt=1) == 0


def test_a_malformed_record_does_not_strand_a_recovered_claim(rws: Workspace) -> None:
    """The review's second reproduction, on the sweep's side: attempt 1 runs, its daemon is
    killed with kill -9, its record is replaced by one whose attempt is "zero". Every sweep's
    recovery of the claim failed with a TypeError and the handoff stayed in in-progress/."""
    first = rws.serve()
    rws.create("--from", "@a", "--to", "@slow-once", "--id", "t1", "--data", "{}")
    wait_until(lambda: procrecords.read_record(rws.root, "t1") is not None
               and procrecords.read_record(rws.root, "t1").pgid is not None,  # type: ignore[union-attr]
               timeout=30, what="attempt 1 started")
    record = procrecords.read_record(rws.root, "t1")
    assert record is not None and record.pgid is not None
    child = record.pgid
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    wait_until(lambda: not alive(child), timeout=10, what="the child dies with its daemon")
    plant(rws.root, "t1", attempt="zero")
    second = rws.serve()
    try:
        assert rws.wait_state("t1", timeout=60) == "completed"
    finally:
        rws.stop(second)
    assert second.stderr is not None
    err = second.stderr.read()
    assert "Traceback" not in err and "TypeError" not in err, err


def test_any_failure_of_the_sweeps_leftover_kill_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever kill_leftovers raises, the recovery of the claim goes on (one line)."""
    from handoffd.service import sweeper

    def broken(*args: Any, **kwargs: Any) -> int:
        raise TypeError("'>' not supported between instances of 'str' and 'int'")
    monkeypatch.setattr(sweeper.procs, "kill_leftovers", broken)

    class Engine:
        ws = tmp_path
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        sweeper._kill_leftovers(Engine(), "k1", 2)  # type: ignore[arg-type]
    lines = [r for r in caplog.records if "leftover" in r.getMessage()]
    assert len(lines) == 1 and "TypeError" in lines[0].getMessage() and not lines[0].exc_info


def test_a_wellformed_record_still_reads_back(tmp_path: Path) -> None:
    token = procs.new_token()
    record = procrecords.RunRecord.new("w1", token, 3)
    record.pgid, record.leader_start = 4242, 17
    procrecords.write_record(tmp_path, record)
    back = procrecords.read_record(tmp_path, "w1")
    assert back is not None and (back.attempt, back.pgid, back.leader_start) == (3, 4242, 17)
    assert back.local() and back.token != token
    assert isinstance(back.token, procrecords.SealedToken) and back.token.matches(token)
    assert not back.token.matches(procs.new_token())
    procrecords.remove_record(tmp_path, "w1", procs.new_token())  # another attempt's token: kept
    assert procrecords.read_record(tmp_path, "w1") is not None
    procrecords.remove_record(tmp_path, "w1", token)
    assert procrecords.read_record(tmp_path, "w1") is None
