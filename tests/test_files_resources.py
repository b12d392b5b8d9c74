"""The files store under resource pressure: out of descriptors, and dropped by its last user.
Each runs in a subprocess (the descriptor limit and the garbage collector are the process's)."""
from __future__ import annotations

from pathlib import Path

from conftest import run_python

SETUP = """
import gc, os, resource, sys
from pathlib import Path
from handoffd.backends.files.backend import FilesBackend
from handoffd.core.native_format import new_native_request
from handoffd.core.timeutil import utc_now
from handoffd.core.workspace import Workspace
ws = Workspace(Path(sys.argv[1])); ws.ensure()
now = utc_now()
backend = FilesBackend.open(ws, watch=False, durable=False)
backend.create(new_native_request(source="@t", target="@x", data={}, now=now), "a", now)
"""


def test_a_good_document_read_without_descriptors_left_is_transient(tmp_path: Path) -> None:
    """Out of descriptors (EMFILE), a valid pending document must read as a passing problem
    (looked at again), never as an unprocessable one (set aside): the reader's own lazy import
    failed with EMFILE and turned the one into the other."""
    code = SETUP + """
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    backend.peek("a")
    print("no error")
except Exception as exc:
    print(type(exc).__name__, getattr(exc, "transient", None))
finally:
    for fd in held:
        os.close(fd)
"""
    out = run_python(code, str(tmp_path / "ws"))
    assert out.stdout.split() == ["UnreadableDocument", "True"], out


def test_a_dropped_backend_gives_its_descriptors_back_at_once(tmp_path: Path) -> None:
    """A backend that has claimed and is then dropped frees its files when its last reference
    goes (the seen-ids record says a long-lived process relies on that), without waiting for
    the cyclic collector: the claim path held the backend in a cycle."""
    code = SETUP + """
def fds(): return len(os.listdir("/proc/self/fd"))
gc.disable()
claim = backend.claim("a", now, 30)
assert claim is not None
backend.store.close()
before = fds()
del backend, claim
print(before - fds())
"""
    out = run_python(code, str(tmp_path / "ws"))
    assert int(out.stdout.strip()) >= 1, out  # its files closed, with no gc.collect()
