"""What a drain costs a handoff in function calls: a count, where CPU times swing with load.

A shared machine's CPU times move by ±20% from one run to the next, which hides a change of a
few percent; the number of Python and C function calls a handoff takes does not (the same
code counts the same within a few calls: lease renewals and the loop's looks ahead follow the
clock). This drains ``--count`` seed-001 requests in this process (``handoffd run --processes 1
--workers 1``, durability ``fast``, the in-process no-op specialist of ``throughput.py``)
under a profiling hook on every thread, and prints the calls a handoff, by file and by
function. Start-up is counted too, spread over the handoffs: compare runs of one count.

Run ``.venv/bin/python benchmarks/calls.py [--count N] [--top N]``. Asserts nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import drop, workspace  # noqa: E402 (the same workspace and producer)

Key = tuple[str, str]


def count_drain(count: int) -> tuple[collections.Counter[Key], int]:
    """The calls of one drain of ``count`` handoffs, by (file or "C", function); and how many
    were filed into completed/."""
    root = workspace("fast")
    for n in range(count):
        drop(root, f"hoff-{n:06d}", False)
    sys.path.insert(0, str(root / "plug"))
    calls: collections.Counter[Key] = collections.Counter()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "c_call":
            calls[("C", getattr(arg, "__qualname__", repr(arg)))] += 1

    from handoffd.cli.handoffd_cmd import main
    sys.argv = ["handoffd", "run", "--root", str(root), "--processes", "1", "--workers", "1", "-q"]
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls, len(os.listdir(root / "handoffs" / "completed"))


def report(calls: collections.Counter[Key], count: int, top: int) -> None:
    """Print the totals a handoff, then the files and the functions that take the most."""
    python = sum(n for (where, _), n in calls.items() if where != "C")
    c_calls = sum(n for (where, _), n in calls.items() if where == "C")
    print(f"python calls a handoff  {python / count:8.1f}")
    print(f"C calls a handoff       {c_calls / count:8.1f}")
    by_file: collections.Counter[str] = collections.Counter()
    for (where, _), n in calls.items():
        if where != "C":
            by_file[where] += n
    print("\nby file (Python calls a handoff)")
    for where, n in by_file.most_common(top):
        print(f"  {n / count:7.1f}  {where}")
    print("\nby function (calls a handoff)")
    for (where, name), n in calls.most_common(top):
        print(f"  {n / count:7.1f}  {name}  ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="handoffs to drain (2000)")
    parser.add_argument("--top", type=int, default=25, help="rows of each table (25)")
    args = parser.parse_args()
    calls, done = count_drain(args.count)
    print(f"{done} of {args.count} handoffs completed")
    report(calls, args.count, args.top)


if __name__ == "__main__":
    main()
