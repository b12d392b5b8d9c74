"""A handler attempt's child process, as both runners handle it: a command specialist's
(:func:`~.runner.run_command`) and an isolated Python handler's (:func:`~.isolation.run_isolated`).

Before the child starts, :func:`clear_previous_attempt` kills what an earlier attempt left and
:func:`write_record` records the attempt's processes (see procrecords.py). While it runs, :func:`feed`
writes its stdin, a :class:`Collector` drains each output pipe, :func:`await_exit` sees it exit
without reaping it, and :func:`wait_attempt` waits for that, the timeout or a cancellation.
:func:`end_attempt` then stops everything the attempt started (SIGTERM to its group and every
token carrier, a grace period, SIGKILL), reaps the child, closes the pipes and joins the
attempt's threads, all in bounded time.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
import time
from typing import Any, Protocol

from . import deathwatch, procrecords, procs
from .errors import HandlerError, is_shortage, shortage_words
from .specialists import HandlerContext
from .starts import THREADS, THREADS_LIMIT, shortage, shown_error
from .watchdog import cancelled, timed_out

KILL_GRACE_SECONDS = 2.0
STDERR_TAIL = 4096
# After the attempt's processes are killed, how long a pipe may stay open (a writer the kill could
# not find) before its reader stops waiting for EOF.
PIPE_DRAIN_SECONDS = 1.0
POLL_MS = 100  # how often an I/O thread of an attempt looks whether it should stop
log = logging.getLogger("handoffd")


def wait_attempt(done: threading.Event, ctx: HandlerContext, timeout: float) -> None:
    """Wait for ``done``; raise TIMEOUT / CANCELLED. Cancellation sets ``done`` too (no polling)."""
    ctx.wake_on_cancel(done)
    if ctx.stop_requested:
        done.set()  # cancelled before we started waiting: do not sleep until the timeout
    deadline = time.monotonic() + timeout
    while not done.wait(max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            raise timed_out(ctx, timeout)
    if ctx.stop_requested:
        raise cancelled(ctx)


def clear_previous_attempt(ctx: HandlerContext) -> None:
    """Kill what an earlier attempt of this handoff left running on this host; refuse to start
    (a retryable error) while any of it survives, so two runs of one handoff never overlap."""
    # any failure (a disk error; a malformed record, whose fields are not the types they
    # should be: a TypeError once stranded the claim until recovery) is one logged line and the
    # attempt starts: the token scan and the parent-death signal still bound a leftover
    try:
        procs.kill_leftovers(ctx.root, ctx.handoff_id, attempt=ctx.attempt)
        left = procrecords.read_record(ctx.root, ctx.handoff_id)
        if left is None or not left.local() or left.attempt > ctx.attempt:
            return
        alive = procs.find(left.token, None)  # (one still in exec: said, see procs)
    except Exception as exc:
        log.warning("handoff %s: cannot check for leftover processes%s", ctx.handoff_id,
                    leftovers_unchecked(exc))
        return
    if alive:
        raise HandlerError(f"handoff {ctx.handoff_id}: {len(alive)} process(es) of attempt "
                           f"{left.attempt} survive SIGKILL (pids "
                           f"{', '.join(str(p.pid) for p in alive[:10])}); not starting another run "
                           "beside them", handoff_id=ctx.handoff_id, retryable=True)


def leftovers_unchecked(exc: BaseException) -> str:
    """What follows "cannot check for leftover processes" for ``exc``: a passing shortage in
    the words naming its limit (it was a bare ``OSError: [Errno 24] ...``), else its type and
    message, cut short."""
    if is_shortage(exc):
        return f" for now: {shortage_words(exc)}"
    return f": {type(exc).__name__}: {str(exc)[:200]}"


def write_record(ctx: HandlerContext, record: procrecords.RunRecord) -> None:
    """Write the attempt's process record (procrecords.py) and tell the daemon's death watch
    (deathwatch.py: kills the attempt at once if the daemon dies); a failure is logged, not
    raised."""
    deathwatch.guard(record.token, ctx.handoff_id, ctx.attempt, record.pgid)
    try:
        procrecords.write_record(ctx.root, record)
    except OSError as exc:  # the attempt still runs; only a later cleanup loses its handle
        log.warning("handoff %s: cannot record the attempt's processes: %s", ctx.handoff_id, exc)


def await_exit(proc: subprocess.Popen[bytes], exited: threading.Event,
               done: threading.Event) -> None:
    """Wait for the child's exit without reaping it: while it is an unreaped zombie its pid, and
    so its process-group id, cannot be reused, and :func:`end_attempt` may kill the group safely."""
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped by end_attempt
        pass
    exited.set()
    done.set()


class Draining(Protocol):
    """A reader of an attempt's pipe (:class:`Collector`, the isolated handler's channel)."""

    def finish(self, wait: float) -> None:
        """Stop reading: up to ``wait`` seconds for the pipe's end, then cut it off."""


def end_attempt(ctx: HandlerContext, proc: subprocess.Popen[bytes], token: str,
                exited: threading.Event, collectors: tuple[Draining, ...],
                helpers: tuple[threading.Thread, ...]) -> None:
    """Stop everything the attempt started, in bounded time: SIGTERM the child (if it still runs)
    with a grace period, then SIGKILL its process group and every process carrying the run token
    (a grandchild that called setsid, a background child holding stdout), reap the child, close
    the pipes and join every thread of the attempt."""
    if not exited.is_set():  # timeout, cancellation, overflow: ask politely first
        signal_all(proc.pid, token, signal.SIGTERM)
        exited.wait(KILL_GRACE_SECONDS)
    # the child is alive or an unreaped zombie, so the group is provably this attempt's
    survivors = 0
    try:
        _, survivors = procs.kill_run(token, proc.pid, group_known=proc.returncode is None)
    except Exception:  # never leave the pipes and threads behind because of a scan failure
        log.exception("handoff %s: killing the attempt's processes failed", ctx.handoff_id)
        survivors = -1
    try:
        proc.wait(timeout=procs.KILL_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        log.error("handoff %s: handler pid %d does not die", ctx.handoff_id, proc.pid)
    exited.set()
    # every writer is dead: the readers see EOF once the buffered output is read; a writer the
    # kill could not find (one that cleared its environment and left the group) is cut off
    for collector in collectors:
        collector.finish(PIPE_DRAIN_SECONDS)
    for thread in helpers:
        if thread.ident is not None:  # (one that could not be started: no thread to spare)
            thread.join(timeout=PIPE_DRAIN_SECONDS)
    deathwatch.release(token)  # (killed and reaped: nothing left for the death watch)
    if proc.stdin is not None and not any(thread.is_alive() for thread in helpers):
        _close(proc.stdin)  # a feeder that never started never closed it
    if survivors == 0:
        procrecords.remove_record(ctx.root, ctx.handoff_id, token)


def signal_name(number: int) -> str:
    """``SIGSEGV`` for 11: how both runners say which signal ended a child (else "unknown")."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


def signal_all(pgid: int, token: str, sig: int) -> None:
    """Send ``sig`` to the attempt's process group and to every process carrying its token
    (found as a kill finds them: one in the middle of exec looked at again, see procs.find)."""
    try:
        os.killpg(pgid, sig)
        reached = pgid
    except (ProcessLookupError, PermissionError):
        reached = None
    # (one still in the middle of exec after the rounds is said, as a kill says it)
    for info in procs.find(token, None):
        if info.pgid == reached:
            # signalled once already: a second SIGTERM a moment later re-enters a handler that
            # prints its partial result, and the answer becomes two JSON lines (seen in a run)
            continue
        try:
            os.kill(info.pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


class Feed:
    """What :func:`feed` met: ``short``, the MemoryError that stopped it (None: none did)."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done  # set when the feed runs short: the attempt ends at once
        self.short: MemoryError | None = None


def feed(proc: subprocess.Popen[bytes], payload: bytes, stop: threading.Event,
         fed: Feed | None = None) -> None:
    """Write the document to the child's stdin; give up when the child has exited (a background
    child that inherited stdin and never reads it must not keep this thread forever).

    Short of memory (a MemoryError: a poll, a slice, the write), the document is not all
    written: ``fed.short`` says so and the attempt ends at once (``fed.done``), stdin left open
    so that the child, killed then, never reads a cut document as if it were whole; its runner
    hands the attempt back uncounted, said stopped after its start (:func:`~.starts.shortage`,
    ``after_start``), unless the child had already exited on its own with a whole
    ``completed`` result, which is kept. The thread once died of it with a traceback, and the
    child ran on half a document, its attempt counted."""
    assert proc.stdin is not None
    close = True
    try:
        fd = proc.stdin.fileno()
        view = memoryview(payload)
        os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while view and not stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            try:
                view = view[os.write(fd, view[:65536]):]
            except BlockingIOError:
                continue
    except OSError:
        pass  # the handler need not read its input (EPIPE)
    except MemoryError as exc:
        if fed is None:
            raise
        fed.short, close = exc, False  # (end_attempt closes stdin once the child is killed)
        fed.done.set()
    finally:
        if close:
            _close(proc.stdin)


class Collector:
    """Drains a pipe in a thread, keeping at most ``limit`` bytes (the head, or the tail).

    The thread polls, so :meth:`finish` can end it even while some process the attempt's kill
    could not find still holds the pipe's write end open (no EOF would ever come)."""

    def __init__(self, pipe: Any, limit: int, *, keep_tail: bool) -> None:
        self.pipe, self.limit, self.keep_tail = pipe, limit, keep_tail
        # one buffer, not a list of the reads: a handler writing a byte at a time once cost
        # ~40 bytes of daemon memory per byte (a bytes object and a list slot per read), so the
        # output cap did not bound memory
        self.buffer = bytearray()
        self.size = 0
        self.overflow = False
        self.on_overflow: Any = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True, name="handler-output")

    def _drain(self) -> None:
        try:
            fd = self.pipe.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while True:
                stopping = self.stop.is_set()
                if not poller.poll(0 if stopping else POLL_MS):
                    if stopping:
                        break
                    continue
                chunk = self._read(fd)
                if chunk is None:  # short of memory: nothing was read, read it again
                    if stopping:
                        break
                    continue
                if not chunk or not self._keep(chunk):
                    break
                self.size = len(self.buffer)
                if self.size > self.limit:
                    if self.keep_tail:
                        del self.buffer[:-self.limit]  # (cheap: the front is dropped in place)
                        self.size = len(self.buffer)
                    else:
                        self.overflow = True
                        if self.on_overflow:
                            self.on_overflow()
                        break
                if stopping:
                    break
        except OSError:
            pass
        finally:
            try:
                self.pipe.close()
            except OSError:
                pass

    def _read(self, fd: int) -> bytes | None:
        """One read of the pipe, or None after a pause when memory ran short for it (its
        buffer is made before the read: nothing was taken from the pipe). The drain once died
        of it (a traceback) and the handler's answer was lost, its attempt counted failed."""
        try:
            return os.read(fd, 65536)
        except MemoryError:
            self.stop.wait(POLL_MS / 1000)
            return None

    def _keep(self, chunk: bytes) -> bool:
        """Add ``chunk`` to what is kept; short of memory, again after a pause until it fits,
        or False (the output cut there) once the drain is told to stop."""
        while True:
            try:
                self.buffer += chunk
                return True
            except MemoryError:
                if self.stop.wait(POLL_MS / 1000):
                    return False

    def finish(self, wait: float) -> None:
        """Join the thread: up to ``wait`` seconds for EOF, then cut the pipe off (one that was
        never started, for want of a thread to spare, only closes the pipe)."""
        if self.thread.ident is None:
            _close(self.pipe)
            return
        self.thread.join(timeout=wait)
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join(timeout=wait + POLL_MS / 1000)

    def data(self) -> bytes:
        """What was kept of the pipe's output."""
        return bytes(self.buffer)


def _close(pipe: Any) -> None:
    try:
        pipe.close()
    except OSError:
        pass


def forget_record(ctx: HandlerContext, token: str) -> None:
    """Remove the record of an attempt whose child never started; a failure is one line (an
    escaping OSError stranded the claim until its lease ran out)."""
    deathwatch.release(token)
    try:
        procrecords.remove_record(ctx.root, ctx.handoff_id, token)
    except OSError as exc:
        log.warning("handoff %s: cannot remove the record of its attempt's processes: %s",
                    ctx.handoff_id, exc)


def start_threads(ctx: HandlerContext, agent: str, proc: subprocess.Popen[bytes],
                   exited: threading.Event, threads: tuple[threading.Thread, ...]) -> None:
    """Start the attempt's I/O threads, its stdin's feeder last. When one cannot be started
    (RuntimeError: no thread to spare, a passing shortage), the child, not given its document
    yet, is killed at once and the shortage raised: :func:`~.childproc.end_attempt` then reaps it and closes
    its pipes (it once raised past them: the child a zombie, its pipes leaked, the claim stalled
    until its lease)."""
    for thread in threads:
        try:
            thread.start()
        except RuntimeError as exc:
            try:  # (unreaped, the child's pid and so its group are still its own)
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            exited.set()  # nothing to wait for politely: end_attempt kills what is left
            raise shortage(ctx, f"a thread for {agent}'s handler", THREADS, shown_error(exc),
                            THREADS_LIMIT) from None
