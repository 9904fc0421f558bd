#!/usr/bin/env bash
# `rlloop sample --sampling-precision int8` over a quantized base, through a LoRA session: the int8 products run
# (the Q8_0 matrices times the step's inputs rounded to 8 bits per block, docs/engine.md). Greedy samples of 32
# tokens from one Q8_0 base (write_gguf_base), single-threaded so that the sums are reproducible:
#   - every sample is 32 tokens long with a finite log-probability;
#   - over the quantized base int8's log-probability differs from bf16's: int8 is bf16 plus the 8-bit rounding of
#     the quantized products' inputs, so equal figures would mean those products never ran;
#   - over the same base dequantized (--dequantize-base: no quantized matrix left) int8 equals bf16 exactly;
#   - int8 stays within 0.1 nats per token of fp32.
# Usage: int8_cli_test.sh RLLOOP_BIN WRITE_GGUF_BASE_BIN
set -euo pipefail
rlloop=$1 write_base=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$write_base" "$dir/base-q8_0.gguf" Q8_0

declare -A logprob
for run in fp32 bf16 int8 "bf16 --dequantize-base" "int8 --dequantize-base"; do
  read -r precision extra <<<"$run"
  out=$("$rlloop" sample --model "$dir/base-q8_0.gguf" --prompt hi --lora-rank 4 --max-tokens 32 --temperature 0 \
        --threads 1 --sampling-precision "$precision" $extra)
  echo "$run: $(head -1 <<<"$out")"
  header=$(grep -E '^--- sample 0 \(32 tokens, stop: length, logprob -?[0-9]+\.[0-9]+\)$' <<<"$out") || {
    echo "FAIL: $run: no sample of 32 tokens with a finite log-probability in: $out"
    exit 1
  }
  logprob[$run]=$(sed -E 's/.*logprob (-?[0-9.]+)\)$/\1/' <<<"$header")
done
awk -v f="${logprob[fp32]}" -v b="${logprob[bf16]}" -v i="${logprob[int8]}" \
    -v bd="${logprob[bf16 --dequantize-base]}" -v id="${logprob[int8 --dequantize-base]}" 'BEGIN {
  bad = 0
  if (i == b) { print "FAIL: int8 sampled what bf16 did (logprob " i "): the int8 products did not run"; bad = 1 }
  if (id != bd) { print "FAIL: on the dequantized base int8 (" id ") is not bf16 (" bd ")"; bad = 1 }
  d = i - f; if (d < 0) d = -d
  if (d > 3.2) { print "FAIL: int8 is " d " nats from fp32 over 32 tokens (at most 0.1 per token)"; bad = 1 }
  if (bad) exit 1
  print "int8 over the Q8_0 base: logprob " i " (bf16 " b ", fp32 " f "; dequantized base: both " id ")"
}'
