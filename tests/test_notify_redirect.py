"""A webhook that answers with a redirect has not received the document: urllib followed a 302
with a GET (no body), whose 200 counted as delivered. A 3xx is a failed attempt (retried, then
dead-lettered), through a real `handoffd run` and a local HTTP server."""
from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Iterator

import pytest
from conftest import FLAKY_TOML, Workspace


class Moved(http.server.BaseHTTPRequestHandler):
    """Answers every POST with ``code`` to /elsewhere; records every request, and answers a GET
    200 (what a followed redirect would reach)."""

    seen: list[tuple[str, str]] = []
    code = 302

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(("POST", self.path))
        self.send_response(self.code)
        self.send_header("Location", "/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(("GET", self.path))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(params=[301, 302, 303, 307])
def moved(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    seen: list[tuple[str, str]] = []
    handler = type("Recorder", (Moved,), {"seen": seen, "code": request.param})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_redirect_is_a_failed_delivery_never_followed(
        ws: Workspace, moved: tuple[str, list[tuple[str, str]]]) -> None:
    url, seen = moved
    ws.write_config(FLAKY_TOML + f"""
[[on_filed]]
url = "{url}/hook"
retries = 1
retry_delay_seconds = 0.05
timeout_seconds = 5
""")
    hid = ws.create("--to", "@flaky", "--data", json.dumps({"mode": "ok"}))
    proc = ws.handoffd("run")
    assert proc.returncode == 0, proc.stderr
    assert seen == [("POST", "/hook"), ("POST", "/hook")]  # tried twice, never followed
    (letter,) = (ws.root / "handoffs/.meta/notify-dead-letters.jsonl").read_text().splitlines()
    record = json.loads(letter)
    assert record["id"] == hid and "answered 3" in record["error"]
    assert "redirect: not followed" in record["error"]
