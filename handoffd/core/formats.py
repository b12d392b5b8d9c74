"""What the engine needs of a document format (the dialects implement it, in
:mod:`handoffd.dialects`): the :class:`Dialect` interface, the retry facts a failure answer may
show, and :class:`Formats`, the set of dialects an engine detects documents with."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Protocol

from .documents import SAFE_ID_RULE, Envelope, Outcome, is_safe_id
from .errors import ErrorCode, InvalidDocument

# Keeps the text of a large artifact (handoff id, index, text) where the workspace's agents can
# read it; returns its reference (a workspace-relative path), or None: the content goes inline.
# The artifacts feature installs one (``Engine.artifact_sink``); seed 000's 1 KB rule uses it.
ArtifactSink = Callable[[str, int, str], "str | None"]


@dataclass(frozen=True)
class FiledState:
    """Retry facts a dialect may print in a failure answer."""

    retry_count: int
    max_retries: int
    retry_available: bool


class Dialect(Protocol):
    """A document format. Implementations are stateless singletons."""

    name: str

    def matches(self, doc: dict[str, Any]) -> bool:
        """True when ``doc`` looks like this format (by ``$schema``/version fields or shape)."""
        ...

    def id_of(self, doc: dict[str, Any]) -> Any:
        """The handoff id the document carries (unchecked; may be missing or unsafe)."""
        ...

    def schema_names(self, doc: dict[str, Any]) -> list[str]:
        """Built-in schema file names an incoming document must satisfy."""
        ...

    def envelope(self, doc: dict[str, Any]) -> Envelope:
        """Routing view; raise InvalidDocument when it cannot be routed."""
        ...

    def complete(self, doc: dict[str, Any], handoff_id: str | None, now: datetime) -> None:
        """Fill in what the format defaults and the document left out (seed 003: ``handoff_id``
        and ``created_at``). ``handoff_id``: the id it is stored under (its file name), None
        for a new submission."""
        ...

    def mark_claimed(self, doc: dict[str, Any], now: datetime) -> None:
        """Update format fields when a daemon claims the document."""
        ...

    def mark_pending(self, doc: dict[str, Any]) -> None:
        """Update format fields when the document goes back to pending/ (retry, hand-back)."""
        ...

    def render(self, doc: dict[str, Any], outcome: Outcome, filed: FiledState, *,
               artifacts: ArtifactSink | None = None) -> dict[str, Any]:
        """The answer document filed in completed/ or failed/, in this format. ``artifacts``
        keeps large artifact contents out of the answer (seed 000's 1 KB rule); None: inline.

        Optional extras a dialect may define: ``is_answer(doc) -> bool`` (the document is an answer
        this dialect renders, validated against its answer schema and not routable by itself),
        ``refuse_unclaimed(doc, handoff_id)`` (raise InvalidDocument when a pending document its
        claim would refuse whatever its target, such as a seed-001 answer, has no specialist
        here: asked by :meth:`Engine.peek <handoffd.core.engine.Engine.peek>` then, as nothing
        would claim it), ``answered_id(doc)`` (the id of the request an answer answers, when
        the answer carries one besides its own id, as a hi_moe Outcome's ``correlation_id``:
        see :func:`id_refusal`) and ``review(doc, outcome, root) -> Outcome`` (check a result
        before it may complete; called by the engine's ``after_run`` hook
        :func:`handoffd.dialects.review_outcome`)."""
        ...


def answer_refusal(dialect: Dialect, doc: dict[str, Any]) -> InvalidDocument | None:
    """The NOT_A_REQUEST refusal of ``doc`` when ``dialect`` calls it an answer (``is_answer``)
    that its :meth:`~Dialect.envelope` refuses to read as work; None otherwise (a request, or
    an answer that carries the request it answers, such as a filed one retried).

    The envelope decides, as it does for :meth:`Engine.peek <handoffd.core.engine.Engine.peek>`
    and so for `handoff ls`: admission asks here before the schema check, so that an answer
    is refused as one whatever its answer schema says of it. Checked first, a swarm completion
    report without ``status`` (seed 004's report has none) or a seed-001 Response that broke
    its schema was filed SCHEMA_VALIDATION_FAILED while `ls` said NOT_A_REQUEST. Any other
    refusal of the envelope is left to the schema check, which lists every error."""
    is_answer = getattr(dialect, "is_answer", None)
    if is_answer is None or not is_answer(doc):
        return None
    try:
        dialect.envelope(doc)
    except InvalidDocument as exc:
        return exc if exc.code == ErrorCode.NOT_A_REQUEST else None
    return None


def id_refusal(dialect: Dialect, doc: dict[str, Any], handoff_id: str) -> InvalidDocument | None:
    """How ``doc``, pending as ``handoff_id``, is refused for the id it carries; None when that
    id is its file name (one string compare: all the usual document pays).

    Asked first, in this order, by admission (``_envelope``) and by :meth:`Engine.peek
    <handoffd.core.engine.Engine.peek>`, so that `handoff ls` notes what the daemon files: an
    id that is no safe file name is set aside ID_MISMATCH before anything else is read (its
    message gives the rule UNSAFE_ID gives); an answer to the request the file is named after
    (its dialect's ``answered_id``: a hi_moe Outcome's ``correlation_id``) is refused
    NOT_A_REQUEST (:func:`answer_refusal`: a filed answer copied from another workspace keeps
    its request's file name but carries its own id); any other id is set aside ID_MISMATCH.

    Only such an answer is filed under its file name: seed 001 files ``failed/{request id}``,
    and a seed-001, HAIOS or swarm answer carries its request's id as its own, so one whose id
    is not its file name answers another request (the sender's, perhaps a live handoff here);
    filed as failed/X.json holding ``Y``, a reader keying on content blamed Y."""
    doc_id = dialect.id_of(doc)
    if doc_id == handoff_id:
        return None
    shown = f"file pending/{handoff_id}.json carries handoff id {str(doc_id)[:80]!r}"
    if not is_safe_id(doc_id):  # the code the daemon has always filed, with what UNSAFE_ID said
        return InvalidDocument(f"{shown}, which is not a safe file name ({SAFE_ID_RULE}); the "
                               "file name must be the id", handoff_id=handoff_id,
                               code=ErrorCode.ID_MISMATCH)
    answered = getattr(dialect, "answered_id", None)
    refusal = answer_refusal(dialect, doc) \
        if answered is not None and answered(doc) == handoff_id else None
    return refusal or InvalidDocument(f"{shown}; the file name must be the id",
                                      handoff_id=handoff_id, code=ErrorCode.ID_MISMATCH)


class Formats(Protocol):
    """The dialects an engine speaks (``handoffd.dialects`` itself is one, as a module)."""

    def detect(self, doc: dict[str, Any], forced: str | None = None) -> Dialect:
        """The dialect ``doc`` is written in; InvalidDocument (UNKNOWN_FORMAT) when none."""
        ...

    def by_name(self, name: str) -> Dialect:
        """The dialect called ``name``; KeyError when there is none."""
        ...
