"""The library and the CLI after the fourteenth review: the Python client raises handoffd errors
where it raised ValueError/TypeError (docs/agents.md's promise), an empty handoff id is refused
rather than replaced, a root that does not exist is refused as ``--root`` is, context keys whose
files would clash are refused with INVALID_CONTEXT_KEY, and a command run in a deleted current
directory says so in one line (exit 3). Review 14g: a cancelled ``wait_async`` ends its thread."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import exe

from handoffd import Client
from handoffd.core.errors import ErrorCode, InvalidDocument, NotFound, UsageError
from handoffd.core.workspace import Workspace
from handoffd.features.context import ContextStore

BASE = {"handoff_id": "d", "source": {"agent_id": "@me"}, "target": {"agent_id": "@x"}}


@pytest.fixture
def client(tmp_path: Path) -> Client:
    return Client(tmp_path)


def test_a_document_with_options_or_nothing_at_all_is_a_usage_error(client: Client) -> None:
    with pytest.raises(UsageError, match="given: to"):
        client.create(to="@x", document=dict(BASE, input={"data": 1}))
    with pytest.raises(UsageError, match="given: priority, depends_on"):
        client.create(document=dict(BASE, input={"data": 1}), priority="high", depends_on=["d"])
    with pytest.raises(UsageError):
        client.create()


@pytest.mark.parametrize("data", [b"x", {1}, object(), math.nan, "\ud800"],
                         ids=["bytes", "set", "object", "nan", "surrogate"])
def test_a_document_holding_what_json_cannot_is_refused_as_data_is(client: Client,
                                                                   data: Any) -> None:
    with pytest.raises(UsageError, match="^document must be JSON data"):
        client.create(document=dict(BASE, input={"data": data}))
    with pytest.raises(UsageError, match="^data must be JSON data"):
        client.create(to="@x", data=data)


def test_an_empty_handoff_id_is_unsafe_not_replaced(client: Client) -> None:
    for if_absent in (False, True):
        with pytest.raises(InvalidDocument) as raised:
            client.create(to="@x", data=1, handoff_id="", if_absent=if_absent)
        assert raised.value.code == ErrorCode.UNSAFE_ID
    assert client.list() == []


def test_the_root_must_be_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        Client(5)  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="does not exist"):
        Client(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()


ASYNC_CANCEL = """
import asyncio, sys, threading
from handoffd import Client

async def main():
    handle = Client(sys.argv[1], agent="@me").create("@nobody", {"x": 1})
    task = asyncio.create_task(handle.wait_async(None))
    await asyncio.sleep(0.3)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        print("cancelled")

asyncio.run(main())  # (joins the default executor's threads: the wait's among them)
print("threads left:", threading.active_count())
"""


def test_a_cancelled_wait_async_ends_its_thread(tmp_path: Path) -> None:
    """Found by review 14g: the worker thread of a cancelled ``wait_async`` waited out its
    timeout (None: for ever), and ``asyncio.run`` returned only after it."""
    Workspace(tmp_path).ensure()
    done = subprocess.run([sys.executable, "-c", ASYNC_CANCEL, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cancelled", "threads", "left:", "1"], done.stdout


def test_context_keys_whose_files_clash_are_refused(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    ws.ensure()
    store = ContextStore(ws)
    store.set("x", 1, agent="@a")
    with pytest.raises(InvalidDocument) as raised:
        store.set("x.json/y", 2, agent="@a")
    assert raised.value.code == ErrorCode.INVALID_CONTEXT_KEY
    with pytest.raises(KeyError):
        store.get("x.json/y")
    store.set("a.json/b", 1, agent="@a")
    with pytest.raises(InvalidDocument) as raised:
        store.set("a", 2, agent="@a")
    assert raised.value.code == ErrorCode.INVALID_CONTEXT_KEY
    with pytest.raises(KeyError):  # a folder of other keys: not set (review 14g), as x.json/y
        store.get("a")
    assert store.get_with_revision("a.json/b") == (1, 1) and store.revision("a") == 0
    assert store.get("x") == 1 and store.get("a.json/b") == 1


def test_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    Workspace(root).ensure()
    env = dict(os.environ, PATH=f"{Path(exe('handoff')).parent}:{os.environ.get('PATH', '')}")
    env.pop("HANDOFFD_ROOT", None)

    def handoff(*args: str, cwd: Path = root) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe("handoff"), *args], cwd=cwd, env=dict(env, PWD=str(cwd)),
                              capture_output=True, text=True, timeout=60)

    assert handoff("context", "set", "x", "1").returncode == 0
    clash = handoff("context", "set", "x.json/y", "2")
    assert clash.returncode == 1 and len(clash.stderr.splitlines()) == 1, clash
    assert "cannot be written" in clash.stderr
    gone = tmp_path / "gone"
    gone.mkdir()
    # a shell whose current directory was deleted: the child starts there, then it goes
    waited = subprocess.run(["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" wait x',
                             exe("handoff")], env=dict(env, PWD=str(gone)),
                            capture_output=True, text=True, timeout=60)
    assert waited.returncode == 3, waited
    assert len(waited.stderr.splitlines()) == 1 and str(gone) in waited.stderr, waited.stderr
