#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer over the code that reads what users and clients send: the GGUF
# reader (its damaged-file test and parser_corpus_test's corpus), the tokenizer files (tokenizer.json, tiktoken, the
# GGUF tokenizer), the safetensors header parser, SigV4 (AWS's test suite) and the server's request handling
# (api_fuzz_replay: the fuzz corpus through rlloop::server::Api::handle). Built in a directory of its own with
# RLLOOP_SANITIZE=ON (cmake/Sanitize.cmake), without LibTorch, and only the targets these tests need; a sanitizer
# report fails the test that made it. tests/fuzz/README.md says what runs and how long it takes.
#   scripts/sanitize.sh [CTEST_ARGS...]
# Environment: SANITIZE_BUILD_DIR (default build-asan), JOBS (default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
build_dir=${SANITIZE_BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros}
tests=(gguf_test parser_corpus_test tokenizer_test sigv4_test api_fuzz_replay)

# Warnings are the main build's job (RLLOOP_WERROR there): GCC reports false -Wmaybe-uninitialized under ASan.
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DRLLOOP_SANITIZE=ON -DRLLOOP_WITH_TORCH=OFF \
  -DRLLOOP_BUILD_BENCH=OFF -DRLLOOP_BUILD_EXAMPLES=OFF -DRLLOOP_WERROR=OFF >/dev/null
cmake --build "$build_dir" -j "$JOBS" --target "${tests[@]}"
built=$SECONDS

# Stack use after return and initialisation order are off by default; leaks are on (LeakSanitizer) by default.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
status=0
ctest --test-dir "$build_dir" --output-on-failure --no-tests=error -j "$JOBS" \
  -R "^($(IFS='|'; echo "${tests[*]}"))\$" "$@" || status=$?
echo "== scripts/sanitize.sh: build $((built - start)) s, tests $((SECONDS - built)) s, $((SECONDS - start)) s in all" \
     "(${tests[*]})"
exit $status
