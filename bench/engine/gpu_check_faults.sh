#!/usr/bin/env bash
# Each of gpu_check's stages fails on the fault it exists to catch, and passes without it (the CPU dry run):
#   logits, bf16  a RoPE base 1.5 times too large  save_load  the checkpoint taken after the step, not before
#   memory        a tensor kept per request        sync       an .item() inside the counted steps
# Usage: gpu_check_faults.sh GPU_CHECK_BINARY OUT_DIR
set -uo pipefail
bin=$1 out=$2
mkdir -p "$out"
failures=0
# $1 stage, $2 fault: the stage's line must say ok without the fault and not ok with it.
check() {
  local stage=$1 fault=$2 clean broken
  clean=$("$bin" --dry-run --out "$out/clean-$stage" --stage "$stage" 2>"$out/clean-$stage.log")
  broken=$("$bin" --dry-run --out "$out/$fault-$stage" --stage "$stage" --inject "$fault" 2>"$out/$fault-$stage.log")
  if [[ $clean != *'"ok":true'* ]]; then
    echo "FAIL: $stage does not pass without a fault: $clean"; failures=$((failures + 1))
  elif [[ $broken != *'"ok":false'* || $broken == *'"error"'* ]]; then
    echo "FAIL: $stage does not catch --inject $fault: $broken"; failures=$((failures + 1))
  else
    echo "ok: $stage fails on --inject $fault"
    echo "  clean:  $clean"
    echo "  broken: $broken"
  fi
}
check logits rope
check bf16 rope
check save_load skip-save
check memory leak
check sync item
((failures == 0)) || { echo "$failures stage(s) cannot fail as they should"; exit 1; }
