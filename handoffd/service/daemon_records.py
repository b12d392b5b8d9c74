"""Who serves a workspace, for ``handoff ls``: ``handoffs/.meta/serving/<pid>.<random>.json``,
one small record per ``handoffd serve`` (its first process) while it runs.

``serve`` reads handoffd.toml once, at its start, and its sweep logs one warning per change of
the file (:class:`.sweeper.ConfigWatch`); but users look at ``handoff ls``, not at the daemon's
log. So the daemon records its pid, its liveness mark (:mod:`..core.liveness`: a reused pid or
a process of another boot never bears it) and the stamp of handoffd.toml it started with, and
``ls`` compares that stamp with the file's now (:func:`stale_line`): one short folder read and
one stat, nothing when no daemon serves.

A record is a file of the workspace, and anyone who can write the workspace can plant one: it
only ever leads to a line on stderr, and only for a live process of this host bearing the mark
it names. Records of other hosts (a shared workspace, or daemons of a PostgreSQL store on other
hosts, which read their own handoffd.toml) are not judged: ls says nothing of them. A record a
killed daemon left is ignored by ls and removed by the next ``serve`` of this host.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from ..core.documents import hostname
from ..core.jsontext import parse_line
from ..core.ownfiles import open_folder, open_regular, read_regular
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace

log = logging.getLogger("handoffd")

FOLDER = "serving"  # in handoffs/.meta
MAX_RECORD_BYTES = 4096
# at most this many entries of the folder are looked at: a folder filled with junk (planted,
# or left by daemons killed again and again) never makes ls slow
MAX_RECORDS = 32
# the name a daemon gives its record (ServingRecord.write): <pid>.<12 hex digits>.json
_RECORD_NAME = re.compile(r"[1-9][0-9]{0,9}\.[0-9a-f]{12}\.json")
# ... and at most this many names listed to find them (other names, a temp file a killed daemon
# left, are passed over without a read: they never hide the records behind them)
MAX_ENTRIES = 1024
# a temp file of a daemon killed between writing its record and renaming it is removed by the
# next serve once it is this old (a live one renames its own within microseconds)
TMP_LEFT_SECONDS = 60.0
Stamp = tuple[int, int, int, int] | None  # (device, inode, size, mtime in ns); None: no file


def config_stamp(path: Path) -> Stamp:
    """handoffd.toml's identity and version, as one stat sees it (None: not there, or it cannot
    be looked at): what :class:`.sweeper.ConfigWatch` and a record compare."""
    try:
        info = os.stat(path)  # (a symlink: its target, what the config is read from)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _folder(ws: Workspace) -> Path:
    return ws.meta / FOLDER


class ServingRecord:
    """This process's record (see the module docstring), written by :meth:`write` and removed by
    :meth:`remove`; ``stamp``: handoffd.toml's as the daemon read it."""

    def __init__(self, ws: Workspace, stamp: Stamp) -> None:
        self.ws, self.stamp = ws, stamp
        self.name: str | None = None

    def write(self) -> None:
        """Write the record (and remove those of dead daemons of this host); never raises: a
        daemon that cannot record itself serves all the same (one warning), and ls then says
        nothing of it."""
        from ..core.liveness import own_mark
        mark = own_mark()
        if mark is None:  # no /proc of our own: nobody could tell whether we live
            return
        body = {"host": hostname(), "pid": os.getpid(), "proc": mark[0], "ns": mark[1],
                "started": iso(utc_now()), "config": list(self.stamp) if self.stamp else None}
        name = f"{os.getpid()}.{os.urandom(6).hex()}.json"
        try:
            folder = open_folder(_folder(self.ws), make=True)
        except OSError as exc:
            log.warning("cannot record this daemon in %s (%s): handoff ls cannot say when "
                        "handoffd.toml changed", _folder(self.ws), exc.strerror or exc)
            return
        try:
            _remove_dead(folder, mark)
            tmp = f".{name}.tmp"
            fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=folder)
            try:
                with os.fdopen(fd, "w") as handle:
                    handle.write(json.dumps(body))
                os.rename(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                _unlink(folder, tmp)
                raise
            self.name = name
        except Exception as exc:  # (whatever the folder holds: the daemon serves all the same)
            log.warning("cannot record this daemon in %s (%s): handoff ls cannot say when "
                        "handoffd.toml changed", _folder(self.ws),
                        getattr(exc, "strerror", None) or exc)
        finally:
            os.close(folder)

    def remove(self) -> None:
        """Remove the record, if it was written; never raises (a record left behind names a
        dead process: ls ignores it, the next serve removes it)."""
        if self.name is None:
            return
        try:
            folder = open_folder(_folder(self.ws))
        except OSError:
            return
        try:
            _unlink(folder, self.name)
        finally:
            os.close(folder)
        self.name = None


def _unlink(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def _records(folder: int) -> list[tuple[str, dict[str, Any]]]:
    """The records in ``folder`` (at most :data:`MAX_RECORDS` read, among the first
    :data:`MAX_ENTRIES` names; only names a daemon gives its record count), with their names; what is not a readable JSON object is
    skipped, whatever it holds (a record nested thousands deep once stopped ``serve`` with
    a RecursionError: :func:`~handoffd.core.jsontext.parse_line` never raises)."""
    found: list[tuple[str, dict[str, Any]]] = []
    read = 0
    with os.scandir(folder) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_ENTRIES or read >= MAX_RECORDS:
                break
            if not _RECORD_NAME.fullmatch(entry.name):
                continue  # (not a name a daemon gives its record: never read, never counted)
            read += 1
            try:
                data = parse_line(read_regular(entry.name, MAX_RECORD_BYTES, dir_fd=folder))
            except OSError:
                continue
            if isinstance(data, dict):
                found.append((entry.name, data))
    return found


def _remove_left_temps(folder: int, now: float) -> None:
    """Remove the temp files (``.<name>.tmp``) of daemons killed between writing a record and
    renaming it, once :data:`TMP_LEFT_SECONDS` old (nothing else ever would)."""
    with os.scandir(folder) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_ENTRIES:
                break
            if not (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                continue
            try:
                old = now - entry.stat(follow_symlinks=False).st_mtime > TMP_LEFT_SECONDS
            except OSError:
                continue
            if old:
                _unlink(folder, entry.name)


def _remove_dead(folder: int, mark: tuple[str, str]) -> None:
    """Remove the records of daemons of this host (and of our namespaces, where we can look
    them up) that no live process bears: killed ones left them."""
    from ..core.liveness import bears_mark
    _remove_left_temps(folder, time.time())
    for name, data in _records(folder):
        if data.get("host") == hostname() and data.get("ns") == mark[1] \
                and not bears_mark(data.get("pid"), data.get("proc")):
            _unlink(folder, name)


def stale_daemons(ws: Workspace) -> list[int]:
    """The pids of the live daemons of this host serving ``ws`` that started with another
    handoffd.toml than the file now there (oldest record first; empty when none, or when
    anything cannot be read). One folder read when no daemon ever served here, a stat more
    when one serves."""
    try:
        folder = open_folder(_folder(ws))
    except OSError:
        return []
    try:
        records = _records(folder)
    except OSError:
        return []
    finally:
        os.close(folder)
    if not records:
        return []
    # (loaded only now: ls in a workspace no daemon serves reads one folder, nothing more)
    from ..core.liveness import bears_mark, own_mark
    mine = own_mark()
    if mine is None:
        return []
    now = config_stamp(ws.config_path)
    stale = []
    for _, data in records:
        pid, stamp = data.get("pid"), data.get("config")
        if data.get("host") != hostname() or data.get("ns") != mine[1]:
            continue  # another host's, or one we cannot look up: not ours to judge
        if not (stamp is None or isinstance(stamp, list) and len(stamp) == 4
                and all(type(part) is int for part in stamp)):
            continue
        if (tuple(stamp) if stamp is not None else None) == now:
            continue
        if type(pid) is int and bears_mark(pid, data.get("proc")):
            started = data.get("started")
            stale.append((started if isinstance(started, str) else "", pid))
    return [pid for _, pid in sorted(stale)]


def stale_line(ws: Workspace, prog: str = "handoff") -> str | None:
    """The line ``handoff ls`` prints on stderr when daemons serve ``ws`` with an older
    handoffd.toml than the file now there (:func:`stale_daemons`); None otherwise, and when
    anything goes wrong (ls never fails for it)."""
    try:
        pids = stale_daemons(ws)
    except Exception:  # (never ls's failure: a line it could not make is a line it leaves out)
        return None
    if not pids:
        return None
    if len(pids) == 1:
        return (f"{prog}: the daemon serving this workspace (pid {pids[0]}) started before "
                "handoffd.toml last changed: restart it to apply the changes")
    shown = ", ".join(str(pid) for pid in pids[:4]) + (", ..." if len(pids) > 4 else "")
    return (f"{prog}: {len(pids)} daemons serving this workspace (pids {shown}) started before "
            "handoffd.toml last changed: restart them to apply the changes")
