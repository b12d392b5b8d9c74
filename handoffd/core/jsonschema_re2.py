"""JSON Schema on RE2: validators of :mod:`.schema_keywords`' classes (whose regex keywords run
in linear time), the checks of an inline or named schema, and seed-001 style error entries.
Imported on first validation only (jsonschema and referencing take a good part of a second to
load; a CLI command that validates nothing must not pay for them). See
:mod:`handoffd.core.validation` for the policy.
"""
from __future__ import annotations

from typing import Any, Callable

import jsonschema
import referencing
import referencing.exceptions

from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from .errors import ErrorCode, InvalidDocument
from .schema_keywords import MAX_MESSAGE, cut, validator_class
# (compile_pattern: part of the machinery validation.py hands out, see its _ENGINE_NAMES)
from .schemachecks import PatternError, compile_pattern, format_checker  # noqa: F401

FORMAT_CHECKER = format_checker()  # jsonschema's, with handoffd's own checks for some formats


def field_path(parts: Any) -> str:
    """Render a jsonschema path deque as ``a.b[0].c`` (empty string for the root)."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


MAX_ERRORS = 100  # entries errors_of lists for one value; past it, one MORE_ERRORS entry says so
MAX_SCANNED = 100 * MAX_ERRORS  # errors it reads at most (repeats of a listed entry included)
MORE_ERRORS = "... and more errors, not listed (the list stops after {listed})"


def path_order(parts: Any) -> tuple[tuple[int, int | str], ...]:
    """The sort key of a jsonschema path: its parts in turn, an index by its number (``[2]``
    before ``[10]``, which comparing the rendered text put the other way) and before any name, so
    a path mixing indexes and names still compares."""
    return tuple((0, part) if isinstance(part, int) and not isinstance(part, bool)
                 else (1, str(part)) for part in parts)


def describe(error: ValidationError) -> dict[str, str]:
    """One seed-001 validation entry for a jsonschema error, each text at most
    :data:`MAX_MESSAGE` characters: jsonschema's messages hold the whole offending value (a 3 MB
    string made a 9 MB failure document, and a 3 MB line in ``handoff show``)."""
    message = error.message
    if error.validator == "required" and isinstance(error.validator_value, list):
        missing = [p for p in error.validator_value if isinstance(error.instance, dict)
                   and p not in error.instance]
        if missing:
            message = f"Missing required field '{missing[0]}'"
    elif len(message) > MAX_MESSAGE:
        message = _shorter_value(message, error.instance)
    schema_path = "#/" + "/".join(str(p) for p in error.absolute_schema_path)
    return {"field": cut(field_path(error.absolute_path) or "$"), "error": cut(message),
            "schema_path": cut(schema_path)}


def _shorter_value(message: str, instance: Any) -> str:
    """``message`` with the value it quotes (jsonschema writes ``repr(instance)``) shortened as
    :func:`_short` does, so that what follows it ("is not one of [...]") stays."""
    try:
        text = repr(instance)
    except (RecursionError, ValueError):  # absurdly nested; an int past str()'s digit limit
        return message
    return message.replace(text, cut(text, 80), 1) if len(text) > 80 else message


# Inline schemas resolve no references outside themselves: jsonschema's default registry would
# fetch http(s) and file URLs with no timeout, so a document could stall a worker, read a file
# outside the workspace, or reach the network. Named schemas may refer to the workspace's other
# schemas by plain name (see named_registry), and to nothing else.
_NO_RETRIEVAL = referencing.Registry()
MAX_EXPANSION = 20_000  # subschemas one value may be checked against, $refs followed
# keywords of a schema object that a value is never checked against as they stand, besides
# the data ones (definitions are reached through $ref)
_NOT_SUBSCHEMAS = frozenset({"title", "description", "$comment", "$defs", "definitions"})
# keywords whose values are data, never schemas: a "$ref" key inside one refers to nothing
_DATA_KEYWORDS = frozenset({"enum", "const", "examples", "default"})
# keywords whose value maps names to schemas, in the drafts jsonschema knows (03 to 2020-12;
# "dependencies" maps to a schema or to a list of names). The names are anyone's: a property
# may be called "default" or "enum", and its schema is a schema all the same
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas", "dependencies"})


def schema_parts(schema: dict[str, Any], skip: frozenset[str] = frozenset()) -> list[Any]:
    """What may hold schemas directly under the schema object ``schema``, read by meaning: each
    entry of a name map (:data:`_SCHEMA_MAPS`) whatever its name, and the value of every other
    keyword (a schema, or a list of them) but the data keywords and those in ``skip``. A
    keyword nobody knows counts as holding schemas: a ``$ref`` may point into it."""
    parts: list[Any] = []
    for key, value in schema.items():
        if key in _DATA_KEYWORDS or key in skip:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            parts.extend(value.values())
        else:
            parts.append(value)
    return parts


class SchemaProblem(ValueError):
    """A schema that cannot be used: not a JSON Schema, a pattern RE2 refuses, a $ref that
    reaches outside, too deep, or too large once its $refs are followed."""


def check_schema(schema: Any, registry: referencing.Registry = _NO_RETRIEVAL) -> Validator:
    """A validator for ``schema`` once it is known usable (SchemaProblem, one line, otherwise):
    a valid JSON Schema for its draft, every pattern RE2 compiles, every ``$ref`` resolves within
    ``registry``, and it expands to at most :data:`MAX_EXPANSION` subschemas."""
    try:
        cls = validator_class(schema)
        cls.check_schema(schema, format_checker=FORMAT_CHECKER)
        validator = cls(schema, format_checker=FORMAT_CHECKER, registry=registry)
        size = _Expansion(validator).size(schema, validator._resolver)  # type: ignore[attr-defined]
    except jsonschema.SchemaError as exc:
        reason = str(exc.cause) if isinstance(exc.cause, PatternError) else exc.message
        raise SchemaProblem(f"not a valid JSON Schema: {reason[:300]}") from None
    except RecursionError:
        raise SchemaProblem("it nests too deeply to be checked") from None
    except referencing.exceptions.Unresolvable as exc:
        raise SchemaProblem(f"$ref {str(exc.ref)[:200]!r} cannot be followed: only references inside "
                            "the schema, or from schemas/ to another file there by name, "
                            "are followed") from None
    if size > MAX_EXPANSION:
        raise SchemaProblem(f"its $refs make it check a value against more than {MAX_EXPANSION} "
                            "subschemas")
    return validator


class _Expansion:
    """Counts the subschemas a value may be checked against, each $ref target counted once per
    reference to it: what validation costs. Two references per level to the next level make
    2**levels; a 2.8 KB schema built so kept four workers busy for ever."""

    def __init__(self, validator: Any) -> None:
        import referencing.jsonschema
        meta = validator.META_SCHEMA
        self.spec = referencing.jsonschema.specification_with(
            dialect_id=validator.ID_OF(meta) or "urn:unknown-dialect",
            default=referencing.Specification.OPAQUE)
        # by id: every node stays alive while counting (the schema, and the files its $refs
        # name, each loaded once into the registry: see named_registry), and a $ref to a node
        # reaches that same object each time: a node's count is worked out once, then added
        # once per reference to it
        self.memo: dict[int, int] = {}
        self.active: set[int] = set()

    def size(self, node: Any, resolver: Any) -> int:
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        if key in self.active or not isinstance(node, (dict, list)):
            return 1  # a $ref cycle is validation's recursion limit's to stop
        self.active.add(key)
        total = 1
        if isinstance(node, dict):
            resolver = self.entered(resolver, node)
            for ref_key in ("$ref", "$dynamicRef"):
                ref = node.get(ref_key)
                if isinstance(ref, str):
                    resolved = resolver.lookup(ref)
                    total += self.size(resolved.contents, resolved.resolver)
            # by meaning: a map of properties is no schema (a property called "$id" used to
            # end the count with an AttributeError), and a property called "default" is one
            # (its subschemas used to go uncounted)
            children = schema_parts(node, _NOT_SUBSCHEMAS)
        else:
            children = node
        for child in children:
            total += self.size(child, resolver)
            if total > MAX_EXPANSION:
                break  # no need to count further
        self.active.discard(key)
        self.memo[key] = total
        return total

    def entered(self, resolver: Any, node: dict[str, Any]) -> Any:
        """``resolver`` inside the schema object ``node`` (its base URI when it has an id). An
        object under a keyword jsonschema does not know may carry any "$id" ({"x-a": {"$id": 5}}
        is a valid schema): jsonschema never enters it as a resource, and the count stays in
        ``resolver`` (an id that is no string raised AttributeError here)."""
        try:
            return resolver.in_subresource(self.spec.create_resource(node))
        except (AttributeError, TypeError, ValueError):
            return resolver


def check_inline(schema: dict[str, Any]) -> Validator:
    """A validator for ``schema`` once it is known usable; InvalidDocument
    (SCHEMA_VALIDATION_FAILED) with one clear line otherwise (see :func:`check_schema`)."""
    try:
        return check_schema(schema)
    except SchemaProblem as exc:
        raise InvalidDocument(f"the inline schema cannot be used: {exc}",
                              code=ErrorCode.SCHEMA_VALIDATION_FAILED) from None


def errors_of(validator: Validator, instance: Any) -> list[dict[str, str]]:
    """The errors of ``instance`` under ``validator`` as seed-001 entries in path order (see
    :func:`path_order`: ``items[2]`` before ``items[10]``): each distinct (field, error) once, at
    most :data:`MAX_ERRORS` of them. When there are more, the list ends with one entry (field
    ``$``, error :data:`MORE_ERRORS`) and the rest are not looked for: jsonschema finds errors
    lazily, and a 2 MB document with a million wrong items took minutes and gigabytes to list
    them all (counting them alone takes ~30 s). The ones kept are the first found; jsonschema
    walks an array's items by index, so of many wrong items the lowest indexes are kept.

    Never raises for a hostile schema or instance: running out of recursion (a schema or value
    nested absurdly deep, a ``$ref`` cycle) or an unresolvable ``$ref`` becomes an entry."""
    found: list[tuple[tuple[tuple[int, int | str], ...], dict[str, str]]] = []
    seen: set[tuple[str, str]] = set()  # several branches can report the same missing field
    trouble: dict[str, str] | None = None
    more = False
    try:
        for scanned, error in enumerate(validator.iter_errors(instance), 1):
            entry = describe(error)
            key = (entry["field"], entry["error"])
            if key not in seen:
                if len(found) == MAX_ERRORS:
                    more = True  # one error past the list
                    break
                seen.add(key)
                found.append((path_order(error.absolute_path), entry))
            elif scanned >= MAX_SCANNED:  # repeats of listed ones, on and on: stop reading
                more = True
                break
    except RecursionError:
        trouble = {"field": "$", "schema_path": "#",
                   "error": "validation gave up: the schema or the value nests too deeply "
                            "(or a $ref refers to itself)"}
    except referencing.exceptions.Unresolvable as exc:
        trouble = {"field": "$", "schema_path": "#",
                   "error": cut(f"the schema refers to something it does not contain: {exc}")}
    # stable: repeats keep the first schema_path found. The marker and any trouble entry go
    # after the sort, so they always end the list
    found.sort(key=lambda pair: pair[0])
    entries = [entry for _, entry in found]
    if more:
        entries.append({"field": "$", "schema_path": "#",
                        "error": MORE_ERRORS.format(listed=len(entries))})
    if trouble is not None:
        entries.append(trouble)
    return entries


def for_inline(schema: dict[str, Any]) -> Validator:
    """A validator for a schema a document carries: checked first (InvalidDocument when unusable),
    RE2 only, and no reference may reach outside the schema."""
    return check_inline(schema)


MAX_SCHEMA_FILES = 100  # other schema files one named schema's $refs may reach


def plain_ref(uri: str) -> bool:
    """True when ``uri`` (a ``$ref`` without its fragment) is a plain schema file name: no
    scheme, no folder, not hidden; the only kind a named schema's ``$ref`` may name."""
    return bool(uri) and not ("/" in uri or "\\" in uri or ":" in uri or uri.startswith("."))


def referenced_names(schema: Any) -> list[str]:
    """The plain file names ``schema``'s ``$ref``s name (``common.json`` of
    ``"common.json#/$defs/id"``), each once, in the order met (iterative: any depth). The
    schema is read by meaning (:func:`schema_parts`): a ``$ref`` inside ``enum`` or ``default``
    data names nothing, one in a property or definition called "enum" or "default" does."""
    names: dict[str, None] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):  # a list of schemas
            stack.extend(reversed(node))
        elif isinstance(node, dict):  # a schema object
            for key in ("$ref", "$dynamicRef"):
                value = node.get(key)
                if isinstance(value, str) and plain_ref(uri := value.split("#", 1)[0]):
                    names[uri] = None
            stack.extend(reversed(schema_parts(node)))
    return list(names)


def named_registry(schema: Any, load: Callable[[str], Any] | None) -> referencing.Registry:
    """The registry of a named schema: every file its ``$ref``s name by plain file name
    ("common.json"), and those files' own, read with ``load`` once, here; nothing is ever
    retrieved while validating (an address not in it is unresolvable: never fetched). A $ref
    used to read and parse its file at every lookup: 100 references to a 2.3 MB schema took
    18 s per handoff. SchemaProblem past :data:`MAX_SCHEMA_FILES` files."""
    if load is None:
        return _NO_RETRIEVAL
    import referencing.jsonschema
    resources: dict[str, referencing.Resource[Any]] = {}
    pending = referenced_names(schema)
    while pending:
        name = pending.pop(0)
        if name in resources:
            continue
        if len(resources) >= MAX_SCHEMA_FILES:
            raise SchemaProblem(f"its $refs name more than {MAX_SCHEMA_FILES} schema files")
        contents = load(name)
        _check_referenced(name, contents, schema)
        try:
            resources[name] = referencing.Resource.from_contents(
                contents, default_specification=referencing.jsonschema.DRAFT202012)
        except (AttributeError, referencing.exceptions.CannotDetermineSpecification):
            raise SchemaProblem(f"$ref {name[:200]!r} names a file that is no JSON Schema "
                                "(its $schema is not a dialect's address)") from None
        pending += referenced_names(contents)
    return _NO_RETRIEVAL.with_resources(resources.items())


def _check_referenced(name: str, contents: Any, root: Any) -> None:
    """SchemaProblem unless the file ``name`` a ``$ref`` names is a valid JSON Schema of its
    draft (the root's when it names none), as the root is checked: {"type": 5} there used to
    reach validation and end it with a TypeError."""
    own = isinstance(contents, dict) and "$schema" in contents
    try:
        validator_class(contents if own else root).check_schema(contents,
                                                                format_checker=FORMAT_CHECKER)
    except jsonschema.SchemaError as exc:
        reason = str(exc.cause) if isinstance(exc.cause, PatternError) else exc.message
        raise SchemaProblem(f"$ref {name[:200]!r} names a file that is not a valid JSON Schema: "
                            f"{reason[:300]}") from None
    except RecursionError:
        raise SchemaProblem(f"$ref {name[:200]!r} names a file that nests too deeply to be "
                            "checked") from None


def for_named(schema: dict[str, Any], load: Callable[[str], Any] | None = None) -> Validator:
    """A validator for an operator's (named) schema, checked as an inline one is (RE2 only, a
    bounded expansion); its ``$ref``s may name other schemas, read with ``load`` (once each,
    now: see :func:`named_registry`). SchemaProblem when it cannot be used."""
    return check_schema(schema, named_registry(schema, load))
