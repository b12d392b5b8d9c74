"""Handler outputs under ``artifacts/``: the engine's hooks, the 1 KB rule, size and sha256 records.

Where an artifact may go (a request's destination resolved, the names of a handoff's artifact
files) and what a reference may name (confined to the workspace) is :mod:`.artifact_paths`.

* **Destination** (seed 001): a request's ``expected_output.destination`` is resolved before the
  handler runs (:func:`prepare`). Command handlers get the absolute path in
  ``$HANDOFF_ARTIFACT_PATH``, Python ones as ``ctx.artifact_path``. The handler either writes that
  file itself or returns ``output.content``, which the daemon writes there (then ``output``
  carries seed 001's ``artifact_id`` / ``artifact_path`` / ``artifact_type`` instead of the
  content). A destination the system refuses (a name too long, a permission) fails the attempt
  once, ``VALIDATION_FAILED``; a passing shortage making its folder hands it back uncounted
  (:func:`_refused`).
* **1 KB rule** (seed 000): content under 1024 UTF-8 bytes is answered inline
  (``inline_content``, ``content_ref`` null); content of 1 KB or more is written to
  ``artifacts/<handoff_id>/<name>`` and answered by reference (``content_ref`` and ``path``,
  ``inline_content`` null). Exactly one of the two is set. ``output.content`` of 1 KB or more is
  moved out the same way even without a destination. Where ``artifacts/<handoff_id>/`` cannot
  hold them (``artifacts/`` leading out of the workspace; a file, a FIFO or a symlink in the
  folder's place), the attempt fails once, ``VALIDATION_FAILED``, its message saying what to
  move (:func:`_answerable`): never an answer with 1 KB inline, never a write through the link.
* **Records**: every artifact in the filed document carries ``size_bytes`` and ``sha256`` (also in
  its ``metadata``), computed from the bytes on disk (referenced) or the inline text. A referenced
  file over :data:`MAX_ARTIFACT_BYTES` (its size from ``fstat``, before any byte is read: a sparse
  file can claim terabytes) fails the attempt ``VALIDATION_FAILED`` in one line rather than being
  hashed past the handler's time limit; a file under it is hashed a megabyte at a time, and an
  attempt stopped meanwhile (cancelled, handed back) stops the hashing.

No artifact is ever written or recorded outside the workspace: paths are resolved and checked.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..backends.files import fsio
from ..core.documents import Outcome
from ..core.errors import ErrorCode, HandlerError, InvalidDocument, is_shortage, shortage_words
from ..core.formats import ArtifactSink, FiledState
from ..core.hashing import sha256_hex
from ..core.ownfiles import open_reading
from ..core.results import failed, wait_to_check_again
from ..core.starts import check_shortage, shortage
from ..core.states import PARKED, Status
from ..core.workspace import Workspace, workspace_at
from .artifact_paths import (
    _file_name,
    _id_part,
    _under_artifacts,
    confine_reference,
    destination,
    destination_template,
    own_folder_problem,
)

if TYPE_CHECKING:
    from ..core.engine import Job

INLINE_LIMIT = 1024
MAX_ARTIFACT_BYTES = 1 << 30  # a referenced artifact file larger than this is refused (1 GiB)
HASH_STEP = 1 << 20
Stopped = Callable[[], bool]
# errors of storing artifacts that the same report gives again on every attempt (a name the
# file system refuses): the attempt fails for good instead of burning its retries
PERMANENT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.ELOOP, errno.EILSEQ,
                              errno.EISDIR, errno.ENOTDIR})


def expected_type(doc: dict[str, Any]) -> str | None:
    expected = doc.get("expected_output")
    if isinstance(expected, dict) and isinstance(expected.get("artifact_type"), str):
        return expected["artifact_type"]
    return None


def check_inputs(job: "Job") -> None:
    """Engine ``before_run`` hook (seed 002: "review results - verify artifacts exist"): every
    file the request says an earlier agent produced must be in the workspace before the
    specialist starts, else DEPENDENCY_MISSING. An external URL is taken on trust (never read)."""
    if not job.envelope.input_artifacts:  # (most requests: nothing to look at)
        return
    ws = workspace_at(str(job.context.root))
    for index, ref in enumerate(job.envelope.input_artifacts):
        path = confine_reference(ws, ref, handoff_id=job.handoff_id)
        if path is not None and not path.exists():
            raise InvalidDocument(
                f"handoff {job.handoff_id}: results.artifacts[{index}].path {ref!r} does not "
                "exist in the workspace; the agent before this one should have produced it",
                handoff_id=job.handoff_id, code=ErrorCode.DEPENDENCY_MISSING,
                errors=[{"field": f"results.artifacts[{index}].path", "error": "no such file"}])


def prepare(job: "Job") -> None:
    """Engine ``before_run`` hook: resolve the destination and hand it to the handler."""
    template = destination_template(job.claim.doc)
    if not template:
        return
    ws = workspace_at(str(job.context.root))
    rel, where, ready = destination(ws, template, handoff_id=job.handoff_id,
                                    attempt=job.context.attempt, agent=job.specialist.agent)
    target = Path(where)
    if not ready:  # (ready: its folder there, nothing at the path, as resolving it saw)
        _check_destination(job, ws, rel, target, where)
    job.context.artifact_path = target
    job.context.artifact_rel = rel
    job.context.env["HANDOFF_ARTIFACT_PATH"] = where


def _check_destination(job: "Job", ws: Workspace, rel: str, target: Path, where: str) -> None:
    """Make the destination's folder when it is missing; InvalidDocument (VALIDATION_FAILED,
    the same at every attempt) when something that is no folder stands in its way, when the
    destination itself is a folder, or when the system refuses its path (:func:`_refused`);
    a passing shortage hands the attempt back uncounted."""
    if not os.path.isdir(os.path.dirname(where)):  # (one stat when it exists, as after the first)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # the same at every attempt: not retried
            raise InvalidDocument(
                f"handoff {job.handoff_id}: expected_output.destination {rel!r} cannot be "
                f"written: {_not_a_folder(ws, target.parent)} is not a folder: move it away, "
                f"then `handoff retry --force {job.handoff_id}`", handoff_id=job.handoff_id,
                code=ErrorCode.VALIDATION_FAILED) from None
        except (OSError, MemoryError) as exc:  # (it escaped the engine: the claim stranded)
            raise _refused(job, rel, exc, "making its folder") from None
    try:
        mode = os.stat(where).st_mode
    except FileNotFoundError:  # (the usual: nothing there yet)
        return
    except (OSError, MemoryError) as exc:  # a file name too long, a folder not searchable
        raise _refused(job, rel, exc, "looking at its path") from None
    if stat.S_ISDIR(mode):  # (no file can be written there, at any attempt)
        raise InvalidDocument(
            f"handoff {job.handoff_id}: expected_output.destination {rel!r} is a folder, "
            "where the output artifact would be a file: name a file in it (e.g. "
            f"{rel.rstrip('/')}/out.json), then `handoff retry --force {job.handoff_id}`",
            handoff_id=job.handoff_id, code=ErrorCode.VALIDATION_FAILED)


# what the system says of a destination's path that it will say again at every attempt (a name
# too long, a permission, a read-only file system): the request is refused, not retried
REFUSED_ERRNOS = PERMANENT_ERRNOS | {errno.EACCES, errno.EPERM, errno.EROFS}
# the space a write needs, short for now: handed back uncounted as the shortages of descriptors
# and memory (is_shortage) are, with the limit it runs into
SPACE_LIMITS = {errno.ENOSPC: "the free space of the workspace's file system",
                errno.EDQUOT: "the disk quota of the daemon's user"}


def _refused(job: "Job", rel: str, exc: OSError | MemoryError,
             doing: str) -> InvalidDocument | HandlerError:
    """What an error the system gave ``doing`` something to the destination ``rel`` before the
    handler starts makes of the attempt: a passing shortage (descriptors, memory, space), a
    hand-back, uncounted (:func:`~handoffd.core.starts.shortage`); a refusal that every attempt
    would meet (:data:`REFUSED_ERRNOS`), VALIDATION_FAILED, not retried; anything else (an I/O
    error), a failure its retry policy retries. Each one line, naming the destination."""
    what = f"{job.specialist.agent}'s handler"
    if is_shortage(exc) or not isinstance(exc, OSError):  # (descriptors, memory)
        return check_shortage(job.context, what, f"{doing} {_shown(rel)}", exc)
    if exc.errno in SPACE_LIMITS:
        return shortage(job.context, what, errno.errorcode[exc.errno],
                        f"{exc.strerror} {doing} {_shown(rel)}", SPACE_LIMITS[exc.errno])
    if exc.errno in REFUSED_ERRNOS:
        return _unwritable(job.handoff_id, rel, doing, exc)
    return HandlerError(f"handoff {job.handoff_id}: expected_output.destination {_shown(rel)}: "
                        f"{doing} failed: {_words(exc)}", handoff_id=job.handoff_id,
                        retryable=True)


def _shown(rel: str) -> str:
    """``rel`` quoted for a line of a message, its middle left out when it is long (a path
    over PATH_MAX is kilobytes)."""
    return repr(rel) if len(rel) <= 200 else repr(f"{rel[:120]}...{rel[-60:]}")


def _words(exc: OSError) -> str:
    """``exc`` in a few words with its errno's name: "File name too long (ENAMETOOLONG)"."""
    return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, 'OSError')})"


def _unwritable(handoff_id: str, rel: str, doing: str, exc: OSError) -> InvalidDocument:
    """The refusal (VALIDATION_FAILED, one line) of a destination ``rel`` whose path the
    system refused (:data:`REFUSED_ERRNOS`) when ``doing`` something to it."""
    return InvalidDocument(
        f"handoff {handoff_id}: expected_output.destination {_shown(rel)} cannot be written: "
        f"the system refused {doing}: {_words(exc)}: name another destination, or fix its "
        f"folder, then `handoff retry --force {handoff_id}`", handoff_id=handoff_id,
        code=ErrorCode.VALIDATION_FAILED)


def _not_a_folder(ws: Workspace, folder: Path) -> str:
    """The first part of ``folder`` (under the workspace) that is there and is not a folder,
    relative to the workspace (``folder`` itself when none is found: it was swapped back)."""
    for part in reversed((folder, *folder.parents)):
        if part == ws.root or ws.root not in part.parents:
            continue
        if os.path.lexists(part) and not part.is_dir():
            return part.relative_to(ws.root).as_posix()
    return folder.relative_to(ws.root).as_posix() if ws.root in folder.parents else str(folder)


def digest(data: bytes) -> dict[str, Any]:
    return {"size_bytes": len(data), "sha256": sha256_hex(data)}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)


def _write(ws: Workspace, rel: str, data: bytes) -> None:
    """Write ``data`` atomically at ``rel``, a path under ``artifacts/``; InvalidDocument
    (VALIDATION_FAILED) when it resolves anywhere else now: a folder of it swapped for a
    symlink since it was checked (one into handoffs/pending/ planted a document there)."""
    target = ws.inside(rel)
    if target is None:
        raise InvalidDocument(f"artifact path {rel!r} points outside the workspace",
                              code=ErrorCode.VALIDATION_FAILED)
    if not _under_artifacts(ws, str(target)):
        raise InvalidDocument(f"artifact path {rel!r} resolves outside artifacts/ of the "
                              f"workspace, to {target.relative_to(ws.root).as_posix()}",
                              code=ErrorCode.VALIDATION_FAILED)
    target.parent.mkdir(parents=True, exist_ok=True)
    ws.tmp.mkdir(parents=True, exist_ok=True)
    fsio.replace(target, data, ws.tmp, durable=True)


def _folder_refused(handoff_id: str, problem: str, *, lost: bool = False) -> str:
    """The one-line message of a handoff whose own artifact folder cannot be used (``lost``:
    its result is not filed)."""
    return (f"handoff {handoff_id}: {'its result was not filed: ' if lost else ''}its content of "
            f"1 KB or more cannot be stored (seed 000's 1 KB rule): {problem}, then `handoff "
            f"retry --force {handoff_id}`")


def _make_own_folder(ws: Workspace, handoff_id: str) -> str | None:
    """Make ``artifacts/<id>/`` (the handoff's own folder: :func:`_id_part`) when missing; why it
    cannot hold files (:func:`own_folder_problem`), or None. OSError for a passing reason."""
    part = _id_part(handoff_id)
    problem = own_folder_problem(ws, part)
    if problem is None:
        try:
            (ws.artifacts / part).mkdir(parents=True)
        except FileExistsError:  # made meanwhile (by another attempt), or something else is there
            problem = own_folder_problem(ws, part)
    return problem


def _own_folder(ws: Workspace, handoff_id: str) -> None:
    """:func:`_make_own_folder`, raising InvalidDocument (VALIDATION_FAILED) for a folder that
    cannot hold files: the same on every attempt, so not retried."""
    problem = _make_own_folder(ws, handoff_id)
    if problem is not None:
        raise InvalidDocument(_folder_refused(handoff_id, problem), handoff_id=handoff_id,
                              code=ErrorCode.VALIDATION_FAILED)


def text_sink(ws: Workspace) -> ArtifactSink:
    """The engine's artifact sink: a large artifact's text goes to
    ``artifacts/<handoff_id>/<index>.txt`` (atomically) and the answer names that path. Never
    None (the text inline would make an answer its format's schema forbids) and nothing outside
    the workspace: a folder that cannot be used, or a failed write, raises OSError. ``collect``
    fails an attempt whose answer would meet an unusable folder before it is filed, so here
    that is a race; a passing reason (a full disk) takes the path docs/guarantees.md describes."""
    def store(handoff_id: str, index: int, text: str) -> str | None:
        relative = f"artifacts/{_id_part(handoff_id)}/{index}.txt"
        problem = _make_own_folder(ws, handoff_id)
        if problem is not None:  # an OSError: filing gives such a claim up (any other error
            # left it claimed until its lease lapsed), and the next attempt fails once (collect)
            raise OSError(errno.ENOTDIR, f"cannot store {relative}: {problem}")
        try:
            _write(ws, relative, text.encode("utf-8"))
        except InvalidDocument as exc:  # (a folder swapped for a link since: the same)
            raise OSError(errno.ENOTDIR, str(exc)) from None
        return relative
    return store


def _stopped(job: "Job") -> Stopped:
    """Whether ``job``'s attempt was stopped (cancelled, handed back) since it began."""
    return lambda: job.context.stop_requested


def _file_facts(ws: Workspace, ref: str, handoff_id: str,
                stopped: Stopped | None = None) -> dict[str, Any] | None:
    """size/sha256 of a workspace file named by ``ref`` (a path or a scheme-qualified reference
    such as a ``beads:`` context key); None when it names no file or is not confined."""
    try:
        target = confine_reference(ws, ref)
    except InvalidDocument:
        return None
    return _facts_at(target, ref, handoff_id, stopped)


def _facts_at(target: Path | None, ref: str, handoff_id: str | None,
              stopped: Stopped | None = None) -> dict[str, Any] | None:
    """size/sha256 of the confined file ``target``; None when there is none, or no file.
    InvalidDocument (VALIDATION_FAILED) when it is larger than :data:`MAX_ARTIFACT_BYTES`;
    OSError when the attempt is stopped while it is hashed, or when no descriptor is left to
    open it (a passing shortage, never "no file": :func:`collect` waits it out)."""
    import hashlib
    if target is None or not target.is_file():
        return None
    try:  # (resolved already) replaced by a FIFO since is_file(), it must not hang the worker
        fh = open_reading(target)
    except OSError as exc:
        if is_shortage(exc):  # no descriptor to open it with: not "no file" (collect waits)
            raise
        return None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_ARTIFACT_BYTES:  # before any byte is read: a sparse file costs nothing
            raise InvalidDocument(
                f"handoff {handoff_id}: artifact {ref!r} is {size} bytes, over the "
                f"{MAX_ARTIFACT_BYTES}-byte limit of an artifact handoffd hashes",
                handoff_id=handoff_id, code=ErrorCode.VALIDATION_FAILED)
        h = hashlib.sha256()
        size = 0
        for chunk in iter(lambda: fh.read(HASH_STEP), b""):
            h.update(chunk)
            size += len(chunk)
            if size > MAX_ARTIFACT_BYTES:  # it grew since fstat
                raise InvalidDocument(
                    f"handoff {handoff_id}: artifact {ref!r} grew over the "
                    f"{MAX_ARTIFACT_BYTES}-byte limit of an artifact handoffd hashes",
                    handoff_id=handoff_id, code=ErrorCode.VALIDATION_FAILED)
            if stopped is not None and stopped():  # cancelled or handed back: stop reading
                raise OSError(errno.ECANCELED, f"the attempt was stopped while {ref} was hashed")
    return {"size_bytes": size, "sha256": h.hexdigest()}


def _record(kind: str, *, name: str | None, ref: str | None, inline: str | None,
            facts: dict[str, Any] | None, metadata: dict[str, Any] | None,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = dict(metadata or {})
    rec: dict[str, Any] = {"artifact_type": kind}
    if name:
        rec["name"] = name
    if ref is not None:
        rec["path"] = ref
    rec["content_ref"] = ref
    rec["inline_content"] = inline if ref is None else None
    if facts:
        rec.update(facts)
        meta.update(facts)
    for key, value in (extra or {}).items():
        rec.setdefault(key, value)
    rec["metadata"] = meta
    return rec


def collect(job: "Job", outcome: Outcome, *, enforce: bool = True,
            host: str | None = None) -> Outcome:
    """Engine ``after_run`` hook: write contents to their destination or by the 1 KB rule and
    record every artifact with size and sha256. Only successful outcomes are touched; a problem
    (a path outside the workspace, a disk error) fails the attempt instead of raising. A missing
    output artifact at ``expected_output.destination`` fails it too, unless not ``enforce``
    (``[daemon] expectations = "advisory"``): then it is a warning of the result. ``host``
    (a store several hosts share): each artifact stored as a file here names this host beside
    its ``content_ref``, since the file is in this host's workspace. Any outcome to be filed
    is then checked by :func:`_answerable`. A passing shortage of descriptors or memory
    reading or storing them is waited out (:func:`~handoffd.core.results.wait_to_check_again`)
    and they are collected again, the attempt not charged; only one that outlasts every wait
    fails it, retryable."""
    if not outcome.succeeded:
        parked = outcome.status in PARKED or outcome.status == Status.THROTTLED
        return outcome if parked else _answerable(job, outcome)
    # what _collect replaces: put back before it starts again after a shortage cut it short
    given = (outcome.output, outcome.artifacts, outcome.warnings)
    rechecks = 0
    while True:
        try:
            collected = _collect(job, outcome, enforce)
            if host:
                name_host(collected.artifacts, host)
            if collected.output is None and not collected.artifacts:
                return collected  # (nothing to store: _answerable's own first answer)
            return _answerable(job, collected)
        except InvalidDocument as exc:
            code, message, retryable = exc.code, str(exc), False
            break
        except MemoryError as exc:  # (a shortage: it escaped, and stranded the claim)
            words = shortage_words(exc)
        except OSError as exc:
            space = SPACE_LIMITS.get(exc.errno or 0)
            if not is_shortage(exc) and space is None:  # a disk error may pass; a name the
                # system refuses won't
                code, message, retryable = ErrorCode.PROCESSING_ERROR, f"handoff " \
                    f"{job.handoff_id}: cannot store artifacts: {exc.strerror or exc}", \
                    exc.errno not in PERMANENT_ERRNOS
                break
            # (a full disk or quota is waited out as a shortage is: it was a counted failure,
            # and the handler, which had done its work, ran again: review RG)
            words = shortage_words(exc) if space is None else \
                f"{exc.strerror or exc} ({errno.errorcode[exc.errno or 0]}: {space})"
        # a passing shortage (descriptors, memory, space) reading or storing them: no fault of the
        # result's, nor a reason to charge the attempt (a last one was filed in failed/): the
        # same artifacts are collected again after a wait, the handler not run again
        try:
            again = wait_to_check_again(job, "its artifacts could not be read or stored",
                                        words, rechecks)
        except HandlerError as exc:  # cancelled meanwhile: filed cancelled
            ended = failed(outcome.started_at or job.started_at,
                           outcome.finished_at or job.started_at, exc.code, str(exc),
                           retryable=False)
            ended.executed_by = outcome.executed_by
            return _answerable(job, ended)
        if not again:  # still short after every wait: a failed attempt, retryable
            code, message, retryable = ErrorCode.PROCESSING_ERROR, f"handoff " \
                f"{job.handoff_id}: cannot store artifacts for now: {words}", True
            break
        rechecks += 1
        outcome.output, outcome.artifacts, outcome.warnings = given
    return _answerable(job, Outcome(
        status="failed", started_at=outcome.started_at, finished_at=outcome.finished_at,
        output=outcome.output, metadata=outcome.metadata, warnings=outcome.warnings,
        error={"code": code, "message": message, "retryable": retryable},
        executed_by=outcome.executed_by))


def _answerable(job: "Job", outcome: Outcome) -> Outcome:
    """``outcome``, unless its answer would keep content of 1 KB or more (seed 000's 1 KB rule:
    the engine's sink, :func:`text_sink`) in a folder that cannot hold it
    (:func:`own_folder_problem`): then a failure in its place, ``VALIDATION_FAILED``, not
    retried (the same every attempt), its message saying what to move, with no output or
    artifacts (so that its own answer needs no folder). Filed any other way, the answer either
    broke its schema (the text inline) or failed filing again and again, the handler rerun each
    time. Cheap for most outcomes: under 1 KB of JSON nothing is stored, and the answer is
    rendered (on a copy) only when the handoff's folder has a problem."""
    if (outcome.output is None and not outcome.artifacts) or _json_bytes(outcome) < INLINE_LIMIT:
        return outcome  # (the first: no encoding at all, for a result with nothing to store)
    ws = workspace_at(str(job.context.root))
    try:
        if own_folder_problem(ws, _id_part(job.handoff_id)) is None:
            return outcome
        problems = [(stored_id, own_folder_problem(ws, _id_part(stored_id)))
                    for stored_id in _stored_ids(job, outcome)]
    except OSError:  # (cannot be looked at: a passing reason, met again when it is filed)
        return outcome
    refused = [(stored_id, problem) for stored_id, problem in problems if problem is not None]
    if not refused:
        return outcome
    stored_id, problem = refused[0]
    message = _folder_refused(stored_id, problem, lost=True)
    earlier = str((outcome.error or {}).get("message"))
    if outcome.error and earlier != _folder_refused(stored_id, problem):  # (not said already)
        message += f" (the attempt had failed: {outcome.error.get('code')}: {earlier[:300]})"
    return Outcome(status="failed", started_at=outcome.started_at,
                   finished_at=outcome.finished_at, metadata=outcome.metadata,
                   warnings=outcome.warnings, executed_by=outcome.executed_by,
                   fields=outcome.fields,
                   error={"code": ErrorCode.VALIDATION_FAILED,
                          "message": message, "retryable": False})


def _json_bytes(outcome: Outcome) -> int:
    """UTF-8 bytes of ``outcome``'s output and artifacts as JSON: no text of theirs a format
    stores (a string, or a value as JSON: a part of this) is longer."""
    try:
        text = json.dumps([outcome.output, outcome.artifacts], ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):  # (its format cannot render it either)
        return 0
    return len(text.encode("utf-8", "surrogatepass"))


def _stored_ids(job: "Job", outcome: Outcome) -> list[str]:
    """The ids under which filing ``outcome`` stores content in the sink: its answer rendered
    on a copy with a sink that records the calls and writes nothing."""
    calls: list[str] = []

    def record(handoff_id: str, index: int, text: str) -> str | None:
        calls.append(handoff_id)
        return f"artifacts/{_id_part(handoff_id)}/{index}.txt"
    try:
        job.dialect.render(copy.deepcopy(job.claim.doc), outcome, FiledState(0, 0, False),
                           artifacts=record)
    except Exception:  # (a format that cannot render it fails its filing, which says so)
        return []
    return list(dict.fromkeys(calls))


def name_host(artifacts: list[Any], host: str) -> None:
    """Add ``host`` to every artifact whose ``content_ref`` is a file of this workspace (a URL
    names its own host)."""
    for record in artifacts:
        ref = record.get("content_ref") if isinstance(record, dict) else None
        if isinstance(ref, str) and ref and "://" not in ref:
            record.setdefault("host", host)
            if isinstance(record.get("metadata"), dict):
                record["metadata"].setdefault("host", host)


def _collect(job: "Job", outcome: Outcome, enforce: bool) -> Outcome:
    root = str(job.context.root)  # (the engine's workspace root, resolved)
    ws = workspace_at(root)
    handoff_id = job.handoff_id
    records: list[dict[str, Any]] = []
    used_names: set[str] = set()
    dest_rel = job.context.artifact_rel
    kind_default = expected_type(job.claim.doc) or "output"

    output = outcome.output
    if isinstance(output, dict) and "content" in output:
        text = _text(output["content"])
        data = text.encode("utf-8")
        rel = None
        if isinstance(dest_rel, str):
            rel = dest_rel
        elif len(data) >= INLINE_LIMIT:
            _own_folder(ws, handoff_id)
            rel = f"artifacts/{_id_part(handoff_id)}/output{'.txt' if isinstance(output['content'], str) else '.json'}"
        if rel is not None:
            try:
                _write(ws, rel, data)
            except OSError as exc:  # a name too long for the system: every attempt's
                if rel != dest_rel or exc.errno not in REFUSED_ERRNOS:
                    raise  # (a passing one: collect's to wait out or retry)
                raise _unwritable(handoff_id, rel, "writing it", exc) from None
            used_names.add(rel)
            moved = {k: v for k, v in output.items() if k != "content"}
            moved.setdefault("artifact_id", Path(rel).stem)
            moved["artifact_path"] = rel
            moved.setdefault("artifact_type", kind_default)
            outcome.output = moved
            records.append(_record(str(moved["artifact_type"]), name=Path(rel).name, ref=rel,
                                   inline=None, facts=digest(data), metadata=None))
    elif isinstance(dest_rel, str) and os.path.isfile(os.path.join(root, dest_rel)):
        # the handler wrote the destination itself: point the output at it
        facts = _file_facts(ws, dest_rel, handoff_id, _stopped(job))
        if isinstance(output, dict) or output is None:
            moved = dict(output or {})
            moved.setdefault("artifact_id", Path(dest_rel).stem)
            moved.setdefault("artifact_path", dest_rel)
            moved.setdefault("artifact_type", kind_default)
            outcome.output = moved
        records.append(_record(kind_default, name=Path(dest_rel).name, ref=dest_rel, inline=None,
                               facts=facts, metadata=None))
        used_names.add(dest_rel)

    for index, item in enumerate(outcome.artifacts, start=1):
        records.append(_one(ws, handoff_id, index, item, used_names, _stopped(job)))
    reported = False  # the output names an artifact file that exists (its own destination)
    if isinstance(outcome.output, dict) and isinstance(outcome.output.get("artifact_path"), str) \
            and outcome.output["artifact_path"] not in used_names:
        ref = outcome.output["artifact_path"]
        confine_reference(ws, ref, handoff_id=handoff_id)
        facts = _file_facts(ws, ref, handoff_id, _stopped(job))
        if facts:
            reported = True
            records.insert(0, _record(str(outcome.output.get("artifact_type") or kind_default),
                                      name=Path(ref).name, ref=ref, inline=None, facts=facts,
                                      metadata=None))
    if isinstance(dest_rel, str) and dest_rel not in used_names and not reported:
        # seed 001: the request asked for an output artifact
        problem = (f"handoff {handoff_id}: expected_output.destination asks for {dest_rel}, but "
                   "the specialist neither wrote it, nor returned output.content to put there, "
                   "nor named an existing output.artifact_path")
        if enforce:
            raise InvalidDocument(problem, handoff_id=handoff_id, code=ErrorCode.VALIDATION_FAILED)
        outcome.warnings = [f"{ErrorCode.VALIDATION_FAILED}: {problem}", *outcome.warnings]
    outcome.artifacts = records
    return outcome


def _one(ws: Workspace, handoff_id: str, index: int, item: Any, used: set[str],
         stopped: Stopped | None = None) -> dict[str, Any]:
    if isinstance(item, str):
        item = {"path": item}
    if not isinstance(item, dict):
        item = {"content": item}
    kind = str(item.get("artifact_type") or item.get("type") or "data")
    name = item.get("name") if isinstance(item.get("name"), str) else None
    metadata = item.get("metadata") if isinstance(item.get("metadata"), dict) else None
    extra = {k: v for k, v in item.items() if k in ("description", "artifact_id")}
    content: Any = None
    has_content = False
    if item.get("inline_content") is not None:
        content, has_content = item["inline_content"], True
    elif "content" in item:
        content, has_content = item["content"], True
    if has_content:
        text = _text(content)
        data = text.encode("utf-8")
        if len(data) < INLINE_LIMIT:
            return _record(kind, name=name, ref=None, inline=text, facts=digest(data),
                           metadata=metadata, extra=extra)
        filename = _file_name(name) if name else f"artifact-{index}{'.txt' if isinstance(content, str) else '.json'}"
        rel = f"artifacts/{_id_part(handoff_id)}/{filename}"
        if rel in used:
            rel = f"artifacts/{_id_part(handoff_id)}/{index}-{filename}"
        _own_folder(ws, handoff_id)
        _write(ws, rel, data)
        used.add(rel)
        return _record(kind, name=name or filename, ref=rel, inline=None, facts=digest(data),
                       metadata=metadata, extra=extra)
    ref = item.get("path") or item.get("artifact_path") or item.get("content_ref")
    if isinstance(ref, str) and ref:
        target = confine_reference(ws, ref, handoff_id=handoff_id)
        facts = _facts_at(target, ref, handoff_id, stopped)
        # a file of the workspace must be there; a URL is taken on trust (never read), and so
        # is a beads: context key (the context is shared: another agent may write it later)
        if target is not None and facts is None and not ref.lower().startswith("beads:"):
            raise InvalidDocument(
                f"handoff {handoff_id}: artifacts[{index - 1}] names {ref!r}, which is not a "
                "file in the workspace (every artifact is recorded with its size and sha256)",
                handoff_id=handoff_id, code=ErrorCode.VALIDATION_FAILED)
        used.add(ref)
        return _record(kind, name=name or Path(ref).name, ref=ref, inline=None,
                       facts=facts, metadata=metadata, extra=extra)
    return _record(kind, name=name, ref=None, inline="", facts=digest(b""), metadata=metadata,
                   extra=extra)
