#!/usr/bin/env bash
# Installs the built project into a temporary prefix and builds consumers against it with find_package (the
# core's, and one per exported module, each run), then builds the core's consumer with add_subdirectory of the
# source tree. Arguments: SOURCE_DIR BUILD_DIR.
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/install/consumer" -B "$work/found" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/found" >/dev/null
# The core's consumer, then one per compiled module the install exports (each must have one).
"$work/found/consumer"
targets=$(cat "$work"/prefix/lib*/cmake/rlloop/rlloopTargets.cmake)
for module in tokenizer gguf sandbox sigv4 wire remote server engine; do
  [[ $targets == *"rlloop::$module"* ]] || continue
  [[ -x $work/found/consumer_$module ]] || { echo "no consumer of rlloop::$module was built" >&2; exit 1; }
  "$work/found/consumer_$module"
done
cmake -S "$src/tests/install/consumer" -B "$work/sub" -DRLLOOP_SOURCE="$src" -DRLLOOP_WITH_TORCH=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/sub" --target consumer >/dev/null
"$work/sub/consumer"
echo "install + find_package and add_subdirectory consumers: OK"
