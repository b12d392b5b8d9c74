"""The gates that hold a parked handoff in pending/ (orchestration's): the requester gate (a
handoff waiting for its requester's answer, here: the rest of it is :mod:`.clarification`), the
children gate (a delegating parent waiting for its children, :mod:`.children_gate`) and
first_success's winners (the siblings of a child that won, :mod:`.first_success`).

:func:`handoffd.features.orchestration.install` installs them with the rest of orchestration;
``handoff ls`` installs them alone (:data:`handoffd.features.build.GATES`) to say why a pending
handoff waits. Neither these gates nor their modules load aggregation, child facts, answer
copies or the making of children until a parked parent is looked at: orchestration as a whole
is about 15 modules, most of them a daemon's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.documents import Envelope, book
from ..core.hooks import Verdict
from .children_gate import FinishedChildren
from .first_success import Winners

if TYPE_CHECKING:
    from ..core.engine import Engine

# how the requester gate's reason begins: what a daemon's quiet check knows its waits by
# (:func:`.clarification.attach`)
ASKING = "waiting on the requester ("


def install(engine: "Engine") -> Winners:
    """Put orchestration's gates first among ``engine``'s gates (the requester gate, the
    children gate with its memory of finished children, the winners' gate); the Winners,
    whose other hooks :func:`~handoffd.features.orchestration.install` adds."""
    winners = Winners(engine)
    engine.gates[0:0] = [requester_gate, FinishedChildren().gate, winners.gate]
    return winners


def requester_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """Hold a handoff parked by needs_clarification / blocked until it is answered."""
    awaiting = book(doc).get("awaiting") if isinstance(doc.get("handoffd"), dict) else None
    if not isinstance(awaiting, dict):
        return None
    kind = str(awaiting.get("kind", "needs_clarification")).replace("_", " ")
    items = awaiting.get("questions") or awaiting.get("blockers") or []
    items = items if isinstance(items, list) else [items]  # (bookkeeping is ours, but typed)
    first = items[0] if items else ""
    if isinstance(first, dict):
        first = first.get("description") or first.get("question") or first.get("text") or ""
    more = f" (+{len(items) - 1} more)" if len(items) > 1 else ""
    who = awaiting.get("requester") or "the requester"
    # no other handoff's filing ends it: the answer rewrites this document in pending/, which
    # wakes the daemon for it (the file watch, its own filing, or the next rescan)
    return Verdict.wait(f"{ASKING}{who}): {kind}: {str(first)[:100]}{more}; "
                        f"answer with `handoff answer {env.handoff_id} --data JSON`", on=())
