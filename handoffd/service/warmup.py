"""What a daemon loads before it works, so that no handoff pays for it on its clock.

``warm_up`` runs before ``handoffd serve`` says it is serving; ``warm_up_to_fork`` before a batch
forks over several processes (:mod:`.spread`), so every process shares what it built.
"""
from __future__ import annotations

import logging
import threading

from ..core.validation import SchemaCache

log = logging.getLogger("handoffd")
# built when a daemon starts serving (the native format's request and answers)
WARM_SCHEMAS = ("native.request.schema.json", "native.response.schema.json",
                "native.failure.schema.json")


def warm_up(schemas: SchemaCache | None = None) -> None:
    """Load before serving what the first handoff (or sweep) would otherwise load: the schema
    checks (jsonschema and RE2, ~120 ms), the seals' hash and the claim locks. One-shot commands keep these lazy; a
    serving daemon pays them before it says it is serving, not on a handoff's clock. The native
    format's own schemas (a few ms each to compile) are built by a thread in the background: a
    handoff that needs one first waits for that build rather than starting its own."""
    from ..core import jsonschema_re2  # noqa: F401
    _import_quick_checks()
    # the sweeps' claim locks: filelock loads hmac and with it OpenSSL (~4 MB resident), which
    # a serving daemon would otherwise map at its first recovery, hours in
    import filelock  # noqa: F401
    if schemas is not None:
        threading.Thread(target=build_schemas, args=(schemas, WARM_SCHEMAS), daemon=True,
                         name="handoffd-warm-up").start()


def warm_up_to_fork(schemas: SchemaCache) -> None:
    """Before a batch forks (:mod:`.spread`): the quick checks' imports and the native format's
    quick checks, built once and shared by every process. Not jsonschema (~50 ms): the quick
    checks answer for valid documents, and a process imports it when one fails them."""
    _import_quick_checks()
    build_schemas(schemas, WARM_SCHEMAS)


def _import_quick_checks() -> None:
    """The seals' hash and the compiled quick checks (RE2 with them)."""
    from ..core import fastschema, hashing  # noqa: F401

    hashing.load()


def build_schemas(schemas: SchemaCache, names: tuple[str, ...]) -> None:
    """Build the quick checks of schemas ``names`` now (a schema that cannot be built is left
    to the handoff that needs it, which says why)."""
    for name in names:
        try:
            schemas.quick(name)
        except Exception:  # an unusable override in schemas/: the handoff that needs it says so
            log.debug("schema %s: not built at start", name, exc_info=True)
