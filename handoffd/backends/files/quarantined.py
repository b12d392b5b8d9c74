"""The quarantine listing (``handoff ls --state quarantined``): every entry set aside in
``handoffs/.quarantine/``, each with the reason published beside it, its fields checked (a
forged reason's list or 1e308 is no field, an entry without a usable reason is listed
UNREADABLE_FILE). Read through a folder opened without following a link. Setting entries aside
is :mod:`.quarantine`.
"""
from __future__ import annotations

import os
import re
from typing import Any

from ...core import jsontext, ownfiles
from ...core.errors import ErrorCode, InvalidDocument
from ...core.timeutil import iso, parse_utc
from ...core.workspace import Workspace

__all__ = ["MAX_REASON_BYTES", "MAX_REASON_TEXT", "REASON", "quarantined"]

MAX_REASON_BYTES = 1 << 20  # a quarantine reason, read whole
REASON = ".reason.json"
MAX_REASON_TEXT = 2000  # characters of a reason's message (or file) listed; the rest cut
_REASON_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")  # an error code, as handoffd records one
_REASON_TEMP = re.compile(r"\..*\.reason\.[0-9a-f]{16}\.tmp", re.DOTALL)  # being published


def quarantined(ws: Workspace) -> list[dict[str, Any]]:
    """Every entry set aside in the quarantine folder, oldest first (their names start with the
    time), with its reason: ``stored_as`` (its name), and the ``code``, ``message``, ``at``,
    ``file`` and ``from`` its ``.reason.json`` gives, each kept only as a string of bounded
    length (an error code; a time, given in UTC). An entry whose reason is missing, unreadable,
    too large or names no error code is listed too, as UNREADABLE_FILE "reason unreadable:
    ...": listed by its reasons, it was hidden, and a forged reason's fields (a list, 1e308)
    were shown as they came. The folder is opened without following a symlink."""
    try:
        folder = ownfiles.open_folder(ws.quarantine)
    except OSError:  # missing, or no plain folder of the workspace: nothing was set aside there
        return []
    try:
        found = set(os.listdir(folder))
        # (a reason is X.reason.json beside X; an entry set aside under a name ending so, from
        # a file called that, has its own reason beside it; an orphan reason is no entry)
        reasons = {name for name in found if name.endswith(REASON)
                   and (name[:-len(REASON)] in found or name + REASON not in found)}
        return [_set_aside_entry(folder, name) for name in sorted(found - reasons)
                if not _REASON_TEMP.fullmatch(name)]
    finally:
        os.close(folder)


def _set_aside_entry(folder: int, name: str) -> dict[str, Any]:
    """The listing's item for the entry ``name`` of the quarantine ``folder`` (a descriptor)."""
    shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") \
        if not name.isascii() else name  # (a name that is no UTF-8 could not be printed)
    try:
        reason = jsontext.parse_document(
            ownfiles.read_regular(name + REASON, MAX_REASON_BYTES, dir_fd=folder), "its reason")
    except FileNotFoundError:
        return _unreadable_reason(shown, f"no {REASON} beside it")
    except OSError as exc:  # a folder or FIFO there, or one over MAX_REASON_BYTES (EFBIG)
        return _unreadable_reason(shown, exc.strerror or type(exc).__name__)
    except InvalidDocument as exc:
        return _unreadable_reason(shown, str(exc)[:200])
    item: dict[str, Any] = {"stored_as": shown}
    for key in ("file", "from", "message"):
        if isinstance(text := reason.get(key), str):
            item[key] = text if len(text) <= MAX_REASON_TEXT else text[:MAX_REASON_TEXT] + "..."
    if isinstance(at := reason.get("at"), str) and len(at) <= 64:
        try:
            item["at"] = iso(parse_utc(at))
        except ValueError:
            pass  # not a time: left out
    code = reason.get("code")
    if not (isinstance(code, str) and _REASON_CODE.fullmatch(code)):
        return {**_unreadable_reason(shown, "it names no error code"),
                **({"at": item["at"]} if "at" in item else {})}
    return {**item, "code": code}


def _unreadable_reason(shown: str, why: str) -> dict[str, Any]:
    return {"stored_as": shown, "code": ErrorCode.UNREADABLE_FILE,
            "message": f"reason unreadable: {why}"}
