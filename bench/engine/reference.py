#!/usr/bin/python3
"""Eager-PyTorch reference for bench_engine: the same Llama-style decoder, batch shapes and steps, written the
way one would write it in plain PyTorch (nn.Module, nn.Linear, F.cross_entropy, a torch.cat KV cache).

Run with Debian's PyTorch: /usr/bin/python3 bench/engine/reference.py [--threads 2] [--only small|100m]
Prints one JSON object per measurement on stdout (the driver compare.py collects them).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Same configs as src/engine/model/builtin_models.cpp (byte_level(...)).
CONFIGS = {
    "rlloop-small": dict(vocab=260, hidden=128, layers=4, heads=4, kv_heads=4, inter=384),
    "rlloop-100m": dict(vocab=32000, hidden=768, layers=12, heads=12, kv_heads=12, inter=2048),
}
FB_SHAPES = {"rlloop-small": (64, 32), "rlloop-100m": (8, 256)}  # (batch, tokens)
FB_ITERS = {"rlloop-small": 4, "rlloop-100m": 1}
SAMPLE_ITERS = {"rlloop-small": 3, "rlloop-100m": 1}
SAMPLES, NEW_TOKENS, PROMPT_TOKENS = 16, 128, 16
ROPE_THETA, EPS, MAX_POS = 10000.0, 1e-5, 1024


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads = c["heads"], c["kv_heads"]
        self.head_dim = c["hidden"] // c["heads"]
        self.q_proj = nn.Linear(c["hidden"], self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c["hidden"], self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c["hidden"], self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c["hidden"], bias=False)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # no-op in fp32
        out = (probs @ v).transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden"], c["inter"], bias=False)
        self.up_proj = nn.Linear(c["hidden"], c["inter"], bias=False)
        self.down_proj = nn.Linear(c["inter"], c["hidden"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        head_dim = c["hidden"] // c["heads"]
        inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for name, p in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, caches=None):
        B, T = ids.shape
        past = caches[0]["k"].shape[2] if caches and "k" in caches[0] else 0
        cos, sin = self.cos[past:past + T], self.sin[past:past + T]
        mask = None
        if T > 1:
            mask = torch.full((T, past + T), float("-inf")).triu(past + 1)
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, caches[i] if caches is not None else None)
        return F.linear(self.norm(x), self.embed_tokens.weight)  # tied unembedding


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def emit(**kw):
    print(json.dumps(kw), flush=True)


def bench_matmul(n, iters=3):
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2.0 * n ** 3 / (time.perf_counter() - t0))
    emit(name=f"matmul/{n}", gflops=best / 1e9)
    return best


def bench_forward_backward(name, model, gen):
    B, T = FB_SHAPES[name]
    V = CONFIGS[name]["vocab"]
    seq = torch.randint(0, 256, (B, T + 1), generator=gen)
    ids, targets = seq[:, :-1], seq[:, 1:]

    def step():
        logits = model(ids)
        loss = F.cross_entropy(logits.view(-1, V), targets.reshape(-1), reduction="sum")
        loss.backward()
        return loss.item()

    step()  # warm-up
    iters = FB_ITERS[name]
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    seconds = time.perf_counter() - t0
    tokens = B * T * iters
    emit(name=f"forward_backward/{name}", seconds=seconds / iters, tokens_per_s=tokens / seconds,
         gflops=6.0 * n_params(model) * tokens / seconds / 1e9)


@torch.inference_mode()
def generate(model, prompt, gen):
    caches = [{} for _ in model.layers]
    logits = model(prompt.unsqueeze(0), caches)[:, -1]  # prefill once
    for c in caches:  # then SAMPLES copies of the prompt's cache
        c["k"] = c["k"].expand(SAMPLES, -1, -1, -1)
        c["v"] = c["v"].expand(SAMPLES, -1, -1, -1)
    logits = logits.expand(SAMPLES, -1)
    out, logprobs = [], []
    for i in range(NEW_TOKENS):
        logp = F.log_softmax(logits.float(), dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        out.append(nxt)
        logprobs.append(logp.gather(-1, nxt))
        if i + 1 < NEW_TOKENS:
            logits = model(nxt, caches)[:, -1]
    return torch.cat(out, 1), torch.cat(logprobs, 1)


def bench_sample(name, model, gen):
    prompt = torch.randint(0, 256, (PROMPT_TOKENS,), generator=gen)
    generate(model, prompt, gen)  # warm-up
    iters = SAMPLE_ITERS[name]
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(iters):
        toks, _ = generate(model, prompt, gen)
        tokens += toks.numel()
    seconds = time.perf_counter() - t0
    emit(name=f"sample/{name}", dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
         seconds=seconds / iters, tokens_per_s=tokens / seconds,
         gflops=2.0 * n_params(model) * tokens / seconds / 1e9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--only", choices=["small", "100m"])
    ap.add_argument("--what", choices=["all", "matmul", "forward_backward", "sample"], default="all")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="sampling precision (the model is converted with .to(); forward_backward stays float32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    emit(name="info", torch=torch.__version__, threads=torch.get_num_threads())
    if args.what in ("all", "matmul"):
        bench_matmul(2048)
        bench_matmul(4096)
    if args.what == "matmul":
        return
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for name in CONFIGS:
        if args.only and not name.endswith(args.only):
            continue
        model = Decoder(CONFIGS[name])
        emit(name=f"params/{name}", params=n_params(model))
        if args.what in ("all", "forward_backward"):
            bench_forward_backward(name, model, gen)
        if args.what in ("all", "sample"):
            bench_sample(name, model.to(getattr(torch, args.dtype)), gen)


if __name__ == "__main__":
    sys.exit(main())
