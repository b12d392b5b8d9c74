"""Session 31: a document nested past MAX_DEPTH is DOCUMENT_TOO_DEEP however deep it is, found
on its text before any parser recurses into it (core.jsontext.nests_deeper). json's parser
refused one some 990 to 1,023 levels deep by its recursion limit (where depended on the
caller's stack) as MALFORMED_JSON, which a store waits on as possibly half-written: a hostile
deep document in pending/ cost a grace period and was set aside with the wrong code."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace, exe, new_workspace, reason_codes, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from handoffd.core import jsontext
from handoffd.core.documents import MAX_DEPTH
from handoffd.core.errors import ErrorCode, InvalidDocument

SAVED = ("_fast", "_fast_option", "_encoded", "_fast_loads")
# brackets, quotes and escapes inside strings: none of them nests anything
TRICKY = '"[[{{\\\\\\"]]}} \\u005b é"'


def nested_text(depth: int, rng: random.Random) -> str:
    """A JSON object nesting exactly ``depth`` levels (arrays and objects at random, strings
    full of brackets beside them), the object itself the first level."""
    kinds = ["{"] + [rng.choice("[{") for _ in range(depth - 1)]
    opening = "".join(f'{{{TRICKY}: ' if kind == "{" else f"[{TRICKY}, " for kind in kinds)
    closing = "".join("}" if kind == "{" else "]" for kind in reversed(kinds))
    return opening + TRICKY + closing


def read(parse: Callable[[], Any]) -> Any:
    """("value", the value) or ("refused", code)."""
    try:
        return ("value", parse())
    except InvalidDocument as exc:
        return ("refused", exc.code)


def with_orjson(fast: bool, parse: Callable[[], Any]) -> Any:
    """:func:`read` of ``parse`` with orjson's reader loaded (a daemon's) or not (a command's)."""
    saved = {name: getattr(jsontext, name) for name in SAVED}
    try:
        if fast:
            jsontext._encoded = jsontext.FAST_AFTER - 1
            jsontext._count_encoded()
            assert jsontext._fast_loads is not None
        else:
            jsontext._fast = jsontext._fast_loads = None
        return read(parse)
    finally:
        for name, value in saved.items():
            setattr(jsontext, name, value)


def at_stack_depth(frames: int, call: Callable[[], Any]) -> Any:
    """``call()`` made ``frames`` Python frames down (a caller deep in its own stack)."""
    if frames <= 0:
        return call()
    return at_stack_depth(frames - 1, call)


def expected(text: str, depth: int) -> Any:
    return ("refused", ErrorCode.DOCUMENT_TOO_DEEP) if depth > MAX_DEPTH \
        else ("value", json.loads(text))


@settings(max_examples=120, deadline=None)
@given(depth=st.integers(60, 3000), rng=st.randoms(use_true_random=False), fast=st.booleans())
def test_depth_decides_whatever_the_path(depth: int, rng: random.Random, fast: bool) -> None:
    """Bytes (parse_document: the daemon's read, with orjson or json) and text (load_json: the
    command line's --data) alike: past MAX_DEPTH, DOCUMENT_TOO_DEEP at every depth; within
    it, the value json reads. (Fails before: from about 990 levels, MALFORMED_JSON.)"""
    text = nested_text(depth, rng)
    want = expected(text, depth)
    assert with_orjson(fast, lambda: jsontext.parse_document(text.encode(), "pending/x.json")) \
        == want
    assert read(lambda: jsontext.load_json(text, "--data", max_depth=MAX_DEPTH)) == want


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 300, 990, 1023, 1025, 5000])
def test_the_callers_stack_does_not_move_the_refusal(depth: int) -> None:
    """Called 700 frames down (a handler's thread deep in its own calls), a document 300
    levels deep was refused MALFORMED_JSON: json's recursion limit, not the document, decided."""
    text = nested_text(depth, random.Random(depth))
    want = expected(text, depth)
    for fast in (False, True):
        assert at_stack_depth(700, lambda: with_orjson(
            fast, lambda: jsontext.parse_document(text.encode(), "pending/x.json"))) == want
    assert at_stack_depth(700, lambda: read(
        lambda: jsontext.load_json(text, "--data", max_depth=MAX_DEPTH))) == want


def test_a_document_cut_short_is_judged_as_the_whole_would_be() -> None:
    """A document still being written: cut short past MAX_DEPTH levels, it is too deep already
    (the whole one is deeper still); cut inside a string full of brackets, it is only not yet
    JSON (MALFORMED_JSON, which the store waits on), not a deep document."""
    deep = nested_text(200, random.Random(1)).encode()
    assert read(lambda: jsontext.parse_document(deep[:len(deep) // 2], "p")) \
        == ("refused", ErrorCode.DOCUMENT_TOO_DEEP)
    shallow = json.dumps({"handoff_id": "h", "note": "[{" * 5000 + '\\"' + "[" * 500}).encode()
    assert read(lambda: jsontext.parse_document(shallow, "p"))[0] == "value"
    for cut in (len(shallow) // 2, len(shallow) - 600, len(shallow) - 3):
        assert read(lambda: jsontext.parse_document(shallow[:cut], "p")) \
            == ("refused", ErrorCode.MALFORMED_JSON), cut


@pytest.fixture
def json_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """json.loads raises if called: the text was judged before any parser saw it."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("json.loads called on a text nested past its limit")

    monkeypatch.setattr(jsontext.json, "loads", refuse)
    yield


@pytest.mark.parametrize("line", [b"[" * 30_000, "[" * 30_000, b'{"a": ' + b"[" * 100 + b"]" * 100
                                  + b"}", '{"at": 1, "x": ' + "{" * 65 + "}" * 65 + "}"])
def test_a_deep_log_line_is_no_line_of_ours_before_it_is_parsed(json_refused: None,
                                                                 line: bytes | str) -> None:
    """parse_line keeps its contract (None: not one of ours, never an exception), and says so
    from the text: the parser never recursed into it (fails before: json.loads was called)."""
    assert jsontext.parse_line(line) is None


def test_a_deep_document_in_pending_is_set_aside_at_once(tmp_path: Path) -> None:
    """A 5,000-deep document dropped into pending/ of a serving daemon whose grace for a
    half-written file is an hour: set aside DOCUMENT_TOO_DEEP (a failure stub under its id, so
    `handoff wait` ends) within the test's bound, not after the hour (before: MALFORMED_JSON,
    put back as still being written, over and over)."""
    ws = new_workspace(tmp_path / "ws", FLAKY_TOML.replace("settle_seconds = 0.2",
                                                           "settle_seconds = 3600"))
    try:
        daemon = ws.serve()
        doc = json.dumps({"handoff_id": "deep", "target": {"agent_id": "@flaky"}, "input": {}})
        ws.drop("deep.json", doc[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
        wait_until(lambda: reason_codes(ws.root).get("deep.json") is not None, timeout=30,
                   what="the deep document set aside")
        assert reason_codes(ws.root) == {"deep.json": "DOCUMENT_TOO_DEEP"}
        assert ws.wait_state("deep", ("failed",)) == "failed"
        assert ws.stop(daemon) == 0
        assert "Traceback" not in (daemon.stderr.read() if daemon.stderr else "")
    finally:
        ws.cleanup()


def test_create_of_a_deep_document_says_one_line(ws: Workspace, tmp_path: Path) -> None:
    """`handoff create --file` of a 5,000-deep document: one line with the code, exit 1 (was
    MALFORMED_JSON, "nests too deeply"); `--data` of one is in test_cli_hostile."""
    path = tmp_path / "deep.json"
    path.write_text('{"handoff_id": "deep", "target": {"agent_id": "@flaky"}, "x": '
                    + "[" * 5000 + "]" * 5000 + "}")
    proc = subprocess.run([exe("handoff"), "create", "--file", str(path), "--root", str(ws.root)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "nests more than 64 levels deep" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((ws.root / "handoffs" / "pending").iterdir())


def test_the_depth_look_at_hostile_bytes_takes_a_few_times_their_size() -> None:
    """1 MiB of ``1]`` after 70 ``[``: the bytes path took about 85 times the document (a bytes
    regex's pieces joined at about 80 bytes each: RE); read as Latin-1, a str's take 8 or so."""
    import tracemalloc

    from handoffd.core.jsontext import nests_deeper
    data = b"[" * 70 + b"1]" * (512 * 1024)
    tracemalloc.start()
    try:
        assert nests_deeper(data, 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data), peak
