#!/usr/bin/env bash
# Installs every Debian package rlloop needs on a fresh Debian 12 machine.
# Idempotent: when everything is present it prints nothing and returns at once.
# Usage: scripts/setup.sh [--bench]   (--bench adds Debian's PyTorch for the Python comparison scripts)
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-openmp
  libtbb-dev libboost1.81-dev libboost-json1.81-dev nlohmann-json3-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
  bubblewrap libseccomp-dev python3
)
if [[ "${1:-}" == "--bench" ]]; then packages+=(python3-torch python3-numpy); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# LibTorch must use the OpenMP OpenBLAS: the reference BLAS is ~40x slower.
if [[ -e /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3 ]]; then
  cur=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
  if [[ "$cur" != *openblas-openmp* ]]; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO update-alternatives --quiet --set libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3
    $SUDO update-alternatives --quiet --set liblapack.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3 || true
  fi
fi
