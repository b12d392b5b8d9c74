"""Rate limits: ``rate = "30/m"`` on a specialist caps how often its handoffs start.

A token bucket per specialist holds up to ``count`` tokens and gains ``count`` every ``seconds``
(evenly); each start takes one, and a start that finds none waits until the next one is due.
The bucket lives in the workspace (``handoffs/.meta/rates/<agent>.json``, read and written under
an exclusive ``flock``), so every daemon and batch of the workspace draws from the same one. A
full bucket lets a burst of ``count`` start at once; after that starts are spaced evenly.

Rate limits decide when a handoff may *start*: a limited handoff stays pending (in its place by
priority) and is looked at again when the next token is due. Retries start under the same limit;
``concurrency`` still caps how many run at once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..core.config import Rate
from ..core.workspace import Workspace

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..core.specialists import Specialist

MAX_NAME = 120


class Buckets:
    """The workspace's token buckets (one file each)."""

    def __init__(self, ws: Workspace) -> None:
        self.folder = ws.meta / "rates"

    def path(self, agent: str) -> Path:
        """The bucket file of ``agent`` (a safe file name whatever the agent id)."""
        name = quote(agent, safe="@-_.")
        if len(name) > MAX_NAME or name.startswith("."):
            name = "h-" + hashlib.sha256(agent.encode()).hexdigest()[:32]
        return self.folder / f"{name}.json"

    def take(self, agent: str, rate: Rate, now: datetime) -> float:
        """Take a token for one start of ``agent``: 0.0 when it may start now (the token is
        taken), else the seconds until the next token is due (nothing is taken)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path(agent), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a write: microseconds
            tokens, at = _load(os.pread(fd, 4096, 0), rate)
            stamp = now.timestamp()
            per_second = rate.count / rate.seconds
            # a clock that stepped back refills nothing (never more than the full bucket)
            tokens = min(float(rate.count), tokens + max(stamp - at, 0.0) * per_second)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / per_second
            if wait == 0.0:
                tokens -= 1.0
            data = json.dumps({"tokens": tokens, "at": stamp, "rate": str(rate)}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            return wait
        finally:
            os.close(fd)


def _load(raw: bytes, rate: Rate) -> tuple[float, float]:
    """(tokens, when) from a bucket file; a new or unreadable one is full."""
    try:
        state = json.loads(raw)
        tokens, at = float(state["tokens"]), float(state["at"])
    except (ValueError, KeyError, TypeError):
        return float(rate.count), 0.0
    if not (tokens == tokens and at == at) or tokens > rate.count:  # nan, or another rate's
        return float(rate.count), 0.0
    return max(tokens, -float(rate.count)), at


def install(engine: Engine) -> None:
    """The rates feature: a start limit for each specialist with a ``rate``."""
    buckets = Buckets(engine.ws)

    def limit(spec: Specialist, now: datetime) -> float:
        rate = spec.config.rate
        return 0.0 if rate is None else buckets.take(spec.agent, rate, now)

    engine.start_limits.append(limit)
