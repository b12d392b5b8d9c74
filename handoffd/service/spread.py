"""One ``handoffd run`` over several processes: a large backlog of short handoffs uses every CPU.

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
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..core.procs import parent_death_signal

if TYPE_CHECKING:
    from ..core.engine import Engine
    from .daemon import BatchReport, Daemon

log = logging.getLogger("handoffd")
AUTO_MIN_PENDING = 200  # "auto" forks for a backlog at least this large (~0.3 s of no-op work)
AUTO_MAX_PROCESSES = 8
ORPHANED = signal.SIGUSR2  # what a child gets when the parent dies


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def processes_for(engine: Engine, requested: int | None) -> int:
    """How many processes one batch over ``engine``'s workspace runs on.

    ``requested`` (``--processes``) else ``[daemon] processes``; 0 is "auto": one per usable
    CPU (one more with fsync durability) when there are two or more, at least
    :data:`AUTO_MIN_PENDING` handoffs are pending and every specialist runs
    in process without a ``concurrency`` cap (a command handler spends its time in its own
    process, and a cap is counted per daemon process). A store that cannot be shared by forked
    processes (``forkable`` unset: PostgreSQL's connections, the in-memory store) runs one.
    """
    wanted = engine.settings.processes if requested is None else requested
    if wanted == 1:
        return 1
    if not getattr(engine.backend, "forkable", False):
        if wanted > 1:
            log.warning("processes = %d: this store is not shared by forked processes; running "
                        "one (start more daemons instead)", wanted)
        return 1
    if wanted > 1:
        capped = [s.agent for s in engine.registry.specialists.values() if s.config.concurrency]
        if capped:
            log.warning("%d processes: the concurrency cap of %s holds in each process", wanted,
                        ", ".join(sorted(capped)))
        return wanted
    from ..core.states import State
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


def spread(count: int, engine: Engine, make: Callable[[tuple[int, int]], Daemon],
           run: Callable[[Daemon], BatchReport]) -> BatchReport:
    """Run ``run(make((index, count)))`` in this process (index 0) and ``count - 1`` forked ones;
    the sum of the reports. The index is the process's stripe (``Daemon(stripe=...)``).

    ``run`` must not install signal handlers: :func:`spread` installs them (the parent's also
    forward the signal to the children). A child that dies without a report makes the result an
    error (the exit code is then non-zero); its claims are recovered by the next sweep."""
    from .daemon import warm_up
    warm_up()  # the schema checks' imports, once, shared by the children
    if threading.active_count() > 1:  # a fork copies no thread but their locks: not safe now
        log.warning("not forking the batch: a thread is running (%s)",
                    ", ".join(t.name for t in threading.enumerate()))
        count = 1
    parent = os.getpid()
    children: list[tuple[int, int]] = []  # (pid, read end of its report pipe)
    for index in range(1, count):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            for _, other in children:
                os.close(other)
            _child(parent, write, lambda: make((index, count)), run)  # never returns
        os.close(write)
        children.append((pid, read))
    daemon = make((0, count))
    unreaped = [pid for pid, _ in children]  # signals go to these (a reaped pid may be reused)
    _on_signals(daemon, unreaped)
    report = run(daemon)
    for pid, read in children:
        _merge(report, _collect(pid, read, unreaped))
    _forget_settled(engine, report)
    return report


def _child(parent: int, write: int, make: Callable[[], Daemon],
           run: Callable[[Daemon], BatchReport]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent alone; it forwards it once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until this process has its daemon
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(ORPHANED, signal.SIG_DFL)
        parent_death_signal(ORPHANED)
        if os.getppid() != parent:  # the parent died before that: nothing claimed yet
            return
        daemon = make()
        _on_signals(daemon, [])
        # the parent is gone: stop as on a first SIGTERM. Not SIGTERM itself: the kernel may
        # send it more than once (once per thread of the parent that the child is handed to),
        # and a second SIGTERM means "hand back now"
        signal.signal(ORPHANED, lambda signum, frame: daemon.stop())
        report = run(daemon)
        code = 0
        _write_all(write, json.dumps(_as_json(report)).encode())
    except BrokenPipeError:  # the parent is gone: nobody to report to (it said so, or died)
        pass
    except BaseException:  # noqa: BLE001 - whatever happens, this process must end here
        log.exception("batch process %d failed", os.getpid())
    finally:
        try:
            # what a normal exit runs (this process's spare files, the logs' flush); os._exit
            # then, so that nothing of the parent's code runs on in the child
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _on_signals(daemon: Daemon, pids: list[int]) -> None:
    """SIGTERM/SIGINT stop ``daemon`` as in ``run_batch`` (a second one hands back at once),
    forwarded to ``pids`` first."""
    def on_signal(signum: int, frame: Any) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # already done
                pass
        daemon.stop(hard=daemon.stopping)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.close(fd)


def _collect(pid: int, read: int, unreaped: list[int]) -> dict[str, Any]:
    """The report of child ``pid``: read to the end, then reaped (and taken off ``unreaped``
    first); an error entry if it has none."""
    chunks = []
    with os.fdopen(read, "rb") as pipe:
        chunks.append(pipe.read())
    unreaped.remove(pid)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    try:
        parsed = json.loads(data) if data else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and os.waitstatus_to_exitcode(status) == 0:
        return parsed
    code = os.waitstatus_to_exitcode(status)
    how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
    return {"error": f"batch process {pid} ended without a report ({how})"}


def _as_json(report: BatchReport) -> dict[str, Any]:
    return {"completed": report.completed, "failed": report.failed,
            "retrying": report.retrying, "handed_back": report.handed_back,
            "unroutable": sorted(report.unroutable), "waiting": report.waiting,
            "error": report.error, "stalls": report.stalls}


def _merge(report: BatchReport, other: dict[str, Any]) -> None:
    for name in ("completed", "failed", "retrying", "handed_back", "stalls"):
        value = other.get(name, 0)
        setattr(report, name, getattr(report, name) + (value if isinstance(value, int) else 0))
    report.unroutable.update(str(hid) for hid in other.get("unroutable", ()))
    report.waiting.update({str(k): str(v) for k, v in dict(other.get("waiting", {})).items()})
    if other.get("error") and not report.error:
        report.error = str(other["error"])


def _forget_settled(engine: Engine, report: BatchReport) -> None:
    """Drop from the summary what one process saw waiting and another then ran."""
    from ..core.errors import HandoffdError
    from ..core.states import State
    for ids in (report.unroutable, report.waiting):
        for hid in list(ids):
            try:
                found = engine.backend.get(hid)
            except (HandoffdError, OSError):  # unreadable now: say what was seen
                continue
            if found is None or found[0] is not State.PENDING:
                if isinstance(ids, set):
                    ids.discard(hid)
                else:
                    ids.pop(hid, None)
