"""Reading a delegation: the ``delegated`` result a handler answers, checked before any child
is planned (what delegation does: :mod:`handoffd.features.orchestration`).

What a result may ask for is bounded here: how many children, how deep the chain, each entry's
agent, timeout, weight and text fields, and the children's ``depends_on`` among themselves
(resolved to sibling indices, with no cycle and never naming what waits for the delegation). A
result that breaks a rule raises :class:`_Malformed`, which the parent's filing turns into a
``VALIDATION_FAILED`` failure of one line. (The ``_`` names here are the orchestration modules'
own, shared by :mod:`.children`, :mod:`.clarification` and :mod:`.orchestration`.)
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..core.documents import check_id
from ..core.errors import ConfigError, HandoffdError, InvalidDocument
from ..core.settings import RetryPolicy
from ..core.timeutil import iso
from .dependencies import Graph
from .lineage import parent_of

if TYPE_CHECKING:
    from ..core.engine import Engine, Job

STRATEGIES = ("all_success", "any_success", "majority", "first_success")
MAX_CHILDREN = 100
MAX_WEIGHT = 1e6  # a child's weight in the aggregated confidence
MAX_CHILD_TIMEOUT_SECONDS = 10 * 365.25 * 24 * 3600  # as the config's: date arithmetic stays finite
MAX_DEPTH = 16


class _Malformed(Exception):
    pass


def _why(exc: BaseException) -> str:
    """An unexpected exception in one line: its type and the start of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _delegation(engine: "Engine", job: "Job", result: dict[str, Any]) -> dict[str, Any]:
    entries = result.get("delegate")
    if not isinstance(entries, list) or not entries:
        raise _Malformed('"delegate" must be a non-empty list of {"to": "@agent", "data": ...}')
    if len(entries) > MAX_CHILDREN:
        raise _Malformed(f"it delegates {len(entries)} children; at most {MAX_CHILDREN} are allowed")
    strategy = result.get("aggregation", "all_success")
    if strategy not in STRATEGIES:
        raise _Malformed(f'"aggregation" {strategy!r} is not one of {", ".join(STRATEGIES)}')
    step = chain_step(job.claim.doc)
    if step >= MAX_DEPTH:
        raise _Malformed(f"the delegation chain is already {step} steps deep (limit {MAX_DEPTH})")
    clean = []
    ids: set[str] = set()
    for index, entry in enumerate(entries):
        item = _check_entry(engine, f"delegate[{index}]", entry)
        if "id" in item:
            if item["id"] in ids:
                raise _Malformed(f"delegate[{index}].id {item['id']!r} is used twice")
            ids.add(item["id"])
        clean.append(item)
    _sibling_order(clean)
    _check_no_wait_upward(engine, job, clean)
    timeout = engine.timeout_for(job)
    return {"delegate": clean, "aggregation": strategy,
            "started": iso(job.started_at),
            "deadline": iso(job.started_at + timedelta(seconds=timeout))}


def _check_entry(engine: "Engine", where: str, entry: Any) -> dict[str, Any]:
    """One delegation entry, checked (_Malformed saying what is wrong), as a copy with ``to``
    resolved and ``weight`` a float."""
    if not isinstance(entry, dict):
        raise _Malformed(f"{where} is not an object")
    to = entry.get("to") or entry.get("agent") or entry.get("target")
    if not isinstance(to, str) or not to:
        raise _Malformed(f'{where} has no "to" agent id')
    if engine.registry.get(to) is None:
        raise _Malformed(f"{where}.to {to!r} has no registered specialist")
    timeout = entry.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout <= MAX_CHILD_TIMEOUT_SECONDS):
        raise _Malformed(f"{where}.timeout_seconds must be a number of seconds above 0, at most "
                         f"{MAX_CHILD_TIMEOUT_SECONDS:.0f}")
    weight = entry.get("weight", 1.0)
    # bounded: 1e308 weights summed to inf, and the aggregated confidence to NaN, which no
    # JSON can hold: the parent's filing then failed again at every recovery
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not 0 <= weight <= MAX_WEIGHT:
        raise _Malformed(f"{where}.weight must be a number from 0 to {MAX_WEIGHT:g}")
    # what the child's request carries as text (seed 000's DelegationPayload: objective str,
    # constraints and context_refs List[str]); a hi_moe child could not be written otherwise
    if entry.get("objective") is not None and not isinstance(entry["objective"], str):
        raise _Malformed(f"{where}.objective must be a string")
    for key in ("constraints", "context_refs"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, list)
                                  or not all(isinstance(v, str) for v in value)):
            raise _Malformed(f"{where}.{key} must be a list of strings")
    _check_request_fields(where, entry)
    item = {k: v for k, v in entry.items() if k != "id" or v is not None}
    if "id" in item:
        try:
            check_id(item["id"])
        except InvalidDocument as exc:
            raise _Malformed(f"{where}.id: {exc}") from None
    item["to"] = to
    item["weight"] = float(weight)
    return item


def _check_request_fields(where: str, entry: dict[str, Any]) -> None:
    """What an entry gives its child's request as it is (``retry_policy``, ``expected_output``,
    ``input_schema``) has the request's types and bounds: a child made with ``retry_policy:
    {"max_retries": "x"}`` (or -1) failed SCHEMA_VALIDATION_FAILED once made, and its parent
    CHILDREN_FAILED, where a bad ``priority`` already failed the delegation as malformed."""
    policy = entry.get("retry_policy")
    if policy is not None:
        try:
            RetryPolicy.from_dict(policy)
        except ConfigError as exc:
            raise _Malformed(f"{where}.retry_policy: {exc}") from None
    expected = entry.get("expected_output")
    if expected is not None:
        if not isinstance(expected, dict):
            raise _Malformed(f"{where}.expected_output must be an object")
        for key in ("schema", "destination"):
            if key in expected and not isinstance(expected[key], str):
                raise _Malformed(f"{where}.expected_output.{key} must be a string")
    if entry.get("input_schema") is not None and not isinstance(entry["input_schema"], str):
        raise _Malformed(f"{where}.input_schema must be a string")


def _check_no_wait_upward(engine: "Engine", job: "Job", entries: list[dict[str, Any]]) -> None:
    """_Malformed when a child would depend on what waits for this delegation: the parent, an
    ancestor, or a handoff that leads to one of them through its dependencies (or a parked
    parent's children). The parent waits for its children: such a child never starts, and the
    family would hang until the parent's deadline."""
    upward = {job.handoff_id} | _ancestors(engine, job.claim.doc)
    for index, item in enumerate(entries):
        loop = sorted(set(item["external_deps"]) & upward)
        if loop:
            raise _Malformed(f"delegate[{index}].depends_on names {loop[0]!r}, which waits for "
                             "this delegation (a cycle)")
    external = list(dict.fromkeys(dep for item in entries for dep in item["external_deps"]))
    if not external:
        return
    path = Graph(engine).path_to(external, upward)
    if path:
        index = next(i for i, item in enumerate(entries) if path[0] in item["external_deps"])
        raise _Malformed(f"delegate[{index}].depends_on names {path[0]!r}, which waits for "
                         f"this delegation through {' -> '.join(path)} (a cycle)")


def _ancestors(engine: "Engine", doc: dict[str, Any]) -> set[str]:
    """The ids above ``doc`` in its delegation chain (its parent, the parent's...), each of
    which waits for what is below it."""
    found: set[str] = set()
    current = doc
    for _ in range(MAX_DEPTH):
        parent = parent_of(current)
        if not isinstance(parent, str) or parent in found:
            break
        found.add(parent)
        try:
            _, current = engine.get(parent)
        except (HandoffdError, OSError):
            break
    return found


def _sibling_order(entries: list[dict[str, Any]]) -> None:
    """Resolve ``depends_on`` references to siblings (``c2``, 2, or a sibling's explicit id) into
    ``sibling_deps`` (0-based) and check they form no cycle; other strings stay handoff ids."""
    names = {f"c{i}": i - 1 for i in range(1, len(entries) + 1)}
    names.update({e["id"]: i for i, e in enumerate(entries) if isinstance(e.get("id"), str)})
    for index, entry in enumerate(entries):
        deps = entry.get("depends_on") or []
        if not isinstance(deps, list):
            raise _Malformed(f"delegate[{index}].depends_on must be a list")
        siblings, others = [], []
        for dep in deps:
            if isinstance(dep, int) and not isinstance(dep, bool):
                if not 1 <= dep <= len(entries):
                    raise _Malformed(f"delegate[{index}].depends_on names sibling {dep}, but there "
                                     f"are {len(entries)}")
                siblings.append(dep - 1)
            elif isinstance(dep, str) and dep in names:
                siblings.append(names[dep])
            elif isinstance(dep, str):
                others.append(dep)
            else:
                raise _Malformed(f"delegate[{index}].depends_on has {dep!r}; use ids or c1, c2...")
        if index in siblings:
            raise _Malformed(f"delegate[{index}] depends on itself")
        entry["sibling_deps"] = siblings
        entry["external_deps"] = others
    order = creation_order(entries)
    if order is None:
        raise _Malformed("the children's depends_on form a cycle")


def creation_order(entries: list[dict[str, Any]]) -> list[int] | None:
    """Sibling indices with every dependency before its dependents (None: a cycle)."""
    order: list[int] = []
    state: dict[int, int] = {}

    def visit(node: int) -> bool:
        if state.get(node) == 2:
            return True
        if state.get(node) == 1:
            return False
        state[node] = 1
        for dep in entries[node].get("sibling_deps", []):
            if not visit(dep):
                return False
        state[node] = 2
        order.append(node)
        return True

    for index in range(len(entries)):
        if not visit(index):
            return None
    return order


def chain_step(doc: dict[str, Any]) -> int:
    """Seed 002's ``chain_position.step`` of a document (1 when absent)."""
    for holder in (doc, given if isinstance(given := doc.get("metadata"), dict) else {}):
        pos = holder.get("chain_position")
        if isinstance(pos, dict) and isinstance(pos.get("step"), int) and pos["step"] > 0:
            return pos["step"]
    return 1
