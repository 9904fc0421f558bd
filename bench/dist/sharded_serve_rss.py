#!/usr/bin/env python3
"""Resident memory of `rlloop serve --world-size 2 --shard full` ranks against `--world-size 1`, through the wire.

  sharded_serve_rss.py RLLOOP [--model rlloop-100m] [--rank 8]

Each server gets one Tinker LoRA training client on the model (its base is what a `--shard full` group shards: each
rank keeps half of it), then VmHWM (the peak so far) of every rank's process is read from /proc; then one
forward_backward of 8 sequences of 64 tokens and an optim_step, and VmRSS and VmHWM again. Prints one line per
rank. (tinker 0.38.0 and the test helper tests/aws/rlloop_serve.py from third_party/venv.)
"""
import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "aws"))
os.environ["TINKER_TELEMETRY"] = "0"
import tinker  # noqa: E402
from tinker import types  # noqa: E402

import rlloop_serve  # noqa: E402

KEY = "tml-rlloop-rss"


def memory_mib(pid):
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def worker_pids(parent):
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def measure(rlloop, model, rank, extra):
    with rlloop_serve.Server(rlloop, extra_args=extra, bearer_keys={"aws": [KEY]}) as server:
        service = tinker.ServiceClient(base_url=server.endpoint, api_key=KEY)
        training = service.create_lora_training_client(model, rank=rank, seed=1).result()
        ranks = [server.proc.pid] + worker_pids(server.proc.pid)
        opened = [memory_mib(pid)["VmHWM"] for pid in ranks]  # the peak of starting and opening the session
        data = [types.Datum(model_input=types.ModelInput.from_ints([(7 * i + j) % 250 + 1 for j in range(64)]),
                            loss_fn_inputs={"target_tokens": [(7 * i + j + 1) % 250 + 1 for j in range(64)],
                                            "weights": [1.0] * 64}) for i in range(8)]
        start = time.time()
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        seconds = time.time() - start
        return [(r, opened[r], memory_mib(pid)) for r, pid in enumerate(ranks)], seconds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rlloop")
    p.add_argument("--model", default="rlloop-100m")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    for label, extra in (("--world-size 1", ()), ("--world-size 2 --shard full", ("--world-size", "2", "--shard",
                                                                                   "full"))):
        ranks, seconds = measure(args.rlloop, args.model, args.rank, extra)
        for r, opened, m in ranks:
            print(f"{label:28s} rank {r}: peak VmHWM once open {opened:6.0f} MiB; after a step VmRSS "
                  f"{m['VmRSS']:6.0f} MiB, peak VmHWM {m['VmHWM']:6.0f} MiB (step {seconds:.1f} s)")


if __name__ == "__main__":
    main()
