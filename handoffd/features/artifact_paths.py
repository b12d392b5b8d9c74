"""Where a handoff's artifacts may go and what its artifact references may name: paths only,
no artifact is written or hashed here (that is :mod:`.artifacts`).

* **Destination** (seed 001): a request's ``expected_output.destination`` such as
  ``artifacts/phase-13-react/artifact-react-comp-{timestamp}.json`` is resolved before the handler
  runs (:func:`resolve_destination`). Placeholders: ``{timestamp}`` (Unix milliseconds),
  ``{handoff_id}`` / ``{id}``, ``{attempt}``, ``{agent}`` (the specialist, without ``@``),
  ``{date}`` (YYYYMMDD). The path must stay under ``artifacts/`` (a destination not starting with
  ``artifacts/`` is placed under it), and out of another handoff's own folder
  ``artifacts/<its id>/`` (where handoffd keeps that handoff's large contents), nor that folder's
  name itself: such a destination fails ``SCHEMA_VALIDATION_FAILED``, so no request can make
  handoffd overwrite an artifact another handoff filed with its sha256. It names a file: one
  ending in ``/`` (or ``/.``, ``/..``) or holding a NUL byte fails the same way.
* **Names**: the folder part naming a handoff's artifacts (:func:`_id_part`) and the file name of
  an artifact the handler named (:func:`_file_name`), both safe on any file system. Whether that
  folder can hold the handoff's files (:func:`own_folder_problem`: a folder of the workspace, or
  none yet; never a file, a FIFO or a symlink in its place).

**References** a handler reports (``path`` / ``artifact_path`` / ``content_ref``) are confined by
:func:`confine_reference`: a plain path must resolve inside the workspace; ``beads:KEY`` must be a
safe context key (no ``..``, no leading ``/``, no empty segments: see context_store) and resolve
inside ``context/``; any other scheme-qualified reference (``file:``, ``artifact:``, ...) is a
workspace-relative path: no ``..`` segment, nothing absolute (``/``, ``\\``, ``~``, a drive
letter), also after %-decoding, and it must resolve inside the workspace (symlinks included). Only
a URL with a host (``https://host/...``, not ``file://``) is an external reference; it is recorded,
never read, and may not contain ``..`` segments either. Anything else fails the attempt with
``VALIDATION_FAILED``.
"""
from __future__ import annotations

import functools
import os
import re
import stat
import time
import unicodedata
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from ..core.errors import ErrorCode, InvalidDocument
from ..core.hashing import sha256_hex
from ..core.states import State
from ..core.workspace import Workspace

KNOWN = ("timestamp", "handoff_id", "id", "attempt", "agent", "date")


class Patterns:
    """This module's regexes (:func:`patterns`)."""

    def __init__(self) -> None:
        self.placeholder = re.compile(r"\{([^{}]*)\}")
        self.safe_part = re.compile(r"[^A-Za-z0-9._-]+")
        self.scheme = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.DOTALL)
        self.url = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/\\?#\s]+)(.*)", re.DOTALL)
        self.drive = re.compile(r"[A-Za-z]:")
        self.hashed_part = re.compile(r".+-[0-9a-f]{10}")  # a non-plain id's part (_id_part)


@functools.cache
def patterns() -> Patterns:
    """The regexes, compiled when an artifact is first looked at: not by every daemon and
    `handoff ls` that loads this module (about 0.7 ms of their start)."""
    return Patterns()


def _traverses(text: str) -> bool:
    """True when ``text`` (or its %-decoding, or its NFKC form) has a ``..`` segment, is
    absolute, or holds a control character."""
    forms = {text}
    decoded = text
    for _ in range(3):  # %252e%252e -> %2e%2e -> ..
        decoded = urllib.parse.unquote(decoded)
        forms.add(decoded)
    forms |= {unicodedata.normalize("NFKC", f) for f in list(forms)}
    for form in forms:
        if any(ord(c) < 32 or ord(c) == 127 for c in form):
            return True
        stripped = form.strip()
        if stripped.startswith(("/", "\\", "~")) or patterns().drive.match(stripped):
            return True
        if any(part.strip() == ".." for part in re.split(r"[/\\]", form)):
            return True
    return False


def confine_reference(ws: Workspace, ref: str, *, handoff_id: str | None = None) -> Path | None:
    """The workspace file an artifact reference names (None for an external URL, which is never
    read); InvalidDocument (VALIDATION_FAILED) when the reference could reach outside the
    workspace. See the module docstring for the rules."""
    def refuse(why: str) -> InvalidDocument:
        prefix = f"handoff {handoff_id}: " if handoff_id else ""
        return InvalidDocument(f"{prefix}artifact reference {ref!r} {why}", handoff_id=handoff_id,
                               code=ErrorCode.VALIDATION_FAILED)

    if not isinstance(ref, str) or not ref.strip():
        raise refuse("is empty")
    if "\x00" in ref:
        raise refuse("contains a NUL byte")
    url = patterns().url.fullmatch(ref)
    if url and url.group(1).lower() != "file":
        if _traverses(url.group(3).lstrip("/")):
            raise refuse("has a '..' segment or a control character")
        return None
    scheme = patterns().scheme.fullmatch(ref)
    if scheme and len(scheme.group(1)) > 1:  # one letter: a Windows drive, refused below
        name, rest = scheme.group(1).lower(), scheme.group(2)
        if name == "beads":
            from .context import (
                normalise_key,  # context_store imports nothing from here
            )

            if _traverses(rest):
                raise refuse("escapes context/ (no '..', no absolute path)")
            try:
                key = normalise_key(ref)
            except InvalidDocument:
                raise refuse("is not a safe context key (segments of letters, digits and ._@+=- "
                              "separated by '/')") from None
            target = ws.inside(f"context/{key}.json")
            context_root = ws.context.resolve()
            if target is None or context_root not in target.parents:
                raise refuse("resolves outside context/ of the workspace")
            return target
        if _traverses(rest):
            raise refuse("escapes the workspace (no '..', no absolute path)")
        target = ws.inside(urllib.parse.unquote(rest))
        if target is None:
            raise refuse("resolves outside the workspace")
        return target
    if patterns().drive.match(ref) or "\x00" in ref:
        raise refuse("is an absolute path outside the workspace")
    target = ws.inside(ref)
    if target is None:
        raise refuse("points outside the workspace")
    return target


def _safe(text: str) -> str:
    return patterns().safe_part.sub("_", text).strip("._") or "x"


# a file name derived from the name a handler gave an artifact is cut to this many characters
# (ASCII, see _safe), well within NAME_MAX (255 bytes) with room for the "<index>-" a clash
# adds: a 3,000-character name once failed the attempt with "File name too long", retried
MAX_DERIVED_NAME = 120


def _file_name(name: str) -> str:
    """The file name of an artifact the handler named ``name``: its :func:`_safe` form, and when
    that is longer than MAX_DERIVED_NAME, its start, a digest of ``name`` and its extension."""
    safe = _safe(name)
    if len(safe) <= MAX_DERIVED_NAME:
        return safe
    stem, dot, suffix = safe.rpartition(".")
    ext = f".{suffix}" if dot and stem and len(suffix) <= 16 else ""
    digest = sha256_hex(name.encode("utf-8", "surrogatepass"))[:10]
    return f"{safe[:MAX_DERIVED_NAME - len(ext) - 11].rstrip('._') or 'x'}-{digest}{ext}"


def _id_part(handoff_id: str) -> str:
    """The path part naming a handoff's artifacts: the id itself when it is made of letters,
    digits and ``._-`` only, else its :func:`_safe` form and a digest of the id. Ids may hold
    ``@ : +``; mapping them to ``_`` alone put ``job@1`` and ``job_1`` in one folder, where each
    overwrote the other's artifact and a filed sha256 no longer matched its file."""
    plain = _safe(handoff_id)
    if plain == handoff_id:
        return plain
    from ..core.hashing import sha256_hex
    return f"{plain}-{sha256_hex(handoff_id.encode('utf-8', 'surrogatepass'))[:10]}"


def _kind(mode: int) -> str:
    """What a file of ``mode`` (from ``lstat``) is, in a few words."""
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a folder"


def own_folder_problem(ws: Workspace, part: str) -> str | None:
    """Why ``artifacts/<part>/`` (``part`` from :func:`_id_part`), where handoffd keeps a handoff's
    contents of 1 KB or more, cannot hold them, and what to do about it (one line); None when it
    can (a folder of the workspace, or missing: it is made then). ``artifacts/`` leading out of
    the workspace, or anything but a folder in its place or the handoff's, is such a reason.
    A symlink at ``artifacts/<part>`` is refused even when it points inside the workspace:
    through it handoffd would overwrite another handoff's files, whose sha256 it filed. OSError
    when it cannot be looked at (a permission: a passing reason)."""
    real = ws.inside("artifacts")
    if real is None:
        return (f"artifacts/ leads out of the workspace (to {os.path.realpath(ws.artifacts)}), "
                "where handoffd writes nothing: make artifacts/ a folder of the workspace")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        if os.path.lexists(ws.artifacts):  # a symlink to nothing: no folder can be made there
            return f"artifacts is a symbolic link to {real}, which does not exist: make it a folder"
        return None  # made when the first artifact is stored
    if not stat.S_ISDIR(mode):
        return f"artifacts is {_kind(mode)}, not a folder: move it away"
    try:
        mode = os.lstat(real / part).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode):
        return None
    return f"artifacts/{part} is {_kind(mode)}, not a folder: move it away"


def destination_template(doc: dict[str, Any]) -> str | None:
    """``expected_output.destination`` of a request (also looked up in a kept request snapshot)."""
    for src in (doc, (doc.get("handoffd") or {}).get("request_snapshot") if isinstance(doc.get("handoffd"), dict) else None):
        if isinstance(src, dict):
            expected = src.get("expected_output")
            if isinstance(expected, dict) and isinstance(expected.get("destination"), str) \
                    and expected["destination"].strip():
                return expected["destination"].strip()
    return None


def resolve_destination(ws: Workspace, template: str, *, handoff_id: str, attempt: int, agent: str,
                        now_ms: int | None = None) -> tuple[str, Path]:
    """(relative path, absolute path) of a destination template; InvalidDocument when it uses an
    unknown placeholder or leaves ``artifacts/``."""
    rel, where, _ = destination(ws, template, handoff_id=handoff_id, attempt=attempt,
                                agent=agent, now_ms=now_ms)
    return rel, Path(where)


def destination(ws: Workspace, template: str, *, handoff_id: str, attempt: int, agent: str,
                now_ms: int | None = None) -> tuple[str, str, bool]:
    """:func:`resolve_destination` (the absolute path as text), and whether the destination is
    ready as it stands: its folder there, a plain folder of the workspace, and nothing at the
    path itself (what the lookups that resolved it saw: the caller needs no look of its own;
    False: look)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    # each value made when the template asks for it (every handoff of a drain resolves one; a
    # partial of a builtin is no Python call)
    values: dict[str, Callable[[], str]] = {
        "timestamp": functools.partial(str, now_ms), "handoff_id": lambda: _id_part(handoff_id),
        "id": lambda: _id_part(handoff_id), "attempt": functools.partial(str, attempt),
        "agent": lambda: _safe(agent.lstrip("@")),
        "date": lambda: time.strftime("%Y%m%d", time.gmtime(now_ms / 1000))}

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise InvalidDocument(
                f"handoff {handoff_id}: expected_output.destination {template!r} uses unknown "
                f"placeholder {{{name}}}; known: {', '.join('{' + k + '}' for k in KNOWN)}",
                handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
        return values[name]()

    text = patterns().placeholder.sub(sub, template).replace("\\", "/")
    if text.startswith("./"):
        text = text[2:]
    if not text.startswith("artifacts/"):
        text = "artifacts/" + text.lstrip("/")
    if text.endswith(("/", "/.", "/..")):
        # a folder, not a file: handoffd wrote a file `artifacts/p` for `artifacts/p/` and filed
        # the path with its slash, and a handler that wrote $HANDOFF_ARTIFACT_PATH was failed
        raise InvalidDocument(f"handoff {handoff_id}: expected_output.destination {template!r} "
                              "ends in '/' (or '/.', '/..'): it names a folder, where the output "
                              f"artifact is a file: name a file, e.g. {text.rstrip('/.')}/out.json",
                              handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
    if "\x00" in text:  # (no file name holds one: its first look would raise ValueError)
        raise InvalidDocument(f"handoff {handoff_id}: expected_output.destination {template!r} "
                              "holds a NUL byte, which no file name can",
                              handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
    root = str(ws.root)
    where = _fresh_path(root, text)  # (the usual case: resolved and checked by its own lookups)
    ready = where is not None
    if where is None:
        found = ws.inside(text)
        where = None if found is None else str(found)
        if where is None or not _under_artifacts(ws, where):
            raise InvalidDocument(f"handoff {handoff_id}: expected_output.destination "
                                  f"{template!r} points outside artifacts/ of the workspace",
                                  handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
    other = _other_handoffs_folder(ws, text, handoff_id, root)
    if other is not None:
        where_it_is = (f"is artifacts/{other}, where the artifact folder of handoff {other} "
                       "(not finished yet) goes" if text.count("/") == 1 else
                       f"lies in artifacts/{other}/, the artifact folder of another handoff")
        raise InvalidDocument(f"handoff {handoff_id}: expected_output.destination {template!r} "
                              f"{where_it_is}; handoffd does not write there",
                              handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED)
    return text, where, ready


def _fresh_path(root: str, rel: str) -> str | None:
    """The absolute path of ``rel`` (under ``artifacts/``) in the workspace whose resolved root
    is ``root``, when it is the usual destination of a first attempt: every part but the last
    a plain folder (no symlink: ``lstat``), the last missing, and no part empty, ``.`` or
    ``..``. Such a path is its own real path inside the root and under its artifacts/ folder,
    so it is what
    :meth:`~handoffd.core.workspace.Workspace.inside` would resolve it to, and the same lookups
    say that its folder is there and nothing is at the path. None for anything else (a
    symlink, a file in the way, a destination already written): the caller resolves it the
    full way (:meth:`Workspace.inside <handoffd.core.workspace.Workspace.inside>`) and looks."""
    parts = rel.split("/")
    if root == "/" or "" in parts or "." in parts or ".." in parts:
        return None
    path = root
    for part in parts[:-1]:
        path += "/" + part
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # (a symlink is no S_ISDIR of lstat)
                return None
        except (OSError, ValueError):  # missing, unreadable, a NUL byte: the full way says
            return None
    path += "/" + parts[-1]
    try:
        os.lstat(path)
    except FileNotFoundError:
        return path
    except (OSError, ValueError):
        return None
    return None  # (something is there already: the full way looks at it)


def _other_handoffs_folder(ws: Workspace, rel: str, handoff_id: str,
                           root: str | None = None) -> str | None:
    """The folder ``artifacts/<part>/`` that ``rel`` lies in, or the file ``artifacts/<part>``
    that it is, when that is another handoff's own folder (:func:`_id_part`): ``part`` is not
    this handoff's, and names a handoff of the workspace's store (a document
    ``handoffs/<state>/<part>.json``), or has the form of a non-plain id's part
    (``name-<10 hex digits>``) and exists. None otherwise: shared folders such as
    ``artifacts/phase-13-react/`` stay usable. ``root``: ``ws.root`` as text, when at hand."""
    parts = rel.split("/")
    if len(parts) < 2 or parts[0] != "artifacts":
        return None
    part = parts[1]
    if len(parts) == 2:  # the file artifacts/<part>: in the way of the folder of a handoff not
        # finished yet only (a finished one makes none: a per-handoff name, as any template
        # without a folder gives, looked up each time, cost a look in every state and filled
        # the memory below; and a finished namesake refused it for good: RG)
        if part == _id_part(handoff_id) or part in ("", ".", ".."):
            return None
        live = (ws.doc_file(State.PENDING, part), ws.doc_file(State.IN_PROGRESS, part))
        return part if any(os.path.lexists(path) for path in live) else None
    key = (root or str(ws.root), part)
    # every handoff of a drain names the same shared folder: what its first look found is
    # remembered (its documents' paths), and only what can turn that answer is looked at again,
    # a document of that name in a state folder (a handoff created since: its folder at once)
    documents = _SHARED.get(key)
    if documents is not None:
        for path in documents:
            try:
                os.lstat(path)
                break  # (there now: the full look below says whose it is)
            except (OSError, ValueError):
                pass
        else:
            return None
    if part == _id_part(handoff_id) or part in ("", ".", ".."):
        return None
    paths = tuple(str(ws.doc_path(state, part)) for state in State)
    if any(os.path.lexists(path) for path in paths):
        return part
    if patterns().hashed_part.fullmatch(part):
        if os.path.isdir(ws.artifacts / part):
            return part
        return None  # (not remembered: a folder of this form made later is a handoff's)
    if len(_SHARED) >= SHARED_REMEMBERED:
        _SHARED.clear()
    _SHARED[key] = paths
    return None


# shared destination folders (no handoff's own) seen lately, with the paths of the documents
# that would make them a handoff's: a drain of handoffs that all write to
# artifacts/phase-13-react/ makes one lstat a state per handoff, no path built and no regex
SHARED_REMEMBERED = 256
_SHARED: dict[tuple[str, str], tuple[str, ...]] = {}


def _under_artifacts(ws: Workspace, resolved: str) -> bool:
    """True when ``resolved`` (a path already resolved) lies under the workspace's artifacts/
    folder, itself resolved: the plain folder needs no system call, a symlinked one is looked up."""
    plain = os.path.join(str(ws.root), "artifacts") + os.sep
    if resolved.startswith(plain):  # every component of it is resolved: artifacts/ is a folder
        return True
    real = os.path.realpath(ws.artifacts)  # itself when it does not exist yet
    return resolved.startswith(real.rstrip(os.sep) + os.sep)
