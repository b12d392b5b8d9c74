"""Command delivery: the rule's argv (never a shell) with the filed document on its stdin.

The command runs in a process group of its own with ``$HANDOFF_ID``, ``$HANDOFF_STATE`` and
``$HANDOFFD_ROOT``; its stdout is discarded and only the tail of its stderr kept (a command
writing without end once grew the daemon by hundreds of MB a second). At its timeout, or when
the process that filed the handoff stops, the whole group is killed (a hanging one outlived the
daemon).

A command is judged by its own exit status. A process it left behind that still holds its pipes
(a ``setsid`` grandchild) is not waited for beyond :data:`PIPE_GRACE_SECONDS` after the command
exited: such a command that exited 0 was once counted as timed out.

Once the command has exited, what it left running in its process group (``sleep 345 &``,
``nohup cmd &``) is killed: such a child once outlived the daemon. The group is killed before
the command is reaped, while its zombie still holds the group's id (so no other group can have
it); what detaches from the group (``setsid``) is the command's own business."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

from .notices import Notice

STDERR_TAIL = 200  # characters of a failing command's stderr kept in its dead letter
PIPE_GRACE_SECONDS = 0.5  # how long a command's pipes may outlive the command itself
POLL_SECONDS = 0.1  # how often a command is checked for having exited while its pipes stay open
CHUNK = 65536


def spawn(notice: Notice, root: Path) -> subprocess.Popen[bytes] | str:
    """Start the rule's command for ``notice`` (in its own process group, in ``root``), or
    say why it could not be started."""
    command = notice.rule.command
    assert command is not None
    env = {**os.environ, "HANDOFF_ID": notice.handoff_id, "HANDOFF_STATE": notice.state.value,
           "HANDOFFD_ROOT": str(root)}
    try:
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, cwd=root,
                                start_new_session=True)
    except OSError as exc:
        return f"{command[0]}: {exc}"


def supervise(proc: subprocess.Popen[bytes], body: bytes, timeout: float) -> str | None:
    """Feed ``body`` to ``proc`` and wait at most ``timeout`` seconds for it to exit, keeping
    only the tail of its stderr: that tail, or None (after killing its group) when time ran
    out. Once the command itself has exited, the rest of its process group is killed and its
    pipes get :data:`PIPE_GRACE_SECONDS` more; it is reaped before this returns."""
    pipes = _Pipes(proc, body)
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                kill_group(proc)
                return None
            if exited_at is None and exited(proc):
                exited_at = now
                _kill_members(proc)
            # its stderr closed, or what still holds it open is not the command (a setsid
            # grandchild): judge it by its exit status
            if exited_at is not None and (not pipes.reading
                                          or now - exited_at >= PIPE_GRACE_SECONDS):
                break
            pipes.step(proc, min(deadline - now, POLL_SECONDS))
    finally:
        pipes.close()
    proc.wait()  # (it has exited: at once)
    return pipes.tail.decode("utf-8", "replace").strip()[-STDERR_TAIL:]


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once the command has exited, without reaping it (its zombie keeps its pid, and so
    its process group's id, from being given to another process)."""
    if proc.returncode is not None:
        return True  # (reaped already: a drain killed its group)
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # (reaped meanwhile by another thread)
        return True


def _kill_members(proc: subprocess.Popen[bytes]) -> None:
    """Kill what the exited (not yet reaped) command left in its process group."""
    if proc.returncode is not None:
        return  # (reaped: kill_group did it, and the group's id may be another's by now)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # (nothing left in it)


def _wait_exit(proc: subprocess.Popen[bytes], wait: float) -> None:
    """Wait at most ``wait`` seconds for the command to exit, without reaping it."""
    if proc.returncode is not None:
        return
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # (not Linux 5.3+: a short nap, then look again)
        time.sleep(min(max(wait, 0.0), 0.01))
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # (readable once it has exited)
        poller.poll(max(wait, 0.0) * 1000)
    finally:
        os.close(fd)


class _Pipes:
    """A command's stdin (fed ``body`` without blocking) and stderr (its tail kept), served by
    one ``select`` loop: no thread is left blocked writing to a pipe nobody reads."""

    def __init__(self, proc: subprocess.Popen[bytes], body: bytes) -> None:
        assert proc.stdin is not None and proc.stderr is not None
        self.stdin, self.stderr = proc.stdin, proc.stderr
        self.left = memoryview(body)
        self.writing = True
        self.reading = True
        self.tail = b""
        os.set_blocking(self.stdin.fileno(), False)
        if not self.left:
            self._close_stdin()

    def step(self, proc: subprocess.Popen[bytes], wait: float) -> None:
        """Write what stdin takes and read what stderr has, waiting at most ``wait`` seconds
        (for the command's exit when both pipes are done)."""
        readers = [self.stderr.fileno()] if self.reading else []
        writers = [self.stdin.fileno()] if self.writing else []
        if not readers and not writers:
            _wait_exit(proc, wait)  # (not proc.wait: reaped, its group's id could be reused)
            return
        poller = select.poll()  # (not select.select: a daemon's descriptors may pass 1023)
        for fd in readers:
            poller.register(fd, select.POLLIN)
        for fd in writers:
            poller.register(fd, select.POLLOUT)
        ready = dict(poller.poll(max(wait, 0.0) * 1000))
        if writers and ready.get(writers[0]):
            self._write()
        if readers and ready.get(readers[0]):
            chunk = os.read(self.stderr.fileno(), CHUNK)
            if not chunk:
                self.reading = False
            self.tail = (self.tail + chunk)[-4 * STDERR_TAIL:]

    def _write(self) -> None:
        try:
            written = os.write(self.stdin.fileno(), self.left[:CHUNK])
            self.left = self.left[written:]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: it exited without reading, or was killed
            self.left = self.left[:0]
        if not self.left:
            self._close_stdin()

    def _close_stdin(self) -> None:
        self.writing = False
        self.left = memoryview(b"")
        try:
            self.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        """Close both pipes (what is left of the document is not written)."""
        self._close_stdin()
        self.stderr.close()


def judge(name: str, proc: subprocess.Popen[bytes], tail: str | None,
          timeout: float) -> tuple[str | None, bool]:
    """What finished command ``name`` says: (None, False) when it took the notice, else (the
    problem, whether it may have acted on the document all the same: it was killed)."""
    killed = tail is None or (proc.returncode or 0) < 0
    if tail is None:
        return f"{name}: timed out after {timeout:g}s", True
    if proc.returncode is not None and proc.returncode < 0:
        return f"{name} was killed by signal {-proc.returncode}: {tail}", killed
    if proc.returncode != 0:
        return f"{name} exited {proc.returncode}: {tail}", killed
    return None, killed


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the command's whole process group and reap it (waiting at most 5 s)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
