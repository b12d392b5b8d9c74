"""One exception hierarchy for handoffd.

Every error a user can meet derives from :class:`HandoffdError`, but for
:class:`StoreUnavailable` (an OSError: the store away, try again later). Messages name the handoff
(when there is one) and say what to do next, because they are printed as-is on one stderr line.
"""
from __future__ import annotations

import enum
import errno
from datetime import datetime
from typing import Any


class ErrorCode(enum.StrEnum):
    """Every error code handoffd itself records (``error.code``, quarantine and violation reasons).

    Members are ``str``, so documents, JSON output and comparisons with plain strings are unchanged.
    A specialist may report codes of its own, so fields holding a code stay typed ``str``.
    """

    # reading a document (fsio, queries)
    MALFORMED_JSON = "MALFORMED_JSON"
    EMPTY_DOCUMENT = "EMPTY_DOCUMENT"
    NOT_UTF8 = "NOT_UTF8"
    NOT_AN_OBJECT = "NOT_AN_OBJECT"
    DOCUMENT_TOO_LARGE = "DOCUMENT_TOO_LARGE"
    DOCUMENT_TOO_DEEP = "DOCUMENT_TOO_DEEP"
    NOT_A_REGULAR_FILE = "NOT_A_REGULAR_FILE"
    UNREADABLE_FILE = "UNREADABLE_FILE"
    UNPROCESSABLE_DOCUMENT = "UNPROCESSABLE_DOCUMENT"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"  # the store could not hand it over now: transient
    # admitting a document
    INVALID_DOCUMENT = "INVALID_DOCUMENT"
    SCHEMA_VALIDATION_FAILED = "SCHEMA_VALIDATION_FAILED"
    UNSAFE_ID = "UNSAFE_ID"
    ID_MISMATCH = "ID_MISMATCH"
    DUPLICATE_HANDOFF_ID = "DUPLICATE_HANDOFF_ID"
    UNKNOWN_VERSION = "UNKNOWN_VERSION"
    UNKNOWN_FORMAT = "UNKNOWN_FORMAT"
    NOT_A_REQUEST = "NOT_A_REQUEST"
    DEPENDENCY_MISSING = "DEPENDENCY_MISSING"
    # running it
    PROCESSING_ERROR = "PROCESSING_ERROR"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    VALIDATION_FAILED = "VALIDATION_FAILED"
    BLOCKED = "BLOCKED"
    NEEDS_CLARIFICATION = "NEEDS_CLARIFICATION"
    EXPIRED = "EXPIRED"  # not started before its expires_at
    # contracts and orchestration
    CONTRACT_VIOLATION = "CONTRACT_VIOLATION"
    OWNERSHIP_CONFLICT = "OWNERSHIP_CONFLICT"
    CHILDREN_FAILED = "CHILDREN_FAILED"
    PARTIAL_COMPLETION = "PARTIAL_COMPLETION"
    TARGET_NOT_FOUND = "TARGET_NOT_FOUND"
    # the shared context store
    INVALID_CONTEXT_KEY = "INVALID_CONTEXT_KEY"
    INVALID_CONTEXT_VALUE = "INVALID_CONTEXT_VALUE"
    INVALID_CONTEXT_REVISION = "INVALID_CONTEXT_REVISION"
    CONTEXT_PERMISSION_DENIED = "CONTEXT_PERMISSION_DENIED"
    CONTEXT_CONFLICT = "CONTEXT_CONFLICT"


class HandoffdError(Exception):
    """Base class of every handoffd error; ``exit_code`` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, *, handoff_id: str | None = None) -> None:
        super().__init__(message)
        self.handoff_id = handoff_id


class UsageError(HandoffdError):
    """The command was called wrongly (bad flag combination, bad JSON argument...)."""

    exit_code = 2


class ConfigError(HandoffdError):
    """``handoffd.toml`` or a specialist definition is unusable."""

    exit_code = 2


class NotFound(HandoffdError):
    """No handoff with that id exists in the workspace."""

    exit_code = 3


class InvalidDocument(HandoffdError):
    """A document cannot be accepted: unreadable, not JSON, wrong shape, unsafe id...

    ``code`` is the seed-001 style error code recorded with it; ``errors`` holds one entry per
    problem (``field``, ``error``, ``schema_path``) when they come from schema validation.
    """

    def __init__(
        self,
        message: str,
        *,
        handoff_id: str | None = None,
        code: str = ErrorCode.INVALID_DOCUMENT,
        errors: list[dict[str, str]] | None = None,
    ) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.code = code
        self.errors = errors or []


class UnreadableDocument(HandoffdError):
    """A stored document that cannot be read or routed (a backend's answer to ``peek``).

    ``code`` says why. ``claimable``: claiming it sets it aside with that code (an invalid
    document, which the claim re-reads with knowledge of half-written files); ``transient``: look
    again later (an error that says "not now"). Neither: set it aside where it lies, unclaimed.
    ``shortage``: transient for want of descriptors (EMFILE, ENFILE, ENOMEM): looked at again
    after the shortage back-off, not the store-outage one."""

    def __init__(self, message: str, *, handoff_id: str | None = None, code: str,
                 claimable: bool = False, transient: bool = False,
                 shortage: bool = False) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.code = code
        self.claimable = claimable
        self.transient = transient or shortage
        self.shortage = shortage


class DocumentNotReady(HandoffdError):
    """A file in pending/ is still being written by a foreign producer; look again later."""


# errnos of a passing shortage of descriptors or memory while claiming, admitting or importing
# a handler (a spawn's list, with EAGAIN, is core.starts.SHORTAGES)
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# the limit each passing shortage's errno runs into, in the words every line saying one uses
# (core.starts.SHORTAGES is this table)
SHORTAGE_LIMITS: dict[int, str] = {
    errno.EMFILE: "the daemon's limit on open files, ulimit -n",
    errno.ENFILE: "the system's limit on open files, fs.file-max",
    errno.EAGAIN: "the limit on processes, ulimit -u (or a cgroup's pids.max)",
    errno.ENOMEM: "the memory the daemon may use",
}


def is_shortage(exc: BaseException) -> bool:
    """True for a passing shortage of descriptors or memory (an OSError of
    :data:`SHORTAGE_ERRNOS`, a MemoryError): "not now", never "not this document"."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError)
                                            and exc.errno in SHORTAGE_ERRNOS)


def shortage_words(exc: BaseException) -> str:
    """A passing shortage in the words every line saying one uses: "Too many open files
    (EMFILE: the daemon's limit on open files, ulimit -n)", "out of memory (MemoryError)"."""
    if not isinstance(exc, OSError):
        return "out of memory (MemoryError)"
    code = exc.errno or 0
    reason = errno.errorcode.get(code, "OSError")
    limit = SHORTAGE_LIMITS.get(code)
    return f"{exc.strerror or exc} ({reason}: {limit})" if limit else \
        f"{exc.strerror or exc} ({reason})"


class ClaimShortage(DocumentNotReady):
    """A claim given up before its lease was written for a passing shortage (``reason``: an
    errno's name such as EMFILE, or ``MemoryError``): the document is back in pending/ as it
    came, no attempt counted. Look again after ``delay`` seconds (0: the caller's own back-off);
    a caller that knows only DocumentNotReady looks again later, which is right too.

    One met admitting a claim whose caller hands it back itself (``Engine.take(keep_short=
    True)``: a daemon, which can keep the claim when that write runs short too) carries the
    claim still held and its format (``claim``, ``dialect``); else both are None.
    ``handed_back``: the claim is back in pending/ already (admission's own hand-back of a
    document that ran out of memory): nothing is left to give up."""

    def __init__(self, message: str, *, handoff_id: str, reason: str,
                 delay: float = 0.0, handed_back: bool = False) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.reason = reason
        self.delay = delay
        self.handed_back = handed_back
        self.claim: Any = None  # (a core.storage.Claim: not imported at this lowest layer)
        self.dialect: Any = None


def claim_shortage(handoff_id: str, exc: OSError | MemoryError,
                   doing: str = "claimed") -> ClaimShortage:
    """The claim of ``handoff_id`` given up for ``exc``, a passing shortage of descriptors or
    memory (:data:`SHORTAGE_ERRNOS`, a MemoryError) met while it was being ``doing`` (claimed,
    admitted); its caller has the document back in pending/. (Here, not with the handler
    starts: the engine needs it loaded before a shortage, and a command that only reads must
    not load the process machinery with it.)"""
    reason = "MemoryError" if isinstance(exc, MemoryError) else \
        errno.errorcode.get(exc.errno or 0, "OSError")
    return ClaimShortage(f"handoff {handoff_id}: cannot be {doing} for now: "
                         f"{shortage_words(exc)}; it stays in pending/, uncounted",
                         handoff_id=handoff_id, reason=reason)


class NotDue(DocumentNotReady):
    """A claim for a run (``due_only``) given up before its lease was written: the document's
    own (trusted) ``next_attempt_at``, ``due_at``, is still to come (a retry's back-off set by
    another process after this one read it). The document is left in pending/ as it was, no
    attempt counted, nothing recorded; look at it again (its due time, or its deadline first)."""

    def __init__(self, message: str, *, handoff_id: str, due_at: datetime) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.due_at = due_at


class DuplicateHandoff(HandoffdError):
    """A handoff with this id already exists (or was seen recently); it is never overwritten."""


class Conflict(DuplicateHandoff):
    """``create --if-absent``: a *different* request already holds that id (or the id was used
    recently and its request is gone, so it cannot be compared)."""

    exit_code = 5


class InvalidTransition(HandoffdError):
    """The state machine forbids this move (e.g. retrying a completed handoff)."""


class HandlerError(HandoffdError):
    """A specialist failed; ``code`` is the error code and ``retryable`` its seed-003 error type."""

    def __init__(
        self,
        message: str,
        *,
        handoff_id: str | None = None,
        code: str = ErrorCode.PROCESSING_ERROR,
        retryable: bool | None = None,
        details: dict | None = None,
    ) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.code = code
        self.retryable = retryable
        self.details = details or {}


class WaitTimeout(HandoffdError):
    """``handoff wait`` gave up before the handoff reached a terminal state."""

    exit_code = 124


class StartStopped(HandoffdError):
    """A stop (SIGTERM, SIGINT, SIGHUP) asked of a daemon while it waited, starting, for a store
    that is away (:mod:`handoffd.core.starting`): it ends as a stop while it starts does, having
    claimed nothing (exit 0)."""

    exit_code = 0


class StoreUnavailable(OSError):
    """The store could not be reached within its reconnect window (PostgreSQL: down or
    restarting for longer than ``[store] reconnect_seconds``), whether the connection was lost
    midway or never made: trying again later may work (exit 1). An OSError, not a
    HandoffdError, on purpose: the daemon and the sweeper treat OSErrors as "try again later",
    never as a fault of the document at hand."""
