"""Every number of handoffd.toml is type-checked and bounded (handoffd/core/config.py).

A bad value is one line naming the key and what is allowed, exit 2 -- never a silent conversion
(``events = "false"`` once turned the event log on, ``max_document_bytes = 1.9`` became 1,
``workers = "3"`` became 3), never a daemon that stalls (``events_keep = 1e10`` at the first
rotation), spins (``rescan_seconds = 1e-300``) or recovers its own live claims
(``lease_seconds = 0.1``)."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from handoffd.backends.files.events import FileEventLog
from handoffd.core.config import (
    DAEMON_RULES, MAX_EVENTS_KEEP, DaemonSettings, RetryPolicy, load_config)
from handoffd.core.errors import ConfigError
from handoffd.core.workspace import Workspace as HandoffdWorkspace

from conftest import FLAKY_TOML, Workspace, exe

SPECIALIST = '[specialists."@x"]\ncommand = ["true"]\n'
NOTIFY = '[[on_filed]]\ncommand = ["true"]\n'

# (handoffd.toml, the key its one-line error must name)
BAD = [
    # the bug hunt's findings
    ("[daemon]\nevents_max_bytes = 4096\nevents_keep = 10000000000\n", "events_keep"),
    ("[daemon]\nlease_seconds = 0.1\n", "lease_seconds"),
    ("[daemon]\nlease_seconds = 1e-9\n", "lease_seconds"),
    ('[daemon]\nevents = "false"\n', "events"),
    ("[daemon]\nmax_document_bytes = 1.9\n", "max_document_bytes"),
    ('[daemon]\nworkers = "3"\n', "workers"),
    ("[daemon]\nrescan_seconds = 1e-300\n", "rescan_seconds"),
    ("[daemon]\nsweep_seconds = 1e-300\n", "sweep_seconds"),
    ("[daemon]\nstall_seconds = 1e-300\n", "stall_seconds"),
    # the rest of [daemon]
    ("[daemon]\nworkers = true\n", "workers"),
    ("[daemon]\nworkers = 0\n", "workers"),
    ("[daemon]\nworkers = 1000000\n", "workers"),
    ("[daemon]\nworkers = 2.0\n", "workers"),
    ("[daemon]\nprocesses = 2.5\n", "processes"),
    ("[daemon]\nrescan_seconds = inf\n", "rescan_seconds"),
    ("[daemon]\nsweep_seconds = nan\n", "sweep_seconds"),
    ('[daemon]\nlease_seconds = "60"\n', "lease_seconds"),
    ("[daemon]\nlease_seconds = 1e300\n", "lease_seconds"),
    ("[daemon]\nsettle_seconds = -0.5\n", "settle_seconds"),
    ("[daemon]\nclaim_grace_seconds = true\n", "claim_grace_seconds"),
    ("[daemon]\ngrace_seconds = 1e12\n", "grace_seconds"),
    ("[daemon]\nmax_output_bytes = 10\n", "max_output_bytes"),
    ("[daemon]\nmax_output_bytes = 99999999999999\n", "max_output_bytes"),
    ("[daemon]\ndefault_timeout_seconds = 0\n", "default_timeout_seconds"),
    ("[daemon]\nseen_ttl_seconds = 0.001\n", "seen_ttl_seconds"),
    ("[daemon]\nevents = 1\n", "events"),
    ("[daemon]\nevents_max_bytes = 1e9\n", "events_max_bytes"),
    ("[daemon]\nevents_max_bytes = 100\n", "events_max_bytes"),
    ("[daemon]\nevents_keep = 0\n", "events_keep"),
    ("[daemon]\ndurability = 1\n", "durability"),
    ("[daemon]\nexpectations = true\n", "expectations"),
    ("[daemon]\nstall_seconds = 1979-05-27\n", "stall_seconds"),
    # [retry]
    ("[retry]\nmax_retries = 2.5\n", "max_retries"),
    ('[retry]\nmax_retries = "3"\n', "max_retries"),
    ("[retry]\nmax_retries = 100000\n", "max_retries"),
    ("[retry]\nretry_delay_seconds = true\n", "retry_delay_seconds"),
    ("[retry]\nretry_delay_seconds = 1e300\n", "retry_delay_seconds"),
    ("[retry]\nbackoff_multiplier = 0.5\n", "backoff_multiplier"),
    ("[retry]\nmax_retrys = 3\n", "max_retrys"),
    # [store], [retention]
    ("[store]\npool_size = 2.0\n", "pool_size"),
    ('[store]\nreconnect_seconds = "60"\n', "reconnect_seconds"),
    ("[retention]\nevery = 0.5\n", "every"),
    ("[retention]\nmode = 1\n", "mode"),
    # a specialist
    (SPECIALIST + "concurrency = 1.5\n", "concurrency"),
    (SPECIALIST + "concurrency = 100000\n", "concurrency"),
    (SPECIALIST + "timeout_seconds = 1e-300\n", "timeout_seconds"),
    (SPECIALIST + 'timeout_seconds = "30"\n', "timeout_seconds"),
    (SPECIALIST + 'retry = { max_retries = "2" }\n', "max_retries"),
    (SPECIALIST + "retry = { backoff_multiplier = 1e9 }\n", "backoff_multiplier"),
    (SPECIALIST + "env = 3\n", "env"),
    (SPECIALIST + "env = { N = 3 }\n", "env"),
    (SPECIALIST + "cwd = 3\n", "cwd"),
    ("specialists = 3\n", "specialists"),
    # [[on_filed]]
    (NOTIFY + "retries = true\n", "retries"),
    (NOTIFY + "retries = 21\n", "retries"),
    (NOTIFY + "timeout_seconds = 0\n", "timeout_seconds"),
    (NOTIFY + "retry_delay_seconds = 1e-300\n", "retry_delay_seconds"),
    (NOTIFY + "states = [[1]]\n", "states"),
]


# through the installed command (~0.15 s each): the bug hunt's nine, and one of each other kind
# of mistake in each section; test_load_config_refuses_it takes every case of BAD in-process
THROUGH_THE_CLI = BAD[:9] + [case for case in BAD if case[0] in (
    "[daemon]\nworkers = true\n", "[daemon]\nrescan_seconds = inf\n",
    "[daemon]\nprocesses = 2.5\n", "[daemon]\nexpectations = true\n",
    "[retry]\nmax_retries = 2.5\n", "[retry]\nmax_retrys = 3\n", "[store]\npool_size = 2.0\n",
    "[retention]\nmode = 1\n", SPECIALIST + "concurrency = 100000\n", SPECIALIST + "env = 3\n",
    "specialists = 3\n", NOTIFY + "states = [[1]]\n", NOTIFY + "retries = true\n")]


def _id(case: tuple[str, str]) -> str:
    return re.sub(r"\s+", " ", case[0].replace(SPECIALIST, "@x ").replace(NOTIFY, "on_filed "))


@pytest.mark.parametrize("toml, key", THROUGH_THE_CLI, ids=[_id(c) for c in THROUGH_THE_CLI])
def test_handoffd_run_refuses_it_in_one_line(tmp_path: Path, toml: str, key: str) -> None:
    (tmp_path / "handoffd.toml").write_text(toml)
    done = subprocess.run([exe("handoffd"), "run", "--root", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert key in lines[0] and "handoffd.toml" in lines[0], lines[0]
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    assert not (tmp_path / "handoffs").exists() or not list((tmp_path / "handoffs").rglob("*.json"))


@pytest.mark.parametrize("toml, key", BAD, ids=[_id(c) for c in BAD])
def test_load_config_refuses_it(tmp_path: Path, toml: str, key: str) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert key in str(caught.value) and "\n" not in str(caught.value)


# ------------------------------------------------------------------ the rules, key by key
def test_every_daemon_setting_has_a_rule_and_its_default_keeps_it(tmp_path: Path) -> None:
    names = [f.name for f in dataclasses.fields(DaemonSettings)]
    assert sorted(DAEMON_RULES) == sorted(names)
    defaults = DaemonSettings()
    path = tmp_path / "handoffd.toml"
    lines = []
    for name in names:
        value = getattr(defaults, name)
        if name == "processes":
            value = "auto"
        lines.append(f"{name} = {json.dumps(value)}")
    path.write_text("[daemon]\n" + "\n".join(lines) + "\n")
    assert load_config(path).daemon == defaults


def _numeric_rules() -> list[tuple[str, str, float, float]]:
    return [(name, kind, low, high) for name, (kind, low, high) in DAEMON_RULES.items()
            if kind in ("int", "seconds")]


def _daemon(tmp_path: Path, name: str, literal: str) -> DaemonSettings:
    path = tmp_path / "handoffd.toml"
    path.write_text(f"[daemon]\n{name} = {literal}\n")
    return load_config(path).daemon


def _literal(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@pytest.mark.parametrize("name, kind, low, high", _numeric_rules())
def test_the_bounds_themselves_are_accepted(tmp_path: Path, name: str, kind: str, low: float,
                                            high: float) -> None:
    for value in (low, high):
        literal = _literal(int(value) if kind == "int" else float(value))
        got = getattr(_daemon(tmp_path, name, literal), name)
        assert got == value and type(got) is (int if kind == "int" else float)


@pytest.mark.parametrize("name, kind, low, high", _numeric_rules())
def test_beyond_the_bounds_and_the_wrong_types_are_refused(tmp_path: Path, name: str, kind: str,
                                                           low: float, high: float) -> None:
    if kind == "int":
        bad = [str(int(low) - 1), str(int(high) + 1), f"{int(low)}.5", f"{float(low + 1)!r}",
               f'"{int(low)}"', "true", "-1"]
    else:
        bad = [repr(low / 2) if low else "-0.001", repr(high * 2), f'"{low}"', "true", "nan",
               "inf", "-inf", "-1", "[1]"]
    for literal in bad:
        with pytest.raises(ConfigError) as caught:
            _daemon(tmp_path, name, literal)
        message = str(caught.value)
        assert f"[daemon] {name}" in message and "\n" not in message, (literal, message)
        assert ".." in message, message  # the allowed range is named


def test_the_range_is_named_in_the_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("lease_seconds = 0.1 is outside the allowed "
                                                    "range 1..315576000 seconds")):
        _daemon(tmp_path, "lease_seconds", "0.1")
    with pytest.raises(ConfigError, match=re.escape("events_keep = 10000000000 is outside the "
                                                    f"allowed range 1..{MAX_EVENTS_KEEP}")):
        _daemon(tmp_path, "events_keep", "10000000000")
    with pytest.raises(ConfigError, match=r"events = 'false' must be true or false"):
        _daemon(tmp_path, "events", '"false"')
    with pytest.raises(ConfigError, match=r"max_document_bytes = 1\.9 is not a whole number"):
        _daemon(tmp_path, "max_document_bytes", "1.9")


@pytest.mark.parametrize("name, literal, expected", [
    ("lease_seconds", "1", 1.0), ("lease_seconds", "30", 30.0), ("rescan_seconds", "0.01", 0.01),
    ("rescan_seconds", "0.2", 0.2), ("sweep_seconds", "0.2", 0.2), ("stall_seconds", "0.3", 0.3),
    ("settle_seconds", "0.0", 0.0), ("claim_grace_seconds", "0", 0.0), ("workers", "8", 8),
    ("events", "false", False), ("events_keep", "1000", 1000), ("max_document_bytes", "2048", 2048),
    ("processes", '"auto"', 0), ("processes", '"3"', 3), ("processes", "64", 64),
    ("durability", '"fast"', "fast"), ("expectations", '"advisory"', "advisory"),
])
def test_values_people_and_the_tests_use_are_accepted(tmp_path: Path, name: str, literal: str,
                                                      expected: Any) -> None:
    got = getattr(_daemon(tmp_path, name, literal), name)
    assert got == expected and type(got) is type(expected)


def test_the_test_suites_own_files_load(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text(FLAKY_TOML + "\n[retention]\ncompleted = \"7d\"\nevery = 1\n"
                    "\n[store]\npool_size = 8\nreconnect_seconds = 0\n"
                    "\n[[on_filed]]\ncommand = [\"true\"]\nretries = 2\nretry_delay_seconds = 0.05\n")
    config = load_config(path)
    assert config.daemon.lease_seconds == 30.0 and config.retry.max_retries == 2
    assert config.specialists["@flaky"].concurrency == 4
    assert config.on_filed[0].retry_delay_seconds == 0.05


def test_retry_tables_are_checked_strictly_but_documents_keep_their_leniency(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text("[retry]\nmax_retries = 0\nretry_delay_seconds = 0\nbackoff_multiplier = 1\n"
                    + SPECIALIST + "retry = { max_retries = 1000, retry_delay_seconds = 604800 }\n")
    config = load_config(path)
    assert config.retry == RetryPolicy(0, 0.0, 1.0)
    assert config.specialists["@x"].retry == RetryPolicy(1000, 604800.0, 1.0)
    # a document's retry_policy (not the file) still reads a hand-written "3" as 3
    assert RetryPolicy.from_dict({"max_retries": "3"}).max_retries == 3


def test_a_specialists_strings_stay_strings(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    path.write_text(SPECIALIST + 'env = { LOG_LEVEL = "info" }\ncwd = "sub"\ntimeout_seconds = 0.5\n'
                    "concurrency = 1024\n")
    spec = load_config(path).specialists["@x"]
    assert spec.env == {"LOG_LEVEL": "info"} and spec.cwd == "sub"
    assert spec.timeout_seconds == 0.5 and spec.concurrency == 1024


# ------------------------------------------------------------------ durations and rates
def test_a_workspace_whose_config_has_upper_case_units_still_works(ws: Workspace) -> None:
    """Found by review 14g: ``completed = "7D"``, ``rate = "100/H"`` and ``--older-than 1e3``,
    read before, failed every command after 14f (exit 2); only ``M`` stays refused."""
    ws.write_config('[retention]\ncompleted = "7D"\nfailed = "1e3"\nevery = "5 m"\n'
                    '[specialists."@a"]\ncommand = ["cat"]\nrate = "100/H"\n')
    created = ws.handoff("create", "--to", "@a", "--data", "1")
    assert created.returncode == 0, created.stderr
    assert ws.handoff("purge", "--older-than", "1e3").returncode == 0
    config = load_config(ws.root / "handoffd.toml")
    assert config.retention.completed == 7 * 86400 and config.retention.failed == 1000
    assert config.retention.every == 300
    assert str(config.specialists["@a"].rate) == "100/3600s"


def test_a_rates_error_names_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "handoffd.toml"
    for rate, why in (("100/M", "rate '100/M': its period 'M': use m for minutes; months are "
                                "not supported"),
                      ("5/1_0s", "rate '5/1_0s': its period '1_0s' must be")):
        path.write_text(SPECIALIST + f'rate = "{rate}"\n')
        with pytest.raises(ConfigError, match=re.escape(why)):
            load_config(path)


# ------------------------------------------------------------------ the event log's rotation
def test_a_huge_keep_never_reaches_the_rotation(tmp_path: Path) -> None:
    """Built directly (not from the file), a keep of 1e10 is held to MAX_EVENTS_KEEP: the
    rotation walks at most that many names and ends at once."""
    ws = HandoffdWorkspace(tmp_path)
    ws.ensure()
    log = FileEventLog(ws, max_bytes=4096, keep=10 ** 10)
    assert log.keep == MAX_EVENTS_KEEP
    started = time.monotonic()
    for n in range(200):  # ~100 bytes a line: several rotations
        log.append({"event": "test", "id": f"h{n}", "at": "2026-01-01T00:00:00Z", "pad": "x" * 60})
    assert time.monotonic() - started < 10
    assert log.rotated(1).exists()
    assert len(list(log.read())) == 200 and len(log.files()) <= MAX_EVENTS_KEEP + 1


# ------------------------------------------------------------------ the lower bound is safe
def test_the_shortest_lease_does_not_kill_a_healthy_daemons_work(ws: Workspace) -> None:
    """lease_seconds = 1 (the lower bound) with a sweep every 0.2 s: a 2.5 s job is renewed,
    not recovered as stalled, and completes at its first attempt."""
    ws.write_config(FLAKY_TOML.replace("lease_seconds = 30.0", "lease_seconds = 1")
                    .replace("sweep_seconds = 0.5", 'sweep_seconds = 0.2\ndurability = "fast"'))
    hid = ws.create("--to", "@flaky", "--data", '{"mode": "sleep", "seconds": 2.5}')
    daemon = ws.serve()
    try:
        assert ws.wait_state(hid, timeout=30) == "completed"
    finally:
        ws.stop(daemon)
    assert [r["attempt"] for r in ws.runs() if r["id"] == hid] == [1]
