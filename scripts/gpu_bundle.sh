#!/usr/bin/env bash
# The prebuilt GPU bundle: builds, on this CPU machine, what the first GPU window runs — bench/engine/gpu_check, the
# rlloop program and the device-aware engine tests — against PyPI's torch 2.11.0 (the CUDA 13.0 build, the same
# LibTorch as the lent GPU machines' 2.11.0+cu130), strips them and packs them with every shared library they need
# that is neither glibc's nor torch's own (the GPU machine brings its torch), plus run.sh (scripts/gpu_bundle/run.sh),
# which runs every stage with its own timeout and writes every log into a folder it is given. Nothing has to be
# fetched or compiled on the GPU machine. docs/gpu_check.md has the plan for a GPU window.
#   scripts/gpu_bundle.sh --out DIR
# Environment: BUILD_DIR (default build-portable: the same configuration as scripts/test.sh's second build, so CI
# builds these binaries once and what goes to a GPU machine is exactly what CI ran), JOBS (default: the cores),
# PYTHON (default third_party/venv/bin/python, whose torch is built against).
set -euo pipefail
cd "$(dirname "$0")/.."
out=""
while (($#)); do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    *) echo "usage: scripts/gpu_bundle.sh --out DIR" >&2; exit 2 ;;
  esac
done
[[ -n $out ]] || { echo "usage: scripts/gpu_bundle.sh --out DIR" >&2; exit 2; }
BUILD_DIR=${BUILD_DIR:-build-portable}
JOBS=${JOBS:-$(nproc)}
PYTHON=${PYTHON:-third_party/venv/bin/python}
# The bundle's size limit: what a GPU window's call carries (64 MiB) with room for the tree beside it.
max_mib=48
binaries=(gpu_check rlloop engine_model_test engine_session_test engine_shared_base_test engine_data_parallel_test)
targets=(gpu_check rlloop_cli engine_model_test engine_session_test engine_shared_base_test engine_data_parallel_test)

# The torch built against: 2.11 with CUDA 13.x, the GPU machines' (a mismatch would only show there).
read -r wheel torch_version torch_cuda < <("$PYTHON" -c \
  'import os, torch; print(os.path.dirname(torch.__file__), torch.__version__, torch.version.cuda or "none")') ||
  { echo "gpu_bundle: no torch importable by $PYTHON (scripts/setup.sh --tests installs it)" >&2; exit 1; }
if [[ $torch_cuda != 13.* ]]; then
  echo "gpu_bundle: $PYTHON's torch $torch_version is built for CUDA $torch_cuda; the GPU machines run CUDA 13.x" >&2
  exit 1
fi
[[ $torch_version == 2.11.* ]] ||
  echo "gpu_bundle: warning: torch $torch_version, not the GPU machines' 2.11.0 (run.sh checks the ABI there)" >&2

# Configure only a folder not configured against a wheel yet: scripts/test.sh configures build-portable the same way.
if ! grep -q "^RLLOOP_TORCH_WHEEL:PATH=.*site-packages/torch" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  werror=OFF
  [[ ${CI:-} == true ]] && werror=ON
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRLLOOP_NATIVE_KERNELS=OFF \
    -DRLLOOP_WERROR=$werror -DRLLOOP_TORCH_WHEEL="$wheel" -DRLLOOP_BUILD_BENCH=ON -DRLLOOP_BUILD_EXAMPLES=OFF >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/share/tests/engine_model"
for name in "${binaries[@]}"; do
  src=$(find "$BUILD_DIR" -name "$name" -type f -executable -not -path '*/CMakeFiles/*' | head -n 1)
  [[ -n $src ]] || { echo "gpu_bundle: $name was not built in $BUILD_DIR" >&2; exit 1; }
  strip --strip-unneeded -o "$out/bin/$name" "$src"
done
# Every library the binaries load that the GPU machine may lack: all but glibc's and torch's (its lib/, the nvidia-*
# and triton wheels beside it), which the machine's own torch provides.
site=$(dirname "$wheel")
glibc='/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64)\.so'
for bin in "$out"/bin/*; do
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  [[ $lib == "$site"/* ]] && continue
  [[ $lib =~ $glibc ]] && continue
  cp -L "$lib" "$out/lib/"
done
cp bench/engine/hf_generate.py "$out/share/"
cp tests/engine_model/golden_logits.json "$out/share/tests/engine_model/"
cp scripts/gpu_bundle/run.sh "$out/run.sh"
chmod +x "$out/run.sh"
# The newest glibc symbol version any packed file asks for: the oldest glibc the bundle runs on.
glibc_needed=$(objdump -T "$out"/bin/* "$out"/lib/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$([[ -n $(git status --porcelain 2>/dev/null) ]] && echo true || echo false)
size_kib=$(du -sk "$out" | cut -f1)
"$PYTHON" - "$out/MANIFEST.json" <<EOF
import json, os, sys
out = os.path.dirname(sys.argv[1])
json.dump({"commit": "$commit", "uncommitted_changes": $([[ $dirty == true ]] && echo True || echo False),
           "torch_version": "$torch_version", "torch_cuda": "$torch_cuda", "glibc_needed": "$glibc_needed",
           "binaries": sorted(os.listdir(os.path.join(out, "bin"))),
           "libraries": sorted(os.listdir(os.path.join(out, "lib"))), "size_kib": $size_kib},
          open(sys.argv[1], "w"), indent=1)
EOF
echo "gpu_bundle: $out ($((size_kib / 1024)) MiB, torch $torch_version, CUDA $torch_cuda, commit $commit," \
     "needs $glibc_needed): $(ls "$out/lib" | paste -sd ' ' -)"
if ((size_kib > max_mib * 1024)); then
  echo "gpu_bundle: $out is $((size_kib / 1024)) MiB, over the $max_mib MiB a GPU window carries" >&2
  exit 1
fi
