#!/usr/bin/env bash
# Runs the GPU bundle (scripts/gpu_bundle.sh made this folder): gpu_check's stages, transformers' generate on the
# decode stage's weights, then the device-aware engine tests, each with its own timeout, every JSON line in
# OUT/gpu-check.jsonl (and on stdout) and every log under OUT/logs, so that a command killed at its time limit keeps
# what ran. The machine's own torch provides LibTorch and CUDA (LD_LIBRARY_PATH is set from it).
#   run.sh --out OUT [--dry-run] [--device cuda:N] [--budget SECONDS] [--no-tests | --only-tests]
#     --dry-run   the CPU in bf16 at toy sizes (CI runs this, from inside the bundle)
#     --budget    seconds for everything (default 540: a 10-minute command with room to copy OUT back); a step
#                 gets its own timeout or what is left, whichever is less; a step with no time left says so
# Environment: PYTHON (default python3): the Python whose torch the binaries load.
# Exit status: 0 when every line is ok, 1 otherwise, 2 on bad usage.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="" dry=false device=cuda budget=540 stages=true tests=true
usage() {
  echo "usage: run.sh --out OUT [--dry-run] [--device cuda:N] [--budget SECONDS] [--no-tests | --only-tests]" >&2
  exit 2
}
while (($#)); do
  case "$1" in
    --out) out=${2:-}; shift 2 || usage ;;
    --dry-run) dry=true; shift ;;
    --device) device=${2:-}; shift 2 || usage ;;
    --budget) budget=${2:-}; shift 2 || usage ;;
    --no-tests) tests=false; shift ;;
    --only-tests) stages=false; shift ;;
    *) usage ;;
  esac
done
[[ -n $out && $budget =~ ^[0-9]+$ ]] || usage
mkdir -p "$out/logs" "$out/work"
out=$(cd "$out" && pwd)
jsonl=$out/gpu-check.jsonl
: >"$jsonl"
emit() { echo "$1" | tee -a "$jsonl"; }
deadline=$(($(date +%s) + budget))
PYTHON=${PYTHON:-python3}

# --- The bundle against this machine's torch ----------------------------------------------------------------
torch_info=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__), torch.__version__,
              torch.version.cuda or "none")' 2>"$out/logs/python.log")
read -r torch_dir machine_torch machine_cuda <<<"$torch_info"
manifest() {
  "$PYTHON" -c "import json; print(json.load(open('$here/MANIFEST.json'))['$1'])" 2>/dev/null || echo unknown
}
built_torch=$(manifest torch_version) built_cuda=$(manifest torch_cuda) commit=$(manifest commit)
problems=()
[[ -n $torch_dir ]] || problems+=("no torch importable by $PYTHON (logs/python.log)")
[[ $built_cuda == 13.* ]] || problems+=("built against CUDA $built_cuda, not 13.x")
if [[ -n $torch_dir ]]; then
  site=$(dirname "$torch_dir")
  lib_path=$here/lib:$torch_dir/lib
  for d in "$site"/nvidia/*/lib "$site"/nvidia/cu*/lib; do [[ -d $d ]] && lib_path+=:$d; done
  export LD_LIBRARY_PATH=$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [[ ${machine_torch%%+*} == "${built_torch%%+*}" ]] ||
    problems+=("this machine's torch is $machine_torch, the bundle's $built_torch: LibTorch's C++ ABI may differ")
  # Every binary's libraries and symbols resolve (ldd -r: a LibTorch of another ABI leaves symbols undefined).
  for bin in "$here"/bin/*; do
    ldd -r "$bin" >"$out/logs/ldd-$(basename "$bin").log" 2>&1
    missing=$(grep -E 'not found|undefined symbol' "$out/logs/ldd-$(basename "$bin").log" | head -n 3 | tr -d '\t' |
              paste -sd ';' -)
    [[ -z $missing ]] || problems+=("$(basename "$bin"): $missing")
  done
fi
ok=true
((${#problems[@]} == 0)) || ok=false
problem_json=$(printf '%s\n' "${problems[@]}" |
  "$PYTHON" -c 'import json, sys; print(json.dumps([l for l in sys.stdin.read().splitlines() if l]))' 2>/dev/null ||
  echo '["(python missing)"]')
emit "{\"stage\": \"bundle\", \"commit\": \"$commit\", \"built_against\": \"$built_torch\",\
 \"built_cuda\": \"$built_cuda\", \"machine_torch\": \"$machine_torch\", \"machine_cuda\": \"$machine_cuda\",\
 \"problems\": $problem_json, \"ok\": $ok}"
$ok || exit 1

status=0
# Runs "$@" with min(its timeout, what is left of the budget), output to a log; its exit status, 124 on a timeout.
bounded() {
  local limit=$1 log=$2
  shift 2
  local left=$((deadline - $(date +%s)))
  ((left > 5)) || return 125
  ((limit < left)) || limit=$left
  timeout -k 5 "$limit" "$@" >"$log" 2>&1
}
# Why a step gave no line: its exit status, in words.
failure() {
  case $1 in
    124 | 137) echo "timed out (its log: logs/$2.log)" ;;
    125) echo "no time left in the budget" ;;
    *) echo "exited with status $1 and no line (its log: logs/$2.log)" ;;
  esac
}

# --- gpu_check's stages, each in its own process -------------------------------------------------------------
# Seconds each may take on a GPU (its figures in bench/README.md once measured); the dry run's are generous.
declare -A limit=([device]=60 [logits]=60 [bf16]=60 [session_lora]=90 [session_full]=120 [save_load]=60
                  [memory]=60 [sync]=60 [decode]=120 [tenants]=120 [prefill]=90 [train]=120 [hf_generate]=120)
mode=(--device "$device")
$dry && mode=(--dry-run)
if $stages; then
  for stage in $("$here/bin/gpu_check" --list); do
    bounded "${limit[$stage]:-60}" "$out/logs/$stage.log" "$here/bin/gpu_check" "${mode[@]}" --out "$out/work" \
      --stage "$stage"
    rc=$?
    line=$(grep -m1 '^{' "$out/logs/$stage.log")
    if [[ -n $line ]]; then
      emit "$line"
    else
      emit "{\"stage\": \"$stage\", \"ok\": false, \"error\": \"$(failure $rc "$stage")\"}"
    fi
    [[ $rc == 0 && $line == *'"ok":true'* ]] || status=1
  done
  # Hugging Face's generate on the weights the decode stage sampled from (the dry run: 4 rows of 8 tokens on the CPU).
  hf_args=(--model "$out/work/decode-hf" --device "$device")
  $dry && hf_args=(--model "$out/work/decode-hf" --device cpu --rows 4 --new-tokens 8)
  bounded "${limit[hf_generate]}" "$out/logs/hf_generate.log" "$PYTHON" "$here/share/hf_generate.py" "${hf_args[@]}"
  rc=$?
  line=$(grep -m1 '^{' "$out/logs/hf_generate.log")
  [[ -n $line ]] || line="{\"stage\": \"hf_generate\", \"ok\": false, \"error\": \"$(failure $rc hf_generate)\"}"
  emit "$line"
  [[ $rc == 0 ]] || status=1
fi

# --- The device-aware engine tests on the device (the dry run: the CPU in bf16) -------------------------------
if $tests; then
  mkdir -p "$out/logs/tests"
  test_env=(RLLOOP_TEST_DEVICE="$device")
  $dry && test_env=(RLLOOP_TEST_DEVICE=cpu RLLOOP_TEST_DTYPE=bf16)
  # The tests' data files and worker program, here instead of the build's paths (tests/test_device.hpp).
  test_env+=(RLLOOP_SOURCE_DIR="$here/share" RLLOOP_PROGRAM="$here/bin/rlloop")
  for bin in "$here"/bin/engine_*_test; do
    t=$(basename "$bin")
    (cd "$out/work" && bounded 240 "$out/logs/tests/$t.log" env "${test_env[@]}" "$bin")
    rc=$?
    if ((rc == 0)); then
      result=passed
    else
      failed=$({ grep -oE '^\[  FAILED  \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+' "$out/logs/tests/$t.log" || true; } |
               sed 's/.*\] //' | sort -u | paste -sd ' ' -)
      result="failed: ${failed:-$(failure $rc "tests/$t")}"
      status=1
    fi
    emit "{\"stage\": \"test\", \"binary\": \"$t\", \"env\": \"${test_env[*]}\", \"result\": \"$result\",\
 \"ok\": $([[ $result == passed ]] && echo true || echo false)}"
  done
fi
exit $status
