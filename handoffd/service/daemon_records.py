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
host that no live process bears is removed at once. "This host" is the record's host name, pid
and time namespaces *and boot id* all ours: host names repeat (containers, cloned machines)
and the init namespaces' ids are the same on every host, so without the boot id two hosts of
one name removed each other's live records every five minutes (R47). Any other record (another
host's, another pid namespace's, or an older handoffd's, which wrote no boot id) is judged by
its mtime: a serving daemon renews it every :data:`RENEW_SECONDS`, so one not renewed for
:data:`LEFT_SECONDS` (a day, 288 renewals) names a daemon that died (or hung for a day) and is
removed, and so is one whose mtime is more than :data:`LEFT_SECONDS` ahead (no renewal sets
it there: planted, or touched by a wild clock). Ages are measured on the filesystem's clock
(against the mtime of the remover's own record, just renewed), not on the hosts' clocks, which
may disagree. That rule needs no read, so it removes all such files among the names listed,
and lists again while it removes (:data:`MAX_PASSES`): thousands of them listed before the live
record are gone once a serve starts or renews, and never hide it from ls. A live daemon whose
record went missing all the same writes it again at its next renewal.

Every folder is reached from ``handoffs/`` one at a time, never through a symlink
(:func:`~handoffd.core.ownfiles.open_beneath`): a ``.meta`` swapped for a link to a folder
outside once took a renewal's record (and the removal of record-named files) there. A renewal
that finds ``.meta`` or ``serving`` no plain folder writes and removes nothing (one warning).
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable

from ..core.documents import hostname
from ..core.jsontext import parse_line
from ..core.logs import log  # (deferred: `handoff ls` reads the records, logging nothing)
from ..core.ownfiles import folder_refusal, open_beneath, open_regular, read_regular
from ..core.timeutil import iso, utc_now
from ..core.workspace import Workspace


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
# ... and by a serve's removal of the dead (those whose name is not, oldest first), per listing
MAX_SWEPT = 256
# a serve's removal lists the folder again while a listing of MAX_ENTRIES names removed some, at
# most this many times: at most 65,536 names of removable junk gone per start or renewal
MAX_PASSES = 16
# a serving daemon renews its record's mtime this often (and removes the records of the dead)
RENEW_SECONDS = 300.0
# a record no process of ours can look up, not renewed for this long (or dated this far ahead),
# is a dead daemon's
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


def _open(ws: Workspace, make: bool = False) -> int:
    """A descriptor of the records folder, ``.meta`` and ``serving`` each opened from the one
    before without following a symlink (made when missing and ``make``, ``handoffs/`` too:
    a symlink there is the user's choice)."""
    if make:
        try:
            ws.handoffs.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # (a file or a dangling link: refused by the open)
    return open_beneath(ws.handoffs, [ws.meta.name, FOLDER], make=make)


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
        # (the process records' code, with the boot id, is a serving daemon's: `handoff ls`,
        # which only reads the records, never loads it unless a record names a live process)
        from ..core.liveness import own_mark
        from ..core.procrecords import boot_id
        self.renewed = self.clock()
        mark = own_mark()
        if mark is None:  # no /proc of our own: nobody could tell whether we live
            return
        # (the boot id: a host of the same name and namespaces' ids never takes it for its own)
        body = {"host": hostname(), "boot": boot_id(), "pid": os.getpid(), "proc": mark[0],
                "ns": mark[1], "started": iso(utc_now()),
                "config": list(self.stamp) if self.stamp else None}
        # (the mark in the name: ls tells a live record from a dead one without reading it)
        name = f"{os.getpid()}.{mark[0][:MARK_DIGITS]}.json"
        try:
            folder = _open(self.ws, make=True)
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
            folder = _open(self.ws)
        except FileNotFoundError:  # (the folder went too: made again with the record)
            self.write()
            return
        except OSError as exc:  # a link (or file) at .meta or serving: nothing through it
            log.warning("%s", folder_refusal(exc.filename or _folder(self.ws), exc,
                                             "this daemon's record is not renewed"))
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
            folder = _open(self.ws)
        except OSError:
            return
        try:
            _unlink(folder, self.name)
        finally:
            os.close(folder)
        self.name = None


def _unlink(folder: int, name: str) -> bool:
    """Remove ``name`` from ``folder``; whether it was removed (an error is no one's to see:
    the next renewal tries again)."""
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        return False
    return True


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


def _unrenewed(now: float, mtime: float) -> bool:
    """True when ``mtime`` is more than :data:`LEFT_SECONDS` from the filesystem's ``now``,
    either way: a serving daemon sets its record's to now every :data:`RENEW_SECONDS`, so one a
    day old was not renewed for a day, and one a day ahead never was (``now - mtime`` alone
    never grew past the day for it: such junk was kept for good)."""
    return abs(now - mtime) > LEFT_SECONDS


def _this_hosts(data: dict[str, Any], mark: tuple[str, str], boot: str) -> bool:
    """True when the record ``data`` is of this host, in our namespaces (``mark``: ours), so
    that /proc tells whether its daemon lives: its host name, namespaces and boot id all ours
    (a record without a boot id, an older handoffd's, never is)."""
    return (bool(boot) and data.get("boot") == boot and data.get("host") == hostname()
            and data.get("ns") == mark[1])


def _sweep_listing(folder: int, now: float, marks: dict[int, str | None]
                   ) -> tuple[bool, list[str], list[tuple[float, str]]]:
    """One listing of the folder's first :data:`MAX_ENTRIES` names, for :func:`_remove_dead`:
    (whether it was full, the names to remove without a read, the records to read (mtime,
    name)). To remove: the temp files (``.<name>.tmp``) of daemons killed between writing a
    record and renaming it, :data:`TMP_LEFT_SECONDS` old or ahead (nothing else ever would),
    and whatever is under a record's name, not named as a live process's, with an
    :func:`_unrenewed` mtime (anything but a folder: an unlink never follows a link). To read:
    the other regular files under a record's name but a live process's."""
    gone: list[str] = []
    unread: list[tuple[float, str]] = []
    count = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if count >= MAX_ENTRIES:
                break
            count += 1
            name = entry.name
            named = _RECORD_NAME.fullmatch(name)
            temp = name.startswith(".") and name.endswith(".tmp")
            if named is None and not temp:
                continue  # (not a name a daemon gives its files: never read, never removed)
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if temp:
                if abs(now - info.st_mtime) > TMP_LEFT_SECONDS:
                    gone.append(name)
            elif named is None or stat.S_ISDIR(info.st_mode) or \
                    _named_live(int(named.group(1)), named.group(2), marks):
                continue  # (a folder, or a live process's: kept unread)
            elif _unrenewed(now, info.st_mtime):
                gone.append(name)
            elif stat.S_ISREG(info.st_mode) and info.st_size <= MAX_RECORD_BYTES:
                unread.append((info.st_mtime, name))
    return count >= MAX_ENTRIES, gone, unread


def _remove_dead(folder: int, mark: tuple[str, str], now: float) -> None:
    """Remove the records of dead daemons (the rules in the module docstring; ``mark``: ours,
    ``now``: the filesystem's time). Those named as a live process's are kept unread; of the
    others, those unrenewed for a day (or dated a day ahead) are removed unread, and of the
    rest at most :data:`MAX_SWEPT` are read per listing, the oldest first, to remove this
    host's dead ones at once. A listing of :data:`MAX_ENTRIES` names that removed some is
    followed by another (at most :data:`MAX_PASSES`): removable junk listed before the live
    record is all gone, however many thousands, before ls looks."""
    from ..core.liveness import bears_mark
    from ..core.procrecords import boot_id
    boot = boot_id()
    marks: dict[int, str | None] = {}
    for _ in range(MAX_PASSES):
        full, gone, unread = _sweep_listing(folder, now, marks)
        # (unlinked once the listing is closed: entries removed under a listing may skip others)
        # (only what was removed counts: an unremovable name, counted, ran every pass)
        removed = sum(_unlink(folder, name) for name in gone)
        unread.sort()
        for _, name in unread[:MAX_SWEPT]:
            data = _read(folder, name)
            # ours to look up in /proc: removed once no live process bears it (one renamed
            # while its daemon lives is kept: its name is not its mark's)
            if data is not None and _this_hosts(data, mark, boot) \
                    and not bears_mark(data.get("pid"), data.get("proc")):
                removed += _unlink(folder, name)
        if not (full and removed):
            return


def stale_daemons(ws: Workspace) -> list[int]:
    """The pids of the live daemons of this host serving ``ws`` that started with another
    handoffd.toml than the file now there (oldest record first; empty when none, or when
    anything cannot be read). One folder read when no daemon ever served here, a stat more
    when one serves."""
    try:
        folder = _open(ws)
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
