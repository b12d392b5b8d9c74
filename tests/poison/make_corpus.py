"""Writes the poison corpus (tests/poison/NAME.doc + NAME.expect.json). Re-run after editing:
``python tests/poison/make_corpus.py``. New entries found by fuzzing may also be added by hand."""
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent

def native(hid, **extra):
    d = {"handoff_id": hid, "target": {"agent_id": "@flaky"}, "input": {"data": {"mode": "ok"}}}
    d.update(extra); return d

def haios(hid, **extra):
    d = {"handoff_id": hid, "from_agent": "@tester", "to_agent": "@flaky",
         "payload": {"directive": {"action": "echo"}, "context": None, "original_input": "hi"},
         "expected_output_schema": None, "timeout_ms": 20000, "status": "pending"}
    d.update(extra); return d

E = {}
def add(name, content, expect, code=None, *, hid=None, drop_as=None, why, **more):
    if not isinstance(content, (bytes, str)):
        content = json.dumps(content, indent=1)
    if isinstance(content, str):
        content = content.encode("utf-8")
    (OUT / f"{name}.doc").write_bytes(content)
    meta = {"why": why, "drop_as": drop_as or f"{name}.json", "expect": expect}
    if hid is not None: meta["id"] = hid
    if code: meta["code"] = code
    meta.update(more)
    (OUT / f"{name}.expect.json").write_text(json.dumps(meta, indent=2) + "\n")

add("forged-revision-duplicate", native("poison-victim", input={"data": {"mode": "fail"}},
    handoffd={"revision": 99, "attempt": 1, "history": []}), "quarantine", "DUPLICATE_HANDOFF_ID",
    hid="poison-victim", drop_as="poison-victim.json", setup="completed-victim",
    why="a forged handoffd.revision 99 under the id of a finished handoff once replaced the completed result")
add("retry-delay-1e12", native("retry-delay-1e12", retry_policy={"retry_delay_seconds": 1e12}),
    "failed", "SCHEMA_VALIDATION_FAILED", hid="retry-delay-1e12",
    why="retry_policy.retry_delay_seconds 1e12 overflowed datetime arithmetic when scheduling a retry")
add("attempt-abc", native("attempt-abc", handoffd={"attempt": "abc"}), "completed", hid="attempt-abc",
    why="handoffd.attempt 'abc' crashed int() in the claim; foreign bookkeeping is now discarded")
add("history-x", native("history-x", handoffd={"history": "x"}), "completed", hid="history-x",
    why="handoffd.history 'x' (a string, not a list) crashed the history append")
add("bookkeeping-garbage", native("bookkeeping-garbage", handoffd={
    "revision": "7", "retries": 1e30, "lease": {"token": 5}, "next_attempt_at": "never",
    "last_error": [1], "dialect": {"x": 1}}), "completed", hid="bookkeeping-garbage",
    why="every handoffd bookkeeping field with a wrong type at once")
add("timeout-1e300", native("timeout-1e300", timeout_seconds=1e300), "failed",
    "SCHEMA_VALIDATION_FAILED", hid="timeout-1e300",
    why="timeout_seconds 1e300 overflowed the deadline computation")
for tok, nm in (("Infinity", "infinity"), ("-Infinity", "neg-infinity"), ("NaN", "nan"), ("1e999", "1e999")):
    hid = f"timeout-{nm}"
    add(hid, '{"handoff_id": "%s", "target": {"agent_id": "@flaky"}, "timeout_seconds": %s}' % (hid, tok),
        "quarantine", "MALFORMED_JSON", hid=hid, stub=True,
        why=f"timeout_seconds {tok}: Python's json accepts it, but it is not JSON and was written back as a bare token")
schema = {"type": "string"}
for _ in range(100):
    schema = {"type": "object", "properties": {"p": schema}}
add("haios-deep-schema", haios("0b0e0c0d-0000-4000-8000-000000000001", expected_output_schema=schema),
    "quarantine", "DOCUMENT_TOO_DEEP", hid="0b0e0c0d-0000-4000-8000-000000000001", stub=True,
    drop_as="0b0e0c0d-0000-4000-8000-000000000001.json",
    why="an expected_output_schema nesting properties 100 deep hit RecursionError in jsonschema")
redos = haios("0b0e0c0d-0000-4000-8000-000000000002",
              # @flaky echoes input.data (an extra field HAIOS allows): its output is {"echo": {"s": "aaa...a!"}}
              input={"data": {"mode": "ok", "s": "a" * 64 + "!"}},
              expected_output_schema={"type": "object", "properties": {"echo": {"type": "object", "properties": {
                  "s": {"type": "string", "pattern": "^(a+)+$"}}}}})
add("haios-redos", redos, "failed", "VALIDATION_FAILED", hid="0b0e0c0d-0000-4000-8000-000000000002",
    drop_as="0b0e0c0d-0000-4000-8000-000000000002.json", max_seconds=10,
    why="pattern ^(a+)+$ against 'aaa...a!' backtracked for ages holding the GIL (ReDoS); RE2 now")
add("malformed", b'{"handoff_id": "malformed", "target": ', "quarantine", "MALFORMED_JSON", hid="malformed", stub=True,
    why="truncated JSON")
add("empty", b"", "quarantine", "EMPTY_DOCUMENT", hid="empty", stub=True, why="zero bytes")
add("whitespace", b" \n\t \n", "quarantine", "EMPTY_DOCUMENT", hid="whitespace", stub=True, why="whitespace only")
add("latin1", b'{"handoff_id": "latin1", "note": "caf\xe9"}', "quarantine", "NOT_UTF8", hid="latin1", stub=True,
    why="Latin-1 byte in a string")
add("bom", b'\xef\xbb\xbf' + json.dumps(native("bom")).encode(), "quarantine", "MALFORMED_JSON", hid="bom",
    stub=True, why="UTF-8 byte-order mark before the object")
add("array", b"[1, 2, 3]", "quarantine", "NOT_AN_OBJECT", hid="array", stub=True, why="a JSON array, not an object")
add("scalar-null", b"null", "quarantine", "NOT_AN_OBJECT", hid="scalar-null", stub=True, why="JSON null")
add("deep-nesting-100k", b'{"handoff_id": "deep-nesting-100k", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    "quarantine", "DOCUMENT_TOO_DEEP", hid="deep-nesting-100k", stub=True,
    why="100000 nested arrays: refused on its text before any parser recurses (was a "
        "RecursionError inside the JSON decoder, MALFORMED_JSON, until session 31)")
deep = "[" * 70 + "]" * 70
add("deep-nesting-70", '{"handoff_id": "deep-nesting-70", "target": {"agent_id": "@flaky"}, "input": {"data": %s}}' % deep,
    "quarantine", "DOCUMENT_TOO_DEEP", hid="deep-nesting-70", stub=True,
    why="70 levels: parses, but deep enough to endanger recursive readers (jsonschema, deepcopy)")
add("traversal-id", native("../x"), "quarantine", "ID_MISMATCH", hid="traversal-id", stub=True,
    why="handoff_id ../x (path traversal)")
add("absolute-id", native("/etc/passwd"), "quarantine", "ID_MISMATCH", hid="absolute-id", stub=True,
    why="handoff_id /etc/passwd")
add("nul-id", native("a\u0000b"), "quarantine", "ID_MISMATCH", hid="nul-id", stub=True, why="NUL in the id")
add("long-id", native("a" * 300), "quarantine", "UNSAFE_ID", hid=None, drop_as="a" * 200 + ".json",
    why="an id (and file name) over 128 characters")
add("numeric-id", native(5), "quarantine", "ID_MISMATCH", hid="numeric-id", stub=True, why="handoff_id is a number")
add("huge-int", b'{"handoff_id": "huge-int", "target": {"agent_id": "@flaky"}, "priority": ' + b"9" * 5000 + b"}",
    "quarantine", "MALFORMED_JSON", hid="huge-int", stub=True,
    why="a 5000-digit integer: Python refuses int() of more than 4300 digits with a bare ValueError")
add("lone-surrogate", b'{"handoff_id": "lone-surrogate", "target": {"agent_id": "@flaky"}, "input": {"data": {"mode": "ok", "s": "\\ud800"}}}',
    "quarantine", "NOT_UTF8", hid="lone-surrogate", stub=True,
    why="a \\ud800 escape decodes to a lone surrogate, which cannot be written back as UTF-8")
add("target-list", native("target-list", target={"agent_id": ["@flaky"]}), "failed", "SCHEMA_VALIDATION_FAILED",
    hid="target-list", why="target.agent_id is a list")
add("unknown-format", {"handoff_id": "unknown-format", "hello": "world"}, "quarantine", "UNKNOWN_FORMAT",
    hid="unknown-format", stub=True, why="an object in none of the five formats")
add("huge-priority", native("huge-priority", priority=10**30), "failed", "SCHEMA_VALIDATION_FAILED",
    hid="huge-priority", why="priority 10**30")
add("depends-on-self", native("depends-on-self", depends_on=["depends-on-self"]), "failed", "DEPENDENCY_MISSING",
    hid="depends-on-self", why="a handoff that depends on itself")
add("seal-non-ascii", native("seal-non-ascii", handoffd={"revision": 3, "seal": "\u00e9" * 32}), "completed",
    hid="seal-non-ascii",
    why="a non-ASCII handoffd.seal made hmac.compare_digest raise TypeError: a traceback in the "
        "claim, the handoff stuck in in-progress/, and `handoff show` an internal error")
add("forged-next-attempt", native("forged-next-attempt", handoffd={
    "next_attempt_at": "9999-12-31T23:59:59Z", "attempt": 50, "retries": 1e300}), "completed",
    hid="forged-next-attempt",
    why="an unsealed handoffd.next_attempt_at held a dropped document in pending/ until 9999: the "
        "scheduler read foreign bookkeeping the claim would have discarded")
add("forged-awaiting", native("forged-awaiting", handoffd={"awaiting": {"questions": ["forged"]}}),
    "completed", hid="forged-awaiting",
    why="an unsealed handoffd.awaiting parked a dropped document as waiting for an answer")
add("forged-children-int", native("forged-children-int", handoffd={
    "waiting_children": {"children": 5, "aggregation": "all"}, "awaiting": {"questions": 5}}),
    "completed", hid="forged-children-int",
    why="handoffd.waiting_children.children 5 and awaiting.questions 5 (ints): a TypeError in the "
        "gates every 5 s, the document never filed")
