"""Creating a handoff (:func:`submit`, behind :meth:`Engine.submit
<handoffd.core.engine.Engine.submit>`), and a request apart from the queue's marks on it: whether
a stored handoff was made from the same request (``if_absent``, ``handoff create --if-absent``),
and a document without its ``handoffd`` bookkeeping block (what formats and handlers see).
:class:`Submitter` creates handoffs without an Engine, for a command that only creates one."""
from __future__ import annotations

from contextlib import ExitStack, nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

from .documents import BOOK, check_request_depth
from .errors import Conflict, DuplicateHandoff, InvalidDocument
from .formats import Dialect, Formats
from .storage import Backend
from .timeutil import Clock

if TYPE_CHECKING:
    from .documents import Envelope
    from .validation import SchemaCache
    from .workspace import Workspace

# when a request was sent, and the queue's marks on it: not part of what it asks
SENT_KEYS = frozenset({BOOK, "status", "timestamp", "created_at", "started_at"})
# what a seed 001 handoff gains in place on its way (its answer is the request document itself)
NATIVE_LIFECYCLE_KEYS = SENT_KEYS | frozenset({
    "completed_at", "failed_at", "timestamp_completed", "timestamp_failed",
    "execution_time_seconds", "output", "artifacts", "validation", "metadata", "next_steps",
    "warnings", "errors", "error", "retry_count", "retry_available", "max_retries",
    "recovery_actions"})


if TYPE_CHECKING:  # for the type checker only: no class to build at each import
    class SubmitHooks(Protocol):
        """The hook lists submitting runs (:class:`~handoffd.core.hooks.Hooks` has them)."""

        @property
        def submit_checks(self) -> list[Callable[[Any, Envelope], None]]: ...

        @property
        def submit_guards(self) -> list[Callable[[Any, Envelope], ContextManager[Any]]]: ...

    class Submitting(Protocol):
        """What submitting uses of an :class:`~handoffd.core.engine.Engine` (named here, not
        imported: engine.py imports this module)."""

        backend: Backend
        formats: Formats
        clock: Clock

        @property
        def hooks(self) -> SubmitHooks: ...

        def validate(self, doc: dict[str, Any], dialect: Dialect, *, subject: str | None = None,
                     handoff_id: str | None = None) -> None: ...


class Submitter:
    """Creates handoffs without an Engine: a store, the formats and a clock.

    ``handoff create --to`` writes one document; importing the engine's run-time for it (jobs,
    hooks, admission, filing, specialists) was about a tenth of the command's start. Its
    :meth:`submit` is :meth:`Engine.submit <handoffd.core.engine.Engine.submit>`'s with no
    feature installed, so it refuses a document that names dependencies: their checks (each
    exists, no cycle, the removal lock) are the dependencies feature's, which needs an Engine."""

    def __init__(self, workspace: Workspace, backend: Backend, formats: Formats,
                 clock: Clock) -> None:
        self.ws = workspace
        self.backend = backend
        self.formats = formats
        self.clock = clock
        self.submit_checks: list[Callable[[Any, Envelope], None]] = []
        self.submit_guards: list[Callable[[Any, Envelope], ContextManager[Any]]] = [
            self._no_dependencies]
        self.hooks: SubmitHooks = self  # the two lists above are all the hooks it runs
        self._schemas: SchemaCache | None = None

    def _no_dependencies(self, _submitter: Any, envelope: Envelope) -> ContextManager[None]:
        """Refuse a document naming dependencies (see the class); a no-op context otherwise."""
        if envelope.depends_on:
            raise InvalidDocument("a handoff with dependencies is created through an Engine "
                                  "with the dependencies feature", handoff_id=envelope.handoff_id)
        return nullcontext()

    def validate(self, doc: dict[str, Any], dialect: Dialect, *, subject: str | None = None,
                 handoff_id: str | None = None) -> None:
        """:meth:`Engine.validate <handoffd.core.engine.Engine.validate>`: the schemas of
        ``doc``'s format, this workspace's first (loaded at the first document that needs it)."""
        from .validation import SchemaCache, check_document
        if self._schemas is None:
            self._schemas = SchemaCache(self.ws.schemas)
        check_document(self._schemas, dialect, doc, subject=subject, handoff_id=handoff_id)

    def submit(self, doc: dict[str, Any] | Any, *, forced: str | None = None,
               prechecked: bool = False, if_absent: bool = False,
               due_at: datetime | None = None) -> str:
        """Create a handoff as :meth:`Engine.submit <handoffd.core.engine.Engine.submit>` does;
        its id."""
        return submit(self, doc, forced=forced, prechecked=prechecked, if_absent=if_absent,
                      due_at=due_at)


def submit(engine: Submitting, doc: dict[str, Any] | Any, *, forced: str | None = None,
           prechecked: bool = False, if_absent: bool = False,
           due_at: datetime | None = None) -> str:
    """Store ``doc`` as a new pending handoff once every check passed; its id. The options are
    :meth:`Engine.submit <handoffd.core.engine.Engine.submit>`'s."""
    if not isinstance(doc, dict) and callable(getattr(doc, "to_dict", None)):
        doc = doc.to_dict()
    if not isinstance(doc, dict):
        raise InvalidDocument(f"a handoff is a JSON object, not {type(doc).__name__}")
    dialect = engine.formats.detect(doc, forced)
    dialect.complete(doc, None, engine.clock())
    if not (prechecked and dialect.name == "native"):
        engine.validate(doc, dialect)
        # (refused now, not at its claim: what is filed for it could not be read back)
        check_request_depth(doc, None, "the document")
    envelope = dialect.envelope(doc)
    if if_absent and already_submitted(engine.backend, doc, dialect.name, envelope.handoff_id):
        return envelope.handoff_id
    with ExitStack() as guarded:  # (dependencies: the removal lock, for a create naming some)
        for guard in engine.hooks.submit_guards:
            guarded.enter_context(guard(engine, envelope))
        for check in engine.hooks.submit_checks:
            check(engine, envelope)
        _create(engine, doc, envelope.handoff_id, dialect.name, if_absent, due_at)
    return envelope.handoff_id


def _create(engine: Submitting, doc: dict[str, Any], handoff_id: str, dialect: str,
            if_absent: bool, due_at: datetime | None) -> None:
    """Store the checked ``doc``; an id taken meanwhile by the same request is no error when
    ``if_absent``."""
    try:
        engine.backend.create(doc, handoff_id, engine.clock(), due_at=due_at)
    except DuplicateHandoff:
        if if_absent and already_submitted(engine.backend, doc, dialect, handoff_id):
            return  # the same request won a race with this one
        if if_absent:  # (a submit guard may still find it: retention's archive)
            raise RequestGone(f"handoff id {handoff_id} was used recently and its "
                              "request is gone, so it cannot be compared; choose another id",
                              doc, dialect, handoff_id=handoff_id) from None
        raise


def already_submitted(backend: Backend, doc: dict[str, Any], dialect: str,
                      handoff_id: str) -> bool:
    """True when ``handoff_id`` holds the same request as ``doc`` (of format ``dialect``);
    Conflict when it holds a different one; False when nothing holds it."""
    found = backend.get(handoff_id)
    if found is None:
        return False
    if same_request(found[1], doc, dialect):
        return True
    raise Conflict(f"handoff {handoff_id} already exists ({found[0].value}) with a different "
                   "request; `handoff show` it, or choose another id", handoff_id=handoff_id)


class RequestGone(Conflict):
    """``if_absent``: the store refuses the id (used within its dedup window) but holds no
    document to compare ``doc`` (of format ``dialect``) with. A submit guard (entered around
    the store) may settle it where the request is still kept: the core knows no archive, and
    :mod:`handoffd.features.build` gives each Engine and Submitter a guard that compares with
    the copy retention archived (exit 5 "its request is gone" was the answer for a handoff
    that ``handoff show`` found there). Unsettled, it is the Conflict it says (exit 5)."""

    def __init__(self, message: str, doc: dict[str, Any], dialect: str, *,
                 handoff_id: str | None = None) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.doc = doc
        self.dialect = dialect


def same_request(stored: dict[str, Any], submitted: dict[str, Any], dialect: str) -> bool:
    """Whether a stored handoff (pending, running or filed) was made from the ``submitted``
    request: the request as first stored (a filed answer's ``request_snapshot`` when the format
    answers with a new document), without what its lifecycle added. A ``conversation_id`` the
    queue gave a delegating parent is ignored when the submission has none."""
    block = stored.get(BOOK)
    snapshot = block.get("request_snapshot") if isinstance(block, dict) else None
    original = snapshot if isinstance(snapshot, dict) else stored
    ignored = NATIVE_LIFECYCLE_KEYS if dialect == "native" else SENT_KEYS
    if "conversation_id" not in submitted:
        ignored = ignored | {"conversation_id"}
    return _asked(original, ignored) == _asked(submitted, ignored)


def _asked(doc: dict[str, Any], ignored: frozenset[str]) -> dict[str, Any]:
    """``doc`` without ``ignored`` keys, nor the answers ``handoff answer`` added to a seed 001
    request's input (``input.clarifications``)."""
    out = {k: v for k, v in doc.items() if k not in ignored}
    if isinstance(out.get("input"), dict) and "clarifications" in out["input"]:
        out["input"] = {k: v for k, v in out["input"].items() if k != "clarifications"}
    return out


def without_book(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without its ``handoffd`` bookkeeping block (what formats and handlers see)."""
    return {k: v for k, v in doc.items() if k != "handoffd"}
