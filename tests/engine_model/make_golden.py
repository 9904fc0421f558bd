#!/usr/bin/python3
"""Golden logits for the engine's transformer, computed by an independent plain-PyTorch implementation of the
Hugging Face Llama / Qwen2 / Qwen3 forward pass (eager attention, written from the published architecture).

Weights are not stored: every tensor is generated from a counter-based integer hash of its HF name (splitmix64),
which the C++ test reproduces exactly (see hashed_weight() in engine_model_test.cpp).

Regenerate with:
    /usr/bin/python3 tests/engine_model/make_golden.py > tests/engine_model/golden_logits.json
"""
import json
import math
import sys

import torch

MASK64 = (1 << 64) - 1


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def hashed_weight(name, shape):
    """Element i = offset + 0.25 * (2u - 1), u = top 24 bits of splitmix64(fnv1a64(name) ^ i) / 2^24.
    Norm weights get offset 1 so they are not trivially ones."""
    salt = fnv1a64(name)
    offset = 1.0 if name.endswith("norm.weight") else 0.0
    n = math.prod(shape)
    vals = []
    for i in range(n):
        u = (splitmix64(salt ^ i) >> 40) / float(1 << 24)
        vals.append(offset + 0.25 * (2.0 * u - 1.0))
    return torch.tensor(vals, dtype=torch.float64).to(torch.float32).reshape(shape)


def weight_shapes(cfg):
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qwen2 = cfg["model_type"] == "qwen2"
    qkv_bias = cfg.get("attention_bias", qwen2)
    o_bias = qkv_bias and not qwen2
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nh * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * d)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * d,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * d,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * d,)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def rms_norm(x, w, eps):
    # LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm
    dtype = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return w * x.to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def forward(cfg, w, ids):
    T = len(ids)
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]
    qwen2 = cfg["model_type"] == "qwen2"
    qkv_bias = cfg.get("attention_bias", qwen2)
    o_bias = qkv_bias and not qwen2

    def lin(x, name, bias):
        return torch.nn.functional.linear(x, w[name + ".weight"], w[name + ".bias"] if bias else None)

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    pos = torch.arange(T, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, T, d]

    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)  # HF additive causal mask

    x = w["model.embed_tokens.weight"][torch.tensor(ids)][None]  # [1, T, h]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        r = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(r, p + "self_attn.q_proj", qkv_bias).view(1, T, nh, d)
        k = lin(r, p + "self_attn.k_proj", qkv_bias).view(1, T, nkv, d)
        v = lin(r, p + "self_attn.v_proj", qkv_bias).view(1, T, nkv, d).transpose(1, 2)
        if cfg["model_type"] == "qwen3":
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(nh // nkv, dim=1)  # repeat_kv: query head j uses kv head j // (nh / nkv)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5 + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attn = torch.matmul(probs, v).transpose(1, 2).reshape(1, T, nh * d)
        x = x + lin(attn, p + "self_attn.o_proj", o_bias)
        r = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = lin(r, p + "mlp.gate_proj", False)
        up = lin(r, p + "mlp.up_proj", False)
        x = x + lin(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj", False)
    x = rms_norm(x, w["model.norm.weight"], eps)
    unembed = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return torch.nn.functional.linear(x, unembed)[0]  # [T, V]


BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, hidden_act="silu")
CONFIGS = {
    "llama": dict(BASE, model_type="llama", tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama_bias": dict(BASE, model_type="llama", tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                       attention_bias=True),
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # head_dim 16 != hidden / heads = 8, as in real Qwen3 configs
    "qwen3": dict(BASE, model_type="qwen3", tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  head_dim=16, attention_bias=False),
}
TOKENS = [1, 5, 9, 63, 0, 17, 42, 7, 7, 30]


def main():
    torch.set_num_threads(1)
    out = {"tokens": TOKENS, "models": {}}
    for key, cfg in CONFIGS.items():
        w = {name: hashed_weight(name, shape) for name, shape in weight_shapes(cfg).items()}
        with torch.no_grad():
            logits = forward(cfg, w, TOKENS)
            logits64 = forward(cfg, {k: v.double() for k, v in w.items()}, TOKENS)
        print(f"{key}: |fp32 - fp64| max = {(logits.double() - logits64).abs().max().item():.2e}", file=sys.stderr)
        out["models"][key] = {"config": cfg, "logits": [[float(f"{v:.8g}") for v in row] for row in logits.tolist()]}
    json.dump(out, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
