"""systemd's notify protocol (``Type=notify``), without a dependency: datagrams to
``$NOTIFY_SOCKET`` saying READY, STOPPING, STATUS and, with ``WatchdogSec=``, WATCHDOG.

The watchdog is pinged from the daemon's main loop (at every rescan), so a loop that hangs stops
the pings and systemd restarts the service; ``WatchdogSec`` must therefore be more than twice
``rescan_seconds``.
"""
from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("handoffd")


class SystemdNotifier:
    """Sends state changes to the service manager that started this process."""

    def __init__(self, address: str, watchdog_seconds: float | None) -> None:
        # an address starting with "@" is in the abstract namespace
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_seconds = watchdog_seconds
        self.last_ping = 0.0

    @classmethod
    def from_env(cls) -> SystemdNotifier | None:
        """A notifier when systemd asked for notifications ($NOTIFY_SOCKET), else None."""
        address = os.environ.get("NOTIFY_SOCKET")
        if not address:
            return None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        watchdog = int(usec) / 1e6 if usec.isdigit() and (not pid or pid == str(os.getpid())) \
            else None
        return cls(address, watchdog)

    def send(self, *lines: str) -> bool:
        """Send ``KEY=value`` lines in one datagram; False (logged once) when it cannot."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(lines).encode("utf-8"), self.address)
            return True
        except OSError as exc:
            log.warning("cannot notify the service manager at %s: %s", self.address, exc)
            return False

    def ready(self, status: str) -> None:
        """The daemon serves."""
        self.send("READY=1", f"STATUS={status}")

    def stopping(self) -> None:
        """The daemon is stopping (its work handed back or finished)."""
        self.send("STOPPING=1", "STATUS=stopping")

    def watchdog(self) -> None:
        """A scan hook: ping the watchdog, at most twice per watchdog period."""
        if self.watchdog_seconds is None:
            return
        now = time.monotonic()
        if now - self.last_ping >= self.watchdog_seconds / 4:
            self.last_ping = now
            self.send("WATCHDOG=1")
