"""Waiting out a passing shortage (descriptors, memory) inside a contract check, locally.

A check that runs short (a criterion's command cannot start: EMFILE; a folder of the tree cannot
be opened; git cannot start) is no fault of the work's. Only the step that ran short is done
again after a wait, never the whole review: the criteria already run would run again and their
changes be judged as the handler's, and the learning log be written twice.
"""
from __future__ import annotations

import threading

from ...core import results
from ...core.errors import shortage_words


def wait_out(exc: BaseException, waits: int, what: str,
             cancelled: threading.Event | None) -> bool:
    """``what`` ran short (``exc``, a shortage), ``waits`` times before this one: wait as a
    result's checks do (:func:`~handoffd.core.results.wait_short`) and return True to try that
    step again. False once the waits are spent, or when ``cancelled`` is set before or during
    the wait (the attempt was stopped): then the check fails as it would without waiting."""
    return results.wait_short(waits, cancelled if cancelled is not None else threading.Event(),
                              lambda delay: f"{what} for now: {shortage_words(exc)}; tried "
                              f"again in {delay:g}s")
