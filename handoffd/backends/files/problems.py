"""Why a file in a state folder cannot be read: the files backend's diagnosis of OS refusals
(a socket, EACCES), invalid documents and readers that choke (or run out of memory: transient,
see :func:`~handoffd.core.memorystrikes.out_of_memory`), as :class:`UnreadableDocument`."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ...core.errors import (
    SHORTAGE_ERRNOS,
    ErrorCode,
    InvalidDocument,
    UnreadableDocument,
    shortage_words,
)
from ...core.memorystrikes import out_of_memory

# errors that say "not now" rather than "never": a file hit by them is looked at again later,
# never set aside
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR,
                              errno.ENOBUFS, errno.ESTALE, errno.EBUSY})


def read_error(path: Path, exc: BaseException, handoff_id: str | None = None) -> UnreadableDocument:
    """Describe an unexpected error met while reading or routing the document at ``path``."""
    where = f"{path.parent.name}/{path.name}"
    if isinstance(exc, UnreadableDocument):
        return exc
    if isinstance(exc, InvalidDocument):
        return UnreadableDocument(str(exc), handoff_id=handoff_id, code=exc.code, claimable=True)
    if isinstance(exc, OSError):
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):  # a socket or device: open() fails (ENXIO) before fstat sees it
            kind = "socket" if stat.S_ISSOCK(mode) else "special file"
            return UnreadableDocument(f"{where} is a {kind}; documents must be regular files",
                                      handoff_id=handoff_id, code=ErrorCode.NOT_A_REGULAR_FILE)
        if exc.errno in SHORTAGE_ERRNOS:  # no descriptor (or memory) to spare: the limit named
            return UnreadableDocument(f"{where} cannot be read for now: {shortage_words(exc)}",
                                      handoff_id=handoff_id, code=ErrorCode.UNREADABLE_FILE,
                                      shortage=True)
        name = errno.errorcode.get(exc.errno or 0, "error")
        return UnreadableDocument(f"{where} cannot be read: {exc.strerror or exc} ({name})",
                                  handoff_id=handoff_id, code=ErrorCode.UNREADABLE_FILE,
                                  transient=exc.errno in TRANSIENT_ERRNOS)
    if isinstance(exc, MemoryError):  # "not now" too: read again later, set aside only after
        return out_of_memory(handoff_id or str(path), where)  # running out again and again
    hint = " (it nests too deeply)" if isinstance(exc, RecursionError) else ""
    return UnreadableDocument(f"{where} could not be processed{hint}: {type(exc).__name__}: "
                              f"{str(exc)[:200]}", handoff_id=handoff_id,
                              code=ErrorCode.UNPROCESSABLE_DOCUMENT)
