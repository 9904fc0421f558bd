#!/usr/bin/env bash
# The library without LibTorch, as a research program that only talks to a remote service uses it:
#   1. configures and builds rlloop with -DRLLOOP_WITH_TORCH=OFF (NOTORCH_BUILD_DIR, default build-notorch: no
#      engine, tests, benchmarks or examples) and installs it into a fresh prefix;
#   2. builds tests/install/notorch_consumer against that prefix with find_package(rlloop), Torch's package
#      disabled (CMAKE_DISABLE_FIND_PACKAGE_Torch: the installed config must not ask for it), and checks that
#      neither the consumer's link line nor its ldd names libtorch or libc10;
#   3. starts `rlloop serve` from a torch build (TORCH_BUILD_DIR, default build: its bin/rlloop) on a free loopback
#      port with the built-in rlloop-tiny model, and runs the consumer's GRPO step through RemoteSession against it:
#      the consumer exits 0 only when the step's stats are finite, it sampled and trained, the session is one
#      optimizer step further and its logprobs moved; this script checks the stats line too.
# Also checks that the no-torch `rlloop` tool refuses `serve` by saying it needs the engine.
#   scripts/no_torch_check.sh [TORCH_BUILD_DIR] [NOTORCH_BUILD_DIR]
# Environment: JOBS (default: number of cores). In CI (CI=true) a compiler warning fails the build, as in
# scripts/test.sh, whose flags this build repeats so that ccache serves the translation units both share.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_build=${1:-build}
notorch_build=${2:-build-notorch}
JOBS=${JOBS:-$(nproc)}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
werror=OFF
[[ ${CI:-} == true ]] && werror=ON
rlloop_bin=$torch_build/bin/rlloop
[[ -x $rlloop_bin ]] || { echo "no_torch_check: no $rlloop_bin (build rlloop_cli in $torch_build first)" >&2; exit 1; }

# A fixed place under the build folder, emptied each run: the consumer's paths stay the same from run to run, so
# ccache serves its translation unit again.
work=$PWD/$notorch_build/no_torch_check
rm -rf "$work"
mkdir -p "$work"
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
fail() {
  echo "no_torch_check: FAIL: $*" >&2
  [[ -f $work/serve.log ]] && { echo "--- server log" >&2; tail -n 20 "$work/serve.log" >&2; }
  exit 1
}
no_torch_in() { ! grep -Eq 'libtorch|libc10|-ltorch|-lc10' "$1"; }

echo "== no_torch_check: the library with RLLOOP_WITH_TORCH=OFF ($notorch_build)"
cmake -S . -B "$notorch_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLLOOP_WERROR=$werror \
  -DRLLOOP_WITH_TORCH=OFF -DRLLOOP_BUILD_TESTS=OFF -DRLLOOP_BUILD_BENCH=OFF -DRLLOOP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$notorch_build" -j "$JOBS"
cmake --install "$notorch_build" --prefix "$work/prefix" >/dev/null
targets=$(cat "$work"/prefix/lib*/cmake/rlloop/rlloopTargets*.cmake)
[[ $targets != *"rlloop::engine"* ]] || fail "the no-torch install exports rlloop::engine"
for module in remote wire sigv4 tokenizer gguf sandbox server; do
  [[ $targets == *"rlloop::$module"* ]] || fail "the no-torch install lacks rlloop::$module"
done
ldd "$work/prefix/bin/rlloop" > "$work/rlloop_ldd.txt"
no_torch_in "$work/rlloop_ldd.txt" || { cat "$work/rlloop_ldd.txt" >&2; fail "the no-torch rlloop tool loads LibTorch"; }
rc=0
"$work/prefix/bin/rlloop" serve --tenants /dev/null > "$work/serve_refused.log" 2>&1 || rc=$?
[[ $rc == 2 ]] && grep -q "'serve' needs the LibTorch engine" "$work/serve_refused.log" \
  || { cat "$work/serve_refused.log" >&2; fail "the no-torch rlloop tool did not refuse serve (status $rc)"; }

echo "== no_torch_check: the consumer (tests/install/notorch_consumer) against the installed prefix"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S tests/install/notorch_consumer -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  --no-warn-unused-cli -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON "${launcher[@]}" > "$work/consumer_configure.log" 2>&1 \
  || { cat "$work/consumer_configure.log" >&2; fail "the consumer did not configure without Torch"; }
cmake --build "$work/consumer" -j "$JOBS" -- -v > "$work/consumer_build.log" 2>&1 \
  || { cat "$work/consumer_build.log" >&2; fail "the consumer did not build"; }
consumer=$work/consumer/remote_grpo_step
grep -- "-o remote_grpo_step " "$work/consumer_build.log" > "$work/link_line.txt" \
  || fail "no link line in the consumer's build log"
no_torch_in "$work/link_line.txt" || { cat "$work/link_line.txt" >&2; fail "the consumer's link line names LibTorch"; }
ldd "$consumer" > "$work/ldd.txt"
grep -q 'libstdc++' "$work/ldd.txt" || { cat "$work/ldd.txt" >&2; fail "ldd did not list the consumer's libraries"; }
no_torch_in "$work/ldd.txt" || { cat "$work/ldd.txt" >&2; fail "the consumer loads LibTorch (ldd)"; }
echo "link line and ldd: no libtorch / libc10"

echo "== no_torch_check: one GRPO step through RemoteSession against $rlloop_bin serve"
echo '{"tenants": [{"id": "notorch", "bearerKeys": ["notorch-key"]}]}' > "$work/tenants.json"
"$rlloop_bin" serve --host 127.0.0.1 --port 0 --tenants "$work/tenants.json" --data-dir "$work/data" \
  --device cpu --threads 1 --stats-interval-s 0 > "$work/serve.log" 2>&1 &
server_pid=$!
port=
for _ in $(seq 1 600); do
  port=$(sed -n 's/.*"event":"listening".*"port":\([0-9]*\).*/\1/p' "$work/serve.log" | head -n1)
  [[ -n $port ]] && break
  kill -0 "$server_pid" 2>/dev/null || fail "rlloop serve exited"
  sleep 0.1
done
[[ -n $port ]] || fail "rlloop serve did not report a port"
"$consumer" "http://127.0.0.1:$port" notorch-key rlloop-tiny > "$work/step.json" 2> "$work/step.err" \
  || { cat "$work/step.json" "$work/step.err" >&2; fail "the consumer's GRPO step failed"; }
cat "$work/step.json"
# A non-finite double is written as null by the JSON writer: each stat must be a number, the counts positive.
for key in loss reward_mean reward_std entropy; do
  grep -Eq "\"$key\":-?[0-9]" "$work/step.json" || fail "$key is not a finite number"
done
for key in sampled_tokens trained_tokens groups_used; do
  grep -Eq "\"$key\":[1-9]" "$work/step.json" || fail "$key is not positive"
done
echo "no_torch_check: OK (no LibTorch in the consumer; one GRPO step on rlloop serve at port $port)"
