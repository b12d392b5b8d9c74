"""@planner: an orchestrator agent using the Python client. It hands two functions to @coder
under deterministic ids (safe to run again), answers the coder's question, and prints what came
back. Run it beside `handoffd serve` in this folder (see README.md)."""
import sys

from handoffd import Client

client = Client(".", agent="@planner")
tasks = {"double-py": {"name": "double", "language": "python"},
         "triple-any": {"name": "triple"}}
handles = {hid: client.create(to="@coder", data=task, handoff_id=hid, if_absent=True)
           for hid, task in tasks.items()}
failures = 0
for hid, handle in handles.items():
    result = handle.wait(timeout=60)
    if result.asks:  # the coder asked which language: answer, then wait again
        print(f"{hid}: asked {result.asks['questions'][0]!r}; answering python")
        client.answer(hid, "python")
        result = handle.wait(timeout=60)
    if result.ok:
        print(f"{hid}: {result.output['language']}: {result.output['code'].splitlines()[0]}")
    else:
        failures += 1
        print(f"{hid}: failed: {result.error.code}: {result.error.message}")
sys.exit(1 if failures else 0)
