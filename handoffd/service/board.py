"""What the processes of one batch (``handoffd run --processes N``: :mod:`.spread`) tell each
other: a :class:`Board` in shared memory, mapped before the fork, with a :class:`Seat` for each
process. A process puts each of its filings on it and says whether it is at work; the others
read what it filed (and wake their waiters of it, as their own filings do: ``Daemon.siblings``)
and wait for it while it works on what their waiters wait for. No file, no system call.
"""
from __future__ import annotations

import mmap
import struct
import time

from ..core.states import State
from .reaping import Clock

__all__ = ["BEAT_STALE_SECONDS", "BOARD_FILINGS", "Board", "Seat"]

# a process of a batch that says it is at work but has not said so again for this long is taken
# for gone (killed, or stopped): its loop says so at least every IDLE_WAKE_SECONDS (10 s)
BEAT_STALE_SECONDS = 30.0
BOARD_FILINGS = 4096  # filings of each process the others can read back (~0.5 MB of memory)


class Board:
    """What the processes of one batch tell each other: per process, whether it is at work and
    when it last said so, and the ids it filed (the last :data:`BOARD_FILINGS`, a ring). Memory
    mapped (shared, anonymous) before the fork: no file, no system call. Each slot is written
    by its own process only, a field (8 aligned bytes) at a time, an entry before the count
    that shows it; the others read. Every process is at work until it says otherwise (one still
    starting is waited for)."""

    FIELD = struct.Struct("=q")
    BEAT = struct.Struct("=d")
    HEAD = 24  # filed (a count), at work (0/1), beat (monotonic seconds)
    ENTRY = struct.Struct("=BB128s")  # where (0 completed, 1 failed, 2 pending), id length, id

    def __init__(self, count: int, *, clock: Clock = time.monotonic,
                 filings: int = BOARD_FILINGS) -> None:
        self.count, self.clock, self.filings = count, clock, filings
        self.slot = self.HEAD + self.ENTRY.size * filings
        self.memory = mmap.mmap(-1, self.slot * count)  # MAP_SHARED | MAP_ANONYMOUS
        for index in range(count):
            self.FIELD.pack_into(self.memory, self.slot * index + 8, 1)
            self.BEAT.pack_into(self.memory, self.slot * index + 16, clock())

    def seat(self, index: int) -> Seat:
        """Process ``index``'s place on the board (what its ``Daemon.siblings`` is)."""
        return Seat(self, index)

    def filed_count(self, index: int) -> int:
        """How many filings process ``index`` put on the board so far."""
        return int(self.FIELD.unpack_from(self.memory, self.slot * index)[0])


WHERE = (State.COMPLETED, State.FAILED, State.PENDING)  # a board entry's first byte


class Seat:
    """One process's place on a :class:`Board`: what its daemon tells the others and hears
    from them (:class:`~handoffd.service.daemon.Siblings`)."""

    def __init__(self, board: Board, index: int) -> None:
        self.board, self.index = board, index
        self.base = board.slot * index
        self.count = 0  # this process's filings (its field, written by this process only)
        self.heard = [0] * board.count  # each other process's filings heard so far

    def filed(self, handoff_id: str, where: State) -> None:
        """Put a filing of this process on the board (under its daemon's lock)."""
        board = self.board
        raw = handoff_id.encode("ascii", "replace")[:128]  # (a safe id: 1-128 ASCII)
        entry = self.base + Board.HEAD + Board.ENTRY.size * (self.count % board.filings)
        code = WHERE.index(where) if where in WHERE else 2
        Board.ENTRY.pack_into(board.memory, entry, code, len(raw), raw)
        self.count += 1
        Board.FIELD.pack_into(board.memory, self.base, self.count)

    def news(self) -> list[tuple[str, State]] | None:
        """What the other processes filed since the last call; None when one of them filed
        more than the board keeps since then (the caller looks at every waiter again)."""
        board, out, lost = self.board, [], False
        for index in range(board.count):
            if index == self.index:
                continue
            heard, count = self.heard[index], board.filed_count(index)
            if count == heard:
                continue
            first = max(heard, count - board.filings)
            lost = lost or first > heard
            base = board.slot * index + Board.HEAD
            for at in range(first, count):
                code, size, raw = Board.ENTRY.unpack_from(
                    board.memory, base + Board.ENTRY.size * (at % board.filings))
                out.append((raw[:size].decode("ascii", "replace"), WHERE[min(code, 2)]))
            # entries overwritten while they were read: some were lost
            lost = lost or board.filed_count(index) - first > board.filings
            self.heard[index] = count
        return None if lost else out

    def busy(self) -> None:
        """This process is at work (said again at each turn of its loop: its beat)."""
        Board.BEAT.pack_into(self.board.memory, self.base + 16, self.board.clock())
        Board.FIELD.pack_into(self.board.memory, self.base + 8, 1)

    def idle(self) -> None:
        """This process has nothing to run (it waits, or it ends)."""
        Board.FIELD.pack_into(self.board.memory, self.base + 8, 0)

    def others_busy(self) -> bool:
        """Another process of the batch is at work, and said so within BEAT_STALE_SECONDS."""
        board, memory = self.board, self.board.memory
        recent = board.clock() - BEAT_STALE_SECONDS
        for index in range(board.count):
            base = board.slot * index
            if index != self.index and Board.FIELD.unpack_from(memory, base + 8)[0] \
                    and Board.BEAT.unpack_from(memory, base + 16)[0] >= recent:
                return True
        return False
