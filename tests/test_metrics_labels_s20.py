"""Prometheus label values carry no control characters (session 20, review R24 #3).

An agent named with ESC [2J, an OSC 52 clipboard write and a right-to-left override came out of
`handoffd metrics`, the endpoint and the textfile raw (prometheus-client escapes only \\, " and
a newline): a terminal showing the scrape was cleared and its clipboard written. Every other
command printed it escaped; the labels now are too, the same way."""
from __future__ import annotations

import json

from conftest import Workspace
from test_metrics_rates_review15 import append_events, samples, ws  # noqa: F401

HOSTILE = "@x\x1b[2J\x1b]52;c;SGVsbG8=\x07\u202eevil"


def test_a_hostile_agent_name_is_escaped_in_the_labels(ws: Workspace) -> None:  # noqa: F811
    append_events(ws, [json.dumps({"at": "2026-11-27T00:00:00.000Z", "event": "failed",
                                   "id": "h1", "agent": HOSTILE, "code": "CANCELLED", "state": "failed",
                                   "seconds": 1})])
    once = ws.handoffd("metrics")
    assert once.returncode == 0, once.stderr
    assert all(ch.isprintable() or ch in "\n" for ch in once.stdout), repr(once.stdout)
    agents = {dict(labels).get("agent") for (name, labels) in samples(once.stdout)
              if name == "handoffd_failures_total"}
    assert "@x\\x1b[2J\\x1b]52;c;SGVsbG8=\\x07\\u202eevil" in agents, agents
