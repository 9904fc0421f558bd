#!/usr/bin/env bash
# The GPU check built on the GPU machine itself, for a machine with a compiler, CMake and PyTorch 2.x but without
# the prebuilt bundle (the usual route is to carry the bundle: scripts/gpu_bundle.sh, docs/gpu_check.md). It unpacks
# the Debian packages configuring needs (fetched beforehand with --fetch-debs on a machine with Debian's mirrors),
# builds the bundle there against that machine's torch and runs it.
#   scripts/gpu_check.sh [--debs DIR] [--out OUT] [run.sh's options: --dry-run, --device cuda:N, --budget S, ...]
#     --debs DIR  unpack the .deb files in DIR (dpkg -x, no root) and build against them
#     --out OUT   where run.sh writes its JSON lines and logs (default gpu-check-out)
#   scripts/gpu_check.sh --fetch-debs DIR   apt-get download those packages and what they depend on into DIR
# Environment: PYTHON (default python3; --dry-run: third_party/venv/bin/python), BUILD_DIR (default build-gpu-check),
# JOBS. Exit status: run.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
# What configuring and building rlloop's bundle needs beyond a compiler, CMake and PyTorch (the find_package and
# find_library calls of CMakeLists.txt, src/ and tests/). Google Benchmark is optional (benches only).
debs=(nlohmann-json3-dev libtbb-dev libboost1.81-dev libboost-json1.81-dev libcli11-dev libssl-dev libseccomp-dev
      ninja-build libgtest-dev libgmock-dev)
# Packages every machine that can compile has (the toolchain and glibc): not downloaded with the dependencies.
base='libc6|libc6-dev|libc-dev-bin|libgcc-s1|libgcc-[0-9]+-dev|libstdc\+\+6|libstdc\+\+-[0-9]+-dev|linux-libc-dev'
base+='|gcc(-[0-9]+)?(-base)?|g\+\+(-[0-9]+)?|cpp(-[0-9]+)?|binutils.*|libcrypt.*|perl.*|debconf|dpkg|tar|zlib1g'
base="^($base)(:amd64)?\$"
debs_dir="" out=gpu-check-out run_args=() dry=false
while (($#)); do
  case "$1" in
    --debs) debs_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --dry-run) dry=true; run_args+=("$1"); shift ;;
    --fetch-debs)
      mkdir -p "$2"
      # The packages and the closure of what they depend on (no recommends), less the toolchain's.
      closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
                  --no-enhances "${debs[@]}" | grep -E '^[a-z0-9]' | grep -vE "$base" | sort -u)
      # shellcheck disable=SC2086
      (cd "$2" && apt-get download $closure)
      echo "gpu_check: $(ls "$2"/*.deb | wc -l) packages in $2 ($(du -sh "$2" | cut -f1))"
      exit 0 ;;
    *) run_args+=("$1"); shift ;;
  esac
done
BUILD_DIR=${BUILD_DIR:-build-gpu-check}
if $dry; then PYTHON=${PYTHON:-$PWD/third_party/venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
export PYTHON BUILD_DIR
if [[ -n $debs_dir ]]; then
  root=$PWD/$BUILD_DIR/debroot
  mkdir -p "$root"
  for deb in "$debs_dir"/*.deb; do dpkg -x "$deb" "$root"; done
  # Debian keeps some headers (openssl/configuration.h) and every library under the multiarch folders.
  multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
  export PATH=$root/usr/bin:$PATH
  export CPATH=$root/usr/include:$root/usr/include/$multiarch${CPATH:+:$CPATH}
  export LIBRARY_PATH=$root/usr/lib/$multiarch${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$root/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CMAKE_PREFIX_PATH="$root/usr;$root/usr/lib/$multiarch/cmake${CMAKE_PREFIX_PATH:+;$CMAKE_PREFIX_PATH}"
fi
mkdir -p "$BUILD_DIR"
if ! scripts/gpu_bundle.sh --out "$BUILD_DIR/bundle" >"$BUILD_DIR/bundle.log" 2>&1; then
  tail -n 40 "$BUILD_DIR/bundle.log" >&2
  echo "gpu_check: building the bundle failed ($BUILD_DIR/bundle.log)" >&2
  exit 1
fi
exec "$BUILD_DIR/bundle/run.sh" --out "$out" "${run_args[@]}"
