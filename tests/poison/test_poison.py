"""The poison corpus (issue 9): every hostile input known to have broken handoffd, replayed through
a real ``handoffd run``. See README.md in this folder for the file layout.

All corpus entries share one workspace and one daemon run (plus one earlier run that files the
victim the forged duplicate points at); the per-entry tests then only look at where each input
ended up. Special file-system objects (socket, FIFO, mode-000 file, directory, symlinks) cannot be
stored in git: they are made here, in the same batch.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from conftest import FLAKY_TOML, Workspace, reason_codes

CORPUS = Path(__file__).resolve().parent
CONTROL = "poison-control"
VICTIM = "poison-victim"


def corpus() -> dict[str, dict[str, Any]]:
    """name -> expectation (with the raw bytes under "content")."""
    out = {}
    for meta_path in sorted(CORPUS.glob("*.expect.json")):
        name = meta_path.name[: -len(".expect.json")]
        meta = json.loads(meta_path.read_text())
        meta["content"] = (CORPUS / f"{name}.doc").read_bytes()
        out[name] = meta
    return out


ENTRIES = corpus()

# Special file-system objects, made by the test: name -> expectation
SPECIAL: dict[str, dict[str, Any]] = {
    "fs-socket": {"expect": "quarantine", "code": "NOT_A_REGULAR_FILE", "stub": True,
                  "why": "a UNIX socket in pending/ (open() gives ENXIO)"},
    "fs-fifo": {"expect": "quarantine", "code": "NOT_A_REGULAR_FILE", "stub": True,
                "why": "a FIFO: a blocking open() would hang the daemon"},
    "fs-dir": {"expect": "quarantine", "code": "NOT_A_REGULAR_FILE", "stub": True,
               "why": "a directory named fs-dir.json"},
    "fs-symlink": {"expect": "quarantine", "code": "NOT_A_REGULAR_FILE", "stub": True,
                   "why": "a symlink to a valid document outside the workspace: never followed"},
    "fs-dangling": {"expect": "quarantine", "code": "NOT_A_REGULAR_FILE", "stub": True,
                    "why": "a symlink to nowhere"},
    # root reads a mode-000 file anyway: then it is an ordinary valid handoff
    "fs-mode000": {"expect": "completed" if os.geteuid() == 0 else "quarantine",
                   "code": None if os.geteuid() == 0 else "ANY",
                   "why": "a regular file nobody may read (EACCES unless root)"},
}


def native(hid: str, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"handoff_id": hid, "target": {"agent_id": "@flaky"},
                           "input": {"data": {"mode": "ok"}}}
    doc.update(extra)
    return doc


@dataclass
class Batch:
    ws: Workspace
    proc: subprocess.CompletedProcess[str]
    seconds: float
    victim_bytes: bytes
    secret: Path
    reasons: dict[str, str] = field(default_factory=dict)


def make_special(pending: Path, name: str, secret: Path, keep: list[Any]) -> None:
    path = pending / f"{name}.json"
    if name == "fs-socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        keep.append(sock)
    elif name == "fs-fifo":
        os.mkfifo(path)
    elif name == "fs-dir":
        path.mkdir()
        (path / "inner.json").write_text(json.dumps(native("inner")))
    elif name == "fs-symlink":
        os.symlink(secret, path)
    elif name == "fs-dangling":
        os.symlink(pending.parent / "nowhere" / "x.json", path)
    elif name == "fs-mode000":
        tmp = pending.parent / ".fs-mode000.part"
        tmp.write_text(json.dumps(native("fs-mode000")))
        os.chmod(tmp, 0)
        os.replace(tmp, path)
    else:
        raise AssertionError(name)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batch]:
    base = tmp_path_factory.mktemp("poison")
    root = base / "ws"
    root.mkdir()
    ws = Workspace(root)
    ws.write_config(FLAKY_TOML)
    HandoffdWorkspace(root).ensure()  # the folders, made in-process
    # phase 1: a finished handoff for the forged duplicate to aim at
    ws.create("--to", "@flaky", "--id", VICTIM, "--data", '{"mode": "ok"}')
    assert ws.handoffd("run").returncode == 0
    victim_bytes = (root / "handoffs" / "completed" / f"{VICTIM}.json").read_bytes()
    # phase 2: every corpus entry, every special object and a control handoff, one daemon run
    secret = base / "secret.json"
    secret.write_text(json.dumps(native("fs-symlink")))
    pending = root / "handoffs" / "pending"
    for name, meta in ENTRIES.items():
        ws.drop(meta["drop_as"], meta["content"])
    keep: list[Any] = []
    for name in SPECIAL:
        make_special(pending, name, secret, keep)
    ws.drop(f"{CONTROL}.json", native(CONTROL))
    started = time.monotonic()
    proc = ws.handoffd("run", timeout=120)
    seconds = time.monotonic() - started
    for sock in keep:
        sock.close()
    yield Batch(ws, proc, seconds, victim_bytes, secret, reason_codes(root))
    ws.cleanup()


def test_the_daemon_never_crashes_and_keeps_serving(batch: Batch) -> None:
    proc = batch.proc
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode in (0, 1), (proc.returncode, proc.stderr[-3000:])
    assert batch.ws.state_of(CONTROL) == ["completed"]  # the normal handoff beside them all
    assert not list((batch.ws.root / "handoffs" / "pending").iterdir())
    assert not list((batch.ws.root / "handoffs" / "in-progress").iterdir())
    # the ReDoS entry and all the rest in one run: nothing may take long
    assert batch.seconds < 60, batch.seconds


def _params() -> list[Any]:
    out = []
    for name, meta in ENTRIES.items():
        marks = [pytest.mark.xfail(strict=True, reason=meta["xfail"])] if meta.get("xfail") else []
        out.append(pytest.param(name, meta, marks=marks, id=name))
    for name, meta in SPECIAL.items():
        out.append(pytest.param(name, {**meta, "drop_as": f"{name}.json", "id": name}, id=name))
    return out


@pytest.mark.parametrize(("name", "meta"), _params())
def test_entry_ends_in_exactly_one_place(batch: Batch, name: str, meta: dict[str, Any]) -> None:
    ws, reasons = batch.ws, batch.reasons
    drop_as, hid, expect, code = meta["drop_as"], meta.get("id"), meta["expect"], meta.get("code")
    pending = ws.root / "handoffs" / "pending"
    assert not os.path.lexists(pending / drop_as)
    assert not os.path.lexists(ws.root / "handoffs" / "in-progress" / drop_as)
    if meta.get("setup") == "completed-victim":
        assert reasons.get(drop_as) == code, (drop_as, reasons)
        assert ws.state_of(hid) == ["completed"]
        assert (ws.root / "handoffs" / "completed" / f"{hid}.json").read_bytes() == batch.victim_bytes
        assert [r["id"] for r in ws.runs()].count(hid) == 1  # the forged input never ran
        return
    if expect == "quarantine":
        assert drop_as in reasons, (drop_as, reasons)
        if code != "ANY":
            assert reasons[drop_as] == code, (drop_as, reasons[drop_as])
        if meta.get("stub"):  # a failure stub under the file's name so that `handoff wait` ends
            assert ws.state_of(hid) == ["failed"]
            assert ws.doc(hid)["error"]["code"] == reasons[drop_as]
        elif hid is not None:
            assert ws.state_of(hid) == []
        return
    assert drop_as not in reasons, (drop_as, reasons.get(drop_as))
    assert ws.state_of(hid) == [expect]
    doc = ws.doc(hid)
    if expect == "failed":
        error = doc.get("error") or {}
        assert error.get("code") == code, (error, doc.get("status"))
    if name == "fs-symlink":
        assert batch.secret.read_text() == json.dumps(native("fs-symlink"))  # target untouched
