#!/usr/bin/env bash
# Compiles every translation unit under src/ with -fsyntax-only against another compiler or LibTorch's headers,
# without building anything: the portability check for targets this machine cannot build for.
# Usage: scripts/syntax_check.sh [--cxx COMPILER] [--torch DIR] [--nccl] [--jobs N] [FILES...]
#   --cxx    the compiler (default g++; e.g. aarch64-linux-gnu-g++ from Debian's g++-aarch64-linux-gnu)
#   --torch  a LibTorch include root (default /usr/include, Debian's 1.13; PyPI torch 2.x:
#            third_party/venv/lib/python3.11/site-packages/torch/include)
#   --nccl   also define USE_CUDA and USE_C10D_NCCL, as a CUDA build of LibTorch does (the NCCL branch of
#            src/engine/comm/group.cpp), with the CUDA runtime and NCCL headers of the PyPI wheels installed beside
#            --torch (site-packages/nvidia/*/include; the runtime wheel lacks crt/, which triton's wheel carries)
#   --jobs   files checked at once (default: the number of cores)
# Prints one line per failing file, then how many compile; exits 1 when any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=g++ torch=/usr/include jobs=$(nproc) nccl=0 files=()
while (($#)); do
  case "$1" in
    --cxx) cxx=$2; shift 2 ;;
    --torch) torch=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --nccl) nccl=1; shift ;;
    *) files+=("$1"); shift ;;
  esac
done
((${#files[@]})) || mapfile -t files < <(ls src/*/*.cpp src/*/*/*.cpp 2>/dev/null)
command -v "$cxx" >/dev/null || { echo "syntax_check: no compiler '$cxx'" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# <rlloop/algorithms/...> and the other top-level folders, linked as the top CMakeLists.txt links them in a
# build tree, so no configured build is needed.
mkdir -p "$tmp/include/rlloop"
for dir in algorithms rewards envs; do ln -s "$PWD/$dir" "$tmp/include/rlloop/$dir"; done
# USE_DISTRIBUTED / USE_C10D_GLOO: what Torch's CMake config defines for every target linking torch (c10d).
common=(-std=c++20 -DRLLOOP_HAVE_ENGINE=1 -DRLLOOP_VERSION='"syntax-check"' -DUSE_DISTRIBUTED -DUSE_C10D_GLOO
        -Iinclude -Isrc -Isrc/engine -Itests -I"$tmp/include" -I"$torch" -I"$torch/torch/csrc/api/include")
if ((nccl)); then
  site=$(cd "$torch/../.." && pwd)
  common+=(-DUSE_CUDA -DUSE_C10D_NCCL)
  for inc in "$site"/nvidia/*/include "$site"/triton/backends/nvidia/include; do
    [[ -d $inc ]] && common+=(-I"$inc")
  done
fi
# A cross compiler searches /usr/include but not this machine's multiarch folder, where Debian keeps the few
# headers that differ between architectures. A machine of the target architecture has its own copy of them;
# OpenSSL's configuration headers are the same on every 64-bit little-endian Linux, so this machine's stand in.
target=$("$cxx" -dumpmachine) host=$(gcc -dumpmachine 2>/dev/null || echo "$target")
if [[ $target != "$host" && ! -d /usr/include/$target/openssl && -d /usr/include/$host/openssl ]]; then
  mkdir -p "$tmp/host"
  ln -s "/usr/include/$host/openssl" "$tmp/host/openssl"
  common+=(-idirafter "$tmp/host")
fi
# The engine is built with OpenMP and with <torch/torch.h> precompiled (src/engine/CMakeLists.txt); the same
# precompiled header here brings an engine file from ~20 s to ~5 s.
engine=(-fopenmp)
if printf '%s\n' "${files[@]}" | grep -q '^src/engine/'; then
  echo '#include <torch/torch.h>' >"$tmp/torch_pch.hpp"
  if "$cxx" "${common[@]}" "${engine[@]}" -x c++-header "$tmp/torch_pch.hpp" \
      -o "$tmp/torch_pch.hpp.gch" 2>"$tmp/pch.log"; then
    engine+=(-include "$tmp/torch_pch.hpp")
  else
    echo "syntax_check: <torch/torch.h> does not compile with $cxx: $(grep -m1 'error' "$tmp/pch.log")"
  fi
fi

check() {  # prints a FAIL line and returns 1 for a file that does not compile
  local f=$1 out flags=(-fsyntax-only "${common[@]}")
  [[ $f == src/engine/* ]] && flags+=("${engine[@]}")
  if ! out=$("$cxx" "${flags[@]}" "$f" 2>&1); then
    echo "FAIL $f: $(grep -m1 'error' <<<"$out")"
    return 1
  fi
}
failed=0 running=0
for f in "${files[@]}"; do
  if ((running >= jobs)); then
    wait -n || failed=$((failed + 1))
    running=$((running - 1))
  fi
  check "$f" &
  running=$((running + 1))
done
while ((running)); do
  wait -n || failed=$((failed + 1))
  running=$((running - 1))
done
echo "syntax_check: $((${#files[@]} - failed)) of ${#files[@]} files compile with $cxx against $torch"
((failed == 0))
