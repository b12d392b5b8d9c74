"""@coder: a specialist agent. Gets a handoff on stdin, writes a function, answers with it.

When the task does not say which language, it asks its requester (needs_clarification); the
answer comes back in $HANDOFF_CLARIFICATIONS and the handoff runs again.
"""
import json
import os
import sys

doc = json.load(sys.stdin)
task = doc["input"]["data"]
answers = json.loads(os.environ.get("HANDOFF_CLARIFICATIONS") or "[]")
language = task.get("language") or (answers[-1]["answer"] if answers else None)
if language is None:
    print(json.dumps({"status": "needs_clarification",
                      "questions": [f"Which language should {task['name']} be written in?"]}))
elif language == "python":
    code = f"def {task['name']}(x):\n    return x * 2\n"
    print(json.dumps({"status": "completed", "output": {"language": language, "code": code}}))
else:
    print(json.dumps({"status": "failed", "error": {"code": "PROCESSING_ERROR", "retryable": False,
                                                     "message": f"{language} is not spoken here"}}))
