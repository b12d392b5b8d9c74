"""Who serves a workspace, for ``handoff ls``: ``handoffs/.meta/serving/<pid>.<mark>.json``,
one small record per ``handoffd serve`` (its first process) while it runs.

``serve`` reads handoffd.toml once, at its start, and its sweep logs one warning per change of
the file (:class:`.sweeper.ConfigWatch`); but users look at ``handoff ls``, not at the daemon's
log. So the daemon records its pid, its liveness mark (:mod:`..core.liveness`: a reused pid or
a process of another boot never bears it) and the stamp of handoffd.toml it started with, and
``ls`` compares that stamp with the file's now (:func:`stale_line`): one short folder read and
one stat, nothing when no daemon serves.

A record's name carries its pid and the first 12 hex digits of its mark, so ``ls`` tells a
live daemon's record from a dead one's by its name alone (one /proc read per pid named), before
reading anything: records killed daemons left, and junk under record-like names, never take the
place of the live ones among the few it reads (the newest first, by mtime).

A record is a file of the workspace, and anyone who can write the workspace can plant one: it
only ever leads to a line on stderr, and only for a live process of this host bearing the mark
it names. Records of other hosts (a shared workspace, or daemons of a PostgreSQL store on other
hosts, which read their own handoffd.toml) are not judged: ls says nothing of them.

Removal, by every ``serve`` (at its start, then every :data:`RENEW_SECONDS`): a record of this
host (in our namespaces) that no live process bears is removed at once. A record this process
cannot look up in /proc (another host's, or another pid namespace's) is judged by its mtime: a
serving daemon renews it every :data:`RENEW_SECONDS`, so one not renewed for
:data:`LEFT_SECONDS` (a day, 288 renewals) names a daemon that died (or hung for a day) and is
removed. Its age is measured on the filesystem's clock (against the mtime of the remover's own
record, just renewed), not on the hosts' clocks, which may disagree. A live daemon whose record
went missing all the same writes it again at its next renewal.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable

from ..core.documents import hostname
from ..core.jsontext import parse_line
from ..core.ownfiles import open_folder, open_regular, read_regular
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace

log = logging.getLogger("handoffd")

FOLDER = "serving"  # in handoffs/.meta
MAX_RECORD_BYTES = 4096
# the name a daemon gives its record (ServingRecord.write): <pid>.<its mark's first 12 hex>.json
_RECORD_NAME = re.compile(r"([1-9][0-9]{0,9})\.([0-9a-f]{12})\.json")
MARK_DIGITS = 12
# at most this many names of the folder are listed (names only, and a stat of those named as
# records): a folder filled with junk never makes ls or serve slow. Other names, a temp file a
# killed daemon left, are passed over without a read: they never hide the records behind them
MAX_ENTRIES = 4096
# at most this many records are read by ls (those whose name is a live process's, newest
# first) ...
MAX_RECORDS = 32
# ... and by a serve's removal of the dead (those whose name is not, oldest first)
MAX_SWEPT = 256
# a serving daemon renews its record's mtime this often (and removes the records of the dead)
RENEW_SECONDS = 300.0
# a record no process of ours can look up, not renewed for this long, is a dead daemon's
LEFT_SECONDS = 24 * 3600.0
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
    """This process's record (see the module docstring), written by :meth:`write`, renewed by
    :meth:`renew` and removed by :meth:`remove`; ``stamp``: handoffd.toml's as the daemon read
    it; ``clock``: when :meth:`renew` renews (tests move it)."""

    def __init__(self, ws: Workspace, stamp: Stamp,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ws, self.stamp, self.clock = ws, stamp, clock
        self.name: str | None = None
        self.renewed = clock()

    def write(self) -> None:
        """Write the record (and remove those of dead daemons); never raises: a daemon that
        cannot record itself serves all the same (one warning), and ls then says nothing of
        it."""
        from ..core.liveness import own_mark
        self.renewed = self.clock()
        mark = own_mark()
        if mark is None:  # no /proc of our own: nobody could tell whether we live
            return
        body = {"host": hostname(), "pid": os.getpid(), "proc": mark[0], "ns": mark[1],
                "started": iso(utc_now()), "config": list(self.stamp) if self.stamp else None}
        # (the mark in the name: ls tells a live record from a dead one without reading it)
        name = f"{os.getpid()}.{mark[0][:MARK_DIGITS]}.json"
        try:
            folder = open_folder(_folder(self.ws), make=True)
        except OSError as exc:
            log.warning("cannot record this daemon in %s (%s): handoff ls cannot say when "
                        "handoffd.toml changed", _folder(self.ws), exc.strerror or exc)
            return
        try:
            tmp = f".{name}.{os.urandom(6).hex()}.tmp"
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
        else:
            try:
                _remove_dead(folder, mark, _own_mtime(folder, name))
            except Exception as exc:  # (recorded all the same: the next renewal tries again)
                log.debug("cannot remove the records of dead daemons: %s", exc)
        finally:
            os.close(folder)

    def renew(self) -> None:
        """Every :data:`RENEW_SECONDS` (else nothing, at once): touch the record (its mtime is
        the liveness other hosts see) and remove the records of the dead; write it again if
        it went missing. Never raises."""
        if self.name is None or self.clock() - self.renewed < RENEW_SECONDS:
            return
        self.renewed = self.clock()
        from ..core.liveness import own_mark
        mark = own_mark()
        if mark is None:
            return
        try:
            folder = open_folder(_folder(self.ws))
        except FileNotFoundError:  # (the folder went too: made again with the record)
            self.write()
            return
        except OSError:
            return
        try:
            try:
                # (never through a symlink planted under its name: its own file, or nothing)
                os.utime(self.name, dir_fd=folder, follow_symlinks=False)
                missing = not stat.S_ISREG(os.stat(self.name, dir_fd=folder,
                                                   follow_symlinks=False).st_mode)
            except FileNotFoundError:
                missing = True
            if not missing:
                _remove_dead(folder, mark, _own_mtime(folder, self.name))
        except Exception as exc:  # (a renewal that failed: the next one tries again)
            log.debug("cannot renew this daemon's record: %s", exc)
            missing = False
        finally:
            os.close(folder)
        if missing:  # (removed while we live: by hand, or by a host with a wild clock)
            self.write()

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


def _own_mtime(folder: int, name: str) -> float:
    """The mtime of our own record, just written or renewed: "now" on the filesystem's clock,
    against which other hosts' records are aged (this host's clock if it cannot be read)."""
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False).st_mtime
    except OSError:
        return time.time()


def _listed(folder: int) -> list[tuple[str, int, str, os.stat_result]]:
    """The entries of ``folder`` named as records, among its first :data:`MAX_ENTRIES` names,
    that are regular files of at most :data:`MAX_RECORD_BYTES` (an lstat each: a symlink, a
    FIFO, a folder or a huge file under such a name is passed over, never opened): (name,
    pid, mark digits, stat)."""
    found = []
    with os.scandir(folder) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_ENTRIES:
                break
            named = _RECORD_NAME.fullmatch(entry.name)
            if named is None:
                continue  # (not a name a daemon gives its record: never read, never counted)
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_RECORD_BYTES:
                found.append((entry.name, int(named.group(1)), named.group(2), info))
    return found


def _read(folder: int, name: str) -> dict[str, Any] | None:
    """The record ``name`` as a JSON object, or None when it is none, whatever it holds (a
    record nested thousands deep once stopped ``serve`` with a RecursionError:
    :func:`~handoffd.core.jsontext.parse_line` never raises)."""
    try:
        data = parse_line(read_regular(name, MAX_RECORD_BYTES, dir_fd=folder))
    except OSError:
        return None
    return data if isinstance(data, dict) else None


def _named_live(pid: int, digits: str, marks: dict[int, str | None]) -> bool:
    """True when the name's pid is a live process of this host whose mark begins with the
    name's digits (``marks``: each pid's looked up once)."""
    from ..core.liveness import live_mark
    if pid not in marks:
        marks[pid] = live_mark(pid)
    mark = marks[pid]
    return mark is not None and mark.startswith(digits)


def _live_records(folder: int) -> list[tuple[int, dict[str, Any]]]:
    """ls's records: those whose name is a live process's (:func:`_named_live`), at most
    :data:`MAX_RECORDS` read, the newest first (a serving daemon renews its record's mtime),
    with the pid their name gives."""
    marks: dict[int, str | None] = {}
    live = [(info.st_mtime_ns, name, pid) for name, pid, digits, info in _listed(folder)
            if _named_live(pid, digits, marks)]
    live.sort(reverse=True)
    found = []
    for _, name, pid in live[:MAX_RECORDS]:
        data = _read(folder, name)
        if data is not None:
            found.append((pid, data))
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


def _remove_dead(folder: int, mark: tuple[str, str], now: float) -> None:
    """Remove the records of dead daemons (the rule in the module docstring; ``mark``: ours,
    ``now``: the filesystem's time). Those named as a live process's are kept unread; of the
    others, at most :data:`MAX_SWEPT` are read, the oldest first."""
    from ..core.liveness import bears_mark
    _remove_left_temps(folder, now)
    marks: dict[int, str | None] = {}
    others = [(info.st_mtime, name) for name, pid, digits, info in _listed(folder)
              if not _named_live(pid, digits, marks)]
    others.sort()
    for mtime, name in others[:MAX_SWEPT]:
        data = _read(folder, name)
        if data is not None and data.get("host") == hostname() and data.get("ns") == mark[1]:
            # ours to look up in /proc: removed once no live process bears it (a record of
            # an older handoffd, named at random, is kept while its daemon lives)
            if not bears_mark(data.get("pid"), data.get("proc")):
                _unlink(folder, name)
        elif now - mtime > LEFT_SECONDS:
            # another host's, or no record at all under a record's name: nothing renewed it
            # for a day (a live daemon renews its own every RENEW_SECONDS)
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
        records = _live_records(folder)
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
    for named, data in records:
        pid, stamp = data.get("pid"), data.get("config")
        if data.get("host") != hostname() or data.get("ns") != mine[1] or pid != named:
            continue  # another host's, one we cannot look up, or not the one its name gives
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
