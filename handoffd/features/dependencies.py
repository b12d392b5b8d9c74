"""Gates: conditions checked before a pending handoff may be claimed.

A gate looks at a pending document and answers go (None), wait (with a reason shown by
``handoff ls``), or fail (with an error code). The daemon re-checks a waiting handoff when a
handoff its wait names is filed, at a rescan when the stored copies of one of those (or its own
document) changed, and every five minutes whatever they say (``service.quiet``). Dependencies
(``--depends-on``, seed 004's ``dependencies_completed``) are this module's gate
(:func:`install`, one of the features :func:`handoffd.features.build.build_engine` installs);
orchestration and contracts add their own.

Long chains and dense graphs stay linear in their edges. A waiter's dependencies are taken in
their order: a check goes on from the first one not yet seen completed (:class:`Progress`) to the
first unfinished one, and waits for its filing only (``Verdict.wait(on=[it])``), so a filing
re-checks only the handoffs waiting for that one, and each check reads about one document (300
handoffs each depending on all earlier ones took 6 minutes when every check read, and waited
for, every unfinished dependency). :class:`Graph` remembers which handoffs completed, believed
for a waiter only when seen after that waiter first came (see :class:`Graph`: an id comes back
once purged), and which handoffs are known to lead to no cycle, so a walk stops where an
earlier one ended. A completed dependency that retention archived is completed too
(:class:`~.archived_ids.ArchiveIndex`); one that was purged is missing. A dependency that
this daemon files into failed/ fails its waiters at once, wherever it is in their lists (within
:data:`WATCHED_FAILURES` of the first unfinished one): its filing wakes them too
(``Verdict.wait(fails_on=...)``), and the gate reads it again before it believes it.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any, Protocol

from .. import dialects
from ..core.documents import BOOK, Envelope
from ..core.engine import (  # Gate and Verdict are the core's; re-exported
    Engine,
    Gate,
    Verdict,
)
from ..core.errors import ErrorCode, HandoffdError, InvalidDocument, NotFound
from ..core.filing import held_answer
from ..core.native_format import stub_code
from ..core.jobs import Job
from ..core.states import State
from ..core.timeutil import parse_iso
from .archived_ids import ArchiveIndex
from .removal import dependents_guard

# documents one cycle check reads at most. A walk cut short by it marks nothing cycle-free, so
# every later check of a longer chain would read as much again (`handoff ls` of a 1,100-long
# chain read 1,000 documents a row, 8 s); one that ends marks the whole chain at once
MAX_DEPENDENCY_WALK = 20_000
MAX_REMEMBERED = 100_000  # completed / cycle-free ids (and waiters) kept before starting over
ACYCLIC_SECONDS = 300.0  # how long "leads to no cycle" is trusted (ids can be purged and reused)
# how long a waiter's progress is trusted at most (also at most the dedup window: an id comes
# back no sooner, once purged); then its dependencies are read again, once. A serving daemon's
# rescans look at a waiter only when what it waits for changed, and drop its progress at its
# full re-check (as often: service.quiet.FULL_RECHECK_SECONDS), so that check reads them all
PROGRESS_SECONDS = 300.0
UNFINISHED_SECONDS = 5.0  # a dependency read unfinished is not read again this soon by a first look
# how long a waiter the gate let go keeps when it became runnable (Graph.runnable) without
# running here: another process claimed it. One let go here is dispatched at once, or gated
# again when it is (parked behind a busy specialist, rate-limited)
RUNNABLE_SECONDS = 300.0
# a waiter is re-checked when any of this many dependencies after its first unfinished one is
# filed into failed/ by this daemon (beyond them, and for another process's filings, a failure is
# found when the check reaches it, or at the first look of the next PROGRESS_SECONDS). A few:
# the scheduler keeps them per waiter (256 made 4,000 waiters on 300 dependencies take 95 MB)
WATCHED_FAILURES = 16
__all__ = ["Gate", "Graph", "Progress", "Verdict", "dependencies_gate", "install",
           "check_new_dependencies"]


class Progress:
    """How far a waiter's checks got: its first ``index`` dependencies were seen completed, each
    after ``since`` (when this waiter was first checked); ``looked``: its first check looked at
    every one; ``key`` tells its list of dependencies (a document with the same id and another
    list starts again); ``awaits``: the dependencies its last wait named (whose filing wakes
    it: :meth:`Graph.awaiting`); ``ready_at``: the latest filing into completed/ among those
    seen completed (carried to :meth:`Graph.runnable_wait` when the waiter passes the gate)."""

    __slots__ = ("key", "since", "index", "looked", "awaits", "ready_at")

    def __init__(self, key: int, since: datetime) -> None:
        self.key, self.since, self.index, self.looked = key, since, 0, False
        self.awaits: tuple[str, ...] = ()
        self.ready_at: datetime | None = None

    def saw_filed(self, filed: datetime | None) -> None:
        """One of the waiter's dependencies was seen completed, filed at ``filed`` (if known)."""
        if filed is not None and (self.ready_at is None or filed > self.ready_at):
            self.ready_at = filed


class Graph:
    """What the gate and the creation check know of the dependency graph, across calls.

    A completed handoff stays completed while a pending or running handoff depends on it
    (retention keeps it), but its id comes back once nothing does and it was purged (and the
    dedup window passed): so "completed" is remembered with when it was seen (a read, or this
    daemon's filing), and believed for a waiter only when seen after that waiter was first
    checked (:attr:`Progress.since`): from then on the waiter protects it. A handoff whose
    unfinished dependencies were all walked without finding a cycle or a missing document is
    remembered as cycle-free for :data:`ACYCLIC_SECONDS`: its ``depends_on`` cannot change, and
    the handoffs it leads to can only finish. A parked parent also waits for its children (an
    edge the walk follows); those edges appear when it delegates, and a delegation whose child
    would wait for its own parent is refused then, by a walk that trusts no memory
    (:meth:`path_to`, see :mod:`.delegation`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.completed: dict[str, datetime] = {}  # id -> when it was last seen completed
        # id -> when it was filed into completed/ (its history says, or this daemon filed it):
        # a dependant's queue wait counts from its last dependency's (runnable_wait)
        self.filed_at: dict[str, datetime] = {}
        self.unfinished: dict[str, datetime] = {}  # id -> when it was last read unfinished
        # id -> when this daemon filed it into failed/: a hint, read again before it is believed
        self.failed: dict[str, datetime] = {}
        self.progress: dict[str, Progress] = {}  # waiter id -> how far its checks got
        # dependency id -> how many waiters' waits name it (their Progress.awaits): only the
        # filing of one of these is noted (Graph.filed)
        self.awaited: dict[str, int] = {}
        # waiter id -> (when it became runnable: its last dependency's filing, when the gate let
        # it go): read by runnable_wait as it runs, dropped then or when it is filed; for one
        # that another process claimed instead, once RUNNABLE_SECONDS old
        self.runnable: dict[str, tuple[datetime, datetime]] = {}
        self.acyclic: set[str] = set()
        self.acyclic_since: datetime | None = None
        self.archive = ArchiveIndex(engine.ws)
        self.lock = threading.Lock()

    def state(self, handoff_id: str) -> tuple[State | None, list[str]]:
        """(state, what it waits for) of a handoff: its ``depends_on``, and for a parent parked
        in pending/ the children it waits for; (None, []) when it is missing or unreadable."""
        if handoff_id in self.completed:
            return State.COMPLETED, []
        try:
            state, doc = self.engine.get(handoff_id)
        except (NotFound, InvalidDocument):
            return None, []
        if state is State.COMPLETED:
            self.seen_completed(handoff_id, completed_at(doc))
            return state, []
        try:
            deps = dialects.detect(doc).envelope(doc).depends_on
        except Exception:  # an unreadable pending document has no known dependencies
            deps = []
        if state is State.PENDING and isinstance(doc.get(BOOK), dict) \
                and isinstance(doc[BOOK].get("waiting_children"), dict):
            deps = deps + [c for c in self._children_waited_for(handoff_id) if c not in deps]
        return state, deps

    def look(self, dep: str, progress: Progress) -> State | None:
        """The state of the dependency ``dep`` for the waiter of ``progress``: completed as
        remembered when seen so since it was first checked, else as read (a completed one that
        retention archived is completed; None: missing or unreadable). A completed one's filing
        time goes into ``progress`` (:attr:`Progress.ready_at`)."""
        seen = self.completed.get(dep)
        if seen is not None and progress.since <= seen:
            progress.saw_filed(self.filed_at.get(dep))
            return State.COMPLETED
        doc: dict[str, Any] = {}
        try:
            state: State | None
            state, doc = self.engine.get(dep)
        except (NotFound, InvalidDocument):
            state = State.COMPLETED if self.archive.completed(dep) else None
        if state is State.COMPLETED:
            filed = completed_at(doc)
            progress.saw_filed(filed)
            self.seen_completed(dep, filed)
        else:
            self.forget(dep)
            if state is not None and not state.terminal:
                self._note_unfinished(dep)
        return state

    def seen_completed(self, handoff_id: str, filed: datetime | None = None) -> None:
        """``handoff_id`` is completed now (read so, or filed so by this daemon; ``filed``: when
        it was filed, if known)."""
        self.unfinished.pop(handoff_id, None)
        self._note(self.completed, handoff_id, self.engine.clock())
        if filed is not None:
            self._note(self.filed_at, handoff_id, filed)
        with self.lock:
            self._prune()

    def forget(self, handoff_id: str) -> None:
        """``handoff_id`` is not completed (any more): pending again under a reused id, failed."""
        self.completed.pop(handoff_id, None)
        self.filed_at.pop(handoff_id, None)

    def failed_among(self, deps: list[str], since: datetime) -> list[str]:
        """Those of ``deps`` this daemon filed into failed/ since ``since`` (a hint: the gate
        reads each again before it fails a waiter for it)."""
        failed = self.failed
        if not failed:
            return []
        return [dep for dep in deps if (at := failed.get(dep)) is not None and since <= at]

    def progress_of(self, waiter: str, deps: list[str]) -> Progress:
        """How far the checks of ``waiter`` got, for this list of dependencies: started afresh
        for a new list, or when it is older than :data:`PROGRESS_SECONDS` or the dedup window
        (the waiter may have gone and come back under its id meanwhile) or the clock jumped."""
        key, now = hash(tuple(deps)), self.engine.clock()
        trusted = min(PROGRESS_SECONDS, self.engine.settings.seen_ttl_seconds)
        with self.lock:
            progress = self.progress.get(waiter)
            if progress is None or progress.key != key \
                    or not _within(now, progress.since, trusted):
                if len(self.progress) >= MAX_REMEMBERED:
                    self.progress.clear()
                    self.awaited.clear()
                    for notes in (self.completed, self.filed_at, self.failed):
                        notes.clear()  # (no waiter is left to believe them)
                elif progress is not None:
                    self._set_awaits(progress, ())
                    del self.progress[waiter]  # (the newest last: the oldest is the first)
                    self._prune()
                progress = self.progress[waiter] = Progress(key, now)
            return progress

    def awaiting(self, progress: Progress, deps: tuple[str, ...]) -> None:
        """The waiter of ``progress`` now waits for ``deps`` (its wait's ``on`` and
        ``fails_on``): their filings are noted for it (:meth:`filed`)."""
        with self.lock:
            self._set_awaits(progress, deps)

    def _set_awaits(self, progress: Progress, deps: tuple[str, ...]) -> None:
        """(With the lock held.) A dependency no wait names any more loses its failure's note:
        only a waiter whose wait names it asks for it (:meth:`failed_among`). Its completion's
        note may serve other waiters that come to it (:meth:`_prune` drops it): dropped here,
        100 handoffs each depending on all earlier ones read 2,000-2,500 documents, not 300."""
        awaited = self.awaited
        before, progress.awaits = progress.awaits, deps
        for dep in deps:  # (first: a dependency named again keeps its notes)
            awaited[dep] = awaited.get(dep, 0) + 1
        for dep in before:
            left = awaited.get(dep, 0) - 1
            if left > 0:
                awaited[dep] = left
            else:
                awaited.pop(dep, None)
                self.failed.pop(dep, None)

    def done_with(self, waiter: str) -> None:
        """``waiter`` leaves the gate (let go, failed, or filed), or is queued for a daemon's
        full re-check: its progress is dropped (its next check looks at every dependency)."""
        with self.lock:
            progress = self.progress.pop(waiter, None)
            if progress is not None:
                if progress.awaits:
                    self._set_awaits(progress, ())
                self._prune()

    def _prune(self) -> None:
        """(With the lock held.) The notes no waiter can believe go: a note is believed only
        by a waiter first checked before it was made (:attr:`Progress.since`), the oldest in
        the gate is the first in :attr:`progress` (none: one checked from now on), and the
        notes are kept oldest first (:meth:`_note`). So a dependency's note (read, or its
        filing that a wait named) goes once the last waiter there when it was made has left:
        kept, each stayed after its dependants ran, about 0.2 KB up to
        :data:`MAX_REMEMBERED` of them."""
        progress = self.progress
        oldest = next(iter(progress.values())).since if progress else self.engine.clock()
        for dep in _drop_oldest(self.completed, lambda at: at < oldest):
            self.filed_at.pop(dep, None)
        _drop_oldest(self.failed, lambda at: at < oldest)

    def filed(self, handoff_id: str, where: State) -> None:
        """``on_filed`` listener: what this daemon filed completed is completed now (a waiter
        woken by it goes on without reading it); anything else is not; what it filed into
        failed/ is noted, for the waiters it wakes (:meth:`failed_among`); a filed waiter's
        progress goes. Noted only when a waiter's wait names it (:attr:`awaited`): a note is
        believed only by a waiter first checked before it was made (:attr:`Progress.since`),
        and one that does not wait for it reads it once instead when its walk comes to it.
        Noting every filing kept an id and two times for each handoff a serving daemon ran
        (about 0.2 KB, up to :data:`MAX_REMEMBERED` of them): its memory grew with every
        handoff, also while dependants waited for something else (review RG)."""
        if handoff_id in self.progress:  # (most filings are of no waiter: nothing to drop)
            self.done_with(handoff_id)  # (first: a filed waiter is no one that could use a note)
        if self.runnable:
            with self.lock:
                self.runnable.pop(handoff_id, None)  # (let go, then filed unrun: rejected...)
        waiters = handoff_id in self.awaited
        if where is State.COMPLETED:
            if waiters:
                self.seen_completed(handoff_id, self.engine.clock())
            else:
                self.unfinished.pop(handoff_id, None)
        else:
            self.forget(handoff_id)
        if where is State.FAILED:
            self.unfinished.pop(handoff_id, None)  # (a first look reads it again)
            if waiters:
                self._note(self.failed, handoff_id, self.engine.clock())
                with self.lock:
                    self._prune()
        else:
            self.failed.pop(handoff_id, None)  # e.g. retried: pending again

    def _children_waited_for(self, handoff_id: str) -> list[str]:
        """The children a parked parent waits for, as handoffd's own (sealed) bookkeeping says:
        a ``waiting_children`` block anyone could write into a pending file is not believed."""
        try:
            trusted = self.engine.backend.peek(handoff_id)
        except (HandoffdError, OSError):
            return []
        given = trusted.get(BOOK) if isinstance(trusted, dict) else None
        wait = given.get("waiting_children") if isinstance(given, dict) else None
        children = wait.get("children") if isinstance(wait, dict) else None
        return [c for c in children if isinstance(c, str)] if isinstance(children, list) else []

    def _remember(self, where: set[str], handoff_id: str) -> None:
        with self.lock:
            if len(where) >= MAX_REMEMBERED:
                where.clear()
            where.add(handoff_id)

    def _note_unfinished(self, dep: str) -> None:
        """``dep`` was read unfinished now; the notes older than :data:`UNFINISHED_SECONDS`
        (which no first look believes) go, oldest first: another process's dependencies, whose
        filing this daemon never hears of, stayed until the 100,000-id bound (review RC)."""
        now = self.engine.clock()
        self._note(self.unfinished, dep, now)
        with self.lock:
            _drop_oldest(self.unfinished, lambda seen: not _within(now, seen, UNFINISHED_SECONDS))

    def _note(self, where: dict[str, datetime], handoff_id: str, at: datetime) -> None:
        with self.lock:
            if where.pop(handoff_id, None) is None and len(where) >= MAX_REMEMBERED:
                where.clear()
            where[handoff_id] = at  # (at the end: the notes are kept oldest first, see _prune)

    def _known_acyclic(self) -> set[str]:
        """The cycle-free ids, forgotten every :data:`ACYCLIC_SECONDS` (or when the clock jumps)."""
        now = self.engine.clock()
        with self.lock:
            age = None if self.acyclic_since is None else (now - self.acyclic_since).total_seconds()
            if age is None or not 0 <= age <= ACYCLIC_SECONDS:
                self.acyclic.clear()
                self.acyclic_since = now
            return self.acyclic

    def find_cycle(self, start: str, deps: list[str], *, stored: bool = True) -> list[str] | None:
        """A path of unfinished handoffs from ``start`` through ``deps`` back to ``start``, or
        None. Completed handoffs end a path (they wait for nothing). Every handoff whose walk
        ended cleanly (no cycle, nothing missing, within the bound) is remembered as cycle-free;
        ``start`` too when it is ``stored`` (at creation it is not yet)."""
        known = self._known_acyclic()
        # a frame: (handoff, dependencies still to look at, [nothing unclean below it so far])
        frames: list[tuple[str, list[str], list[bool]]] = [(start, list(deps), [True])]
        on_path = {start}
        visited: set[str] = set()
        while frames:
            node, todo, ok = frames[-1]
            if not todo:
                frames.pop()
                on_path.discard(node)
                if ok[0] and (stored or node != start):
                    self._remember(known, node)
                elif frames:
                    frames[-1][2][0] = ok[0] and frames[-1][2][0]
                continue
            nxt = todo.pop()
            if nxt == start:
                return [frame[0] for frame in frames] + [start]
            if nxt in known:
                continue
            if nxt in on_path or nxt in visited or len(visited) >= MAX_DEPENDENCY_WALK:
                # another cycle (not through start), a handoff already walked and found not
                # clean, or the walk's bound: nothing above it is known to be cycle-free
                ok[0] = False
                continue
            visited.add(nxt)
            state, next_deps = self.state(nxt)
            if state is None:
                ok[0] = False  # a missing dependency may yet be created, leading anywhere
            elif state is not State.COMPLETED:
                on_path.add(nxt)
                frames.append((nxt, list(next_deps), [True]))
        return None

    def path_to(self, starts: list[str], targets: Collection[str]) -> list[str] | None:
        """A path of unfinished handoffs from one of ``starts`` to one of ``targets`` through
        what each waits for (its dependencies, a parked parent's children), or None; at most
        :data:`MAX_DEPENDENCY_WALK` documents are read. The cycle-free memory is not used: it
        answers another question (no path back to *that* handoff)."""
        came_from: dict[str, str | None] = {start: None for start in starts}
        queue = deque(starts)
        while queue:
            node = queue.popleft()
            if node in targets:
                path = [node]
                while (before := came_from[path[-1]]) is not None:
                    path.append(before)
                return path[::-1]
            if len(came_from) >= MAX_DEPENDENCY_WALK:
                continue  # the bound: what is queued is still compared with the targets
            state, after = self.state(node)
            if state is None or state is State.COMPLETED:
                continue
            for nxt in after:
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        return None

    def gate(self, engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
        """The engine's gate: :func:`dependencies_gate` on this graph."""
        if not env.depends_on:  # (most handoffs: forgotten as completed, as the gate does)
            self.completed.pop(env.handoff_id, None)  # (forget's, without a call of its own)
            self.filed_at.pop(env.handoff_id, None)
            return None
        return dependencies_gate(self, env)

    def let_go(self, waiter: str, progress: Progress) -> None:
        """``waiter`` passes the gate: it carries when it became runnable (its last
        dependency's filing, :attr:`Progress.ready_at`) to :meth:`runnable_wait`, and its
        progress goes. What another process claimed instead goes once
        :data:`RUNNABLE_SECONDS` old (the gate runs again before each claim here)."""
        ready, now = progress.ready_at, self.engine.clock()
        with self.lock:
            runnable = self.runnable
            runnable.pop(waiter, None)  # (to the end of the line: the oldest come first)
            _drop_oldest(runnable, lambda entry: not _within(now, entry[1], RUNNABLE_SECONDS)
                         or len(runnable) >= MAX_REMEMBERED)
            if ready is not None:
                runnable[waiter] = (ready, now)
        self.done_with(waiter)

    def runnable_wait(self, job: Job) -> None:
        """Engine ``before_run`` hook: a dependant's queue wait (its ``claimed`` event's
        ``wait``) counts from when it became runnable, its last dependency's filing into
        completed/ (as the gate found it: carried from there, :meth:`let_go`, no document read
        here), not from the history entry before its claim (its creation: an hour waited on a
        dependency was an hour of queue wait). Never more than that count: a retry due later
        counts from then."""
        claim = job.claim
        if not self.runnable or not job.envelope.depends_on:
            return
        with self.lock:
            ready = self.runnable.pop(job.handoff_id, None)
        if ready is None or claim.wait is None or claim.claimed_at is None:
            return
        since = (claim.claimed_at - ready[0]).total_seconds()
        claim.wait = round(min(claim.wait, max(since, 0.0)), 6)

    def check_submitted(self, engine: "Engine", env: Envelope) -> None:
        """Engine.submit's check: what a new handoff depends on exists and leads nowhere back."""
        self.forget(env.handoff_id)  # a new handoff under this id: not the completed one
        if env.depends_on:
            check_new_dependencies(self, env.handoff_id, env.depends_on)


class FullRechecks(Protocol):
    """What the dependencies feature uses of a daemon's scheduler (see
    handoffd.service.quiet)."""

    def add_full_recheck_hook(self, hook: Callable[[str], None]) -> None: ...


class DaemonPlugins(Protocol):
    """What the dependencies feature uses of a daemon."""

    scheduler: FullRechecks


def install(engine: "Engine") -> None:
    """The dependencies feature: hold a handoff back until what it depends on has completed."""
    graph = Graph(engine)
    engine.gates.append(graph.gate)
    engine.submit_checks.append(graph.check_submitted)
    engine.submit_guards.append(dependents_guard)  # no dependency purged under a new dependent
    engine.on_filed.append(graph.filed)
    engine.before_run.append(graph.runnable_wait)

    def attach(daemon: DaemonPlugins) -> None:
        # a rescan leaves a waiter alone while what its wait names is unchanged: at its full
        # re-check the waiter's progress goes, and the check looks at every dependency again
        # (a failure filed by another process, of one the wait does not name, is found then)
        daemon.scheduler.add_full_recheck_hook(graph.done_with)

    engine.daemon_plugins.append(attach)


def completed_at(doc: dict[str, Any]) -> datetime | None:
    """When a completed document was filed, as its history's last ``completed`` entry says
    (None: no such entry, or an unreadable time)."""
    block = doc.get(BOOK)  # (read only: the document may be the store's cached copy)
    history = block.get("history") if isinstance(block, dict) else None
    for entry in reversed(history if isinstance(history, list) else []):
        if isinstance(entry, dict) and entry.get("event") == State.COMPLETED.value:
            try:
                return parse_iso(str(entry.get("at")))
            except ValueError:
                return None
    return None


def _drop_oldest(notes: dict[str, Any], stale: Callable[[Any], bool]) -> list[str]:
    """(With the graph's lock held.) Take from the front of ``notes``, kept oldest first, each
    entry whose value is ``stale``, up to the first that is not; the ids taken. A change
    meanwhile by a pop without the lock (``forget``, ``filed``) ends it: the next call goes on."""
    dropped: list[str] = []
    while notes:
        try:
            key, value = next(iter(notes.items()))
        except RuntimeError:
            break
        if not stale(value):
            break
        notes.pop(key, None)
        dropped.append(key)
    return dropped


def _within(now: datetime, at: datetime, seconds: float) -> bool:
    """``at`` is at most ``seconds`` before ``now`` (and not after it: a clock stepped back)."""
    return 0 <= (now - at).total_seconds() <= seconds


def dependencies_gate(graph: Graph, env: Envelope) -> Verdict | None:
    """Wait until every dependency completed; fail with DEPENDENCY_MISSING when one failed, was
    cancelled, does not exist, or the dependencies form a cycle. The dependencies are taken in
    order, from the first one not yet seen completed to the first unfinished one, which the
    wait names; at a waiter's first check every one is looked at once, so that one missing or
    failed already fails it at once."""
    graph.forget(env.handoff_id)  # pending: not the completed handoff an earlier life was
    if not env.depends_on:
        return None
    deps, waiter = env.depends_on, env.handoff_id
    progress = graph.progress_of(waiter, deps)
    failed = None if progress.looked else _first_look(graph, env, progress)
    progress.looked = True
    index = progress.index  # (two checks at once each go on from it: neither skips one)
    while failed is None and index < len(deps):
        dep = deps[index]
        state = graph.look(dep, progress)
        if state is State.COMPLETED:
            index += 1
            progress.index = max(progress.index, index)
        elif state is None or state is State.FAILED:
            failed = _failure(graph, waiter, dep, state)
        else:
            return _wait(graph, env, (dep, state), len(deps) - index - 1, progress)
    if failed is None:
        graph.let_go(waiter, progress)
    else:
        graph.done_with(waiter)
    return failed


def _first_look(graph: Graph, env: Envelope, progress: Progress) -> Verdict | None:
    """A waiter's first check: every dependency is looked at once (but one read unfinished a
    moment ago: dependants checked one after the other read each of what they share once), so
    that one missing or failed fails it at once. One that this daemon files into failed/ later
    wakes the waiter (:data:`WATCHED_FAILURES` of them), and the gate reads it again and fails
    it; one that another process files is found when the dependencies before it have
    completed, or at the first look of the next :data:`PROGRESS_SECONDS`."""
    now = graph.engine.clock()
    for dep in env.depends_on:
        seen = graph.unfinished.get(dep)
        if seen is not None and _within(now, seen, UNFINISHED_SECONDS):
            continue
        state = graph.look(dep, progress)
        if state is None or state is State.FAILED:
            return _failure(graph, env.handoff_id, dep, state)
    return None


def _failure(graph: Graph, waiter: str, dep: str, state: State | None) -> Verdict:
    """The verdict on ``waiter`` whose dependency ``dep`` is missing (None) or failed."""
    if state is None:
        return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, _missing(graph, waiter, dep))
    why = _unretriable(graph, dep)
    if why is not None:
        # `handoff retry` refuses such a dependency, even forced: "retry it first" was a dead end
        what = ("was filed holding an answer, not a request (NOT_A_REQUEST)" if why == "answer"
                else "is a failure stub (its file was set aside unread: no request to retry)")
        first = ("submit the request it answers as a new handoff" if why == "answer"
                 else "fix its file and submit it as a new handoff")
        return Verdict.fail(
            ErrorCode.DEPENDENCY_MISSING, f"handoff {waiter} depends on {dep}, which {what}: it "
            f"cannot be retried; {first}, then this one's request as a new handoff whose "
            "depends_on names that one", recovery=(
                f"The dependency {dep} cannot be retried: {first}",
                f"Submit this handoff's request again as a new handoff whose depends_on names "
                f"that new handoff instead of {dep}: retried, this one would fail again at once, "
                f"{dep} still failed"))
    return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {waiter} depends on {dep}, "
                        f"which {_ended(graph, dep)}; retry {dep} first, then this "
                        f"one with `handoff retry --force {waiter}`")


def _wait(graph: Graph, env: Envelope, first: tuple[str, State], after: int,
          progress: Progress) -> Verdict:
    """Wait for the first unfinished dependency (``after``: how many come after it), or for
    the last one when it is unfinished too: the last one listed is most often the last to
    finish (when each of 300 handoffs depended on all earlier ones, every waiter waited for the
    same first one, and each filing woke all that were left). Unless one leads back to the
    waiter: only a handoff that would wait can be waiting for ever, a cycle is looked for now."""
    (dep, state), waiter, last = first, env.handoff_id, env.depends_on[-1]
    target = dep
    later = env.depends_on[len(env.depends_on) - after:] if after else []
    watched = later[:WATCHED_FAILURES]
    for failed in graph.failed_among(watched, progress.since):
        failed_state = graph.look(failed, progress)
        if failed_state is None or failed_state is State.FAILED:
            graph.done_with(waiter)
            return _failure(graph, waiter, failed, failed_state)
        graph.failed.pop(failed, None)  # retried since: pending or running again
    if after:
        last_state = graph.look(last, progress)
        if last_state is None or last_state is State.FAILED:
            graph.done_with(waiter)
            return _failure(graph, waiter, last, last_state)
        if last_state is not State.COMPLETED:
            target = last
    cycle = graph.find_cycle(waiter, list(dict.fromkeys((dep, target))))
    if cycle:
        graph.done_with(waiter)
        return Verdict.fail(ErrorCode.DEPENDENCY_MISSING, f"handoff {waiter} depends on "
                            f"itself through {' -> '.join(cycle)}; break the cycle")
    more = f", then {after} more" if after else ""
    # re-checked at the filing of its target, or of one of the others into failed/
    fails_on = [d for d in (dep, *watched) if d != target]
    graph.awaiting(progress, (target, *fails_on))  # (their filings are noted for it)
    return Verdict.wait(f"waiting for dependency {dep} ({state.value}){more}", on=[target],
                        fails_on=fails_on)


def check_new_dependencies(graph: Graph, handoff_id: str, deps: list[str]) -> None:
    """At creation: every dependency must exist (a completed one that retention archived does)
    and none may lead back here (InvalidDocument)."""
    for dep in deps:
        if dep == handoff_id:
            raise InvalidDocument(f"handoff {handoff_id} cannot depend on itself",
                                  handoff_id=handoff_id, code=ErrorCode.DEPENDENCY_MISSING)
        if graph.engine.backend.get(dep) is None and not graph.archive.completed(dep):
            raise InvalidDocument(_missing(graph, handoff_id, dep), handoff_id=handoff_id,
                                  code=ErrorCode.DEPENDENCY_MISSING)
    cycle = graph.find_cycle(handoff_id, deps, stored=False)
    if cycle:
        raise InvalidDocument(f"dependency cycle: {' -> '.join(cycle)}", handoff_id=handoff_id,
                              code=ErrorCode.DEPENDENCY_MISSING)


def _missing(graph: Graph, handoff_id: str, dep: str) -> str:
    """Why ``dep``, not found, cannot be depended on: never created, or (the seen-ids record
    knows it) found in no state now ("create it first" misled: it existed): removed by
    retention (purged, or archived after it failed: an archived completed one is completed), or
    set aside unread, its failure stub not (yet) in failed/ (a dependant looked at in that
    moment was told "removed by retention" alone; the stub would have failed it too). The
    quarantine is not read here: this is the gate's path, and anyone can write there."""
    try:
        seen = graph.engine.backend.seen_contains(dep, graph.engine.clock())
    except (HandoffdError, OSError):  # (the record unreadable: say only what is sure)
        seen = False
    if seen:
        return (f"handoff {handoff_id} depends on {dep}, which existed but was removed by "
                f"retention (archived or purged): `handoff show {dep}` finds an archived one; "
                "or it was set aside unread: `handoff ls --state quarantined` lists it")
    return f"handoff {handoff_id} depends on {dep}, which does not exist; create it first"


def _unretriable(graph: Graph, handoff_id: str) -> str | None:
    """Why `handoff retry` refuses the failed ``handoff_id`` even forced, by handoffd's own
    bookkeeping (the store's trusted view, as retry reads it): "answer" (refused
    NOT_A_REQUEST, or filed holding an answer: cancelled while pending), "stub" (set aside
    unread: a failure stub), None (it may be retried)."""
    try:
        doc = graph.engine.get(handoff_id)[1]
    except (NotFound, InvalidDocument):
        return None
    if stub_code(doc) is not None:
        return "stub"
    return "answer" if held_answer(graph.engine.formats, doc) is not None else None


def _ended(graph: Graph, handoff_id: str) -> str:
    """How a failed dependency ended, for the message: its status (failed, cancelled...)."""
    try:
        status = graph.engine.get(handoff_id)[1].get("status")
    except (NotFound, InvalidDocument):
        status = None
    return status[:40] if isinstance(status, str) and status else "failed"
