"""What the engine needs of a document format (the dialects implement it, in
:mod:`handoffd.dialects`): the :class:`Dialect` interface, the retry facts a failure answer may
show, and :class:`Formats`, the set of dialects an engine detects documents with."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Protocol

from .documents import Envelope, Outcome
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
        would claim it) and ``review(doc, outcome, root) -> Outcome`` (check a result before it
        may complete; called by the engine's ``after_run`` hook
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


class Formats(Protocol):
    """The dialects an engine speaks (``handoffd.dialects`` itself is one, as a module)."""

    def detect(self, doc: dict[str, Any], forced: str | None = None) -> Dialect:
        """The dialect ``doc`` is written in; InvalidDocument (UNKNOWN_FORMAT) when none."""
        ...

    def by_name(self, name: str) -> Dialect:
        """The dialect called ``name``; KeyError when there is none."""
        ...
