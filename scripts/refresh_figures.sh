#!/usr/bin/env bash
# Regenerates the README tables a CPU can produce and prints each in the README's Markdown form, under a line that
# names the commit (git rev-parse --short HEAD, and the files changed beside it when the tree is not clean), the
# command that made it, the machine and its load.
#   scripts/refresh_figures.sh [--seeds "1 2 3"] [--arith] [--no-build] [--build-dir DIR] [--out DIR]
#     --seeds LIST   the seeds of the main job's table (default 1 2 3)
#     --arith        also examples/grpo_arith/README.md's table (examples/grpo_arith/kernel_table.sh: every OpenBLAS
#                    kernel this CPU runs and the portable kernels, same seeds; 30-45 minutes on 2 cores)
#     --no-build     use the binaries in the build folder as they are (default: scripts/setup.sh --model, then
#                    configure and build the targets, as scripts/demo.sh does)
#     --build-dir    default build; --out: where the runs' outputs and logs go (default runs/refresh_figures)
#
# Covered:
#   - the main job's table (README.md "What the main job does" and examples/grpo_smollm2/README.md "Measured"):
#     build/bin/grpo_smollm2 --seed N with the defaults (20 steps of 8 prompts x 8 samples, 100 held-out sums):
#     held-out accuracy before -> after, after 10 steps, wall time. About 6-7 minutes a seed on 2 cores. Then
#     examples/grpo_smollm2/README.md's answers before and after on three held-out problems, of the first seed.
#   - with --arith, examples/grpo_arith/README.md's kernel table.
# Not covered (each README section names the command that made its figures):
#   - bench/README.md, bench/engine/README.md, bench/server/README.md, bench/tokenizer/README.md: throughput, time
#     and memory of benchmarks, which move with the machine's other load more than with the code;
#   - examples/sagemaker_sdk/README.md, docs/wire.md, docs/algorithms.md, docs/engine.md: tables of API shapes and
#     options, not measurements; tests/hf/README.md and tests/fuzz/README.md: what the tests cover;
#   - docs/gpu_check.md: needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
command_line="scripts/refresh_figures.sh${*:+ $*}"
seeds="1 2 3"
arith=false
build=true
BUILD_DIR=build
OUT=runs/refresh_figures
while [[ $# -gt 0 ]]; do
  case $1 in
    --seeds) seeds=$2; shift 2 ;;
    --arith) arith=true; shift ;;
    --no-build) build=false; shift ;;
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "refresh_figures.sh: unknown argument '$1' (--help)" >&2; exit 2 ;;
  esac
done
[[ -n ${seeds// /} ]] || { echo "refresh_figures.sh: --seeds is empty" >&2; exit 2; }
targets=(grpo_smollm2)
$arith && targets+=(grpo_arith)
if $build; then
  scripts/setup.sh --model
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${targets[@]}"
fi
for t in "${targets[@]}"; do
  [[ -x $BUILD_DIR/bin/$t ]] || { echo "refresh_figures.sh: no $BUILD_DIR/bin/$t (drop --no-build)" >&2; exit 1; }
done
mkdir -p "$OUT"

commit=$(git rev-parse --short HEAD)
# Uncommitted changes to what the binaries are built from, by name; the others (docs, tests, benches) counted.
built_from=(src include algorithms rewards envs examples cmake CMakeLists.txt)
changed=$(git status --porcelain --untracked-files=no -- "${built_from[@]}" | awk '{print $2}' | tr '\n' ' ')
others=$(git status --porcelain --untracked-files=no | wc -l)
others=$((others - $(git status --porcelain --untracked-files=no -- "${built_from[@]}" | wc -l)))
provenance="commit $commit"
[[ -n $changed ]] && provenance+=" with uncommitted changes to ${changed% }"
[[ $others -gt 0 ]] && provenance+=" (and to $others files not built into the examples)"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
machine="$(nproc) cores, ${cpu:-unknown CPU}"
load() { cut -d' ' -f1 /proc/loadavg; }

# A number as the README writes it: 2 decimals.
two() { [[ -n $1 ]] && printf '%.2f' "$1" || printf '?'; }

# The main job, one run per seed. Each row: seed | before -> after | after 10 steps | wall time.
rows=()
answers=()
started=$(date -u '+%Y-%m-%d %H:%M UTC')
load_start=$(load)
for s in $seeds; do
  dir="$OUT/grpo_smollm2-seed$s"
  log="$OUT/grpo_smollm2-seed$s.log"
  echo "refresh_figures.sh: $BUILD_DIR/bin/grpo_smollm2 --seed $s --out $dir (log: $log)" >&2
  "$BUILD_DIR/bin/grpo_smollm2" --seed "$s" --out "$dir" >"$log" 2>&1 \
    || { tail -20 "$log" >&2; echo "refresh_figures.sh: grpo_smollm2 --seed $s failed" >&2; exit 1; }
  before=$(sed -n 's/^held-out accuracy before GRPO: *\([0-9.]*\).*/\1/p' "$log" | tail -1)
  after=$(sed -n 's/^held-out accuracy after GRPO: *\([0-9.]*\).*/\1/p' "$log" | tail -1)
  at10=$(grep '"phase":"grpo"' "$dir/metrics.jsonl" | grep '"step":10[,}]' |
         sed -n 's/.*"accuracy":\([0-9.e+-]*\).*/\1/p' | head -1)
  wall=$(sed -n 's/^time: *\([0-9]*\) s$/\1/p' "$log" | tail -1)
  rows+=("| $s | $(two "$before") -> $(two "$after") | $(two "$at10") | ${wall:-?} s |")
  # The run's closing lines "  What is 99+24? Answer with just the number. -> before ... | after ..." (newlines
  # as \n), of the first seed only; a '|' inside an answer escaped for Markdown.
  if [[ ${#answers[@]} == 0 ]]; then
    answers+=("seed $s")
    while IFS= read -r line; do
      q=${line%%\? Answer with just the number. -> before *}
      rest=${line#* -> before }
      b=${rest% | after *}
      a=${rest##* | after }
      answers+=("| ${q#  }? | ${b//|/\\|} | ${a//|/\\|} |")
    done < <(grep '^  What is .* -> before .* | after ' "$log")
  fi
done
load_end=$(load)

echo
echo "Main job (README.md \"What the main job does\", examples/grpo_smollm2/README.md \"Measured\"):"
echo "made by \`$command_line\` at $provenance, $started, $machine, load average $load_start at the start and"
echo "$load_end at the end; each run: \`$BUILD_DIR/bin/grpo_smollm2 --seed N\` (the defaults otherwise):"
echo
echo "| seed | before -> after | after 10 steps | wall time |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "examples/grpo_smollm2/README.md, answers before and after on three held-out problems (${answers[0]}, the run above):"
echo
echo "| question | before | after |"
echo "|---|---|---|"
printf '%s\n' "${answers[@]:1}"

if $arith; then
  echo
  echo "examples/grpo_arith/README.md \"Every kernel, three seeds\": made by \`$command_line\` at $provenance,"
  echo "$machine (\`OUT=$OUT/kernel_table SEEDS=\"$seeds\" examples/grpo_arith/kernel_table.sh $BUILD_DIR\`):"
  echo
  OUT="$OUT/kernel_table" SEEDS="$seeds" examples/grpo_arith/kernel_table.sh "$BUILD_DIR"
fi
