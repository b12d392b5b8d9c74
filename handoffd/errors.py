"""One exception hierarchy for handoffd.

Every error a user can meet derives from :class:`HandoffdError`. Messages name the handoff
(when there is one) and say what to do next, because they are printed as-is on one stderr line.
"""
from __future__ import annotations


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
        code: str = "INVALID_DOCUMENT",
        errors: list[dict[str, str]] | None = None,
    ) -> None:
        super().__init__(message, handoff_id=handoff_id)
        self.code = code
        self.errors = errors or []


class DocumentNotReady(HandoffdError):
    """A file in pending/ is still being written by a foreign producer; look again later."""


class DuplicateHandoff(HandoffdError):
    """A handoff with this id already exists (or was seen recently); it is never overwritten."""


class InvalidTransition(HandoffdError):
    """The state machine forbids this move (e.g. retrying a completed handoff)."""


class HandlerError(HandoffdError):
    """A specialist failed; ``code`` is the error code and ``retryable`` its seed-003 error type."""

    def __init__(
        self,
        message: str,
        *,
        handoff_id: str | None = None,
        code: str = "PROCESSING_ERROR",
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
