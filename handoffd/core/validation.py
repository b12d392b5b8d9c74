"""JSON Schema validation with validators built once and cached, and seed-001 style error entries.

Schemas are looked up by name in the workspace's ``schemas/`` first, then among the built-in ones
shipped in the package. Each error becomes ``{"field", "error", "schema_path"}`` where ``field`` is
the instance path written ``a.b[0].c`` (seed 001's ``component_requirements[0].props.userId``).

Every schema is hostile input: the workspace's ``schemas/`` can be written by any agent sharing
the workspace, and inline ones (HAIOS's ``expected_output_schema``) come with documents. So:

- regular expressions (``pattern``, ``patternProperties`` and the ``regex`` format) run on RE2, a
  linear-time engine, and a pattern RE2 cannot compile (lookaround, backreferences) makes the
  schema unusable: no pattern and no input can make validation backtrack while holding the GIL;
- a ``$ref`` is followed only inside the schema, or, from ``schemas/``, to another file of
  ``schemas/`` by plain name: never to a URL or a path (jsonschema would fetch them, unbounded);
- a schema that expands to more than 20,000 subschemas once its ``$ref``s are followed is refused
  (two references per level make 2**levels: validation would never end).

An unusable named schema is a ConfigError naming the file: the handoffs that name it fail with
one line, and the daemon goes on.
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigError, ErrorCode, InvalidDocument
from .hashing import sha256_hex

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from jsonschema.protocols import Validator

INLINE_CACHE_SIZE = 256  # inline schemas kept compiled (LRU): repeats are common, the set is not bounded
# the machinery (jsonschema with RE2 keywords) lives in .jsonschema_re2, loaded on first validation
_ENGINE_NAMES = ("PatternError", "compile_pattern", "validator_class", "check_inline", "describe",
                 "field_path", "errors_of")


def __getattr__(name: str) -> Any:
    """The machinery's names, loaded from :mod:`.jsonschema_re2` on first use (PEP 562)."""
    if name in _ENGINE_NAMES:
        from . import jsonschema_re2
        return getattr(jsonschema_re2, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _builtin_folder() -> Traversable:
    """The package's ``schemas/`` folder."""
    # importlib.resources pulls in tempfile, shutil, zlib and random (~9 ms): only a process that
    # reads a built-in schema pays for it
    from importlib import resources
    return resources.files("handoffd") / "schemas"


def builtin_schema_names() -> list[str]:
    """Names of the schemas shipped inside the package."""
    folder = _builtin_folder()
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def load_builtin(name: str) -> dict[str, Any]:
    """A built-in schema by file name."""
    path = _builtin_folder() / name
    return json.loads(path.read_text(encoding="utf-8"))


def plain_name(name: str) -> bool:
    """True when ``name`` is a plain file name (no folder, not hidden): the only names a schema
    may be looked up by, in schemas/ or among the built-ins."""
    return not ("/" in name or "\\" in name or name.startswith("."))


@lru_cache(maxsize=256)
def builtin_exists(name: str) -> bool:
    """True when a built-in schema is called ``name`` (the package's schemas never change while
    it runs; asked for every handoff that names an expected schema)."""
    return (_builtin_folder() / name).is_file()


def schema_digest(schema: Any) -> str:
    """A stable key for a schema: SHA-256 of its canonical JSON."""
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise InvalidDocument("the inline schema nests too deeply to be used",
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED) from None
    except (ValueError, TypeError) as exc:  # not JSON data (only possible from library callers)
        raise InvalidDocument(f"the inline schema is not JSON data: {exc}",
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED) from None
    return sha256_hex(text.encode("utf-8", "surrogatepass"))


class SchemaCache:
    """Compiled validators: named schemas by name (a fixed set), inline schemas in a bounded LRU
    keyed by their content; thread-safe, built on first use."""

    def __init__(self, workspace_schemas: Path | None = None, *,
                 inline_size: int = INLINE_CACHE_SIZE) -> None:
        self.folder = workspace_schemas
        self._validators: dict[str, Validator] = {}
        self._quick: dict[str, Any] = {}  # name -> fastschema check, or None (jsonschema only)
        self._missing: dict[str, int] = {}  # name -> schemas/ mtime when it was not there
        self._inline: OrderedDict[str, Validator] = OrderedDict()
        self._inline_size = inline_size
        self._lock = threading.Lock()

    def validator(self, name: str) -> Validator:
        """The validator for schema ``name`` (workspace schemas/ first, then built-ins)."""
        found = self._validators.get(name)
        if found is not None:
            return found
        with self._lock:
            if name not in self._validators:
                self._validators[name] = self._build(name, self._load(name))
            return self._validators[name]

    def has(self, name: str) -> bool:
        """True when schema ``name`` can be loaded (a plain name in schemas/ or built in)."""
        if name in self._validators:
            return True
        if not plain_name(name):
            return False
        if self.folder is not None and self._in_folder(name):
            return True
        return builtin_exists(name)

    def _in_folder(self, name: str) -> bool:
        """``schemas/<name>`` is a file. A name found missing is remembered with the folder's
        mtime, which any file added or renamed in changes: a request naming a schema nobody
        wrote (a warning each time, in advisory mode) costs one stat, not one per name."""
        assert self.folder is not None
        try:
            stamp = os.stat(self.folder).st_mtime_ns
        except OSError:
            stamp = -1
        if self._missing.get(name) == stamp:
            return False
        if (self.folder / name).is_file():
            return True
        if len(self._missing) >= INLINE_CACHE_SIZE:
            self._missing.clear()
        self._missing[name] = stamp
        return False

    def for_schema(self, key: str, schema: dict[str, Any]) -> Validator:
        """A validator for an inline schema (e.g. seed 003's expected_output_schema).

        ``key`` names the schema's origin (such as ``inline:<handoff id>``) and is not the cache
        key: the cache is keyed by the schema's content, so repeats share one validator and the
        cache stays bounded however many handoffs a daemon serves. InvalidDocument
        (SCHEMA_VALIDATION_FAILED) if the schema is unusable."""
        digest = schema_digest(schema)
        with self._lock:
            found = self._inline.get(digest)
            if found is not None:
                self._inline.move_to_end(digest)
                return found
        from .jsonschema_re2 import for_inline
        found = for_inline(schema)
        with self._lock:
            self._inline[digest] = found
            while len(self._inline) > self._inline_size:
                self._inline.popitem(last=False)
        return found

    def _load(self, name: str) -> dict[str, Any]:
        if not plain_name(name):
            raise ConfigError(f"schema name {name!r} must be a plain file name inside schemas/")
        if self.folder is not None and (self.folder / name).is_file():
            try:
                return json.loads((self.folder / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"schemas/{name} is not valid JSON: {str(exc)[:200]}") from None
            except RecursionError:
                raise ConfigError(f"schemas/{name} nests too deeply to be read") from None
            except OSError as exc:
                raise ConfigError(f"schemas/{name} cannot be read: {exc.strerror}") from None
        try:
            return load_builtin(name)
        except FileNotFoundError:
            raise ConfigError(f"schema {name} not found in {self.folder} nor among the built-in "
                              "schemas (`handoff schemas` lists them)") from None

    def _shipped(self, name: str) -> dict[str, Any] | None:
        """The built-in schema ``name`` when no file in schemas/ overrides it, else None."""
        if not plain_name(name) or not builtin_exists(name):
            return None
        if self.folder is not None and (self.folder / name).is_file():
            return None
        return load_builtin(name)

    def _build(self, name: str, schema: Any) -> Validator:
        """A checked validator for named schema ``name``; ConfigError naming it if unusable."""
        from .jsonschema_re2 import SchemaProblem, for_named
        where = f"schemas/{name}" if self.folder is not None and (self.folder / name).is_file() \
            else f"the built-in schema {name}"
        try:
            return for_named(schema, self._load)
        except SchemaProblem as exc:
            raise ConfigError(f"{where} cannot be used: {exc}") from None
        except ConfigError as exc:  # a schema it refers to
            raise ConfigError(f"{where} refers to a schema that cannot be used: {exc}") from None

    def errors(self, name: str, instance: Any) -> list[dict[str, str]]:
        """Every error of ``instance`` against schema ``name``, in document order. A compiled
        quick check answers for valid documents (:mod:`handoffd.core.fastschema`); jsonschema
        judges the rest."""
        from .fastschema import is_valid
        quick = self.quick(name)
        if quick is not None and is_valid(quick, instance):
            return []
        return self.errors_with(self.validator(name), instance)

    def quick(self, name: str) -> Any:
        """The compiled quick check of schema ``name``, or None when it has none. A built-in
        schema is compiled as it stands: it ships with the package and its tests check it
        against its metaschema, so the process does not load jsonschema to check it again (only
        a document that fails the quick check does, to say why)."""
        if name in self._quick:
            return self._quick[name]
        from .fastschema import compile_schema
        schema: Any = self._shipped(name)
        if schema is None:
            schema = self.validator(name).schema  # loads and checks it (ConfigError if unusable)
        draft7 = isinstance(schema, dict) and "draft-07" in str(schema.get("$schema", ""))
        found = compile_schema(schema, draft7=draft7) if isinstance(schema, (dict, bool)) else None
        with self._lock:
            self._quick[name] = found
        return found

    @staticmethod
    def errors_with(validator: Validator, instance: Any) -> list[dict[str, str]]:
        """Every error of ``instance`` under ``validator`` (seed-001 entries in path order,
        ``items[2]`` before ``items[10]``: see :func:`~handoffd.core.jsonschema_re2.errors_of`)."""
        from .jsonschema_re2 import errors_of
        return errors_of(validator, instance)


class _Schemas(Protocol):
    def errors(self, name: str, instance: Any) -> list[dict[str, str]]: ...


class _Format(Protocol):
    name: str

    def schema_names(self, doc: dict[str, Any]) -> list[str]: ...


@lru_cache(maxsize=1)
def builtin_schemas() -> SchemaCache:
    """One shared cache of the built-in schemas (for checks made outside any workspace)."""
    return SchemaCache(None)


def more_errors(errors: list[dict[str, str]]) -> str:
    """`` (and N more)`` after a message naming the first of ``errors`` ("" for one alone); a
    list cut short ends with jsonschema_re2's MORE_ERRORS entry: `` (and 100+ more)``."""
    unlisted = any(e.get("field") == "$" and str(e.get("error", "")).startswith("... and more")
                   for e in errors[1:])
    return f" (and {len(errors) - 1}{'+' if unlisted else ''} more)" if len(errors) > 1 else ""


def check_document(schemas: _Schemas, dialect: _Format, doc: dict[str, Any], *,
                   subject: str | None = None, handoff_id: str | None = None) -> None:
    """The one schema check of a document against its format: raise InvalidDocument
    (SCHEMA_VALIDATION_FAILED, every error in ``errors``) unless ``doc`` minus handoffd's
    bookkeeping block satisfies each schema ``dialect`` names. ``subject`` starts the message
    (default: "not a valid <format> document"). An unusable workspace schema raises too."""
    instance = {k: v for k, v in doc.items() if k != "handoffd"}
    errors: list[dict[str, str]] = []
    for name in dialect.schema_names(doc):
        errors.extend(schemas.errors(name, instance))
    if errors:
        first = errors[0]
        more = more_errors(errors)

        def cut(text: str, limit: int = 300) -> str:  # as jsonschema_re2 cuts its entries
            return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"
        head = cut(subject or f"not a valid {dialect.name} document")
        what = f"{cut(str(first['field']))}: {cut(str(first['error']))}"
        raise InvalidDocument(f"{head}: {what}{more}",
                              handoff_id=handoff_id, code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                              errors=errors)
