"""What an aggregated answer copies of its children's answers, within a byte budget
(seed 000's 1 KB-per-artifact rule aside, the parent's filed document must stay readable by
every reader of a finished document): the winner's output first, then each successful child's
in child order; what does not fit is named by child id (``output_omitted``, an
``artifacts_omitted`` record), and a child's answer that was let go while reading is read again
only when it is copied (:func:`copies`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import HandoffdError
from . import artifacts
from .childfacts import SUCCESS_LIKE, ChildInfo, from_child, json_size, let_go

if TYPE_CHECKING:
    from ..core.engine import Engine


# A first_success winner's output is also copied into ``output.result`` when at most this large
# (the small answers every parent gave); a larger one is not copied twice: ``result`` names
# where it is (``output.results[<winner>]``).
RESULT_COPY_BYTES = 64 * 1024


# The files store reads a finished document up to max_document_bytes + max_output_bytes + 1 MiB
# (its FILED_MARGIN_BYTES): an aggregated answer keeps within the first half MiB of that margin,
# leaving the rest to the bookkeeping written after it.
ANSWER_SLACK_BYTES = 512 * 1024


def answer_limit(engine: "Engine") -> int:
    """The most bytes a parent's filed aggregated answer may take, so that every reader of a
    finished document (`handoff wait`, `show`, dependants, the daemon) can read it."""
    settings = engine.settings
    return settings.max_document_bytes + settings.max_output_bytes + ANSWER_SLACK_BYTES


@dataclass
class Copies:
    """What an aggregated answer copies of its children's answers within a byte budget;
    the rest is named, not copied (the children stay filed: `handoff show <child>`)."""

    results: dict[str, Any]  # output.results: each successful child's output (or its omission)
    result: Any  # output.result of first_success: the winner's output (or where it is)
    artifacts: list[Any]  # the children's artifacts (or one omission record per child)
    omitted: list[str]  # children something of which was not copied


def _omission(handoff_id: str, what: str, size: int, budget: int) -> str:
    shown = "too large to write" if size == sys.maxsize else f"{size} bytes"
    return (f"{what} ({shown}) is not copied: an aggregated answer copies at most {budget} bytes "
            f"of its children's answers; see `handoff show {handoff_id}`")


def _unread(handoff_id: str, what: str) -> str:
    """The omission of a child's answer that could not be read again as it was measured."""
    return (f"{what} is not copied: its document could not be read again as it was measured; "
            f"see `handoff show {handoff_id}`")


def copies(infos: list[ChildInfo], winner: ChildInfo | None, budget: int) -> Copies:
    """The children's outputs and artifacts an aggregated answer copies, at most ``budget``
    bytes of them (JSON), the winner's first, then in child order; each that does not fit is
    replaced by an ``output_omitted`` entry (or an ``artifacts_omitted`` record) naming the
    child whose document holds it. What is copied is decided from the measured sizes first
    (:class:`Plan`); then the held answers not copied are let go, and one :func:`read_child`
    let go is read again, one child at a time, so at most ``budget`` bytes are in hand."""
    kept = [i for i in infos if i.status in SUCCESS_LIKE]
    plan = Plan.of(kept, winner, budget)
    for info in kept:  # (the answers held while reading need not be the ones copied)
        if info.held and info.reread is not None and info.handoff_id not in plan.anything:
            let_go(info)
    outputs: dict[str, Any] = {}
    omitted: list[str] = []
    result: Any = None
    for info in sorted(kept, key=lambda i: i is not winner):  # (stable: the winner first)
        size = _output_size(info)
        fits = info.handoff_id in plan.outputs
        got = _output_of(info, size) if fits else None
        if got is not None:
            outputs[info.handoff_id] = got[0]
        else:
            outputs[info.handoff_id] = {
                "output_omitted": _omission(info.handoff_id, "its output", size, budget) if not fits
                else _unread(info.handoff_id, "its output"),
                "handoff_id": info.handoff_id, "size_bytes": size}
            omitted.append(info.handoff_id)
        if info is winner:
            result = _winner_result(info, outputs[info.handoff_id], got is not None, size,
                                    plan.result_copied)
    records: list[Any] = []
    for info in kept:
        size, count = _artifacts_size(info)
        fits = info.handoff_id in plan.artifacts
        items = _artifacts_of(info, size) if fits else None
        if items is not None:
            records.extend(items)
            continue
        what = f"its {count} artifacts"
        records.append(artifacts._record(
            "artifacts_omitted", name=None, ref=None, facts=None,
            inline=_omission(info.handoff_id, what, size, budget) if not fits
            else _unread(info.handoff_id, what),
            metadata={"child_id": info.handoff_id, "count": count, "size_bytes": size}))
        omitted.append(info.handoff_id)
    return Copies({i.handoff_id: outputs[i.handoff_id] for i in kept}, result, records,
                  [i.handoff_id for i in kept if i.handoff_id in omitted])


@dataclass
class Plan:
    """Which children's outputs and artifact lists an answer copies within its budget, by
    their measured sizes alone, in :func:`copies`' order (the winner's output first, then
    each output in child order, then each child's artifacts), and whether the winner's output
    is copied again into ``output.result``. A child whose answer cannot be read again as it
    was measured is named instead; the room planned for it stays unused."""

    outputs: set[str]
    artifacts: set[str]
    result_copied: bool

    @property
    def anything(self) -> set[str]:
        """The children something of which is copied."""
        return self.outputs | self.artifacts

    @classmethod
    def of(cls, kept: list[ChildInfo], winner: ChildInfo | None, budget: int) -> "Plan":
        """The plan for the successful children ``kept`` within ``budget`` bytes."""
        plan, left = cls(set(), set(), False), budget
        for info in sorted(kept, key=lambda i: i is not winner):
            size = _output_size(info)
            if size <= left:
                plan.outputs.add(info.handoff_id)
                left -= size
                if info is winner and size <= min(RESULT_COPY_BYTES, left):
                    plan.result_copied = True
                    left -= size  # (copied again into output.result)
        for info in kept:
            size = _artifacts_size(info)[0]
            if size <= left:
                plan.artifacts.add(info.handoff_id)
                left -= size
        return plan


def _output_size(info: ChildInfo) -> int:
    """JSON bytes of the child's output (as measured when read, else measured now)."""
    return json_size(info.output) if info.output_size is None else info.output_size


def _reloaded(info: ChildInfo) -> ChildInfo | None:
    """``info`` with its output and artifacts in hand: itself when held, else its document read
    again; None when that fails or finds another answer (a filed child is final, but its file
    lies in a workspace others can write)."""
    if info.held or info.reread is None:
        return info
    try:
        again = info.reread()
    except (HandoffdError, OSError):
        return None
    return again if again.status == info.status else None


def _output_of(info: ChildInfo, size: int) -> tuple[Any] | None:
    """(the child's output,) to copy, measured ``size`` bytes; None when it cannot be had
    again as it was measured (the budget counts the measured size)."""
    again = _reloaded(info)
    if again is None or (again is not info and json_size(again.output) != size):
        return None
    return (again.output,)


def _artifacts_size(info: ChildInfo) -> tuple[int, int]:
    """(JSON bytes, count) of the child's artifacts as the parent lists them."""
    if info.artifacts_size is not None:
        return info.artifacts_size, info.artifacts_count
    return json_size([from_child(item, info.handoff_id) for item in info.artifacts]), \
        len(info.artifacts)


def _artifacts_of(info: ChildInfo, size: int) -> list[Any] | None:
    """The child's artifacts as the parent lists them (tagged with its id), measured ``size``
    bytes; None when they cannot be had again as they were measured."""
    if not info.held and info.artifacts_count == 0:
        return []  # (none: nothing to read again)
    again = _reloaded(info)
    if again is None:
        return None
    items = [from_child(item, info.handoff_id) for item in again.artifacts]
    return items if again is info or json_size(items) == size else None


def _winner_result(winner: ChildInfo, entry: Any, copied: bool, size: int,
                   again: bool) -> Any:
    """``output.result`` of first_success: the winner's output again when small enough to be
    copied twice (``again``, the plan's), else a note saying where it is (never a second copy
    of a large output). ``entry`` is the winner's ``output.results`` entry, ``copied`` whether
    it is the output itself."""
    if not copied or again:  # not copied at all: the same omission; small: the output again
        return entry
    return {"output_omitted": f"the winner's output ({size} bytes) is not copied twice: it is "
                              f"output.results[\"{winner.handoff_id}\"]",
            "handoff_id": winner.handoff_id, "size_bytes": size}
