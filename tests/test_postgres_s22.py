"""A file dropped for the PostgreSQL bridge is never ingested (run) twice (session 22, helper P3).

A file the bridge ingested but could not remove (its process killed between the insert's commit
and the file's removal) was ingested again when its row was gone by the next ingest: set aside
before its failure stub was filed (or set aside without one), or run and purged. The ingest now
writes a receipt of the very file (its identity and digest) in the insert's transaction, and a
left-over copy is known by it: removed, never run again. A new drop of the same document is a
new file: still ingested.

Every test takes a fresh database of the session's throw-away cluster."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Workspace
from test_postgres import backend, request, sql
from test_postgres_hostile import bridge, local_store

from handoffd.core.states import State
from handoffd.core.timeutil import utc_now


class Killed(BaseException):
    """Stands for a kill -9 between the insert's commit and the file's removal."""


def killed_before_removal(files: Any, handoff_id: str) -> None:
    """Ingest ``handoff_id`` with the process "killed" just before its file is removed."""
    real = files._remove_if_same

    def die(*_args: Any, **_kwargs: Any) -> bool:
        raise Killed()

    files._remove_if_same = die
    try:
        with pytest.raises(Killed):
            files.ingest(handoff_id)
    finally:
        files._remove_if_same = real


def ingested_events(url: str, handoff_id: str) -> int:
    return int(sql(url, "SELECT count(*) FROM handoffd.events WHERE handoff_id = %s "
                        "AND event = 'ingested'", handoff_id)[0][0])


def left_over(tmp_path: Path, pg_url: str, handoff_id: str, doc: dict[str, Any]
              ) -> tuple[Any, Any, Workspace]:
    """A database, a bridge of a new workspace, and the workspace, where ``doc`` was dropped
    and ingested by a process killed before it removed the file (still in pending/)."""
    db = backend(pg_url)
    files = bridge(db, local_store(tmp_path / "ws"))
    space = Workspace(tmp_path / "ws")
    space.drop(f"{handoff_id}.json", doc)
    killed_before_removal(files, handoff_id)
    assert space.state_of(handoff_id) == ["pending"]
    return db, bridge(db, local_store(tmp_path / "ws")), space  # (a new process's bridge)


def test_a_left_over_file_set_aside_before_its_stub_is_not_ingested_again(
        tmp_path: Path, pg_url: str) -> None:
    db, files, space = left_over(tmp_path, pg_url, "bad-1", {
        "handoff_id": "bad-1", "source_agent": "@x", "target_agent": "@a", "input": {}})
    try:
        # the daemon's admission sets it aside (its row into the quarantine); its stub is not
        # filed yet (or never: a duplicate is set aside without one) when the file is met again
        assert db.set_aside("bad-1", State.PENDING, "UNKNOWN_FORMAT", "no format")
        assert files.ingest("bad-1") == "known"  # it was "ingested": a second row
        assert space.state_of("bad-1") == []
        assert sql(pg_url, "SELECT id FROM handoffd.handoffs") == []
        assert ingested_events(pg_url, "bad-1") == 1
        assert db.create_failed("bad-1", {"handoff_id": "bad-1", "status": "failed"})
    finally:
        db.close()


def test_a_left_over_file_run_and_purged_is_not_run_again(tmp_path: Path, pg_url: str) -> None:
    db, files, space = left_over(tmp_path, pg_url, "ok-1", request("ok-1"))
    try:
        sql(pg_url, "UPDATE handoffd.handoffs SET state = 'completed' WHERE id = 'ok-1'")
        assert db.purge("ok-1", State.COMPLETED, utc_now())
        assert files.ingest_all() == 0 and space.state_of("ok-1") == []
        assert sql(pg_url, "SELECT id FROM handoffd.handoffs") == []
        assert ingested_events(pg_url, "ok-1") == 0  # (the purge took its trail), not 1
        # the receipt of a file that is gone is pruned at the next pass
        files.ingest_all()
        assert sql(pg_url, "SELECT key FROM handoffd.records WHERE kind LIKE "
                           "'file-bridge ingested %%'") == []
    finally:
        db.close()


def test_a_new_drop_of_the_same_document_is_still_ingested(tmp_path: Path,
                                                           pg_url: str) -> None:
    db, files, space = left_over(tmp_path, pg_url, "ok-2", request("ok-2"))
    try:
        assert files.ingest("ok-2") == "known" and space.state_of("ok-2") == []
        sql(pg_url, "UPDATE handoffd.handoffs SET state = 'completed' WHERE id = 'ok-2'")
        assert db.purge("ok-2", State.COMPLETED, utc_now())
        sql(pg_url, "DELETE FROM handoffd.seen")  # (past the dedup window)
        space.drop("ok-2.json", request("ok-2"))  # the same document, dropped anew: a new file
        assert files.ingest("ok-2") == "ingested" and space.state_of("ok-2") == []
        assert sql(pg_url, "SELECT id, state FROM handoffd.handoffs") == [("ok-2", "pending")]
    finally:
        db.close()


# ---------------------------------------------------------------------------- item 2
def _engine(root: Path, url: str) -> Any:
    from conftest import FLAKY_TOML

    from handoffd import build_engine
    from handoffd.core.workspace import Workspace as HandoffdWorkspace
    root.mkdir()
    (root / "handoffd.toml").write_text(FLAKY_TOML + f'\n[store]\nurl = "{url}"\n')
    ws = HandoffdWorkspace(root)
    ws.ensure()
    return build_engine(ws, ws.load_config())


def _dependent(handoff_id: str, dep: str, now: Any) -> dict[str, Any]:
    from handoffd.core.native_format import new_native_request
    return new_native_request(source="@o", target="@flaky", data={"mode": "ok"}, now=now,
                              handoff_id=handoff_id, depends_on=[dep])
