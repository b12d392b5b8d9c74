"""Notifications when work is filed (``[[on_filed]]`` in handoffd.toml).

Each rule names a command (an argument list, never a shell; the filed document on its stdin)
and/or a webhook (an HTTP POST of the filed document). A webhook is signed when the rule has a
secret: ``X-Handoffd-Signature: sha256=<hex HMAC-SHA256 of the body>``, beside
``X-Handoffd-Id`` and ``X-Handoffd-State``. A delivery that fails (a non-2xx answer, a command
that exits non-zero, a timeout) is tried again ``retries`` times with exponential backoff from
``retry_delay_seconds``; after the last try one line is appended to the dead-letter record
``handoffs/.meta/notify-dead-letters.jsonl`` and a warning is logged.

Nothing here blocks the daemon's workers: filing only queues the notice, one background thread
delivers, and a stopping daemon gives it a bounded time to finish (:data:`DRAIN_SECONDS`). Any
other process that files work (`handoff cancel`, an MCP server, a program using the client)
drains the same way when it exits, so its notices are delivered, retried or dead-lettered too,
and no command it started outlives it.
"""
from __future__ import annotations

import atexit
import hmac
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..core.config import NotifyRule
from ..core.errors import HandoffdError
from ..core.states import State
from ..core.timeutil import iso, utc_now

if TYPE_CHECKING:
    from ..core.engine import Engine

log = logging.getLogger("handoffd")
DRAIN_SECONDS = 10.0  # a stopping daemon waits at most this long for queued deliveries
QUEUE_LIMIT = 10_000  # notices beyond this are dead-lettered at once (a webhook that is down)
DEAD_LETTERS = "notify-dead-letters.jsonl"


def shown_url(url: str | None) -> str | None:
    """``url`` as logs and dead letters show it: a password in it is replaced by ``***``."""
    if not url or "@" not in url:
        return url
    from urllib.parse import urlsplit, urlunsplit
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an unparsable url)"
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rsplit('@', 1)[1]}"
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass
class Notice:
    """One delivery to make: a rule, and the filed handoff it is about."""

    rule: NotifyRule
    handoff_id: str
    state: State
    body: bytes


def install(engine: Engine) -> None:
    """The notify feature: only when handoffd.toml has ``[[on_filed]]`` rules."""
    if not engine.config.on_filed:
        return
    notifier = Notifier(engine)
    engine.on_filed.append(notifier.filed)
    engine.daemon_plugins.append(lambda daemon: daemon.add_stop_hook(notifier.drain))


class Notifier:
    """Queues a notice per matching rule when a handoff is filed; a thread delivers them."""

    def __init__(self, engine: Engine, *, sleep: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self.stopping = threading.Event()  # set by drain(): no more retries, no new command
        self.sleep = sleep or self.stopping.wait  # (a backoff that a drain cuts short)
        self.at_exit = False
        self.queue: queue.Queue[Notice] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen[bytes]] = set()  # commands being delivered to

    def filed(self, handoff_id: str, where: State) -> None:
        """``on_filed`` listener: queue the notices (never raises, never waits)."""
        if not where.terminal:
            return
        try:
            rules = self._matching(handoff_id, where)
            if not rules:
                return
            _, doc = self.engine.get(handoff_id)
            body = json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except (HandoffdError, OSError) as exc:
            log.warning("handoff %s: cannot prepare its notification: %s", handoff_id, exc)
            return
        if self.stopping.is_set() and not self.queue.unfinished_tasks:
            self.stopping.clear()  # an earlier drain is over: this engine files again
        for rule in rules:
            notice = Notice(rule, handoff_id, where, body)
            if self.queue.qsize() >= QUEUE_LIMIT:
                self._dead_letter(notice, "the notification queue is full")
                continue
            self.queue.put(notice)
        self._ensure_thread()

    def _matching(self, handoff_id: str, where: State) -> list[NotifyRule]:
        rules = [r for r in self.engine.config.on_filed if where.value in r.states]
        if any(r.agents for r in rules):
            agent = self._agent_of(handoff_id)
            rules = [r for r in rules if not r.agents or agent in r.agents]
        return rules

    def _agent_of(self, handoff_id: str) -> str | None:
        """The specialist the handoff was for (whatever its format)."""
        try:
            _, doc = self.engine.get(handoff_id)
            block = doc.get("handoffd")
            request = block.get("request_snapshot") if isinstance(block, dict) else None
            source = request if isinstance(request, dict) else doc
            env = self.engine.formats.detect(source).envelope(source)
        except Exception:  # an unreadable answer: it matches no agent filter
            return None
        spec = self.engine.specialist_for(env)
        return spec.agent if spec else env.target

    def _ensure_thread(self) -> None:
        with self.lock:
            if not self.at_exit:  # whatever process this is, it delivers before it exits
                atexit.register(self.drain)
                self.at_exit = True
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._deliver_all, daemon=True,
                                               name="handoffd-notify")
                self.thread.start()

    def _deliver_all(self) -> None:
        while True:
            try:
                notice = self.queue.get(timeout=1.0)
            except queue.Empty:
                return  # started again by the next notice
            try:
                self.deliver(notice)
            except Exception:  # a bug here must not kill the deliveries behind it
                log.exception("handoff %s: notification failed", notice.handoff_id)
            finally:
                self.queue.task_done()

    def deliver(self, notice: Notice) -> bool:
        """Make one delivery with its retries; True when every target of the rule took it."""
        targets: list[tuple[str, Callable[[Notice], str | None]]] = []
        if notice.rule.command:
            targets.append(("command", self._run_command))
        if notice.rule.url:
            targets.append(("webhook", self._post))
        ok = True
        for kind, send in targets:
            delay = notice.rule.retry_delay_seconds
            for attempt in range(notice.rule.retries + 1):
                problem = send(notice)
                if problem is None:
                    break
                if self.stopping.is_set():
                    self._dead_letter(notice, f"{kind}: {problem}; not tried again: the "
                                              "process that filed it stopped")
                    ok = False
                    break
                if attempt == notice.rule.retries:
                    self._dead_letter(notice, f"{kind}: {problem}")
                    ok = False
                    break
                self.sleep(delay)
                delay *= 2
        return ok

    def _run_command(self, notice: Notice) -> str | None:
        """Run the rule's command with the document on stdin, in a process group of its own:
        its stdout is discarded and only the tail of its stderr kept (a command writing without
        end once grew the daemon by hundreds of MB a second), and at its timeout, or when the
        daemon stops, the whole group is killed (a hanging one outlived the daemon)."""
        assert notice.rule.command is not None
        if self.stopping.is_set():
            return "not started: the process that filed it is stopping"
        env = {**os.environ, "HANDOFF_ID": notice.handoff_id, "HANDOFF_STATE": notice.state.value,
               "HANDOFFD_ROOT": str(self.engine.ws.root)}
        try:
            proc = subprocess.Popen(notice.rule.command, stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                    cwd=self.engine.ws.root, start_new_session=True)
        except OSError as exc:
            return f"{notice.rule.command[0]}: {exc}"
        with self.lock:
            self.running.add(proc)
        try:
            tail = _supervise(proc, notice.body, notice.rule.timeout_seconds)
        finally:
            with self.lock:
                self.running.discard(proc)
        if tail is None:
            return f"{notice.rule.command[0]}: timed out after {notice.rule.timeout_seconds:g}s"
        if proc.returncode != 0:
            return f"{notice.rule.command[0]} exited {proc.returncode}: {tail}"
        return None

    def kill_running(self) -> None:
        """Kill the process groups of the commands still running (the daemon is stopping)."""
        with self.lock:
            running = list(self.running)
        for proc in running:
            _kill_group(proc)

    def _post(self, notice: Notice) -> str | None:
        import hashlib
        assert notice.rule.url is not None
        headers = {"Content-Type": "application/json", "User-Agent": "handoffd",
                   "X-Handoffd-Id": notice.handoff_id, "X-Handoffd-State": notice.state.value}
        secret = notice.rule.secret or (os.environ.get(notice.rule.secret_env)
                                        if notice.rule.secret_env else None)
        if notice.rule.secret_env and not secret:  # never sent unsigned when a signature is asked
            return f"secret_env {notice.rule.secret_env} is not set: not sent unsigned"
        if secret:
            digest = hmac.new(secret.encode("utf-8"), notice.body, hashlib.sha256).hexdigest()
            headers["X-Handoffd-Signature"] = f"sha256={digest}"
        request = urllib.request.Request(notice.rule.url, data=notice.body, headers=headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=notice.rule.timeout_seconds) as answer:
                status = answer.status
        except urllib.error.HTTPError as exc:
            return f"{shown_url(notice.rule.url)} answered {exc.code}"
        except (OSError, ValueError) as exc:
            return f"{shown_url(notice.rule.url)}: {exc}"
        return None if 200 <= status < 300 else f"{shown_url(notice.rule.url)} answered {status}"

    def _dead_letter(self, notice: Notice, why: str) -> None:
        log.warning("handoff %s: notification given up: %s", notice.handoff_id, why)
        line = json.dumps({"at": iso(utc_now()), "id": notice.handoff_id,
                           "state": notice.state.value, "command": notice.rule.command,
                           "url": shown_url(notice.rule.url), "error": why}) + "\n"
        try:
            self.engine.ws.meta.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.engine.ws.meta / DEAD_LETTERS, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                         | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)  # a FIFO there: ENXIO, no wait
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot record the dead letter of %s: %s", notice.handoff_id, exc)

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """Deliver what is queued, for at most ``timeout`` seconds (a stopping daemon, or any
        process that filed work, at its exit); True when nothing was left. What is still
        undelivered then is dead-lettered, and a command still running is killed."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            self._ensure_thread()
            time.sleep(0.02)
        left = not self.queue.unfinished_tasks
        if not left:
            log.warning("%d notification(s) not delivered before the process stopped",
                        self.queue.unfinished_tasks)
        self.stopping.set()  # the delivery under way ends with a dead letter, not a retry
        self.kill_running()  # a command still running must not outlive the daemon
        settle = time.monotonic() + 2.0
        while self.thread is not None and self.thread.is_alive() and self.queue.unfinished_tasks \
                and time.monotonic() < settle:
            time.sleep(0.02)
        while True:  # what was never tried is recorded, as a failed delivery is
            try:
                notice = self.queue.get_nowait()
            except queue.Empty:
                break
            self._dead_letter(notice, "the process that filed it stopped before it was delivered")
            self.queue.task_done()
        return left


STDERR_TAIL = 200  # characters of a failing command's stderr kept in its dead letter


def _supervise(proc: "subprocess.Popen[bytes]", body: bytes, timeout: float) -> str | None:
    """Feed ``body`` to ``proc`` and wait at most ``timeout`` seconds, keeping only the tail of
    its stderr; the tail, or None (after killing its group) when time ran out."""
    import select

    def feed() -> None:
        try:
            assert proc.stdin is not None
            proc.stdin.write(body)
            proc.stdin.close()
        except OSError:  # it exited without reading, or was killed
            pass

    threading.Thread(target=feed, name="notify-stdin", daemon=True).start()
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    tail = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # stderr closed: the command is ending
                tail = (tail + chunk)[-4 * STDERR_TAIL:]
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None
    finally:
        proc.stderr.close()
    return tail.decode("utf-8", "replace").strip()[-STDERR_TAIL:]


def _kill_group(proc: "subprocess.Popen[bytes]") -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
