"""Drain rate with 1, 2 and 4 daemons: the files store (one shared workspace) against PostgreSQL
(one workspace per daemon, as separate hosts would have), in one run.

Each daemon is a real ``handoffd serve`` process with a no-op Python specialist; N handoffs are
pending before the daemons start, and the clock runs from the first daemon's start to the last
handoff filed (daemon start-up included). Prints figures; asserts nothing about speed.

    python benchmarks/scaling.py [--count N] [--workers W] [--store postgresql://...]

Without ``--store`` it starts a throw-away PostgreSQL cluster (tests/pgserver.py) for the run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

NOOP = '''def handle(handoff, ctx):
    return {"status": "completed", "output": {"ok": True}}
'''
TOML = """
[daemon]
workers = {workers}
durability = "fast"

[specialists."@noop"]
handler = "bench_noop:handle"
concurrency = {workers}
{store}
"""


def exe(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def fill(root: Path, count: int) -> None:
    """``count`` pending handoffs in the store ``root``'s configuration names."""
    from handoffd import Workspace, build_engine, new_native_request
    ws = Workspace(root)
    ws.ensure()
    engine = build_engine(ws, features=())
    try:
        now = engine.clock()
        for i in range(count):
            doc = new_native_request(source="@bench", target="@noop", data={"i": i}, now=now,
                                     handoff_id=f"b-{i:06d}")
            engine.backend.create(doc, doc["handoff_id"], now)
    finally:
        engine.backend.close()


def counter(root: Path) -> tuple[Callable[[], int], Callable[[], None]]:
    """A function counting the completed handoffs of the store ``root`` names, and its close."""
    from handoffd import State, Workspace
    from handoffd.features.build import open_backend
    ws = Workspace(root)
    backend = open_backend(ws, ws.load_config())
    return (lambda: len(backend.ids(State.COMPLETED))), backend.close


def drain(kind: str, daemons: int, count: int, workers: int, url: str | None) -> float:
    """Seconds for ``daemons`` daemons to drain ``count`` handoffs on ``kind``."""
    with tempfile.TemporaryDirectory(prefix="handoffd-scale-") as tmp:
        base = Path(tmp)
        (base / "bench_noop.py").write_text(NOOP)
        roots = [base / f"ws{i}" for i in range(daemons if kind == "postgres" else 1)]
        store = f'[store]\nurl = "{url}"' if kind == "postgres" else ""
        for root in roots:
            (root / "handoffs").mkdir(parents=True)
            (root / "handoffd.toml").write_text(TOML.format(workers=workers, store=store))
        if kind == "postgres":
            from handoffd.backends.postgres import PostgresBackend
            probe = PostgresBackend(url or "")
            probe.db.run(lambda conn, _: conn.execute(
                "TRUNCATE handoffd.handoffs, handoffd.events, handoffd.seen"))
            probe.close()
        fill(roots[0], count)
        env = dict(os.environ, PYTHONPATH=str(base))
        filed, close = counter(roots[0])
        start = time.perf_counter()
        procs = [subprocess.Popen([exe("handoffd"), "serve", "--root", str(roots[i % len(roots)])],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for i in range(daemons)]
        try:
            deadline = time.monotonic() + 600
            while filed() < count and time.monotonic() < deadline:
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        finally:
            close()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--store", help="a PostgreSQL URL (default: a throw-away cluster)")
    args = parser.parse_args()
    server = None
    url = args.store
    if url is None:
        import pgserver
        started = pgserver.start()
        if isinstance(started, str):
            sys.exit(started)
        server, url = started, started.new_database()
    try:
        print(f"{args.count} handoffs, {args.workers} workers per daemon, no-op Python specialist")
        print(f"{'daemons':>7}  {'files (one workspace)':>22}  {'postgresql':>12}")
        for daemons in (1, 2, 4):
            rates = [args.count / drain(kind, daemons, args.count, args.workers, url)
                     for kind in ("files", "postgres")]
            print(f"{daemons:>7}  {rates[0]:>18.0f} h/s  {rates[1]:>8.0f} h/s", flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
