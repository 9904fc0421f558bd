#!/usr/bin/env bash
# Installs the built project into a temporary prefix and builds a consumer against it with find_package,
# then builds the same consumer with add_subdirectory of the source tree. Arguments: SOURCE_DIR BUILD_DIR.
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/install/consumer" -B "$work/found" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/found" >/dev/null
"$work/found/consumer"
cmake -S "$src/tests/install/consumer" -B "$work/sub" -DRLLOOP_SOURCE="$src" -DRLLOOP_WITH_TORCH=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/sub" --target consumer >/dev/null
"$work/sub/consumer"
echo "install + find_package and add_subdirectory consumers: OK"
