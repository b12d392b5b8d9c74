"""A webhook attempt's HTTP: urllib's opener with connections a :class:`~.webhook.Cutoff` can
shut down, and no redirect followed.

Kept apart from :mod:`.webhook` because ``urllib.request`` and ``http.client`` bring ``ssl`` and
``email`` with them (about 20 ms at every daemon start): they are loaded by the first delivery,
and a daemon without a webhook rule never loads them.
"""
from __future__ import annotations

import functools
import http.client
import socket
import urllib.error
import urllib.request
from typing import Any, Callable, Protocol


class Cutoff(Protocol):
    """What the connections here need of :class:`.webhook.Cutoff` (which imports this module
    at its first attempt: this one does not import it)."""

    sent: bool  # set once the whole request is out: it may have been delivered

    def opened(self, sock: socket.socket) -> socket.socket:
        """Keep a way to shut ``sock`` down; refuse it when the attempt is already over."""


def attempt(cutoff: Cutoff, request: urllib.request.Request, timeout: float,
            shown: str) -> tuple[str | None, bool]:
    """POST ``request`` under ``cutoff``: the problem (None: delivered), and whether the server
    answered at all."""
    opener = urllib.request.build_opener(_CutoffHTTPHandler(cutoff), _CutoffHTTPSHandler(cutoff),
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
