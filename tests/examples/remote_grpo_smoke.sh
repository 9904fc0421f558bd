#!/usr/bin/env bash
# examples/remote_grpo end to end: `rlloop serve` on a free loopback port (--port 0, read back from its
# "listening" line) with a tenants file holding a bearer key, then a short remote_grpo run against it.
# Checks the run's output and metrics.jsonl; stops the server it started.
# Usage: remote_grpo_smoke.sh RLLOOP_BIN REMOTE_GRPO_BIN
set -euo pipefail
rlloop_bin=$1
example_bin=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/rlloop-remote-grpo-smoke.XXXXXX")
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; echo "--- server log" >&2; cat "$work/serve.log" >&2 || true; exit 1; }

cat > "$work/tenants.json" <<'JSON'
{"tenants": [{"id": "demo", "bearerKeys": ["smoke-key"]}]}
JSON
"$rlloop_bin" serve --host 127.0.0.1 --port 0 --tenants "$work/tenants.json" --data-dir "$work/data" \
  --device cpu --threads 1 > "$work/serve.log" 2>&1 &
server_pid=$!
port=
for _ in $(seq 1 600); do
  port=$(sed -n 's/.*"event":"listening".*"port":\([0-9]*\).*/\1/p' "$work/serve.log" | head -n1)
  [[ -n "$port" ]] && break
  kill -0 "$server_pid" 2>/dev/null || fail "rlloop serve exited"
  sleep 0.1
done
[[ -n "$port" ]] || fail "rlloop serve did not report a port"

# A wrong key is refused before any session exists: one error line, exit status 1.
rc=0
"$example_bin" --url "http://127.0.0.1:$port" --api-key wrong-key --sft-steps 0 --steps 1 \
  --out "$work/refused" > "$work/refused.log" 2>&1 || rc=$?
[[ $rc == 1 ]] || { cat "$work/refused.log" >&2; fail "a wrong bearer key: exit status $rc, expected 1"; }
grep -q '^remote_grpo: UnrecognizedClientException: The bearer key is not valid' "$work/refused.log" \
  || { cat "$work/refused.log" >&2; fail "a wrong bearer key: no UnrecognizedClientException line"; }

"$example_bin" --url "http://127.0.0.1:$port" --api-key smoke-key --name smoke \
  --sft-steps 3 --sft-batch 8 --steps 2 --problems 2 --group-size 4 --eval-problems 4 \
  --out "$work/run" > "$work/run.log" 2>&1 || { cat "$work/run.log" >&2; fail "remote_grpo failed"; }
cat "$work/run.log"

grep -q '^rlloop remote_grpo: session smoke at http://127.0.0.1:'"$port"', rlloop-small + LoRA rank 32' "$work/run.log" \
  || fail "no session line"
grep -q '^SFT state saved as arn:aws:sagemaker:.*:model-package/smoke/' "$work/run.log" || fail "no SFT checkpoint ARN"
grep -q '^held-out accuracy after GRPO: [01]\.[0-9]\{3\}' "$work/run.log" || fail "no final accuracy"
[[ $(grep -c '"phase":"sft"' "$work/run/metrics.jsonl") == 3 ]] || fail "expected 3 sft records"
[[ $(grep -c '"phase":"grpo"' "$work/run/metrics.jsonl") == 2 ]] || fail "expected 2 grpo records"
grep '"phase":"grpo"' "$work/run/metrics.jsonl" | grep -q '"sampled_tokens":[1-9]' || fail "grpo sampled nothing"
[[ -s "$work/run/plot.svg" ]] || fail "no plot"
echo "remote_grpo smoke: ok (port $port)"
