"""A quick yes for valid documents: named schemas compiled into straight-line Python.

jsonschema walks a schema keyword by keyword and builds a validator object at each step down:
about 0.4 ms for a seed-001 request, paid by every handoff. The schemas handoffd ships (and most
an operator writes) use a small set of keywords, so each named schema is also compiled once into
Python source (as fastjsonschema does) that only answers "valid" or "not valid". "Valid" is final;
"not valid" sends the document to jsonschema, which says why and stays the judge (were the two
ever to disagree, the document gets jsonschema's verdict). A schema with any keyword outside the
set is not compiled: it always goes to jsonschema. ``tests/test_fastschema.py`` holds the two to
agreement.

The generated code: one function per ``$ref`` target and per subschema whose verdict is needed as
a value (``anyOf``, ``oneOf``, ``not``, ``if``, ``contains``); everything else is inlined as
``if ...: return False`` statements, with explicit ``for`` loops (no generators, no ``all()``: a
deeply nested document recurses on the Python stack only, up to a RecursionError). Schemas are
hostile input (a workspace's ``schemas/`` folder, or a document): no value from a schema is ever
written into the source. Property names, enum options, bounds and the like are passed to the
generated code as ``_cN`` names in its namespace; the source holds only names made here.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import re2

from .schemachecks import PatternError, compile_pattern, conforms, equal

Check = Callable[[Any], bool]

# keywords that assert nothing (``$defs`` is reached through ``$ref``)
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$defs", "definitions", "title",
                         "description", "examples", "default", "readOnly", "writeOnly",
                         "deprecated"})
# the drafts whose "integer" excludes 1.0 (and whose bounds differ): jsonschema alone decides
_OLD_DRAFTS = ("draft-03", "draft-04")
_NUMBER_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">",
                  "exclusiveMaximum": "<"}
# bounds on a length: (the kind they apply to, the comparison that makes a value invalid)
_LENGTH_BOUNDS = {"minItems": ("array", "<"), "maxItems": ("array", ">"),
                  "minLength": ("string", "<"), "maxLength": ("string", ">")}
# JSON Schema types as Python tests of the value named {v}; bool is not a number in JSON Schema,
# and (draft 6 on) 1.0 is an integer
_TYPE_TESTS = {
    "object": "isinstance({v}, dict)",
    "array": "isinstance({v}, list)",
    "string": "isinstance({v}, str)",
    "boolean": "({v} is True or {v} is False)",
    "null": "{v} is None",
    "number": "(isinstance({v}, (int, float)) and not isinstance({v}, bool))",
    "integer": "((isinstance({v}, int) and not isinstance({v}, bool))"
               " or (isinstance({v}, float) and {v}.is_integer()))",
}
# the test a keyword applies before asserting anything (other values pass), by the kind it needs
_GUARDS = {"object": "isinstance({v}, dict)", "array": "isinstance({v}, list)",
           "string": "isinstance({v}, str)",
           "number": "(isinstance({v}, (int, float)) and not isinstance({v}, bool))"}
_KIND_OF_TYPE = {"object": "object", "array": "array", "string": "string", "number": "number",
                 "integer": "number"}  # a known type that makes a guard true
# a JSON pointer that reads the same as a URI fragment (jsonschema's reading) and as it stands
_PLAIN_REF = re.compile(r"#(/[A-Za-z0-9_.~$@:+-]*)*")
BIG_ENUM = 32  # options from which an enum is checked by hashing (member_test), not one by one
_MAX_INDENT = 10  # deeper subschemas become functions of their own (CPython nests 20 blocks at most)


class _Unsupported(Exception):
    """A keyword (or a form of one) the compiler does not handle: jsonschema alone decides."""


def compile_schema(schema: Any, *, draft7: bool = False) -> Check | None:
    """A check answering True only for instances ``schema`` accepts, or None when the schema
    uses something this module does not compile. ``draft7``: ``$ref`` ignores its siblings."""
    try:
        source, namespace = _source(schema, draft7)
        exec(compile(source, "<fastschema>", "exec"), namespace)  # the source holds no schema text
    except (_Unsupported, PatternError, RecursionError, SyntaxError):
        return None
    check: Check = namespace["_f0"]
    return check


def is_valid(check: Check, instance: Any) -> bool:
    """``check(instance)``, False (ask jsonschema) when a value defeats it."""
    try:
        return check(instance)
    except (RecursionError, TypeError, ValueError):
        return False


# ---------------------------------------------------------------- uniqueItems in linear time
# jsonschema's uniqueItems sorts the items, and when they do not sort (objects, or ints mixed
# with strings) compares every pair: 8,000 small objects took 86 s. Here each item gets a
# hashable key, equal exactly when the items are equal as JSON, and one set finds a repeat.
_TRUE, _FALSE, _ARRAY, _OBJECT, _LOOSE = (object() for _ in range(5))
# documents.MAX_DEPTH: no document nests deeper (not imported from there: documents imports
# config, which imports validation, which imports this module)
KEY_DEPTH = 64


def json_key(value: Any, loose: list[bool], depth: int = 0) -> Any:
    """A hashable key of JSON ``value``, equal to another's exactly when the two values are
    equal in JSON Schema's sense: ``1`` is ``1.0`` (Python hashes them alike), ``true`` is not
    ``1``, arrays member by member in order, objects by their keys whatever the order. Past
    :data:`KEY_DEPTH` levels (no document nests deeper), or for a value that is not JSON, the
    key stands for anything at all: ``loose[0]`` is set, and two values with equal loose keys
    must still be compared. The recursion stops there too."""
    if isinstance(value, str):
        return value
    if value is True:
        return _TRUE
    if value is False:
        return _FALSE
    if value is None or isinstance(value, (int, float)):
        return value
    if depth < KEY_DEPTH:
        if isinstance(value, (list, tuple)):
            return (_ARRAY, tuple([json_key(item, loose, depth + 1) for item in value]))
        if isinstance(value, dict):
            return (_OBJECT, frozenset([(name, json_key(item, loose, depth + 1))
                                        for name, item in value.items()]))
    loose[0] = True
    return _LOOSE


def unique_items(items: Any) -> bool:
    """True when no two of ``items`` are equal as JSON (``uniqueItems``), in time linear in
    their size: only items whose keys are loose (see :func:`json_key`) are compared, and only
    with the others of the same key."""
    exact: set[Any] = set()
    loose_ones: dict[Any, list[Any]] = {}
    for item in items:
        loose = [False]
        key = json_key(item, loose)
        if not loose[0]:
            if key in exact:
                return False
            exact.add(key)
            continue
        same = loose_ones.setdefault(key, [])
        for other in same:
            if equal(item, other):
                return False
        same.append(item)
    return True


def member_test(options: list[Any]) -> Check:
    """A test true when a value equals (as JSON) one of ``options`` (``enum``), in time linear
    in the value's size however many options there are: a 300,000-option enum took 0.1 s per
    value compared one by one."""
    exact: set[Any] = set()
    loose_ones: list[Any] = []  # (options past KEY_DEPTH, or not JSON: compared one by one)
    for option in options:
        loose = [False]
        key = json_key(option, loose)
        if loose[0]:
            loose_ones.append(option)
        else:
            exact.add(key)

    def test(value: Any) -> bool:
        loose = [False]
        key = json_key(value, loose)
        if loose[0]:
            return any(equal(value, option) for option in options)
        return key in exact or any(equal(value, option) for option in loose_ones)
    return test


def _source(schema: Any, draft7: bool) -> tuple[str, dict[str, Any]]:
    """The Python source of ``schema``'s check (function ``_f0``) and the namespace it runs in.
    _Unsupported (or PatternError, RecursionError) when the schema cannot be compiled."""
    if isinstance(schema, dict) and any(d in str(schema.get("$schema", "")) for d in _OLD_DRAFTS):
        raise _Unsupported("a draft older than 6")
    gen = _Generator(schema, draft7)
    gen.function(schema)
    return "\n\n".join(gen.functions) + "\n", gen.namespace


def _pattern_test(pattern: str) -> Callable[[str], Any]:
    """A callable truthy when ``pattern`` matches somewhere in a string. The engine is
    compile_pattern's (RE2); the pattern is asked through a one-pattern RE2 Set, which answers yes/no without building a
    match object (~1 us against ~5-13 us for ``search`` on the seed's patterns)."""
    searcher: Any = compile_pattern(pattern)  # as the schema's validator does
    try:  # the same pattern, with the same options, on the same engine
        found = re2.Set.SearchSet(searcher.options)
        found.Add(searcher.pattern)
        found.Compile()
    except re2.error:
        return searcher.search
    return found.Match  # a list of the matching patterns' indexes, None when none matched


Lines = list[str]


class _Generator:
    """Writes one Python function per compiled subschema into ``functions``."""

    def __init__(self, root: Any, draft7: bool) -> None:
        self.root = root
        self.draft7 = draft7
        self.functions: list[str] = []
        self.namespace: dict[str, Any] = {"equal": equal, "conforms": conforms,
                                          "unique_items": unique_items}
        self.refs: dict[str, str] = {}  # $ref -> the name of its target's function
        self.names = 0  # functions named so far
        self.variables = 0

    # ------------------------------------------------------------ names
    def const(self, value: Any) -> str:
        """A namespace name bound to ``value`` (schema values reach the code only this way)."""
        name = f"_c{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def variable(self, prefix: str = "x") -> str:
        self.variables += 1
        return f"{prefix}{self.variables}"

    def function(self, schema: Any, name: str | None = None) -> str:
        """The name of a new function ``name(v) -> bool`` for ``schema``."""
        if name is None:
            name = self.new_function_name()
        body = self.block(schema, "v", 1, None)
        self.functions.append("\n".join([f"def {name}(v):", *body, "    return True"]))
        return name

    def new_function_name(self) -> str:
        name = f"_f{self.names}"
        self.names += 1
        return name

    # ------------------------------------------------------------ statements
    def block(self, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        """Statements (indented ``depth`` levels) returning False unless ``var`` satisfies
        ``schema``. ``known``: the kind ``var`` is already known to be (or None)."""
        pad = "    " * depth
        if schema is True:
            return []
        if schema is False:
            return [pad + "return False"]
        if not isinstance(schema, dict):
            raise _Unsupported("schema is not an object")
        if depth > _MAX_INDENT:
            return [pad + f"if not {self.function(schema)}({var}): return False"]
        if "$id" in schema and schema is not self.root:
            raise _Unsupported("$id below the root")  # $refs inside resolve against it
        if "$ref" in schema and self.draft7 and set(schema) - ANNOTATIONS - {"$ref"}:
            raise _Unsupported("draft 7 $ref with siblings")
        out: Lines = []
        for key, value in schema.items():
            if key in ANNOTATIONS:
                continue
            if key in _NUMBER_BOUNDS:
                out += self.bound(key, value, var, depth, known)
                continue
            if key in _LENGTH_BOUNDS:
                out += self.length(*_LENGTH_BOUNDS[key], value, var, depth, known)
                continue
            emit = _KEYWORDS.get(key)
            if emit is None:
                raise _Unsupported(key)
            out += emit(self, value, schema, var, depth, known)
            if key == "type" and isinstance(value, str):
                known = _KIND_OF_TYPE.get(value)
        return out

    def guarded(self, kind: str, var: str, depth: int, known: str | None,
                inner: Callable[[int], Lines]) -> Lines:
        """``inner``'s statements, run only when ``var`` is of ``kind`` (a keyword about objects
        says nothing of strings): behind an ``if`` unless ``known`` says so already."""
        if known == kind:
            return inner(depth)
        body = inner(depth + 1)
        if not body:
            return []
        return ["    " * depth + f"if {_GUARDS[kind].format(v=var)}:", *body]

    def bound(self, key: str, value: Any, var: str, depth: int, known: str | None) -> Lines:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _Unsupported(f"{key} that is not a number")  # e.g. draft 4's booleans
        c = self.const(value)
        test = f"not ({var} {_NUMBER_BOUNDS[key]} {c})"
        return self.guarded("number", var, depth, known,
                            lambda d: ["    " * d + f"if {test}: return False"])

    def length(self, kind: str, op: str, value: Any, var: str, depth: int,
               known: str | None) -> Lines:
        """A bound on the length of ``kind`` values (other values pass)."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _Unsupported("a length that is not a count")
        c = self.const(value)
        return self.guarded(kind, var, depth, known,
                            lambda d: ["    " * d + f"if len({var}) {op} {c}: return False"])

    def each(self, value: Any) -> list[Any]:
        if not isinstance(value, list) or not value:
            raise _Unsupported("an empty or malformed list of schemas")
        return value

    def resolve(self, ref: str) -> Any:
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise _Unsupported(f"unresolvable $ref {ref}")
        return target

    # ------------------------------------------------------------ one method per keyword
    def k_type(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _Unsupported("type")
        if not all(n in _TYPE_TESTS for n in names):
            raise _Unsupported("an unknown type")
        pad = "    " * depth
        if not names:
            return [pad + "return False"]
        tests = " or ".join(_TYPE_TESTS[n].format(v=var) for n in dict.fromkeys(names))
        return [pad + f"if not ({tests}): return False"]

    def k_properties(self, value: Any, schema: Any, var: str, depth: int,
                     known: str | None) -> Lines:
        if not isinstance(value, dict):
            raise _Unsupported("properties")

        def inner(d: int) -> Lines:
            pad = "    " * d
            out: Lines = []
            for name, sub in value.items():
                item = self.variable()
                body = self.block(sub, item, d + 1, None)
                if body:
                    c = self.const(name)
                    out += [pad + f"if {c} in {var}:", pad + f"    {item} = {var}[{c}]", *body]
            return out
        return self.guarded("object", var, depth, known, inner)

    def k_required(self, value: Any, schema: Any, var: str, depth: int,
                   known: str | None) -> Lines:
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise _Unsupported("required")

        def inner(d: int) -> Lines:
            names = [self.const(n) for n in dict.fromkeys(value)]
            return ["    " * d + "if " + " or ".join(f"{c} not in {var}" for c in names[i:i + 8])
                    + ": return False" for i in range(0, len(names), 8)]
        return self.guarded("object", var, depth, known, inner)

    def k_additionalProperties(self, value: Any, schema: Any, var: str, depth: int,
                               known: str | None) -> Lines:
        if "patternProperties" in schema or "unevaluatedProperties" in schema:
            raise _Unsupported("additionalProperties with patterns")
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise _Unsupported("properties")

        def inner(d: int) -> Lines:
            pad = "    " * d
            key, item = self.variable("k"), self.variable()
            body = self.block(value, item, d + 2, None)
            if not body:
                return []
            c = self.const(frozenset(props))
            return [pad + f"for {key}, {item} in {var}.items():",
                    pad + f"    if {key} not in {c}:", *body]
        return self.guarded("object", var, depth, known, inner)

    def k_items(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        if isinstance(value, list) or "prefixItems" in schema:
            raise _Unsupported("tuple items")

        def inner(d: int) -> Lines:
            item = self.variable()
            body = self.block(value, item, d + 1, None)
            return ["    " * d + f"for {item} in {var}:", *body] if body else []
        return self.guarded("array", var, depth, known, inner)

    def k_contains(self, value: Any, schema: Any, var: str, depth: int,
                   known: str | None) -> Lines:
        if "minContains" in schema or "maxContains" in schema:
            raise _Unsupported("minContains")
        test = self.function(value)

        def inner(d: int) -> Lines:
            pad, item = "    " * d, self.variable()
            return [pad + f"for {item} in {var}:", pad + f"    if {test}({item}): break",
                    pad + "else:", pad + "    return False"]
        return self.guarded("array", var, depth, known, inner)

    def k_pattern(self, value: Any, schema: Any, var: str, depth: int,
                  known: str | None) -> Lines:
        if not isinstance(value, str):
            raise _Unsupported("pattern")
        c = self.const(_pattern_test(value))
        return self.guarded("string", var, depth, known,
                            lambda d: ["    " * d + f"if not {c}({var}): return False"])

    def k_uniqueItems(self, value: Any, schema: Any, var: str, depth: int,
                      known: str | None) -> Lines:
        if not isinstance(value, bool):
            raise _Unsupported("uniqueItems")
        if not value:
            return []
        return self.guarded("array", var, depth, known,
                            lambda d: ["    " * d + f"if not unique_items({var}): return False"])

    def k_format(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        if not isinstance(value, str):
            raise _Unsupported("format")
        return ["    " * depth + f"if not conforms({var}, {self.const(value)}): return False"]

    def k_enum(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        if not isinstance(value, list):
            raise _Unsupported("enum")
        pad = "    " * depth
        if all(isinstance(option, str) for option in value):
            # equal(v, a string) is v == the string; ``in`` a tuple tests ``is``, then ``==``
            return [pad + f"if {var} not in {self.const(tuple(value))}: return False"]
        if len(value) >= BIG_ENUM:
            return [pad + f"if not {self.const(member_test(value))}({var}): return False"]
        option = self.variable("o")
        return [pad + f"for {option} in {self.const(list(value))}:",
                pad + f"    if equal({var}, {option}): break",
                pad + "else:", pad + "    return False"]

    def k_const(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        pad, c = "    " * depth, self.const(value)
        if value is None or value is True or value is False:  # equal(v, True) is v is True
            return [pad + f"if {var} is not {c}: return False"]
        if isinstance(value, str):
            return [pad + f"if not ({var} == {c}): return False"]
        return [pad + f"if not equal({var}, {c}): return False"]

    def k_allOf(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        out: Lines = []
        for sub in self.each(value):
            out += self.block(sub, var, depth, known)
        return out

    def k_anyOf(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        tests = [f"{self.function(sub)}({var})" for sub in self.each(value)]
        return ["    " * depth + f"if not ({' or '.join(tests)}): return False"]

    def k_oneOf(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        pad, count = "    " * depth, self.variable("n")
        tests = [self.function(sub) for sub in self.each(value)]  # all asked, as sum() did
        return [pad + f"{count} = 0", *(pad + f"if {t}({var}): {count} += 1" for t in tests),
                pad + f"if {count} != 1: return False"]

    def k_not(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        return ["    " * depth + f"if {self.function(value)}({var}): return False"]

    def k_if(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        pad, test = "    " * depth, self.function(value)
        then = self.block(schema.get("then", True), var, depth + 1, known)
        otherwise = self.block(schema.get("else", True), var, depth + 1, known)
        if not then and not otherwise:
            return [pad + f"{test}({var})"]  # asked all the same (it may raise)
        return [pad + f"if {test}({var}):", *(then or [pad + "    pass"]),
                pad + "else:", *(otherwise or [pad + "    pass"])]

    def k_then(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        return []  # applied by "if" (alone, it asserts nothing)

    k_else = k_then

    def k_ref(self, value: Any, schema: Any, var: str, depth: int, known: str | None) -> Lines:
        if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
            raise _Unsupported("$ref outside the schema")
        if not _PLAIN_REF.fullmatch(value):  # jsonschema reads a URI (percent-decoded, ...)
            raise _Unsupported("a $ref that is not a plain JSON pointer")
        name = self.refs.get(value)
        if name is None:  # compile once; a recursive reference finds the name already given
            name = self.refs[value] = self.new_function_name()
            self.function(self.resolve(value), name)
        return ["    " * depth + f"if not {name}({var}): return False"]


# keyword -> its method (an explicit table: a schema's keys never pick a method by name)
_KEYWORDS: dict[str, Callable[[_Generator, Any, Any, str, int, str | None], Lines]] = {
    "$ref": _Generator.k_ref, "type": _Generator.k_type,
    "properties": _Generator.k_properties, "required": _Generator.k_required,
    "additionalProperties": _Generator.k_additionalProperties, "items": _Generator.k_items,
    "contains": _Generator.k_contains, "pattern": _Generator.k_pattern,
    "uniqueItems": _Generator.k_uniqueItems,
    "format": _Generator.k_format, "enum": _Generator.k_enum, "const": _Generator.k_const,
    "allOf": _Generator.k_allOf, "anyOf": _Generator.k_anyOf, "oneOf": _Generator.k_oneOf,
    "not": _Generator.k_not, "if": _Generator.k_if, "then": _Generator.k_then,
    "else": _Generator.k_else,
}
