"""The sweep's recurring problems: one line per distinct problem, not one per claim per sweep.

A persistent fault (inode exhaustion as the sweep takes its per-claim recovery locks, a seen-ids
lock file another user owns) failed the same way for every in-progress claim, at every sweep:
hundreds of identical ERROR lines a minute, burying whatever else was said. While a sweep runs
(:func:`sweeping`), :func:`error` says a problem, identified by what failed (its ``kind``, the
same for every claim) and how (the errno, else the exception's type), once; the same problem
again is held back and counted, and said at most every :data:`REPEAT_SECONDS` (by the engine's
clock) with the count of what was held back. When that kind of step succeeds again in a sweep
that no longer meets the problem (:func:`ok`), one WARNING line says it cleared.

The lease keeper's rounds (renewals, owner-lock checks) keep books of their own the same way,
and so does the cancel requests' poll (:mod:`handoffd.features.cancellation`). A book whose
"sweep" is a single operation (the pending/ listing, an open of the process records' or the
cancel requests' folder) clears a problem only once it has stayed away
:data:`QUIET_SECONDS`: at a descriptor limit every other open fails, and each success said
"works again" once more.
Outside a sweep or round every problem is said as it comes, as before.

A ``handoffd run`` batch that ended while a book still held a problem back said nothing more
of it: the operator's last word was its first WARNING. Every book is known here (weakly), and
each problem met carries a number from one count of the process: at its end a batch asks
(:func:`batch_end`, with the :func:`mark` it took as it began) every book for the problems it
met since, and each book that still holds one says so in one line (``still short at the end of
the batch: ...``); one that a sweep found working since it was last met (its kind worked and
it was not met, for any claim: the sweep's own rule, in a book waiting out its
:attr:`~Recurring.quiet` period) says "works again" then. Each batch takes its mark as it
begins (a second batch of one daemon said the first one's problems again). A ``serve`` that
stops says the same of its whole life (``still short at the daemon's stop: ...``): its
operator's last lines before a restart said nothing of a shortage it still held back.

A passing shortage of descriptors or memory (:func:`~.errors.is_shortage`: EMFILE, ENFILE,
ENOMEM, a MemoryError) is no fault of the store: its line is a WARNING, and the exception is said
in :func:`~.errors.shortage_words` (naming the limit), as every shortage line is; it was an
ERROR with the bare ``[Errno 24] Too many open files``.
"""
from __future__ import annotations

import errno
import itertools
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import is_shortage, shortage_words
from .logs import log

REPEAT_SECONDS = 60.0  # a problem that persists is said again at most this often
# a book whose "sweep" is one operation (one open of a folder, one listing) rather than a
# round of many: a problem clears only after this long without it, as a passing shortage
# comes and goes from one open to the next (at the limit, every other open fails) and was
# said twice per occurrence ("cannot open", then "works again")
QUIET_SECONDS = 10.0
# logging's own level values: core.logs imports logging only when a first line is written,
# which keeps a command's start light
ERROR, WARNING = 40, 30
# the kind of every per-claim recovery step (the repairs' and the take-overs'): one problem
# however many claims meet it
RECOVERY = "recovering a claim"
# what the line of a problem still held names as the moment it is said (batch_end)
BATCH_END = "the end of the batch"
SERVE_END = "the daemon's stop"

Key = tuple[str, str]
# every problem met is numbered from here (in this process): what a batch met since its start
_MET = itertools.count(1)
_BOOKS: weakref.WeakSet[Recurring] = weakref.WeakSet()  # every book of this process
_BOOKS_MUTEX = threading.Lock()


@dataclass
class _Problem:
    said_at: float  # when it was last said (the clock's seconds)
    last_at: float  # when it was last met
    held: int = 0  # occurrences held back since
    total: int = 1  # occurrences since it began
    met: int = 0  # its number when last met (_MET): whether a batch met it
    level: int = ERROR
    words: str = ""  # what failed, how: said by a batch's end (batch_end)
    # a sweep since it was last met had its kind work and did not meet it (the sweep's rule,
    # :meth:`Recurring.end`), though not yet quiet long enough to clear: what a batch's end
    # says "works again" (set as a step of its kind worked, a key still failing for another
    # claim in the same sweep was said cleared)
    worked: bool = False


class Recurring:
    """The problems of one daemon's sweeps (kept across them); thread-safe."""

    def __init__(self, every: float = REPEAT_SECONDS, quiet: float = 0.0) -> None:
        self.every = every
        self.quiet = quiet  # a problem clears only after this long without it (QUIET_SECONDS)
        self.active: dict[Key, _Problem] = {}
        self._failed: set[Key] = set()  # met since the last sweep ended
        self._succeeded: set[str] = set()  # kinds that worked at least once since
        self._mutex = threading.Lock()
        with _BOOKS_MUTEX:
            _BOOKS.add(self)

    def begin(self) -> None:
        """A sweep starts. What was met since the last one ended still counts in it: a step
        that outlasted its round (a lease renewal the round stopped waiting for) fails or
        works between rounds, and its failure must not read as a problem gone."""

    def error(self, key: Key, now: float, msg: str, args: tuple[Any, ...],
              level: int = ERROR, words: str = "") -> None:
        """Say ``msg % args`` (at ``level``) unless ``key`` was said less than :attr:`every`
        ago; ``words``: what failed and how, as a batch's end says it (:func:`batch_end`;
        the kind and how it failed when not given)."""
        with self._mutex:
            self._failed.add(key)
            problem = self.active.get(key)
            if problem is None:
                problem = self.active[key] = _Problem(said_at=now, last_at=now)
                held = None
            elif now - problem.said_at < self.every:
                held = -1  # (held back)
                problem.held += 1
                problem.total += 1
            else:
                held, problem.held, problem.said_at = problem.held, 0, now
                problem.total += 1
            problem.last_at, problem.met, problem.worked = now, next(_MET), False
            problem.level, problem.words = level, words or f"{key[0]}: {key[1]}"
        if held == -1:
            return
        if held is None:
            log.log(level, msg + " (if it recurs, said again at most once a minute)", *args)
        else:
            log.log(level, msg + " (still; %d more like it held back)", *args, held)

    def ok(self, kind: str) -> None:
        """A step of ``kind`` worked in this sweep."""
        with self._mutex:
            self._succeeded.add(kind)

    def end(self, now: float | None = None) -> None:
        """A sweep ended (at ``now``): a problem whose kind worked in it and that it did not
        meet cleared, if :attr:`quiet` seconds have passed since it was last met (else it
        is marked as having worked: a batch that ends before then says it cleared)."""
        with self._mutex:
            cleared = []
            for key in list(self.active):
                if key[0] not in self._succeeded or key in self._failed:
                    continue  # (met again in this sweep, for one claim of many: still held)
                if now is None or now - self.active[key].last_at >= self.quiet:
                    cleared.append((key, self.active.pop(key)))
                else:
                    self.active[key].worked = True
            self._failed.clear()
            self._succeeded.clear()
        _say_cleared(cleared)

    def at_batch_end(self, since: int, end: str = BATCH_END) -> None:
        """A batch that began at :func:`mark` ``since`` ends: of the problems it met, those
        that a sweep since they were last met found working (its kind worked, and it was not
        met: :meth:`end`'s rule, the quiet period aside) are said cleared ("works again"), and
        those it still holds are said in one line (the line's level the highest of theirs),
        ``still short at <end>: ...``."""
        with self._mutex:
            met = [(key, problem) for key, problem in self.active.items() if problem.met > since]
            cleared = [(key, self.active.pop(key)) for key, problem in met if problem.worked]
            held = [problem for _, problem in met if not problem.worked]
        _say_cleared(cleared)
        if not held:
            return
        short = all(problem.level < ERROR for problem in held)  # (a shortage is a WARNING)
        log.log(max(problem.level for problem in held),
                "still %s at %s: %s", "short" if short else "failing", end,
                "; ".join(f"{problem.words} ({problem.total} time(s) since it began)"
                          for problem in held))


def _say_cleared(cleared: list[tuple[Key, _Problem]]) -> None:
    for (kind, why), problem in cleared:
        log.warning("%s works again (%s cleared after %d failure(s))", kind, why,
                    problem.total)


def mark() -> int:
    """Where a batch begins in the count of problems met (what :func:`batch_end` takes)."""
    return next(_MET)


def batch_end(since: int, end: str = BATCH_END) -> None:
    """A batch that began at :func:`mark` ``since`` ends: every book says what it met since
    and still holds (one line a book), or that it works again (:meth:`Recurring.at_batch_end`).
    ``end`` names the moment in that line: :data:`BATCH_END`, or :data:`SERVE_END` for a
    ``serve`` that stops (its whole life one batch)."""
    with _BOOKS_MUTEX:
        books = list(_BOOKS)
    for book in books:
        book.at_batch_end(since, end)


_CURRENT: ContextVar[tuple[Recurring, Callable[[], float]] | None] = ContextVar(
    "handoffd_sweep_problems", default=None)


@contextmanager
def sweeping(book: Recurring, clock: Callable[[], float]) -> Iterator[None]:
    """Within: :func:`error` and :func:`ok` count in ``book``, timed by ``clock`` (seconds)."""
    book.begin()
    token = _CURRENT.set((book, clock))
    try:
        yield
    finally:
        _CURRENT.reset(token)
        book.end(clock() if book.quiet else None)


def how(exc: BaseException) -> str:
    """What identifies a failure across claims: its errno's name, else its type's name."""
    number = getattr(exc, "errno", None)
    if isinstance(number, int):
        return errno.errorcode.get(number, f"errno {number}")
    return type(exc).__name__


def error(kind: str, exc: BaseException, msg: str, *args: Any) -> None:
    """Log ``msg % args`` as an ERROR: within :func:`sweeping`, once per (``kind``, how
    ``exc`` failed) and at most every :data:`REPEAT_SECONDS`. A passing shortage is a WARNING,
    ``exc`` among ``args`` said in :func:`~.errors.shortage_words` (module doc)."""
    level = ERROR
    words = f"{type(exc).__name__}: {str(exc)[:200]}"
    if is_shortage(exc):
        level = WARNING
        words = shortage_words(exc)
        args = tuple(words if arg is exc else arg for arg in args)
    current = _CURRENT.get()
    if current is None:
        log.log(level, msg, *args)
        return
    book, clock = current
    book.error((kind, how(exc)), clock(), msg, args, level, f"{kind}: {words}")


def ok(kind: str) -> None:
    """Within :func:`sweeping`: a step of ``kind`` worked (what clears its problems)."""
    current = _CURRENT.get()
    if current is not None:
        current[0].ok(kind)
