"""Connections to the PostgreSQL store: a pool with reconnection, and the LISTEN thread.

:class:`Database` runs each operation on a pooled connection in one transaction. A lost
connection (a restarted server, ``pg_terminate_backend``, a network cut) is retried with backoff
for up to ``reconnect_seconds``, with one log line when it is lost and one when it is back (one
each for all of a process's connections to the store: :class:`Outages`), and so is a first
connection that meets an outage (:func:`first_connection`); after
that the operation fails with :class:`StoreUnavailable` (an OSError: the daemon and the sweeper
already treat those as "try again later"). An operation whose commit may have happened before
the connection died is told so (``retried=True``) and checks its own fencing token first, so a
retry never applies a write twice. A pooled connection the server ended while it sat idle
(a restart) is passed over at checkout (:func:`_hung_up`: one ``poll``, no round trip), so
a retry does not take the dead ones one by one. Each attempt to connect is bounded by
``connect_timeout`` (``[store] connect_timeout_seconds``).

The window can be cut short, so that a lost server never holds a caller longer than it may
wait: :meth:`Database.interrupt` (a stopping daemon: retries give up within its grace) and
:func:`deadline` (a block of code, e.g. ``handoff wait --timeout``: retries in it give up at
the deadline). Waiting for a pooled connection is bounded by the same limits.

:class:`Listener` holds one dedicated connection that LISTENs on the wake-up channel. What it
hears is a hint only: when the connection drops it reconnects with backoff and tells its reader
``lost`` (rescan), because notifications sent meanwhile are gone.
"""
from __future__ import annotations

import collections
import contextvars
import functools
import logging
import math
import os
import re
import select
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ...core.errors import (ConfigError, HandoffdError, StartStopped, StoreUnavailable,
                            shortage_words)
from ...core.starting import start_by, stop_asked
from ...core.timeutil import connect_by
from ...core.timeutil import connect_timeout as bounded_connect
from .values import configure

log = logging.getLogger("handoffd")
# psycopg_pool logs every failed (re)connection attempt, several lines each; handoffd says it in
# one line of its own (Database, SessionThread), so the pool's are kept out of every output
logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]
CHANNEL = "handoffd"
# a long-lived idle connection notices a server that vanished without closing it (a crashed host,
# a cut network) within about 30 s instead of the kernel's two hours
# what a session thread's stop waits for it (SessionThread.stop, the key-holding session's): its
# connection attempts are bounded by as much, whatever [store] connect_timeout_seconds says, or
# an attempt hung in connect outlived a stop and ran on beside the next start (two LISTEN
# sessions, each notification heard twice: review RD, session 30)
SESSION_STOP_SECONDS = 5.0


def session_connect(configured: float) -> int:
    """libpq's connect_timeout (whole seconds, at least 1) for a session thread's connection:
    ``configured`` (``[store] connect_timeout_seconds``), at most :data:`SESSION_STOP_SECONDS`."""
    return max(int(min(configured, SESSION_STOP_SECONDS)), 1)


KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 15, "keepalives_interval": 5,
                              "keepalives_count": 3}
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0
# a connection lost this soon after its process said the store is back is the same outage,
# noticed late (an idle pool notices at its next operation): said at debug level (Outages)
OUTAGE_QUIET_SECONDS = 10.0
# the pool's own reconnection backs off 1, 2, 4 ... 32 s (to 300 s) after a lost server: back
# after 35 s, work resumed after 61. Its attempts give up after this long instead (the next
# checkout, at most CHECKOUT_SLICE later, starts afresh at once), so it tries about each second
POOL_RETRY_SECONDS = BACKOFF_MAX
# a server that answered but takes no connections now (starting up, shutting down, in recovery,
# full): unlike a refused password, role or database, trying again later may work
BUSY_SERVER = ("the database system is", "too many clients", "connection slots are reserved")
# libpq's words for a failed connection no retry cures although the server was never told no:
# no password to send, a server without SSL under sslmode=require, channel binding or an
# authentication method the server does not use, a service no service file defines, GSSAPI
# encryption this client or server cannot do, options that contradict each other
SETTINGS_WRONG = ("fe_sendauth: no password supplied",
                  "server does not support SSL, but SSL was required",
                  "channel binding required", "channel binding is required",
                  "authentication method requirement", "definition of service",
                  "service file", "GSSAPI encryption required",
                  "GSSAPI support is not compiled in", "may not be used with",
                  "could not parse network address")  # (a hostaddr that is no address, R57)
# a named host with a port that is no number: getaddrinfo's EAI_SERVICE (psycopg resolves the
# host itself, and says so before libpq could call the port no integer): the URL is wrong
BAD_SERVICE = "Servname not supported"
STOP_SLICE = 0.1  # a start waiting for the store looks at a stop asked this often
MIN_CHECKOUT = 0.05  # a pooled connection that is free is taken even at a deadline
CHECKOUT_SLICE = 0.5  # waiting for a pooled connection looks at interrupts this often
# when the operations of this thread (context) give up retrying, on time.monotonic()'s clock
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("handoffd_store_deadline",
                                                                  default=math.inf)


class _Pool(ConnectionPool[Conn]):
    """A ConnectionPool that tells its caller which connection a failed checkout took: a
    MemoryError (or any error) raised inside ``getconn`` after the connection left the pool
    (its own logging, its statistics) once lost it, the pool counting it checked out for
    ever (after ``max_size`` such leaks every operation waited out the pool's timeout). Each
    connection taken is noted in the taking thread's slot (set by :meth:`Database._checkout`
    before it asks: noting it allocates nothing) until ``getconn`` returns it: one taken from
    the idle ones as ``_getconn_unchecked`` returns it, and the place in the queue of a client
    that waits (:class:`_NotedQueue`), which the connection handed to it is read from (a
    MemoryError updating the pool's statistics after the wait once leaked that one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.taking = threading.local()  # .slot: [the connection taken, the place waited in]
        super().__init__(*args, **kwargs)
        self._waiting = _NotedQueue(self.taking)

    def _getconn_unchecked(self, timeout: float) -> Conn:
        conn = super()._getconn_unchecked(timeout)
        slot = getattr(self.taking, "slot", None)
        if slot is not None:
            slot[0] = conn  # (an item replaced in place: no allocation, no MemoryError)
        return conn


class _NotedQueue(collections.deque):  # type: ignore[type-arg]
    """psycopg_pool's queue of waiting clients: each place appended (by the waiting client's
    own thread, under the pool's lock) is noted in that thread's slot, so a checkout that
    fails after a connection was handed to it can find the connection and give it back."""

    def __init__(self, taking: threading.local) -> None:
        super().__init__()
        self.taking = taking

    def append(self, place: Any) -> None:
        slot = getattr(self.taking, "slot", None)
        if slot is not None:
            slot[1] = place  # (no allocation)
        super().append(place)


def _hung_up(conn: Conn) -> bool:
    """True when the server already ended ``conn`` while it sat idle in the pool: its socket
    is readable (the server's farewell, its end of the stream) or gone. One ``poll`` that never
    waits, no round trip: a live idle connection has nothing to read. A network cut without a
    word from the server is not seen here: the operation fails on it and is retried."""
    try:
        fd = conn.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError, psycopg.Error):  # (closed already: its fd is gone)
        return True


def _handed(place: Any) -> Conn | None:
    """The connection handed to a checkout that waited in ``place`` (psycopg_pool's waiting
    client) and that the pool left with it: its wait ended with the connection, no error, so
    only the failure after it (the pool's statistics) kept it from its caller. A wait that
    failed (timed out, interrupted) gave back whatever it was handed itself (None here)."""
    if place is None or getattr(place, "error", None) is not None:
        return None
    return getattr(place, "conn", None)  # type: ignore[no-any-return]


def _abandon_place(place: Any, exc: BaseException) -> Conn | None:
    """A checkout failed while its place (psycopg_pool's waiting client) may still be in the
    pool's queue with no connection yet (a MemoryError updating the pool's statistics right
    after it queued, R62): the place is failed, so the pool skips it and hands the next
    connection given back to a live client (one handed to the abandoned place was lost). The
    connection handed to it meanwhile (its fail came too late), for the caller to give back."""
    if getattr(place, "error", None) is not None:
        return None  # (its wait failed on its own: the pool took back what it was handed)
    try:
        if place.fail(exc if isinstance(exc, Exception) else RuntimeError("checkout stopped")):
            return None
    except Exception:  # (a place of another psycopg_pool: left as it is)
        return None
    return _handed(place)


# connections remembered as back from an outage (Outages), per store
MAX_RETURNED = 1000


class Outages:
    """Each outage of a store said once: a process holds several connections to it (the pool,
    the wake-up listener, the presence thread), and a restarted server drops them all, each
    noticing on its own (an idle pool at its next operation). The first to lose the database
    says so, the first back says so (the store answers again), and the others' lines go to
    debug; a loss noticed while others of the outage are still away, or within
    :data:`OUTAGE_QUIET_SECONDS` of its end being said, is that outage, noticed late, and says
    nothing either (a daemon printed three lines each way for one outage). A connection that
    came back from the outage and loses the store again starts a new one, and says so however
    soon (a server crashing again 3 s after its restart was an outage nobody was told of)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # store URL -> [the connections lost now (ids), the outage's end is yet to be said,
        # when its end was last said, the connections back since they were lost (ids)]
        self._state: dict[str, tuple[set[int], bool, float, set[int]]] = {}

    def lost(self, url: str, who: object) -> bool:
        """Connection ``who`` to ``url`` was lost: True when it is the one to say so."""
        with self._lock:
            held, unsaid, ended, returned = self._state.get(
                url, (set(), False, -math.inf, set()))
            again = id(who) in returned  # (it worked since it was lost: a new outage)
            say = not unsaid and (again or (
                not held and time.monotonic() - ended >= OUTAGE_QUIET_SECONDS))
            held.add(id(who))
            returned.discard(id(who))
            self._state[url] = (held, unsaid or say, ended, returned)
            return say

    def back(self, url: str, who: object) -> bool:
        """Connection ``who`` to ``url`` is back (or its holder stops): True when it is the
        first back of an outage that was said (it says the end)."""
        with self._lock:
            held, unsaid, ended, returned = self._state.get(
                url, (set(), False, -math.inf, set()))
            if id(who) not in held:
                return False
            held.discard(id(who))
            if len(returned) >= MAX_RETURNED:  # (connections the pool replaced: forgotten)
                returned.clear()
            returned.add(id(who))
            self._state[url] = (held, False, time.monotonic() if unsaid else ended, returned)
            return unsaid


OUTAGES = Outages()


class StoreError(HandoffdError):
    """The store URL is unusable (bad URL, authentication, missing database), or the store
    cannot be opened now (``unreachable``)."""

    #: why the server cannot be reached now (down, restarting, a cut network): trying again
    #: later may work, as a bounded wait does (``handoff wait --timeout``); None: it cannot
    unreachable: str | None = None


# libpq's words for a connection option it cannot use (a port that is no number, an sslmode it
# does not know), said when connecting (its URL parser takes any text): the URL is wrong. They
# may follow the server's address ("connection to server at ... failed: invalid integer value
# ... for connection option "keepalives""): looked for after a ": " too
UNUSABLE_OPTION = re.compile(r"(?:^|: )(invalid [\w ]+ (?:value|number)\b.*)")


def cannot_connect(url: str, detail: str) -> HandoffdError:
    """The error of a store that could not be opened, for ``detail`` (libpq's words): a
    ConfigError (exit 2) when libpq refused one of the URL's options, else a StoreError with
    ``unreachable`` set unless the server answered and refused (see :func:`reachable_later`).
    What libpq quotes is said only where it is no part of a password (:func:`scrubbed`)."""
    # judged by libpq's own words, said cleaned: a password holding '"' once masked the
    # server's "FATAL: password authentication failed for user ..." along with it, and a wrong
    # password was waited out as an outage (R57)
    raw, detail = detail, shown(detail, url)
    if UNUSABLE_OPTION.search(raw):
        option = UNUSABLE_OPTION.search(detail)
        return ConfigError("the store URL is not a valid PostgreSQL URL: "
                           + (option.group(1) if option else detail))
    if BAD_SERVICE in raw:  # (check_url says it first of a port it can read)
        return ConfigError("the store URL is not a valid PostgreSQL URL: its port is no number "
                           f"({detail})")
    error = StoreError(f"cannot connect to the PostgreSQL store {redact(url)}: {detail}")
    if reachable_later(raw):
        error.unreachable = f"the PostgreSQL store {redact(url)} is unreachable: {detail}"
    return error


def reachable_later(detail: str) -> bool:
    """True when a failed connection's ``detail`` says the server was not reached (no server
    on the socket or port, a timeout, a name that does not resolve) or is busy
    (:data:`BUSY_SERVER`); False when it answered with a refusal (``FATAL:`` a wrong password,
    role or database, no pg_hba.conf entry), libpq refused the URL's options
    (:data:`UNUSABLE_OPTION`, :data:`BAD_SERVICE`), or settings the server cannot meet
    (:data:`SETTINGS_WRONG`: no password given, SSL, channel binding or an authentication
    method required of a server that does not use it, an unknown service), that no retry cures."""
    if UNUSABLE_OPTION.search(detail) or BAD_SERVICE in detail \
            or any(words in detail for words in SETTINGS_WRONG):
        return False
    return "FATAL:" not in detail or any(words in detail for words in BUSY_SERVER)


# a URL's user: what comes before a password's ":" (or the "@" of a URL without one). libpq's
# own scan stops at these two only: "a?b:pw@host" is user "a?b", password "pw"
URL_USER = re.compile(r"[^:@]*")
# where a URL's query may begin: a "?" and a key (percent-encoded or not) with its "="
QUERY_KEY = re.compile(r"\?([A-Za-z0-9_%]+)=")
URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
# libpq's keywords that hold a secret (a query key may be percent-encoded: %70assword)
# libpq's options that hold a secret (its newer ones too: a URL may be written for a newer libpq)
SECRET_KEYS = ("password", "sslpassword", "oauth_client_secret", "scram_client_key",
               "scram_server_key")
# the attempts made while waiting out an outage at start: libpq's least connect_timeout
WAITING_ATTEMPT = 2.0


def _mask_query(url: str) -> str:
    """``url`` with the value of every query parameter whose (decoded) key is a secret masked."""
    from urllib.parse import unquote
    base, sep, rest = url.partition("?")
    if not sep:
        return url
    query, hashsep, fragment = rest.partition("#")
    items = []
    for item in query.split("&"):
        key, eq, _ = item.partition("=")
        items.append(f"{key}=***" if eq and unquote(key).strip().lower() in SECRET_KEYS else item)
    return base + "?" + "&".join(items) + hashsep + fragment


@functools.lru_cache(maxsize=1)
def connection_keywords() -> frozenset[str]:
    """libpq's connection keywords: the only keys a URL's query may hold (libpq refuses
    others), so a "?" followed by one of them and "=" starts a query."""
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


def _query_start(url: str, start: int) -> int:
    """Where ``url``'s query begins, looking from ``start``: the first "?" followed by a
    connection keyword and "=" (len(url) when there is none)."""
    from urllib.parse import unquote
    for found in QUERY_KEY.finditer(url, start):
        if unquote(found.group(1)) in connection_keywords():
            return found.start()
    return len(url)


def password_span(url: str) -> tuple[int, int] | None:
    """Where the password of a URL's userinfo lies in its text (start, end), by the text, not
    by libpq's parse (which finds none, or a wrong one, when it holds an unencoded "/" or
    "@"): from the user's ":" (libpq's user ends at the first ":" or "@", whatever "?" or "#"
    it holds) to the last "@" before the query. libpq reads a userinfo when an "@" comes before
    any "/", up to that first "@": the query is looked for after it (a password holding
    "?sslmode=" is still masked whole). Otherwise the query is looked for from the ":" on, and
    when every "@" after the ":" is in that "query", the text cannot be told from a password
    holding "/" and "?keyword=" (``postgresql://u:p/w?sslmode=x@host/db`` is host "u", port
    "p"...): masked to the last "@" all the same, more rather than less
    (``postgresql://db1:5432/h?application_name=a@b`` is said ``postgresql://db1:***@b``). A
    user holding an unencoded "@" (``user@server:pw@host``) has its ":" after that "@": masked
    from it to the last "@" before the query, and when every "@" after the ":" is in what
    libpq reads as a query (a password holding "?keyword=": ``me@corp:pw?sslmode=x@host``),
    to the last "@" before a query that follows the first of them (so
    ``me@db1:5432/h?application_name=a@b`` is said ``me@db1:***@b``). None: no password. A password that holds an "@"
    followed by "?", a connection keyword and "=", after an "@" before any "/" (libpq's
    userinfo), cannot be told from a query: percent-encode it."""
    scheme = URL_SCHEME.match(url)
    if scheme is None:
        return None
    if url.startswith("[", scheme.end()):  # an IPv6 host, no userinfo before it (R57: the
        bracket = url.find("]", scheme.end())  # fallback below masked "[::1]:5432/db?a=b@c")
        at = url.find("@", scheme.end())
        if bracket >= 0 and (at < 0 or bracket < at):
            return None
    colon = URL_USER.match(url, scheme.end()).end()  # type: ignore[union-attr]  # (matches "")
    if not url.startswith(":", colon):  # (an "@" first: a user without a password, or one
        colon = url.find(":", colon)  # holding an unencoded "@" with its password after)
        if colon < 0:
            return None
        end = url.rfind("@", colon, _query_start(url, colon))
        if end < 0 and _not_a_port(url, colon):  # every "@" after the ":" is in what libpq
            # reads as a query, and what it reads as the port is no number: the password's
            # ("me@corp:pw?sslmode=x@host" is host "corp", port "pw" to libpq): masked to the
            # last "@" before a query after the first "@" (more rather than less). A port that
            # is a number is one (R64: "app@db1:5432/h?application_name=me@box" was masked to
            # "app@db1:***@box", the server that failed unreadable), an IPv6 host's ":" none
            first_at = url.find("@", colon)
            end = -1 if first_at < 0 else url.rfind("@", colon, _query_start(url, first_at))
        return None if end < 0 else (colon + 1, end)
    first_at, slash = url.find("@", colon), url.find("/", colon)
    if first_at < 0:
        return None
    floor = first_at if slash < 0 or first_at < slash else colon
    end = url.rfind("@", colon, _query_start(url, floor))
    if end < 0:  # (every "@" in what libpq reads as a query: it may be the password's)
        end = url.rfind("@", colon)
    return colon + 1, end


def _not_a_port(url: str, colon: int) -> bool:
    """Whether the ":" at ``colon`` (after a URL's userinfo "@") is followed by what libpq would
    read as a port but is no number (so it is a password's): not inside an IPv6 host's
    brackets, not digits up to the next "/", "?", "," or "#"."""
    if "[" in url[:colon] and "]" not in url[url.rfind("[", 0, colon):colon]:
        return False  # (inside "[...]": an IPv6 address's colons)
    port = re.match(r"[^/?,#]*", url[colon + 1:])
    return not (port is not None and port.group(0).isdigit())


def redact(url: str) -> str:
    """``url`` without its password, for messages. A URL's userinfo is masked by its text
    (:func:`password_span`: an unencoded "/", "@" or ":" in it is masked too, and the host is
    kept, whatever "@" the query holds); a ``password=`` parameter too."""
    if URL_SCHEME.match(url):
        span = password_span(url)
        return _mask_query(url if span is None else f"{url[:span[0]]}***{url[span[1]:]}")
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo
        parts = conninfo_to_dict(url)
    except Exception:  # not parseable: say nothing of it rather than leak a secret
        return "the store URL"
    if any(key in parts for key in SECRET_KEYS):
        for key in SECRET_KEYS:
            if key in parts:
                parts[key] = "***"
        return make_conninfo("", **parts)
    return url


def check_url(url: str) -> None:
    """ConfigError (one line, exit 2) when ``url`` is no connection string libpq can parse. The
    parser's words quote the URL, or parts of it that may be the password: those are left out
    (:func:`_unquoted`)."""
    from psycopg.conninfo import conninfo_to_dict
    try:
        parts = conninfo_to_dict(url)
    except UnicodeDecodeError:  # (psycopg decodes libpq's percent-decoded values as UTF-8)
        raise ConfigError("the store URL is not a valid PostgreSQL URL: a percent-escape in it "
                          "(%XX) is not UTF-8 text") from None
    except psycopg.Error as exc:
        words = re.sub(r'(?: in URI)?:? ?"' + re.escape(url) + '"', "", str(exc))
        # the character libpq did not expect may be the password's (its position says where)
        words = re.sub(r'unexpected character "[^"]*"', "unexpected character",
                       words.replace(url, ""))
        detail = _unquoted(" ".join(words.split()), marks='"' not in url)
        raise ConfigError(f"the store URL is not a valid PostgreSQL URL: {detail}") from None
    port = str(parts.get("port") or "")
    if any(one and not one.strip().isdigit() for one in port.split(",")):
        # libpq says so only of a host-less URL; a named host fails resolving it (EAI_SERVICE):
        # said the same way for both. A password holding an unencoded ",", ":" or "/" is read
        # as hosts and ports (libpq finds a userinfo only when an "@" comes before any "/"):
        # the port is quoted only when each of its pieces stands as a port where redact()
        # shows it, past the password (after a host's ":" or in the query's "port=")
        if all(_stands(one, url) for one in port.split(",") if one):
            raise ConfigError("the store URL is not a valid PostgreSQL URL: invalid integer "
                              f'value "{port}" for connection option "port"')
        raise ConfigError("the store URL is not a valid PostgreSQL URL: it is malformed, its "
                          "port is no number (a password holding an unencoded \",\", \":\" "
                          "or \"/\" is read as host and port: percent-encode it)")


def _unquoted(words: str, marks: bool = True) -> str:
    """A URL parser's message without what it quotes, which may be a secret: one punctuation
    character such as ``"]"`` or ``"="`` says what is wrong and is kept (``marks``; not when
    the URL holds a ``"``: it may be the password's edge, R57); the rest, from the first other
    quote to the last (a password holding ``"`` ends a quote early), is ``"..."``."""
    kept: list[str] = []

    def keep(quoted: re.Match[str]) -> str:
        kept.append(quoted.group(0))
        return f"\0{len(kept) - 1}\0"
    words = words.replace("\0", "")
    if marks:
        words = re.sub(r'"[^\w\s"]"', keep, words)
    words = re.sub(r'".*"', '"..."', words)
    return re.sub(r"\0(\d+)\0", lambda at: kept[int(at.group(1))], words)


def _stands(text: str, url: str) -> bool:
    """Whether ``text`` (a value libpq quotes, read from ``url``) is no part of its password:
    ``url`` has none, or ``text`` stands whole, as a value, where :func:`redact` shows the URL
    (e.g. a port after a host's ":", or an option's value after its "=")."""
    if password_span(url) is None:
        return True
    from urllib.parse import unquote
    shown = redact(url)
    value = r"(?<=[/:=,@\[?&])" + re.escape(text) + r"(?=[\]/?&,:#@=]|$)"
    return bool(text) and any(re.search(value, one) for one in (shown, unquote(shown)))


def scrubbed(detail: str, url: str) -> str:
    """libpq's ``detail`` of a failed connection to ``url`` without what may be its password's:
    libpq reads a password holding an unencoded "/" or "@" as hosts, ports, a database and
    options, and quotes them (``invalid integer value "..."``, ``at "...", port N``). Each
    quoted value, and each port, is kept only where it stands whole in the URL as
    :func:`redact` shows it (a socket's path by its folder); a password holding ``"`` masks
    from the first quote to the last, and ``'`` every host psycopg quotes so."""
    span = password_span(url)
    if span is None:
        return detail
    secret = url[span[0]:span[1]]

    def kept(masked: str) -> Callable[[re.Match[str]], str]:
        def one(found: re.Match[str]) -> str:
            text = found.group(1)
            folder = re.sub(r"/\.s\.PGSQL\.\d+$", "", text)
            return found.group(0) if _stands(text, url) or _stands(folder, url) else masked
        return one
    # (a password holding the quote ends a quote early: from the first to the last, masked)
    double, single = (".*" if quote in secret else f"[^{quote}]*" for quote in "\"'")
    detail = re.sub(f'"({double})"', kept('"..."'), detail)
    detail = re.sub(rf"\bhost '({single})'", kept("host '...'"), detail)  # (psycopg's quotes)
    # psycopg's summary of several attempts: "- host: 'h', port: '5432', hostaddr: '1.2.3.4'"
    # (R57: a password of digits, "," and a host read as two hosts showed there)
    for key in ("host", "port", "hostaddr"):
        detail = re.sub(rf"\b{key}: '({single})'", kept(f"{key}: '...'"), detail)
    return re.sub(r"\bport (\d+)", kept("port ..."), detail)


def refusal(exc: BaseException, url: str, doing: str) -> StoreError:
    """An error of the server that no reconnection cures (a role without the right to create
    handoffd's tables, a missing table...) as one line: what handoffd was ``doing``, the
    server's words, and for a missing right who may do it."""
    detail = shown(" ".join(str(exc).split()), url) or type(exc).__name__
    hint = ("; run it as a role that may (e.g. the database's owner, or after GRANT CREATE ON "
            "DATABASE ... TO this role)"
            if isinstance(exc, psycopg.errors.InsufficientPrivilege) else "")
    return StoreError(f"cannot {doing} in the PostgreSQL store {redact(url)}: {detail}{hint}")


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Within the block (this thread or context), an operation that lost its connection gives up
    ``seconds`` from now (StoreUnavailable) instead of after the reconnect window; an earlier
    deadline of an enclosing block still holds. None: no deadline of its own."""
    if seconds is None:
        yield
        return
    token = _DEADLINE.set(min(_DEADLINE.get(), time.monotonic() + max(seconds, 0.0)))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def is_disconnect(exc: BaseException) -> bool:
    """True for errors that a new connection may cure (and that may be retried)."""
    return isinstance(exc, psycopg.OperationalError)


def first_connection(url: str, *, reconnect_seconds: float, connect_timeout: float = 10.0,
                     report_level: int = logging.WARNING,
                     limit: Callable[[float], float] | None = None,
                     pause: Callable[[float], None] = time.sleep) -> None:
    """Return once a direct connection to ``url`` works: a wrong URL, password, role or
    database fails at once with the server's own words (a pool would retry quietly until its
    timeout). A server that is away (refused, starting up, shutting down:
    :func:`reachable_later`) is an outage, waited out as a lost connection is: with backoff,
    for up to ``reconnect_seconds`` (cut by ``limit(window_end)``, by default a
    :func:`deadline`, and by a starting batch's bound,
    :func:`~handoffd.core.starting.start_by`), saying so in one line at ``report_level``, then
    StoreUnavailable (a command started during a restart once failed at once). A stop asked
    meanwhile (:func:`~handoffd.core.starting.stop_asked`) ends the wait with StartStopped.
    Under a command's ``--timeout`` (connecting_within) one attempt is made, bounded by it: the
    command waits out the outage itself, with its own last line (reads.open_within).
    ``pause(seconds)`` sleeps a slice of a backoff step (a pool's wakes at its interrupt).
    Every opening of the store comes here: a Database's, and ``handoffd db init``'s."""
    bound = limit or (lambda window: min(window, _DEADLINE.get()))
    delay = BACKOFF_FIRST
    window = time.monotonic() + reconnect_seconds
    said = False  # (the wait's line: once)
    attempt = connect_timeout  # the first attempt's bound; then at most WAITING_ATTEMPT
    while True:
        # each attempt bounded by the start's bound too (a server that never answers held
        # `run --max-seconds 3` for connect_timeout, 10 s; R50)
        attempt = min(attempt, max(start_by() - time.monotonic(), 1.0))
        detail = _last_error(url, bounded_connect(attempt))
        if detail is None:
            return
        if not reachable_later(detail) or connect_by() < math.inf:
            raise cannot_connect(url, detail)
        left = min(bound(window), start_by()) - time.monotonic()
        if left <= 0:
            raise StoreUnavailable(f"the PostgreSQL store {redact(url)} is unreachable: "
                                   f"{shown(detail, url)}")
        if not said:
            said = True
            log.log(report_level, "waiting for the database at %s (up to %gs): %s",
                    redact(url), round(left, 1), shown(detail, url))
        _pause_starting(min(delay, left), url, pause)
        delay = min(delay * 2, BACKOFF_MAX)
        # while waiting, short attempts: a stop is seen between them (a server that never
        # answers held each for connect_timeout, a SIGTERM unseen meanwhile; R50)
        attempt = min(connect_timeout, WAITING_ATTEMPT)


def _pause_starting(seconds: float, url: str, pause: Callable[[float], None]) -> None:
    """One backoff step of the first connection's wait, in slices: a stop asked of a process
    that is starting meanwhile (a signal its handler only records: it cannot wake this wait)
    ends it with :class:`StartStopped` within a slice."""
    ends = time.monotonic() + seconds
    while not stop_asked():
        left = ends - time.monotonic()
        if left <= 0:
            return
        pause(min(left, STOP_SLICE))
    raise StartStopped(f"before it began, waiting for the database at {redact(url)}")


class Database:
    """A connection pool on ``url`` whose :meth:`run` survives lost connections."""

    def __init__(self, url: str, *, max_size: int = 8, reconnect_seconds: float = 60.0,
                 connect_timeout: float = 10.0) -> None:
        check_url(url)
        self.url = url
        self.reconnect_seconds = reconnect_seconds
        self.connect_timeout = connect_timeout
        self._lost_since: float | None = None
        self._state_lock = threading.Lock()
        self._give_up_at = math.inf  # set by interrupt(): retries end then, whatever the window
        self._wake = threading.Condition()  # interrupt() wakes retries sleeping their backoff
        self.report_level = logging.WARNING  # of the lost/back lines (see quiet_reconnects)
        self._first_connection(url)
        self.pool: ConnectionPool[Conn] = _Pool(
            url, min_size=1, max_size=max(max_size, 1), open=False, name="handoffd",
            timeout=connect_timeout, kwargs={"connect_timeout": max(int(connect_timeout), 1)},
            reconnect_timeout=POOL_RETRY_SECONDS,  # (not its minutes of backoff: see there)
            configure=configure)  # json a foreign writer left must never fail a whole fetch
        # no check on checkout (a round trip per operation): a connection the server ended
        # while idle is passed over by _getconn (a poll), one cut without a word fails its
        # first statement, is discarded by the pool, and run() retries on a new one
        try:
            self.pool.open(wait=True, timeout=bounded_connect(connect_timeout))
        except Exception as exc:
            self.pool.close(timeout=1.0)
            raise cannot_connect(url, _last_error(url, bounded_connect(connect_timeout))
                                 or str(exc)) from None

    def _first_connection(self, url: str) -> None:
        """One direct connection first (:func:`first_connection`), its wait cut by this
        pool's :meth:`interrupt` as well as by a :func:`deadline`."""
        first_connection(url, reconnect_seconds=self.reconnect_seconds,
                         connect_timeout=self.connect_timeout, report_level=self.report_level,
                         limit=self._limit, pause=self._pause)

    def run(self, operation: Callable[[Conn, bool], T]) -> T:
        """``operation(conn, retried)`` in one transaction (committed when it returns).
        ``retried`` is True when an earlier try lost its connection: it may have committed."""
        delay = BACKOFF_FIRST
        retried = False
        window = time.monotonic() + self.reconnect_seconds
        while True:
            try:
                conn = self._getconn(window)
                try:
                    with conn:  # commits when the operation returns, else rolls back
                        result = operation(conn, retried)
                finally:
                    self._put_back(conn)  # (a broken connection is replaced by the pool)
                self._back()
                return result
            except Exception as exc:
                if not is_disconnect(exc):
                    raise
                self._lost(exc)
                left = self._limit(window) - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"the PostgreSQL store {redact(self.url)} is "
                                           "unreachable: "
                                           + scrubbed(" ".join(str(exc).split()), self.url)
                                           ) from None
                retried = True
                self._pause(min(delay, left))
                delay = min(delay * 2, BACKOFF_MAX)

    def _put_back(self, conn: Conn) -> None:
        """Return ``conn`` to the pool, whatever is raised meanwhile. A MemoryError returning it
        once leaked it: the pool counted it checked out for ever, and after ``max_size`` such
        leaks every operation waited for the pool's timeout. Tried once more; a connection
        that cannot be returned even so is closed and handed back closed, which the pool
        discards and replaces (one WARNING line). No MemoryError leaves it: what the operation
        raised, or its result (it may have committed), is what its caller must get."""
        try:
            self.pool.putconn(conn)
            return
        except MemoryError as exc:
            short = exc
        try:  # once more
            self.pool.putconn(conn)
            return
        except ValueError:  # it "comes from no pool": the first put unlinked it, then ran short
            if self._idle_in_pool(conn):  # (after taking it back: nothing more to do)
                return
            # lost between the two (psycopg_pool unlinks a connection before it stores it):
            # linked back, to be handed back closed below, which the pool counts and replaces.
            # (Handed to a waiting client before running short, it is closed under that
            # client: its operation fails as a lost connection, and is retried.)
            conn._pool = self.pool  # type: ignore[attr-defined]
        except MemoryError:
            pass
        try:
            conn.close()  # (the pool's close_returns is off: this closes the connection)
        except Exception:  # (a MemoryError too: handed back as it is, closed or not)
            pass
        try:
            self.pool.putconn(conn)
            fate = "closed, the pool replaces it"
        except ValueError:
            fate = "closed"
        except MemoryError:  # (nothing more can be done, and nothing the caller can do)
            fate = "the pool counts it in use, one fewer, until the store is closed"
        try:
            log.warning("a connection to the PostgreSQL store could not be returned to its "
                        "pool: %s; %s", shortage_words(short), fate)
        except MemoryError:
            pass

    def _idle_in_pool(self, conn: Conn) -> bool:
        """Whether ``conn`` sits among the pool's idle connections (psycopg_pool's own deque,
        read without its lock: a snapshot is enough to tell a connection taken back from one
        lost; a pool without that attribute is taken at its word)."""
        idle = getattr(self.pool, "_pool", None)
        if idle is None:
            return True
        try:
            return any(item is conn for item in list(idle))
        except (RuntimeError, MemoryError):  # (changed under the copy, or no memory for it)
            return True

    def interrupt(self, grace: float = 0.0) -> None:
        """From now on, an operation that lost its connection (or finds none) gives up within
        ``grace`` seconds instead of retrying for the whole reconnect window: a process that is
        stopping lets go of a store that is away in time. An operation whose connection works
        is not affected."""
        with self._wake:
            self._give_up_at = min(self._give_up_at, time.monotonic() + max(grace, 0.0))
            self._wake.notify_all()

    def resume(self) -> None:
        """Undo :meth:`interrupt`: retries last the whole reconnect window again (a program that
        stopped one daemon and serves again on the same store)."""
        with self._wake:
            self._give_up_at = math.inf

    def _limit(self, window: float) -> float:
        """When the retries of an operation whose reconnect window ends at ``window`` end."""
        return min(window, self._give_up_at, _DEADLINE.get())

    def _getconn(self, window: float) -> Conn:
        """A pooled connection, waited for up to the connect timeout (PoolTimeout after it, as
        the pool's own wait), cut to what is left before the retries would end. The wait is
        made in short slices: an :meth:`interrupt` or deadline that comes meanwhile ends it."""
        ends = time.monotonic() + self.connect_timeout
        while True:
            left = min(ends, self._limit(window)) - time.monotonic()
            try:  # a connection already free is taken at once, even past a deadline
                conn = self._checkout(max(min(left, CHECKOUT_SLICE), MIN_CHECKOUT))
            except PoolTimeout:
                if left <= CHECKOUT_SLICE:
                    raise
                continue
            if not _hung_up(conn):
                return conn
            # the server ended it while it sat idle (a restart: every idle one at once): closed
            # and given back, the pool replaces it, and the next is taken at once. Each retry
            # took the next dead one and waited its backoff, and a pool of ten or more outlasted
            # a short reconnect window with the server back (review RC, session 29). Said as a
            # lost connection (once an outage), and its end as the operation succeeds (run)
            self._lost(ConnectionError("the server ended an idle pooled connection"))
            try:
                conn.close()
            finally:
                self._put_back(conn)

    def _checkout(self, timeout: float) -> Conn:
        """``pool.getconn(timeout)``; a connection it took before it failed (a MemoryError in
        its own logging or statistics, after it took an idle one or was handed one while it
        waited) is given back (:meth:`_put_back`) before the error goes on: a checkout never
        leaks one, whatever fails."""
        taking = getattr(self.pool, "taking", None)
        if taking is None:  # (a pool of another kind: taken at its word)
            return self.pool.getconn(timeout=timeout)
        slot: list[Any] = [None, None]  # (allocated before any connection is taken)
        taking.slot = slot
        try:
            return self.pool.getconn(timeout=timeout)
        except BaseException as exc:
            taken = slot[0] if slot[0] is not None else _handed(slot[1])
            if taken is None and slot[1] is not None:
                taken = _abandon_place(slot[1], exc)
            slot[0] = slot[1] = None
            if taken is not None and not self._idle_in_pool(taken):  # (not given back by the
                # pool itself)
                if getattr(taken, "_pool", None) is None:  # (handed to a waiting client: the
                    # pool links it as getconn returns, and takes back only what it linked)
                    taken._pool = self.pool  # type: ignore[attr-defined]
                if getattr(taken, "_pool", None) is self.pool:
                    self._put_back(taken)
            raise
        finally:
            taking.slot = None

    def _pause(self, seconds: float) -> None:
        """Sleep one backoff step, or less when :meth:`interrupt` is called meanwhile."""
        with self._wake:
            self._wake.wait(seconds)

    def _lost(self, exc: BaseException) -> None:
        with self._state_lock:
            if self._lost_since is not None:
                return
            self._lost_since = time.monotonic()
        level = self.report_level if OUTAGES.lost(self.url, self) else logging.DEBUG
        log.log(level, "lost the database connection (%s); reconnecting with "
                "backoff", scrubbed(" ".join(str(exc).split()), self.url)[:200]
                or type(exc).__name__)

    def _back(self) -> None:
        if self._lost_since is None:
            return
        with self._state_lock:
            since, self._lost_since = self._lost_since, None
        if since is not None:
            level = self.report_level if OUTAGES.back(self.url, self) else logging.DEBUG
            log.log(level, "reconnected to the database after %.1fs", time.monotonic() - since)

    def close(self) -> None:
        """Close every pooled connection (an operation still retrying gives up at once)."""
        self.interrupt()
        if self._lost_since is not None:  # (an outage it said ends with it: others say theirs)
            OUTAGES.back(self.url, self)
        self.pool.close(timeout=2.0)


def _last_error(url: str, timeout: float = 5.0) -> str | None:
    """Why a direct connection to ``url`` fails now (the pool's own error says only 'timeout'),
    in libpq's own words: judge by them, say them through :func:`shown`; None when it
    connects."""
    try:
        psycopg.connect(url, connect_timeout=max(int(timeout), 1)).close()
    except Exception as exc:
        return " ".join(str(exc).split())
    return None


def shown(detail: str, url: str) -> str:
    """libpq's ``detail`` of ``url`` as a message says it: cleaned of what may be the
    password's (:func:`scrubbed`), then cut (cut first, a quote left open masked nothing)."""
    return scrubbed(detail, url)[:300]


class SessionThread:
    """A thread holding one dedicated connection, set up by :meth:`_setup`, and re-established
    with backoff when it is lost (one log line when lost, one when back)."""

    what = "session"  # for the log lines
    thread_name = "handoffd-session"

    def __init__(self, url: str, *, connect_timeout: float = 5.0) -> None:
        self.url = url
        self.connect_timeout = connect_timeout  # ([store] connect_timeout_seconds)
        self.report_level = logging.WARNING  # of the lost/back lines
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() interrupts the select at once
        os.set_blocking(self._wake_w, False)

    def _setup(self, conn: Conn) -> None:
        """Prepare a new connection (LISTEN, take a lock...)."""

    def _lost(self) -> None:
        """Called when the connection is lost and again when it is back."""

    def start(self) -> None:
        """Start the thread (returns once the first set-up is done, or after 5 s)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._ready.clear()
        self._drain_wake()
        self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
        self._thread.start()
        self._ready.wait(SESSION_STOP_SECONDS)

    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the thread (at once: the pipe wakes its select) and close its connection."""
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: the thread is being woken already
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=SESSION_STOP_SECONDS)
        self._thread = None

    def close(self) -> None:
        """Stop the thread and release the wake-up pipe."""
        self.stop()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _loop(self) -> None:
        delay = BACKOFF_FIRST
        lost_at: float | None = None
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True,
                                     connect_timeout=session_connect(self.connect_timeout),
                                     **KEEPALIVES) as conn:
                    self._setup(conn)
                    self._ready.set()
                    if lost_at is not None:  # (said as the pool says it, when it is to say)
                        level = self.report_level if OUTAGES.back(self.url, self) else logging.DEBUG
                        log.log(level, "reconnected to the database after %.1fs (its %s "
                                "connection)", time.monotonic() - lost_at, self.what)
                        lost_at = None
                        self._lost()
                    delay = BACKOFF_FIRST
                    self._hold(conn)
            except Exception as exc:
                if self._stop.is_set():
                    break
                if lost_at is None:
                    lost_at = time.monotonic()
                    level = self.report_level if OUTAGES.lost(self.url, self) else logging.DEBUG
                    log.log(level, "lost the database connection (its %s connection: %s); "
                            "reconnecting with backoff", self.what,
                            scrubbed(" ".join(str(exc).split()), self.url)[:200])
                    self._lost()
                self._ready.set()  # nobody waits on a server that is down
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX)
        if lost_at is not None:  # (stopped while away: an outage it said ends with it)
            OUTAGES.back(self.url, self)

    def _hold(self, conn: Conn) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([conn.fileno(), self._wake_r], [], [], 5.0)
            if self._stop.is_set():
                return
            if conn.fileno() in readable:
                # notifications arrive with any result: a no-op round trip delivers them to the
                # handler (and raises at once when the server has closed the connection)
                conn.execute("SELECT 1")

    def _drain_wake(self) -> None:
        os.set_blocking(self._wake_r, False)
        try:
            while os.read(self._wake_r, 64):
                pass
        except OSError:  # empty
            pass


class Listener(SessionThread):
    """LISTENs on :data:`CHANNEL` and calls ``on_payload(text)`` for each notification, or
    ``on_lost()`` when notifications may have been missed (lost connection: rescan)."""

    what = "wake-up"
    thread_name = "handoffd-listen"

    def __init__(self, url: str, on_payload: Callable[[str], None],
                 on_lost: Callable[[], None], *, connect_timeout: float = 5.0) -> None:
        super().__init__(url, connect_timeout=connect_timeout)
        self.on_payload = on_payload
        self.on_lost = on_lost

    def _setup(self, conn: Conn) -> None:
        conn.add_notify_handler(lambda n: self._deliver(n.payload))
        conn.execute(f"LISTEN {CHANNEL}")

    def _lost(self) -> None:
        self.on_lost()

    def _deliver(self, payload: str) -> None:
        try:
            self.on_payload(payload)
        except Exception:  # a reader's bug must not end the listening thread
            log.exception("wake-up handler failed")


class Presence(SessionThread):
    """Holds the session-level advisory lock ``key`` while this process lives: claims record
    the key, and a claim whose key no session holds belongs to a process that died (the server
    ends a dead client's session, and with it the lock).

    Other hosts take such claims over once they have held the key themselves (taken when they
    saw it unheld) for their owner grace, lease or no lease. So this process must know, on its
    own, when it can no longer be sure it holds the key (a network cut: its session may have
    ended on the server): a round trip every ``beat`` seconds on the session proves it alive,
    and :meth:`age` says how long ago that last was (the claims' owner stops their handlers
    before the grace can run out)."""

    what = "presence"
    thread_name = "handoffd-presence"

    def __init__(self, url: str, key: int, *, beat: float = 1.0,
                 monotonic: Callable[[], float] = time.monotonic,
                 connect_timeout: float = 5.0) -> None:
        super().__init__(url, connect_timeout=connect_timeout)
        self.key = key
        self.beat = beat
        self.monotonic = monotonic
        self.confirmed_at: float | None = None  # (monotonic) when the key was last sure held

    def age(self) -> float:
        """Seconds since the session holding the key last proved alive (infinity: never)."""
        confirmed = self.confirmed_at
        return math.inf if confirmed is None else max(self.monotonic() - confirmed, 0.0)

    def _setup(self, conn: Conn) -> None:
        """Take the key, waiting for it while another host's sweep holds it (it saw our session
        gone; it lets go once it sees us wait, and takes our claims over only if it held the
        key for its whole grace: we prove nothing meanwhile, so our handlers are stopped at
        half the grace, and nothing is claimed). The wait is made in rounds of ``beat``
        seconds (``lock_timeout``): a :meth:`stop` meanwhile ends it within one."""
        conn.execute(f"SET lock_timeout = '{max(int(self.beat * 1000), 1)}ms'")
        while True:
            started = self.monotonic()
            try:
                conn.execute("SELECT pg_advisory_lock(%s)", (self.key,))
            except psycopg.errors.LockNotAvailable:
                self._ready.set()  # (nobody waits for a key another host holds)
                if self._stop.is_set():
                    raise InterruptedError("stopped while waiting for the presence key") from None
                continue
            self.confirmed_at = started
            return

    def _hold(self, conn: Conn) -> None:
        while not self._stop.is_set():
            # (the connection turning readable unasked: the server closed it; the round trip
            # below then raises at once and the loop reconnects)
            select.select([conn.fileno(), self._wake_r], [], [], self.beat)
            if self._stop.is_set():
                return
            started = self.monotonic()  # the session was alive when it answered, so then too
            conn.execute("SELECT 1")
            self.confirmed_at = started
