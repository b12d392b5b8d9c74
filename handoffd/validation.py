"""JSON Schema validation with validators built once and cached, and seed-001 style error entries.

Schemas are looked up by name in the workspace's ``schemas/`` first, then among the built-in ones
shipped in the package. Each error becomes ``{"field", "error", "schema_path"}`` where ``field`` is
the instance path written ``a.b[0].c`` (seed 001's ``component_requirements[0].props.userId``).
"""
from __future__ import annotations

import json
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from .errors import ConfigError, InvalidDocument

_FORMAT_CHECKER = jsonschema.FormatChecker()


def builtin_schema_names() -> list[str]:
    """Names of the schemas shipped inside the package."""
    folder = resources.files("handoffd") / "schemas"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".json"))


def load_builtin(name: str) -> dict[str, Any]:
    """A built-in schema by file name."""
    path = resources.files("handoffd") / "schemas" / name
    return json.loads(path.read_text(encoding="utf-8"))


def field_path(parts: Any) -> str:
    """Render a jsonschema path deque as ``a.b[0].c`` (empty string for the root)."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(error: ValidationError) -> dict[str, str]:
    """One seed-001 validation entry for a jsonschema error."""
    message = error.message
    if error.validator == "required" and isinstance(error.validator_value, list):
        missing = [p for p in error.validator_value if isinstance(error.instance, dict)
                   and p not in error.instance]
        if missing:
            message = f"Missing required field '{missing[0]}'"
    schema_path = "#/" + "/".join(str(p) for p in error.absolute_schema_path)
    return {"field": field_path(error.absolute_path) or "$", "error": message,
            "schema_path": schema_path}


class SchemaCache:
    """Compiled validators keyed by schema name; thread-safe, built on first use."""

    def __init__(self, workspace_schemas: Path | None = None) -> None:
        self.folder = workspace_schemas
        self._validators: dict[str, Validator] = {}
        self._lock = threading.Lock()

    def validator(self, name: str) -> Validator:
        """The validator for schema ``name`` (workspace schemas/ first, then built-ins)."""
        found = self._validators.get(name)
        if found is not None:
            return found
        with self._lock:
            if name not in self._validators:
                self._validators[name] = self._build(self._load(name))
            return self._validators[name]

    def for_schema(self, key: str, schema: dict[str, Any]) -> Validator:
        """A validator for an inline schema (e.g. seed 003's expected_output_schema), cached by key."""
        found = self._validators.get(key)
        if found is None:
            try:
                found = self._build(schema)
            except jsonschema.SchemaError as exc:
                raise InvalidDocument(f"the inline schema is not a valid JSON Schema: {exc.message}",
                                      code="SCHEMA_VALIDATION_FAILED") from None
            with self._lock:
                self._validators[key] = found
        return found

    def _load(self, name: str) -> dict[str, Any]:
        if "/" in name or "\\" in name or name.startswith("."):
            raise ConfigError(f"schema name {name!r} must be a plain file name inside schemas/")
        if self.folder is not None and (self.folder / name).is_file():
            try:
                return json.loads((self.folder / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"schemas/{name} is not valid JSON: {exc}") from None
        try:
            return load_builtin(name)
        except FileNotFoundError:
            raise ConfigError(f"schema {name} not found in {self.folder} nor among the built-in "
                              "schemas (`handoff schemas` lists them)") from None

    @staticmethod
    def _build(schema: dict[str, Any]) -> Validator:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema, format_checker=_FORMAT_CHECKER)

    def errors(self, name: str, instance: Any) -> list[dict[str, str]]:
        """Every error of ``instance`` against schema ``name``, in document order."""
        return errors_of(self.validator(name), instance)


def errors_of(validator: Validator, instance: Any) -> list[dict[str, str]]:
    """Every error of ``instance`` under ``validator`` as seed-001 entries, sorted by path."""
    found = sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    entries: list[dict[str, str]] = []
    for entry in map(describe, found):  # several branches can report the same missing field
        if not any(e["field"] == entry["field"] and e["error"] == entry["error"] for e in entries):
            entries.append(entry)
    return entries
