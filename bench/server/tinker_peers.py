#!/usr/bin/env python3
"""One plain Tinker loop timed against `rlloop serve` and against skyrl-tx 0.3.0, in one run on the same cores.

  third_party/skyrl-venv/bin/python bench/server/tinker_peers.py RLLOOP [--steps N] [--prompts N] [--samples N]
                                                                 [--max-tokens N] [--only rlloop|skyrl]

The loop, through the tinker 0.12.0 SDK (the protocol generation skyrl-tx serves; rlloop serves it too), on
SmolLM2-135M-Instruct as a Hugging Face directory (both servers load the same fp32 weights, LoRA rank 8), fixed
sizes: save the weights for a sampler and sample --samples completions of --max-tokens tokens for each of --prompts
prompts (temperature 1, no stop), reward each completion (the share of its tokens with an even id: a fixed function,
so both servers train on the same kind of signal), then forward_backward with importance_sampling over every
completion (advantages: reward minus its prompt's mean) and optim_step. Step 1 is a warm-up (skyrl-tx compiles its
JAX functions there) and is not counted; the table shows each phase's median over the other steps, in seconds, and
the median of each step's tokens/s (sampled tokens for sampling, prompt + completion tokens for forward_backward).

Set-up, once (bench/README.md, "Tinker peers"): `scripts/setup.sh --tests` (the project
venv), then `bench/server/tinker_peers_setup.sh`, which makes third_party/skyrl-venv (skyrl-tx 0.3.0 without its
CUDA extra: jax, flax, optax for the CPU, tinker 0.12.0; torch and peft's other imports from the project venv through
a .pth) and build/peers/SmolLM2-135M-Instruct (the GGUF's weights dequantized to fp32, by transformers).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "aws"))
os.environ["TINKER_TELEMETRY"] = "0"
import tinker  # noqa: E402
import transformers  # noqa: E402
from tinker import types  # noqa: E402

import rlloop_serve  # noqa: E402

MODEL = os.path.join(ROOT, "build", "peers", "SmolLM2-135M-Instruct")
KEY = "tml-rlloop-peers"
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count from 1 to 5.", "Say hello in French.", "What is the capital of"
           " Italy?", "Write a word that rhymes with cat.", "What is 10 - 4?", "Name a planet."]


def reward(tokens):
    return sum(1 for t in tokens if t % 2 == 0) / max(len(tokens), 1)


def run_loop(endpoint, args):
    service = tinker.ServiceClient(base_url=endpoint, api_key=KEY)
    training = service.create_lora_training_client(MODEL, rank=8, seed=1)
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7)
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True) for text in PROMPTS[:args.prompts]]
    phases = {"sample": [], "forward_backward": [], "optim_step": [], "step": [], "sampled_tok_s": [],
              "trained_tok_s": []}
    for step in range(args.steps + 1):
        start = time.time()
        sampler = training.save_weights_and_get_sampling_client()
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.samples, params) for p in prompts]
        results = [f.result() for f in futures]
        sampled = time.time()
        data = []
        for prompt, result in zip(prompts, results):
            rewards = [reward(s.tokens) for s in result.sequences]
            mean = sum(rewards) / len(rewards)
            for s, r in zip(result.sequences, rewards):
                tokens = prompt + list(s.tokens)
                n = len(tokens) - 1
                prompt_part = len(prompt) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": [0.0] * prompt_part + list(s.logprobs),
                                    "advantages": [0.0] * prompt_part + [r - mean] * (n - prompt_part)}))
        training.forward_backward(data, "importance_sampling").result()
        trained = time.time()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        stepped = time.time()
        if step == 0:
            print(f"  warm-up step: {stepped - start:.1f} s", file=sys.stderr)
            continue
        phases["sample"].append(sampled - start)
        phases["forward_backward"].append(trained - sampled)
        phases["optim_step"].append(stepped - trained)
        phases["step"].append(stepped - start)
        phases["sampled_tok_s"].append(sum(len(s.tokens) for r in results for s in r.sequences) / (sampled - start))
        phases["trained_tok_s"].append(sum(d.model_input.length + 1 for d in data) / (trained - sampled))
    return {k: statistics.median(v) for k, v in phases.items()}


def rlloop_endpoint(rlloop, threads):
    """`rlloop serve` serving MODEL under its own path (the name the loop asks for), on `threads` threads."""
    directory = tempfile.mkdtemp(prefix="rlloop-peers-")
    tenants = rlloop_serve.write_tenants(directory, bearer_keys={"peers": [KEY]})
    return rlloop_serve.Server(rlloop, argv=[rlloop, "serve", "--tenants", tenants, "--port", "0", "--data-dir",
                                             os.path.join(directory, "data"), "--device", "cpu", "--threads",
                                             str(threads), "--base-model", f"{MODEL}={MODEL}"])


# skyrl-tx's JAX backend sized for a 24 GiB CPU machine: with its defaults (32 adapter slots of rank 32, the whole
# batch in one pass) its engine took 23.6 GB and was killed by the OOM killer at the first forward_backward.
SKYRL_BACKEND = {"max_lora_adapters": 2, "max_lora_rank": 8, "train_micro_batch_size": 4,
                 "sample_max_num_sequences": 16}


def exit_if_dead(proc, what, stopping):
    """A thread that ends this process when `proc` dies before `stopping` is set: the SDK would otherwise wait on
    its futures for ever."""
    def watch():
        code = proc.wait()
        if not stopping.is_set():
            print(f"tinker_peers: {what} exited with {code}", file=sys.stderr)
            os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


class SkyrlServer:
    """skyrl-tx's API server (which starts its engine process) on a free port, its database and checkpoints in a
    temporary directory."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="skyrl-peers-")
        with socket.socket() as s:  # a free port, released for the server to take
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        venv_bin = os.path.dirname(sys.executable)
        env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ["PATH"], JAX_PLATFORMS="cpu")
        self.log = open(os.path.join(self.dir, "log.txt"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tx.tinker.api", "--base-model", MODEL, "--port", str(self.port),
             "--database-url", f"sqlite:///{self.dir}/tinker.db", "--checkpoints-base", f"{self.dir}/ckpt",
             "--backend-config", json.dumps(SKYRL_BACKEND)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while "Starting background engine" not in open(os.path.join(self.dir, "log.txt")).read():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("skyrl-tx did not start:\n" + open(os.path.join(self.dir, "log.txt")).read())
            time.sleep(0.5)
        self.stopping = threading.Event()
        exit_if_dead(self.proc, "skyrl-tx's API server (its log: " + os.path.join(self.dir, "log.txt") + ")",
                     self.stopping)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        os.killpg(self.proc.pid, 9)
        self.proc.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("rlloop")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--only", choices=["rlloop", "skyrl"])
    args = p.parse_args()
    if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
        sys.exit(f"tinker_peers: {MODEL} is missing (bench/server/tinker_peers_setup.sh makes it)")
    rows = []
    for name, make in (("rlloop", lambda: rlloop_endpoint(args.rlloop, args.threads)), ("skyrl-tx 0.3.0", SkyrlServer)):
        if args.only and not name.startswith(args.only):
            continue
        print(f"{name}:", file=sys.stderr)
        with make() as server:
            rows.append((name, run_loop(server.endpoint, args)))
    print(f"| server | sample s (tok/s) | forward_backward s (tok/s) | optim_step s | step s |")
    print("|---|---|---|---|---|")
    for name, m in rows:
        print(f"| {name} | {m['sample']:.2f} ({m['sampled_tok_s']:.0f}) | {m['forward_backward']:.2f} "
              f"({m['trained_tok_s']:.0f}) | {m['optim_step']:.2f} | {m['step']:.2f} |")


if __name__ == "__main__":
    main()
