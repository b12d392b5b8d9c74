"""A store URL's password is never said, whatever it holds (session 27, task G, after R54):

1. A password holding "/" and then "?keyword=" before its "@" (libpq reads it as host, port,
   database and query) reached stderr: quoted as a port by ``check_url``, shown whole by
   ``redact`` in the ``waiting for the database`` and ``unreachable`` lines. Masked from the ":"
   to the last "@" now, and libpq's words for the connection (:func:`scrubbed`) quote no piece.
2. Settings no wait cures (channel binding, ``require_auth``, an unknown service, GSSAPI
   encryption, ``keepalives=x`` after the server's address) were waited out for
   ``reconnect_seconds``: they fail at once.
3. A password holding ``"`` ended the parser's quote early, showing its rest.
4. A user name holding an unencoded "?" or "#" (libpq's user ends only at ":" or "@") showed
   the whole password.
5. A percent-escape that is not UTF-8 was an internal error (exit 1): the URL line, exit 2.

The hypothesis tests build URLs of lower-case letters, ``/ ? # @ : " %`` and spaces and libpq's
keywords (the letters of the earlier tests' passwords were upper-case, its keywords lower-case:
the "?sslmode=" in a password was never tried)."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import Workspace
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from handoffd.backends.postgres.connection import (cannot_connect, check_url,
                                                   connection_keywords,
                                                   reachable_later, redact, scrubbed)
from handoffd.core.errors import ConfigError
from handoffd.core.workspace import Workspace as HandoffdWorkspace

KEYWORDS = sorted(connection_keywords())
PIECES = st.one_of(st.sampled_from("abcdefghijklmnopqrstuvwxyz/?#@:\"% "),
                   st.sampled_from(KEYWORDS), st.sampled_from([f"?{k}=" for k in KEYWORDS]),
                   st.sampled_from([f"&{k}=" for k in KEYWORDS]))
PASSWORDS = st.lists(PIECES, min_size=1, max_size=10).map("".join)
USERS = st.text("abcdefghijklmnopqrstuvwxyz?#/", max_size=5)  # (libpq's user ends at ":", "@")
HOSTS = st.sampled_from(["db1", "db1:5432", "db1,db2:6432", "[::1]", "127.0.0.1:39425", ""])
QUERIES = st.one_of(st.just(""), st.builds(
    lambda key, value: f"?{key}={value}", st.sampled_from(KEYWORDS),
    st.text("abcdefghijklmnopqrstuvwxyz@:/", max_size=8)))
# what check_url says besides what it quotes (libpq's parser's words and its own)
WORDS = ("the store URL is not a valid PostgreSQL URL: it is malformed, its port is no number "
         "(a password holding an unencoded \",\", \":\" or \"/\" is read as host and port: "
         "percent-encode it) invalid integer value for connection option \"port\" invalid "
         "percent-encoded token: unexpected spaces found in use percent-encoded spaces (%20) "
         "instead extra key/value separator \"=\" in URI query parameter: missing key/value "
         "separator invalid URI query parameter: a percent-escape in it (%XX) is not UTF-8 "
         "text forbidden value %00 in percent-encoded value unexpected character at position "
         "in URI (expected \":\" or \"/\") end of string reached when looking for matching "
         "\"]\" in IPv6 host address IPv6 host address may not be empty in URI")


def leaked(password: str, around: str, said: str) -> list[str]:
    """The pieces (4 characters or more) of ``password`` that ``said`` holds, but the URL's
    other parts (``around``) and the messages' own words do not."""
    return [password[i:j] for i in range(len(password)) for j in range(i + 4, len(password) + 1)
            if password[i:j] in said and password[i:j] not in around
            and password[i:j] not in WORDS]


def a_url(user: str, password: str, hosts: str, query: str) -> tuple[str, str]:
    """The URL, and its parts other than the password (joined by a character no piece of a
    password can straddle)."""
    before, after = f"postgresql://{user}:", f"@{hosts}/db{query}"
    return before + password + after, before + "\n" + after


def secret_enough(password: str) -> bool:
    """Not the documented limit: a password holding an "@" and then "?keyword=" cannot be
    told from a userinfo followed by a query (percent-encode it)."""
    at = password.find("@")
    return at < 0 or not any(f"?{key}=" in password[at:] for key in KEYWORDS)


@settings(max_examples=600, deadline=None)
@given(USERS, PASSWORDS, HOSTS, QUERIES)
@example("u", "sec/ret?sslmode=disable", "127.0.0.1:39425", "")
@example("u", "sec/ret?port=yz", "host", "")
@example("localhost", "1234/secretx?application_name=x", "127.0.0.1:39425", "")
@example("u", 'sec"ret%passw0rd', "127.0.0.1", "")
@example("u", 'sec"ret passw0rd', "127.0.0.1", "")
@example("a?b", "secretx", "127.0.0.1:39425", "")
@example("a#b", "secretx", "127.0.0.1:39425", "")
def test_no_password_text_is_ever_said(user: str, password: str, hosts: str,
                                       query: str) -> None:
    assume(secret_enough(password))
    url, around = a_url(user, password, hosts, query)
    shown = redact(url)
    assert not leaked(password, around, shown), (url, shown)
    try:
        check_url(url)
    except ConfigError as exc:
        said = str(exc)
        assert not leaked(password, around, said), (url, said)
        assert len(said.splitlines()) == 1, said


@pytest.mark.parametrize("url", ["postgresql://u:SECRET%99X@127.0.0.1/db",
                                 "postgresql://u%FF:pw@127.0.0.1/db",
                                 "postgresql://u:pw@127.0.0.1/d%C3b"])
def test_a_percent_escape_that_is_no_utf8_is_the_url_line(url: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_url(url)
    assert str(raised.value) == ("the store URL is not a valid PostgreSQL URL: a percent-escape "
                                 "in it (%XX) is not UTF-8 text")


@pytest.mark.parametrize("url", ["postgresql://a?b:SECRETX@127.0.0.1:39425/db",
                                 "postgresql://a#b:SECRETX@127.0.0.1:39425/db",
                                 "postgresql://me@server:SECRETX@server.example/db"])
def test_a_user_holding_a_question_mark_or_an_at_sign_keeps_the_password_masked(
        url: str) -> None:
    assert "SECRETX" not in redact(url) and redact(url).endswith(":***@" + url.split("@")[-1])


@pytest.mark.parametrize("detail, url", [
    ('connection to server at "localhost" (::1), port 1234 failed: Connection refused',
     "postgresql://localhost:1234/secretx?application_name=x@127.0.0.1:39425/db"),
    ("failed to resolve host 'secr': [Errno -2] Name or service not known",
     "postgresql://u:12,secr:1/x@h/db"),
    ('connection is bad: invalid sslmode value: "verysecret@h/db"',
     "postgresql://u:5/x?sslmode=verysecret@h/db"),
    ('invalid integer value "se"cret" for connection option "port"',
     'postgresql://u:5/x?port=se"cret@h/db'),
    # psycopg's summary of several attempts (R57): the password read as hosts and ports
    ("connection failed: Multiple connection attempts failed. All failures were: - host: '', "
     "port: '1234', hostaddr: '': x - host: 'secr.example', port: '7777', hostaddr: '': y",
     "postgresql://:1234,secr.example:7777/QWXZ@127.0.0.1:1/db")])
def test_libpqs_words_quote_no_piece_of_a_password(detail: str, url: str) -> None:
    said = scrubbed(detail, url)
    assert not any(secret in said for secret in ("1234", "secr", "verysecret")), said


def test_libpqs_words_keep_what_the_url_shows() -> None:
    url = "postgresql://u:pw@db1:6432/db?sslmode=bogus&host=%2Ftmp%2Fs"
    for detail in ('connection to server at "db1" (10.0.0.1), port 6432 failed: refused',
                   'invalid sslmode value: "bogus"',
                   'connection to server on socket "/tmp/s/.s.PGSQL.6432" failed: no such file'):
        assert scrubbed(detail, url) == detail


@pytest.mark.parametrize("detail", [
    'connection to server on socket "/s/.s.PGSQL.5432" failed: channel binding required, but '
    "server authenticated client without channel binding",
    'connection to server at "h" (1.2.3.4), port 5 failed: channel binding required, but SSL '
    "not in use",
    'connection to server on socket "/s/.s.PGSQL.5432" failed: authentication method '
    'requirement "md5" failed: server did not complete authentication',
    'connection is bad: definition of service "nonexistent" not found',
    "connection is bad: GSSAPI encryption required but it is not supported over a local socket",
    "connection is bad: GSSAPI encryption required but no credential cache",
    'connection is bad: connection to server at "127.0.0.1", port 1 failed: invalid integer '
    'value "x" for connection option "keepalives"',
    'connection is bad: could not parse network address "x": Name or service not known'])
def test_settings_no_wait_cures_are_not_waited_out(detail: str) -> None:
    assert not reachable_later(detail)


# ------------------------------------------------------------------- end to end: db init
def nobody_on() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def store_workspace(root: Path, url: str, reconnect: int = 60) -> Workspace:
    """A workspace whose store is ``url`` (any text: written as a TOML string)."""
    root.mkdir(parents=True)
    space = Workspace(root)
    space.write_config(f"[store]\nurl = {json.dumps(url)}\nreconnect_seconds = {reconnect}\n")
    HandoffdWorkspace(root).ensure()
    return space


def test_db_init_never_says_a_password_holding_a_query(tmp_path: Path) -> None:
    """R54's URLs: a password holding "/" then "?sslmode=" or "?port=" (exit 2), or read by
    libpq as host, port and database with a database that is away (waited for, then exit 1)."""
    port = nobody_on()
    for n, url in enumerate([f"postgresql://u:sec/ret?sslmode=disable@127.0.0.1:{port}/db",
                             "postgresql://u:sec/ret?port=yz@host/db"]):
        done = store_workspace(tmp_path / f"ws{n}", url).handoffd("db", "init", timeout=30)
        assert done.returncode == 2, done.stderr
        assert "sec" not in done.stderr and "ret" not in done.stderr, done.stderr
        assert "yz" not in done.stderr and "disable" not in done.stderr, done.stderr
    other = nobody_on()
    url = f"postgresql://localhost:{other}/secretx?application_name=x@127.0.0.1:{port}/db"
    space = store_workspace(tmp_path / "away", url, reconnect=1)
    for done in (space.handoffd("db", "init", timeout=30), space.handoff("ls", timeout=30)):
        assert done.returncode == 1, done.stderr
        assert "waiting for the database at postgresql://localhost:***@127.0.0.1:" in done.stderr
        assert "unreachable" in done.stderr, done.stderr
        assert "secretx" not in done.stderr and str(other) not in done.stderr, done.stderr


@pytest.mark.parametrize("url", ['postgresql://u:Sec"ret%Passw0rd@127.0.0.1/db',
                                 'postgresql://u:Sec"ret Passw0rd@127.0.0.1/db'])
@pytest.mark.parametrize("command", [("handoffd", "db", "init"), ("handoff", "ls")])
def test_a_password_holding_a_quote_is_never_said(tmp_path: Path, url: str,
                                                  command: tuple[str, ...]) -> None:
    space = store_workspace(tmp_path / "ws", url)
    run = space.handoffd if command[0] == "handoffd" else space.handoff
    done = run(*command[1:], timeout=30)
    assert done.returncode == 2, done.stderr
    assert "ret" not in done.stderr and "Passw0rd" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "the store URL is not a valid" in done.stderr


def test_a_percent_escape_that_is_no_utf8_is_exit_2(tmp_path: Path) -> None:
    space = store_workspace(tmp_path / "ws", "postgresql://u:SECRET%99X@127.0.0.1/db")
    for done in (space.handoffd("db", "init", timeout=30), space.handoff("ls", timeout=30)):
        assert done.returncode == 2, done.stderr
        assert "SECRET" not in done.stderr and "internal error" not in done.stderr, done.stderr


@pytest.mark.parametrize("option", ["channel_binding=require", "require_auth=md5",
                                    "service=nonexistent", "gssencmode=require"])
def test_settings_no_wait_cures_fail_db_init_at_once(tmp_path: Path, pg_url: str,
                                                     option: str) -> None:
    """With reconnect_seconds = 60 each took 61 s and ended "unreachable"."""
    space = store_workspace(tmp_path / "ws", f"{pg_url}&{option}")
    for done in (space.handoffd("db", "init", timeout=40), space.handoff("ls", timeout=40)):
        assert done.returncode == 1, done.stderr
        assert "waiting" not in done.stderr and "unreachable" not in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr


def test_an_unusable_option_after_the_servers_address_is_exit_2(tmp_path: Path) -> None:
    space = store_workspace(tmp_path / "ws",
                            f"postgresql://u@127.0.0.1:{nobody_on()}/db?keepalives=x")
    done = space.handoffd("db", "init", timeout=40)
    assert done.returncode == 2 and "waiting" not in done.stderr, done.stderr
    assert done.stderr == ("handoffd: error: the store URL is not a valid PostgreSQL URL: "
                           'invalid integer value "x" for connection option "keepalives"\n')


# ---------------------------------------------------------------- R57
def test_a_wrong_password_holding_a_quote_fails_at_once(tmp_path: Path, pg_url: str) -> None:
    """R57: the cleaning of libpq's words masked from the password's '"' to the last quote,
    the server's FATAL with it, and a refusal was waited out as an outage (60 s by default)
    and said "unreachable". It is judged by libpq's own words, said cleaned."""
    url = pg_url.replace("postgresql://postgres@", 'postgresql://nobody:wr"ongpw@')
    assert url != pg_url, pg_url
    space = store_workspace(tmp_path / "ws", url)
    done = space.handoffd("db", "init", timeout=40)
    assert done.returncode == 1 and "waiting" not in done.stderr, done.stderr
    assert "unreachable" not in done.stderr and "ongpw" not in done.stderr, done.stderr


@pytest.mark.parametrize("url", ['postgresql://app:Secret%pw"!@127.0.0.1:1/db',
                                 'postgresql://app:!"Secret%pw@127.0.0.1:1/db'])
def test_a_quote_at_a_passwords_edge_is_no_mark_kept(url: str) -> None:
    """R57: a one-character quote such as "!" was kept as libpq's mark, though it was the
    password's edge: the rest of the password was then quoted unmasked."""
    with pytest.raises(ConfigError) as refused:
        check_url(url)
    assert "Secret" not in str(refused.value), refused.value


def test_an_ipv6_host_without_a_password_is_said_whole() -> None:
    """R57: masked to the last "@" as if "[" were a user with a password."""
    url = "postgresql://[::1]:5432/appdb?application_name=svc@ops"
    assert redact(url) == url


def test_a_long_secret_is_cleaned_before_it_is_cut() -> None:
    """R57: libpq's words were cut to 300 characters first, and a quote left open masked
    nothing."""
    secret = "Q" * 400
    url = f"postgresql://localhost:5/x?keepalives=1{secret}@127.0.0.1:1/db"
    error = cannot_connect(url, f'invalid integer value "1{secret}" for connection option '
                                '"keepalives"')
    assert "QQQQ" not in str(error), error
