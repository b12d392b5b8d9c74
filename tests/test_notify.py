"""Notifications when work is filed (`[[on_filed]]`), through a real `handoffd run`: a webhook to
a real local HTTP server (signed with HMAC-SHA256), a command with the document on stdin, filters
by state and agent, retries, and a dead letter after the last try."""
from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace

SECRET = "s3cret"


class Hooks(http.server.BaseHTTPRequestHandler):
    """Records every POST; answers 500 on /down, 200 elsewhere."""

    received: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append({"path": self.path, "headers": dict(self.headers), "body": body})
        self.send_response(500 if self.path == "/down" else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    handler = type("Recorder", (Hooks,), {"received": received})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", received
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_webhooks_and_commands_are_told_what_was_filed(
        ws: Workspace, tmp_path: Path, server: tuple[str, list[dict[str, Any]]]) -> None:
    url, received = server
    script = tmp_path / "record.py"
    script.write_text("import os, sys\n"
                      "open(os.environ['HANDOFF_ID'] + '.notified', 'wb').write(sys.stdin.buffer.read())\n")
    ws.write_config(FLAKY_TOML.replace("[retry]", 'durability = "fast"\n\n[retry]') + f"""
[[on_filed]]
url = "{url}/all"
secret = "{SECRET}"

[[on_filed]]
url = "{url}/failures"
states = ["failed"]
agents = ["@flaky"]

[[on_filed]]
command = ["{sys.executable}", "{script}"]
states = ["completed"]

[[on_filed]]
url = "{url}/down"
states = ["completed"]
retries = 2
retry_delay_seconds = 0.05
""")
    ok = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    bad = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "permanent"}))
    proc = ws.handoffd("run")  # a batch delivers before it exits
    assert proc.returncode == 1, proc.stderr
    by_path: dict[str, list[dict[str, Any]]] = {}
    for item in received:
        by_path.setdefault(item["path"], []).append(item)
    assert sorted(h["headers"]["X-Handoffd-Id"] for h in by_path["/all"]) == sorted([ok, bad])
    for hit in by_path["/all"]:
        expected = hmac.new(SECRET.encode(), hit["body"], hashlib.sha256).hexdigest()
        assert hit["headers"]["X-Handoffd-Signature"] == f"sha256={expected}"
        doc = json.loads(hit["body"])
        assert doc["handoff_id"] == hit["headers"]["X-Handoffd-Id"]
        assert hit["headers"]["X-Handoffd-State"] == ("completed" if doc["handoff_id"] == ok
                                                      else "failed")
    assert [h["headers"]["X-Handoffd-Id"] for h in by_path["/failures"]] == [bad]
    assert "X-Handoffd-Signature" not in by_path["/failures"][0]["headers"]  # no secret
    notified = json.loads((ws.root / f"{ok}.notified").read_bytes())
    assert notified["handoff_id"] == ok and notified["status"] == "completed"
    assert not (ws.root / f"{bad}.notified").exists()
    assert len(by_path["/down"]) == 3  # the first try and two retries
    (letter,) = (ws.root / "handoffs" / ".meta" / "notify-dead-letters.jsonl").read_text().splitlines()
    record = json.loads(letter)
    assert record["id"] == ok and "answered 500" in record["error"]


def test_a_bad_rule_is_a_configuration_error(ws: Workspace) -> None:
    ws.write_config(FLAKY_TOML + '\n[[on_filed]]\nurl = "ftp://example"\n')
    proc = ws.handoffd("run")
    assert proc.returncode == 2 and "url must be an http" in proc.stderr


@pytest.mark.heavy
def test_a_cancel_from_the_command_line_delivers_retries_and_dead_letters(
        ws: Workspace, tmp_path: Path) -> None:
    """Found by the third bug hunt: `handoff cancel` files the handoff in its own process, which
    exited at once, so a failing notification was neither retried nor dead-lettered, and a
    hanging command outlived it (its timeout never applied). The process now drains its
    notices at exit, as a stopping daemon does."""
    import subprocess
    import time
    runs = tmp_path / "runs.txt"
    failing = json.dumps([sys.executable, "-c",
                          f"import sys; open({str(runs)!r}, 'a').write('run\\n'); sys.exit(7)"])
    marker = f"cli-drain-sleeper-{os.urandom(6).hex()}"  # (pgrep must see no other test's)
    hang = json.dumps([sys.executable, "-c", "import time; time.sleep(600)", marker])
    ws.write_config(f"""
[[on_filed]]
command = {failing}
states = ["failed"]
retries = 2
retry_delay_seconds = 0.05

[[on_filed]]
command = {hang}
states = ["failed"]
retries = 3
timeout_seconds = 600
""")
    handoff_id = ws.create("--to", "@nobody", "--data", "{}")
    started = time.monotonic()
    done = ws.handoff("cancel", handoff_id, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 40  # bounded by the drain (10 s), not by the 600 s
    assert runs.read_text().count("run") == 3  # one try and two retries
    letters = [json.loads(line) for line in
               (ws.root / "handoffs" / ".meta" / "notify-dead-letters.jsonl").read_text().splitlines()]
    assert [letter["error"].split(":")[0] for letter in letters] == ["command", "command"], letters
    assert "exited 7" in letters[0]["error"]
    assert "not tried again" in letters[1]["error"]  # killed at the drain, not retried 3 times
    assert "notification given up" in done.stderr
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert found.stdout.strip() == "", f"a notification command outlived `handoff cancel`: {found.stdout}"
