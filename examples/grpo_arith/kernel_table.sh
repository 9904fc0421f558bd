#!/usr/bin/env bash
# The table of examples/grpo_arith/README.md: held-out accuracy after SFT and after GRPO of the demo's defaults for
# 3 seeds under each OpenBLAS kernel this CPU can run (OPENBLAS_CORETYPE) and under the engine's portable kernels
# (RLLOOP_CPU_KERNELS=portable: the path a CPU without AVX2 takes, with OpenBLAS's own choice). Prints a Markdown
# table; each run's output goes to $OUT/<kernel>-<seed>.log. About 30-45 minutes on 2 cores.
# Usage: examples/grpo_arith/kernel_table.sh [BUILD_DIR]      (default build; build/bin/grpo_arith must exist)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-build}/bin/grpo_arith
OUT=${OUT:-runs/kernel_table}
SEEDS=${SEEDS:-1 2 3}
mkdir -p "$OUT"
kernels=()
grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && kernels+=(Haswell Zen)
grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && kernels+=(SkylakeX)
grep -qw avx512_bf16 /proc/cpuinfo && kernels+=(Cooperlake)
kernels+=(portable)
echo "| kernel | $(for s in $SEEDS; do printf 'seed %s: SFT -> GRPO (SFT steps) | ' "$s"; done)"
echo "|---|$(for s in $SEEDS; do printf -- '---|'; done)"
for k in "${kernels[@]}"; do
  row="| $k |"
  for s in $SEEDS; do
    log="$OUT/$k-$s.log"
    if [[ $k == portable ]]; then
      env -u OPENBLAS_CORETYPE RLLOOP_CPU_KERNELS=portable "$bin" --seed "$s" --out "$OUT/$k-$s" >"$log" 2>&1
    else
      OPENBLAS_CORETYPE=$k "$bin" --seed "$s" --out "$OUT/$k-$s" >"$log" 2>&1
    fi
    sft=$(sed -n 's/^held-out accuracy after SFT:  *//p' "$log" | tail -1)
    grpo=$(sed -n 's/^held-out accuracy after GRPO: *\([0-9.]*\).*/\1/p' "$log")
    steps=$(sed -n 's/.* at step \([0-9]*\)$/\1/p' "$log")
    row+=" $sft -> $grpo (${steps:-max}) |"
  done
  echo "$row"
done
