"""The shared context against session 16's review (R8):

1. a context write, a read and the PostgreSQL mirror never follow a symlink swapped onto a key's
   path between the check and the rename (``renameat2(RENAME_EXCHANGE)`` of ``context/a`` and a
   link ``context/b -> outside``): in process at the exact step, with the real CLI in a loop, and
   with a serving daemon mirroring a PostgreSQL store;
2. a key and its file are a bijection: ``a.json.json`` is no key, a file no key names is not
   listed, and a listed key reads back its own file;
3. the mirror's record is sealed and out of ``context/``: a forged value of a protected key with
   a forged record is replaced by the store's value;
4. what is planted at ``context/.history.jsonl`` (or a revision record's name) is set aside, not
   a refusal of every write nor "another key's file or folder"."""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import FLAKY_TOML, Workspace, exe
from test_context_mirror import drop, mirror_of, store_at
from test_postgres_context import eventually

from handoffd.backends.files.context import FileContext
from handoffd.backends.memory import MemoryContext
from handoffd.core.errors import InvalidDocument
from handoffd.core.hashing import sha256_hex
from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.features.context import ContextStore, Permissions

LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2
AT_FDCWD = -100
REAL_REPLACE = os.replace
REAL_OPEN = os.open
PAUSE = 0.0002  # between two swaps of the loop


def exchange(a: Path, b: Path) -> None:
    """Swap the entries ``a`` and ``b`` in one step (what the review's swap.py does)."""
    if LIBC.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def files_store(root: Path) -> ContextStore:
    ws = HandoffdWorkspace(root)
    ws.ensure()
    return ContextStore(ws, Permissions.from_config(ws.load_config()), durable=False)


def plant_link(context: Path, outside: Path) -> tuple[Path, Path]:
    """``context/a`` a real folder, ``context/b`` a symlink to ``outside``."""
    outside.mkdir(exist_ok=True)
    (context / "a").mkdir(parents=True, exist_ok=True)
    (context / "b").symlink_to(outside)
    return context / "a", context / "b"


def swap_once_at(name: str, a: Path, b: Path) -> Callable[..., Any]:
    """An ``os.replace`` that swaps ``a`` and ``b`` first, the first time it publishes a file
    called ``name``: exactly between every check of the path and the rename."""
    done: list[bool] = []

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if not done and os.fspath(dst).endswith(name):
            done.append(True)
            exchange(a, b)
        REAL_REPLACE(src, dst, **kwargs)
    return replace


# ---------------------------------------------------------------- 1. the swap, in process
def test_a_link_swapped_in_before_the_rename_takes_no_write_outside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = files_store(tmp_path / "ws")
    store.set("a/seed", 1, agent="@cli")
    real, link = plant_link(store.root, tmp_path / "outside")
    monkeypatch.setattr(os, "replace", swap_once_at("x.json", real, link))
    try:
        store.set("a/x", "attempt", agent="@cli")
    except InvalidDocument:
        pass  # refused is fine; written outside is not
    monkeypatch.undo()
    assert list((tmp_path / "outside").iterdir()) == []
    # the value went into the folder that was checked (now called b), never through the link
    assert json.loads((store.root / "b" / "x.json").read_text()) == "attempt"


def test_a_read_never_follows_a_link_swapped_in_on_the_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = files_store(tmp_path / "ws")
    store.set("a/x", "mine", agent="@cli")
    real, link = plant_link(store.root, tmp_path / "outside")
    (tmp_path / "outside" / "x.json").write_text('"outside secret"')
    done: list[bool] = []

    def opening(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if not done and os.fspath(path).endswith("x.json"):
            done.append(True)
            exchange(real, link)  # between the check of the path and the open of the file
        return REAL_OPEN(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", opening)
    try:
        got = store.get("a/x")
    except InvalidDocument:
        got = None
    monkeypatch.undo()
    assert done and got != "outside secret"


def test_a_read_never_goes_through_a_planted_link(tmp_path: Path) -> None:
    store = files_store(tmp_path / "ws")
    store.set("task/x", "original", agent="ABSTRACT_ARCHITECT")
    (store.root / "alias").symlink_to(store.root / "task")
    with pytest.raises(InvalidDocument, match="context/alias is a symlink"):
        store.get("alias/x")
    assert store.keys() == ["task/x"]


def test_the_mirror_writes_no_value_through_a_swapped_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = MemoryContext()
    store = store_at(tmp_path / "ws", shared)
    mirror = mirror_of(store)
    real, link = plant_link(store.root, tmp_path / "outside")
    store.set("a/x", "remote", agent="@other-host")
    store.set("c/y", "other", agent="@other-host")
    monkeypatch.setattr(os, "replace", swap_once_at("x.json", real, link))
    report = mirror.pull()
    monkeypatch.undo()
    assert list((tmp_path / "outside").iterdir()) == []
    assert "c/y" in report["written"]  # one key's trouble never aborts the round
    assert json.loads((store.root / "c" / "y.json").read_text()) == "other"


def test_a_link_on_a_keys_path_fails_that_key_not_the_mirrors_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = store_at(tmp_path / "ws", MemoryContext())
    mirror = mirror_of(store)
    plant_link(store.root, tmp_path / "outside")
    store.set("b/x", "remote", agent="@other-host")
    store.set("c/y", "other", agent="@other-host")
    report = mirror.sync()
    assert report["written"] == ["c/y"] and list((tmp_path / "outside").iterdir()) == []
    assert "cannot write context/b/x.json: context/b is a symlink" in caplog.text


# ---------------------------------------------------------------- 1. the swap, for real
class Swapper(threading.Thread):
    """Exchanges ``a`` and ``b`` in a loop until stopped (leaves ``a`` the real folder)."""

    def __init__(self, a: Path, b: Path) -> None:
        super().__init__(daemon=True)
        self.a, self.b = a, b
        self.halt = threading.Event()
        self.swaps = 0

    def run(self) -> None:
        while not self.halt.is_set():
            exchange(self.a, self.b)
            self.swaps += 1
            time.sleep(PAUSE)  # thousands a second, yet the commands under test get the CPU

    def finish(self) -> None:
        self.halt.set()
        self.join(timeout=10)
        if self.a.is_symlink():
            exchange(self.a, self.b)


@pytest.mark.heavy
def test_the_cli_writes_nothing_outside_while_a_link_is_swapped_in_a_loop(ws: Workspace,
                                                                         tmp_path: Path) -> None:
    assert ws.handoff("context", "set", "a/seed", "1").returncode == 0
    real, link = plant_link(ws.root / "context", tmp_path / "outside")
    swapper = Swapper(real, link)
    swapper.start()
    outcomes = []
    try:
        for attempt in range(10):  # hundreds of swaps during each command
            proc = ws.handoff("context", "set", "a/x", "--data", json.dumps(f"attempt {attempt}"),
                              timeout=60)
            got = ws.handoff("context", "get", "a/x", timeout=60)
            outcomes.append((proc.returncode, got.returncode))
            for done in (proc, got):  # refused in one line, or done; never a traceback
                assert done.returncode in (0, 1, 3), done.stderr
                assert "Traceback" not in done.stderr and done.stderr.count("\n") <= 1, done.stderr
                assert "another key's file" not in done.stderr  # a link, not a clash
            assert list((tmp_path / "outside").iterdir()) == [], f"written outside at {attempt}"
            if got.returncode == 0:
                assert not json.loads(got.stdout).startswith("outside")
    finally:
        swapper.finish()
    assert swapper.swaps > 0 and any(code == 0 for code, _ in outcomes)
    assert ws.handoff("context", "get", "a/x").returncode == 0


@pytest.mark.heavy
def test_a_serving_mirror_writes_nothing_outside_while_a_link_is_swapped(
        tmp_path: Path, pg_url: str) -> None:
    """Another host sets ``a/x`` on the PostgreSQL store again and again; this host's daemon
    mirrors each value while ``context/a`` and a link to outside are swapped in a loop."""
    config = (FLAKY_TOML.split('[specialists."@flaky"]')[0].replace("rescan_seconds = 1.0",
                                                                     "rescan_seconds = 0.2")
              + f'\n[store]\nurl = "{pg_url}"\n')
    here, there = Workspace(tmp_path / "here"), Workspace(tmp_path / "there")
    for space in (here, there):
        space.root.mkdir()
        space.write_config(config)
        HandoffdWorkspace(space.root).ensure()
    real, link = plant_link(here.root / "context", tmp_path / "outside")
    log_path = tmp_path / "here.log"
    with open(log_path, "w") as log_file:  # a file: a daemon logging much never blocks on a pipe
        daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(here.root)],
                                  stdout=subprocess.DEVNULL, stderr=log_file)
    swapper = Swapper(real, link)
    try:
        eventually(lambda: "serving" in log_path.read_text(), "the daemon serving", timeout=60)
        swapper.start()
        for attempt in range(12):  # each value mirrored while hundreds of swaps go on
            there.handoff("context", "set", "a/x", "--data", json.dumps(f"attempt {attempt}"),
                          check=True)
            assert list((tmp_path / "outside").iterdir()) == [], f"written outside at {attempt}"
            time.sleep(0.05)  # the daemon's mirror round runs on its NOTIFY meanwhile
        swapper.finish()
        # While the folders were exchanged, a/x and b/x named the same file by turns, so which
        # value a/x.json ends with is not promised (the mirror may have taken an aliased file
        # in as a local edit). What is: nothing went outside, and the mirror is not wedged: a
        # key set now reaches this host's folder.
        there.handoff("context", "set", "a/y", "--data", json.dumps("after"), check=True)
        after = real / "y.json"
        eventually(lambda: after.exists() and json.loads(after.read_text()) == "after",
                   "a key set after the swaps, in this host's context/a", timeout=60)
        assert list((tmp_path / "outside").iterdir()) == []
        text = log_path.read_text()
        assert "is not in the subpath" not in text and "Traceback" not in text, text[-3000:]
        assert "refreshing context/ failed" not in text, text[-3000:]
    finally:
        swapper.finish()
        daemon.kill()
        daemon.wait(timeout=10)


# ---------------------------------------------------------------- 2. key <-> file
def test_a_key_ending_in_json_json_is_refused_and_never_listed(ws: Workspace) -> None:
    assert ws.handoff("context", "set", "a", "--data", '"a value"').returncode == 0
    refused = ws.handoff("context", "set", "a.json.json", "--data", '"another"')
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "may not end in '.json'" in refused.stderr
    assert not (ws.root / "context" / "a.json.json").exists()
    # a foreign tool's a.json.json and a file no key could name are no key: not listed
    (ws.root / "context" / "a.json.json").write_text('"planted"')
    (ws.root / "context" / "my notes.json").write_text('"planted"')
    listed = json.loads(ws.handoff("context", "ls", "--json", check=True).stdout)
    assert [row["key"] for row in listed] == ["a"]
    for key in ("a", "a.json"):  # `a.json` is a spelling of `a`, and reads a's file
        assert json.loads(ws.handoff("context", "get", key, check=True).stdout) == "a value"
    assert ws.handoff("context", "get", "a.json.json").returncode == 2


def test_every_listed_key_reads_back_its_own_file(tmp_path: Path) -> None:
    context = FileContext(tmp_path / "context", durable=False)
    for name in ("a.json", "a.json.json", "x.json/y.json", "x.tmp.json", "b.JSON.json",
                 "deep/er/key.json", ".dot.json", "no-suffix", "sp ace.json"):
        path = context.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(name))
    keys = context.keys()
    assert keys == ["a", "b.JSON", "deep/er/key", "x.json/y"]
    for key in keys:
        data, _ = context.read(key)
        assert data is not None and json.loads(data) == f"{key}.json"


# ---------------------------------------------------------------- 3. the mirror's record
def test_a_forged_record_keeps_no_forged_protected_value(tmp_path: Path) -> None:
    store = store_at(tmp_path / "ws", MemoryContext())
    mirror = mirror_of(store)
    store.set("task/goal", "real", agent="ABSTRACT_ARCHITECT")
    mirror.sync()
    forged = '"forged"\n'
    drop(store, "task/goal", forged)
    record = {"task/goal": [1, sha256_hex(forged.encode())]}
    # the record a workspace writer rewrites, wherever the mirror keeps it
    (store.root / ".meta").mkdir(exist_ok=True)
    (store.root / ".meta" / "mirror.json").write_text(json.dumps(record))
    (store.ws.meta / "context-mirror.json").write_text(
        json.dumps({"keys": record, "seal": "0" * 64}))
    mirror.sync()
    mirror.sync()
    assert json.loads((store.root / "task" / "goal.json").read_text()) == "real"
    assert store.get("task/goal") == "real"
    # and the record it keeps now is its own again: a later round trusts it
    assert mirror.pull()["written"] == []


# ---------------------------------------------------------------- 4. a planted history
@pytest.mark.parametrize("plant", ["folder", "symlink", "fifo"])
def test_a_planted_history_is_set_aside_and_the_write_is_recorded(ws: Workspace, tmp_path: Path,
                                                                  plant: str) -> None:
    assert ws.handoff("context", "set", "seed/x", "0").returncode == 0
    history = ws.root / "context" / ".history.jsonl"
    history.unlink()
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    {"folder": history.mkdir, "symlink": lambda: history.symlink_to(target),
     "fifo": lambda: os.mkfifo(history)}[plant]()
    proc = ws.handoff("context", "set", "ok/x", "6", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "another key's file or folder" not in proc.stderr
    assert "context/.history.jsonl is a" in proc.stderr and "history of context writes" in proc.stderr
    assert history.is_file() and not history.is_symlink() and target.read_text() == ""
    entries = json.loads(ws.handoff("context", "history", "--json", check=True).stdout)
    assert [e["key"] for e in entries] == ["ok/x"]
    aside = [p.name for p in (ws.root / "handoffs" / ".quarantine").iterdir()]
    assert any(name.endswith("-.history.jsonl") for name in aside), aside
    assert ws.handoff("context", "set", "ok/y", "7").returncode == 0  # and from then on


def test_a_folder_at_a_revision_records_name_is_set_aside(tmp_path: Path) -> None:
    store = files_store(tmp_path / "ws")
    record = store.root / ".meta" / f"rev-{sha256_hex(b'k')[:24]}.json"
    record.parent.mkdir(parents=True)
    record.mkdir()
    assert store.set("k", 1, agent="@cli")["revision"] == 1
    assert store.get_with_revision("k") == (1, 1) and record.is_file()


def test_a_history_that_cannot_be_set_aside_refuses_the_write_in_one_line(ws: Workspace) -> None:
    """What test_context_safety's FIFO test asked, where the plant cannot be moved (another
    process holds the folder's flock past the wait): nothing is written without its history."""
    assert ws.handoff("context", "set", "seed/x", "0").returncode == 0
    history = ws.root / "context" / ".history.jsonl"
    history.unlink()
    os.mkfifo(history)
    folder = os.open(ws.root / "context", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        proc = ws.handoff("context", "set", "ok/fifo", "6", timeout=30)
    finally:
        os.close(folder)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "context/.history.jsonl cannot be appended to" in proc.stderr
    assert "nothing was written" in proc.stderr and "Traceback" not in proc.stderr
    assert ws.handoff("context", "get", "ok/fifo").returncode == 3
