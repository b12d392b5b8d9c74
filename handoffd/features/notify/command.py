"""Command delivery: the rule's argv (never a shell) with the filed document on its stdin.

The command runs in a process group of its own with ``$HANDOFF_ID``, ``$HANDOFF_STATE`` and
``$HANDOFFD_ROOT``; its stdout is discarded and only the tail of its stderr kept (a command
writing without end once grew the daemon by hundreds of MB a second). At its timeout, or when
the process that filed the handoff stops, the whole group is killed (a hanging one outlived the
daemon).

A command is judged by its own exit status. A process it left behind that still holds its pipes
(a ``setsid`` grandchild, a ``nohup cmd &``) is not waited for beyond :data:`PIPE_GRACE_SECONDS`
after the command exited: such a command that exited 0 was once counted as timed out."""
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
    out. Once the command itself has exited, its pipes get :data:`PIPE_GRACE_SECONDS` more."""
    pipes = _Pipes(proc, body)
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                kill_group(proc)
                return None
            if proc.poll() is not None:
                exited_at = now if exited_at is None else exited_at
                # its stderr closed, or what still holds it open is not the command (a setsid
                # grandchild): judge it by its exit status
                if not pipes.reading or now - exited_at >= PIPE_GRACE_SECONDS:
                    break
            pipes.step(proc, min(deadline - now, POLL_SECONDS))
    finally:
        pipes.close()
    return pipes.tail.decode("utf-8", "replace").strip()[-STDERR_TAIL:]


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
            try:
                proc.wait(max(wait, 0.0))
            except subprocess.TimeoutExpired:
                pass
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
