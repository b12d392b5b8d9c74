"""A fan-out parent's aggregated answer stays readable however large its children's answers are
(session 16): the children's outputs and artifacts are copied within a byte budget
(max_output_bytes), the rest is named (``output_omitted``: see `handoff show <child>`), a
first_success winner's large output is not copied twice, and an answer still over the limit is
abridged further or filed as a readable failure, never as a document nobody can read."""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from conftest import Workspace

from handoffd.core.results import failed
from handoffd.core.settings import DaemonSettings
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features import aggregation
from handoffd.features.answer_copies import RESULT_COPY_BYTES, answer_limit, copies
from handoffd.features.childfacts import ChildInfo, json_size

DOC_BYTES = 64 * 1024
OUTPUT_BYTES = 2 * 1024 * 1024
# the files store reads a finished document up to this much (max_document_bytes +
# max_output_bytes + its 1 MiB margin): before the fix, one over it was filed anyway
READ_LIMIT = DOC_BYTES + OUTPUT_BYTES + (1 << 20)
BLOB = 1_900_000  # a child's output: within max_output_bytes, two of them are over READ_LIMIT

SPECIALIST = '''
import json, sys
doc = json.load(sys.stdin)
data = (doc.get("input") or {}).get("data") or {}
if "delegate" in data:
    print(json.dumps({"status": "delegated", "aggregation": data["aggregation"],
                      "delegate": data["delegate"]}))
else:
    print(json.dumps({"status": "completed", "output": {"blob": "y" * data["big"]}}))
'''


def big_workspace(tmp_path: Path, limits: str, slots: int) -> Workspace:
    """A workspace whose command specialist @big (``slots`` at once) delegates to itself as
    asked and answers outputs of ``big`` bytes; ``limits``: [daemon] lines."""
    script = tmp_path / "big.py"
    script.write_text(SPECIALIST)
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(f"""
[daemon]
durability = "fast"
settle_seconds = 0.1
rescan_seconds = 0.5
sweep_seconds = 0.5
workers = {slots}
{limits}

[retry]
max_retries = 0

[specialists."@big"]
command = ["{sys.executable}", "-S", "{script}"]
timeout_seconds = 60
concurrency = {slots}
""")
    HandoffdWorkspace(root).ensure()
    return ws


@pytest.fixture
def bws(tmp_path: Path) -> Iterator[Workspace]:
    ws = big_workspace(tmp_path, f"max_document_bytes = {DOC_BYTES}\n"
                                 f"max_output_bytes = {OUTPUT_BYTES}", 4)
    yield ws
    ws.cleanup()


def fan_out(ws: Workspace, hid: str, strategy: str, sizes: list[int]) -> None:
    data = {"aggregation": strategy, "delegate": [{"to": "@big", "data": {"big": n}} for n in sizes]}
    ws.create("--to", "@big", "--id", hid, "--data", json.dumps(data))


def filed(ws: Workspace, hid: str) -> dict[str, Any]:
    """The parent as `handoff wait` reads it: it must be readable (exit 0)."""
    path = ws.root / "handoffs" / "completed" / f"{hid}.json"
    assert path.stat().st_size <= READ_LIMIT, f"{hid}.json is {path.stat().st_size} bytes"
    proc = ws.handoff("wait", hid, "--timeout", "5", "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def test_large_children_leave_a_readable_aggregated_answer(bws: Workspace) -> None:
    fan_out(bws, "one", "first_success", [BLOB])
    fan_out(bws, "all", "all_success", [BLOB, BLOB, BLOB])
    fan_out(bws, "small", "all_success", [10, 20])
    proc = bws.handoffd("run", timeout=180)
    assert proc.returncode == 0, proc.stderr

    one = filed(bws, "one")  # before: "one.json is 3800... bytes, over the ...-byte limit"
    assert one["status"] == "completed" and one["output"]["winner"] == "one.c1"
    assert one["output"]["results"]["one.c1"] == {"blob": "y" * BLOB}  # copied once
    result = one["output"]["result"]  # ... and named, not copied again
    assert result["handoff_id"] == "one.c1" and 'output.results["one.c1"]' in result["output_omitted"]
    assert "outputs_omitted" not in one["output"]

    both = filed(bws, "all")
    results = both["output"]["results"]
    assert results["all.c1"] == {"blob": "y" * BLOB}  # within max_output_bytes: copied
    for cid in ("all.c2", "all.c3"):  # past it: named, with where to read it
        assert set(results[cid]) == {"output_omitted", "handoff_id", "size_bytes"}
        assert f"`handoff show {cid}`" in results[cid]["output_omitted"]
    assert both["output"]["outputs_omitted"] == ["all.c2", "all.c3"]
    assert "not copied (too large): all.c2, all.c3" in both["output"]["summary"]
    assert both["aggregated_outcome"]["aggregated_status"] == "success"
    child = bws.handoff("show", "all.c3", "--json")  # the child keeps the output
    assert child.returncode == 0
    assert json.loads(child.stdout)["document"]["output"]["blob"] == "y" * BLOB

    small = filed(bws, "small")  # the normal case is as it always was
    assert small["output"]["results"] == {"small.c1": {"blob": "y" * 10},
                                          "small.c2": {"blob": "y" * 20}}
    assert "outputs_omitted" not in small["output"]
    assert small["output"]["summary"] == "2/2 subtasks succeeded (all_success)"

    listing = bws.handoff("ls", "--json")
    assert listing.returncode == 0 and "DOCUMENT_TOO_LARGE" not in listing.stdout + listing.stderr


# ---------------------------------------------------------------- unit tests
def child(cid: str, output: Any, status: str = "success", **kw: Any) -> ChildInfo:
    return ChildInfo(cid, "completed", status, 1.0, "@w", output, **kw)


def test_copies_keeps_the_small_case_whole() -> None:
    infos = [child("p.c1", {"v": 1}), child("p.c2", None, "failed"), child("p.c3", [1, 2], "partial",
             artifacts=[{"name": "a", "metadata": {"x": 1}}, "plain"])]
    got = copies(infos, None, 10_000)
    assert got.results == {"p.c1": {"v": 1}, "p.c3": [1, 2]} and got.omitted == []
    assert got.artifacts == [{"name": "a", "metadata": {"x": 1, "child_id": "p.c3"}}, "plain"]
    assert infos[2].artifacts[0] == {"name": "a", "metadata": {"x": 1}}  # the child's untouched
    winner = child("p.c1", {"v": "fast"})
    small = copies([winner, child("p.c2", {"v": "slow"})], winner, 10_000)
    assert small.result == {"v": "fast"} and small.results["p.c1"] == {"v": "fast"}


def test_copies_stays_within_its_budget() -> None:
    big, small = "x" * 600, "y" * 100
    infos = [child("p.c1", big), child("p.c2", big), child("p.c3", small)]
    got = copies(infos, None, 1000)
    assert got.results["p.c1"] == big and got.results["p.c3"] == small  # first fit, in order
    assert got.results["p.c2"]["size_bytes"] == json_size(big)
    assert "`handoff show p.c2`" in got.results["p.c2"]["output_omitted"]
    assert list(got.results) == ["p.c1", "p.c2", "p.c3"] and got.omitted == ["p.c2"]
    # the winner goes first, and its large output is copied once
    winner = child("p.c2", big)
    first = copies([child("p.c1", big), winner], winner, 1000)
    assert first.results["p.c2"] == big and first.results["p.c1"]["handoff_id"] == "p.c1"
    assert first.result["handoff_id"] == "p.c2"  # (no room left for a second copy)
    assert first.result["output_omitted"].startswith("the winner's output (602 bytes)")
    huge = "z" * (RESULT_COPY_BYTES + 1)
    only = child("q.c1", huge)
    named = copies([only], only, 10 * len(huge))
    assert named.results["q.c1"] == huge and named.result["output_omitted"].startswith("the winner's")
    none = copies([only], only, 10)  # nothing fits: both name the child
    assert none.result == none.results["q.c1"] and none.omitted == ["q.c1"]


def test_copies_names_artifacts_past_the_budget() -> None:
    items = [{"name": f"f{n}", "inline_content": "a" * 200} for n in range(10)]
    got = copies([child("p.c1", {"v": 1}, artifacts=items)], None, 500)
    assert got.results == {"p.c1": {"v": 1}} and got.omitted == ["p.c1"]
    [record] = got.artifacts
    assert record["artifact_type"] == "artifacts_omitted" and record["metadata"]["count"] == 10
    assert "`handoff show p.c1`" in record["inline_content"] and len(record["inline_content"]) < 1024


def test_json_size_counts_bytes_as_written() -> None:
    assert json_size({"a": "é"}) == len('{"a":"é"}'.encode())
    assert json_size(float("nan")) == sys.maxsize
    assert json_size({1, 2}) == sys.maxsize


def _fake(max_output: int) -> tuple[Any, Any, aggregation.Family]:
    when = datetime(2026, 1, 1, tzinfo=timezone.utc)
    settings = DaemonSettings(max_document_bytes=1024, max_output_bytes=max_output)
    engine = SimpleNamespace(settings=settings, clock=lambda: when,
                             failure=lambda started, code, message, retryable=None: failed(
                                 started, when, code, message, retryable=retryable))
    job = SimpleNamespace(handoff_id="p", specialist=SimpleNamespace(agent="@d"))
    infos = [child("p.c1", "x" * 5000), child("p.c2", "y" * 5000)]
    agg = {"strategy_used": "all_success", "child_outcomes": [], "aggregated_status": "success",
           "aggregated_confidence": 1.0}
    family = aggregation.Family(infos, "all_success", "success", None, agg,
                                "2/2 subtasks succeeded", when, ["success", "success"])
    return engine, job, family


def test_an_answer_over_the_limit_is_abridged_then_failed_readably(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, job, family = _fake(max_output=1 << 20)
    budgets: list[int] = []
    real = copies

    def spy(infos: list[ChildInfo], winner: ChildInfo | None, budget: int) -> Any:
        budgets.append(budget)
        return real(infos, winner, budget)

    monkeypatch.setattr(aggregation, "copies", spy)
    # measured over the limit by a request that is large (not the copies): abridged to none
    limit = answer_limit(engine)
    sizes = iter([limit + 10, limit + 5, limit - 1])
    monkeypatch.setattr(aggregation, "filed_size", lambda engine, job, outcome: next(sizes))
    outcome = aggregation.readable_outcome(engine, job, family)
    assert budgets[0] == 1 << 20 and budgets[-1] == 0 and len(budgets) == 3
    assert outcome.status == "completed" and outcome.output["outputs_omitted"] == ["p.c1", "p.c2"]
    # still over without any copy: a failure that says why, never an unreadable answer
    budgets.clear()
    monkeypatch.setattr(aggregation, "filed_size", lambda engine, job, outcome: limit + 1)
    outcome = aggregation.readable_outcome(engine, job, family)
    assert outcome.status == "failed" and outcome.output is None and budgets[-1] == 0
    assert outcome.error is not None and outcome.error["code"] == "DOCUMENT_TOO_LARGE"
    assert "`handoff show <child>`" in outcome.error["message"]
    assert outcome.fields["children"] == ["p.c1", "p.c2"]
