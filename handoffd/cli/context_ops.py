"""``handoff context get`` and ``set`` without typer: what the quick path (:mod:`.quick`) and
the full command line (:mod:`.orchestration_cmd`) both run, and the argument checks the
orchestration commands share (``--as``, ``--data``/``--input``, a context key).

Agents read and write shared context between their steps, often several times a handoff, so
these two start as ``handoff create`` does: no typer, click or rich (about 50 ms of imports).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.errors import ErrorCode, InvalidDocument, NotFound, UsageError
from .basics import json_arg, open_workspace, read_json_arg, text_arg
from .render import clean, print_json

DEFAULT_AGENT = "@cli"


def value_arg(data: str | None, input_file: str | None, max_bytes: int, *,
              depth_below: int | None = None, what: str = "--data") -> Any:
    """The value of --data JSON (``what``: how the command line gave it) or --input FILE|-
    (at most ``max_bytes``, the workspace's ``daemon.max_document_bytes``)."""
    if (data is None) == (input_file is None):
        raise UsageError("give the value with --data JSON or --input FILE|-")
    if data is not None:
        return json_arg(data, what, depth_below=depth_below)
    return read_json_arg(str(input_file), max_bytes, "--input", depth_below=depth_below)


def agent_arg(as_agent: str | None) -> str:
    """``--as``, else the specialist a command handler runs as ($HANDOFF_TARGET), else @cli."""
    return text_arg(as_agent or os.environ.get("HANDOFF_TARGET") or DEFAULT_AGENT, "--as")


def key_arg(key: str) -> str:
    """``key`` when it can name a context value; a usage error (exit 2) otherwise. The store
    checks it again: what it refuses beyond this (a key a symlink in ``context/`` sends
    elsewhere) is the workspace's problem, not the argument's, and stays exit 1."""
    from ..core.keys import normalise_key
    try:
        normalise_key(key)
    except InvalidDocument as exc:
        raise UsageError(str(exc)) from None
    return key


def context_store(root: str | Path | None, config: Any = None) -> Any:
    """The workspace's context: its ``context/`` folder, or the shared store's (a
    PostgreSQL store named by $HANDOFFD_STORE or [store] url). ``config``: the workspace's,
    when the caller loaded it."""
    from ..features.context import ContextStore, Permissions
    from ..features.stores import context_backend

    ws = open_workspace(root)
    if config is None:
        config = ws.load_config()  # validated once (a bad [namespaces] table: exit 2)
    backend = None
    if config.store_url() is not None:  # psycopg loads only for a PostgreSQL store
        from ..features.build import open_backend
        backend = open_backend(ws, config, workers=1)  # closed when the command exits
    return ContextStore(ws, Permissions.from_config(config), durable=config.daemon.durable,
                        backend=context_backend(ws, backend, durable=config.daemon.durable))


def get(root: str | Path | None, key: str, *, with_revision: bool = False) -> None:
    """``handoff context get``: print a context value as JSON (NotFound, exit 3, if unset)."""
    key = key_arg(key)
    store = context_store(root)
    try:
        value, revision = store.get_with_revision(key)
    except KeyError:
        raise NotFound(f"context key {key!r} is not set; `handoff context ls` lists the keys") from None
    if with_revision:
        from ..features.context import normalise_key

        print_json({"key": normalise_key(key), "revision": revision, "value": value})
        return
    print_json(value)


def put(root: str | Path | None, key: str, value: str | None = None, *, data: str | None = None,
        input_file: str | None = None, if_revision: int | None = None,
        as_agent: str | None = None) -> None:
    """``handoff context set``: write a value (the VALUE argument, --data or --input) as
    ``--as`` (compare-and-set with ``if_revision``) and print one line saying so."""
    if value is not None:
        if data is not None or input_file is not None:
            raise UsageError("give the value once: as the VALUE argument, --data or --input")
        data = value
    key, agent, writer = key_arg(key), agent_arg(as_agent), writer_handoff()
    config = open_workspace(root).load_config()
    store = context_store(root, config)
    given = value_arg(data, input_file, config.daemon.max_document_bytes,
                      what="--data" if value is None else "VALUE")
    try:
        entry = store.set(key, given, agent=agent, handoff_id=writer, if_revision=if_revision)
    except InvalidDocument as exc:  # a value over the store's size or depth limit: the argument's
        if exc.code != ErrorCode.INVALID_CONTEXT_VALUE:
            raise
        raise UsageError(str(exc)) from None
    refresh_mirror(store)
    print(clean(f"{entry['key']}: written by {entry['by']} (revision {entry['revision']}, "
                f"{entry['bytes']} bytes, sha256 {entry['sha256'][:12]})"))


def writer_handoff() -> str | None:
    """The handoff a ``context set`` writes for: ``$HANDOFF_ID``, which the daemon sets for a
    command handler and the history records beside the write (unset or empty: none). A value
    no handoff id can be (argv's undecodable bytes, a path, 100 kB) is a usage error (exit 2),
    said before anything is written: it was stored as given, or failed as an internal error."""
    from ..core.documents import check_id
    given = os.environ.get("HANDOFF_ID")
    if not given:
        return None
    try:
        return check_id(given)
    except InvalidDocument as exc:
        raise UsageError(f"$HANDOFF_ID (the handoff this write is for): {exc}; unset it or "
                         "give the id of the handoff being run") from None


def refresh_mirror(store: Any) -> None:
    """On a shared store, bring this workspace's ``context/`` copy up to date at once (a
    command handler that sets a key and then reads its file finds the new value)."""
    from ..features.context_mirror import ContextMirror, guarded
    from ..features.stores import is_shared
    if is_shared(store.backend):
        guarded("refreshing context/", ContextMirror(store, durable=store.durable).pull)
