"""Time fastschema's quick check against the schema the native dialect picks for seed 001.

    .venv/bin/python benchmarks/fastschema_bench.py [request.json]

Prints the best of several timeit rounds (microseconds per document) for: is_valid on the seed-001
request (valid: the quick path answers), is_valid on a mutated, invalid copy (the quick path says
"not valid" and jsonschema would be asked next), and jsonschema's own errors_of for comparison.
The instance is the document minus its ``handoffd`` block, as validation.check_document passes it.
"""
from __future__ import annotations

import copy
import json
import sys
import timeit
from pathlib import Path

from handoffd.core.fastschema import compile_schema, is_valid
from handoffd.core.jsonschema_re2 import errors_of, for_named
from handoffd.core.validation import load_builtin
from handoffd.dialects.native import NativeDialect

HERE = Path(__file__).resolve().parent
ROUNDS = 7


def best_us(fn: object, number: int) -> float:
    """Best of ROUNDS timeit runs, in microseconds per call."""
    times = timeit.repeat(fn, number=number, repeat=ROUNDS)  # type: ignore[arg-type]
    return min(times) / number * 1e6


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "seed001-request.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    instance = {k: v for k, v in doc.items() if k != "handoffd"}
    [name] = NativeDialect().schema_names(doc)
    schema = load_builtin(name)
    draft7 = "draft-07" in str(schema.get("$schema", ""))
    compiled = timeit.timeit(lambda: compile_schema(schema, draft7=draft7), number=20) / 20
    check = compile_schema(schema, draft7=draft7)
    assert check is not None, f"{name} is not compiled"
    judge = for_named(schema)
    invalid = copy.deepcopy(instance)
    invalid["target"]["phase"] = "thirteen"  # deep in, after most of the document is checked
    assert is_valid(check, instance) and not errors_of(judge, instance)
    assert not is_valid(check, invalid) and errors_of(judge, invalid)
    print(f"schema {name} (compile: {compiled * 1e3:.2f} ms)")
    print(f"  is_valid, valid seed-001 request:   {best_us(lambda: is_valid(check, instance), 2000):8.1f} us")
    print(f"  is_valid, invalid (target.phase):   {best_us(lambda: is_valid(check, invalid), 2000):8.1f} us")
    print(f"  jsonschema errors_of, valid:        {best_us(lambda: errors_of(judge, instance), 200):8.1f} us")


if __name__ == "__main__":
    main()
