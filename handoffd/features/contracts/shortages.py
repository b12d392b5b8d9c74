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
from ...core.logs import deferred

log = deferred("handoffd.contracts")


def wait_out(exc: BaseException, waits: int, what: str,
             cancelled: threading.Event | None) -> bool:
    """``what`` ran short (``exc``, a shortage), ``waits`` times before this one: wait
    (``results.RECHECK_SECONDS``, doubling, at most ``results.RECHECKS`` waits, as a result's
    checks do) and return True to try that step again. False once the waits are spent, or when
    ``cancelled`` is set before or during the wait (the attempt was stopped): then the check
    fails as it would without waiting."""
    if waits >= results.RECHECKS or (cancelled is not None and cancelled.is_set()):
        return False
    delay = results.RECHECK_SECONDS * 2 ** waits
    log.warning("%s for now: %s; tried again in %gs", what, shortage_words(exc),
                delay)
    if cancelled is None:
        threading.Event().wait(delay)
        return True
    return not cancelled.wait(delay)
