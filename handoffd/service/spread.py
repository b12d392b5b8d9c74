"""``handoffd run`` (and ``serve``) over several processes: short handoffs use every CPU.

A batch of in-process handlers is bound by one interpreter's lock: threads take turns at every
system call, so four workers drain no faster than one (see docs/performance.md). Several
processes on one workspace are already safe (each claim is one rename; leases and the sweep
know their owners), so :func:`spread` forks the batch: each process runs the same batch on its
own engine and the parent sums their reports into one summary line and one exit code.

The fork happens after the imports and before anything opens a file or starts a thread (the
stores open their files lazily and forget inherited ones after a fork). Each process starts on
its own stretch of the pending list (``Daemon(stripe=...)``) rather than all racing for its
head. Each child leads its own process group, so a Ctrl-C reaches it once, through the parent,
which forwards SIGTERM and SIGINT; a child whose parent dies gets :data:`ORPHANED` and stops as
on a first SIGTERM (claims nothing more, lets running work finish for ``grace_seconds``).

The processes of a batch share a :class:`Board` (memory mapped before the fork): the ids each
one filed, and whether it is at work. A filing wakes the waiters of the process that made it,
and, through the board, those of the others (``Daemon.siblings``); a process with nothing left
to run waits while another is at work on what its waiters may wait for, then they all end.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..core.procs import STOP_SIGNALS, parent_death_signal
from ..core.states import State
from .reaping import Clock, Collected, collect
from .report import RECOVERED_IDS_KEPT
from .sweeper import SweepReport

if TYPE_CHECKING:
    from ..core.engine import Engine
    from .board import Seat
    from .daemon import BatchReport, Daemon

log = logging.getLogger("handoffd")
GATE_SECONDS = 30.0  # a child waits at most this long for the parent's first sweep
AUTO_MIN_PENDING = 200  # "auto" forks for a backlog at least this large (~0.3 s of no-op work)
AUTO_MAX_PROCESSES = 8
ORPHANED = signal.SIGUSR2  # what a child gets when the parent dies
# what a child is given, past the batch's --max-seconds or a stop, beyond grace_seconds to hand
# its work back, file, report and exit, before the parent stops it (.reaping)
HANDBACK_MARGIN_SECONDS = 5.0
# and beyond that when features stop with it: the notifications' last deliveries take up to
# 12 s (features.notify: 10 s to drain, 2 s to settle), the context mirror's last round 10 s
STOP_HOOKS_SECONDS = 12.0


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def processes_for(engine: Engine, requested: int | None) -> int:
    """How many processes one batch over ``engine``'s workspace runs on.

    ``requested`` (``--processes``) else ``[daemon] processes``; AUTO_PROCESSES: one per usable
    CPU (one more with fsync durability) when there are two or more, at least
    :data:`AUTO_MIN_PENDING` handoffs are pending and every specialist runs
    in process without a ``concurrency`` cap (a command handler spends its time in its own
    process, and a cap is counted per daemon process). A store that cannot be shared by forked
    processes (``forkable`` unset: PostgreSQL's connections, the in-memory store) runs one.
    """
    wanted = engine.settings.processes if requested is None else requested
    if wanted > 1:
        return _as_asked(engine, wanted)
    if wanted == 1 or not getattr(engine.backend, "forkable", False):
        return 1
    specs = engine.registry.specialists.values()
    if any(s.is_command or s.config.concurrency for s in specs):
        return 1
    cpus = usable_cpus()
    if cpus < 2:
        return 1
    try:
        if len(engine.backend.ids(State.PENDING)) < AUTO_MIN_PENDING:
            return 1
    except OSError:  # the batch's own scan will say what is wrong with the folder
        return 1
    # with fsync each process also waits for the disk: one more keeps the CPUs busy (2 CPUs,
    # 2,000 no-op handoffs: 3 processes drain 13-18% faster than 2; without fsync, 3 are slower)
    return min(cpus + 1 if engine.settings.durable else cpus, AUTO_MAX_PROCESSES)


def serve_processes_for(engine: Engine, requested: int | None) -> int:
    """How many processes ``handoffd serve`` runs on: ``requested`` (``--processes``) else
    ``[daemon] processes``, as given; "auto" serves on one (a serving daemon's load is not known
    when it starts: ask for a count to use more CPUs)."""
    wanted = engine.settings.processes if requested is None else requested
    return _as_asked(engine, wanted) if wanted > 1 else 1


def _as_asked(engine: Engine, wanted: int) -> int:
    """An explicit count: taken as given, unless the store cannot be shared by forked
    processes (then one); a concurrency cap is said to hold per process."""
    if not getattr(engine.backend, "forkable", False):
        log.warning("processes = %d: this store is not shared by forked processes; running "
                    "one (start more daemons instead)", wanted)
        return 1
    capped = [s.agent for s in engine.registry.specialists.values() if s.config.concurrency]
    if capped:
        log.warning("%d processes: the concurrency cap of %s holds in each process", wanted,
                    ", ".join(sorted(capped)))
    return wanted


def spread(count: int, engine: Engine, make: Callable[[tuple[int, int]], Daemon],
           run: Callable[[Daemon], BatchReport], *, serving: bool = False,
           child_run: Callable[[Daemon], BatchReport] | None = None,
           early: list[int] | None = None) -> BatchReport:
    """Run ``run(make((index, count)))`` in this process (index 0) and ``count - 1`` forked ones
    (``child_run`` there, if given); the sum of the reports. The index is the process's stripe
    (``Daemon(stripe=...)``).

    ``run`` must not install signal handlers: :func:`spread` installs them (the parent's also
    forward the signal to the children), then acts on the stop signals in ``early`` (those
    that came during the start: :meth:`.daemon.Daemon.take_signals`). A child that dies
    without a report is named in the result's ``lost`` (the exit code is then non-zero); its
    claims are recovered by the next sweep.
    ``serving`` (``handoffd serve``): a child that ends while the others serve stops them all, so
    that the supervisor restarts the whole; the children stop when the parent does.

    A child still running past the batch's ``--max-seconds`` (or past a stop) by more than
    :meth:`_Family.allowance` is stopped (SIGTERM, then SIGKILL) and named in ``lost``, so a
    stuck process never holds the batch: see :mod:`.reaping`."""
    from .board import Board  # (mapped for a batch of several: one process never loads it)
    from .daemon import warm_up_to_fork
    warm_up_to_fork(engine.schemas)  # built once, shared by the children
    if threading.active_count() > 1:  # a fork copies no thread but their locks: not safe now
        log.warning("not forking: a thread is running (%s)",
                    ", ".join(t.name for t in threading.enumerate()))
        count = 1
    parent = os.getpid()
    children: list[tuple[int, int]] = []  # (pid, read end of its report pipe)
    # the children start once the parent's first sweep is done (EOF on this pipe): a crash it
    # recovers marks specialists whose attempts must then run isolated in every process
    # (core/suspects.py), and a child claiming before the mark ran a crasher in itself
    gate, opened = os.pipe() if count > 1 else (-1, -1)
    began = time.monotonic()  # each process's --max-seconds counts from here, not its gate
    # a batch's processes end together: what one files may let another's waiters go
    board = Board(count) if count > 1 and not serving else None
    for index in range(1, count):
        read, write = os.pipe()
        # a stop signal waits while the child is made: it would run the parent's handler in
        # the child (a stop held for a daemon the child never has) until the child has its own
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        if pid == 0:
            os.close(read)
            os.close(opened)
            for _, other in children:
                os.close(other)
            _child(parent, write, lambda: make((index, count)), child_run or run,
                   gate=gate, began=began, mask=mask,
                   seat=board.seat(index) if board is not None else None)  # no return
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(write)
        children.append((pid, read))
    daemon = make((0, count))
    daemon.started = began
    daemon.siblings = board.seat(0) if board is not None else None
    family = _Family(daemon, [pid for pid, _ in children])
    family.install(early)
    if count > 1:
        os.close(gate)
        try:
            daemon.engine.ws.ensure()
            daemon.engine.backend.prepare()
            daemon.first_sweep = daemon.sweep()
        finally:
            os.close(opened)
    if serving:
        daemon.add_scan_hook(family.check)
    # what this process's late Python handlers kept is filed once the children are done: they
    # would claim the retry beside those handlers, which run on until this process exits
    daemon.defer_held = bool(children)
    try:
        report = run(daemon)
        if serving:
            family.stop_the_rest()
        for pid, read in children:
            _merge(report, _collect(pid, read, family))
    finally:
        if daemon.defer_held:
            daemon.release_held()
    _forget_settled(engine, report)
    return report


class _Family:
    """The parent's view of its children: signals forwarded to the ones not yet reaped (a
    reaped pid may be reused); for ``serve``, a child that ended stops the parent."""

    def __init__(self, daemon: Daemon, pids: list[int], *, clock: Clock = time.monotonic) -> None:
        self.daemon = daemon
        self.unreaped = pids
        self.signalled = False
        self.ended: set[int] = set()
        self.clock = clock
        self.stopped_at = math.inf  # when the children were first told to stop

    def install(self, early: list[int] | None = None) -> None:
        """SIGTERM/SIGINT stop the daemon as in ``run_batch`` (a second one hands back at once),
        forwarded to the children first; then each signal in ``early`` (held before: it came
        while the process started) acts so, in order, and is taken out."""
        def on_signal(signum: int, frame: Any) -> None:
            self.signalled = True
            self.stopped_at = min(self.stopped_at, self.clock())
            self.send(signal.SIGTERM if signum == signal.SIGHUP else signum)
            self.daemon.stop(hard=self.daemon.stopping)

        for signum in STOP_SIGNALS:
            signal.signal(signum, on_signal)
        while early:
            on_signal(early.pop(0), None)

    def send(self, signum: int) -> None:
        """``signum`` to every child not yet reaped."""
        for pid in list(self.unreaped):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # already done
                pass

    def check(self) -> None:
        """A scan hook of the serving parent: a child that ended (seen without reaping it)
        stops the parent, which then stops the others."""
        for pid in self.unreaped:
            if pid in self.ended:
                continue
            try:
                gone = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                gone = None
            if gone is not None:
                self.ended.add(pid)
                log.error("serving process %d ended; stopping the others (the supervisor "
                          "restarts handoffd)", pid)
                self.daemon.stop()

    def stop_the_rest(self) -> None:
        """The parent stopped on its own (not on a signal it forwarded): stop the children."""
        if not self.signalled:
            self.stopped_at = min(self.stopped_at, self.clock())
            self.send(signal.SIGTERM)

    def allowance(self) -> float:
        """Seconds a child is given past the batch's end or a stop to hand back and report:
        ``grace_seconds`` (a first stop lets running work finish that long), a margin, and
        what the stop hooks may take when features registered some."""
        hooks = STOP_HOOKS_SECONDS if self.daemon.stop_hooks else 0.0
        return self.daemon.settings.grace_seconds + HANDBACK_MARGIN_SECONDS + hooks

    def deadline(self) -> float:
        """When the children must have ended (monotonic; inf: no bound, a batch without
        ``--max-seconds`` that nobody stopped waits for its children's work): the allowance
        after the parent's ``--max-seconds`` ran out (each child's ran out before: it started
        first) or after the children were told to stop, whichever came first."""
        return min(self.daemon.batch_deadline, self.stopped_at) + self.allowance()

    def ended_by(self) -> str:
        """What the deadline counts from, for the summary."""
        if self.stopped_at < self.daemon.batch_deadline:
            return "it was told to stop"
        return "the batch's --max-seconds ran out"


def _report(write: int, report: BatchReport) -> None:
    try:
        _write_all(write, json.dumps(_as_json(report)).encode())
    except BrokenPipeError:  # the parent is gone: nobody to report to (it said so, or died)
        pass


def _child(parent: int, write: int, make: Callable[[], Daemon],
           run: Callable[[Daemon], BatchReport], *, gate: int = -1,
           began: float | None = None, seat: Seat | None = None,
           mask: set[int | signal.Signals] | None = None) -> None:
    code = 1
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent alone; it forwards it once
        held: list[int] = []  # until this process has its daemon: then acted on (install)
        for signum in STOP_SIGNALS:  # (a stop the parent forwarded meanwhile killed it: "lost")
            signal.signal(signum, lambda signum, frame: held.append(signum))
        if mask is not None:  # (blocked by the parent around the fork)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(ORPHANED, signal.SIG_DFL)
        parent_death_signal(ORPHANED)
        if os.getppid() != parent:  # the parent died before that: nothing claimed yet
            return
        daemon = make()
        forked = getattr(daemon.engine.backend, "after_fork", None)
        if forked is not None:  # files: a temp folder of its own (no lock shared at each create)
            forked()
        _Family(daemon, []).install(held)
        # the parent is gone: stop as on a first SIGTERM. Not SIGTERM itself: the kernel may
        # send it more than once (once per thread of the parent that the child is handed to),
        # and a second SIGTERM means "hand back now"
        signal.signal(ORPHANED, lambda signum, frame: daemon.stop())
        daemon.started = began
        daemon.siblings = seat
        if _await_gate(gate, parent):  # the parent swept: no second sweep, only its crash marks read
            daemon.first_sweep = SweepReport()
            daemon.engine.suspects.refresh()
        report = run(daemon)
        code = 0
        _report(write, report)
    except BaseException:  # noqa: BLE001 - whatever happens, this process must end here
        log.exception("process %d failed", os.getpid())
    finally:
        try:
            # what a normal exit runs (this process's spare files, the logs' flush); os._exit
            # then, so that nothing of the parent's code runs on in the child
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.close(fd)


def _collect(pid: int, read: int, family: _Family) -> dict[str, Any]:
    """The report of child ``pid`` (read to the end, then reaped: :func:`.reaping.collect`);
    an error entry when it has none, added to what it reported when it had to be stopped past
    ``family``'s deadline."""
    done = collect(pid, read, family.deadline, family.unreaped, clock=family.clock)
    if not done.stopped:
        return _parsed(pid, done)
    late = (f"process {pid} was still running {family.allowance():g}s after "
            f"{family.ended_by()}; stopped it with {done.stopped}"
            + ("" if done.status is not None else " (it has not ended yet)"))
    try:  # what it reported as it stopped still counts
        parsed = json.loads(done.data) if done.data else None
    except ValueError:
        parsed = None
    return {**parsed, "lost": late} if isinstance(parsed, dict) else {"lost": late}


def _parsed(pid: int, done: Collected) -> dict[str, Any]:
    """The report a child that ended on its own sent; an error entry if it has none."""
    status = done.status if done.status is not None else 0
    try:
        parsed = json.loads(done.data) if done.data else None
    except ValueError:
        parsed = None
    code = os.waitstatus_to_exitcode(status)
    if isinstance(parsed, dict) and code == 0:
        return parsed
    how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
    return {"lost": f"process {pid} ended without a report ({how})"}


def _as_json(report: BatchReport) -> dict[str, Any]:
    return {"completed": report.completed, "failed": report.failed,
            "retrying": report.retrying, "throttled": report.throttled,
            "recovered": report.recovered, "handed_back": report.handed_back,
            "unroutable": sorted(report.unroutable), "waiting": report.waiting,
            "error": report.error, "stalls": report.stalls, "errors": report.errors,
            "set_aside": report.set_aside, "backed_off": report.backed_off,
            "recovered_ids": report.recovered_ids}


def _merge(report: BatchReport, other: dict[str, Any]) -> None:
    for name in ("completed", "failed", "retrying", "throttled", "recovered", "handed_back",
                 "stalls", "errors", "set_aside"):
        value = other.get(name, 0)
        setattr(report, name, getattr(report, name) + (value if isinstance(value, int) else 0))
    report.unroutable.update(str(hid) for hid in other.get("unroutable", ()))
    report.waiting.update({str(k): str(v) for k, v in dict(other.get("waiting", {})).items()})
    recovered = other.get("recovered_ids")
    if isinstance(recovered, list):
        room = max(RECOVERED_IDS_KEPT - len(report.recovered_ids), 0)
        report.recovered_ids.extend(str(hid) for hid in recovered[:room])
    backed = other.get("backed_off")
    if isinstance(backed, list):
        report.backed_off.extend(str(hid) for hid in backed)
    if other.get("error") and not report.error:
        report.error = str(other["error"])
    if other.get("lost"):
        report.lost.append(str(other["lost"]))


def _forget_settled(engine: Engine, report: BatchReport) -> None:
    """Drop from the summary what one process saw waiting, or handed back for a start
    shortage, and another then ran (a sibling claimed it once its back-off ended)."""
    from ..core.errors import HandoffdError

    def settled(hid: str) -> bool:
        try:
            found = engine.backend.get(hid)
        except (HandoffdError, OSError):  # unreadable now: say what was seen
            return False
        return found is None or found[0] is not State.PENDING

    for ids in (report.unroutable, report.waiting):
        for hid in [hid for hid in ids if settled(hid)]:
            if isinstance(ids, set):
                ids.discard(hid)
            else:
                ids.pop(hid, None)
    taken = {hid for hid in set(report.backed_off) if settled(hid)}
    left = [hid for hid in report.backed_off if hid not in taken]
    report.handed_back = max(report.handed_back - (len(report.backed_off) - len(left)), 0)
    report.backed_off = left


def _await_gate(gate: int, parent: int, limit: float = GATE_SECONDS) -> bool:
    """Wait until the parent's first sweep is done (EOF on ``gate``; also when the parent dies),
    at most ``limit`` seconds: a sweep that takes longer must not hold the batch. True when
    the parent's sweep is done (then this process need not sweep at its start)."""
    if gate < 0:
        return False
    try:
        readable, _, _ = select.select([gate], [], [], limit)
        # EOF with the parent alive: its sweep is done (a dead parent closes it too)
        return bool(readable) and not os.read(gate, 1) and os.getppid() == parent
    except (OSError, ValueError):  # (interrupted, or a descriptor closed under us)
        return False
    finally:
        try:
            os.close(gate)
        except OSError:
            pass
