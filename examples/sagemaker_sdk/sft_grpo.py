#!/usr/bin/env python3
"""SFT, then GRPO, on synthetic arithmetic, written against the SageMaker Python SDK's training-session clients
(`sagemaker-train`, module `sagemaker.train.training_session`: ServiceClient -> TrainingClient -> SamplingClient)
and run against `rlloop serve`. Only the endpoint and the credentials differ from a run against AWS.

    third_party/venv/bin/python examples/sagemaker_sdk/sft_grpo.py            # starts its own `rlloop serve`
    third_party/venv/bin/python examples/sagemaker_sdk/sft_grpo.py --endpoint http://127.0.0.1:8765 \
        --access-key AKID... --secret-key ...                                    # a server already running

The model is the built-in `rlloop-small` (byte-level, randomly initialised), trained through a LoRA adapter, the
only kind of session the training-session API has. The task is single-digit addition in GSM8K answer format
(`3+4=` -> `#### 7`, then end-of-text); the reward is 1 for the right number after `####`, else 0.
Standard library + the SDK only; tokenization is done here (byte ids 0..255, end-of-text 256).
"""

import argparse
import os
import random
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# ---------------------------------------------------------------------------------------------------------------
# Byte-level tokenizer of the built-in models (include/rlloop/tokenizer.hpp, byte_tokens): a byte is its own id.

EOS = 256  # endoftext; 257 im_start, 258 im_end, 259 pad; vocab 260


def encode(text):
    return list(text.encode("utf-8"))


def decode(tokens):
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic task (envs/arithmetic.hpp, in Python): prompts "a+b=", answers "#### N". A problem's split is
# a hash of its text (the same FNV-1a fold as the C++), so train and held-out problems never overlap.

TRAIN, HELD_OUT = "train", "held_out"
MASK64 = (1 << 64) - 1


def split_of(expression, held_out_fraction):
    h = 1469598103934665603
    for c in expression.encode():
        h = ((h ^ c) * 1099511628211) & MASK64
    h ^= h >> 29
    return HELD_OUT if (h % 1000003) < held_out_fraction * 1000003.0 else TRAIN


class Problem:
    def __init__(self, prompt, answer):
        self.prompt = prompt          # "3+4="
        self.answer = answer          # "7"
        self.target = "#### " + answer  # the completion that earns the reward

    def __repr__(self):
        return f"Problem({self.prompt!r}, {self.answer!r})"


class ArithmeticTask:
    """Sums of `operands` numbers of 1..`digits` digits (difficulty 1 of the C++ task: digits=1, operands=2)."""

    def __init__(self, digits=1, operands=2, held_out_fraction=0.1, seed=0):
        self.digits, self.operands, self.held_out_fraction = digits, operands, held_out_fraction
        self.rng = random.Random(seed)

    def draw(self):
        terms = [self.rng.randrange(10 ** self.digits) for _ in range(self.operands)]
        return Problem("+".join(map(str, terms)) + "=", str(sum(terms)))

    def next(self, split):
        for _ in range(100000):
            p = self.draw()
            if split_of(p.prompt, self.held_out_fraction) == split:
                return p
        raise ValueError("no problem of this split in the problem space")

    def sample(self, n, split):
        return [self.next(split) for _ in range(n)]

    def all_problems(self, split):
        """Every distinct problem of a split (for the small problem spaces only)."""
        out = []
        for i in range(10 ** (self.digits * self.operands)):
            terms = [(i // 10 ** (self.digits * k)) % 10 ** self.digits for k in range(self.operands)]
            p = Problem("+".join(map(str, terms)) + "=", str(sum(terms)))
            if split_of(p.prompt, self.held_out_fraction) == split:
                out.append(p)
        return out


ANSWER = re.compile(r"####\s*(-?\d+)")


def reward(completion, answer):
    """1 when the number after the last "####" is the answer (rewards/math.hpp, in short), else 0."""
    found = ANSWER.findall(completion)
    return 1.0 if found and found[-1] == answer else 0.0


# ---------------------------------------------------------------------------------------------------------------
# Connecting the SDK to a server: the endpoints and the credentials come from the environment, as for AWS.

def configure_environment(endpoint, access_key, secret_key, region="us-west-2"):
    """Points the SDK (and any boto3 client it builds) at `endpoint`, signed with these SigV4 keys."""
    for var in ("SAGEMAKER_TRAINING_SESSION_ENDPOINT", "SAGEMAKER_TRAINING_SESSION_RUNTIME_ENDPOINT",
                "AWS_ENDPOINT_URL_SAGEMAKER", "AWS_ENDPOINT_URL_SAGEMAKERTRAININGSESSIONRUNTIME"):
        os.environ[var] = endpoint
    os.environ["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"] = region
    os.environ["AWS_ACCESS_KEY_ID"] = access_key
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret_key
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(var, None)


def hub_model_arn(model, region="us-west-2"):
    return f"arn:aws:sagemaker:{region}:aws:hub-content/SageMakerPublicHub/Model/{model}/1.0.0"


def service_client(account, role_arn, region="us-west-2", group="rlloop-demo"):
    """A ServiceClient whose defaults need no call outside the training-session API: an explicit model package
    group (else CreateModelPackageGroup) and S3 output path (else STS GetCallerIdentity + S3 CreateBucket)."""
    from sagemaker.train.training_session import ServiceClient

    return ServiceClient(
        region=region,
        role_arn=role_arn,
        model_package_group_arn=f"arn:aws:sagemaker:{region}:{account}:model-package-group/{group}",
        s3_output_path=f"s3://rlloop-demo-{account}/sft_grpo/",
    )


def find_rlloop():
    for path in (os.environ.get("RLLOOP", ""), os.path.join(ROOT, "build", "bin", "rlloop"),
                 os.path.join(ROOT, "build", "src", "cli", "rlloop")):
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("sft_grpo: no rlloop binary (build it, or pass --rlloop / set RLLOOP)")


def start_server(rlloop, result_wait_ms=1500, extra_args=()):
    """`rlloop serve` on a free port with one SigV4 tenant (tests/aws/rlloop_serve.py); `extra_args` go to serve."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "aws"))
    import rlloop_serve

    # The SDK polls an operation right away and then every 2 s: waiting on the server for up to 1.5 s makes the
    # first poll answer, so a 30 ms training step costs 30 ms, not 2 s.
    return rlloop_serve.Server(rlloop, max_sessions=4,
                               extra_args=("--result-wait-ms", str(result_wait_ms), *extra_args))


# ---------------------------------------------------------------------------------------------------------------
# Data: a datum is the sequence without its last token; target_tokens is the sequence shifted by one; the
# per-token loss inputs (weights, logprobs, advantages) are aligned with the targets, 0 on the prompt.

def completion_datum(prompt_ids, completion_ids, **per_completion_token):
    """A Datum training `completion_ids` after `prompt_ids`. Each keyword gives one value per completion token
    (e.g. logprobs=[...]) or a scalar for all of them (advantages=0.5); prompt positions get 0."""
    from sagemaker.train.training_session import Datum, ModelInput

    full = prompt_ids + completion_ids
    n_prompt = len(prompt_ids) - 1  # targets that are still prompt tokens
    inputs = {"target_tokens": full[1:], "weights": [0.0] * n_prompt + [1.0] * len(completion_ids)}
    for key, value in per_completion_token.items():
        values = list(value) if isinstance(value, (list, tuple)) else [float(value)] * len(completion_ids)
        assert len(values) == len(completion_ids), key
        inputs[key] = [0.0] * n_prompt + [float(v) for v in values]
    return Datum(model_input=ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def sft_datum(problem):
    return completion_datum(encode(problem.prompt), encode(problem.target) + [EOS])


def loss_sum(fb_output):
    """The summed loss of a forward_backward (rlloop reports it as the metric "loss:sum")."""
    metrics = fb_output.metrics
    if "loss:sum" not in metrics:
        raise KeyError(f"no loss:sum in the forward_backward metrics {sorted(metrics)}")
    return float(metrics["loss:sum"])


# ---------------------------------------------------------------------------------------------------------------
# The loop.

def sft(tc, task, steps, batch, lr, log=print, every=10):
    """SFT on fresh correct worked examples of the training split ("3+4=" -> "#### 7" + end-of-text): one
    forward_backward + optim_step per batch. Returns the loss per completion token of each step."""
    from sagemaker.train.training_session import AdamParams

    losses = []
    for step in range(1, steps + 1):
        data = [sft_datum(p) for p in task.sample(batch, TRAIN)]
        tokens = sum(sum(d.loss_fn_inputs["weights"]) for d in data)
        fb = tc.forward_backward(data, loss_fn="cross_entropy")
        opt = tc.optim_step(AdamParams(learning_rate=lr, beta2=0.99, weight_decay=0.0))  # queued behind fb
        losses.append(loss_sum(fb.result()) / tokens)
        opt.result()
        if log and (step % every == 0 or step == steps or step == 1):
            log(f"sft   step {step:3d}/{steps}  loss/token {losses[-1]:.3f}")
    return losses


def sampling_params(temperature, seed=None, top_k=None):
    from sagemaker.train.training_session import SamplingParams

    # The runtime's model makes 512 the least maxTokens (botocore refuses less). The model ends its answer with
    # end-of-text after SFT; the "\n" stop sequence bounds a rambling one.
    return SamplingParams(max_tokens=512, temperature=temperature, top_k=top_k, seed=seed, stop=["\n"])


def sample_all(sc, problems, num_samples, temperature, seed=None, top_k=None):
    """One sample operation per problem, all in flight at once; returns each problem's SampledSequences."""
    futures = [sc.sample(encode(p.prompt), num_samples=num_samples,
                         sampling_params=sampling_params(temperature, None if seed is None else seed + i, top_k))
               for i, p in enumerate(problems)]
    return [f.result().sequences for f in futures]


def evaluate(sc, problems):
    """Greedy accuracy on `problems`; returns (accuracy, completions, stop reasons)."""
    seqs = [s[0] for s in sample_all(sc, problems, 1, temperature=0.0)]
    texts = [decode(s.tokens) for s in seqs]
    acc = statistics.mean(reward(t, p.answer) for t, p in zip(texts, problems))
    return acc, texts, [s.stop_reason.value for s in seqs]


class GrpoOptions:
    """GRPO settings. Sampling is at a low temperature within the top 4 tokens: the LoRA adapter cannot scale
    the frozen random tied embedding of rlloop-small, so the model's own (temperature 1) distribution stays
    nearly flat even when its most likely answer is right (README: "Why these settings")."""

    def __init__(self, problems=16, group_size=8, temperature=0.3, top_k=4, lr=5e-5):
        self.problems, self.group_size, self.temperature, self.top_k, self.lr = (
            problems, group_size, temperature, top_k, lr)


def sampled_reward(sc, problems, o, samples=4, seed=7):
    """Mean reward of `samples` completions per problem drawn as GRPO draws them (fixed seeds, so before and
    after are measured alike)."""
    groups = sample_all(sc, problems, samples, o.temperature, seed, o.top_k)
    return statistics.mean(reward(decode(s.tokens), p.answer) for p, g in zip(problems, groups) for s in g)


def grpo_step(tc, sc, problems, o, seed):
    """One GRPO step: `o.group_size` samples per problem from `sc` (the current weights), reward, advantages
    centred in each group, the importance_sampling loss with the sampler's logprobs, one optim_step."""
    from sagemaker.train.training_session import AdamParams

    groups = sample_all(sc, problems, o.group_size, o.temperature, seed, o.top_k)
    data, rewards, stops = [], [], []
    for p, seqs in zip(problems, groups):
        rs = [reward(decode(s.tokens), p.answer) for s in seqs]
        rewards += rs
        stops += [s.stop_reason.value for s in seqs]
        mean = statistics.mean(rs)
        if all(r == mean for r in rs):
            continue  # equal rewards: no advantage, nothing to learn from this group
        for s, r in zip(seqs, rs):
            if s.tokens:
                data.append(completion_datum(encode(p.prompt), list(s.tokens), logprobs=s.logprobs,
                                             advantages=r - mean))
    stats = {"reward": statistics.mean(rewards), "datums": len(data), "stop_reasons": stops}
    if data:
        fb = tc.forward_backward(data, loss_fn="importance_sampling")
        opt = tc.optim_step(AdamParams(learning_rate=o.lr, beta2=0.99, weight_decay=0.0))
        stats["loss"] = loss_sum(fb.result())
        opt.result()
    return stats


def grpo(tc, sc, task, steps, o, seed=1, log=print, on_eval=None, eval_every=10):
    """`steps` GRPO steps on fresh training problems, each sampled from the weights the previous step saved
    (save_weights_and_get_sampling_client). Returns (the last sampling client, per-step stats)."""
    history = []
    for step in range(1, steps + 1):
        st = grpo_step(tc, sc, task.sample(o.problems, TRAIN), o, seed=seed * 100000 + step * 100)
        sc = tc.save_weights_and_get_sampling_client()
        history.append(st)
        if log:
            extra = on_eval(sc) if on_eval and step % eval_every == 0 else ""
            log(f"grpo  step {step:3d}/{steps}  reward {st['reward']:.3f}  datums {st['datums']:3d}{extra}")
    return sc, history


def run(endpoint, access_key, secret_key, account, role_arn, *, model="rlloop-small", rank=32, alpha=64,
        sft_steps=200, sft_batch=32, sft_lr=1e-3, grpo_steps=30, grpo_options=None, seed=1,
        log=print):
    """The whole demo; returns a dict of what it measured."""
    o = grpo_options or GrpoOptions()
    configure_environment(endpoint, access_key, secret_key)
    t0 = time.time()
    svc = service_client(account, role_arn)
    train_set = ArithmeticTask().all_problems(TRAIN)
    held_out = ArithmeticTask().all_problems(HELD_OUT)
    out = {"held_out": held_out}

    def measure(sc, tag):
        acc_train, _, _ = evaluate(sc, train_set)
        acc_held, texts, stops = evaluate(sc, held_out)
        r = sampled_reward(sc, train_set, o)
        out[tag] = {"train_accuracy": acc_train, "held_out_accuracy": acc_held, "reward": r, "texts": texts,
                    "stop_reasons": stops}
        return (f"greedy accuracy {acc_train:.3f} on the {len(train_set)} training problems, {acc_held:.3f} on the "
                f"{len(held_out)} held-out ones; mean sampled reward {r:.3f}")

    with svc.create_lora_training_client(hub_model_arn(model), rank=rank, alpha=alpha) as tc:
        log(f"session {tc.training_session_name} Running after {time.time() - t0:.1f} s: {model} + LoRA rank {rank}, "
            f"alpha {alpha}")
        base = tc.create_sampling_client()  # "" = the base model
        seq = base.sample(encode(held_out[0].prompt), 1, sampling_params(0.0)).result().sequences[0]
        log(f"base model, greedy: {held_out[0].prompt}{decode(seq.tokens)[:40]!r}... ({len(seq.tokens)} tokens, "
            f"stopReason {seq.stop_reason.value})")

        out["sft_losses"] = sft(tc, ArithmeticTask(seed=seed), sft_steps, sft_batch, sft_lr, log=log, every=20)
        sc = tc.save_weights_and_get_sampling_client()
        out["sft_arn"] = sc.model_package_arn
        log(f"SFT weights saved as {sc.model_package_arn}")
        log("after SFT:  " + measure(sc, "before"))

        sc, history = grpo(tc, sc, ArithmeticTask(seed=seed + 2000), grpo_steps, o, seed, log=log,
                           on_eval=lambda sc: f"  greedy accuracy {evaluate(sc, train_set)[0]:.3f} (training problems)")
        out["grpo"] = history
        out["final_arn"] = sc.model_package_arn
        log(f"GRPO weights saved as {sc.model_package_arn}")
        log("after GRPO: " + measure(sc, "after"))
    out["seconds"] = time.time() - t0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", help="a running `rlloop serve` (default: start one)")
    ap.add_argument("--access-key", help="SigV4 access key id of a tenant of that server")
    ap.add_argument("--secret-key", help="its secret access key")
    ap.add_argument("--account", default="111122223333", help="the tenant's account id")
    ap.add_argument("--role-arn", help="RoleArn to send (default arn:aws:iam::ACCOUNT:role/rlloop-demo)")
    ap.add_argument("--rlloop", help="rlloop binary for the server this starts (default build/bin/rlloop)")
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--grpo-lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    server = None
    if a.endpoint is None:
        server = start_server(a.rlloop or find_rlloop())
        import rlloop_serve
        endpoint, key, secret = server.endpoint, rlloop_serve.ACCESS_KEY, rlloop_serve.SECRET_KEY
        account, role = rlloop_serve.ACCOUNT, rlloop_serve.ROLE_ARN
        print(f"rlloop serve at {endpoint}")
    else:
        endpoint, key, secret, account = a.endpoint, a.access_key, a.secret_key, a.account
        role = a.role_arn or f"arn:aws:iam::{account}:role/rlloop-demo"
        if not key or not secret:
            raise SystemExit("sft_grpo: --endpoint needs --access-key and --secret-key")
    try:
        r = run(endpoint, key, secret, account, role, sft_steps=a.sft_steps, grpo_steps=a.grpo_steps, grpo_options=GrpoOptions(lr=a.grpo_lr), seed=a.seed)
    finally:
        if server:
            server.stop()
    b, f = r["before"], r["after"]
    rewards = [h["reward"] for h in r["grpo"]]
    k = max(1, min(5, len(rewards) // 2))
    print(f"SFT loss per token: {r['sft_losses'][0]:.3f} -> {r['sft_losses'][-1]:.3f}")
    print(f"GRPO reward per step, mean of the first {k}: {statistics.mean(rewards[:k]):.3f}, "
          f"of the last {k}: {statistics.mean(rewards[-k:]):.3f}")
    print(f"mean sampled reward (training problems): {b['reward']:.3f} -> {f['reward']:.3f}")
    print(f"greedy accuracy, training problems: {b['train_accuracy']:.3f} -> {f['train_accuracy']:.3f}")
    print(f"greedy accuracy, held-out problems: {b['held_out_accuracy']:.3f} -> {f['held_out_accuracy']:.3f}")
    for p, t0, t1 in list(zip(r["held_out"], b["texts"], f["texts"]))[:4]:
        print(f"  {p.prompt:5} after SFT {t0!r:10} after GRPO {t1!r:10} (expected {p.answer})")
    print(f"time: {r['seconds']:.0f} s")


if __name__ == "__main__":
    main()
