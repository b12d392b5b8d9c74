"""Cancel requests: what a canceller leaves in the backend for a handoff it cannot file itself,
and the engine's checks that honour one before a handoff runs. The daemon side (stopping a running
handler, carrying out cancellation messages) is :mod:`.cancellation`; cancelling a handoff and its
family is :mod:`.cancel_family`.

* A **running** handoff may belong to another process: the canceller records a cancel request in
  the backend (files: ``handoffs/.meta/cancel/<id>.json``, written atomically) with
  :func:`request`; :func:`requested` reads it back, :func:`describe` puts it in a line a document
  can hold, :func:`cascading` tells whether it asks for the descendants too.
* A pending handoff with a request is filed ``cancelled`` instead of being run
  (:func:`cancel_gate`), so a request also cancels the handoff if it comes back to pending/
  (recovered from a dead owner); a request that arrived while the handoff was being claimed is
  met just before its handler starts, and a child never starts whose parent, or an ancestor
  (:data:`MAX_ANCESTORS` steps up), carries a cascading request or was filed cancelled by a
  cascade (its filed block keeps the cascade: :func:`cascaded`) (:func:`check_before_run`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.documents import BOOK, Envelope, actor, book, book_int, check_id, is_safe_id
from ..core.engine import Verdict
from ..core.errors import ErrorCode, HandlerError, HandoffdError
from ..core.logs import log
from ..core.states import State
from ..core.timeutil import iso
from .lineage import parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine, Job


MAX_REASON = 1000  # characters of a cancellation's reason kept in the document
# steps up the parent_id chain a starting handoff looks for a cascade (delegation.MAX_DEPTH: no
# delegated family is deeper)
MAX_ANCESTORS = 16
# the key of the filed ``handoffd`` block that keeps the cascading request a cancel carried out
CASCADE_KEY = "cascade_cancel"


def request(engine: "Engine", handoff_id: str, *, reason: str, cascade: bool, by: str,
            via: str) -> None:
    """Ask whoever runs ``handoff_id`` to stop it (a cancel request in the backend)."""
    check_id(handoff_id)
    engine.backend.request_cancel(handoff_id, {
        "handoff_id": handoff_id, "reason": reason, "cascade": cascade, "requested_by": by,
        "via": via, "requested_at": iso(engine.clock()), "actor": actor()})


def describe(body: dict[str, Any] | None) -> str:
    """A cancel request in a line a document can hold: its reason and who asked."""
    reason, by = _request_texts(body or {})
    who = (body or {}).get("requested_by")
    return f"{reason} (by {by})" if isinstance(who, str) and who else reason


def requested(engine: "Engine", handoff_id: str) -> dict[str, Any] | None:
    """The cancel request recorded for ``handoff_id``, or None. Never raises: a store that
    cannot answer now is asked again by whoever looks next (a gate, the daemon's poll)."""
    try:
        body = engine.backend.cancel_request(handoff_id)
    except (HandoffdError, OSError) as exc:
        log.debug("handoff %s: cannot read its cancel request: %s", handoff_id, exc)
        return None
    return body if isinstance(body, dict) else None


def cascading(body: dict[str, Any] | None) -> bool:
    """True when the cancel request ``body`` asks for the descendants too."""
    return isinstance(body, dict) and body.get("cascade") is True


def _text(value: object, default: str, limit: int) -> str:
    """``value`` as text a document can hold (a request is read from the store: a lone
    surrogate there must not make every cancel it asks for fail its check), at most ``limit``
    characters."""
    text = value if isinstance(value, str) and value else default
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]


def _request_texts(body: dict[str, Any]) -> tuple[str, str]:
    """(reason, by) of a stored request, as text a document can hold."""
    reason = _text(body.get("reason"), "cancellation requested", MAX_REASON)
    return reason, _text(body.get("requested_by"), "@handoffd", 200)


# ---------------------------------------------------------------- engine hooks
def install_gate(engine: "Engine") -> None:
    """Put :func:`cancel_gate` first among ``engine``'s gates: what :mod:`.cancellation`'s
    install does for the gate, and all ``handoff ls`` installs of the feature to give a pending
    row its note (the rest of the feature, the family walk of :mod:`.cancel_family`, is not
    loaded then)."""
    engine.gates.insert(0, cancel_gate)


def cancel_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """A pending handoff with a cancel request is filed cancelled instead of being run."""
    body = engine.backend.cancel_request(env.handoff_id)
    if body is None:
        return None
    return Verdict.fail(ErrorCode.CANCELLED, f"handoff {env.handoff_id} cancelled: {describe(body)}")


def keep_cascade(doc: dict[str, Any], body: dict[str, Any]) -> None:
    """Keep the cascading request ``body`` that cancels ``doc`` in its ``handoffd`` block (the
    filing keeps the block): once the request itself is dropped, a child of the filed handoff
    still never starts (:func:`check_before_run`). Stamped with the handoff's retries: a
    `handoff retry` of it makes the record stale."""
    reason, by = _request_texts(body)
    book(doc)[CASCADE_KEY] = {"cascade": True, "reason": reason, "requested_by": by,
                              "retries": book_int(doc, "retries", 0)}


def cascaded(state: State, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The cascading request kept by a handoff filed cancelled by a cascade (``doc`` a trusted
    view, as ``Backend.get`` gives it: a block from outside never counts), else None."""
    if state is not State.FAILED:
        return None
    block = doc.get(BOOK)
    kept = block.get(CASCADE_KEY) if isinstance(block, dict) else None
    if not (isinstance(kept, dict) and cascading(kept)):
        return None
    # (a record kept by an attempt before a `handoff retry`: that filing is not this one)
    return kept if kept.get("retries") == book_int(doc, "retries", 0) else None


def check_before_run(engine: "Engine", job: "Job") -> None:
    """Before an attempt runs or resumes (the engine's first resumer): a request that arrived
    while the handoff was being claimed, or that the gates were not asked about (a parked
    parent claimed at its aggregation deadline), ends it CANCELLED; so does a cascade above it
    (:func:`cascade_above`: no read for a handoff without a parent)."""
    body = engine.backend.cancel_request(job.handoff_id)
    if body is not None:
        if cascading(body):
            keep_cascade(job.claim.doc, body)
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(body)}",
                           handoff_id=job.handoff_id, code=ErrorCode.CANCELLED, retryable=False)
    found = cascade_above(engine, job.handoff_id, job.claim.doc)
    if found is not None:
        above, ancestor = found
        keep_cascade(job.claim.doc, above)  # (a child of it, made by another producer, too)
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(above)} (cascaded "
                           f"from {ancestor})", handoff_id=job.handoff_id,
                           code=ErrorCode.CANCELLED, retryable=False)


def cascade_above(engine: "Engine", handoff_id: str,
                  doc: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """(the cascading request, the ancestor) of the nearest of ``doc``'s parent, grandparent...
    (at most MAX_ANCESTORS steps up its ``parent_id`` chain) that carries a cascading cancel
    request or was filed cancelled by a cascade; None when none does, or when the chain cannot
    be read further (the cascade's own walk reaches what this misses). A child made, or
    claimed, after the canceller walked its family must not start: a request stays until the
    family was walked again, and the canceller's walk may not have reached the parent yet (a
    cancelled grandparent) or has filed it already (its filed block keeps the cascade). Two
    reads a step; none for a handoff without a parent."""
    seen = {handoff_id}
    current = parent_of(doc)
    for _ in range(MAX_ANCESTORS):
        # (a parent_id loop, or one no file may be named after, that someone wrote)
        if current is None or current in seen or not is_safe_id(current):
            return None
        seen.add(current)
        body = requested(engine, current)
        if body is not None and cascading(body):
            return body, current
        try:
            found = engine.backend.get(current)
        except (HandoffdError, OSError) as exc:  # the walk of the cascade reaches it still
            log.debug("handoff %s: cannot read its ancestor %s: %s", handoff_id, current, exc)
            return None
        if found is None:
            return None
        kept = cascaded(*found)
        if kept is not None:
            return kept, current
        current = parent_of(found[1])
    return None
