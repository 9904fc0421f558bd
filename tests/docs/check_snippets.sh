#!/usr/bin/env bash
# Every ```cpp block of README.md compiles: #include lines go to the top, the rest into main().
# Arguments: SOURCE_DIR BINARY_DIR CXX. Compiles with -fsyntax-only against the header-only core.
set -euo pipefail
src=$1 bin=$2 cxx=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
awk -v dir="$work" '
  /^```cpp/ { n++; inblock = 1; next }
  /^```/ && inblock { inblock = 0; next }
  inblock { print > (dir "/block" n ".txt") }
' "$src/README.md"
count=0
for block in "$work"/block*.txt; do
  [ -e "$block" ] || continue
  out="$work/$(basename "$block" .txt).cpp"
  { grep '^#include' "$block"; echo '#include <rlloop/rewards/math.hpp>'; echo 'int main() {';
    grep -v '^#include' "$block"; echo 'return 0; }'; } > "$out"
  "$cxx" -std=c++20 -fsyntax-only -I"$src/include" -I"$bin/rlloop_include" "$out"
  count=$((count + 1))
done
[ "$count" -gt 0 ] || { echo "no cpp snippet found in README.md"; exit 1; }
echo "$count README snippet(s) compile"
