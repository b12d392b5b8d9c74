"""Who is related to whom: parents, children, conversations and correlations of handoff documents.

Read-only helpers shared by delegation (:mod:`handoffd.features.orchestration`), cancellation
(:mod:`handoffd.features.cancellation`), tracing (:mod:`handoffd.features.trace`) and ``handoff ls``. A relation may
be written in the document itself (seed 001/002 fields such as ``parent_id``, ``conversation_id``,
``correlation_id``) or, for formats without such fields, in the ``handoffd`` bookkeeping block.
Answers filed by non-native dialects keep the request in ``handoffd.request_snapshot``; it is
consulted too. The helpers read the documents they are given: pass trusted views (what
``Backend.get`` returns; :func:`documents` gives them), never a block the store does not vouch
for (``children`` in a forged block would make ``cancel --cascade`` cancel others' work).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

from ..core.documents import BOOK
from ..core.states import State
from ..core.storage import trusted_doc

if TYPE_CHECKING:
    from ..core.storage import Backend, Row

MAX_WALK = 10_000


def _block(doc: dict[str, Any]) -> dict[str, Any]:
    block = doc.get(BOOK)
    return block if isinstance(block, dict) else {}


def _first_str(doc: dict[str, Any], key: str) -> str | None:
    """``key``'s text (not empty) where relation fields may be found, the first that has one:
    the document, its request snapshot, the book."""
    value = doc.get(key)
    if isinstance(value, str) and value:
        return value
    block = doc.get(BOOK)
    if not isinstance(block, dict):
        return None
    snap = block.get("request_snapshot")
    for src in (snap, block) if isinstance(snap, dict) else (block,):
        value = src.get(key)
        if isinstance(value, str) and value:
            return value
    return None


# parent_of(doc): the id of the handoff that delegated this one (``parent_id``), or None. A
# partial: no call of its own (asked twice a handoff, of almost every one in vain)
parent_of = functools.partial(_first_str, key="parent_id")


def conversation_of(doc: dict[str, Any]) -> str | None:
    """The conversation (seed 002 ``conversation_id``) the handoff belongs to, or None."""
    return _first_str(doc, "conversation_id")


def correlation_of(doc: dict[str, Any]) -> str | None:
    """``correlation_id``: the request this document answers or descends from (seed 000)."""
    return _first_str(doc, "correlation_id")


def children_of(doc: dict[str, Any]) -> list[str]:
    """Ids of the children this handoff delegated to (every round), in creation order."""
    kids = _block(doc).get("children")
    return [k for k in kids if isinstance(k, str)] if isinstance(kids, list) else []


def depends_of(doc: dict[str, Any]) -> list[str]:
    """The ``depends_on`` list as written in the document (any dialect via its envelope)."""
    from .. import dialects

    try:
        return list(dialects.detect(doc).envelope(doc).depends_on)
    except Exception:  # an answer or an unreadable document: look at the raw field
        deps = doc.get("depends_on")
        return [d for d in deps if isinstance(d, str)] if isinstance(deps, list) else []


@dataclass
class Entry:
    """One handoff as the lineage walkers see it."""

    handoff_id: str
    state: State
    doc: dict[str, Any] = field(repr=False)

    @property
    def parent(self) -> str | None:
        return parent_of(self.doc)

    @property
    def conversation(self) -> str | None:
        return conversation_of(self.doc)


def documents(backend: "Backend", states: tuple[State, ...] = tuple(State)) -> Iterator[Entry]:
    """Every readable handoff document in ``states``, as handoffd trusts it (a listing hands
    documents out as stored): relations, times and notes are never read from a block the
    store does not vouch for, such as a foreign filing's."""
    for state in states:
        for row in backend.list(state=state, order="oldest"):
            yield Entry(row.id, state, trusted_doc(backend, state, row.id, row.doc))


def created_of(doc: dict[str, Any]) -> str | None:
    """When the handoff was created as its history says (its first ``created`` or ``claimed``
    event's time, as written), or None."""
    history = _block(doc).get("history")
    for event in history if isinstance(history, list) else ():
        if isinstance(event, dict) and event.get("event") in ("created", "claimed"):
            return str(event.get("at"))
    return None


class Link(NamedTuple):
    """One handoff's relations, without its document: what a walk over every handoff keeps
    (a named tuple: immutable like the frozen dataclass with slots it was, 8 bytes larger,
    three times quicker to make one per document, and a millisecond less to define in every
    process that loads lineage)."""

    handoff_id: str
    state: State
    parent: str | None = None
    conversation: str | None = None
    correlation: str | None = None
    depends_on: tuple[str, ...] = ()
    created_at: str | None = None

    @property
    def related(self) -> bool:
        """True when it names another handoff or a conversation."""
        return bool(self.parent or self.conversation or self.correlation or self.depends_on)


def each_link(backend: "Backend", visit: Callable[[Link], None],
              states: tuple[State, ...] = tuple(State)) -> None:
    """Call ``visit`` with the :class:`Link` of every readable handoff document in ``states``
    (each state oldest first; read from its trusted view, as :func:`documents` reads it). No
    document is held: the listing's predicate takes each row's relations and keeps none
    (``handoff trace`` held every document of the workspace: 688 MB for 100,000)."""
    def note(row: "Row") -> bool:
        doc = trusted_doc(backend, row.state, row.id, row.doc)
        visit(Link(row.id, row.state, parent_of(doc), conversation_of(doc), correlation_of(doc),
                   tuple(depends_of(doc)), created_of(doc)))
        return False

    for state in states:
        backend.list(state=state, order="oldest", where=note)


def _recovered(doc: dict[str, Any]) -> bool:
    """True when an attempt of this handoff was ended by recovery from a dead owner."""
    history = _block(doc).get("history")
    return isinstance(history, list) and any(
        isinstance(event, dict) and event.get("event") == "recovered" for event in history)


def descendants(backend: "Backend", handoff_id: str, *, scan: bool = True) -> list[str]:
    """Every handoff below ``handoff_id`` (children, grandchildren...), parents before children.

    Uses the children lists the daemon keeps, plus one scan of unfinished handoffs for documents
    naming a parent in the tree (children created by other producers). ``scan`` False: the
    children lists alone (they name every child a delegation made) unless a handoff of the
    tree was recovered from a dead owner, whose attempt may have made children it never
    recorded: reading every unfinished document costs ~0.1 s per thousand."""
    order: list[str] = []
    seen = {handoff_id}
    queue = [handoff_id]
    while queue and len(seen) < MAX_WALK:
        current = queue.pop(0)
        try:
            found = backend.get(current)
        except Exception:  # unreadable: it has no known children
            scan = True  # (nor is it known whether an attempt of it died)
            continue
        if found is None:
            continue
        doc = found[1]
        scan = scan or _recovered(doc)
        for kid in children_of(doc):
            if kid not in seen:
                seen.add(kid)
                order.append(kid)
                queue.append(kid)
    if not scan:
        return order
    changed = True
    live: list[tuple[str, str]] = []  # (id, parent) of each unfinished handoff with a parent
    each_link(backend, lambda link: live.append((link.handoff_id, link.parent))
              if link.parent else None, (State.PENDING, State.IN_PROGRESS))
    while changed:
        changed = False
        for handoff_id, parent in live:
            if handoff_id not in seen and parent in seen:
                seen.add(handoff_id)
                order.append(handoff_id)
                changed = True
    return order
