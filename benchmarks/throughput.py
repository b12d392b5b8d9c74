"""End-to-end throughput: handoffs/s through a real daemon with an in-process no-op handler.

Prints figures; asserts nothing about speed (machines are shared and noisy). Run with
``make bench`` or ``python benchmarks/throughput.py [--count N]``.

Scenarios:
* drain:    N handoffs already pending, start the daemon, time until all are completed;
* live:     a producer creates N handoffs while the daemon runs (create -> completed);
* backlog:  drain rate with a 1x and a 5x backlog, to show claim cost does not grow with it.
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from handoffd import (
    Daemon,
    Engine,
    Registry,
    State,
    Workspace,
    build_engine,
    new_native_request,
)
from handoffd.core.config import Config, DaemonSettings


def noop(handoff: dict, ctx: object) -> dict:
    """The cheapest possible specialist."""
    return {"status": "completed", "output": {"ok": True}}


def make_engine(root: Path, durability: str, workers: int) -> Engine:
    ws = Workspace(root)
    ws.ensure()
    config = Config(daemon=DaemonSettings(durability=durability, workers=workers))
    registry = Registry()
    registry.add_function("@noop", noop, config=config, concurrency=workers)
    return build_engine(ws, config, registry)


def submit(engine: Engine, count: int, prefix: str) -> None:
    for i in range(count):
        doc = new_native_request(source="@bench", target="@noop", data={"i": i}, now=engine.clock(),
                                 handoff_id=f"{prefix}-{i:06d}")
        engine.backend.store.create(doc, doc["handoff_id"])


def completed(engine: Engine) -> int:
    return len(engine.backend.store.ids(State.COMPLETED))


def run_daemon(engine: Engine, count: int, producer: threading.Thread | None = None) -> float:
    daemon = Daemon(engine)
    ready = threading.Event()
    thread = threading.Thread(target=daemon.serve, kwargs={"install_signals": False, "ready": ready.set})
    start = time.perf_counter()
    thread.start()
    ready.wait()
    if producer:
        producer.start()
    done = threading.Event()
    daemon.on_filed = lambda hid, st: (completed_count.__setitem__(0, completed_count[0] + 1),
                                       completed_count[0] >= count and done.set())
    completed_count = [0]
    done.wait(timeout=600)
    elapsed = time.perf_counter() - start
    daemon.stop()
    thread.join()
    assert completed(engine) == count, (completed(engine), count)
    return elapsed


def scenario(name: str, count: int, durability: str, workers: int, live: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="handoffd-bench-", dir=".") as tmp:
        engine = make_engine(Path(tmp), durability, workers)
        if live:
            producer = threading.Thread(target=submit, args=(engine, count, "live"))
            elapsed = run_daemon(engine, count, producer)
        else:
            submit(engine, count, "drain")
            elapsed = run_daemon(engine, count)
    rate = count / elapsed
    print(f"{name:<34} {durability:<6} workers={workers}  {count:>6} handoffs in {elapsed:6.2f}s"
          f"  = {rate:7.0f} handoffs/s")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    n, w = args.count, args.workers
    scenario("drain (backlog, then daemon)", n, "fsync", w, live=False)
    scenario("live (producer + daemon)", n, "fsync", w, live=True)
    scenario("drain (backlog, then daemon)", n, "fast", w, live=False)
    small = scenario("backlog 1x", n, "fsync", w, live=False)
    large = scenario("backlog 5x", n * 5, "fsync", w, live=False)
    print(f"rate with a 5x backlog / rate with 1x: {large / small:.2f} (1.0 = claim cost independent of backlog)")


if __name__ == "__main__":
    main()
