"""A store URL's password is never said, in libpq's real words too (session 28, task G):

1. A user name holding an unencoded "@" (``me@corp:pw?sslmode=x@host``; libpq's userinfo ends
   at the first "@", and it reads host "corp", port "pw" and an sslmode) with a password
   holding "?keyword=" was not masked: :func:`password_span` found no password, so ``redact``
   showed the URL whole and ``check_url`` quoted the password as a port. A percent-encoded
   "@" (``me%40corp``, libpq's user "me@corp") was masked already, and is checked here too.
2. The earlier property tests fed ``scrubbed`` libpq's words written by hand. Here it is fed
   psycopg's real error text of a failed connection, to a port nobody listens on and to a live
   server (started once for this module, asking passwords on 127.0.0.1) with a wrong
   password, for generated passwords of every printable character.

The generated passwords' letters are JKQVWXYZ (no message of libpq's or psycopg's holds two of
them in a row, so any two of them said in a row are the password's), with every printable
character that is no letter (quotes, "@", "/", "?", "#", "=", spaces, backslashes...), and
libpq's keywords as "?keyword=" and "&keyword=" (what turns a password into a query)."""
from __future__ import annotations

import re
import socket
import string
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import pgserver
import pytest
from conftest import Workspace
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from handoffd.backends.postgres.connection import check_url, redact, scrubbed
from handoffd.core.errors import ConfigError
from handoffd.core.workspace import Workspace as HandoffdWorkspace

SECRET = "JKQVWXYZ"
OTHERS = [c for c in string.printable if not c.isalpha() and (c == " " or not c.isspace())]
# libpq's keywords that turn a password's rest into options (hostaddr is left out: a generated
# address could be a real one, and tests send nothing past loopback)
KEYWORDS = ["sslmode", "port", "host", "dbname", "user", "password", "application_name",
            "options", "keepalives", "connect_timeout", "target_session_attrs", "service",
            "require_auth", "channel_binding", "gssencmode"]
PIECES = st.one_of(st.sampled_from(SECRET), st.sampled_from(OTHERS),
                   st.sampled_from([f"{mark}{key}=" for key in KEYWORDS for mark in "?&"]))
PASSWORDS = st.lists(PIECES, min_size=1, max_size=12).map("".join)
# the user names: plain, and holding an "@" as libpq takes it (percent-encoded) and not
USERS = ["app", "me%40corp", "me@corp"]
RIGHT = "right-password"


def nobody_on() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def loopback_only(real: object) -> object:
    """``socket.getaddrinfo`` resolving 127.0.0.1 and localhost only: a password read as host
    names is looked up nowhere (fast, and no traffic leaves the machine)."""
    def resolve(host: object, *args: object, **kwargs: object) -> object:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in ("127.0.0.1", "localhost", None):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)  # type: ignore[operator]
    return resolve


@pytest.fixture(scope="module")
def live() -> Iterator[int]:
    """A server of this module's own, on 127.0.0.1 at the port returned, whose roles "app" and
    "me@corp" must give the password RIGHT; host names resolve to loopback only meanwhile."""
    server = pgserver.start(tcp_port=nobody_on())
    if isinstance(server, str):
        pytest.skip(server)
    try:
        for role in ("app", "me@corp"):
            server.admin(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{RIGHT}'")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(socket, "getaddrinfo", loopback_only(socket.getaddrinfo))
            assert server.tcp_port is not None
            yield server.tcp_port
    finally:
        server.stop()


def said_of(url: str) -> str:
    """What handoffd says of a failed connection to ``url``: check_url's line for a URL libpq
    cannot parse (no connection is tried then), else libpq's words through :func:`scrubbed`;
    with the URL as :func:`redact` shows it."""
    import psycopg
    try:
        check_url(url)
    except ConfigError as exc:
        return f"{redact(url)} {exc}"
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except Exception as exc:
        return f"{redact(url)} {scrubbed(' '.join(str(exc).split()), url)}"
    return redact(url)


def told_apart(password: str, user: str = "") -> bool:
    """Not the documented limits (docs/scaling.md): a password holding an "@" and then
    "?keyword=" is a userinfo followed by a query to libpq too (percent-encode it); after a
    user holding an unencoded "@", a password that starts with a number up to its first "/",
    "?", "," or "#" is a port to libpq (R64: such a port is shown, not masked)."""
    at = password.find("@")
    if at >= 0 and any(f"?{key}=" in password[at:] for key in KEYWORDS):
        return False
    lead = re.match(r"[^/?,#]*", password)
    return not ("@" in user and lead is not None and lead.group(0).isdigit())


def leaks(password: str, said: str) -> list[str]:
    """The runs of two or more of the password's letters (:data:`SECRET`) that ``said`` holds,
    and the password itself when it is four characters or more and ``said`` holds it."""
    runs = [run for run in re.findall(f"[{SECRET}]{{2,}}", password) if run in said]
    # (a password of the masks' or the URL's own characters, "***@" or "0.0.", is found in
    # what is said of any URL: no leak; R64)
    shown = said.replace("***", " ")
    whole = len(password) >= 4 and password in shown and not any(
        password in fixed for fixed in ("127.0.0.1", "postgres", "localhost"))
    return runs + ([password] if whole else [])


@settings(max_examples=60, deadline=timedelta(seconds=10),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(PASSWORDS, st.sampled_from(USERS))
@example("QX?sslmode=disableJK", "me@corp")
@example("QX/W?port=YZ", "me@corp")
@example('JK"W\\ Q"XY?application_name=ZV', "me@corp")
@example("QX?sslmode=disableJK", "me%40corp")
@example("JK,XY:QV/ZW", "app")
def test_libpqs_real_words_never_say_a_password(live: int, password: str, user: str) -> None:
    assume(told_apart(password, user))
    for port in (nobody_on(), live):  # refused, and a live server refusing the password
        url = f"postgresql://{user}:{password}@127.0.0.1:{port}/postgres"
        said = said_of(url)
        assert not leaks(password, said), (url, said)


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("password", ["QX?sslmode=disableJK", "QX/W?port=YZ",
                                      "QX?application_name=JK"])
def test_a_user_holding_an_at_sign_keeps_a_password_holding_a_query_masked(
        user: str, password: str) -> None:
    url = f"postgresql://{user}:{password}@127.0.0.1:5432/db"
    assert redact(url) == f"postgresql://{user}:***@127.0.0.1:5432/db"
    try:
        check_url(url)
    except ConfigError as exc:
        assert not leaks(password, str(exc)), exc


def test_the_right_password_still_connects(live: int) -> None:
    """The server of this module asks passwords: a wrong one is refused, not let in."""
    import psycopg
    with psycopg.connect(f"postgresql://me%40corp:{RIGHT}@127.0.0.1:{live}/postgres",
                         connect_timeout=5) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("me@corp",)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(f"postgresql://app:wrong@127.0.0.1:{live}/postgres", connect_timeout=5)


def test_db_init_never_says_it(tmp_path: Path) -> None:
    """End to end: ``handoffd db init`` on such a URL, given in the workspace's config."""
    url = f"postgresql://me@corp:QX?sslmode=disableJK@127.0.0.1:{nobody_on()}/db"
    root = tmp_path / "ws"
    root.mkdir()
    space = Workspace(root)
    space.write_config(f"[store]\nurl = \"{url}\"\nreconnect_seconds = 1\n")
    HandoffdWorkspace(root).ensure()
    done = space.handoffd("db", "init", timeout=30)
    assert done.returncode in (1, 2), done.stderr
    assert "QX" not in done.stderr and "JK" not in done.stderr, done.stderr
    assert "me@corp:***@127.0.0.1" in done.stderr or "not a valid" in done.stderr, done.stderr


@pytest.mark.parametrize("url", [
    "postgresql://app@db1:5432,db2:5433/h?application_name=me@box",
    "postgresql://app@[::1]:5432/h?application_name=a@b",
    "postgresql://app@[2001:db8::1]/h?application_name=a@b",
    "postgresql://app@db1:5432/h?sslrootcert=/etc/pg@x/root.crt"])
def test_a_url_without_a_password_keeps_its_hosts_and_ports_shown(url: str) -> None:
    """R64: a URL with a user, no password, and an "@" in its query was masked from its port's
    ":" on ("app@db1:***@box", "app@[:***@b"): which server failed was unreadable. A port that
    is a number, or an IPv6 host's colons, are no password's."""
    assert redact(url) == url
