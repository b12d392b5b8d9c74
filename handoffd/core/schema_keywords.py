"""The validator classes handoffd validates with: jsonschema's, each draft's keywords that call
``re.search`` replaced by versions that compile with RE2 (linear time), and ``uniqueItems`` and
large enums hashed instead of compared pair by pair. Split from
:mod:`~handoffd.core.jsonschema_re2`, which builds and runs validators of these classes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator

import jsonschema
# private helper, absent from the types-jsonschema stubs (they cover the module's keyword functions)
from jsonschema._legacy_keywords import lookup_recursive_ref  # type: ignore[attr-defined]
from jsonschema.exceptions import ValidationError

from .fastschema import BIG_ENUM, member_test, unique_items
from .schemachecks import PatternError, Searcher, compile_pattern, equal

MAX_MESSAGE = 300  # characters of one entry's error (and field, schema_path): see describe


def cut(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` cut to ``limit`` characters (``head...ta``): entries stay readable and small."""
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


# ---------------------------------------------------------------- RE2-backed keywords
# jsonschema calls re.search in four keywords (pattern, patternProperties, and through helpers in
# additionalProperties and unevaluatedProperties); each is replaced by a version that compiles
# with compile_pattern. They mirror jsonschema 4's implementations otherwise. uniqueItems is
# replaced too: jsonschema's compares every pair of items that do not sort (objects), and a
# 218 KB request held a worker for 104 s; fastschema.unique_items hashes each item once.

def _keywords(legacy_2019: bool) -> dict[str, Callable[..., Iterator[ValidationError]]]:
    """Keyword implementations on RE2 (``legacy_2019``: draft 2019-09's variants), and a
    linear-time ``uniqueItems``."""

    def searcher(pattern: str) -> Searcher | None:
        try:
            return compile_pattern(pattern)
        except PatternError:
            return None  # reported by the pattern / patternProperties keyword itself

    def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
        if not validator.is_type(instance, "string"):
            return
        try:
            compiled = compile_pattern(patrn)
        except PatternError as exc:
            yield ValidationError(str(exc))
            return
        if not compiled.search(instance):
            yield ValidationError(f"{_short(instance)} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any,
                           schema: Any) -> Iterator[ValidationError]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            try:
                compiled = compile_pattern(patrn)
            except PatternError as exc:
                yield ValidationError(str(exc))
                continue
            for key, value in instance.items():
                if compiled.search(key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def matches_any(patterns: Any, key: str) -> bool:
        return any(c is not None and c.search(key) for c in map(searcher, patterns or {}))

    def additional_properties(validator: Any, ap: Any, instance: Any,
                              schema: Any) -> Iterator[ValidationError]:
        if not validator.is_type(instance, "object"):
            return
        properties = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extras = {k for k in instance if k not in properties and not matches_any(patterns, k)}
        if validator.is_type(ap, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], ap, path=extra)
        elif not ap and extras:
            if "patternProperties" in schema:
                verb = "does" if len(extras) == 1 else "do"
                joined = ", ".join(_short(each) for each in sorted(extras))
                listed = ", ".join(repr(each) for each in sorted(patterns))
                yield ValidationError(f"{joined} {verb} not match any of the regexes: {listed}")
            else:
                names = ", ".join(_short(e) for e in sorted(extras, key=str))
                verb = "was" if len(extras) == 1 else "were"
                yield ValidationError(f"Additional properties are not allowed ({names} {verb} "
                                      "unexpected)")

    def evaluated_keys(validator: Any, instance: dict[str, Any], schema: Any) -> list[str]:
        """The keys of ``instance`` some keyword of ``schema`` evaluated (jsonschema's
        find_evaluated_property_keys_by_schema, drafts 2020-12 and 2019-09, with RE2)."""
        if validator.is_type(schema, "boolean"):
            return []
        found: list[str] = []

        def via(resolved: Any) -> list[str]:  # a $ref / $dynamicRef / $recursiveRef target
            return evaluated_keys(validator.evolve(schema=resolved.contents,
                                                   _resolver=resolved.resolver),
                                  instance, resolved.contents)

        if schema.get("$ref") is not None:
            found += via(validator._resolver.lookup(schema["$ref"]))
        if not legacy_2019 and schema.get("$dynamicRef") is not None:
            found += via(validator._resolver.lookup(schema["$dynamicRef"]))
        if legacy_2019 and "$recursiveRef" in schema:
            found += via(lookup_recursive_ref(validator._resolver))
        if legacy_2019:
            for keyword in ("properties", "additionalProperties", "unevaluatedProperties"):
                value = schema.get(keyword)
                if value is True:
                    found += instance.keys()
                elif isinstance(value, dict):
                    found += [p for p in value if p in instance]
        else:
            properties = schema.get("properties")
            if validator.is_type(properties, "object"):
                found += properties.keys() & instance.keys()
            for keyword in ("additionalProperties", "unevaluatedProperties"):
                if (sub := schema.get(keyword)) is not None:
                    found += [k for k, v in instance.items() if _valid(validator.descend(v, sub))]
        found += [k for k in instance if matches_any(schema.get("patternProperties"), k)]
        for key, sub in (schema.get("dependentSchemas") or {}).items():
            if key in instance:
                found += evaluated_keys(validator, instance, sub)
        for keyword in ("allOf", "oneOf", "anyOf"):
            for sub in schema.get(keyword, []):
                if _valid(validator.descend(instance, sub)):
                    found += evaluated_keys(validator, instance, sub)
        if "if" in schema:
            if validator.evolve(schema=schema["if"]).is_valid(instance):
                found += evaluated_keys(validator, instance, schema["if"])
                if "then" in schema:
                    found += evaluated_keys(validator, instance, schema["then"])
            elif "else" in schema:
                found += evaluated_keys(validator, instance, schema["else"])
        return found

    def unevaluated_properties(validator: Any, up: Any, instance: Any,
                               schema: Any) -> Iterator[ValidationError]:
        if not validator.is_type(instance, "object"):
            return
        seen = set(evaluated_keys(validator, instance, schema))
        bad = [k for k in instance if k not in seen
               and not _valid(validator.descend(instance[k], up, path=k, schema_path=k))]
        if not bad:
            return
        verb = "was" if len(bad) == 1 else "were"
        if up is False:
            names = ", ".join(_short(e) for e in sorted(bad, key=str))
            yield ValidationError(f"Unevaluated properties are not allowed ({names} {verb} unexpected)")
        else:
            names = ", ".join(_short(e) for e in bad)
            yield ValidationError("Unevaluated properties are not valid under the given schema "
                                  f"({names} {verb} unevaluated and invalid)")

    def enum(validator: Any, enums: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        if len(enums) < BIG_ENUM:
            if all(not equal(option, instance) for option in enums):
                yield ValidationError(f"{instance!r} is not one of {enums!r}")
            return
        test, shown = _members(enums)
        if not test(instance):
            yield ValidationError(f"{instance!r} is not one of {shown()}")

    def unique(validator: Any, ui: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        # (JSON equality, where jsonschema's sorting shortcut missed a repeat such as [[1], [true],
        # [1]]: Python sorts [true] between the two [1]s, and it compares neighbours only)
        if ui and validator.is_type(instance, "array") and not unique_items(instance):
            yield ValidationError(f"{_short(instance)} has non-unique elements")

    return {"pattern": pattern, "patternProperties": pattern_properties,
            "additionalProperties": additional_properties,
            "unevaluatedProperties": unevaluated_properties, "uniqueItems": unique, "enum": enum}


# the hashed tests of the large enums met lately: id(options) -> (options, test, shown text).
# The options are held so that their id is not reused while listed; a validator runs one
# keyword function per check and has no place of its own to keep them. An enum met again after
# it left the list pays to build its test again, no more than comparing its options would.
_MEMBERS: OrderedDict[int, tuple[Any, Callable[[Any], bool], list[str]]] = OrderedDict()
_MEMBERS_SIZE = 64
_MEMBERS_LOCK = threading.Lock()


def _members(options: Any) -> tuple[Callable[[Any], bool], Callable[[], str]]:
    """The hashed membership test of a large ``enum`` (fastschema.member_test), and a function
    giving the options as its message shows them (``repr``, cut, made once: a 300,000-option
    enum's repr is 2 MB)."""
    with _MEMBERS_LOCK:
        found = _MEMBERS.get(id(options))
        if found is not None and found[0] is options:
            _MEMBERS.move_to_end(id(options))
    if found is None or found[0] is not options:
        found = (options, member_test(options), [])
        with _MEMBERS_LOCK:
            _MEMBERS[id(options)] = found
            while len(_MEMBERS) > _MEMBERS_SIZE:
                _MEMBERS.popitem(last=False)
    text = found[2]

    def shown() -> str:
        if not text:
            text.append(cut(repr(options)))
        return text[0]
    return found[1], shown


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error entries must stay readable (and small)
    when a document holds a megabyte-long string."""
    return cut(repr(value), limit)


def _valid(errors: Iterator[ValidationError]) -> bool:
    return next(errors, None) is None


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def validator_class(schema: Any) -> Any:
    """The validator class for ``schema``'s draft (default 2020-12) with the RE2 keywords."""
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        schema = {}  # {"$schema": 5} made jsonschema fail with an AttributeError: 2020-12's
        # metaschema then says "5 is not of type 'string'"
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    with _CLASSES_LOCK:
        found = _CLASSES.get(base)
        if found is None:
            legacy = base is jsonschema.Draft201909Validator
            keywords = {name: func for name, func in _keywords(legacy).items()
                        if name in base.VALIDATORS}  # e.g. draft 7 has no unevaluatedProperties
            found = _CLASSES[base] = jsonschema.validators.extend(base, keywords)
        return found
