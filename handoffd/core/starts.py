"""Whether an attempt's handler started: what a runner (:mod:`.runner`, :mod:`.isolation`)
tells when a passing shortage of descriptors, processes or memory kept it from starting (the
claim is then handed back uncounted: :func:`handoffd.service.handbacks.hand_back_unstarted`),
and when it did start (the event log's ``claimed``: :attr:`.specialists.HandlerContext.on_start`).

The engine loads it before any shortage (a MemoryError must find it loaded), so it holds no
process machinery: a command that only reads (``handoff ls``) builds an engine too. Starting a
child's threads and forgetting its record are :mod:`.childproc`'s.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass

from .errors import SHORTAGE_LIMITS, HandlerError
from .specialists import HandlerContext

__all__ = ["NOT_STARTED", "SHORTAGES", "THREADS", "THREADS_LIMIT", "NotStarted",
           "check_shortage", "not_started", "shortage", "shown_error", "started"]

# what a child (or a thread of an attempt) cannot be started for now, not for good: a passing
# shortage of descriptors, processes or memory, and the limit to name. Its handler never started,
# so the claim is handed back uncounted and started again after a back-off
# (:func:`handoffd.service.handbacks.hand_back_unstarted`); it once failed the handoff for good,
# blamed on handoffd.toml (all 20 of a burst under `ulimit -n 16`)
SHORTAGES: dict[int, str] = SHORTAGE_LIMITS
THREADS = "THREADS"  # the reason when a thread of the attempt could not be started
THREADS_LIMIT = "the limit on processes and threads, ulimit -u, or memory"
NOT_STARTED = "handoffd.not_started"  # the key of a :class:`NotStarted` in ctx.feature_state


@dataclass(frozen=True)
class NotStarted:
    """An attempt whose handler could not be started for a passing shortage: ``reason`` (an
    errno's name, or :data:`THREADS`), the one line saying so, naming the resource limit, and
    ``words``, the shortage itself in that line (what a batch's end says of it).
    ``after_start``: the handler had started, and was stopped when what it needed from the
    daemon ran short (its document's feed to its stdin): handed back uncounted all the same,
    its history saying so (it said "not started" of a child that may have run a while)."""

    reason: str
    message: str
    words: str = ""
    after_start: bool = False


def started(ctx: HandlerContext) -> None:
    """The attempt's handler is started: tell whoever asked (:attr:`HandlerContext.on_start`:
    the event log's ``claimed``), once."""
    on_start, ctx.on_start = ctx.on_start, None
    if on_start is not None:
        on_start()


def not_started(ctx: HandlerContext) -> NotStarted | None:
    """The passing shortage that kept the attempt's handler from starting, if one did. Only this
    module sets it: no result or error a handler gives back can claim it (an uncounted hand-back
    for ever)."""
    found = ctx.feature_state.get(NOT_STARTED)
    return found if isinstance(found, NotStarted) else None


def shortage(ctx: HandlerContext, what: str, reason: str, why: str, limit: str, *,
             after_start: bool = False) -> HandlerError:
    """Mark the attempt as not started for a passing shortage (:func:`not_started`) and return
    its error: the after-run hooks see an attempt that does not count (``ctx.handback``: a
    contract's reservation is released, its scope not reviewed), the worker hands it back.
    ``after_start``: the handler had started, and was stopped for the shortage
    (:attr:`NotStarted.after_start`)."""
    if after_start:
        message = (f"handoff {ctx.handoff_id}: {what} was stopped after it started: {why} "
                   f"({reason}: {limit})")
    else:
        message = (f"handoff {ctx.handoff_id}: cannot start {what} for now: {why} "
                   f"({reason}: {limit})")
    ctx.feature_state[NOT_STARTED] = NotStarted(reason, message, f"{why} ({reason}: {limit})",
                                                after_start)
    ctx.handback = True
    return HandlerError(message, handoff_id=ctx.handoff_id, retryable=True,
                        details={"cannot_start": reason})


def check_shortage(ctx: HandlerContext, what: str, doing: str,
                   exc: OSError | MemoryError) -> HandlerError:
    """:func:`shortage` for ``exc``, a passing shortage of descriptors or memory met ``doing``
    a check of the attempt (loading a schema): not the document's fault nor the result's."""
    code = errno.ENOMEM if isinstance(exc, MemoryError) else (exc.errno or errno.ENOMEM)
    words = "out of memory" if isinstance(exc, MemoryError) else (exc.strerror or str(exc))
    return shortage(ctx, what, errno.errorcode.get(code, "OSError"), f"{words} {doing}",
                    SHORTAGES.get(code, SHORTAGES[errno.ENOMEM]))


def shown_error(exc: BaseException) -> str:
    """``str(exc)``, whatever the exception does in its ``__str__``."""
    try:
        return str(exc)
    except Exception:
        return f"(a {type(exc).__name__} that cannot be shown)"
