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
  (two references per level make 2**levels: validation would never end);
- a file of ``schemas/`` is read only when it is a regular file (never through a symlink, never
  a FIFO or a device) of at most :data:`MAX_SCHEMA_BYTES`, that bound holding for a schema and
  every file its ``$ref``s reach together; the files a ``$ref`` names are read once, when the
  validator is built, and the validator is built again when one of them changes (its stat stamp),
  or when a file comes into schemas/ under a name that was a built-in's (schemas/'s mtime).

An unusable named schema is a ConfigError naming the file: the handoffs that name it fail with
one line, and the daemon goes on.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .errors import SHORTAGE_ERRNOS, ConfigError, ErrorCode, InvalidDocument
from .hashing import sha256_hex
from .ownfiles import open_folder, read_regular

if TYPE_CHECKING:
    from collections.abc import Iterable
    from importlib.resources.abc import Traversable

    from jsonschema.protocols import Validator

INLINE_CACHE_SIZE = 256  # inline schemas kept compiled (LRU): repeats are common, the set is not bounded
# a file of schemas/, and a named schema with all the files its $refs reach: a 1 GB file there
# took 2.1 GB of memory to be found not JSON, and was read again by every handoff naming it
MAX_SCHEMA_BYTES = 4 << 20
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


# how old schemas/'s stamp must be before a name found missing is remembered by it
SETTLED_NS = 1_000_000_000
# the longest file name a file system takes (NAME_MAX): a longer one made every look-up raise
NAME_MAX_BYTES = 255


def plain_name(name: str) -> bool:
    """True when ``name`` is a plain file name (no folder, not hidden, no NUL, a name a file
    system can hold): the only names a schema may be looked up by, in schemas/ or among the
    built-ins. A request's schema name is the sender's: one of 300 bytes, or with a NUL, made
    each look-up raise (ENAMETOOLONG, "embedded null byte") out of admission, and the claim
    was left in in-progress/ (review RF)."""
    return bool(name) and not ("/" in name or "\\" in name or "\0" in name
                               or name.startswith(".")) \
        and len(name.encode("utf-8", "surrogatepass")) <= NAME_MAX_BYTES


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


# what os.lstat says of a file of schemas/ (device, inode, size, mtime, ctime, mode), or None
# when nothing is there: a validator (or a refusal) is kept while these stay as they were
Stamp = tuple[int, ...] | None


def file_stamp(path: Path) -> Stamp:
    """The stat stamp of ``path`` itself (not what a symlink there points at); None when absent."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
            info.st_mode)


def folder_mtime(folder: Path) -> int:
    """``folder``'s mtime (ns), which any file added, removed or renamed in it changes; -1 when
    it cannot be read (absent)."""
    try:
        return os.stat(folder).st_mtime_ns
    except OSError:
        return -1


# schemas/'s mtime kept for names looked up when it was too recent to be trusted: equal to no
# mtime, so those names are looked up again until one is
UNSETTLED = -2


def _settled(mtime: int) -> int:
    """schemas/'s ``mtime`` when it is old enough to be trusted, else UNSETTLED: the kernel may
    stamp from a clock that ticks every few milliseconds, so a file added within the tick of
    the change last seen could leave the mtime as it was (review RF)."""
    return mtime if time.time_ns() - mtime > SETTLED_NS else UNSETTLED


class _Basis:
    """What a cached schema (a validator, a quick check, a refusal) was made from: ``stamps``,
    the stamp of each name it looked for in schemas/ (None: nothing there, so a built-in was
    used, or none was found), and ``folder``, schemas/'s mtime taken before those names were
    looked for (None when every name was found there). A file added in schemas/ since moves
    that mtime, and the names are looked up again: an edited copy of a built-in schema put there
    while a daemon runs is used from the next handoff on (it was not until a restart)."""

    __slots__ = ("stamps", "folder")

    def __init__(self, stamps: dict[str, Stamp], folder: int | None) -> None:
        self.stamps = stamps
        self.folder = folder


class Look:
    """What the checks of one request have seen of schemas/: its mtime, stat'ed once, and the
    cached schemas found as they were made, not looked at again (:meth:`SchemaCache.absent`
    and then :meth:`SchemaCache.errors` each took the stamps of a request's schema). Made anew
    for each request: a schema replaced between two requests is seen by the second."""

    __slots__ = ("_mtime", "current")

    def __init__(self) -> None:
        self._mtime: int | None = None
        self.current: set[_Basis] = set()

    def folder_mtime(self, folder: Path) -> int:
        """schemas/'s mtime (see :func:`folder_mtime`), taken at the first call."""
        if self._mtime is None:
            self._mtime = folder_mtime(folder)
        return self._mtime


def _refusal(name: str, exc: OSError) -> str:
    """The one line saying why ``schemas/<name>`` is not read."""
    if exc.errno == errno.ELOOP:
        return f"schemas/{name} is a symlink: a schema is read only from a regular file in schemas/"
    if exc.errno in (errno.EINVAL, errno.ENXIO, errno.EISDIR):
        return f"schemas/{name} is not a regular file: a schema is read only from one"
    if exc.errno == errno.EFBIG:
        return f"schemas/{name} is larger than {MAX_SCHEMA_BYTES >> 20} MiB, a schema file's limit"
    return f"schemas/{name} cannot be read: {exc.strerror}"


class _Build:
    """The reads of one build of a named schema: each file of schemas/ looked at, with its stamp
    taken before it was read (a change during the build is seen as one after it), and the bytes
    read, at most :data:`MAX_SCHEMA_BYTES` together."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.stamps: dict[str, Stamp] = {}
        self.total = 0
        self.mtime: int | None = None  # schemas/'s, taken before the first name is looked for

    def basis(self) -> _Basis:
        """What the build read: the stamps, and schemas/'s mtime if a name was not there."""
        return _Basis(self.stamps, self.mtime if None in self.stamps.values() else None)

    def load(self, name: str) -> Any:
        """Schema ``name``: ``schemas/<name>`` when anything has that name there (refused with a
        ConfigError unless it is a regular file within the bounds), else the built-in one."""
        if not plain_name(name):
            raise ConfigError(f"schema name {name!r} must be a plain file name inside schemas/")
        data = self._read(name)
        if data is None:
            try:
                return load_builtin(name)
            except FileNotFoundError:
                raise ConfigError(f"schema {name} not found in {self.folder} nor among the "
                                  "built-in schemas (`handoff schemas` lists them)") from None
        self.total += len(data)
        if self.total > MAX_SCHEMA_BYTES:
            raise ConfigError(f"schemas/{name}: a schema and the files its $refs name may hold "
                              f"{MAX_SCHEMA_BYTES >> 20} MiB together, and these hold more")
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"schemas/{name} is not valid JSON: {str(exc)[:200]}") from None
        except RecursionError:
            raise ConfigError(f"schemas/{name} nests too deeply to be read") from None

    def _read(self, name: str) -> bytes | None:
        """The bytes of ``schemas/<name>``, None when nothing has that name there."""
        if self.folder is None:
            return None
        if self.mtime is None:
            self.mtime = _settled(folder_mtime(self.folder))
        stamp = self.stamps[name] = file_stamp(self.folder / name)
        if stamp is None:
            return None
        try:  # the folder itself not through a symlink either: nothing outside is read
            folder = open_folder(self.folder)
        except OSError as exc:
            if exc.errno in SHORTAGE_ERRNOS:  # no descriptor to spare: "not now", no config
                raise  # error (the claim is handed back uncounted: admission's shortage)
            raise ConfigError(f"schemas/{name} is not read: schemas/ is not a plain folder of the "
                              "workspace (a symlink?)") from None
        try:
            return read_regular(name, MAX_SCHEMA_BYTES, dir_fd=folder)
        except FileNotFoundError:
            return None  # gone since: its stamp changes, and the next use looks again
        except OSError as exc:
            if exc.errno in SHORTAGE_ERRNOS:  # (as the folder's open: not the schema's fault)
                raise
            raise ConfigError(_refusal(name, exc)) from None
        finally:
            os.close(folder)


class SchemaCache:
    """Compiled validators: named schemas by name (a fixed set), inline schemas in a bounded LRU
    keyed by their content; thread-safe, built on first use."""

    def __init__(self, workspace_schemas: Path | None = None, *,
                 inline_size: int = INLINE_CACHE_SIZE) -> None:
        self.folder = workspace_schemas
        # name -> its validator and what of schemas/ it was built from
        self._validators: dict[str, tuple[Validator, _Basis]] = {}
        # name -> the refusal of an unusable schema, and what of schemas/ it looked at: given
        # again (nothing read) while that stays as it was
        self._refused: dict[str, tuple[str, _Basis]] = {}
        # name -> fastschema check, or None (jsonschema only), and what it stands on (for a
        # schema of schemas/, its validator's own _Basis: a Look that found one current found
        # both)
        self._quick: dict[str, tuple[Any, _Basis]] = {}
        self._missing: dict[str, int] = {}  # name -> schemas/ mtime when it was not there
        self._inline: OrderedDict[str, Validator] = OrderedDict()
        self._inline_size = inline_size
        self._lock = threading.Lock()

    def validator(self, name: str, look: Look | None = None) -> Validator:
        """The validator for schema ``name`` (workspace schemas/ first, then built-ins), built
        again when a file of schemas/ it was built from changes, or one comes in under a name
        that was a built-in's; ConfigError if unusable. ``look``: the request's (see
        :class:`Look`)."""
        return self._current(name, look)[0]

    def _current(self, name: str, look: Look | None) -> tuple[Validator, _Basis]:
        """:meth:`validator` with what of schemas/ it was built from."""
        found = self._validators.get(name)
        if found is not None and self._holds(found[1], look):
            return found
        with self._lock:
            found = self._validators.get(name)
            if found is not None and self._holds(found[1], look):
                return found
            refused = self._refused.get(name)
            if refused is not None and self._holds(refused[1], look):
                raise ConfigError(refused[0])
            build = _Build(self.folder)
            try:
                built = self._build(name, build)
            except ConfigError as exc:
                self._validators.pop(name, None)
                if len(self._refused) >= INLINE_CACHE_SIZE:  # names come from requests
                    self._refused.clear()
                self._refused[name] = (str(exc), build.basis())
                raise
            self._refused.pop(name, None)
            found = self._validators[name] = (built, build.basis())
            return found

    def _holds(self, basis: _Basis, look: Look | None) -> bool:
        """True when what ``basis`` was made from is as it was: each file of schemas/ it read
        still has its stamp (one lstat each), and no file has come in under a name it found
        absent (schemas/'s mtime as it was; moved, each such name is looked up again). With
        ``look``, once a request: its later checks take the answer as given."""
        if self.folder is None or (look is not None and basis in look.current):
            return True
        for name, stamp in basis.stamps.items():
            if stamp is not None and file_stamp(self.folder / name) != stamp:
                return False
        if basis.folder is not None:
            mtime = look.folder_mtime(self.folder) if look is not None \
                else folder_mtime(self.folder)
            if mtime != basis.folder:
                if any(stamp is None and file_stamp(self.folder / name) is not None
                       for name, stamp in basis.stamps.items()):
                    return False
                # (still absent, each: trusted from this mtime on, once it is settled)
                basis.folder = _settled(mtime)
        if look is not None:
            look.current.add(basis)
        return True

    def has(self, name: str) -> bool:
        """True when schema ``name`` can be loaded (a plain name in schemas/ or built in). Any
        entry of schemas/ counts, a symlink too: using it says why it is refused."""
        return not self.absent((name,))

    def absent(self, names: Iterable[str], look: Look | None = None) -> set[str]:
        """The ``names`` :meth:`has` says no to, schemas/ looked at once for all of them (one
        ``stat`` of the folder: a request's input and expected output schemas are asked
        together, and a request naming schemas nobody wrote costs one stat, not one a name).
        ``look``: the request's, which its later checks share (see :class:`Look`)."""
        missing: set[str] = set()
        mtime: int | None = None  # schemas/'s, taken at the first name that needs it
        for name in names:
            found = self._validators.get(name)
            # (a cached one whose files changed is looked up afresh: one removed since is a
            # missing schema, said as such, not a "not found" from its rebuild, which failed
            # the handoff for good in advisory mode; review RF)
            if found is not None and self._holds(found[1], look):
                continue
            if not plain_name(name):
                missing.add(name)
                continue
            if self.folder is not None:
                if mtime is None:
                    mtime = folder_mtime(self.folder) if look is None \
                        else look.folder_mtime(self.folder)
                if self._in_folder(name, mtime):
                    continue
            if not builtin_exists(name):
                missing.add(name)
        return missing

    def _in_folder(self, name: str, stamp: int) -> bool:
        """``schemas/<name>`` is a file. A name found missing is remembered with the folder's
        mtime ``stamp``, which any file added or renamed in changes: a request naming a schema
        nobody wrote (a warning each time, in advisory mode) costs no stat of its own."""
        assert self.folder is not None
        if self._missing.get(name) == stamp:
            return False
        if file_stamp(self.folder / name) is not None:
            return True
        # remembered only once the folder's stamp is settled: the kernel may stamp from a clock
        # that ticks every few milliseconds, so a file added within the tick of the change
        # last seen could leave the stamp as it was, and the miss would be believed for good
        # (review RF; as backends.files.quarantine's folder guard trusts a stamp)
        if time.time_ns() - stamp > SETTLED_NS:
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

    def _shipped(self, name: str) -> tuple[dict[str, Any], _Basis] | None:
        """The built-in schema ``name`` when nothing in schemas/ overrides it, and what of
        schemas/ says so; else None."""
        if not plain_name(name) or not builtin_exists(name):
            return None
        if self.folder is None:
            return load_builtin(name), _Basis({}, None)
        mtime = _settled(folder_mtime(self.folder))  # (before the look-up: a file added after
        if file_stamp(self.folder / name) is not None:  # it moves the mtime)
            return None
        return load_builtin(name), _Basis({name: None}, mtime)

    def _build(self, name: str, build: _Build) -> Validator:
        """A checked validator for named schema ``name``, its files read through ``build``;
        ConfigError naming it if unusable."""
        from .jsonschema_re2 import SchemaProblem, for_named
        schema = build.load(name)
        where = f"schemas/{name}" if build.stamps.get(name) is not None \
            else f"the built-in schema {name}"
        try:
            return for_named(schema, build.load)
        except SchemaProblem as exc:
            raise ConfigError(f"{where} cannot be used: {exc}") from None
        except ConfigError as exc:  # a schema it refers to
            raise ConfigError(f"{where} refers to a schema that cannot be used: {exc}") from None

    def errors(self, name: str, instance: Any, look: Look | None = None) -> list[dict[str, str]]:
        """Every error of ``instance`` against schema ``name``, in document order. A compiled
        quick check answers for valid documents (:mod:`handoffd.core.fastschema`); jsonschema
        judges the rest. ``look``: the request's (see :class:`Look`)."""
        from .fastschema import is_valid
        quick = self.quick(name, look)
        if quick is not None and is_valid(quick, instance):
            return []
        return self.errors_with(self.validator(name, look), instance)

    def quick(self, name: str, look: Look | None = None) -> Any:
        """The compiled quick check of schema ``name``, or None when it has none. A built-in
        schema is compiled as it stands: it ships with the package and its tests check it
        against its metaschema, so the process does not load jsonschema to check it again (only
        a document that fails the quick check does, to say why)."""
        known = self._quick.get(name)
        if known is not None and self._holds(known[1], look):
            return known[0]
        from .fastschema import compile_schema
        shipped = self._shipped(name)
        if shipped is None:  # loads and checks it (ConfigError if unusable)
            validator, basis = self._current(name, look)
            schema: Any = validator.schema
        else:
            schema, basis = shipped
        draft7 = isinstance(schema, dict) and "draft-07" in str(schema.get("$schema", ""))
        found = compile_schema(schema, draft7=draft7) if isinstance(schema, (dict, bool)) else None
        with self._lock:
            self._quick[name] = (found, basis)
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
