#!/usr/bin/env bash
# Compiles every translation unit under src/ with -fsyntax-only against another compiler or LibTorch's headers,
# without building anything: the portability check for targets this machine cannot build for.
# Usage: scripts/syntax_check.sh [--cxx COMPILER] [--torch DIR] [FILES...]
#   --cxx    the compiler (default g++; e.g. aarch64-linux-gnu-g++ from Debian's g++-aarch64-linux-gnu)
#   --torch  a LibTorch include root (default /usr/include, Debian's 1.13; PyPI torch 2.x:
#            third_party/venv/lib/python3.11/site-packages/torch/include)
# Needs a configured build/ (for the generated include folder). Prints one line per failing file and exits 1
# when any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=g++ torch=/usr/include files=()
while (($#)); do
  case "$1" in
    --cxx) cxx=$2; shift 2 ;;
    --torch) torch=$2; shift 2 ;;
    *) files+=("$1"); shift ;;
  esac
done
((${#files[@]})) || mapfile -t files < <(ls src/*/*.cpp)
[[ -d build/rlloop_include ]] || { echo "syntax_check: run cmake -S . -B build first" >&2; exit 2; }
failed=0
for f in "${files[@]}"; do
  if ! out=$("$cxx" -std=c++20 -fsyntax-only -DRLLOOP_HAVE_ENGINE=1 -DRLLOOP_VERSION='"syntax-check"' \
      -Iinclude -Isrc -Isrc/engine -Ibuild/rlloop_include \
      -I"$torch" -I"$torch/torch/csrc/api/include" "$f" 2>&1); then
    echo "FAIL $f: $(grep -m1 'error' <<<"$out")"
    failed=1
  fi
done
((failed == 0)) && echo "syntax_check: ${#files[@]} files compile with $cxx against $torch"
exit $failed
