"""What a snapshot watches in ``git`` mode: git's listing, asked safely, and git's own files.

In ``git`` mode (the directory is in a git work tree) a snapshot watches the files
``git ls-files --cached --others --exclude-standard`` lists (so git-ignored files are not
watched) (:func:`git_files`). git lists an untracked nested repository as its folder alone
(``hidden/``), and a submodule as one entry (its commit): such a folder is walked as in ``hash``
mode (every file of the submodule's working tree, whatever its own ignore rules say), so a file
created or changed inside it is seen. The listing and those walks share one tally, so the
snapshot's bounds hold for them together (see walk.py).

git mode trusts git's ignore rules, and a handler could change them to hide its files. So it also
watches, always, the files those rules come from (:func:`git_guarded`): the repository's
``info/exclude`` and ``config`` (``config.worktree``, ``commondir``), the ``.git`` entry, every
``.gitignore`` from the work tree's top down to the directory, and every ``.gitignore`` git
ignores (one can ignore itself). Their paths are fixed before the handler and looked at again
after, so a change to any of them is a change like any other; one above the directory is keyed
``../...``. git itself runs with only the repository's own config, and with every setting that
could make it start a program, or read ignore rules from outside the repository, overridden on its
command line (:data:`GIT_SAFE_CONFIG`), bounded by :data:`GIT_TIMEOUT_SECONDS`. What git writes
is read as it comes and bounded too: a listing is parsed record by record as it arrives, and only
the paths the snapshot keeps (not skipped by ``scope_ignore``) are held and counted in the tally
(past MAX_ENTRIES, or past :data:`MAX_LISTING_BYTES` read in all, the tree is too big to see:
:class:`~.walk.Incomplete`); git's messages are held up to :data:`MAX_ANSWER_BYTES` (past it
git is not answering: GitError). git is killed and reaped right there, so no repository (a huge
or forged index) makes the daemon hold git's whole output, nor a list of every path in it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...core.errors import is_shortage
from .walk import LIMIT_HINT, Incomplete, Walker

if TYPE_CHECKING:
    import subprocess  # (run only in git mode: imported where git is started)

GIT_TIMEOUT_SECONDS = 120.0
# What one snapshot's listings may stream through in all, skipped paths included (a monorepo
# whose vendored folder is in scope_ignore lists it all the same; entries average about 100
# bytes, so this is ten million or so): the kept ones are bounded by MAX_ENTRIES, this bounds the
# parsing, as git's timeout does.
MAX_LISTING_BYTES = 1 << 30
MAX_RECORD_BYTES = 64 << 10  # one path of a listing (the kernel's own limit is 4 KiB)
MAX_ANSWER_BYTES = 1 << 20  # rev-parse's answer (a few paths) and git's messages (a line or two)
READ_CHUNK = 1 << 16
# Command-line settings outrank every config file, so nothing written into the repository's
# config can make handoffd's git start a program or read ignore rules from outside the repository.
# ls-files and rev-parse run no filter, diff driver, hook or credential helper; these are the ways
# left (and the index extension a handler could forge to hide files).
GIT_SAFE_CONFIG = (
    "core.fsmonitor=",  # empty: "false" for git >= 2.36, "no hook" before; else a command it runs
    "core.hooksPath=/dev/null",
    "core.pager=cat",  # never started anyway: our stdout is a pipe, and --no-pager
    "core.untrackedCache=false",
    "core.excludesFile=/dev/null",  # ignore rules only from .gitignore files and info/exclude
)


class GitError(Exception):
    """git did not answer: not installed, not a work tree, failed or too slow (one line)."""


def git_files(walker: Walker) -> set[str]:
    """What git mode watches under ``walker.root``: the files git lists, the .gitignore files git
    ignores, and the files of the folders git lists as one entry (nested repositories,
    submodules), the walker's skips applied, all counted in its tally. Raises GitError, or
    Incomplete past the bounds."""
    root = walker.root
    # the three listings share one budget of bytes (MAX_LISTING_BYTES), as they share the tally
    kept = Kept(walker)
    _git(root, "ls-files", "-z", "--stage",  # with modes: 160000 = a submodule
         limit=MAX_LISTING_BYTES, too_much=_too_big(), sink=kept.staged)
    kept.end()
    _git(root, "ls-files", "-z", "--others", "--exclude-standard",
         limit=MAX_LISTING_BYTES - kept.read, too_much=_too_big(), sink=kept.names)
    kept.end()
    # a new .gitignore that ignores itself (and what it hides) is invisible to the listing
    # above: list the ignored ones too (--directory: an ignored folder is not descended)
    rules = Kept(walker, only=".gitignore")
    _git(root, "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
         "--directory", "--", ":(glob)**/.gitignore",
         limit=MAX_LISTING_BYTES - kept.read, too_much=_too_big(), sink=rules.names)
    rules.end()
    found: set[str] = set()
    for name, submodule in kept.paths:
        if name.endswith("/"):  # an untracked nested repository: git names only its folder,
            found |= walker.walk(name.rstrip("/"))  # so its files are walked (hash mode's way)
            continue
        found.add(name)  # (a submodule's folder is no file: Snapshotter._stat_all leaves it out)
        if submodule:  # git lists a submodule as its commit: its files are walked
            found |= walker.walk(name)
    return found | {name for name, _ in rules.paths}


class Kept:
    """The paths of ``-z`` listings that a snapshot keeps, taken as git writes them: each
    record parsed as it completes, a path the walker skips dropped at once, a kept one counted
    in the walker's tally (Incomplete past MAX_ENTRIES: the tree is too big to see, however many
    skipped paths came with it). ``only``: keep just the paths with this last part."""

    def __init__(self, walker: Walker, *, only: str | None = None) -> None:
        self.walker = walker
        self.only = only
        self.paths: list[tuple[str, bool]] = []  # (path, a submodule)
        self.read = 0  # bytes of listings taken
        self._tail = b""

    def staged(self, chunk: bytes) -> None:
        """Take a chunk of ``ls-files -z --stage`` (``MODE OBJECT STAGE\tPATH`` records)."""
        for raw in self._records(chunk):
            meta, tab, path = raw.partition(b"\t")
            if tab and path:
                self._keep(os.fsdecode(path), meta.split(b" ", 1)[0] == b"160000")

    def names(self, chunk: bytes) -> None:
        """Take a chunk of a plain ``-z`` listing (paths)."""
        for raw in self._records(chunk):
            if raw:
                self._keep(os.fsdecode(raw), False)

    def end(self) -> None:
        """The listing ended: what is left is no whole record (a cut listing: ignored)."""
        self._tail = b""

    def _records(self, chunk: bytes) -> list[bytes]:
        self.read += len(chunk)
        *records, self._tail = (self._tail + chunk).split(b"\0")
        if len(self._tail) > MAX_RECORD_BYTES:
            raise Incomplete(f"git's listing of the contract directory has a path over "
                             f"{MAX_RECORD_BYTES} bytes (a forged index?){LIMIT_HINT}")
        return records

    def _keep(self, name: str, submodule: bool) -> None:
        if self.walker.skipped(name):
            return
        if self.only is not None and name.rsplit("/", 1)[-1] != self.only:
            return
        if not name.endswith("/"):  # (a folder's files are counted as it is walked)
            self.walker.tally.count()
        self.paths.append((name, submodule))


def git_guarded(root: Path) -> tuple[str, ...]:
    """git's own files that decide what git mode sees, relative to ``root`` (see the module
    docstring); they need not exist. Raises GitError outside a work tree."""
    answer = os.fsdecode(_git(root, "rev-parse", "--is-inside-work-tree", "--show-toplevel",
                              "--git-path", "info/exclude", "--git-path", "config",
                              "--git-path", "config.worktree", "--git-path", "commondir"))
    lines = answer.split("\n")
    if len(lines) != 7 or lines[0] != "true" or lines[-1]:
        raise GitError("not a git work tree")
    top = Path(lines[1])
    files = [top / ".git", *(root / line for line in lines[2:6])]
    here = root.resolve()
    if here == top or top in here.parents:  # the .gitignore files above the directory
        files += [top / part / ".gitignore" for part in _ancestors(here.relative_to(top))]
    keys = {os.path.relpath(path, root).replace(os.sep, "/") for path in files}
    return tuple(sorted(keys))


def _too_big() -> Incomplete:
    """What a listing past MAX_LISTING_BYTES says. Incomplete, not GitError: the listing's size
    is the tree's size, and a tree too big to see is what Incomplete says (the snapshot fails
    closed; before the handler, the handoff is not run), where a GitError before the handler
    would make ``auto`` fall back to a walk that watches other files (git-ignored ones too)."""
    return Incomplete(f"git's listing of the contract directory holds more than "
                      f"{MAX_LISTING_BYTES} bytes{LIMIT_HINT}")


def _git(root: Path, *args: str, limit: int = MAX_ANSWER_BYTES,
         too_much: Exception | None = None,
         sink: Callable[[bytes], None] | None = None) -> bytes:
    """Run ``git -C root ARGS`` safely (see GIT_SAFE_CONFIG), bounded by GIT_TIMEOUT_SECONDS;
    its output, or GitError with one line saying why not. Output past ``limit`` bytes raises
    ``too_much`` (default: a GitError), git killed there (see :func:`_read_capped`). ``sink``:
    give it the output as it comes instead (then b"" is returned); what it raises kills git."""
    import subprocess  # only in git mode
    argv = ["git", "--no-pager", "-C", str(root)]
    for setting in GIT_SAFE_CONFIG:
        argv += ["-c", setting]
    # the daemon's own GIT_* variables (GIT_DIR, GIT_CONFIG_PARAMETERS...) must not steer it;
    # no system or user config: settings come from the repository and GIT_SAFE_CONFIG only
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_TERMINAL_PROMPT="0",
               GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    try:
        proc = subprocess.Popen([*argv, *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise GitError("git is not installed") from None
    except OSError as exc:
        if is_shortage(exc):  # the daemon's descriptors, not git's answer: the caller waits
            raise
        raise GitError(f"git {args[0]} could not start: {exc.strerror or exc}") from None
    try:
        stdout, stderr = _read_capped(proc, args[0], limit, too_much or GitError(
            f"git {args[0]} answered more than {limit} bytes"), sink)
    finally:  # done, failed or past a bound: never leave git running, nor a zombie
        if proc.poll() is None:
            proc.kill()  # (Popen.kill: SIGKILL to git's own pid)
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if proc.returncode != 0:
        lines = stderr.decode("utf-8", "replace").strip().splitlines() or ["(no message)"]
        raise GitError(f"git {args[0]} failed: {lines[-1][:200]}")
    return stdout


def _read_capped(proc: "subprocess.Popen[bytes]", what: str, limit: int,
                 too_much: Exception,
                 sink: Callable[[bytes], None] | None = None) -> tuple[bytes, bytes]:
    """git's stdout and stderr, read as they come until both end and git exits, within
    GIT_TIMEOUT_SECONDS (else GitError). Past ``limit`` bytes of stdout it raises ``too_much``;
    past MAX_ANSWER_BYTES of messages git is not answering: GitError. Nothing more is read
    then, and the caller kills git: no repository makes the daemon hold git's whole output."""
    import selectors
    import subprocess
    import time
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    taken = 0  # stdout's bytes (given to ``sink`` when there is one, else kept in ``out``)
    deadline = time.monotonic() + GIT_TIMEOUT_SECONDS
    timed_out = GitError(f"git {what} did not finish within {GIT_TIMEOUT_SECONDS:g} s")
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise timed_out
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                if key.data is out:
                    taken += len(chunk)
                    if taken > limit:
                        raise too_much
                    if sink is not None:
                        sink(chunk)
                        continue
                key.data.extend(chunk)
                if len(err) > MAX_ANSWER_BYTES:
                    raise GitError(f"git {what} wrote more than {MAX_ANSWER_BYTES} bytes of "
                                   "messages")
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        raise timed_out from None
    return bytes(out), bytes(err)


def _ancestors(relative: Path) -> list[str]:
    """``a/b/c`` → ``["", "a", "a/b"]``: the directories from the top down to its parent."""
    parts = relative.parts
    return ["/".join(parts[:i]) for i in range(len(parts))]
