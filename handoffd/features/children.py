"""A delegation's children: their ids, their documents, and the crash replay's adoption.

From a checked delegation (:mod:`.delegation`) the parent's filing (:mod:`.orchestration`) plans
every child before any is stored (:func:`_plan_children`): its id (``<parent>.c1``, or
``<parent>.r2.c1`` in a later round, or the entry's own), its document in the parent's format
with ``parent_id``, conversation, chain position, dependencies and a timeout within the parent's
deadline. An id another handoff holds, or held recently, refuses the whole delegation; one that a
crashed attempt of this very delegation made is adopted instead of made again, as handoffd's own
bookkeeping of the child and of the parent's history tell (:func:`_made_by_interrupted_attempt`).
"""
from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..core.documents import book, book_int, check_id, priority_rank
from ..core.errors import HandoffdError, InvalidDocument, NotFound, UnreadableDocument
from ..core.native_format import new_native_request
from ..core.states import State
from ..core.timeutil import parse_iso
from ..dialects import hi_moe
from .delegation import _Malformed, chain_step, creation_order
from .lineage import conversation_of, documents, parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine
    from ..dialects import Dialect


def ensure_conversation(doc: dict[str, Any], dialect: "Dialect", handoff_id: str) -> str:
    """The handoff's conversation id, creating ``conv-<id>`` when it has none."""
    found = conversation_of(doc)
    if found:
        return found
    conv = f"conv-{handoff_id}"
    if dialect.name == "native":
        doc["conversation_id"] = conv
    else:
        book(doc)["conversation_id"] = conv
    return conv


def child_id(parent: str, round_no: int, index: int) -> str:
    """The id of child ``index`` (from 1) of a delegation round: ``<parent>.c1``,
    ``<parent>.r2.c1``... (the parent id shortened with a hash when that is too long)."""
    import hashlib
    suffix = f".c{index}" if round_no <= 1 else f".r{round_no}.c{index}"
    candidate = parent + suffix
    try:
        return check_id(candidate)
    except InvalidDocument:
        short = hashlib.sha1(parent.encode()).hexdigest()[:10]
        return check_id(f"{parent[:96]}-{short}{suffix}")


@dataclasses.dataclass
class _Plan:
    """A delegation's children before any is stored."""

    ids: list[str]  # every child's id, in the delegation's order
    new: list[tuple[str, dict[str, Any]]]  # (id, document) to create, dependencies first
    adopted: list[str]  # made by an interrupted attempt of this delegation (a crash replay)
    round: int  # the delegation round these children are of


def _plan_children(engine: "Engine", doc: dict[str, Any], parent: str, dialect: "Dialect",
                   info: dict[str, Any], now: datetime) -> _Plan:
    """Every child document of a delegation, in creation order, before any is stored: one that
    cannot be made (a bad priority, an id used twice or held by another handoff, or used
    recently) raises InvalidDocument or _Malformed, and then none is made (no orphan runs
    beside a parent that fails)."""
    # the round is written into the document only as the parent is parked or filed: the lease
    # renewer writes claim.doc while the children are made, and a round it saved too early made a
    # crash replay a new round, whose children ran beside the interrupted round's
    round_no = book_int(doc, "delegation_round", 0) + 1
    conv = ensure_conversation(doc, dialect, parent)
    env = dialect.envelope(doc)
    step = chain_step(doc)
    deadline = parse_iso(info["deadline"])
    remaining = max((deadline - now).total_seconds(), 1.0)
    base_context = given if isinstance(given := doc.get("context"), dict) else {}
    entries = info["delegate"]
    ids = [e["id"] if isinstance(e.get("id"), str) else child_id(parent, round_no, i)
           for i, e in enumerate(entries, start=1)]
    _check_distinct(entries, ids)
    adopted = [cid for cid in ids if _free_for(engine, cid, doc, parent, now)]
    planned: list[tuple[str, dict[str, Any]]] = []
    # dependencies first, so a daemon never sees a child whose sibling dependency is missing
    for position in creation_order(entries) or range(len(entries)):
        index, entry, cid = position + 1, entries[position], ids[position]
        if cid in adopted:
            continue
        spec = engine.registry.get(entry["to"])
        wanted = entry.get("timeout_seconds") or (spec.config.timeout_seconds if spec else None) \
            or engine.settings.default_timeout_seconds
        deps = [ids[i] for i in entry.get("sibling_deps", [])] + list(entry.get("external_deps", []))
        timeout = round(min(float(wanted), remaining), 3)
        if dialect.name == "hi_moe":  # children speak the parent's format (seed 000)
            given = entry.get("priority")
            rank = priority_rank(given) if given is not None else env.priority
            planned.append((cid, _message_child(doc, parent, cid, entry, deps, timeout, rank,
                                                 now, conv, {"step": step + 1, "index": index,
                                                             "of": len(entries)})))
            continue
        child = new_native_request(source=env.target, target=entry["to"], data=entry.get("data"),
                                   now=now, handoff_id=cid, timeout_seconds=timeout,
                                   priority=entry.get("priority", env.priority), depends_on=deps)
        context = dict(base_context)
        for key in ("objective", "constraints", "context_refs", "scope"):
            if entry.get(key) is not None:
                context[key] = entry[key]
        if context:
            child["context"] = context
        for key in ("expected_output", "retry_policy"):
            if isinstance(entry.get(key), dict):
                child[key] = entry[key]
        if isinstance(entry.get("input_schema"), str):
            child["input"]["schema"] = entry["input_schema"]
        child["parent_id"] = parent
        child["correlation_id"] = parent
        child["conversation_id"] = conv
        child["chain_position"] = {"step": step + 1, "index": index, "of": len(entries)}
        planned.append((cid, child))
    return _Plan(ids, planned, adopted, round_no)


def _check_distinct(entries: list[dict[str, Any]], ids: list[str]) -> None:
    """_Malformed when two entries would be one child: an explicit id may equal another
    entry's default id (``<parent>.c1``), and then one entry was silently dropped."""
    first: dict[str, int] = {}
    for index, cid in enumerate(ids):
        if cid in first:
            how = "its explicit id" if isinstance(entries[first[cid]].get("id"), str) else "by default"
            raise _Malformed(f"delegate[{index}] child id {cid!r} is used twice "
                             f"(delegate[{first[cid]}] has it {how})")
        first[cid] = index


def _free_for(engine: "Engine", cid: str, doc: dict[str, Any], parent: str, now: datetime) -> bool:
    """False when ``cid`` is free for a child of ``parent`` (whose claimed document is ``doc``);
    True when it holds a child this very delegation made in an attempt that was interrupted
    before the parent was parked (a crash replay: adopted, not made again). _Malformed when
    any other handoff holds it, or held it recently (the store would refuse it midway)."""
    try:
        state, existing = engine.get(cid)
    except NotFound:
        if engine.backend.seen_contains(cid, now):
            raise _Malformed(f"the child id {cid!r} was used recently (a handoff purged within "
                             "the dedup window had it); choose another id") from None
        return False
    except (InvalidDocument, UnreadableDocument):
        raise _Malformed(f"the child id {cid!r} is taken by another handoff") from None
    if not _made_by_interrupted_attempt(engine, cid, state, existing, doc, parent):
        raise _Malformed(f"the child id {cid!r} is taken by another handoff")
    return True


def _made_by_interrupted_attempt(engine: "Engine", cid: str, state: State,
                                 existing: dict[str, Any], doc: dict[str, Any],
                                 parent: str) -> bool:
    """Whether ``existing`` is ``parent``'s own child, told by bookkeeping only handoffd writes,
    never by what a document says of itself (anyone can drop a ``parent_id`` into pending/): its
    ``created`` event names the process and time of an attempt of the parent, in the parent's
    own history, that was interrupted (``recovered``) since the parent last delegated. A
    document another producer dropped has no ``created`` event (its block is replaced when it
    is claimed, and an unsealed one is left out while it waits in pending/)."""
    if parent_of(existing) != parent:
        return False
    if state is State.PENDING:  # the block as the scheduler trusts it (see Backend.peek)
        try:
            existing = engine.backend.peek(cid) or {}
        except HandoffdError:
            return False
    history = book(existing).get("history") if isinstance(existing.get("handoffd"), dict) else None
    created = history[0] if isinstance(history, list) and history else None
    if not isinstance(created, dict) or created.get("event") != "created":
        return False
    at = _when(created)
    # no upper bound: a stalled owner may go on creating children after it was recovered
    # (the same delegation's, by their ids), and "recovered" is stamped by another host's clock
    return at is not None and any(actor == created.get("actor") and begun <= at
                                  for actor, begun in _interrupted_attempts(doc))


def made_by_interrupted_attempts(engine: "Engine", doc: dict[str, Any], parent: str) -> list[str]:
    """The unfinished children of ``parent`` (its claimed document ``doc``) that an attempt of
    its delegation made before it was interrupted: the ones a replay would adopt. When the
    parent is filed for good instead, nobody waits for them. One scan of the unfinished
    handoffs (as `cancel --cascade` makes): it runs when an interrupted parent fails for good."""
    if not _interrupted_attempts(doc):
        return []
    return [entry.handoff_id for entry in documents(engine.backend, (State.PENDING, State.IN_PROGRESS))
            if entry.parent == parent and _made_by_interrupted_attempt(
                engine, entry.handoff_id, entry.state, entry.doc, doc, parent)]


def _interrupted_attempts(doc: dict[str, Any]) -> list[tuple[Any, datetime]]:
    """(actor, claimed at) of each attempt in ``doc``'s history that ended by recovery, since
    its last delegation was parked (an earlier round's children are not this round's). Both
    stamps of a pair come from the claiming process, so its clock alone decides."""
    history = book(doc).get("history")
    events = [e for e in (history if isinstance(history, list) else []) if isinstance(e, dict)]
    last = max((i for i, e in enumerate(events) if e.get("event") == "delegated"), default=-1)
    found, current = [], None
    for event in events[last + 1:]:
        if event.get("event") == "claimed":
            current = event
        elif event.get("event") == "recovered" and current is not None:
            begun = _when(current)
            if begun is not None:
                found.append((current.get("actor"), begun))
            current = None
    return found


def _when(event: dict[str, Any]) -> datetime | None:
    """When a history event happened (None: unreadable)."""
    try:
        return parse_iso(str(event.get("at")))
    except ValueError:
        return None


def _message_child(doc: dict[str, Any], parent: str, cid: str, entry: dict[str, Any],
                   deps: list[str], timeout: float, priority: int, now: datetime, conv: str,
                   position: dict[str, int]) -> dict[str, Any]:
    """A hi_moe parent's child: a Message one tier down. The relations a Message has no field
    for (parent, conversation, dependencies, chain position) are extra envelope fields, which
    seed 000 allows within a MAJOR version (and every reader of the file can see)."""
    child = hi_moe.delegation(doc, cid, to=entry["to"], data=entry.get("data"), now=now,
                              timeout_seconds=timeout, priority=priority, fields=entry)
    child.update(parent_id=parent, conversation_id=conv, chain_position=position)
    if deps:
        child["depends_on"] = deps
    return child
