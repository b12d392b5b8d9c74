#!/usr/bin/env bash
# make demo: run the daemon on this repository's own workspace, submit real handoffs, watch them
# move through pending -> in-progress -> completed/failed, then stop the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
export HANDOFFD_ROOT="$ROOT"
stamp=$(date +%s%N)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

# Submit a whole example document under a fresh id (the examples carry fixed ids).
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
submit_example() {  # FILE NEW_ID
  python3 - "$1" "$2" > "$TMP/$2.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["handoff_id"] = sys.argv[2]
print(json.dumps(doc))
PY
  handoff create --file "$TMP/$2.json"
}

say "submitting handoffs"
react=$(submit_example examples/requests/react-userprofile.json "demo-react-$stamp")
code=$(submit_example examples/requests/code-binary-search.json "demo-code-$stamp")
bad=$(submit_example examples/requests/react-invalid.json "demo-bad-$stamp")
echo "  @react-specialist  $react"
echo "  @code-runner       $code"
echo "  @react-specialist  $bad   (input violates the specialist's input schema)"
wrong=$(handoff create --to @code-runner --data '{"language": "python", "entrypoint": "double", "source": "def double(x):\n    return x + x + 1\n", "test_cases": [{"args": [2], "expected": 4}, {"args": [0], "expected": 0}]}')
echo "  @code-runner       $wrong   (a wrong implementation: its tests fail)"
later=$(handoff create --to @code-runner --depends-on "$code" --data '{"language": "python", "entrypoint": "inc", "source": "def inc(x):\n    return x + 1\n", "test_cases": [{"args": [1], "expected": 2}]}')
echo "  @code-runner       $later   (runs only after $code completed)"

say "handoff ls (submitted; no daemon is running yet, so all are pending)"
handoff ls --limit 5

say "starting: handoffd serve --root $ROOT"
handoffd serve --verbose 2> >(sed -u "s/^/  [daemon] /" >&2) &
DAEMON=$!
trap 'kill -TERM ${DAEMON:-0} 2>/dev/null || true; rm -rf "$TMP"' EXIT
sleep 1


for id in "$react" "$code" "$bad" "$wrong" "$later"; do
  handoff wait "$id" --timeout 60 || true
done

say "handoff ls (after the daemon did its work)"
handoff ls --limit 5

say "handoff show $react  (timeline + filed response)"
handoff show "$react" | head -40
artifact=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["document"]["output"]["artifact_path"])' < <(handoff show "$react" --json))
say "the artifact the React specialist wrote: $artifact"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["components"][0]["source"][:600])' "$artifact"

say "why $bad failed (seed 001 failure document)"
handoff show "$bad" --json | python3 -c 'import json,sys; d=json.load(sys.stdin)["document"]; print(json.dumps({k: d[k] for k in ("status", "error", "validation", "retry_available", "recovery_actions")}, indent=2))'

say "stopping the daemon (SIGTERM)"
kill -TERM $DAEMON
wait $DAEMON && echo "handoffd exited 0"
trap - EXIT
rm -rf "$TMP"
