"""The daemon's worker threads: a pool that never runs short because a handler hangs.

A worker calls Python handlers itself (:mod:`handoffd.core.watchdog`). When one overruns, the
watchdog ends its attempt on time and the daemon counts the slot free again, but the thread is
still inside the handler until it returns, if ever. A fixed pool would then lose a thread for
each hung handler and, once all hung, stop. Here a task that finds no idle thread starts a new
one, so the daemon's own limit (``running < workers``) is the only bound on work in progress;
threads beyond ``keep`` that fall idle end. The threads are daemon threads: a handler that never
returns does not keep the process from exiting, as its own thread did before.
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("handoffd")
Task = tuple[Callable[..., Any], tuple[Any, ...]]


class WorkerPool:
    """Runs submitted calls on daemon threads, starting one whenever none is idle."""

    def __init__(self, keep: int, name: str = "handoffd-worker") -> None:
        self.keep = keep  # idle threads kept for the next task; more end when they fall idle
        self.name = name
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, func: Callable[..., Any], *args: Any) -> None:
        """Run ``func(*args)`` on an idle thread, or on a new one (RuntimeError once shut down).
        When no thread can be started (the process or thread limit: ``ulimit -u``, a cgroup's
        ``pids.max``), OSError EAGAIN, and the task is not queued: the caller gives its slot
        back and looks again later. (It once stayed queued for the next thread to fall idle,
        to run beside tasks dispatched into the slot it gave back.)"""
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            if self._idle:
                self._idle -= 1  # one idle thread is taken by this task
                self._tasks.put((func, args))
                return
            self._started += 1
            number = self._started
        try:
            threading.Thread(target=self._serve, name=f"{self.name}_{number}", daemon=True).start()
        except BaseException as exc:
            with self._lock:
                self._started -= 1
            if isinstance(exc, RuntimeError):  # "can't start new thread"
                raise OSError(errno.EAGAIN, f"cannot start a worker thread ({exc})") from None
            raise
        self._tasks.put((func, args))  # (the new thread, or any that fell idle since, takes it)

    def shutdown(self) -> None:
        """Take no more tasks; idle threads end, busy ones when their task returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._tasks.put(None)

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            func, args = task
            try:
                func(*args)
            except BaseException:  # the daemon's tasks catch their own; this thread still ends well
                log.exception("a worker's task failed")
            with self._lock:
                if self._closed or self._idle >= self.keep:
                    return
                self._idle += 1
