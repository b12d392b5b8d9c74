"""Webhook delivery: one signed HTTP POST of the filed document, the whole attempt bounded.

``timeout_seconds`` bounds a whole attempt (connect, send, and the answer's status line and
headers): the attempt runs on a thread of its own and its sockets are shut down at the deadline,
even when the server trickles its answer a byte at a time (urllib's own timeout bounds each
socket read, so such a server once held the one delivery thread for as long as it liked)."""
from __future__ import annotations

import functools
import hashlib
import hmac
import http.client
import os
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, Callable

from ...core.config import NotifyRule
from ...core.states import State


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
        opener = urllib.request.build_opener(_CutoffHTTPHandler(self), _CutoffHTTPSHandler(self),
                                             _NoRedirect())
        try:
            with opener.open(request, timeout=timeout) as answer:
                status = answer.status
        except urllib.error.HTTPError as exc:  # (before OSError: it is one)
            moved = " (a redirect: not followed)" if 300 <= exc.code < 400 else ""
            return f"{shown} answered {exc.code}{moved}", True
        except (OSError, ValueError, http.client.HTTPException) as exc:  # a bad status line too
            return f"{shown}: {exc or type(exc).__name__}", False
        except Exception as exc:  # on this thread a traceback would reach the user's terminal
            return f"{shown}: {type(exc).__name__}: {exc}", False
        return (None if 200 <= status < 300 else f"{shown} answered {status}"), True

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


class _CutoffConnection(http.client.HTTPConnection):
    """An HTTP connection whose sockets its :class:`Cutoff` can shut down, and which tells it
    when the whole request is out."""

    _create_connection: Callable[..., socket.socket]  # (http.client's own hook to open sockets)

    def __init__(self, *args: Any, cutoff: Cutoff, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cutoff = cutoff
        opener = self._create_connection
        self._create_connection = lambda *a, **kw: cutoff.opened(opener(*a, **kw))

    def getresponse(self) -> http.client.HTTPResponse:
        self.cutoff.sent = True  # urllib asks for the answer once the request is sent
        return super().getresponse()


class _CutoffHTTPSConnection(_CutoffConnection, http.client.HTTPSConnection):
    """The same over TLS (a handshake blocked on a trickling server is cut off too)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is a failed delivery: followed, the POST became a GET without the document,
    whose 200 counted as delivered."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> None:
        return None  # urllib then raises HTTPError with the 3xx code


class _CutoffHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, cutoff: Cutoff) -> None:
        super().__init__()
        self.cutoff = cutoff

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_CutoffConnection, cutoff=self.cutoff), req)


class _CutoffHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, cutoff: Cutoff) -> None:
        super().__init__()
        self.cutoff = cutoff

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_CutoffHTTPSConnection, cutoff=self.cutoff), req)
