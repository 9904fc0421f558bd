#!/usr/bin/env bash
# The prepared GPU check: builds rlloop's engine and bench/engine/gpu_check against the LibTorch of this machine's
# PyTorch 2.x (cmake/TorchWheel.cmake) and runs its stages, one JSON line each (docs/gpu_check.md). Meant for a
# machine lent for minutes with one NVIDIA GPU, PyTorch 2.x and no network.
#   scripts/gpu_check.sh [--dry-run] [--debs DIR] [--device cuda:N] [--no-tests]
#     --dry-run   on this machine's CPU in bf16 at toy sizes, against third_party/venv's torch (CI runs the same
#                 program through ctest: gpu_check_dry_run)
#     --debs DIR  unpack the .deb files in DIR (dpkg -x, no root) and build against them: the Debian packages the
#                 configure step needs (fetch them beforehand, on a machine with Debian's mirrors, with
#                 scripts/gpu_check.sh --fetch-debs DIR)
#     --no-tests  skip the last stage: the device-aware engine tests (tests/test_device.hpp) on the device
#   scripts/gpu_check.sh --fetch-debs DIR   apt-get download those packages into DIR
# Environment: PYTHON (default python3; --dry-run: third_party/venv/bin/python), BUILD_DIR (default
# build-gpu-check), JOBS (default: the number of cores). Output: the JSON lines on stdout and in
# $BUILD_DIR/gpu-check.jsonl; exits 1 when a stage is not ok.
set -euo pipefail
cd "$(dirname "$0")/.."
# What configuring rlloop needs beyond a compiler, CMake and PyTorch (CMakeLists.txt's find_package calls).
debs=(nlohmann-json3-dev libtbb-dev libtbb12 libboost1.81-dev libcli11-dev libssl-dev ninja-build libgtest-dev)
# The engine tests that take their device and dtype from RLLOOP_TEST_DEVICE / RLLOOP_TEST_DTYPE.
device_tests=(engine_model_test engine_session_test engine_shared_base_test engine_data_parallel_test)
dry=false debs_dir="" device=cuda with_tests=true
while (($#)); do
  case "$1" in
    --dry-run) dry=true; shift ;;
    --debs) debs_dir=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --no-tests) with_tests=false; shift ;;
    --fetch-debs)
      mkdir -p "$2" && cd "$2" && apt-get download "${debs[@]}"
      exit 0 ;;
    *) echo "usage: scripts/gpu_check.sh [--dry-run] [--debs DIR] [--device cuda:N] [--no-tests] | --fetch-debs DIR" >&2
       exit 2 ;;
  esac
done
BUILD_DIR=${BUILD_DIR:-build-gpu-check}
JOBS=${JOBS:-$(nproc)}
if $dry; then PYTHON=${PYTHON:-third_party/venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
wheel=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(torch.__file__))') ||
  { echo "gpu_check: no PyTorch importable by $PYTHON" >&2; exit 1; }
mkdir -p "$BUILD_DIR"
prefix_args=()
if [[ -n $debs_dir ]]; then
  root=$PWD/$BUILD_DIR/debroot
  mkdir -p "$root"
  for deb in "$debs_dir"/*.deb; do dpkg -x "$deb" "$root"; done
  export PATH=$root/usr/bin:$PATH CPATH=$root/usr/include${CPATH:+:$CPATH}
  export LD_LIBRARY_PATH=$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  prefix_args=(-DCMAKE_PREFIX_PATH="$root/usr;$root/usr/lib/x86_64-linux-gnu/cmake")
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
start=$(date +%s)
# Each step's output goes to its log, whose end is shown when the step fails.
step() {
  local log=$1
  shift
  "$@" >"$BUILD_DIR/$log" 2>&1 || { tail -n 40 "$BUILD_DIR/$log" >&2; echo "gpu_check: $* failed" >&2; exit 1; }
}
targets=(gpu_check)
$with_tests && targets+=("${device_tests[@]}")
step configure.log cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DRLLOOP_TORCH_WHEEL="$wheel" -DRLLOOP_BUILD_TESTS=$($with_tests && echo ON || echo OFF) \
  -DRLLOOP_BUILD_EXAMPLES=OFF -DRLLOOP_BUILD_BENCH=ON "${prefix_args[@]}"
step build.log cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"
echo "{\"stage\": \"build\", \"seconds\": $(($(date +%s) - start)), \"libtorch\": \"$wheel\", \"ok\": true}" |
  tee "$BUILD_DIR/gpu-check.jsonl"
args=(--out "$BUILD_DIR/runs")
if $dry; then args+=(--dry-run); else args+=(--device "$device"); fi
status=0
"$BUILD_DIR/bench/engine/gpu_check" "${args[@]}" | tee -a "$BUILD_DIR/gpu-check.jsonl" || status=1
# Hugging Face's generate on the weights the decode stage sampled from (the dry run: 4 rows of 8 tokens on the CPU).
hf_args=(--model "$BUILD_DIR/runs/decode-hf" --device "$device")
$dry && hf_args=(--model "$BUILD_DIR/runs/decode-hf" --device cpu --rows 4 --new-tokens 8)
if ! "$PYTHON" bench/engine/hf_generate.py "${hf_args[@]}" 2>"$BUILD_DIR/hf_generate.log" |
     tee -a "$BUILD_DIR/gpu-check.jsonl"; then
  tail -n 20 "$BUILD_DIR/hf_generate.log" >&2
  echo '{"stage": "hf_generate", "ok": false}' | tee -a "$BUILD_DIR/gpu-check.jsonl"
  status=1
fi
# Last, after every figure is out: the device-aware tests on the device (the dry run: on the CPU in bf16, the
# arithmetic CUDA runs), each binary's result and its failed tests' names in one line; logs in $BUILD_DIR/test-logs.
if $with_tests; then
  logs=$BUILD_DIR/test-logs
  mkdir -p "$logs"
  logs=$(realpath "$logs")
  test_env=(RLLOOP_TEST_DEVICE="$device")
  $dry && test_env=(RLLOOP_TEST_DEVICE=cpu RLLOOP_TEST_DTYPE=bf16)
  results="" failed_any=false
  for t in "${device_tests[@]}"; do
    bin=$(find "$BUILD_DIR/tests" -name "$t" -type f -executable | head -n 1)
    # As ctest runs them: from the build directory. (A binary that crashed or timed out lists no failed test;
    # nothing here may end the script before its line is out.)
    if [[ -n $bin ]] && (cd "$BUILD_DIR" && env "${test_env[@]}" timeout 300 "$(realpath "$bin")" >"$logs/$t.log" 2>&1)
    then
      result=passed
    else
      failed=$({ grep -oE '^\[  FAILED  \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+' "$logs/$t.log" 2>/dev/null || true; } |
               sed 's/.*\] //' | sort -u | paste -sd ' ' -)
      result="failed: ${failed:-the binary itself (not built, crashed or timed out; see its log)}"
      failed_any=true
    fi
    results+="${results:+, }\"$t\": \"$result\""
  done
  ok=$($failed_any && echo false || echo true)
  echo "{\"stage\": \"tests\", \"env\": \"${test_env[*]}\", \"results\": {$results}, \"ok\": $ok}" |
    tee -a "$BUILD_DIR/gpu-check.jsonl"
  $failed_any && status=1
fi
exit $status
