"""Lease renewal, and the fence that stops a handler before its lease can lapse.

A claim is a lease: once it lapses, another process (another host, with PostgreSQL) may recover
the handoff and run it. So a process must never run a handler past its own lease. Two threads
keep that promise for a daemon's jobs:

* the **renewer** extends every running job's lease each ``lease_seconds / 3``;
* the **guard** looks every ``min(1 s, lease / 10)`` at when each job's lease was last extended
  (the moment the successful renewal *started*, so the store's own clock can only be later), and
  stops the handler, its attempt handed back, once that is :data:`FENCE_FRACTION` of a lease ago.

With the files backend a third thread, the **lock check**, makes sure every ``min(0.5 s, lease
/ 10)`` that this process still holds the owner lock its claims ride on: a Python handler that
closes file descriptors it did not open (``os.closerange(3, …)``) drops it, and any other process
would then take our running claims for abandoned. The store takes a new lock at once (the next
claim checks too, with one ``fstat``); the jobs on the lost one are fenced like a lost lease,
since another process may have seen the lock free meanwhile. With PostgreSQL the same thread
asks whether this process's presence (the session holding the key its claims record) proved
alive recently enough: another host takes the claims of a key it has seen unheld for
``claim_grace_seconds`` over, leases or not, so they are all fenced once that is uncertain
(:class:`handoffd.backends.postgres.claims.ClaimOwner`).

A store that cannot be reached (a PostgreSQL outage longer than the lease) therefore ends this
process's handlers before any other process can recover them: two live hosts never run one
handoff at once. A renewal that finds the claim gone (recovered meanwhile) stops the handler at
once. The guard makes no store call, so a renewal that hangs cannot hold the fence back.

A fenced attempt ends as a retryable failure, counted by the retry policy: a daemon too busy to
renew in time (a 1 s lease, 40 workers, handlers holding the GIL) once handed the same handoffs
back uncounted, for ever. Its message says to raise ``lease_seconds``.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..core import recurring

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

log = logging.getLogger("handoffd")
FENCE_FRACTION = 0.8  # of a lease since the last renewal: past it, the handler is stopped
MIN_RENEW_SECONDS = 0.25  # (a lease is at least 1 s: renewals every 0.33 s at most)
RENEWERS = 8  # leases renewed at once
LOCK_CHECK_SECONDS = 0.5  # at most: how long a lost owner lock may go unnoticed without claims
LOST_LOCK_REASON = ("a handler closed the daemon's owner lock, so another process may take the "
                    "handoff over; the handler is stopped and its result will be discarded")


def broken_reason(backend: Any) -> str:
    """Why a job whose claim ``backend.broken_claims`` gave up is fenced: the backend's own
    ``broken_reason`` (PostgreSQL: its presence was lost), else a lost owner lock (files)."""
    reason = getattr(backend, "broken_reason", None)
    return reason if isinstance(reason, str) else LOST_LOCK_REASON


class LeaseKeeper:
    """Renews the leases of the jobs ``jobs()`` returns and fences those it cannot renew.

    ``fence(job, reason)`` stops a job's handler and hands its attempt back (the daemon's
    cancel path); it is called at most once per job."""

    def __init__(self, engine: Engine, jobs: Callable[[], list[Job]],
                 fence: Callable[[Job, str], None]) -> None:
        self.engine = engine
        self.jobs = jobs
        self.fence = fence
        self.lease = engine.settings.lease_seconds
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.pool: Any = None  # the renewals' threads, made when two jobs run at once
        self._flying: set[int] = set()  # id() of the jobs whose renewal is under way
        self._flying_lock = threading.Lock()
        # each step's book of recurring problems, kept past its thread: a batch's end asks
        # them what they still hold (core.recurring.batch_end)
        self.problems: list[recurring.Recurring] = []

    def start(self) -> None:
        """Start the renewer and the guard (daemon threads: they end with the process)."""
        self.stopped.clear()  # (a daemon may run several batches)
        self.threads, self.problems = [], []
        renew_every = max(self.lease / 3, MIN_RENEW_SECONDS)
        guard_every = min(1.0, self.lease / 10)
        steps: list[tuple[str, Callable[[], None], float]] = [
            ("handoffd-lease-renewer", self.renew_all, renew_every),
            ("handoffd-lease-guard", self.check, guard_every)]
        if callable(getattr(self.engine.backend, "broken_claims", None)):  # (files, PostgreSQL)
            # a thread of its own: a lock check that hangs (a hung NFS) holds back neither
            # the renewals nor the fence
            steps.append(("handoffd-lock-check", self.check_locks,
                          min(LOCK_CHECK_SECONDS, self.lease / 10)))
        for name, step, every in steps:
            thread = threading.Thread(target=self._every, args=(step, every), daemon=True,
                                      name=name)
            thread.start()
            self.threads.append(thread)

    def stop(self) -> None:
        """Stop both threads (after the daemon's last job has ended)."""
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=5)
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None

    def _every(self, step: Callable[[], None], seconds: float) -> None:
        """Run ``step`` every ``seconds``, counted from each round's start: a round that took
        long (a busy daemon, the GIL held by handlers) does not push the next one later."""
        next_at = time.monotonic() + seconds
        # a fault that lasts (no inode to rewrite a claim with, no descriptor for a new owner
        # lock) is said once a minute, not per job each round (core/recurring.py)
        problems = recurring.Recurring()
        self.problems.append(problems)
        while not self.stopped.wait(max(next_at - time.monotonic(), 0.0)):
            next_at = max(next_at + seconds, time.monotonic())
            try:
                with recurring.sweeping(problems, lambda: self.engine.clock().timestamp()):
                    step()
            except Exception:  # one bad round must not end the renewals or the fence
                log.exception("lease keeping failed; will try again")

    def renew_all(self) -> None:
        """Extend the lease of every running job, the longest unrenewed first, several at a
        time (one after another, 40 renewals of a busy daemon took longer than a 1 s lease);
        fence a job whose claim is gone. The round waits a renewal interval at most: a
        renewal still under way then (a row another session holds locked) is left to finish
        on its own and is not started again meanwhile, so it holds back no other job's."""
        jobs = sorted(self.jobs(), key=lambda j: j.renewed_at)
        if len(jobs) <= 1:
            for job in jobs:
                self.renew(job)
            return
        from concurrent.futures import ThreadPoolExecutor, wait
        if self.pool is None:
            self.pool = ThreadPoolExecutor(RENEWERS, thread_name_prefix="handoffd-lease")
        with self._flying_lock:
            due = [job for job in jobs if id(job) not in self._flying]
            self._flying.update(id(job) for job in due)
        wait([self.pool.submit(contextvars.copy_context().run, self._renew_once, job)
              for job in due],
             timeout=max(self.lease / 3, MIN_RENEW_SECONDS))

    def _renew_once(self, job: Job) -> None:
        """:meth:`renew`, then ``job`` may be renewed again."""
        try:
            self.renew(job)
        finally:
            with self._flying_lock:
                self._flying.discard(id(job))

    def renew(self, job: Job) -> None:
        """Extend ``job``'s lease; fence it when its claim is gone."""
        started = time.monotonic()
        try:
            kept = self.engine.backend.renew(job.claim, self.engine.clock(), self.lease)
        except Exception as exc:  # an unreachable store: the guard decides, not this
            recurring.error("renewing a lease", exc, "handoff %s: cannot renew its lease: %s",
                            job.handoff_id, exc)
            return
        recurring.ok("renewing a lease")
        if kept:
            job.renewed_at = max(job.renewed_at, started)
        elif not job.ending:  # (a renewal that met the filing is no takeover)
            self._fence(job, "its claim was recovered by another process; the handler is "
                             "stopped and its result will be discarded")

    def check(self) -> None:
        """Fence every running job whose lease was last extended too long ago."""
        limit = FENCE_FRACTION * self.lease
        now = time.monotonic()
        for job in self.jobs():
            if not job.ending and now - job.renewed_at > limit:
                self._fence(job, f"its lease could not be renewed for {now - job.renewed_at:.1f}s "
                                 f"(lease_seconds = {self.lease:g}); the handler is stopped before "
                                 "another process may take the handoff over")

    def check_locks(self) -> None:
        """Fence every running job whose claim rides on a lock this process no longer holds for
        sure (a handler closed its descriptor; the store has taken a new one, and logged it)."""
        broken_claims = getattr(self.engine.backend, "broken_claims", None)
        if broken_claims is None:
            return
        jobs = self.jobs()
        try:
            broken = broken_claims([job.claim for job in jobs])
        except OSError as exc:  # no new lock: every job on the old one is returned next time
            recurring.error("taking a new owner lock", exc,
                            "cannot take a new owner lock: %s; will try again", exc)
            return
        recurring.ok("taking a new owner lock")
        lost = {id(claim) for claim in broken}
        reason = broken_reason(self.engine.backend)
        for job in jobs:
            if id(job.claim) in lost and not job.ending:  # (one being filed: finish checks)
                self._fence(job, reason)

    def _fence(self, job: Job, reason: str) -> None:
        if job.fenced:
            return
        job.fenced = True
        log.warning("handoff %s: %s", job.handoff_id, reason)
        self.fence(job, reason)
