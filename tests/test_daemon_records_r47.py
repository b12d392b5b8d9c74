"""Three defects of the serving records (``handoffs/.meta/serving/``) a reviewer found (R47).

1. A host of the same host name (containers, cloned machines; the init namespaces' ids are the
   same on every host) took another's live record for one of its own dead daemons and removed
   it at once: the boot id was only inside the hashed mark. A record now names its boot id, and
   is judged as this host's only when host name, namespaces and boot id all match.
2. A renewal opened ``.meta/serving`` by path: a ``.meta`` swapped for a symlink sent the
   record (and the removal of record-named files) outside the workspace. Each folder is now
   opened from the one before without following a link; a renewal that finds none writes
   nothing.
3. A file under a record's name dated more than a day ahead was never removed, and removable
   junk past the first 4,096 names (or past 256 reads) hid the live record from ls.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Workspace, exe, new_workspace, wait_until
from test_daemon_records_s26 import (CONFIG, DAY, RealLast, home, record_body,  # noqa: F401
                                     set_age, sleeper, sleepers)

from handoffd.core.workspace import Workspace as HandoffdWorkspace
from handoffd.service import daemon_records
from handoffd.service.daemon_records import ServingRecord, stale_daemons

OTHER_BOOT = "00000000-1111-2222-3333-444444444444"


# ---------------------------------------------------------------- 1: a host of the same name
def test_a_record_of_another_boot_is_judged_by_the_day_rule_not_removed_at_once(
        home: HandoffdWorkspace, sleepers: list[subprocess.Popen[bytes]]) -> None:
    folder = home.meta / daemon_records.FOLDER

    def plant(name: str, text: str, age: float) -> str:
        (folder / name).write_text(text)
        set_age(folder / name, age)
        return name

    # a live daemon of a host of the same name: its pid may be a live process here too, whose
    # mark (this boot's) is not the record's
    pid, _ = sleeper(sleepers)
    theirs = "e" * 16  # (the mark of that host's process: never this one's)
    older = json.loads(record_body(4_000_002, "c" * 16))
    del older["boot"]  # (an older handoffd's record: no boot id)
    kept = {
        plant(f"{pid}.{theirs[:12]}.json", record_body(pid, theirs, boot=OTHER_BOOT), 60),
        plant("4000001.dddddddddddd.json", record_body(4_000_001, "d" * 16, boot=OTHER_BOOT), 60),
        plant("4000002.cccccccccccc.json", json.dumps(older), 60),
    }
    gone = {
        plant("4000003.bbbbbbbbbbbb.json", record_body(4_000_003, "b" * 16), 60),  # ours, dead
        plant("4000004.aaaaaaaaaaaa.json",
              record_body(4_000_004, "a" * 16, boot=OTHER_BOOT), 2 * DAY),  # unrenewed a day
        plant("4000005.999999999999.json", json.dumps(older), 2 * DAY),
    }
    record = ServingRecord(home, None)
    record.write()  # a serve's start: removes the dead
    try:
        names = {path.name for path in folder.iterdir()}
        assert kept <= names and not gone & names
        assert record.name is not None
        written = json.loads((folder / record.name).read_text())
        assert written["boot"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    finally:
        record.remove()


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Workspace]:
    workspace = new_workspace(tmp_path / "ws", CONFIG)
    yield workspace
    workspace.cleanup()


def test_two_serves_of_one_host_name_and_two_boot_ids_keep_each_others_records(
        ws: Workspace, tmp_path: Path) -> None:
    """The reviewer's reproduction: a second ``serve`` in a mount namespace of its own where
    /proc/sys/kernel/random/boot_id is another file (same host name, same namespaces' ids)."""
    fake = tmp_path / "boot_id"
    fake.write_text(OTHER_BOOT + "\n")
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount --bind {fake} /proc/sys/kernel/random/boot_id && "
                            "cat /proc/sys/kernel/random/boot_id"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or probe.stdout.strip() != OTHER_BOOT:
        pytest.skip(f"no mount namespace to fake a boot id in: {probe.stderr.strip()}")
    folder = ws.root / "handoffs" / ".meta" / "serving"
    first = ws.serve()
    wait_until(lambda: list(folder.glob(f"{first.pid}.*.json")), what="the first record")
    # the other "host": exec'd, so its pid is the one Popen gives
    other = subprocess.Popen(["unshare", "-m", "sh", "-c",
                              f"mount --bind {fake} /proc/sys/kernel/random/boot_id && "
                              f"exec {exe('handoffd')} serve --root {ws.root}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    ws.daemons.append(other)  # (killed by its pid at cleanup)
    try:
        wait_until(lambda: list(folder.glob(f"{other.pid}.*.json")), what="the other's record")
        # its start removed the dead: the first's record is another boot's, kept
        assert list(folder.glob(f"{first.pid}.*.json"))
        first_record = json.loads(next(folder.glob(f"{first.pid}.*.json")).read_text())
        other_record = json.loads(next(folder.glob(f"{other.pid}.*.json")).read_text())
        assert other_record["boot"] == OTHER_BOOT != first_record["boot"]
        assert other_record["host"] == first_record["host"]
    finally:
        assert ws.stop(other, signal.SIGTERM) == 0
        assert ws.stop(first, signal.SIGTERM) == 0


# ---------------------------------------------------------------- 2: a symlinked .meta
def test_a_renewal_never_writes_nor_removes_through_a_symlinked_meta(
        home: HandoffdWorkspace, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    record = ServingRecord(home, None, clock=lambda: now[0])
    record.write()
    assert record.name is not None
    outside = tmp_path / "outside"
    (outside / "serving").mkdir(parents=True)
    planted = []
    for name, age in (("4000001.dddddddddddd.json", 60), ("4000002.cccccccccccc.json", 2 * DAY)):
        path = outside / "serving" / name  # removable, were they in the workspace
        path.write_text(record_body(int(name.split(".")[0]), "d" * 16))
        set_age(path, age)
        planted.append(name)
    home.meta.rename(tmp_path / "meta-aside")
    home.meta.symlink_to(outside)  # (swapped in while the daemon serves)
    now[0] += daemon_records.RENEW_SECONDS
    with caplog.at_level(logging.WARNING, logger="handoffd"):
        record.renew()
    assert sorted(path.name for path in (outside / "serving").iterdir()) == planted
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(home.meta) in warned[0] and "not renewed" in warned[0]

    # no folder made outside either (mkdir(parents=True) followed the link)
    for path in (outside / "serving").iterdir():
        path.unlink()
    (outside / "serving").rmdir()
    now[0] += daemon_records.RENEW_SECONDS
    record.renew()
    record.write()  # (a serve's start through it: refused too)
    assert list(outside.iterdir()) == []

    # nor a removal: its stop unlinks nothing there
    (outside / "serving").mkdir()
    (outside / "serving" / record.name).write_text("{}")
    record.remove()
    assert (outside / "serving" / record.name).exists()


# ---------------------------------------------------------------- 3: future junk, hiding junk
def test_files_dated_more_than_a_day_ahead_are_removed(home: HandoffdWorkspace) -> None:
    folder = home.meta / daemon_records.FOLDER
    ahead = {"5000001.000000000001.json": "{junk",
             "5000002.000000000002.json": record_body(5_000_002, "2" * 16, host="another-host"),
             ".5000003.000000000003.json.abcdef.tmp": "{"}
    for name, text in ahead.items():
        (folder / name).write_text(text)
        set_age(folder / name, -2 * DAY)
    (folder / "5000004.000000000004.json").symlink_to("/dev/zero")  # (unlinked, never opened)
    set_age(folder / "5000004.000000000004.json", -2 * DAY)
    (folder / "5000005.000000000005.json").write_text("{junk")
    set_age(folder / "5000005.000000000005.json", -DAY / 2)  # (within the day: kept)
    record = ServingRecord(home, None)
    record.write()
    try:
        names = {path.name for path in folder.iterdir()}
        assert names == {record.name, "5000005.000000000005.json"}
    finally:
        record.remove()


def test_thousands_of_removable_junk_names_listed_first_never_hide_the_live_record(
        home: HandoffdWorkspace, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = home.meta / daemon_records.FOLDER
    count = daemon_records.MAX_ENTRIES + 1000
    for n in range(count):
        path = folder / f"{6_000_000 + n}.{n:012x}.json"
        path.write_text("{junk" if n % 2 else record_body(6_000_000 + n, f"{n:016x}",
                                                          host="another-host"))
        set_age(path, 2 * DAY if n % 3 else -2 * DAY)  # (unrenewed for a day, or a day ahead)
    monkeypatch.setattr(os, "scandir", RealLast(os.scandir))  # (our record listed last)
    record = ServingRecord(home, (0, 0, 0, 0))  # (not the file there now: a stale daemon)
    record.write()  # a serve's start removes them all, not 256 of them
    try:
        assert stale_daemons(home) == [os.getpid()]
        assert [path.name for path in folder.iterdir()] == [record.name]
    finally:
        record.remove()
