"""`handoffd serve` under systemd's notify protocol, with this test playing systemd on a Unix
datagram socket; and the service files in contrib/."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import Workspace, exe

CONTRIB = Path(__file__).parent.parent / "contrib"


def test_ready_watchdog_and_stopping(ws: Workspace, tmp_path: Path) -> None:
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(address)
        sock.settimeout(20)
        env = {**os.environ, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000"}
        daemon = subprocess.Popen([exe("handoffd"), "serve", "--root", str(ws.root)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            messages = [sock.recv(4096).decode()]
            assert messages[0].startswith("READY=1\nSTATUS=serving "), messages
            deadline = time.monotonic() + 20
            while not any("WATCHDOG=1" in m for m in messages):  # pinged from the main loop
                assert time.monotonic() < deadline, messages
                messages.append(sock.recv(4096).decode())
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=30) == 0
            while not any(m.startswith("STOPPING=1") for m in messages):
                messages.append(sock.recv(4096).decode())
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait(timeout=10)


def test_the_service_files_say_what_the_daemon_does() -> None:
    unit = (CONTRIB / "handoffd.service").read_text()
    for line in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "WatchdogSec=60"):
        assert f"\n{line}\n" in unit, line
    assert "ExecStart=/usr/local/bin/handoffd serve --root /srv/agents" in unit
    cron = (CONTRIB / "crontab.example").read_text()
    assert "handoffd run --max-seconds 50" in cron and "timeout 55" in cron
