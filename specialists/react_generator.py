#!/usr/bin/env python3
"""@react-specialist: generate React components from seed 001's ``component_requirements``.

A handoffd command specialist (docs/specialists.md): the handoff document arrives as JSON on
stdin, the result object leaves as one JSON line on stdout. For each requirement it writes the source
of a React component (TypeScript when ``code_quality.typescript_enabled``): a typed props interface,
one ``useState`` per ``state_needs`` entry and an axios call per ``api_integration`` entry. All
components go into ONE artifact file, ``artifacts/phase-13-react/artifact-react-comp-{epoch ms}.json``
under ``$HANDOFFD_ROOT`` (or the handoff's ``expected_output.destination``, which must stay inside the
workspace), written atomically.

Every name that ends up in generated code is checked against a strict pattern first, so input text
can never inject code; free text (``responsibility``) only ever appears inside a line comment.
Standard library only.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

DEFAULT_DESTINATION = "artifacts/phase-13-react/artifact-react-comp-{timestamp}.json"
ARTIFACT_TYPE = "react-components"
COMPONENT_NAME = re.compile(r"^[A-Z][A-Za-z0-9]{0,63}$")
IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]{0,63}$")
CUSTOM_TYPE = re.compile(r"^[A-Z][A-Za-z0-9_.]{0,63}(\[\])?$")
ENDPOINT = re.compile(r"^/[A-Za-z0-9/_.\-{}:]{0,200}$")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
RESERVED = {"break", "case", "catch", "class", "const", "continue", "debugger", "default", "delete",
            "do", "else", "enum", "export", "extends", "false", "finally", "for", "function", "if",
            "import", "in", "instanceof", "new", "null", "return", "super", "switch", "this",
            "throw", "true", "try", "typeof", "var", "void", "while", "with", "yield", "let",
            "static", "implements", "interface", "package", "private", "protected", "public",
            "await", "props", "React"}
PROP_TYPES = {
    "string": "string", "number": "number", "integer": "number", "boolean": "boolean",
    "bool": "boolean", "callback": "(value?: unknown) => void", "function": "(value?: unknown) => void",
    "object": "Record<string, unknown>", "array": "unknown[]", "node": "React.ReactNode",
    "element": "React.ReactElement", "date": "Date", "any": "unknown", "unknown": "unknown",
}


class InputProblems(Exception):
    """One or more problems with ``input.data``, each ``{"field", "error", "schema_path"}``."""

    def __init__(self, problems: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{p['field']}: {p['error']}" for p in problems))
        self.problems = problems


class DestinationRefused(Exception):
    """``expected_output.destination`` would put the artifact outside the workspace."""


# --- input ---------------------------------------------------------------------------------

def parse_input(doc: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return (components, options) from the handoff; raise InputProblems listing every problem."""
    problems: list[dict[str, str]] = []

    def problem(field: str, error: str, schema_path: str) -> None:
        problems.append({"field": field, "error": error, "schema_path": schema_path})

    data = doc.get("input", {}).get("data") if isinstance(doc, dict) and isinstance(doc.get("input"), dict) else None
    if not isinstance(data, dict):
        raise InputProblems([{"field": "input.data", "error": "must be an object holding "
                              "component_requirements", "schema_path": "$"}])
    reqs = data.get("component_requirements")
    if not isinstance(reqs, list) or not reqs:
        raise InputProblems([{"field": "component_requirements",
                              "error": "Missing required field: a non-empty array of components",
                              "schema_path": "$.component_requirements"}])
    components: list[dict[str, Any]] = []
    seen_names: set[str] = set()
    for i, req in enumerate(reqs):
        where = f"component_requirements[{i}]"
        base = "$.component_requirements[*]"
        if not isinstance(req, dict):
            problem(where, "must be an object", base)
            continue
        name = req.get("name")
        if not isinstance(name, str) or not COMPONENT_NAME.match(name):
            problem(f"{where}.name", "Missing or invalid field 'name': use a PascalCase identifier "
                    "such as UserProfile", f"{base}.name")
        elif name in seen_names:
            problem(f"{where}.name", f"duplicate component name {name!r}", f"{base}.name")
        else:
            seen_names.add(name)
        kind = req.get("type")
        if kind not in ("functional", "class"):
            problem(f"{where}.type", "Missing or invalid field 'type': must be 'functional' or 'class'",
                    f"{base}.type")
        responsibility = req.get("responsibility", "")
        if not isinstance(responsibility, str):
            problem(f"{where}.responsibility", "must be a string", f"{base}.responsibility")
            responsibility = ""
        props = _parse_props(req.get("props", {}), where, base, problem)
        state = _parse_state(req.get("state_needs", []), where, base, problem)
        apis = _parse_apis(req.get("api_integration", []), where, base, problem)
        components.append({"name": name, "type": kind, "responsibility": responsibility,
                           "props": props, "state": state, "apis": apis})
    quality = data.get("code_quality", {})
    if not isinstance(quality, dict):
        problem("code_quality", "must be an object", "$.code_quality")
        quality = {}
    typescript = quality.get("typescript_enabled", True)
    if not isinstance(typescript, bool):
        problem("code_quality.typescript_enabled", "must be true or false",
                "$.code_quality.typescript_enabled")
    context = data.get("dependency_context", {})
    if not isinstance(context, dict):
        problem("dependency_context", "must be an object", "$.dependency_context")
        context = {}
    if problems:
        raise InputProblems(problems)
    return components, {"typescript": typescript, "context": context}


def _parse_props(props: Any, where: str, base: str, problem: Any) -> list[dict[str, Any]]:
    if not isinstance(props, dict):
        problem(f"{where}.props", "must be an object mapping prop names to {type, required}",
                f"{base}.props")
        return []
    parsed = []
    for prop_name, spec in props.items():
        field = f"{where}.props.{prop_name}"
        if not IDENTIFIER.match(prop_name) or prop_name in RESERVED:
            problem(field, "prop names must be JavaScript identifiers", f"{base}.props")
            continue
        if not isinstance(spec, dict):
            problem(field, "must be an object with 'type' and 'required'", f"{base}.props.*")
            continue
        if "type" not in spec:
            problem(field, "Missing required field 'type'", f"{base}.props.*")
            continue
        prop_type = spec["type"]
        ts_type = PROP_TYPES.get(prop_type.lower()) if isinstance(prop_type, str) else None
        if ts_type is None and isinstance(prop_type, str) and CUSTOM_TYPE.match(prop_type):
            ts_type = prop_type
        if ts_type is None:
            problem(f"{field}.type", f"unsupported prop type {prop_type!r}: use one of "
                    f"{', '.join(sorted(PROP_TYPES))} or a PascalCase type name", f"{base}.props.*.type")
            continue
        required = spec.get("required", False)
        if not isinstance(required, bool):
            problem(f"{field}.required", "must be true or false", f"{base}.props.*.required")
            continue
        parsed.append({"name": prop_name, "type": ts_type, "required": required,
                       "callback": ts_type.startswith("(")})
    return parsed


def _parse_state(state: Any, where: str, base: str, problem: Any) -> list[str]:
    if not isinstance(state, list):
        problem(f"{where}.state_needs", "must be an array of state variable names", f"{base}.state_needs")
        return []
    names = []
    for j, name in enumerate(state):
        if not isinstance(name, str) or not IDENTIFIER.match(name) or name in RESERVED or "$" in name:
            problem(f"{where}.state_needs[{j}]", "must be a JavaScript identifier such as isEditing",
                    f"{base}.state_needs[*]")
        elif name not in names:
            names.append(name)
    return names


def _parse_apis(apis: Any, where: str, base: str, problem: Any) -> list[dict[str, str]]:
    if not isinstance(apis, list):
        problem(f"{where}.api_integration", "must be an array of {endpoint, method}",
                f"{base}.api_integration")
        return []
    parsed = []
    for j, api in enumerate(apis):
        field = f"{where}.api_integration[{j}]"
        if not isinstance(api, dict):
            problem(field, "must be an object with 'endpoint' and 'method'", f"{base}.api_integration[*]")
            continue
        endpoint, method = api.get("endpoint"), api.get("method", "GET")
        if not isinstance(endpoint, str) or not ENDPOINT.match(endpoint):
            problem(f"{field}.endpoint", "must be a path such as /api/users/{id} (letters, digits, "
                    "/ _ . - : and {placeholders})", f"{base}.api_integration[*].endpoint")
            continue
        if not isinstance(method, str) or method.upper() not in METHODS:
            problem(f"{field}.method", f"must be one of {', '.join(METHODS)}",
                    f"{base}.api_integration[*].method")
            continue
        parsed.append({"endpoint": endpoint, "method": method.upper()})
    return parsed


# --- code generation -----------------------------------------------------------------------

def _cap(name: str) -> str:
    return name[:1].upper() + name[1:]


def _comment(text: str) -> str:
    """Free text made safe for a ``//`` comment: one line, no control characters."""
    cleaned = re.sub(r"[\x00-\x1f\x7f\u2028\u2029]+", " ", text).strip()
    return cleaned[:200]


def _state_type(name: str) -> tuple[str, str]:
    """A (TypeScript type, initial value) guess for a state variable from its name."""
    lowered = name.lower()
    if re.match(r"^(is|has|should|can|show)[A-Z_]", name):
        return "boolean", "false"
    if lowered.endswith(("error", "message")):
        return "string | null", "null"
    if lowered.endswith(("count", "total", "index", "page")):
        return "number", "0"
    if lowered.endswith(("list", "items")) or (lowered.endswith("s")
                                                and not lowered.endswith(("ss", "us", "is"))):
        return "unknown[]", "[]"
    return "Record<string, unknown> | null", "null"


def _url(endpoint: str, props: list[dict[str, Any]]) -> tuple[str, list[str], list[str]]:
    """A template literal for ``endpoint`` with each ``{param}`` bound to a prop when one fits
    (``{id}`` also binds to the first ``somethingId`` prop); returns (literal, bound props,
    unbound params, which become parameters of the generated function)."""
    names = {p["name"] for p in props if not p["callback"]}
    id_props = [p["name"] for p in props if p["name"].endswith("Id") and not p["callback"]]
    bound: list[str] = []
    unbound: list[str] = []

    def bind(match: re.Match[str]) -> str:
        param = match.group(1)
        if param in names:
            variable = param
            bound.append(param)
        elif param == "id" and id_props:
            variable = id_props[0]
            bound.append(variable)
        else:
            variable = param if param not in RESERVED else f"{param}Param"
            if variable not in unbound:
                unbound.append(variable)
        return "${encodeURIComponent(String(" + variable + "))}"

    return "`" + PLACEHOLDER.sub(bind, endpoint) + "`", bound, unbound


def _api_plan(comp: dict[str, Any]) -> list[dict[str, Any]]:
    """One function per API call: name, method, URL expression, extra parameters."""
    verbs = {"GET": "load", "POST": "create", "PUT": "save", "PATCH": "update", "DELETE": "remove"}
    plan: list[dict[str, Any]] = []
    used: set[str] = set()
    for api in comp["apis"]:
        url, bound, unbound = _url(api["endpoint"], comp["props"])
        fn = verbs[api["method"]] + comp["name"]
        n = 2
        while fn in used:
            fn, n = f"{verbs[api['method']]}{comp['name']}{n}", n + 1
        used.add(fn)
        plan.append({"fn": fn, "method": api["method"], "url": url, "params": unbound,
                     "bound": sorted(set(bound)), "endpoint": api["endpoint"]})
    return plan


def generate_component(comp: dict[str, Any], typescript: bool) -> str:
    """Source text of one component (TSX or JSX)."""
    if comp["type"] == "class":
        return _class_component(comp, typescript)
    return _function_component(comp, typescript)


def _header(comp: dict[str, Any], hooks: list[str], uses_axios: bool) -> list[str]:
    lines = [f"// {comp['name']} — generated by handoffd @react-specialist"]
    if comp["responsibility"]:
        lines.append(f"// Responsibility: {_comment(comp['responsibility'])}")
    lines.append(f"import React{', { ' + ', '.join(hooks) + ' }' if hooks else ''} from 'react';")
    if uses_axios:
        lines.append("import axios from 'axios';")
    lines.append("")
    return lines


def _props_interface(comp: dict[str, Any]) -> list[str]:
    lines = [f"export interface {comp['name']}Props {{"]
    for prop in comp["props"]:
        lines.append(f"  {prop['name']}{'' if prop['required'] else '?'}: {prop['type']};")
    lines += ["}", ""]
    return lines


def _function_component(comp: dict[str, Any], ts: bool) -> str:
    name, plan, state = comp["name"], _api_plan(comp), comp["state"]
    data_var = next((s for s in state if _state_type(s)[0].startswith("Record")), None)
    saving_var = next((s for s in state if s.lower() in ("issaving", "issubmitting", "isloading")), None)
    hooks = (["useState"] if state else []) + (["useCallback", "useEffect"] if plan else [])
    lines = _header(comp, hooks, bool(plan))
    if ts:
        lines += _props_interface(comp)
    prop_names = [p["name"] for p in comp["props"]]
    destructure = "{ " + ", ".join(prop_names) + " }" if prop_names else "_props"
    signature = f"{destructure}: {name}Props" if ts else destructure
    lines.append(f"export function {name}({signature}){': React.ReactElement' if ts else ''} {{")
    for var in state:
        ts_type, initial = _state_type(var)
        generic = f"<{ts_type}>" if ts else ""
        lines.append(f"  const [{var}, set{_cap(var)}] = useState{generic}({initial});")
    if state:
        lines.append("")
    callbacks = [p["name"] for p in comp["props"] if p["callback"]]
    for call in plan:
        params = [f"{p}: string" if ts else p for p in call["params"]]
        if call["method"] in ("POST", "PUT", "PATCH"):
            params.append("payload: Record<string, unknown>" if ts else "payload")
        notified = callbacks if call["method"] != "GET" else []
        deps = sorted(set(call["bound"]) | set(notified))
        lines.append(f"  const {call['fn']} = useCallback(async ({', '.join(params)}) => {{")
        lines.append(f"    // {call['method']} {call['endpoint']}")
        if saving_var and call["method"] != "GET":
            lines.append(f"    set{_cap(saving_var)}(true);")
        lines.append("    try {")
        body = ", payload" if call["method"] in ("POST", "PUT", "PATCH") else ""
        lines.append(f"      const response = await axios.{call['method'].lower()}({call['url']}{body});")
        if data_var and call["method"] in ("GET", "PUT", "PATCH", "POST"):
            lines.append(f"      set{_cap(data_var)}(response.data);")
        for cb in notified:
            lines.append(f"      {cb}?.(response.data);")
        lines.append("      return response.data;")
        if saving_var and call["method"] != "GET":
            lines.append("    } finally {")
            lines.append(f"      set{_cap(saving_var)}(false);")
        else:
            lines.append("    } catch (error) {")
            lines.append(f"      console.error('{call['fn']} failed', error);")
            lines.append("      throw error;")
        lines.append("    }")
        lines.append(f"  }}, [{', '.join(deps)}]);")
        lines.append("")
    loader = next((c for c in plan if c["method"] == "GET" and not c["params"]), None)
    if loader:
        lines.append("  useEffect(() => {")
        lines.append(f"    void {loader['fn']}().catch(() => undefined);")
        lines.append(f"  }}, [{loader['fn']}]);")
        lines.append("")
    lines.append("  return (")
    lines.append(f"    <section className=\"rounded-lg border p-4 shadow-sm\" aria-label=\"{name}\">")
    lines.append(f"      <h2 className=\"text-lg font-semibold\">{name}</h2>")
    if data_var:
        lines.append(f"      {{{data_var} ? (")
        lines.append(f"        <pre className=\"text-sm\">{{JSON.stringify({data_var}, null, 2)}}</pre>")
        lines.append("      ) : (")
        lines.append("        <p className=\"text-gray-500\">Loading…</p>")
        lines.append("      )}")
    for var in state:
        if _state_type(var)[0] == "boolean" and var != saving_var:
            lines.append(f"      <button type=\"button\" className=\"mt-2 rounded px-3 py-1\" "
                         f"onClick={{() => set{_cap(var)}((value) => !value)}}>")
            lines.append(f"        Toggle {var}")
            lines.append("      </button>")
    if saving_var:
        lines.append(f"      {{{saving_var} && <p role=\"status\">Saving…</p>}}")
    lines.append("    </section>")
    lines.append("  );")
    lines.append("}")
    lines.append("")
    lines.append(f"export default {name};")
    return "\n".join(lines) + "\n"


def _class_component(comp: dict[str, Any], ts: bool) -> str:
    name, state, plan = comp["name"], comp["state"], _api_plan(comp)
    lines = _header(comp, [], bool(plan))
    if ts:
        lines += _props_interface(comp)
        lines.append(f"interface {name}State {{")
        for var in state:
            lines.append(f"  {var}: {_state_type(var)[0]};")
        lines += ["}", ""]
    generics = f"<{name}Props, {name}State>" if ts else ""
    lines.append(f"export class {name} extends React.Component{generics} {{")
    initial = ", ".join(f"{var}: {_state_type(var)[1]}" for var in state)
    lines.append(f"  state{f': {name}State' if ts else ''} = {{ {initial} }};" if state else "  state = {};")
    lines.append("")
    for call in plan:
        params = [f"{p}: string" if ts else p for p in call["params"]]
        if call["method"] in ("POST", "PUT", "PATCH"):
            params.append("payload: Record<string, unknown>" if ts else "payload")
        url = call["url"]
        for prop in call["bound"]:
            url = url.replace("String(" + prop + ")", "String(this.props." + prop + ")")
        body = ", payload" if call["method"] in ("POST", "PUT", "PATCH") else ""
        lines.append(f"  {call['fn']} = async ({', '.join(params)}) => {{")
        lines.append(f"    // {call['method']} {call['endpoint']}")
        lines.append(f"    const response = await axios.{call['method'].lower()}({url}{body});")
        lines.append("    return response.data;")
        lines.append("  };")
        lines.append("")
    lines.append(f"  render(){': React.ReactNode' if ts else ''} {{")
    lines.append("    return (")
    lines.append(f"      <section className=\"rounded-lg border p-4 shadow-sm\" aria-label=\"{name}\">")
    lines.append(f"        <h2 className=\"text-lg font-semibold\">{name}</h2>")
    lines.append("      </section>")
    lines.append("    );")
    lines.append("  }")
    lines.append("}")
    lines.append("")
    lines.append(f"export default {name};")
    return "\n".join(lines) + "\n"


def balanced(source: str) -> bool:
    """A cheap structural check of generated code: brackets balance (outside comments and string
    literals)."""
    pairs, stack, quote = {")": "(", "]": "[", "}": "{"}, [], None
    code = "\n".join(line.split("//", 1)[0] if line.lstrip().startswith("//") else line
                     for line in source.splitlines())
    for ch in code:
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack


# --- the artifact ----------------------------------------------------------------------------

def resolve_destination(root: Path, template: str, stamp_ms: int) -> Path:
    """The artifact path for ``template`` under ``root``; DestinationRefused if it leaves root."""
    if "\x00" in template or not template.strip():
        raise DestinationRefused("expected_output.destination must be a non-empty path")
    relative = template.replace("{timestamp}", str(stamp_ms))
    candidate = Path(relative)
    target = (candidate if candidate.is_absolute() else root / candidate).resolve(strict=False)
    if not target.is_relative_to(root) or target == root:
        raise DestinationRefused(f"expected_output.destination {template!r} resolves to {target}, "
                                 f"outside the workspace {root}")
    if target.is_dir():
        raise DestinationRefused(f"expected_output.destination {template!r} is a directory")
    return target


def write_atomically(path: Path, payload: bytes, root: Path) -> None:
    """Temp file in the same directory, fsync, rename over ``path``, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.parent.resolve().is_relative_to(root):
        raise DestinationRefused(f"{path.parent} resolves outside the workspace {root}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _failed(code: str, message: str, **extra: Any) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "retryable": False}
    error.update(extra)
    return {"status": "failed", "error": error}


def handle(doc: Any, root: Path, now_ms: int | None = None) -> dict[str, Any]:
    """The whole specialist: a handoff document in, a result object out."""
    try:
        components, options = parse_input(doc)
    except InputProblems as exc:
        first = exc.problems[0]
        more = f" (and {len(exc.problems) - 1} more)" if len(exc.problems) > 1 else ""
        return _failed("SCHEMA_VALIDATION_FAILED",
                       f"Input validation failed: {first['field']}: {first['error']}{more}",
                       errors=exc.problems)
    stamp = now_ms if now_ms is not None else time.time_ns() // 1_000_000
    expected = doc.get("expected_output") if isinstance(doc.get("expected_output"), dict) else {}
    template = expected.get("destination", DEFAULT_DESTINATION)
    if not isinstance(template, str):
        return _failed("VALIDATION_FAILED", "expected_output.destination must be a string path")
    root = root.resolve()
    try:
        path = resolve_destination(root, template, stamp)
    except DestinationRefused as exc:
        return _failed("VALIDATION_FAILED", f"refusing to write the artifact: {exc}")

    ts = options["typescript"]
    generated = []
    for comp in components:
        source = generate_component(comp, ts)
        if not balanced(source):  # a generator bug, not the caller's fault
            return _failed("PROCESSING_ERROR", f"generated source for {comp['name']} is malformed")
        generated.append({"name": comp["name"], "type": comp["type"],
                          "file": f"src/components/{comp['name']}.{'tsx' if ts else 'jsx'}",
                          "language": "typescript" if ts else "javascript",
                          "lines": source.count("\n"), "source": source})
    artifact_id = path.stem if path.suffix == ".json" else path.name
    dependencies = {"react": "^18.2.0"}
    if any(c["apis"] for c in components):
        dependencies["axios"] = "^1.6.0"
    generated_at = datetime.fromtimestamp(stamp / 1000, timezone.utc)
    artifact = {
        "artifact_id": artifact_id,
        "artifact_type": ARTIFACT_TYPE,
        "handoff_id": doc.get("handoff_id"),
        "generated_at": generated_at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp % 1000:03d}Z",
        "typescript": ts,
        "dependencies": dependencies,
        "components": generated,
    }
    try:
        write_atomically(path, (json.dumps(artifact, indent=2) + "\n").encode("utf-8"), root)
    except DestinationRefused as exc:
        return _failed("VALIDATION_FAILED", f"refusing to write the artifact: {exc}")
    except OSError as exc:
        result = _failed("PROCESSING_ERROR", f"cannot write the artifact {path}: {exc.strerror}")
        result["error"]["retryable"] = True
        return result

    total_lines = sum(c["lines"] for c in generated)
    context = options["context"]
    next_steps = [f"Integrate {c['name']} component into application" for c in generated]
    if "redux" in str(context.get("state_management", "")).lower():
        next_steps.append("Configure Redux store with slices for the new components' data")
    if context.get("routing_library"):
        next_steps.append(f"Set up {context['routing_library']} routes")
    if context.get("testing_framework"):
        next_steps.append(f"Write {context['testing_framework']} tests for the generated components")
    return {
        "status": "completed",
        "output": {"artifact_id": artifact_id,
                   "artifact_path": path.relative_to(root).as_posix(),
                   "artifact_type": ARTIFACT_TYPE,
                   "schema_compliance": "valid"},
        "validation": {"status": "passed", "components_checked": len(generated),
                       "checks": ["identifiers", "balanced_brackets", "default_export"]},
        "metadata": {"components_generated": len(generated), "total_lines_generated": total_lines,
                     "api_calls_generated": sum(len(c["apis"]) for c in components),
                     "typescript": ts},
        "next_steps": next_steps,
        "warnings": [],
    }


def main() -> int:
    """Read the handoff from stdin, print the result; exit 0 whenever a result was printed."""
    root = Path(os.environ.get("HANDOFFD_ROOT") or os.getcwd())
    try:
        doc = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        result = _failed("SCHEMA_VALIDATION_FAILED", f"the handoff on stdin is not JSON: {exc}")
    else:
        result = handle(doc, root) if isinstance(doc, dict) else _failed(
            "SCHEMA_VALIDATION_FAILED", "the handoff on stdin must be a JSON object")
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
