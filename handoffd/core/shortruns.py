"""A handoff's run of shortage hand-backs: one count, whichever kind each one was.

An attempt that a passing shortage (descriptors, processes, memory) stopped before its work was
done is handed back uncounted, due again after a back-off, in two places: its handler could not
be started, or fed its stdin (:mod:`handoffd.service.handbacks`), and its delegation's children
could not be planned or stored (:mod:`handoffd.features.orchestration`). Each is free only
while the run of such hand-backs at the end of the history is at most ``FREE_SHORTAGES`` long
(about half an hour of back-offs); each further one counts as a failed attempt, its error's
details carrying :data:`SHORTAGE_RUN`, so the retry policy bounds a shortage that never ends.
The run counts every kind: two counts, each ended by the other kind's hand-back, once let
alternating kinds hand a handoff back for ever, uncounted (80 alternating: counts 0 and 1).
"""
from __future__ import annotations

from typing import Any

from .documents import in_a_row

# the detail keys of a ``handed_back`` event for a shortage, each naming its errno (or THREADS,
# MemoryError): the handler was not started; it was stopped as its stdin could not be fed; its
# delegation's children could not be planned or stored
NOT_STARTED = "not_started"
STDIN_SHORT = "stdin_short"
CHILDREN_SHORT = "children_short"
SHORT_HANDBACKS = (NOT_STARTED, STDIN_SHORT, CHILDREN_SHORT)
# the key, in the details of a failed attempt's error, of a shortage counted past the free ones
SHORTAGE_RUN = "shortages_in_a_row"


def shortage_handback(entry: Any) -> bool:
    """Whether history ``entry`` handed an attempt back uncounted for a passing shortage, of
    any kind (see the module)."""
    detail = entry.get("detail") if isinstance(entry, dict) else None
    return isinstance(detail, dict) and entry.get("event") == "handed_back" and any(
        isinstance(detail.get(key), str) for key in SHORT_HANDBACKS)


def shortages_in_a_row(doc: dict[str, Any]) -> int:
    """How many attempts in a row, at the end of the handoff's history, a passing shortage
    ended: handed back uncounted (:func:`shortage_handback`, every kind) or counted past the
    free ones (a ``retry_scheduled`` whose error carries :data:`SHORTAGE_RUN`). Claims are
    skipped; any other event ends the run."""
    return in_a_row(doc, _shortage_ended)


def _shortage_ended(entry: dict[str, Any]) -> bool:
    """Whether history ``entry`` ended an attempt for a passing shortage (see
    :func:`shortages_in_a_row`)."""
    detail = entry.get("detail")
    error = detail.get("error") if isinstance(detail, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    counted = entry.get("event") == "retry_scheduled" and isinstance(details, dict) \
        and SHORTAGE_RUN in details
    return counted or shortage_handback(entry)
