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
  met just before its handler starts, and a child whose parent carries a cascading request never
  starts (:func:`check_before_run`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.documents import Envelope, actor, check_id
from ..core.engine import Verdict
from ..core.errors import ErrorCode, HandlerError, HandoffdError
from ..core.logs import log
from ..core.timeutil import iso
from .lineage import parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine, Job


MAX_REASON = 1000  # characters of a cancellation's reason kept in the document


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
def cancel_gate(engine: "Engine", env: Envelope, doc: dict[str, Any]) -> Verdict | None:
    """A pending handoff with a cancel request is filed cancelled instead of being run."""
    body = engine.backend.cancel_request(env.handoff_id)
    if body is None:
        return None
    return Verdict.fail(ErrorCode.CANCELLED, f"handoff {env.handoff_id} cancelled: {describe(body)}")


def check_before_run(engine: "Engine", job: "Job") -> None:
    """Before an attempt runs or resumes (the engine's first resumer): a request that arrived
    while the handoff was being claimed, or that the gates were not asked about (a parked
    parent claimed at its aggregation deadline), ends it CANCELLED; so does a cascading
    request of its parent (one read more per attempt)."""
    body = engine.backend.cancel_request(job.handoff_id)
    if body is not None:
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(body)}",
                           handoff_id=job.handoff_id, code=ErrorCode.CANCELLED, retryable=False)
    # a child made, or claimed, after its parent's cascading request was walked: the request
    # stays until the family is walked again, and the child must not start meanwhile
    parent = parent_of(job.claim.doc)
    above = requested(engine, parent) if parent is not None and parent != job.handoff_id else None
    if cascading(above):
        raise HandlerError(f"handoff {job.handoff_id} cancelled: {describe(above)} (cascaded "
                           f"from {parent})", handoff_id=job.handoff_id, code=ErrorCode.CANCELLED,
                           retryable=False)
