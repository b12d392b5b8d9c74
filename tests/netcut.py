"""A relay in front of a test cluster's Unix socket, to cut one host off the database.

A daemon given :meth:`Relay.url` reaches the database only through the relay: :meth:`Relay.cut`
closes every connection it carries and refuses new ones (a network partition of that host
alone; the server sees its sessions end, as it would a dead client's), and ``cut(False)`` lets
it back. The relay's socket lives in a short temp folder (a Unix socket path is limited to
about 100 bytes); :meth:`Relay.close` removes it."""
from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from pathlib import Path
from urllib.parse import quote

PG_SOCKET = ".s.PGSQL.5432"


class Relay:
    """Relays connections to the cluster socket in ``server_dir`` until :meth:`close`."""

    def __init__(self, server_dir: Path) -> None:
        self.target = str(server_dir / PG_SOCKET)
        self.folder = Path(tempfile.mkdtemp(prefix="hcut-"))
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(self.folder / PG_SOCKET))
        self.listener.listen(64)
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.is_cut = False
        self.closed = False
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def url(self, dbname: str) -> str:
        """A libpq URL for ``dbname`` through the relay."""
        return f"postgresql://postgres@/{dbname}?host={quote(str(self.folder), safe='')}"

    def cut(self, on: bool = True) -> None:
        """Cut every connection and refuse new ones (``on``), or accept them again."""
        with self.lock:
            self.is_cut = on
            pairs, self.pairs = (self.pairs, []) if on else ([], self.pairs)
        for pair in pairs:
            for end in pair:
                _shut(end)

    def close(self) -> None:
        """Stop relaying and remove the socket's folder."""
        self.closed = True
        self.cut(True)
        _shut(self.listener)
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            with self.lock:
                refused = self.is_cut
            if refused:
                client.close()
                continue
            server = socket.socket(socket.AF_UNIX)
            try:
                server.connect(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True,
                                 name="relay-pump").start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    for end in (source, sink):
        _shut(end)
    source.close()  # (the other pump closes the other end)


def _shut(end: socket.socket) -> None:
    try:
        end.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
