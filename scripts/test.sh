#!/usr/bin/env bash
# The test command of the README: installs what is missing, builds everything, runs every test; then builds the
# engine a second way, without its x86 SIMD kernels and against PyTorch 2.x's LibTorch (the PyPI wheel in
# third_party/venv, the LibTorch of the GPU machines) instead of Debian's 1.13, and runs the engine tests that reach
# the kernels and the training arithmetic again in that configuration.
#   scripts/test.sh [CTEST_ARGS...]             what CI runs
#   scripts/test.sh --portable [CTEST_ARGS...]  everything built and every test run in the portable configuration
#                                               only (RLLOOP_NATIVE_KERNELS=OFF, in PORTABLE_BUILD_DIR)
# Both together are "ctest green with the native kernels on and off". Arguments go to the main run's ctest (with
# --portable, to the portable one's). Environment: BUILD_DIR (default build), JOBS (default: number of cores),
# PORTABLE_BUILD_DIR (default build-portable; empty skips the second configuration).
set -euo pipefail
cd "$(dirname "$0")/.."
portable_only=false
if [[ ${1-} == --portable ]]; then
  portable_only=true
  shift
fi
# The engine compiles with a precompiled <torch/torch.h>; ccache caches such translation units only with these.
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
# ctest -j runs as many multi-threaded tests at once as there are cores, so their OpenMP threads outnumber the
# cores: waiting threads sleep instead of spinning on a core another test needs (engine_memory_test beside three
# other engine tests took 36 s spinning, 20 s sleeping; values are unchanged).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Each step says when it starts, in seconds since the start, so a CI log shows where its time went.
stage() { echo "== [${SECONDS} s] $*"; }
trap 'stage "scripts/test.sh ends (exit $?)"' EXIT
stage "set-up (scripts/setup.sh --tests)"
scripts/setup.sh --tests
JOBS=${JOBS:-$(nproc)}
PORTABLE_BUILD_DIR=${PORTABLE_BUILD_DIR-build-portable}
# In CI a compiler warning fails the build (-Wall -Wextra: CMakeLists.txt); elsewhere it is only reported.
werror=OFF
[[ ${CI:-} == true ]] && werror=ON
# The wheel scripts/setup.sh --tests installs (scripts/python-requirements.txt pins torch).
torch_wheel=$(echo "$PWD"/third_party/venv/lib/python3*/site-packages/torch)
venv_python=$PWD/third_party/venv/bin/python
if [[ ! -f $torch_wheel/share/cmake/Torch/TorchConfig.cmake ]]; then
  echo "scripts/test.sh: no PyTorch wheel at $torch_wheel (scripts/setup.sh --tests installs it)" >&2
  exit 1
fi
portable_config=(-S . -B "$PORTABLE_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLLOOP_NATIVE_KERNELS=OFF
                 -DRLLOOP_WERROR=$werror -DRLLOOP_TORCH_WHEEL="$torch_wheel")
if $portable_only; then
  [[ -n $PORTABLE_BUILD_DIR ]] || { echo "scripts/test.sh --portable: PORTABLE_BUILD_DIR is empty" >&2; exit 2; }
  cmake "${portable_config[@]}" -DRLLOOP_BUILD_BENCH=ON -DRLLOOP_BUILD_EXAMPLES=ON >/dev/null
  cmake --build "$PORTABLE_BUILD_DIR" -j "$JOBS"
  exec ctest --test-dir "$PORTABLE_BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
fi

BUILD_DIR=${BUILD_DIR:-build}
# The tests that may skip under CI=true (tests/skip.sh): what CI lets go unrun is printed where it ran.
if [[ ${CI:-} == true ]]; then
  echo "== tests allowed to skip under CI=true: tests/skip_list.txt and RLLOOP_SKIP_TESTS='${RLLOOP_SKIP_TESTS:-}'"
  grep -v '^#' tests/skip_list.txt | sed 's/^/   /'
fi
stage "main build ($BUILD_DIR)"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLLOOP_WERROR=$werror >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS"
stage "main tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "$@"
# The library without LibTorch (docs/no_torch.md): configured, built and installed, then an installed consumer's
# GRPO step through RemoteSession against this build's `rlloop serve`, with no libtorch/libc10 on its link line.
stage "the library without LibTorch (scripts/no_torch_check.sh)"
JOBS=$JOBS scripts/no_torch_check.sh "$BUILD_DIR"

# The engine's numerics depend on which CPU kernels run: rlloop's own (RLLOOP_CPU_KERNELS), LibTorch's
# (ATEN_CPU_CAPABILITY) and OpenBLAS's (OPENBLAS_CORETYPE). On a CPU beyond AVX2 (AVX-512) the tests above ran
# the AVX-512 ones; the tests that reach them run again as on an AVX2-only machine (Haswell's OpenBLAS kernels),
# so that a machine of either kind passes what CI passed.
engine_tests=(engine_kernels_test engine_model_test engine_session_test engine_shared_base_test)
if grep -qw avx512f /proc/cpuinfo && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  stage "engine tests again with the AVX2 kernels (RLLOOP_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell)"
  avx2_tests="$(IFS='|'; echo "${engine_tests[*]}")|engine_shared_base_aten_test|engine_data_parallel_test"
  RLLOOP_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell \
    ctest --test-dir "$BUILD_DIR" --output-on-failure --no-tests=error -j "$JOBS" -R "^($avx2_tests|engine_math_test)\$"
fi

# The parsers and the server's input side under AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan
# (scripts/sanitize.sh: no LibTorch, only the targets its tests need; a few minutes, tests/fuzz/README.md).
stage "sanitizers (scripts/sanitize.sh)"
JOBS=$JOBS scripts/sanitize.sh

# The second configuration. RLLOOP_NATIVE_KERNELS=OFF compiles the kernels as a non-x86 CPU gets them
# (src/engine/kernels/simd.hpp), so that path is tested although this machine would always choose the SIMD one; and the
# LibTorch is PyTorch 2.x's (cmake/TorchWheel.cmake: a CUDA build, which runs here on the CPU), so that what the
# GPU machines build is built and run here too. One build for both keeps CI's time. Only the engine and the tests
# that reach its kernels or its training arithmetic are built: each kernel against its reference, the decoder and
# sampler against the model, a session end to end, sessions batched on a shared base (with the CPU decoder and, as
# engine_shared_base_aten_test, with the ATen decoding step CUDA runs), the optimizer and loss math,
# bf16 training and the training memory; and data parallelism, whose c10d differs between the two LibTorches (2.x's
# store reads a zero timeout as "at once", which broke every worker before it was found here). The other engine
# tests (checkpoints, config parsing, the CLI) reach them only through paths these already cover; `--portable`
# builds and runs every test in that configuration.
[[ -n $PORTABLE_BUILD_DIR ]] || exit 0
# Also the GPU check's stages failing on planted faults (bench/engine/gpu_check_faults.sh), on the LibTorch the GPU
# machines run. The group's collectives and fully sharded training too, and torchrun's launch, which on 2.x joins
# the agent's own store (1.13's client cannot: tests/dist/launchers_test.py).
portable_tests=("${engine_tests[@]}" engine_math_test engine_mixed_precision_test engine_memory_test
                engine_data_parallel_test engine_collectives_test engine_fully_sharded_test
                engine_tensor_parallel_test)
stage "portable build ($PORTABLE_BUILD_DIR)"
cmake "${portable_config[@]}" -DRLLOOP_BUILD_BENCH=ON -DRLLOOP_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$PORTABLE_BUILD_DIR" -j "$JOBS" --target "${portable_tests[@]}" gpu_check
stage "portable tests"
ctest --test-dir "$PORTABLE_BUILD_DIR" --output-on-failure --no-tests=error -j "$JOBS" \
  -R "^($(IFS='|'; echo "${portable_tests[*]}")|engine_shared_base_aten_test|gpu_check_faults|dist_launchers_test)\$"
# The GPU bundle made from these very binaries (scripts/gpu_bundle.sh: torch 2.11.0, the GPU machines' LibTorch),
# and its run.sh's dry run from inside it, as a GPU window runs it: what goes to a GPU machine is what ran here.
stage "GPU bundle and its dry run"
BUILD_DIR=$PORTABLE_BUILD_DIR scripts/gpu_bundle.sh --out "$PORTABLE_BUILD_DIR/gpu-bundle"
(cd "$PORTABLE_BUILD_DIR/gpu-bundle" &&
  PYTHON="$venv_python" ./run.sh --dry-run --budget 900 --out "../gpu-bundle-dry-run")
