"""CPython's cyclic garbage collector, set for a command-line process.

The collector runs a pass over the young objects every 700 net allocations and, as the
interpreter ends, full passes over every object still alive. Neither finds anything worth the
time in a one-shot command: nearly every object a ``handoff create`` allocates is made while
importing (classes, functions, compiled patterns) and lives until the process ends, which gives
the memory back whole. Measured (2026-11-28, CPython 3.11, ``handoff create``): 34 young and 3
middle passes (about 5 ms), and about 14 ms of full passes at the end: about 20 ms of the
command's 105 ms of CPU, where ``python -c pass`` takes 29 ms.

- :func:`for_a_command` raises the young generation's threshold, so a start makes a few passes
  instead of dozens: ``handoff``'s commands only, which handle little data. Collection stays
  on: a long one (``ls --watch``, ``wait``) still collects its cyclic garbage, in larger
  rounds. Not the daemon's (``handoffd``): a serving daemon whose handlers failed kept what
  each failed attempt left in a reference cycle (a traceback holding the attempt's frames, its
  document with them) until a young pass, and an idle one makes none: a review measured
  165-520 MB held at a threshold of 20,000 against about 50 MB at CPython's 700. Since session
  30 an attempt leaves no such cycle (its document is freed by reference counting as it ends:
  ``core/runner.py``, :meth:`~handoffd.core.jobs.Job.let_go`); the daemon keeps CPython's
  threshold all the same, for cycles a handler's own code makes.
- :func:`freeze_at_exit` moves every object alive into the collector's permanent generation as
  the command ends, so the interpreter's final passes skip them. Objects freed by reference
  counting are still freed, their finalizers run, as the modules are torn down; what is left
  uncollected is garbage held only in reference cycles, whose memory the process's end gives
  back. handoffd never relies on the collector to close a file or a store: its writes are closed
  (and made durable) by the code that makes them.
"""
from __future__ import annotations

import gc

# young objects allocated between two passes (CPython's default: 700); the middle and old
# generations keep their defaults (a pass of theirs every 10 young ones, and 10 middle ones)
YOUNG_THRESHOLD = 20_000


def for_a_command() -> None:
    """Make the collector's young passes rare (:data:`YOUNG_THRESHOLD`): called first thing by
    the ``handoff`` console script, before its imports."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def freeze_at_exit() -> None:
    """Keep the interpreter's final passes off every object alive now (see the module's
    docstring): called as a console script ends, whatever way it ends."""
    gc.freeze()
