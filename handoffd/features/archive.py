"""The archive of finished handoffs: ``handoffs/.archive/YYYY-MM-DD.jsonl.gz``.

Retention (:mod:`handoffd.features.retention`) appends each handoff it archives to today's file:
one JSON object per line (``id``, ``state``, ``archived_at``, ``document``); gzip members
appended, so the file stays readable after a crash mid-write; never appended after a torn one:
``YYYY-MM-DD-1.jsonl.gz``, ``-2``... are started instead. An append is flushed to disk before
retention deletes the documents. The readers (``handoff show`` and ``wait``, the dependency
gate, notify, ``--if-absent``) stream a file member by member, bounded whatever it holds: a
torn member is skipped and the reader resyncs on the next gzip header after it.

This module is the file format alone: what may be archived, and when, is retention's.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from ..core.ownfiles import open_regular, plain_folder
from ..core.states import State
from ..core.storage import Backend, trusted_doc
from ..core.timeutil import iso
from ..core.workspace import Workspace

log = logging.getLogger("handoffd")
ARCHIVE_DIR = ".archive"
READ_CHUNK = 1 << 20  # archive bytes read, and decompressed, at a time
MAX_LINE_BYTES = 64 * 1024 * 1024  # one archived entry, decompressed
MAX_MEMBER_BYTES = 256 * 1024 * 1024  # one append's entries, decompressed, held until it ends
MAX_MEMBER_LINES = 2_000_000  # lines of one member (handoffd's own passes write 500 at a time)
LINE_OVERHEAD = 64  # what holding one line costs beyond its bytes (its object, its list slot)
# the text of one member handoffd writes, at most (beyond one line): a pass's documents are one
# member (retention's PASS_BYTES of them), well within what the reader takes of a member
# (MEMBER_BUDGET)
MEMBER_TEXT = 64 * 1024 * 1024
# what the reader decompresses of one member before it passes over the rest of the file as not
# one handoffd wrote (a gzip bomb): its entries, and one line being read or skipped beyond them
MEMBER_BUDGET = MAX_MEMBER_BYTES + MAX_LINE_BYTES
# what one file's torn members, and the false starts looked for after them, may cost the reader
# (bytes read plus bytes decompressed) before it passes over the rest of the file: a tear costs
# one batch's bytes; a file of planted gzip headers would otherwise be read once per header
RESYNC_BUDGET = MEMBER_BUDGET
# how far before the end of today's archive `append_archive` looks for its last whole member
# (past it, or past TAIL_BUDGET of work, the tail counts as torn: a new file is started)
TAIL_LOOKBACK = MEMBER_TEXT + MAX_LINE_BYTES + READ_CHUNK
TAIL_BUDGET = 2 * TAIL_LOOKBACK + MEMBER_BUDGET


# ---------------------------------------------------------------------------- writing
def archive_dir(ws: Workspace) -> Path:
    """``handoffs/.archive``."""
    return ws.handoffs / ARCHIVE_DIR


def append_archive(ws: Workspace, docs: list[tuple[State, str, dict[str, Any]]],
                   now: datetime) -> Path:
    """Append ``docs`` to today's archive as gzip members, on disk (fsync) before returning.
    Today's archive is ``DATE.jsonl.gz``, or the newest ``DATE-N.jsonl.gz``: a file whose tail
    is not a whole member (a crash or kill -9 tore the batch being appended) is never appended
    to, the next ``DATE-N`` is started instead, so a torn batch is always the end of its file
    (appended after, a tear once swallowed the batches that followed it: archived, deleted,
    and found by no reader). OSError, with nothing written, when ``.archive`` or today's file is
    not a plain folder and a regular file of the workspace (a symlink once led the append outside
    the workspace, and a FIFO there froze the daemon's sweep), or when the write fails (a full
    disk): the file is cut back to where the append began, so nothing is deleted that the
    archive does not hold whole (a short write on a full disk once went unnoticed, the documents
    deleted, the member torn)."""
    folder = archive_dir(ws)
    folder.mkdir(parents=True, exist_ok=True)
    if not plain_folder(folder):
        raise OSError(errno.ENOTDIR, "not a folder of the workspace (a symlink?)", str(folder))
    lines = [(json.dumps({"id": hid, "state": state.value, "archived_at": iso(now),
                          "document": doc}, ensure_ascii=False) + "\n").encode("utf-8")
             for state, hid, doc in docs]
    data = _members(lines)
    fd, path = _open_today(folder, f"{now:%Y-%m-%d}")
    try:
        start = os.fstat(fd).st_size  # (one pass at a time: nobody else appends meanwhile)
        try:
            _write_all(fd, data)
            os.fsync(fd)  # the documents are deleted next: their copy must be durable
        except OSError:
            try:  # what was written of this append goes: the next pass appends it again
                os.ftruncate(fd, start)
            except OSError:  # (a torn member at the end: the reader drops it)
                pass
            raise
    finally:
        os.close(fd)
    return path


# an archive file's name: DATE.jsonl.gz, then DATE-1.jsonl.gz, DATE-2.jsonl.gz... the same day
_ARCHIVE_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})(?:-([1-9]\d{0,8}))?\.jsonl\.gz")
MAX_DAY_FILES = 100  # files one append tries, at most (each after a torn tail)


def archive_key(name: str) -> tuple[str, int]:
    """How the archive file ``name`` sorts, oldest first: by day, then DATE.jsonl.gz before
    DATE-1.jsonl.gz before DATE-2... (by name, DATE-1 sorted before DATE, and DATE-10 before
    DATE-2). A name of another shape sorts by itself."""
    found = _ARCHIVE_NAME.fullmatch(name)
    return (found[1], int(found[2] or 0)) if found else (name, -1)


def _open_today(folder: Path, day: str) -> tuple[int, Path]:
    """An fd appending to (and reading) today's archive file, and its path: the newest of the
    day's files when it is empty or ends with a whole member, else the next DATE-N. OSError
    when that file is not a regular file (a symlink or FIFO there is refused, never passed
    over for the next name: the pass stops, nothing deleted)."""
    numbers = [key[1] for key in (archive_key(p.name) for p in folder.glob(f"{day}*.jsonl.gz"))
               if key[0] == day]
    newest = max(numbers, default=0)
    for number in range(newest, newest + MAX_DAY_FILES):
        path = folder / (f"{day}-{number}.jsonl.gz" if number else f"{day}.jsonl.gz")
        fd = open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            if _ends_whole(fd):
                return fd, path
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EEXIST, f"{MAX_DAY_FILES} archive files of {day} in a row end torn",
                  str(folder))


def _ends_whole(fd: int) -> bool:
    """Whether the archive file open at ``fd`` is empty or ends with a whole gzip member: the
    last header before its end whose member decodes whole (its CRC checked) ends exactly at the
    end. Looked for no further back than TAIL_LOOKBACK, at no more than TAIL_BUDGET of work: a
    tail not found whole within them counts as torn (at worst, one file more is started)."""
    import zlib
    size = os.fstat(fd).st_size
    if size == 0:
        return True
    work = 0
    with os.fdopen(os.dup(fd), "rb") as fh:
        for offset in _headers_backwards(fh, size, max(0, size - TAIL_LOOKBACK)):
            reader = _Members(fh, offset)
            try:  # (nothing is held: no line of an archive holds a NUL byte, JSON escapes it)
                if _member_lines(reader, offset, b"\0") is not None:
                    return reader.offset == size  # whole: the tail is, if nothing follows it
            except (zlib.error, _TooLarge):  # a false header, or a torn member: further back
                pass
            work += reader.work
            if work > TAIL_BUDGET:
                break
    return False


def _headers_backwards(fh: BinaryIO, end: int, lowest: int) -> Iterator[int]:
    """The offsets in [lowest, end) where a gzip header starts, the last first."""
    magic = b"\x1f\x8b\x08"
    top = end
    while top > lowest:
        bottom = max(lowest, top - READ_CHUNK)
        fh.seek(bottom)
        block = fh.read(top - bottom + len(magic) - 1)  # (a header across two blocks)
        at = block.rfind(magic)
        while at >= 0:
            yield bottom + at
            at = block.rfind(magic, 0, at + len(magic) - 1)
        top = bottom


def _members(lines: list[bytes]) -> bytes:
    """``lines`` as gzip members: one per MEMBER_TEXT of text (a pass's documents are one),
    each compressed whole. (Storing a line that expanded much uncompressed, in its own member,
    made an archive of 2,000 small similar documents 400 times bigger than one member: the
    reader's guard is an absolute budget per member now, not a ratio.)"""
    import gzip  # gzip and zlib: only when archiving or reading the archive
    members: list[bytes] = []
    batch: list[bytes] = []
    size = 0
    for line in lines:
        if batch and size + len(line) > MEMBER_TEXT:
            members.append(gzip.compress(b"".join(batch)))
            batch, size = [], 0
        batch.append(line)
        size += len(line)
    if batch:
        members.append(gzip.compress(b"".join(batch)))
    return b"".join(members)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data``: a short write is followed by the rest; OSError when the disk takes
    nothing more (ENOSPC, EFBIG)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, "no space left for the archive")
        view = view[written:]


# ---------------------------------------------------------------------------- reading
def archived(ws: Workspace) -> Iterator[dict[str, Any]]:
    """Every archived entry, newest archive first (a torn member at a file's end is skipped;
    a file that is not a regular file, or an archive folder that is a symlink, is passed over)."""
    for _, entry in archived_with_files(ws):
        yield entry


def _entries(fh: BinaryIO, name: str = "archive",
             wanted: bytes | None = None) -> Iterator[dict[str, Any]]:
    """The entries of one archive file (see :func:`_lines`), each parsed."""
    for line in _lines(fh, name, wanted):
        yield from _entry(line)


def _lines(fh: BinaryIO, name: str = "archive", wanted: bytes | None = None) -> Iterator[bytes]:
    """The entry lines of one archive file, streamed member by member: a member's entries are
    given when it ends whole. A member that is torn (a crash mid-append, then appends after it
    by a version that did not start a new file) is skipped: the reader looks for the next gzip
    header after its start and goes on from there, so what was appended after a tear stays
    readable. The torn member's decompressor may have taken the members after it as its own
    data without an error, to the end of the file (a tear once lost everything after it that
    way): the end of the file inside a member is a tear like any other. A header found so must
    prove itself: its member must end whole (its CRC checked) and hold only lines of ours, else
    the next header is tried (a header's three bytes occur by chance in compressed data). Bounded
    whatever the file holds: a line over MAX_LINE_BYTES is skipped without being held; the file
    is passed over from where a member decompresses to more than MEMBER_BUDGET (a gzip bomb; a
    line being skipped counts too), holds more than MAX_MEMBER_BYTES of lines or more than
    MAX_MEMBER_LINES lines, and from where its tears and false headers cost more than
    RESYNC_BUDGET. (A ratio over the file refused handoffd's own archives of repetitive JSON,
    which compresses 1,000-fold.) ``wanted``: only lines holding these bytes are parsed (a
    lookup by id: a file of millions of tiny lines once took 28 s and 700 MB)."""
    import zlib
    reader = _Members(fh)
    found = False  # the member at hand was found by looking for a header: it must prove itself
    wasted = 0
    while True:
        work = reader.work
        member = reader.next_member()
        if member is None:
            return
        try:
            lines = _member_lines(reader, member, wanted, ours=found)
        except _TooLarge:
            log.warning("%s: not an archive handoffd wrote (a member at offset %d expands "
                        "past %d bytes or holds too many lines); the rest of it is passed over",
                        name, member, MEMBER_BUDGET)
            return
        except (zlib.error, _Foreign):
            lines = None
        if lines is None:  # torn, or no member of ours: the next header after its start
            reader.resync(member)
            wasted += reader.work - work
            if wasted > RESYNC_BUDGET:
                log.warning("%s: torn past repair (from offset %d); the rest of it is passed "
                            "over", name, member)
                return
            found = True
            continue
        found = False
        yield from lines


class _TooLarge(Exception):
    pass


class _Foreign(Exception):
    """A member found by looking for a header holds a line that is not one of ours."""


class _Members:
    """The gzip members of an archive file, with the file offsets they start at."""

    def __init__(self, fh: BinaryIO, start: int = 0) -> None:
        self.fh = fh
        fh.seek(start)
        self.pending = b""  # bytes read but not yet decompressed
        self.offset = start  # the file offset of pending's first byte
        self.work = 0  # bytes read and decompressed so far (what tears cost is bounded)

    def next_member(self) -> int | None:
        """The offset the next member starts at, or None at the end of the file."""
        return self.offset if self.chunk() else None

    def chunk(self) -> bytes:
        """More input for the member being read (b"" at the end of the file)."""
        if not self.pending:
            self.pending = self.fh.read(READ_CHUNK)
            self.work += len(self.pending)
        return self.pending

    def consumed(self, left: bytes) -> None:
        """The decompressor used pending up to ``left`` (what it has not taken)."""
        self.offset += len(self.pending) - len(left)
        self.pending = left

    def resync(self, start: int) -> None:
        """Go on from the next gzip header after ``start`` (the end of the file if none)."""
        magic, step = b"\x1f\x8b\x08", READ_CHUNK
        position = start + 1
        while True:
            self.fh.seek(position)
            block = self.fh.read(step + len(magic) - 1)
            self.work += len(block)
            found = block.find(magic)
            if found >= 0:
                self.fh.seek(position + found)
                self.offset, self.pending = position + found, b""
                return
            if len(block) < step + len(magic) - 1:  # the end: nothing after the tear
                self.fh.seek(0, os.SEEK_END)
                self.offset, self.pending = self.fh.tell(), b""
                return
            position += step


def _member_lines(reader: _Members, start: int, wanted: bytes | None = None, *,
                  ours: bool = False) -> list[bytes] | None:
    """The lines of the member starting at ``start`` (those holding ``wanted``, when given),
    once it ended whole; None when the file ends inside it. zlib.error when it is torn;
    _TooLarge past the bounds (every line counted, kept or not). ``ours``: _Foreign unless
    every line (kept or not) is shaped as :func:`append_archive` writes it, and there is one."""
    import zlib
    decoder = zlib.decompressobj(zlib.MAX_WBITS | 16)
    part: list[bytes] = []  # the line being decompressed, in pieces (joined once, when whole)
    part_size, skipping = 0, False
    lines: list[bytes] = []
    held = count = written = 0
    while True:
        data = reader.chunk()
        if not data:
            return None
        out = decoder.decompress(data, READ_CHUNK)
        written += len(out)  # (all of it: kept, not wanted, or a long line being skipped)
        reader.work += len(out)
        *whole, rest = out.split(b"\n")
        count += len(whole)
        for piece in whole:
            if not skipping and part_size + len(piece) <= MAX_LINE_BYTES:
                text = b"".join(part) + piece
                if ours and not (text.startswith(b'{"id": "') and text.endswith(b"}")):
                    raise _Foreign
                if text.strip() and (wanted is None or wanted in text):
                    lines.append(text)
                    held += len(text) + LINE_OVERHEAD
            part, part_size, skipping = [], 0, False
        if not skipping:
            part.append(rest)
            part_size += len(rest)
            if part_size > MAX_LINE_BYTES:
                part, part_size, skipping = [], 0, True
        if held > MAX_MEMBER_BYTES or count > MAX_MEMBER_LINES or written > MEMBER_BUDGET:
            raise _TooLarge
        if decoder.eof:
            if ours and (count == 0 or part_size or skipping):  # (ours: each line ends "\n")
                raise _Foreign
            # at the member's end, everything after it in the input is in unused_data (the
            # unconsumed tail can hold the same bytes again: taking both read them twice)
            reader.consumed(decoder.unused_data)
            return lines
        reader.consumed(decoder.unconsumed_tail)


def _entry(line: bytes) -> Iterator[dict[str, Any]]:
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return
    if isinstance(entry, dict):
        yield entry


def find_archived(ws: Workspace, handoff_id: str) -> dict[str, Any] | None:
    """The archived entry of ``handoff_id`` (the newest), or None: the last one in the newest
    file that holds it (a file's entries are in the order they were archived, so its first
    match was a handoff's earlier life, e.g. a failure later retried and completed)."""
    found: dict[str, Any] | None = None
    found_in: str | None = None
    # each line starts as append_archive writes it: only lines naming the id are parsed
    wanted = b'"id": ' + json.dumps(handoff_id).encode()
    for entry in archived_with_files(ws, wanted):
        path, item = entry
        if found_in is not None and path != found_in:
            break
        if item.get("id") == handoff_id:
            found, found_in = item, path
    return found


def archived_as(ws: Workspace, handoff_id: str) -> tuple[str, str] | None:
    """(its state, "archived at T") of ``handoff_id`` as retention archived it, for a line
    that says so (``handoff retry`` and ``cancel`` of it); None when no archive holds it as a
    finished handoff, or the archive cannot be read now."""
    try:
        entry = find_archived(ws, handoff_id)
    except (OSError, ValueError):
        return None
    if entry is None or entry.get("state") not in ("completed", "failed"):
        return None
    return str(entry["state"]), f"archived at {entry.get('archived_at', '?')}"


def find_archived_document(ws: Workspace, store: Backend, handoff_id: str
                           ) -> tuple[State, dict[str, Any]] | None:
    """(state, the document as ``store`` reads its documents: :func:`trusted_doc`) of the
    newest archived entry of ``handoff_id``; None when there is none, or it holds no finished
    document. Archived as stored, a document keeps the seal of the folder it was filed in, so
    the store's rule still tells handoffd's filings from foreign ones."""
    entry = find_archived(ws, handoff_id)
    return None if entry is None else entry_document(store, handoff_id, entry)


def entry_document(store: Backend, handoff_id: str, entry: dict[str, Any]
                   ) -> tuple[State, dict[str, Any]] | None:
    """(state, the document as ``store`` reads its documents) of the archived ``entry`` of
    ``handoff_id`` (one :func:`find_archived` gave); None when it holds no finished document."""
    kept = entry.get("document")
    state = entry.get("state")
    if state not in ("completed", "failed") or not isinstance(kept, dict):
        return None
    return State(state), trusted_doc(store, State(state), handoff_id, kept)


def archived_with_files(ws: Workspace, wanted: bytes | None = None
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, entry) of every archived entry (those whose line holds ``wanted``), newest
    file first (:func:`archive_key`: a day's DATE-2, DATE-1, then DATE)."""
    folder = archive_dir(ws)
    if not plain_folder(folder):
        return
    for path in sorted(folder.glob("*.jsonl.gz"), key=lambda p: archive_key(p.name),
                       reverse=True):
        try:
            fd = open_regular(path, os.O_RDONLY)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            for entry in _entries(fh, path.name, wanted):
                yield path.name, entry


# the start of a line as append_archive writes it: the id and state, read without parsing the
# document (an unambiguous pattern: linear time)
_ID_AND_STATE = re.compile(rb'\{"id": ("(?:[^"\\]|\\.)*"), "state": "([a-z_]{1,20})"')


def archive_files(ws: Workspace) -> list[Path]:
    """The archive files, oldest first (:func:`archive_key`; none when ``.archive`` is not a
    plain folder)."""
    folder = archive_dir(ws)
    return sorted(folder.glob("*.jsonl.gz"), key=lambda p: archive_key(p.name)) \
        if plain_folder(folder) else []


def archived_states(path: Path) -> dict[str, str]:
    """Each handoff archived in the archive file ``path``, with the state of its last entry
    there (the documents are not parsed: a daemon's dependency gate indexes the archive with
    it); {} when ``path`` is not a regular file. Bounded as :func:`_lines` is."""
    states: dict[str, str] = {}
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return states
    with os.fdopen(fd, "rb") as fh:
        for line in _lines(fh, path.name):
            head = _ID_AND_STATE.match(line)
            try:
                found = (json.loads(head[1]), head[2].decode()) if head else next(
                    ((e.get("id"), e.get("state")) for e in _entry(line)), (None, None))
            except ValueError:  # (an id that is not JSON text: not handoffd's line)
                continue
            if isinstance(found[0], str) and isinstance(found[1], str):
                states[found[0]] = found[1]
    return states
