#!/bin/bash
# A/B of bench_engine binaries built from different commits, alternated so that both see the same machine
# load (on a shared machine absolute figures move by more than most single changes):
#   bench/engine/ab.sh FILTER ROUNDS BENCH_A BENCH_B [...]
#   e.g. bench/engine/ab.sh 'BM_Sample.*/1' 3 /tmp/bench_before build/bench/engine/bench_engine
# Each round runs every binary once (--benchmark_repetitions=${REP:-2}, RLLOOP_BENCH_THREADS=${T:-2}). Prints,
# per benchmark and binary, every tokens_per_s (GFLOPs where there is none) sorted, their median, and the
# median's ratio to BENCH_A's. Results are grouped by path: for an A/A run, pass two copies of one binary.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
filter=$1 rounds=$2
shift 2
export LC_ALL=C
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for _ in $(seq "$rounds"); do
  for bin in "$@"; do
    if ! RLLOOP_BENCH_THREADS=${T:-2} "$bin" --benchmark_filter="$filter" --benchmark_repetitions="${REP:-2}" \
      --benchmark_report_aggregates_only=false >"$out" 2>&1; then
      echo "ab.sh: $bin failed:" >&2
      cat "$out" >&2
      exit 1
    fi
    if ! grep -qE '^BM_' "$out"; then
      echo "ab.sh: no benchmark of $bin matches '$filter'" >&2
      exit 1
    fi
    grep -E '^BM_' "$out" | grep -vE '_(mean|median|stddev|cv) ' |
      awk -v bin="$bin" '{
        name = $1; sub(/\/(iterations|min_time|repeats).*/, "", name)
        v = ""
        for (i = 2; i <= NF; i++) {
          if ($i ~ /^tokens_per_s=/) { v = $i; break }
          if ($i ~ /^GFLOPs=/) v = $i
        }
        if (v == "") next
        sub(/^[a-zA-Z_]+=/, "", v)
        # Google Benchmark writes counters with SI suffixes (k = 1e3 ... m = 1e-3 ...).
        scale = 1; suffix = substr(v, length(v))
        if (suffix ~ /[kMGTmunp]/) {
          v = substr(v, 1, length(v) - 1)
          scale = suffix == "k" ? 1e3 : suffix == "M" ? 1e6 : suffix == "G" ? 1e9 : suffix == "T" ? 1e12 : \
                  suffix == "m" ? 1e-3 : suffix == "u" ? 1e-6 : suffix == "n" ? 1e-9 : 1e-12
        }
        print name, bin, v * scale
      }'
  done
done | sort -k1,1 -k2,2 -k3,3n | awk -v first="$1" '
  { key = $1 SUBSEP $2; n[key]++; x[key, n[key]] = $3; list[key] = list[key] " " $3 }
  END {
    for (key in n) {
      m = n[key]
      med[key] = (m % 2) ? x[key, (m + 1) / 2] : (x[key, m / 2] + x[key, m / 2 + 1]) / 2
    }
    for (key in n) {
      split(key, part, SUBSEP)
      base = med[part[1] SUBSEP first]
      printf "%s %s:%s  median %.1f  (%.3fx %s)\n", part[1], part[2], list[key], med[key],
             base ? med[key] / base : 0, first
    }
  }' | sort
