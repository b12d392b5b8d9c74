"""The quarantine (``handoffs/.quarantine``): moving an entry that cannot be used out of the way,
with a ``.reason.json`` beside it that ``handoff ls --state quarantined`` reads, and the entries
planted at the names of handoffd's own lock files (a folder, a link, a FIFO), which failed every
open of the lock and so every update it guards, set aside the same way; and the folders of
``handoffs/`` swapped for a symlink or a file while a process runs (:class:`FolderGuard`).

One module below the store's writers (``writes``, ``records``, ``leases``, ``seen``, ``events``,
``contextfs``) that each of them uses: it imports only :mod:`.fsio`, :mod:`.logfiles`, :mod:`.seals` and the core."""
from __future__ import annotations

import errno
import os
import stat
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from ...core.documents import actor
from ...core.errors import ErrorCode
from ...core.logs import log
from ...core.ownfiles import START_UMASK, plain_folder
from ...core.timeutil import iso, utc_now
from ...core.workspace import Workspace, not_a_plain_folder
from . import fsio, logfiles
from .seals import KEY_NAME


def quarantine_folder(folder: Path) -> Path:
    """``handoffs/.quarantine``, made if missing; OSError (ENOTDIR) when it is no plain folder
    of the workspace: through a symlink planted there, what is set aside (and its reason) would
    be moved and written outside it. The file then stays where it is, looked at again later."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling symlink: refused just below
    if not plain_folder(folder):
        raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?); nothing is "
                      "set aside there", str(folder))
    return folder


def move_to_quarantine(folder: Path, path: Path, code: str, message: str,
                       publish: Callable[[Path, bytes], Any], *,
                       now: datetime | None = None, called: str | None = None) -> Path:
    """Move the entry ``path`` into the quarantine ``folder`` (a plain folder: see
    :func:`quarantine_folder`) under a dated, safe name, its ``.reason.json`` (what ``handoff
    ls --state quarantined`` reads) published beside it by ``publish`` first; the moved path.
    ``called``: the name the entry had where it was found, when it was renamed before
    (``path.name``).

    The reason comes first: an entry renamed in before it was listed meanwhile as "reason
    unreadable: no .reason.json beside it". A reason without its entry (a crash between the
    two, or the entry's rename failing, when the reason is removed again) is no entry to the
    listing. The name is taken by creating its reason exclusively, and only while no entry
    has it: two set-asides never share one, so no reason is paired with another's entry."""
    now = now or utc_now()
    quarantine_folder(folder)
    called = called or path.name
    name, reason_path = _reserve(folder, called, now)
    target = folder / name
    reason = {"file": _readable(called), "from": path.parent.name, "code": code,
              "message": _readable(message), "at": iso(now), "actor": actor()}
    try:
        publish(reason_path, fsio.dump_json(reason))
    except BaseException:  # the entry is moved all the same (as it always was), then it is raised
        _move_in(path, target, reason_path)
        raise
    _move_in(path, target, reason_path)
    return target


def _move_in(path: Path, target: Path, reason_path: Path) -> None:
    """Rename the entry ``path`` to ``target`` in the quarantine (a symlink or FIFO too: the
    entry moves, not what it points to). When that fails its reason, at ``reason_path``, is
    removed; when it is done, a reason left empty (its publish failed) is removed too."""
    try:
        os.rename(path, target)
    except BaseException:
        _discard(reason_path)
        raise
    _drop_if_empty(reason_path)


RESERVE_TRIES = 8  # names drawn before giving up (each is 32 random bits: one try, all but always)


def _reserve(folder: Path, called: str, now: datetime) -> tuple[str, Path]:
    """A fresh dated name for an entry called ``called`` in the quarantine ``folder``, and its
    reason's path, created there empty (exclusively, never through a link) to hold the name;
    OSError when none can be made. The empty reason is replaced by :func:`move_to_quarantine`'s
    publish, and is no entry to the listing until its entry is in."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in called)[:100] or "file"
    for _ in range(RESERVE_TRIES):
        name = f"{now.strftime('%Y%m%dT%H%M%S')}-{os.urandom(4).hex()}-{safe}"
        reason_path = folder / f"{name}.reason.json"
        try:
            os.close(os.open(reason_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, fsio.FILE_MODE))
        except FileExistsError:
            continue  # taken by another set-aside (or planted): another name
        if not os.path.lexists(folder / name):  # (an entry of a set-aside whose reason is gone)
            return name, reason_path
        _discard(reason_path)
    raise OSError(errno.EEXIST, f"no free name in the quarantine after {RESERVE_TRIES} tries",
                  str(folder))


def _discard(path: Path) -> None:
    """Remove ``path`` (a reason of ours) if it is there; a failure leaves it (an orphan reason,
    which the listing ignores)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _drop_if_empty(reason_path: Path) -> None:
    """Remove the reason at ``reason_path`` if it is still the empty file that held its name
    (its publish failed, and said so): the listing then says it is missing, not unreadable.
    Its entry is in by now and holds the name (see :func:`_reserve`)."""
    try:
        if os.lstat(reason_path).st_size == 0:
            os.unlink(reason_path)
    except OSError:
        pass


def _readable(text: str) -> str:
    """``text`` as UTF-8 can hold it: the bytes of a file name that is not UTF-8 (and any lone
    surrogate) written as ``\\x`` escapes, so that a reason naming it can be filed."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte stands for
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")


def publish_beside(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically. The temp file is created afresh without
    following a symlink: one planted under its name must not redirect the write. Its name is
    random, not the pid's: a folder planted under a name known ahead (nobody can unlink it)
    refused every update of the kind by that pid, and one per pid every update for good. A
    failed write removes its temp file; a process that dies in between leaves it (nothing
    sweeps ``.meta/``: one file, at most the kind's bound, per such crash)."""
    tmp = path.with_name(f".{path.stem}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with fsio.discarded_on_failure(tmp):
        try:
            os.fchmod(fd, fsio.FILE_MODE)  # the process's starting umask, not a handler's
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)


# how long set_aside_planted waits for another process's hold of the locks folder's own flock
FOLDER_LOCK_WAIT_SECONDS = 2.0


def clear_planted(path: Path, quarantine: Path | None = None) -> None:
    """:func:`set_aside_planted` when an entry that is no regular file is at ``path`` (one
    ``lstat`` otherwise): before a lock file of ours is opened (a folder or a link planted at
    its name failed every open, so every update the lock guards)."""
    if planted(path):
        set_aside_planted(path, quarantine)


def set_aside_planted(path: Path, quarantine: Path | None = None) -> None:
    """Move the entry at ``path`` (a lock file's name in ``handoffs/.locks`` or ``.meta``) to
    the workspace's quarantine (``quarantine``, default the ``.quarantine`` beside its folder:
    ``handoffs/.quarantine``, as the store sets files aside, which ``handoff ls`` lists) if it
    is no regular file, said in one warning line. Nothing is done to a regular file
    or to an entry gone meanwhile. OSError when it cannot be moved.

    Under the flock of the folder itself, the entry looked at again: two processes finding
    the plant at once must not both move "it", the second taking away the live lock file the
    first made in its place meanwhile (two holders). Nothing else renames an entry there."""
    folder = path.parent
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not logfiles.flock_within(fd, FOLDER_LOCK_WAIT_SECONDS):  # a stopped or hostile
            raise OSError(errno.EWOULDBLOCK, f"{_shown(folder)}/ has been locked by "  # holder
                          f"another process for over {FOLDER_LOCK_WAIT_SECONDS:g} s; "
                          f"{path.name}, no regular file, is left there", str(path))
        if not planted(path):
            return  # moved by another process (a lock file may be there now), or gone
        what = "is not a regular file"
        target = move_to_quarantine(quarantine or folder.parent / ".quarantine", path,
                                    str(ErrorCode.NOT_A_REGULAR_FILE),
                                    f"{path.name} {what} (a lock file's name in {folder.name})",
                                    publish_reason)
    finally:
        os.close(fd)  # closing drops the lock
    log.warning("%s/%s %s: moved to %s/%s so that its lock can be taken [%s]", _shown(folder),
                path.name, what, _shown(target.parent), target.name,
                ErrorCode.NOT_A_REGULAR_FILE)


def publish_reason(dst: Path, data: bytes) -> None:
    """Write a quarantined entry's reason (a temp file of a random name beside it, never
    through a link, renamed into place); a failure is one warning: the entry moved already."""
    try:
        publish_beside(dst, data)
    except OSError as exc:
        log.warning("%s/%s: cannot record why it was moved (%s)", _shown(dst.parent), dst.name,
                    exc.strerror or exc)


def planted(path: Path) -> bool:
    """True when an entry that is no regular file (a folder, symlink, FIFO...) is at ``path``."""
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:  # absent, or its folder unusable: nothing to move
        return False


def _shown(folder: Path) -> str:
    """A folder of the workspace's ``handoffs/`` as a log line names it (``handoffs/.locks``)."""
    return f"{folder.parent.name}/{folder.name}"


# ------------------------------------------------------------------ folders swapped while running
# The code recorded for a folder of handoffs/ found swapped for a symlink or a file: an entry
# of a kind handoffd does not use there, set aside as every such entry is
SWAPPED_CODE = ErrorCode.NOT_A_REGULAR_FILE
# A change to handoffs/ newer than this keeps the guard looking at every folder at each check:
# the kernel stamps a folder's mtime from a clock that ticks every few milliseconds, so a swap
# within the tick of the change last seen could leave the stamp as it was
SETTLED_NS = 1_000_000_000
FOLDER_MODE = 0o777 & ~START_UMASK  # what Workspace.ensure's mkdir gives, whatever the umask now
SWAP_ROUNDS = 3  # looks at every folder in one check; a folder set aside changes handoffs/


def _mark(info: os.stat_result) -> tuple[int, int, int, int]:
    """What changes in ``handoffs/``'s stat when an entry in it is renamed, made or removed."""
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns


class FolderGuard:
    """Keeps the folders of ``handoffs/`` (:attr:`Workspace.own_folders`: the bookkeeping and
    state folders) plain folders of the workspace while a process runs. Every command and the
    daemon refuse a workspace where one is not (:meth:`Workspace.check_state_folders`); one
    swapped for a symlink or a file after that took every claim, filing, record and removal
    through it, outside the workspace, until the next start.

    :meth:`check` comes before each claim, lease renewal, filing, move, set-aside and removal
    of the store and costs one ``stat`` of ``handoffs/``: a swap renames or makes an entry
    there, which changes its mtime, so while the stamp is the one last seen with every folder
    in order (and older than :data:`SETTLED_NS`), nothing was swapped. Otherwise every folder
    is looked at (one ``lstat`` each): one that is a symlink or a file is set aside into
    ``handoffs/.quarantine`` and a plain folder made in its place (:meth:`_put_right`).
    Nothing is ever read, written or removed through the link, and what it points to is left
    as it is. :meth:`check_all` looks whatever the stamp; the sweep's also makes a missing
    folder again (every filing into a removed ``completed/`` failed, and its handoff ran again
    at each sweep). Between sweeps a missing folder is left as it is (an operator's ``mv`` then
    ``ln -s`` must find the name free, for the link to be set aside), and no stamp is trusted
    while one is."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        self._handoffs = str(ws.handoffs)
        self._trusted: tuple[int, int, int, int] | None = None
        # folder name -> the times this process made it again: a running claim whose copy went
        # with a swapped (or removed) in-progress/ is written again into the new one (Store.owns)
        self.remade: dict[str, int] = {}
        self.seal_key: bytes | None = None  # the store's: written again into a new .meta
        self._said: str | None = None  # the refusal said last (said once, not at each check)

    def check(self) -> None:
        """Put right a folder of ``handoffs/`` swapped since the last look (see the class);
        one ``stat`` when nothing changed there. OSError (ENOTDIR) when one that is no plain
        folder cannot be set aside: what the caller was to do there is not done."""
        try:
            info = os.stat(self._handoffs)
        except OSError:  # handoffs/ gone or unreadable: what uses it says so
            return
        if _mark(info) != self._trusted:
            # this stat, taken before the look, is the look's own: while the stamp is unsettled
            # (the first second after a change) every check looks, and a second stat of
            # handoffs/ for it was one more call per claim and filing
            self._look(info, make_missing=False)

    def check_all(self, *, make_missing: bool = False) -> None:
        """Look at every folder of ``handoffs/`` now and put right what is no plain folder
        (OSError as :meth:`check`); ``make_missing``: a missing one is made again too."""
        try:
            info = os.stat(self._handoffs)
        except OSError:
            return
        self._look(info, make_missing=make_missing)

    def _look(self, info: os.stat_result, *, make_missing: bool) -> None:
        """:meth:`check_all` from ``info``, the ``stat`` of ``handoffs/`` taken just before:
        the stamp trusted afterwards is one taken before the look, so that a swap during it
        changes the stamp and the next check looks again."""
        for round_ in range(SWAP_ROUNDS):
            if round_:  # a folder was put right (handoffs/ changed): a fresh stamp
                try:
                    info = os.stat(self._handoffs)
                except OSError:
                    return
            # the clock is read before the look too: a swap during the look is stamped at
            # least this late, so the stamp is settled only if it was a second old before it
            before = time.time_ns()
            in_order = self._put_right(make_missing)
            if in_order is not None:
                break
        else:  # swapped again and again meanwhile: no stamp is trusted, the next check looks
            return
        self._said = None
        if in_order and before - max(info.st_mtime_ns, info.st_ctime_ns) > SETTLED_NS:
            self._trusted = _mark(info)  # (stat taken before the look: a later swap changes it)

    def _put_right(self, make_missing: bool) -> bool | None:
        """One look at every folder (one ``lstat`` each): None when one was put right (look
        again), else whether every folder is there."""
        present = True
        for path in self.ws.own_folders:
            try:
                why = not_a_plain_folder(os.lstat(path))
            except FileNotFoundError:
                if make_missing and self._set_aside(path, make_missing=True):
                    return None
                present = False
                continue
            except OSError:  # (EACCES...): what uses it says so
                present = False
                continue
            if why is not None:
                self._set_aside(path)
                return None
        return present

    def _set_aside(self, path: Path, *, make_missing: bool = False) -> bool:
        """Under the flock of ``handoffs/`` itself (two processes noticing at once must not
        both move "it": the second would take away the folder the first made), looked at
        again: the entry at ``path`` renamed aside within ``handoffs/``, a plain folder made in
        its place, then the entry moved into the quarantine; ``make_missing``: a folder made
        where there is none. One line says so. True when something was done."""
        fd = os.open(self._handoffs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not logfiles.flock_within(fd, FOLDER_LOCK_WAIT_SECONDS):
                self._refuse(path, f"handoffs/ has been locked by another process for over "
                             f"{FOLDER_LOCK_WAIT_SECONDS:g} s")
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                if not make_missing or not self._make(path):
                    return False  # (set aside by another process meanwhile, which made it)
                self.remade[path.name] = self.remade.get(path.name, 0) + 1
                log.warning("handoffs/%s was missing: made again (empty)", path.name)
                return True
            if not_a_plain_folder(info) is None:
                return False  # put right by another process meanwhile
            was = _what_it_was(path, info)
            aside = path.with_name(f".swapped-{os.urandom(4).hex()}-{path.name}")
            try:
                os.rename(path, aside)  # the entry itself, never what a link points to
            except OSError as exc:
                self._refuse(path, f"it is {was}, and it cannot be set aside "
                             f"({exc.strerror or exc})")
            self._make(path)
        finally:
            os.close(fd)  # closing drops the lock
        self._said = None
        self.remade[path.name] = self.remade.get(path.name, 0) + 1
        log.error("handoffs/%s was replaced by %s while handoffd ran: nothing is read or "
                  "written through it; %s, and handoffs/%s is a plain folder again (what it "
                  "held or pointed to is left where it is) [%s]", path.name, was,
                  self._quarantined(aside, path, was), path.name, SWAPPED_CODE)
        return True

    def _make(self, path: Path) -> bool:
        """A plain folder at ``path`` (with the mode :meth:`Workspace.ensure` gives); the seal
        key written again into a new ``.meta``. False when something was put there meanwhile
        (looked at at the next round)."""
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return False
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(folder, FOLDER_MODE)
        finally:
            os.close(folder)
        if path == self.ws.meta:
            try:
                self._restore_key()
            except OSError as exc:  # (a full disk): the folder is made all the same
                log.warning("cannot write the seal key again into the new handoffs/.meta "
                            "(%s): the next writer makes a new one, and documents sealed "
                            "before read as foreign", exc.strerror or exc)
        return True

    def _restore_key(self) -> None:
        """The seal key this process uses, written into a new ``.meta`` (mode 0600): without
        it the next command made a key of its own, and each then took the other's documents
        for foreign ones. Staged in the folder itself, linked into place (never replaced)."""
        if self.seal_key is None:
            return
        staged = self.ws.meta / f".seal-{os.urandom(8).hex()}.tmp"
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            try:
                os.write(fd, self.seal_key + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(staged, self.ws.meta / KEY_NAME)
        except FileExistsError:
            pass  # made meanwhile by another process (which read or made the same key)
        finally:
            os.unlink(staged)

    def _quarantined(self, aside: Path, path: Path, was: str) -> str:
        """Move the entry set ``aside`` into the quarantine; where it went, said for the log."""
        try:
            target = move_to_quarantine(
                quarantine_folder(self.ws.quarantine), aside, str(SWAPPED_CODE),
                f"handoffs/{path.name} was replaced by {was} while handoffd ran; a plain "
                f"folder was made in its place", publish_reason, called=path.name)
        except OSError as exc:  # (the quarantine unusable: it is put right first, so rarely)
            return (f"it is left at handoffs/{aside.name} (it cannot be moved to "
                    f"handoffs/.quarantine: {exc.strerror or exc})")
        return f"it is moved to handoffs/.quarantine/{target.name}"

    def _refuse(self, path: Path, why: str) -> None:
        """Raise the OSError (ENOTDIR) that refuses to use ``path``, said in one line once."""
        message = (f"handoffs/{path.name} is no plain folder of the workspace ({why}); nothing "
                   "is written there until it is one")
        if message != self._said:
            self._said = message
            log.error("%s [%s]", message, SWAPPED_CODE)
        raise OSError(errno.ENOTDIR, message, str(path))


def _what_it_was(path: Path, info: os.stat_result) -> str:
    """``a symlink to /x``, ``a file``...: what was found at ``path``."""
    if stat.S_ISLNK(info.st_mode):
        try:
            return f"a symlink to {_readable(os.readlink(path))}"
        except OSError:
            return "a symlink"
    return "a file" if stat.S_ISREG(info.st_mode) else "an entry that is no folder"
