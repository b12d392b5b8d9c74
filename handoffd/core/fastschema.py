"""A quick yes for valid documents: named schemas compiled into plain Python checks.

jsonschema walks a schema keyword by keyword and builds a validator object at each step down:
about 0.6 ms for a seed-001 request, paid by every handoff. The schemas handoffd ships (and most
an operator writes) use a small set of keywords, so each named schema is also compiled once into
nested closures that only answer "valid" or "not valid". "Valid" is final; "not valid" sends the
document to jsonschema, which says why and stays the judge (were the two ever to disagree, the
document gets jsonschema's verdict). A schema with any keyword outside the set is not compiled:
it always goes to jsonschema. ``tests/test_fastschema.py`` holds the two to agreement.
"""
from __future__ import annotations

from typing import Any, Callable

from .jsonschema_re2 import PatternError, compile_pattern, conforms, equal

Check = Callable[[Any], bool]

# keywords that assert nothing (``$defs`` is reached through ``$ref``)
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$defs", "definitions", "title",
                         "description", "examples", "default", "readOnly", "writeOnly",
                         "deprecated"})
_NUMBER_BOUNDS: dict[str, Callable[[float, float], bool]] = {
    "minimum": lambda x, bound: x >= bound, "maximum": lambda x, bound: x <= bound,
    "exclusiveMinimum": lambda x, bound: x > bound,
    "exclusiveMaximum": lambda x, bound: x < bound}


class _Unsupported(Exception):
    """A keyword (or a form of one) the compiler does not handle: jsonschema alone decides."""


def compile_schema(schema: Any, *, draft7: bool = False) -> Check | None:
    """A check answering True only for instances ``schema`` accepts, or None when the schema
    uses something this module does not compile. ``draft7``: ``$ref`` ignores its siblings."""
    try:
        return _Compiler(schema, draft7).compile(schema)
    except (_Unsupported, PatternError, RecursionError):
        return None


def is_valid(check: Check, instance: Any) -> bool:
    """``check(instance)``, False (ask jsonschema) when a value defeats it."""
    try:
        return check(instance)
    except (RecursionError, TypeError, ValueError):
        return False


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if isinstance(value, bool):
        return False
    if name == "number":
        return isinstance(value, (int, float))
    if name == "integer":  # draft 6 on: 1.0 is an integer
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    raise _Unsupported(name)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Compiler:
    def __init__(self, root: Any, draft7: bool) -> None:
        self.root = root
        self.draft7 = draft7
        self.refs: dict[str, list[Check]] = {}  # compiled $ref targets (a list: filled late)

    def compile(self, schema: Any) -> Check:
        if schema is True:
            return lambda value: True
        if schema is False:
            return lambda value: False
        if not isinstance(schema, dict):
            raise _Unsupported("schema is not an object")
        if "$ref" in schema and self.draft7 and set(schema) - ANNOTATIONS - {"$ref"}:
            raise _Unsupported("draft 7 $ref with siblings")
        made = [self.keyword(key, value, schema) for key, value in schema.items()
                if key not in ANNOTATIONS]
        checks = [c for c in made if c is not None]
        if len(checks) == 1:
            return checks[0]
        return lambda value: all(check(value) for check in checks)

    def keyword(self, key: str, value: Any, schema: dict[str, Any]) -> Check | None:
        if key == "$ref":
            return self.k_ref(value, schema)
        maker = None if key.startswith("$") or key == "ref" else getattr(self, "k_" + key, None)
        if maker is None:
            if key in _NUMBER_BOUNDS:
                return self.bound(key, value)
            raise _Unsupported(key)
        return maker(value, schema)  # type: ignore[no-any-return]

    # ------------------------------------------------------------ one method per keyword
    def k_type(self, value: Any, schema: Any) -> Check:
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _Unsupported("type")
        for name in names:
            _is_type(None, name)  # unknown type names raise here, once
        return lambda v: any(_is_type(v, n) for n in names)

    def k_properties(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, dict):
            raise _Unsupported("properties")
        props = [(name, self.compile(sub)) for name, sub in value.items()]
        return lambda v: not isinstance(v, dict) or all(
            name not in v or check(v[name]) for name, check in props)

    def k_required(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise _Unsupported("required")
        return lambda v: not isinstance(v, dict) or all(n in v for n in value)

    def k_additionalProperties(self, value: Any, schema: Any) -> Check:
        if "patternProperties" in schema or "unevaluatedProperties" in schema:
            raise _Unsupported("additionalProperties with patterns")
        known = set(schema.get("properties") or {})
        check = self.compile(value)
        return lambda v: not isinstance(v, dict) or all(
            k in known or check(item) for k, item in v.items())

    def k_items(self, value: Any, schema: Any) -> Check:
        if isinstance(value, list) or "prefixItems" in schema:
            raise _Unsupported("tuple items")
        check = self.compile(value)
        return lambda v: not isinstance(v, list) or all(check(item) for item in v)

    def k_contains(self, value: Any, schema: Any) -> Check:
        if "minContains" in schema or "maxContains" in schema:
            raise _Unsupported("minContains")
        check = self.compile(value)
        return lambda v: not isinstance(v, list) or any(check(item) for item in v)

    def k_minItems(self, value: Any, schema: Any) -> Check:
        return self.length(list, value, at_least=True)

    def k_maxItems(self, value: Any, schema: Any) -> Check:
        return self.length(list, value, at_least=False)

    def k_minLength(self, value: Any, schema: Any) -> Check:
        return self.length(str, value, at_least=True)

    def k_maxLength(self, value: Any, schema: Any) -> Check:
        return self.length(str, value, at_least=False)

    def k_pattern(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, str):
            raise _Unsupported("pattern")
        searcher = compile_pattern(value, trusted=True)  # as the named schema's validator does
        return lambda v: not isinstance(v, str) or bool(searcher.search(v))

    def k_format(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, str):
            raise _Unsupported("format")
        return lambda v: conforms(v, value)

    def k_enum(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, list):
            raise _Unsupported("enum")
        return lambda v: any(equal(v, option) for option in value)

    def k_const(self, value: Any, schema: Any) -> Check:
        return lambda v: bool(equal(v, value))

    def k_allOf(self, value: Any, schema: Any) -> Check:
        checks = self.each(value)
        return lambda v: all(check(v) for check in checks)

    def k_anyOf(self, value: Any, schema: Any) -> Check:
        checks = self.each(value)
        return lambda v: any(check(v) for check in checks)

    def k_oneOf(self, value: Any, schema: Any) -> Check:
        checks = self.each(value)
        return lambda v: sum(1 for check in checks if check(v)) == 1

    def k_not(self, value: Any, schema: Any) -> Check:
        check = self.compile(value)
        return lambda v: not check(v)

    def k_if(self, value: Any, schema: Any) -> Check:
        test = self.compile(value)
        then = self.compile(schema.get("then", True))
        otherwise = self.compile(schema.get("else", True))
        return lambda v: then(v) if test(v) else otherwise(v)

    def k_then(self, value: Any, schema: Any) -> None:
        return None  # applied by "if" (alone, it asserts nothing)

    k_else = k_then

    def k_ref(self, value: Any, schema: Any) -> Check:
        if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
            raise _Unsupported("$ref outside the schema")
        slot = self.refs.get(value)
        if slot is None:  # compile once; a recursive reference finds the slot filled later
            slot = self.refs[value] = []
            slot.append(self.compile(self.resolve(value)))
        return lambda v: slot[0](v)

    # ------------------------------------------------------------ helpers
    def bound(self, key: str, value: Any) -> Check:
        if not _number(value):
            raise _Unsupported(f"{key} that is not a number")  # e.g. draft 4's booleans
        test = _NUMBER_BOUNDS[key]
        return lambda v: not _number(v) or test(v, value)

    def each(self, value: Any) -> list[Check]:
        if not isinstance(value, list) or not value:
            raise _Unsupported("an empty or malformed list of schemas")
        return [self.compile(sub) for sub in value]

    @staticmethod
    def length(kind: type[list[Any]] | type[str], value: Any, *, at_least: bool) -> Check:
        """A bound on the length of ``kind`` values (other values pass)."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _Unsupported("a length that is not a count")
        if at_least:
            return lambda v: not isinstance(v, kind) or len(v) >= value
        return lambda v: not isinstance(v, kind) or len(v) <= value

    def resolve(self, ref: str) -> Any:
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise _Unsupported(f"unresolvable $ref {ref}")
        return target
