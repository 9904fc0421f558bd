#!/usr/bin/python3
"""Runs bench_engine (rlloop, C++) and reference.py (eager PyTorch, Debian's /usr/bin/python3) on the same
models, shapes and thread count, alternating C++ and Python per measurement so both see the same machine
load, and prints tokens/s, achieved GFLOP/s, fraction of the matmul peak and rlloop / Python ratios.

  /usr/bin/python3 bench/engine/compare.py --bench build-bench/bench/engine/bench_engine [--threads 2] [--repeats 3]
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = [("rlloop-small", 0), ("rlloop-100m", 1)]
TARGETS = {  # (op, model) -> (min ratio vs Python, min fraction of matmul peak)
    ("forward_backward", "rlloop-small"): (1.2, None),
    ("forward_backward", "rlloop-100m"): (1.1, 0.5),
    ("sample", "rlloop-small"): (4.0, None),
    ("sample", "rlloop-100m"): (4.0, None),
    ("sample_bf16", "rlloop-small"): (4.0, None),
    ("sample_bf16", "rlloop-100m"): (4.0, None),
}
# op -> (bench_engine benchmark, reference.py --what, reference.py --dtype). sample_bf16 is rlloop's "bf16"
# sampling precision against Python sampling in bfloat16: the same precision on both sides.
OPS = [("forward_backward", "BM_ForwardBackward", "forward_backward", "float32"),
       ("sample", "BM_Sample", "sample", "float32"),
       ("sample_bf16", "BM_SampleBf16", "sample", "bfloat16")]


def load():
    return os.getloadavg()[0]


def run_cpp(bench, flt, env):
    out = subprocess.run([bench, f"--benchmark_filter={flt}", "--benchmark_format=json"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["benchmarks"]


def run_py(args, env):
    out = subprocess.run([sys.executable, os.path.join(HERE, "reference.py")] + args, env=env, check=True,
                         capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build-bench/bench/engine/bench_engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", choices=["all", "small", "100m"], default="all")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each measurement N times (C++ and Python alternating) and keep each side's best")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), RLLOOP_BENCH_THREADS=str(args.threads))
    started = time.time()
    print(f"threads {args.threads}, repeats {args.repeats}, load average at start {load():.2f}", flush=True)

    cpp_peak = max(b["GFLOPs"] for b in run_cpp(args.bench, "BM_MatmulPeak", env))
    py_peak = max(r["gflops"] for r in run_py(["--what", "matmul", "--threads", str(args.threads)], env)
                  if r["name"].startswith("matmul"))
    peak = max(cpp_peak, py_peak)
    print(f"fp32 matmul peak (2048^2 and 4096^2, best of 3): C++ {cpp_peak:.1f} GFLOP/s, "
          f"Python {py_peak:.1f} GFLOP/s; peak used below = {peak:.1f} GFLOP/s", flush=True)

    # The decoding step's product alone (16 rows x weights streamed from memory): no sampler can decode
    # rlloop-100m faster than this rate allows.
    decode = None
    if args.models in ("all", "100m"):
        decode = max(b["GFLOPs"] for b in run_cpp(args.bench, "BM_DecodeProduct/", env))
        print(f"decoding product alone (16 rows x [2048, 768] weights from memory): {decode:.1f} GFLOP/s "
              f"({decode / peak:.0%} of peak)", flush=True)
        bf16 = run_cpp(args.bench, "BM_DecodeProductBf16", env)[0]
        print(f"the same product on bf16-rounded operands ({bf16.get('label', '')}): {bf16['GFLOPs']:.1f} GFLOP/s",
              flush=True)

    rows = []
    for op, bm, py_what, py_dtype in OPS:
        for model, idx in MODELS:
            if args.models != "all" and not model.endswith(args.models):
                continue
            l0 = load()
            short = model.split("-")[1]
            c = p = None
            for _ in range(args.repeats):  # alternate, keep each side's best run
                ci = run_cpp(args.bench, f"{bm}/{idx}/", env)[0]
                pi = [r for r in run_py(["--what", py_what, "--only", short, "--threads", str(args.threads),
                                         "--dtype", py_dtype], env)
                      if r["name"] == f"{py_what}/{model}"][0]
                c = ci if c is None or ci["tokens_per_s"] > c["tokens_per_s"] else c
                p = pi if p is None or pi["tokens_per_s"] > p["tokens_per_s"] else p
            row = dict(op=op, model=model, shape=c.get("label", "").split(" ")[-1],
                       cpp_tok_s=c["tokens_per_s"], py_tok_s=p["tokens_per_s"],
                       cpp_gflops=c["GFLOPs"], py_gflops=p["gflops"], load=(l0 + load()) / 2)
            row["ratio"] = row["cpp_tok_s"] / row["py_tok_s"]
            rows.append(row)
            print(f"  {op} {model}: rlloop {row['cpp_tok_s']:.0f} tok/s, python {row['py_tok_s']:.0f} tok/s, "
                  f"ratio {row['ratio']:.2f}x (load {row['load']:.1f})", flush=True)

    print()
    print("| op | model | shape | rlloop tok/s | Python tok/s | ratio | rlloop GFLOP/s (% peak) | "
          "Python GFLOP/s (% peak) | target | met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        want_ratio, want_peak = TARGETS[(r["op"], r["model"])]
        frac_c, frac_p = r["cpp_gflops"] / peak, r["py_gflops"] / peak
        met = r["ratio"] >= want_ratio and (want_peak is None or frac_c >= want_peak)
        target = f">= {want_ratio}x" + (f", >= {want_peak:.0%} peak" if want_peak else "")
        print(f"| {r['op']} | {r['model']} | {r['shape']} | {r['cpp_tok_s']:.0f} | {r['py_tok_s']:.0f} | "
              f"{r['ratio']:.2f}x | {r['cpp_gflops']:.1f} ({frac_c:.0%}) | {r['py_gflops']:.1f} ({frac_p:.0%}) | "
              f"{target} | {'yes' if met else 'no'} |")
    fp32 = {r["model"]: r for r in rows if r["op"] == "sample"}
    for r in rows:  # bf16 sampling against Python's fp32 sampling (the CPU default), for the record
        if r["op"] == "sample_bf16" and r["model"] in fp32:
            print(f"\nsample_bf16 {r['model']}: {r['cpp_tok_s'] / fp32[r['model']]['py_tok_s']:.2f}x Python's float32 "
                  f"sampling ({fp32[r['model']]['py_tok_s']:.0f} tok/s), {r['cpp_tok_s'] / fp32[r['model']]['cpp_tok_s']:.2f}x "
                  f"rlloop's fp32 sampling")
    for r in rows:  # what an unmet ratio would take, in the same run's units
        want_ratio, _ = TARGETS[(r["op"], r["model"])]
        if r["ratio"] >= want_ratio:
            continue
        flop_per_token = r["cpp_gflops"] / r["cpp_tok_s"]
        need = want_ratio * r["py_tok_s"] * flop_per_token
        line = (f"\n{r['op']} {r['model']}: {want_ratio}x Python is {want_ratio * r['py_tok_s']:.0f} tok/s = "
                f"{need:.1f} GFLOP/s = {need / peak:.0%} of the matmul peak")
        if r["op"] == "sample" and r["model"] == "rlloop-100m" and decode:  # the fp32 product's cap
            line += (f"; the decoding product alone allows at most {decode / flop_per_token:.0f} tok/s "
                     f"({decode / flop_per_token / r['py_tok_s']:.2f}x Python)")
        print(line)
    print(f"\nmatmul peak {peak:.1f} GFLOP/s; load average {load():.2f} at the end; total {time.time() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
