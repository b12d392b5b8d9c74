"""Review 15, execution layer: what a command's start, death and output cost and say.

* A hi_moe ``specialist_hint`` nobody serves falls back to its tier's specialist; the hint (any
  string of the document's: a NUL, 200 kB) once became ``$HANDOFF_TARGET`` and the attempt could
  not start (a ValueError traceback and a claim stranded until recovery; "Argument list too
  long; check command in handoffd.toml", blaming a correct config). ``$HANDOFF_TARGET`` is now
  the agent the handler runs as, and a start the system refuses is one line naming the cause.
* An unexpected error that strands a claim is counted: ``handoffd run`` exits non-zero.
* A command killed by a signal "died (signal 11, SIGSEGV)", as an isolated Python handler does.
* A handler writing its stdout a byte at a time costs about its size in daemon memory, not ~40x.
* A malformed process record left by an earlier attempt is one logged line, never a stranded
  claim.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Workspace, handlers_workspace, new_workspace
from dialect_examples import HI_MOE_DISPATCHER_TO_FLEET, fresh

from handoffd.core import childproc, procrecords
from handoffd.core.childproc import Collector, clear_previous_attempt
from handoffd.core.config import Config, specialist_from_table
from handoffd.core.errors import HandlerError
from handoffd.core.runner import _parse_output, run_command
from handoffd.core.specialists import HandlerContext, Specialist

PY = sys.executable

# prints one result; notes the $HANDOFF_TARGET it saw in artifacts/target-<id>
NOTE_TARGET = """
import json, os, sys
sys.stdin.read()
root, hid = os.environ["HANDOFFD_ROOT"], os.environ["HANDOFF_ID"]
with open(os.path.join(root, "artifacts", "target-" + hid), "w") as f:
    f.write(os.environ.get("HANDOFF_TARGET", "<unset>"))
print(json.dumps({"status": "completed", "output": {"ok": 1}}))
"""


def config(spec: Path, extra: str = "") -> str:
    return f"""
[daemon]
durability = "fast"
settle_seconds = 0.05
sweep_seconds = 0.5
rescan_seconds = 0.5
lease_seconds = 30.0

[retry]
max_retries = 0
retry_delay_seconds = 0.1

[specialists."SPECIALIZED_FLEET"]
command = ["{PY}", "-S", "{spec}"]
timeout_seconds = 30

[specialists."@ok"]
command = ["{PY}", "-S", "{spec}"]
timeout_seconds = 30
{extra}
"""


@pytest.fixture
def xws(tmp_path: Path) -> Iterator[Workspace]:
    spec = tmp_path / "note_target.py"
    spec.write_text(NOTE_TARGET)
    ws = new_workspace(tmp_path / "ws", config(spec, f"""
[specialists."@big"]
command = ["{PY}", "-S", "{spec}"]
env = {{ BIG = "{'x' * 200_000}" }}

[specialists."@seg"]
command = ["{PY}", "-S", "-c", "import os, sys; sys.stdin.read(); sys.stderr.write('boom'); sys.stderr.flush(); os.kill(os.getpid(), 11)"]
"""))
    (ws.root / "artifacts").mkdir(exist_ok=True)
    yield ws
    ws.cleanup()


def hi_moe(msg_id: str, hint: str) -> dict[str, Any]:
    doc = fresh(HI_MOE_DISPATCHER_TO_FLEET)
    doc["id"], doc["target_tier"] = msg_id, "SPECIALIZED_FLEET"
    doc["payload"]["specialist_hint"] = hint
    doc["payload"]["timeout_ms"] = 30000
    return doc


def error_of(ws: Workspace, hid: str) -> dict[str, Any]:
    doc = json.loads((ws.root / "handoffs" / "failed" / f"{hid}.json").read_text())
    return doc["error"]


# ---------------------------------------------------------------- 3: the hint never reaches env

def test_a_hint_nobody_serves_runs_on_its_tier_with_the_agent_as_target(xws: Workspace) -> None:
    """A NUL in the hint was a ValueError out of Popen (a traceback, exit 0, the claim left in
    in-progress/ for recovery); a 200,000-character one was E2BIG blamed on handoffd.toml.
    Both run on the tier's specialist, which sees itself as $HANDOFF_TARGET."""
    for hid, hint in (("msg-nul", "python\u0000lora"), ("msg-long", "h" * 200_000)):
        path = xws.root / f"{hid}.json"
        path.write_text(json.dumps(hi_moe(hid, hint)))
        made = xws.handoff("create", "--file", str(path))
        assert made.returncode == 0, made.stderr
    xws.create("--to", "@ok", "--id", "n-ok")
    proc = xws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "unexpected error" not in proc.stderr
    for hid in ("msg-nul", "msg-long"):
        assert xws.state_of(hid) == ["completed"], (hid, xws.state_of(hid), proc.stderr)
        assert xws.doc(hid)["payload"]["status"] == "success"
        assert (xws.root / "artifacts" / f"target-{hid}").read_text() == "SPECIALIZED_FLEET"
    # a target that is the specialist's own agent is what it always was
    assert (xws.root / "artifacts" / "target-n-ok").read_text() == "@ok"


def test_an_environment_too_large_names_the_variable(xws: Workspace) -> None:
    """E2BIG said "Argument list too long; check command in handoffd.toml": the command was
    fine. The line now says what is too large and which variable is the largest."""
    xws.create("--to", "@big", "--id", "h-big")
    proc = xws.handoffd("run", timeout=120)
    assert "Traceback" not in proc.stderr
    error = error_of(xws, "h-big")
    assert error["code"] == "PROCESSING_ERROR" and error["retryable"] is False
    message = error["message"]
    assert "E2BIG" in message and "$BIG" in message and "check command" not in message, message
    assert "\n" not in message


def test_an_unpassable_environment_value_is_a_handler_error(tmp_path: Path) -> None:
    """What Popen refuses with ValueError (a NUL byte in a value an engine hook passes) is a
    non-retryable HandlerError naming the variable, and the attempt's process record is gone;
    it once escaped run_command, Engine.run and the worker as an unexpected error."""
    spec = Specialist(specialist_from_table("@c", {"command": [PY, "-c", "print(1)"]},
                                            Config().retry))
    ctx = HandlerContext(handoff_id="v1", attempt=1, root=tmp_path, data=None, target="@c",
                         max_output_bytes=1 << 20)
    ctx.env["HANDOFF_EXTRA"] = "a\0b"
    with pytest.raises(HandlerError) as caught:
        run_command(spec, {}, ctx, 10, max_output_bytes=1 << 20)
    assert caught.value.retryable is False
    assert "$HANDOFF_EXTRA" in str(caught.value) and "NUL" in str(caught.value)
    assert caught.value.details.get("cannot_start") == "UNPASSABLE"
    assert procrecords.read_record(tmp_path, "v1") is None


# ---------------------------------------------------------------- 4: a stranded claim is counted

STRAND = '''
import handoffd.core.engine as engine

def strand(doc, ctx):
    """Its attempt ends in an error no step expects (stands in for a bug past the handler)."""
    def boom(*args, **kwargs):
        raise RuntimeError("a bug past the handler")
    engine.conclude = boom
    return {"status": "completed", "output": {}}
'''


def test_a_claim_an_unexpected_error_strands_makes_run_exit_non_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`handoffd run` said "completed 0, failed 0" and exited 0 while it left the claim in
    in-progress/ (for recovery): the error is now counted in the summary and the exit code."""
    ws = handlers_workspace(tmp_path, monkeypatch, "strandmod", STRAND, """
[daemon]
durability = "fast"
settle_seconds = 0.05
lease_seconds = 30.0

[specialists."@strand"]
handler = "strandmod:strand"
""")
    try:
        ws.create("--to", "@strand", "--id", "s1")
        proc = ws.handoffd("run", timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "1 error(s)" in proc.stderr, proc.stderr
        assert ws.state_of("s1") == ["in-progress"]  # recovery's, after the lease
    finally:
        ws.cleanup()


# ---------------------------------------------------------------- 6: death by a signal

def test_a_command_killed_by_a_signal_is_said_so(xws: Workspace) -> None:
    xws.create("--to", "@seg", "--id", "h-seg")
    proc = xws.handoffd("run", timeout=120)
    assert "Traceback" not in proc.stderr
    message = error_of(xws, "h-seg")["message"]
    assert "died (signal 11, SIGSEGV)" in message and "boom" in message, message
    assert "status -11" not in message


def test_the_signal_is_in_the_details() -> None:
    with pytest.raises(HandlerError) as caught:
        _parse_output(-int(signal.SIGKILL), b"", b"", "d1")
    assert "died (signal 9, SIGKILL)" in str(caught.value)
    assert caught.value.details.get("signal") == 9 and "exit_code" not in caught.value.details
    with pytest.raises(HandlerError) as caught:
        _parse_output(3, b"", b"", "d2")
    assert "exited with status 3" in str(caught.value) and caught.value.details["exit_code"] == 3


# ---------------------------------------------------------------- 5: output memory

def _drip(collector: Collector, count: int) -> int:
    """Write ``count`` single bytes into the collector's pipe, each read on its own (so each is
    one read of the drainer); returns the write end's fd (closed)."""
    read_fd, write_fd = os.pipe()
    collector.pipe = os.fdopen(read_fd, "rb", buffering=0)
    collector.thread.start()
    deadline = time.monotonic() + 60
    for number in range(1, count + 1):
        os.write(write_fd, b"x")
        while collector.size < number and collector.thread.is_alive():
            if time.monotonic() > deadline:
                raise AssertionError(f"the collector read {collector.size} of {number} bytes")
            time.sleep(0.00001)
    os.close(write_fd)
    collector.thread.join(timeout=10)
    assert not collector.thread.is_alive()
    return write_fd


def test_output_written_a_byte_at_a_time_costs_its_size() -> None:
    """Each read was kept as a bytes object in a list: ~40 bytes of memory per byte written
    (16 MB written a byte at a time: 119 MB RSS), so max_output_bytes did not bound memory."""
    count = 20_000
    tracemalloc.start()
    try:
        collector = Collector(None, 1 << 20, keep_tail=False)
        before = tracemalloc.get_traced_memory()[0]
        _drip(collector, count)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert collector.data() == b"x" * count and not collector.overflow
    assert held < 8 * count, f"{held} bytes held for {count} bytes of output"


def test_the_output_caps_are_kept() -> None:
    """The head (stdout) stops past its limit and says so; the tail (stderr) keeps the last
    ``limit`` bytes."""
    for keep_tail in (False, True):
        read_fd, write_fd = os.pipe()
        collector = Collector(os.fdopen(read_fd, "rb", buffering=0), 4096, keep_tail=keep_tail)
        flagged = threading.Event()
        collector.on_overflow = flagged.set
        collector.thread.start()
        data = bytes(range(256)) * 64  # 16 KiB
        for start in range(0, len(data), 1000):
            try:
                os.write(write_fd, data[start:start + 1000])
            except BrokenPipeError:
                break
        os.close(write_fd)
        collector.thread.join(timeout=10)
        assert not collector.thread.is_alive()
        if keep_tail:
            assert collector.data() == data[-4096:] and not collector.overflow
        else:
            assert collector.overflow and flagged.is_set()
            kept = collector.data()
            assert 4096 < len(kept) <= 4096 + 65536 and data.startswith(kept)


# ---------------------------------------------------------------- a malformed leftover record

def test_a_malformed_process_record_does_not_strand_the_claim(xws: Workspace) -> None:
    """A record whose attempt is not a number made kill_leftovers raise TypeError, which only
    OSError was caught for: the claim was stranded until recovery. Now one line, and the
    attempt runs."""
    from handoffd.core.documents import hostname
    folder = xws.root / "handoffs" / ".meta" / "procs"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lr1.json").write_text(json.dumps({
        "handoff_id": "lr1", "token": "feed", "attempt": "one", "host": hostname(),
        "boot_id": procrecords.boot_id(), "pid_namespace": procrecords.pid_namespace(), "daemon_pid": 1,
        "pgid": None, "leader_start": None, "started_at": 0}))
    xws.create("--to", "@ok", "--id", "lr1")
    proc = xws.handoffd("run", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert xws.state_of("lr1") == ["completed"], proc.stderr
    assert "Traceback" not in proc.stderr


def test_any_failure_of_the_leftover_check_is_one_line(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> int:
        raise TypeError("'>' not supported between instances of 'str' and 'int'")
    monkeypatch.setattr(childproc.procs, "kill_leftovers", broken)
    ctx = HandlerContext(handoff_id="k1", attempt=2, root=tmp_path, data=None, target="@c")
    with caplog.at_level("WARNING", logger="handoffd"):
        clear_previous_attempt(ctx)  # no raise: the attempt may start
    lines = [r for r in caplog.records if "leftover" in r.getMessage()]
    assert len(lines) == 1 and "TypeError" in lines[0].getMessage() and not lines[0].exc_info
