#!/usr/bin/env bash
# The main job of the README: installs what is missing, builds the demo, and runs GRPO on synthetic arithmetic
# with the embedded default model (rlloop-small, trained from scratch) on CPU. Extra arguments go to the demo
# (see build/bin/grpo_arith --help). Environment: BUILD_DIR (default build), JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target grpo_arith
# No kernel is pinned: the recipe trains SFT to a loss rather than for a fixed step count, so it learns with
# whichever OpenBLAS kernel the CPU gets (examples/grpo_arith/README.md has the table, per kernel and seed).
exec "$BUILD_DIR/bin/grpo_arith" --out runs/grpo_arith "$@"
