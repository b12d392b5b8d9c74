"""handoffd's own speed figures, measured the way users meet them (``make bench``).

Prints figures and asserts nothing (machines are shared and noisy: read the ratios, each taken
in the same run on the same disk). The referee against Huey and kombu is ``../shared/bench/run``;
this benchmark reports the figures of the performance issue with the same request document:

  drain      a foreign producer drops N seed-001 requests into pending/ (temp file + rename),
             then ``handoffd run`` drains them with an in-process no-op specialist; against the
             bare filesystem floor (the same renames, reads and writes without a framework), for
             durability ``fast`` and ``fsync``
  backlog    the drain rate of a large backlog against that of N (claims must not slow down)
  pickup     ``handoffd serve`` running: a foreign rename into pending/ -> claimed, and
             ``handoff create`` -> claimed (p50 and p95, from the daemon's history timestamps)
  cli        wall time of ``handoff create``, ``show``, ``ls`` and ``wait`` against ``python -c pass``
  listing    ``handoff ls`` and ``show`` with a large number of finished documents
  memory     the serving daemon's RSS and open descriptors before and after many handoffs

Run ``.venv/bin/python benchmarks/throughput.py [--count N] [--backlog N] [--finished N]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
REQUEST = json.loads((HERE / "seed001-request.json").read_text())
TMP = Path(tempfile.mkdtemp(prefix="handoffd-bench-"))


def exe(name: str) -> str:
    """The project's console script next to this interpreter."""
    return str(BIN / name)


def fresh(name: str) -> Path:
    path = TMP / f"{name}-{time.monotonic_ns()}"
    path.mkdir()
    return path


def workspace(durability: str) -> Path:
    """A workspace whose @react-specialist is an in-process no-op."""
    root = fresh("ws")
    for state in ("pending", "in-progress", "completed", "failed"):
        (root / "handoffs" / state).mkdir(parents=True)
    (root / "plug").mkdir()
    (root / "plug" / "benchspec.py").write_text(
        "def noop(handoff, ctx=None):\n    return {'status': 'completed'}\n")
    # the request names schemas and a destination the no-op never writes: advisory, as the
    # referee's copy does
    (root / "handoffd.toml").write_text(
        f'[daemon]\ndurability = "{durability}"\nexpectations = "advisory"\n\n'
        '[specialists."@react-specialist"]\nhandler = "benchspec:noop"\n')
    return root


def env(root: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(root / "plug"))


def drop(root: Path, handoff_id: str, durable: bool) -> None:
    """What a foreign producer does: a temp file, then a rename into pending/."""
    tmp = root / f".{handoff_id}.tmp"
    with open(tmp, "w") as out:
        json.dump(dict(REQUEST, handoff_id=handoff_id), out)
        if durable:
            out.flush()
            os.fsync(out.fileno())
    os.rename(tmp, root / "handoffs" / "pending" / f"{handoff_id}.json")


# ------------------------------------------------------------------ drain and floor
def floor(count: int, durable: bool) -> float:
    """The bare minimum in Python for one handoff's trip, per second (the referee's floor)."""
    root = fresh("floor")
    for name in ("tmp", "pending", "in-progress", "completed"):
        (root / name).mkdir()

    def put(path: str, doc: dict, n: int) -> None:
        tmp = f"{root}/tmp/{n}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, json.dumps(doc).encode())
        if durable:
            os.fsync(fd)
        os.close(fd)
        os.rename(tmp, path)
    start = time.perf_counter()
    for i in range(count):
        put(f"{root}/pending/h-{i:06d}.json", dict(REQUEST, handoff_id=f"h-{i:06d}"), i)
    for name in os.listdir(f"{root}/pending"):
        claimed = f"{root}/in-progress/{name}"
        os.rename(f"{root}/pending/{name}", claimed)
        with open(claimed) as inp:
            doc = json.load(inp)
        doc["status"] = "completed"
        put(f"{root}/completed/{name}", doc, count + 1)
        os.unlink(claimed)
    return count / (time.perf_counter() - start)


def drain(count: int, durability: str) -> tuple[float, float]:
    """(end to end with the producer's drops, the drain alone), handoffs per second."""
    root = workspace(durability)
    start = time.perf_counter()
    for i in range(count):
        drop(root, f"h-{i:06d}", durability == "fsync")
    dropped = time.perf_counter()
    proc = subprocess.run([exe("handoffd"), "run", "--root", str(root), "-q"], env=env(root),
                          capture_output=True, text=True)
    end = time.perf_counter()
    done = len(os.listdir(root / "handoffs" / "completed"))
    if done != count:
        sys.exit(f"handoffd run completed {done} of {count} (exit {proc.returncode}): "
                 f"{proc.stderr[-400:]}")
    shutil.rmtree(root, ignore_errors=True)
    return count / (end - start), count / (end - dropped)


# ------------------------------------------------------------------ serving daemon
def serve(root: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([exe("handoffd"), "serve", "--root", str(root)], env=env(root),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline and not (root / "handoffs" / ".meta").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # its start-up sweep
    return proc


def wait_completed(root: Path, count: int, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and len(os.listdir(root / "handoffs" / "completed")) < count:
        time.sleep(0.02)


def claimed_after(root: Path, started: dict[str, float | None]) -> list[float]:
    """Milliseconds from each start time (None: the document's own "created" entry) to the
    daemon's "claimed" entry, sorted."""
    out = []
    for handoff_id, t0 in started.items():
        doc = json.loads((root / "handoffs" / "completed" / f"{handoff_id}.json").read_text())
        at = {e["event"]: datetime.fromisoformat(e["at"].replace("Z", "+00:00")).timestamp()
              for e in doc["handoffd"]["history"]}
        out.append((at["claimed"] - (at["created"] if t0 is None else t0)) * 1000)
    return sorted(out)


def pickup(count: int = 40) -> dict[str, float]:
    """Drop -> claimed and ``handoff create`` -> claimed, p50 and p95 in ms."""
    root = workspace("fsync")
    daemon = serve(root)
    try:
        dropped: dict[str, float | None] = {}
        for i in range(count):
            dropped[f"lat-{i:04d}"] = time.time()
            drop(root, f"lat-{i:04d}", False)
            time.sleep(0.05)
        created: dict[str, float | None] = {}
        for i in range(count // 2):
            handoff_id = f"cli-{i:04d}"
            subprocess.run([exe("handoff"), "create", "--root", str(root), "--to",
                            "@react-specialist", "--data", "{}", "--id", handoff_id],
                           check=True, capture_output=True)
            created[handoff_id] = None  # from the moment it wrote the document
        wait_completed(root, count + count // 2, 60)
    finally:
        daemon.terminate()
        daemon.wait(30)
    foreign, cli = claimed_after(root, dropped), claimed_after(root, created)
    p95 = lambda xs: xs[int(0.95 * (len(xs) - 1))]  # noqa: E731
    return {"drop_p50": statistics.median(foreign), "drop_p95": p95(foreign),
            "create_p50": statistics.median(cli), "create_p95": p95(cli)}


def memory(count: int, wave: int = 1000) -> dict[str, float]:
    """RSS (MB) and open descriptors of a serving daemon after a first wave of ``wave``
    handoffs and after ``count`` in all, fed in waves as producers feed a queue (a leak grows
    with every wave; the high-water mark of one big backlog is the allocator's, not a leak)."""
    root = workspace("fast")
    daemon = serve(root)

    def sample() -> tuple[float, int]:
        status = Path(f"/proc/{daemon.pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        return rss / 1024, len(os.listdir(f"/proc/{daemon.pid}/fd"))
    try:
        done = 0
        rss0 = fds0 = rss_half = 0.0
        while done < count:
            for i in range(done, min(done + wave, count)):
                drop(root, f"mem-{i:05d}", False)
            done = min(done + wave, count)
            wait_completed(root, done, 300)
            if done == wave:  # warm: imports, caches, thread pools and one wave's peak
                rss0, fds0 = sample()
            if done == count // 2:
                rss_half = sample()[0]
        rss1, fds1 = sample()
    finally:
        daemon.terminate()
        daemon.wait(30)
    return {"rss_start": rss0, "rss_half": rss_half, "rss_end": rss1, "fds_start": fds0,
            "fds_end": fds1}


# ------------------------------------------------------------------ command line
def wall(argv: list[str], runs: int = 10, **kw: object) -> float:
    """Median wall time of ``argv`` in ms."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, **kw)  # type: ignore[call-overload]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def cli() -> dict[str, float]:
    root = workspace("fsync")
    subprocess.run([exe("handoffd"), "run", "--root", str(root)], env=env(root), check=True,
                   capture_output=True)  # creates the workspace's files once
    done = "done-0001"
    drop(root, done, False)
    subprocess.run([exe("handoffd"), "run", "--root", str(root)], env=env(root), check=True,
                   capture_output=True)
    r = ["--root", str(root)]
    return {"python": wall([sys.executable, "-c", "pass"]),
            "create": wall([exe("handoff"), "create", *r, "--to", "@react-specialist",
                            "--data", "{}"]),
            "show": wall([exe("handoff"), "show", done, *r]),
            "ls": wall([exe("handoff"), "ls", *r]),
            "wait": wall([exe("handoff"), "wait", done, *r])}


def listing(finished: int) -> dict[str, float]:
    """``handoff ls`` and ``show`` (ms) with ``finished`` completed documents."""
    root = workspace("fast")
    drop(root, "one", False)
    subprocess.run([exe("handoffd"), "run", "--root", str(root)], env=env(root), check=True,
                   capture_output=True)
    template = (root / "handoffs" / "completed" / "one.json").read_text()
    folder = root / "handoffs" / "completed"
    for i in range(finished - 1):  # copies of a real filed document under new ids
        (folder / f"f-{i:06d}.json").write_text(template.replace('"one"', f'"f-{i:06d}"'))
    r = ["--root", str(root)]
    return {"ls": wall([exe("handoff"), "ls", *r], runs=3),
            "show": wall([exe("handoff"), "show", "f-000007", *r], runs=3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="handoffs per drain")
    parser.add_argument("--backlog", type=int, default=20000, help="the large backlog")
    parser.add_argument("--finished", type=int, default=100000, help="documents for listing")
    parser.add_argument("--memory", type=int, default=10000, help="handoffs for the memory figure")
    args = parser.parse_args()
    n = args.count
    try:
        fast_floor, fast = floor(n, False), drain(n, "fast")
        durable_floor, durable = floor(n, True), drain(n, "fsync")
        _, small = drain(1000, "fast")
        _, large = drain(args.backlog, "fast")
        up, c = pickup(), cli()
        mem = memory(args.memory)
        big = listing(args.finished)
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{n} seed-001 requests per drain (a foreign producer's drops, then `handoffd run`)")
    print(f"drain, fast     {fast[0]:7.0f}/s end to end = {fast[0] / fast_floor:.2f}x the floor "
          f"without fsync ({fast_floor:.0f}/s); the drain alone {fast[1]:.0f}/s")
    print(f"drain, fsync    {durable[0]:7.0f}/s end to end = {durable[0] / durable_floor:.2f}x the "
          f"durable floor ({durable_floor:.0f}/s); the drain alone {durable[1]:.0f}/s")
    print(f"backlog         {args.backlog} pending drain at {large:.0f}/s, 1000 at {small:.0f}/s: "
          f"ratio {large / small:.2f}")
    print(f"pick-up         foreign rename -> claimed p50 {up['drop_p50']:.1f} ms, p95 "
          f"{up['drop_p95']:.1f} ms; `handoff create` -> claimed p50 {up['create_p50']:.1f} ms, "
          f"p95 {up['create_p95']:.1f} ms (from its write; the command's start-up is under cli)")
    print("cli             " + ", ".join(
        f"{k} {c[k]:.0f} ms ({c[k] / c['python']:.1f}x)" for k in ("create", "show", "ls", "wait"))
        + f"; python -c pass {c['python']:.0f} ms")
    print(f"listing         {args.finished} finished: handoff ls {big['ls']:.0f} ms, "
          f"show {big['show']:.0f} ms")
    print(f"memory          serving daemon, {args.memory} handoffs in waves of 1000: RSS after the "
          f"first wave {mem['rss_start']:.1f}"
          f" -> {mem['rss_half']:.1f} halfway -> {mem['rss_end']:.1f} MB, open descriptors {mem['fds_start']:.0f} -> "
          f"{mem['fds_end']:.0f}")
    print(goals(fast[0] / fast_floor, durable[0] / durable_floor, large / small, up, c, big, mem))


def goals(fast: float, durable: float, backlog: float, up: dict[str, float],
          cli: dict[str, float], big: dict[str, float], mem: dict[str, float]) -> str:
    """One line: each goal of the performance issue that this benchmark measures, met or not
    (2x Huey is the referee's: ../shared/bench/run). Memory is reported as its growth."""
    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"
    ratios = [cli[k] / cli["python"] for k in ("create", "show", "ls", "wait")]
    growth = (mem["rss_end"] / mem["rss_start"] - 1) * 100 if mem["rss_start"] else 0.0
    return ("goals           "
            f"fast >= 0.5x floor {mark(fast >= 0.5)}; fsync >= 0.7x floor {mark(durable >= 0.7)}; "
            f"backlog >= 0.8 {mark(backlog >= 0.8)}; pick-up p50 <= 5 / p95 <= 20 ms "
            f"{mark(max(up['drop_p50'], up['create_p50']) <= 5 and max(up['drop_p95'], up['create_p95']) <= 20)}; "
            f"cli <= 4x {mark(max(ratios) <= 4)}; ls / show <= 1 s {mark(max(big.values()) <= 1000)}; "
            f"descriptors flat {mark(mem['fds_end'] <= mem['fds_start'])}; RSS {growth:+.1f}% "
            "(goal: flat)")


if __name__ == "__main__":
    main()
