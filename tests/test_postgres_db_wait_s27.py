"""PostgreSQL start-up and URL handling (session 27, task D):

1. ``handoffd db init`` started while the database was down failed at once (exit 1), and
   ``db import`` waited 60 s whatever ``[store] reconnect_seconds`` said, in a line without
   the ``handoffd:`` prefix, deaf to a stop. Both now wait as every command does: the same
   line, the same bound, the same refusals that fail at once, and a SIGTERM meanwhile ends the
   wait with exit 0 (``stopped: before it began, ...``, as ``serve`` and ``run`` say it).
2. ``redact`` masked the host along with the password when the query held an "@"
   (``?application_name=a@b``): only the password is masked now.
3. ``check_url`` quoted a port made of password pieces (a password holding an unencoded ",",
   ":" or "/" is read as hosts and ports): the port is quoted only where it is no password's.

The end-to-end tests of 1 stop and start a cluster of their own (test_postgres_first_connect_s26's
``own_server``); the rest need no server, or the session's (``pg_url``)."""
from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pgserver
import pytest
from conftest import exe, wait_for_words
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_postgres import pg_workspace
from test_postgres_first_connect_s26 import ended, own_server, started  # noqa: F401
from test_postgres_outage_s20 import down, up

from handoffd.backends.postgres.connection import check_url, connection_keywords, redact
from handoffd.core.errors import ConfigError

DB_COMMANDS = [("db", "init"), ("db", "import")]


def nobody_listens(tmp_path: Path) -> str:
    """A URL whose socket folder no server listens in (the port's socket is absent)."""
    folder = tmp_path / "sock"
    folder.mkdir()
    return f"postgresql://postgres@/handoffd?host={folder}"


# ------------------------------------------------- 1. db commands wait out an outage
@pytest.mark.heavy
@pytest.mark.parametrize("command", DB_COMMANDS)
def test_a_db_command_started_while_the_server_is_down_waits_for_it(
        tmp_path: Path, own_server: pgserver.PgServer, command: tuple[str, ...]) -> None:
    url = own_server.new_database()
    space = pg_workspace(tmp_path / "ws", url)  # (reconnect_seconds: 60, the default)
    down(own_server)  # nobody listens on the URL's port now
    try:
        proc = started(space.root, tmp_path / "db.err", "handoffd", *command)
        said = wait_for_words(tmp_path / "db.err", ["waiting for the database"])
        assert proc.poll() is None, said  # (it failed at once, exit 1)
    finally:
        up(own_server)  # the cluster started on it within the wait
    assert ended(proc) == 0, (tmp_path / "db.err").read_text()
    lines = (tmp_path / "db.err").read_text().splitlines()
    assert lines[0].startswith(f"handoffd: waiting for the database at {redact(url)} "
                               "(up to 60s): "), lines
    assert proc.stdout is not None
    out = proc.stdout.read()
    if command == ("db", "init"):
        assert re.fullmatch(r"schema version \d+\n", out), out
        assert lines[1:] == [lines[-1]] and lines[-1].startswith("handoffd: db init: "), lines
    # the store is set up: a second run finds it up to date at once
    again = space.handoffd("db", "init", timeout=30)
    assert again.returncode == 0 and "waiting" not in again.stderr, again.stderr


@pytest.mark.parametrize("command", DB_COMMANDS)
def test_a_stop_while_a_db_command_waits_ends_it_with_exit_0(
        tmp_path: Path, command: tuple[str, ...]) -> None:
    url = nobody_listens(tmp_path)
    space = pg_workspace(tmp_path / "ws", url)  # (reconnect_seconds: 60, the default)
    proc = started(space.root, tmp_path / "db.err", "handoffd", *command)
    try:
        said = wait_for_words(tmp_path / "db.err", ["waiting for the database"])
        assert "waiting for the database" in said and proc.poll() is None, said
        proc.send_signal(signal.SIGTERM)
        assert ended(proc, 30) == 0  # (long before the 60 s window would end)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    lines = (tmp_path / "db.err").read_text().splitlines()
    assert lines == [lines[0], "handoffd: stopped: before it began, waiting for the database "
                     f"at {redact(url)}"], lines


@pytest.mark.parametrize("command", DB_COMMANDS)
def test_a_db_command_waits_no_longer_than_reconnect_seconds(
        tmp_path: Path, command: tuple[str, ...]) -> None:
    url = nobody_listens(tmp_path)
    space = pg_workspace(tmp_path / "ws", url)
    space.write_config((space.root / "handoffd.toml").read_text() + "reconnect_seconds = 1\n")
    done = space.handoffd(*command, timeout=30)  # (db import waited 60 s)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"handoffd: waiting for the database at {redact(url)} (up to 1s): ")
    assert lines[1].startswith(f"handoffd: error: the PostgreSQL store {redact(url)} is "
                               "unreachable: "), lines


@pytest.mark.parametrize("command", DB_COMMANDS)
@pytest.mark.parametrize("change, words", [
    (("postgresql://postgres@", "postgresql://nobody@"), 'role "nobody" does not exist'),
    (("?host=", "_missing?host="), "_missing\" does not exist")])
def test_a_refusal_fails_a_db_command_at_once(tmp_path: Path, pg_url: str,
                                              command: tuple[str, ...],
                                              change: tuple[str, str], words: str) -> None:
    space = pg_workspace(tmp_path / "ws", pg_url.replace(*change))
    done = space.handoffd(*command, timeout=30)
    assert done.returncode == 1 and "waiting" not in done.stderr, done.stderr
    assert words in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


# -------------------------------------------------- 2. an "@" in the query keeps the host
@pytest.mark.parametrize("url, said", [
    ("postgresql://u:pw@db1/h?application_name=a@b",
     "postgresql://u:***@db1/h?application_name=a@b"),
    ("postgresql://u:pw@db1?application_name=a@b&password=x",
     "postgresql://u:***@db1?application_name=a@b&password=***"),
    ("postgresql://u:p@ss@db1:5432/h?application_name=a@b",
     "postgresql://u:***@db1:5432/h?application_name=a@b"),
    ("postgresql://u:s3/cr@db1/h?options=-c%20x%3Dy@z", "postgresql://u:***@db1/h?options=-c%20x%3Dy@z"),
    ("postgresql://u:x?sslmode=y@db1/h", "postgresql://u:***@db1/h"),  # (libpq's password)
    # (no userinfo, but it cannot be told from user "db1" with a password holding "/" and
    # "?application_name=": masked more rather than less, R54; a "%40" keeps it whole)
    ("postgresql://db1:5432/h?application_name=a@b", "postgresql://db1:***@b"),
    ("postgresql://db1:5432/h?application_name=a%40b",
     "postgresql://db1:5432/h?application_name=a%40b"),
])
def test_an_at_sign_in_the_query_masks_only_the_password(url: str, said: str) -> None:
    assert redact(url) == said


PASSWORD_LETTERS = "JKVWXYZ"  # (none of them is in the URLs' other parts, nor in messages)
PASSWORDS = st.text(PASSWORD_LETTERS + "@/:?#,=&%[]!", min_size=1, max_size=24)
QUERIES = st.sampled_from(["", "?sslmode=disable", "?application_name=a@b",
                           "?application_name=me@host&sslmode=require",
                           "?options=-c%20a%3Db@c&%70assword=q"])


def no_query_in(password: str) -> bool:
    """A password that holds no "?keyword=", or neither "/" nor "@": only then is the host
    sure to be kept (otherwise it may be masked with the password, more rather than less;
    test_postgres_url_secrets_s27g checks that no password shows, whatever it holds)."""
    return ("/" not in password and "@" not in password) or not any(
        f"?{key}=" in password for key in connection_keywords())


@settings(max_examples=300, deadline=None)
@given(PASSWORDS, QUERIES, st.sampled_from(["db1", "db1:5432", "db1,db2:6432", "[::1]"]))
@example("pw", "?application_name=a@b", "db1")
@example("p@ss/w?rd", "?application_name=a@b", "db1")
def test_any_password_is_masked_and_the_host_kept(password: str, query: str,
                                                  hosts: str) -> None:
    assume(no_query_in(password))
    shown = redact(f"postgresql://u:{password}@{hosts}/db{query}")
    assert shown == f"postgresql://u:***@{hosts}/db{query.replace('=q', '=***')}"


# --------------------------------------------------- 3. a port made of password pieces
@pytest.mark.parametrize("url", ["postgresql://u:J:5/X@host/db",
                                 "postgresql://u:JK,WX:YZ/x@host/db",  # (port "JK,YZ")
                                 "postgresql://u:J@h:KW@host/db",  # (port "KW@host")
                                 "postgresql://u:JK,[WX]YZ/x@host/db"])  # (the parser's words)
def test_a_port_made_of_password_pieces_is_never_quoted(url: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_url(url)
    said = str(raised.value)
    assert said.startswith("the store URL is not a valid PostgreSQL URL: "), said
    assert not set(PASSWORD_LETTERS) & set(said), said


@pytest.mark.parametrize("url, port", [("postgresql://u:pw@host:badport/db", "badport"),
                                       ("postgresql://u:pw@h1:5432,h2:bad/db", "5432,bad"),
                                       ("postgresql://u:pw@h1/db?port=bad", "bad")])
def test_a_port_that_is_no_number_is_still_quoted_where_it_is_no_password(url: str,
                                                                          port: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_url(url)
    assert str(raised.value) == ("the store URL is not a valid PostgreSQL URL: invalid integer "
                                 f'value "{port}" for connection option "port"')


@settings(max_examples=300, deadline=None)
@given(PASSWORDS, st.sampled_from(["host", "host:5432", ""]))
@example("J:KW/X", "host")
@example("JK,WX:YZ/X", "host")
def test_check_url_never_says_a_password(password: str, host: str) -> None:
    try:
        check_url(f"postgresql://u:{password}@{host}/db")
    except ConfigError as exc:
        said = str(exc)
        assert not set(PASSWORD_LETTERS) & set(said), said
        assert len(said.splitlines()) == 1, said


def test_db_init_says_a_malformed_url_without_its_password(tmp_path: Path) -> None:
    space = pg_workspace(tmp_path / "ws", "postgresql://u:JK,WX:YZ/x@host/db")
    done = subprocess.run([exe("handoffd"), "db", "init", "--root", str(space.root)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert not set(PASSWORD_LETTERS) & set(done.stderr), done.stderr
    assert done.stderr.startswith("handoffd: error: the store URL is not a valid PostgreSQL "
                                  "URL: it is malformed"), done.stderr


@pytest.mark.parametrize("key", ["oauth_client_secret", "scram_client_key", "scram_server_key",
                                 "sslpassword", "password"])
def test_every_secret_option_of_libpq_is_masked(key: str) -> None:
    """Helper D's note: libpq's newer secret options were printed as given."""
    from handoffd.backends.postgres.connection import redact
    said = redact(f"postgresql://u@db1/h?{key}=s3cr3tvalue&application_name=x")
    assert "s3cr3tvalue" not in said and "db1" in said and "application_name=x" in said
