"""Webhook delivery: one signed HTTP POST of the filed document, the whole attempt bounded.

``timeout_seconds`` bounds a whole attempt (connect, send, and the answer's status line and
headers): the attempt runs on a thread of its own and its sockets are shut down at the deadline,
even when the server trickles its answer a byte at a time (urllib's own timeout bounds each
socket read, so such a server once held the one delivery thread for as long as it liked)."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from typing import TYPE_CHECKING

from ...core.config import NotifyRule
from ...core.states import State

if TYPE_CHECKING:  # urllib.request and http.client (with ssl and email) are loaded by the
    import urllib.request  # first delivery, in :mod:`.webhook_http`: ~20 ms at every start



def shown_url(url: str | None) -> str | None:
    """``url`` as logs and dead letters show it: a password in it is replaced by ``***``."""
    if not url or "@" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unparsable url)"
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(parts._replace(netloc=netloc))


def webhook_request(rule: NotifyRule, handoff_id: str, state: State,
                    body: bytes) -> urllib.request.Request | str:
    """The signed POST of ``body`` (the document ``handoff_id`` was filed with in ``state``),
    or why it cannot be sent."""
    assert rule.url is not None
    headers = {"Content-Type": "application/json", "User-Agent": "handoffd",
               "X-Handoffd-Id": handoff_id, "X-Handoffd-State": state.value}
    secret = rule.secret or (os.environ.get(rule.secret_env) if rule.secret_env else None)
    if rule.secret_env and not secret:  # never sent unsigned when a signature is asked
        return f"secret_env {rule.secret_env} is not set: not sent unsigned"
    import urllib.request
    if secret:
        digest = hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
        headers["X-Handoffd-Signature"] = f"sha256={digest}"
    return urllib.request.Request(rule.url, data=body, headers=headers, method="POST")


class Cutoff:
    """One webhook attempt, made on a thread of its own so that it can be ended at its
    deadline or at a stop: urllib's timeout bounds each socket operation, not the attempt, and
    a server answering a byte a second held the delivery thread for as long as it liked. The
    attempt's sockets are shut down then (a duplicate of each is kept for that: shutting one
    down ends a read blocked on the other), which ends the attempt's thread too, and no socket
    is opened after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.cut: str | None = None  # why the attempt was ended, once it is
        self.outcome: list[str | None] = []  # what its thread found, if it ended before
        self.sent = False  # the whole request went out: it may have been delivered
        self.answered = False  # a status line came back (in the outcome kept)
        self.ended = threading.Event()  # the attempt finished, or was cut off

    def run(self, request: urllib.request.Request, timeout: float, shown: str) -> str | None:
        """Make the attempt, waiting at most ``timeout`` seconds: None when the webhook took
        it, else the problem."""
        threading.Thread(target=self._work, args=(request, timeout, shown),
                         name="handoffd-webhook", daemon=True).start()
        self.ended.wait(timeout)
        # from here its thread keeps nothing: an answer it still reads (headers cut short
        # read as complete to http.client) is no delivery
        self.cut_off(f"no answer within {timeout:g}s (timeout_seconds bounds the whole delivery)")
        with self.lock:
            if self.outcome:
                return self.outcome[0]
            return f"{shown}: {self.cut}"

    def _work(self, request: urllib.request.Request, timeout: float, shown: str) -> None:
        try:
            problem, answered = self._attempt(request, timeout, shown)
            with self.lock:
                if self.cut is None:  # (in time: the outcome counts)
                    self.outcome.append(problem)
                    self.answered = answered
        finally:
            self.ended.set()

    def _attempt(self, request: urllib.request.Request, timeout: float,
                 shown: str) -> tuple[str | None, bool]:
        """The problem (None: delivered), and whether the server answered at all."""
        from .webhook_http import attempt
        return attempt(self, request, timeout, shown)

    def opened(self, sock: socket.socket) -> socket.socket:
        """Keep a way to shut ``sock`` down; refuse it when the attempt is already over."""
        with self.lock:
            if self.cut is None:
                try:
                    self.socks.append(sock.dup())
                    return sock
                except OSError:
                    pass
        sock.close()
        raise ConnectionAbortedError("the delivery was cut off")

    def cut_off(self, why: str = "cut off before its answer came") -> None:
        """End the attempt (the first ``why`` is kept): its sockets are shut down, none is
        opened after, and what its thread finds later is not kept."""
        with self.lock:  # (shut under the lock: close() must not close one meanwhile)
            self.cut = self.cut or why
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.ended.set()

    def close(self) -> None:
        """The attempt is over, whatever its thread still does: cut it off, free the copies."""
        self.cut_off()
        with self.lock:
            socks, self.socks = self.socks, []
        for sock in socks:
            sock.close()
