"""What a notice is, what delivering one takes, and its dead letter.

A notice is small: the rule, the handoff's id, the state and revision it was filed in, the
targets left and its line in the outbox. The filed document is read when the notice is
delivered (each once held the whole document, up to 1 MB: a webhook that was down grew a daemon
by 1.5 GB); the revision tells the filing the notice is about from a later one of the same
handoff (retried and filed again before the notice was delivered)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.config import NotifyRule
from ...core.ownfiles import open_regular
from ...core.states import State
from ...core.timeutil import iso, utc_now

if TYPE_CHECKING:
    from .webhook import Cutoff

log = logging.getLogger("handoffd")
DEAD_LETTERS = "notify-dead-letters.jsonl"
KINDS = ("command", "webhook")  # a rule's targets, in the order they are tried
STOPPED = "the process that filed it stopped"
NEVER_TRIED = f"{STOPPED} before it was delivered"
MAYBE_DELIVERED = {  # said in a dead letter when the target may have had the document all the same
    "webhook": "; it may have been delivered all the same: its request was sent and no answer "
               "came",
    "command": "; it may have been delivered all the same: the command was started and did not "
               "finish",
}
SHOWN_IDS = 5  # ids a log line about many dead letters names
NOTICE_BYTES = 512  # what one queued notice holds, about (its object, its strings, its slot)


def kinds_of(rule: NotifyRule) -> tuple[str, ...]:
    """The targets of ``rule``, in the order they are tried."""
    return tuple(kind for kind, there in zip(KINDS, (rule.command, rule.url)) if there)


def fingerprint(rule: NotifyRule) -> str:
    """What names ``rule`` in the outbox: its targets (never its secret). A process that takes
    over a notice finds its rule in its own configuration by this."""
    targets = json.dumps([rule.command, rule.url], ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(targets).hexdigest()[:16]


@dataclass(eq=False)
class Notice:
    """One delivery to make: a rule, and the filed handoff it is about."""

    rule: NotifyRule
    handoff_id: str
    state: State
    kinds: tuple[str, ...] = ()  # the targets to deliver to (default: every target of the rule)
    filed_at: str = ""  # when it was queued (ISO 8601)
    seq: int | None = None  # its record in this process's outbox (None: not journaled)
    # the filed document's handoffd.revision (None: unknown, e.g. a journal line written before
    # revisions were recorded: then only the state tells a later filing)
    revision: int | None = None

    def __post_init__(self) -> None:
        self.kinds = self.kinds or kinds_of(self.rule)
        self.filed_at = self.filed_at or iso(utc_now())

    def size(self) -> int:
        """About what this notice holds in memory (the queue's byte count)."""
        return NOTICE_BYTES + len(self.handoff_id)


@dataclass(eq=False)
class Flight:
    """A notice a delivery thread has taken. Whoever settles it first records it: the thread
    (delivered, or dead-lettered after its retries), or a drain whose time is up (dead-lettered
    while in flight); the other then records nothing, so a notice is never lost nor recorded
    twice. Fields other than ``notice`` and ``body`` change under the notifier's lock."""

    notice: Notice
    body: bytes = b""  # the filed document, read when the flight starts, dropped when it ends
    kinds: list[str] = field(default_factory=list)  # the targets not yet finished, in order
    trying: bool = False  # kinds[0] is being tried (or waits for its next try)
    exposed: bool = False  # the attempt under way has handed the document over (a command ran)
    maybe_delivered: bool = False  # an ended attempt of kinds[0] may have delivered it
    cutoff: Cutoff | None = None  # the webhook attempt under way (or the last one)
    settled: bool = False  # a drain dead-lettered what was left of it
    worker: threading.Thread | None = None  # the delivery thread flying it

    def __post_init__(self) -> None:
        self.kinds = list(self.notice.kinds)

    def may_have_delivered(self) -> bool:
        """True when the target being tried may have the document although no try succeeded."""
        answerless = self.cutoff is not None and self.cutoff.sent and not self.cutoff.answered
        return self.maybe_delivered or self.exposed or answerless


def write_dead_letter(meta: Path, notice: Notice, why: str, url: str | None) -> None:
    """Log a warning and append one line to ``meta``/notify-dead-letters.jsonl (``url`` as it
    may be shown: no password). Never raises: a record that cannot be written is logged."""
    write_dead_letters(meta, [(notice, why, url)])


def write_dead_letters(meta: Path, letters: list[tuple[Notice, str, str | None]], *,
                       summary: str | None = None) -> None:
    """Append a line per (notice, why, url) of ``letters`` to ``meta``/notify-dead-letters.jsonl
    in one write, and log a warning for each, or with ``summary``, when they are more than
    SHOWN_IDS, one for them all (a takeover once dead-lettered 800,000 notices one by one, each
    its own warning, open and append, and stalled its daemon for minutes). Never raises: a
    record that cannot be written is logged."""
    if not letters:
        return
    if summary is None or len(letters) <= SHOWN_IDS:
        for notice, why, _ in letters:
            log.warning("handoff %s: notification given up: %s", notice.handoff_id, why)
    else:
        shown = ", ".join(notice.handoff_id for notice, _, _ in letters[:SHOWN_IDS])
        more = f" and {len(letters) - SHOWN_IDS} more" if len(letters) > SHOWN_IDS else ""
        log.warning("%d notification(s) given up: %s (handoffs %s%s; each in %s)", len(letters),
                    summary, shown, more, DEAD_LETTERS)
    at = iso(utc_now())
    data = "".join(json.dumps({"at": at, "id": notice.handoff_id, "state": notice.state.value,
                               "command": notice.rule.command, "url": url, "error": why}) + "\n"
                   for notice, why, url in letters).encode("utf-8")
    try:
        meta.mkdir(parents=True, exist_ok=True)
        # a FIFO there: ENXIO, no wait; a symlink: ELOOP, never followed
        fd = open_regular(meta / DEAD_LETTERS, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        log.error("cannot record the dead letter(s) of %s: %s",
                  ", ".join(notice.handoff_id for notice, _, _ in letters[:SHOWN_IDS]), exc)
