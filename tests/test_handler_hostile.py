"""Python and command handlers that misbehave in ways no protocol check foresaw (found by the
handler hunt): each attempt ends with one recorded error, filed at once, never a traceback and a
claim stranded in in-progress/ until its lease ran out; what a handler does to the process
itself (a fork, the umask) is contained as it returns."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import exe

from handoffd import Registry, Workspace, build_engine
from handoffd.core.config import Config
from handoffd.core.engine import Engine
from handoffd.core.errors import HandlerError
from handoffd.core.native_format import new_native_request
from handoffd.core.states import State


def engine_with(tmp_path: Path, handler: Callable[..., Any]) -> Engine:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    config = Config()
    registry = Registry()
    registry.add_function("@py", handler, config=config)
    return build_engine(ws, config, registry)


def run_one(engine: Engine, data: Any = None) -> tuple[State, dict[str, Any]]:
    doc = new_native_request(source="@test", target="@py", data=data, now=engine.clock())
    doc["retry_policy"] = {"max_retries": 0}
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    job = engine.take(hid)
    assert job is not None
    state = engine.file(job.claim, job.dialect, job.specialist, engine.run(job))
    found = engine.backend.get(hid)
    assert found is not None and found[0] is state
    assert not list(engine.ws.state_dir(State.IN_PROGRESS).iterdir())  # nothing stranded
    return state, found[1]


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


class RaisingItems(dict):  # type: ignore[type-arg]
    def items(self) -> Any:
        raise RuntimeError("items() of the result")


class RaisingHash(str):
    def __hash__(self) -> int:
        raise RuntimeError("__hash__ of status")


def test_an_exception_that_cannot_be_shown_is_one_line(tmp_path: Path) -> None:
    def handler(handoff: dict, ctx: Any) -> dict:
        raise Unprintable()

    state, doc = run_one(engine_with(tmp_path, handler))
    assert state is State.FAILED and doc["error"]["code"] == "PROCESSING_ERROR"
    assert "Unprintable" in doc["error"]["message"] and "cannot be shown" in doc["error"]["message"]


def test_a_result_whose_dict_raises_fails_the_attempt(tmp_path: Path) -> None:
    state, doc = run_one(engine_with(tmp_path, lambda h, c: RaisingItems(status="completed")))
    assert state is State.FAILED and "cannot be filed as JSON" in doc["error"]["message"]


def test_a_status_of_a_str_subclass_is_read_as_plain_text(tmp_path: Path) -> None:
    state, doc = run_one(engine_with(tmp_path, lambda h, c: {"status": RaisingHash("completed")}))
    assert state is State.COMPLETED


def test_a_handler_error_with_a_bad_code_and_details_is_rebuilt(tmp_path: Path) -> None:
    def handler(handoff: dict, ctx: Any) -> dict:
        raise HandlerError("nope", code=["LIST"], details={"x": object()})  # type: ignore[arg-type]

    state, doc = run_one(engine_with(tmp_path, handler))
    assert state is State.FAILED and doc["error"]["code"] == "PROCESSING_ERROR"
    assert "details" not in doc["error"]


@pytest.mark.parametrize("result", [
    {"status": "completed", "artifacts": [{"path": "report\x00.txt"}]},
    {"status": "completed", "output": {"artifact_path": "a\x00b"}},
])
def test_an_artifact_path_with_a_nul_is_outside_the_workspace(tmp_path: Path,
                                                              result: dict) -> None:
    state, doc = run_one(engine_with(tmp_path, lambda h, c: result))
    assert state is State.FAILED and doc["error"]["code"] == "VALIDATION_FAILED"


def test_a_huge_throttle_delay_is_capped_not_an_overflow(tmp_path: Path) -> None:
    engine = engine_with(tmp_path, lambda h, c: {"status": "throttled",
                                                 "retry_after_seconds": int("9" * 401)})
    doc = new_native_request(source="@test", target="@py", data=None, now=engine.clock())
    hid = engine.backend.store.create(doc, doc["handoff_id"], now=engine.clock())
    job = engine.take(hid)
    assert job is not None
    assert engine.file(job.claim, job.dialect, job.specialist, engine.run(job)) is State.PENDING
    found = engine.backend.get(hid)
    assert found is not None
    (event,) = [e for e in found[1]["handoffd"]["history"] if e["event"] == "throttled"]
    assert event["detail"]["delay_seconds"] == 3600


def test_a_umask_a_handler_sets_is_put_back(tmp_path: Path) -> None:
    def handler(handoff: dict, ctx: Any) -> dict:
        if ctx.data == "mask":
            os.umask(0o777)
        return {"status": "completed"}

    engine = engine_with(tmp_path, handler)
    before = os.umask(0o022)
    os.umask(before)
    try:
        run_one(engine, "mask")
        assert os.umask(before) == before  # put back as the handler returned
        run_one(engine, "after")
    finally:
        os.umask(before)
    for path in engine.ws.state_dir(State.COMPLETED).iterdir():
        assert stat.S_IMODE(path.stat().st_mode) & 0o444 == 0o444 & ~before


def test_a_handler_that_forks_leaves_no_copy_of_the_batch(tmp_path: Path) -> None:
    """The forked copy returned into the daemon and lived for ever, holding the batch's output
    pipes: anything reading them to the end (cron, CI, subprocess.run) hung."""
    root = tmp_path / "ws"
    (root / "plug").mkdir(parents=True)
    (root / "plug" / "forky.py").write_text(
        "import os\n"
        "def work(handoff, ctx):\n"
        "    os.fork()\n"
        "    return {'status': 'completed'}\n")
    (root / "handoffd.toml").write_text('[specialists."@f"]\nhandler = "forky:work"\n')
    env = dict(os.environ, PYTHONPATH=str(root / "plug"))
    env.pop("HANDOFFD_ROOT", None)
    subprocess.run([exe("handoff"), "create", "--root", str(root), "--to", "@f", "--id", "f1",
                    "--data", "{}"], check=True, capture_output=True, env=env, timeout=30)
    # capture_output reads both pipes to their end: a lingering copy would hold them open
    proc = subprocess.run([exe("handoffd"), "run", "--root", str(root)], capture_output=True,
                          text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert (root / "handoffs" / "completed" / "f1.json").exists()
    assert sys.platform != "linux" or "Traceback" not in proc.stderr


def test_a_command_printing_bytes_that_are_not_utf8_fails_the_attempt() -> None:
    from handoffd.core.runner import _parse_output
    with pytest.raises(HandlerError, match="not UTF-8") as caught:
        _parse_output(0, b'{"status": "completed", "output": "caf\xe9"}', b"", "h1")
    assert caught.value.code == "NOT_UTF8"


def _timed_out(ctx_partial: Any, stdout: str | None = None) -> Any:
    """keep_partial on a timed-out attempt whose handler reported ``ctx_partial`` (or whose
    command printed ``stdout`` on SIGTERM)."""
    from datetime import datetime, timezone

    from handoffd.core.documents import Outcome
    from handoffd.core.runner import keep_partial
    from handoffd.core.specialists import HandlerContext
    now = datetime.now(timezone.utc)
    ctx = HandlerContext(handoff_id="p1", attempt=1, root=Path("/nonexistent"), data=None,
                         target="@x", max_output_bytes=1 << 20)
    ctx.partial = ctx_partial
    details = {"partial_stdout": stdout} if stdout is not None else {}
    outcome = Outcome(status="timeout", started_at=now, finished_at=now,
                      error={"code": "TIMEOUT", "message": "late", "details": details})
    return keep_partial(ctx, outcome)


@pytest.mark.parametrize("partial", [float("nan"), {"x": float("inf")}, "deep"])
def test_a_partial_that_cannot_be_filed_is_dropped_not_filed(partial: Any) -> None:
    """A NaN partial made the filing raise (a traceback, the claim stranded until recovery); a
    200-level one was filed and then unreadable to show and wait. Both are now dropped."""
    if partial == "deep":
        for _ in range(200):
            partial = [partial]
    outcome = _timed_out(partial)
    assert outcome.output is None and not (outcome.metadata or {}).get("partial")


@pytest.mark.parametrize("line", ['{"output": NaN}', "[" * 5000 + "]" * 5000])
def test_a_commands_last_line_that_cannot_be_filed_is_no_partial(line: str) -> None:
    outcome = _timed_out(None, stdout=f"noise\n{line}\n")
    assert outcome.output is None


def test_a_fileable_partial_is_kept_as_plain_json() -> None:
    class Sub(dict):  # a handler's own type: filed as a plain copy
        pass
    outcome = _timed_out(Sub(step=2))
    assert outcome.output == {"step": 2} and type(outcome.output) is dict
    assert outcome.metadata == {"partial": True}
