#!/usr/bin/env python3
"""Tiny random-weight Llama / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss / Mistral / Gemma 2 models made by Hugging Face
`transformers`, random LoRA adapters made by `peft`, and the fp32 logits both compute for fixed token ids: the
reference rlloop's engine must match.

  make_models.py OUT_DIR [--seed N]

writes, for every entry of MODELS:
  OUT_DIR/<name>/         config.json + model.safetensors        (transformers' save_pretrained)
  OUT_DIR/<name>-lora/    adapter_config.json + adapter_model.safetensors   (peft's save_pretrained)
  OUT_DIR/<name>-merged/  the adapter merged into the base        (peft's merge_and_unload + save_pretrained)
and OUT_DIR/reference.json: {"tokens": [...], "versions": {...}, "models": {name: {"logits": [[...]],
"lora_logits": ..., "merged_logits": ..., "fp32_vs_fp64": ..., ...}}}, one row of logits per token.
hf_parity_test.py imports make() from here; the command line is for looking at the models by hand.
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

# Both ends of the 300-token vocabulary (0, 299) and a repeat (7, 7), whose two logits rows differ by position only.
TOKENS = [1, 5, 9, 299, 0, 17, 42, 7, 7, 130, 255, 64]

# Shared by every model (all thirteen are made in a few seconds); grouped-query attention (4 query heads over 2 key/value
# heads).
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, hidden_act="silu", bos_token_id=1, eos_token_id=2)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK, LORA_ALPHA = 4, 8


@dataclass(frozen=True)
class Spec:
    name: str
    model_type: str
    config: dict  # on top of COMMON
    lora_targets: list | str  # a list of module names, or PEFT's "all-linear"
    # PEFT's target_parameters (stacked experts, a router that is no nn.Linear): gate_up_proj at twice the rank and
    # alpha, the layout rlloop writes
    lora_parameters: list | None = None
    gguf: bool = True  # whether gguf_parity_test writes it as llama.cpp's converter would (rlloop reads the GGUF)


MODELS = [
    # Llama, untied, with the adapter on lm_head as well.
    Spec("llama", "llama", dict(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
         ALL_LINEAR + ["lm_head"]),
    # Llama with attention_bias (q/k/v and o_proj biases in HF), tied embeddings, Llama 3's theta.
    Spec("llama-bias-tied", "llama",
         dict(tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5, attention_bias=True),
         ["q_proj", "v_proj"]),
    # Qwen2: q/k/v biases always (its config has no attention_bias key), none on o_proj; tied as Qwen2-0.5B is.
    Spec("qwen2", "qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                use_sliding_window=False), ALL_LINEAR),
    Spec("qwen2-untied", "qwen2", dict(tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                       use_sliding_window=False), ["q_proj", "k_proj", "v_proj", "o_proj"]),
    # Qwen3: per-head q/k RMSNorm, head_dim 32 unlike hidden / heads = 16 (real Qwen3 states it too).
    Spec("qwen3", "qwen3", dict(tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=32,
                                use_sliding_window=False), ALL_LINEAR),
    Spec("qwen3-tied", "qwen3", dict(tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                     head_dim=32, use_sliding_window=False), ["gate_proj", "up_proj", "down_proj"]),
    # Qwen3-MoE: every layer sparse, 8 experts of width 48, two per token with renormalised weights (as the
    # released models route). PEFT puts the MLP's targets on the stacked experts (gate_up_proj at twice the rank).
    Spec("qwen3-moe", "qwen3_moe", dict(tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        head_dim=32, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=48, norm_topk_prob=True),
         ALL_LINEAR),
    # Plain top-k probabilities (no renormalisation), three of four experts, layer 1 dense (mlp_only_layers), tied;
    # PEFT's all-linear: attention, the router and the experts (not layer 1's dense MLP).
    Spec("qwen3-moe-mixed", "qwen3_moe", dict(tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                              head_dim=32, use_sliding_window=False, num_experts=4,
                                              num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
                                              mlp_only_layers=[1]), "all-linear", gguf=False),
    # gpt-oss: attention biases and sinks, layer 0 sliding (a window of 4 of the 12 tokens), layer 1 full; YaRN RoPE
    # scaled so that these 12 positions span its ramp; a router with a bias, softmax over the top 2 of 4 logits;
    # experts with biases and the clamped SwiGLU, clamped at 1 so that the clamps bite. Adapters on attention
    # (PEFT's all-linear there: the router is no nn.Linear, the experts are stacked parameters).
    Spec("gpt-oss", "gpt_oss", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=4, swiglu_limit=1.0, rms_norm_eps=1e-5,
                                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                         beta_fast=8.0, beta_slow=1.0, truncate=False,
                                                         original_max_position_embeddings=8)),
         "all-linear", gguf=False),
    # gpt-oss with adapters on its experts and router too (PEFT's target_parameters: its ParamWrapper reads the
    # transposed stacks as [E, in, out]; the B of gate_up has its rows interleaved as the stack's columns are); its
    # clamps at gpt-oss's 7, which llama.cpp's gpt-oss assumes (gguf_parity_test writes it as llama.cpp's converter).
    Spec("gpt-oss-experts", "gpt_oss", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=4, rms_norm_eps=1e-5,
                                            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                                 beta_fast=8.0, beta_slow=1.0, truncate=False,
                                                                 original_max_position_embeddings=8)),
         ["q_proj", "o_proj"], lora_parameters=["gate_up_proj", "down_proj", "router.weight"]),
    # Mistral: every layer sliding (a window of 4 of the 12 tokens, so that it bites), head_dim 32 unlike hidden /
    # heads = 16 (Mistral-Nemo states its own too). Not written as GGUF: llama.cpp's converter writes Mistral as
    # "llama" and runs it without the window.
    Spec("mistral", "mistral", dict(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4,
                                    head_dim=32), ALL_LINEAR, gguf=False),
    # Gemma 2: sandwich norms scaling by (1 + w), GeGLU, embeddings x sqrt(64), layer 0 sliding (a window of 4),
    # attention scaled by 24^-1/2 (not head_dim 32's) and soft-capped at 1.5, the output logits at 2.5: caps small
    # enough to bite on these O(1) logits. Tied, as Gemma 2 is. Not written as GGUF: llama.cpp's gemma2 derives the
    # attention scale from the model's size (head_dim^-1/2 here), so rlloop's export refuses this one.
    Spec("gemma2", "gemma2", dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                                  tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=4, head_dim=32,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=2.5),
         ALL_LINEAR, gguf=False),
    # Gemma 2 as llama.cpp runs it: as above with the attention scaled by head_dim^-1/2 (query_pre_attn_scalar 32).
    Spec("gemma2-gguf", "gemma2", dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                                       tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=4, head_dim=32,
                                       query_pre_attn_scalar=32, attn_logit_softcapping=1.5,
                                       final_logit_softcapping=2.5), ALL_LINEAR),
]


def load(path, dtype=torch.float32):
    # Eager attention: the plain softmax(QK^T)V, so the reference does not depend on which SDPA kernel ran. Eager
    # experts too (one product per expert hit): the default grouped_mm takes no fp64.
    extra = {"experts_implementation": "eager"} if hasattr(AutoConfig.from_pretrained(path), "num_experts") else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **extra).eval()


def forward_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0]


def router_metrics(model, tokens=TOKENS):
    """A model with experts: transformers' load-balancing loss (aux_loss, unscaled) and the mean squared log-sum-exp
    of its routers' logits over every sparse layer and token (ST-MoE's z-loss), what rlloop reports as
    router/aux_loss and router/z_loss."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False, output_router_logits=True)
    z = torch.stack([torch.logsumexp(l.double(), -1) for l in out.router_logits]).square().mean()
    return {"aux_loss": out.aux_loss.item(), "z_loss": z.item()}


def randomize(model, generator):
    """HF's init (std 0.02, norms 1, biases 0) would hide whole terms: zero biases, unit norms and near-zero
    logits let a mistake there pass. Linears, embeddings and biases get N(0, 0.1^2), norms 1 + N(0, 0.1^2);
    logits then come out O(1), where fp32 rounding (~1e-6) stays well under the 1e-5 tolerance."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # a tied lm_head is listed once, as the embedding
            noise = torch.randn(param.shape, generator=generator)
            # (Gemma's norms scale by 1 + w: their weights are the noise alone.)
            one = 0.0 if model.config.model_type.startswith("gemma") else 1.0
            param.copy_(one + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)


def random_adapter(base, targets, generator, parameters=None):
    """A LoRA adapter with random A and B: PEFT's own init sets B = 0, an adapter that changes nothing."""
    extra = {}
    if parameters:
        extra = dict(target_parameters=parameters, rank_pattern={r".*\.gate_up_proj": 2 * LORA_RANK},
                     alpha_pattern={r".*\.gate_up_proj": 2 * LORA_ALPHA})
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def make_mxfp4(out_dir, base_dir, generator):
    """gpt-oss as OpenAI ships it: the experts' matrices in MXFP4 (..._blocks with two FP4 codes a byte, ..._scales
    with a power of two per 32 values), config.json's quantization_config saying so. Random codes and scales (2^-6 to
    2^-3, so the values are O(0.1) as randomize's); the reference is the model with transformers' own dequantization
    (convert_moe_packed_tensors) in place of its experts. Returns its logits."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(os.path.join(base_dir, "model.safetensors"))
    model = load(base_dir)
    with torch.no_grad():
        for name in sorted(tensors):
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            experts, n_in, n_out = tensors.pop(name).shape
            blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(121, 125, (experts, n_out, n_in // 32), generator=generator, dtype=torch.uint8)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            model.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    mxfp4_dir = os.path.join(out_dir, "gpt-oss-mxfp4")
    os.makedirs(mxfp4_dir, exist_ok=True)
    save_file(tensors, os.path.join(mxfp4_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(base_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    with open(os.path.join(mxfp4_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return forward_logits(model)


def as_rows(logits):
    return logits.tolist()  # float32 -> Python float is exact


def make(out_dir, seed=0):
    """Writes the models, adapters and merged models under out_dir; returns (and writes) the reference."""
    os.makedirs(out_dir, exist_ok=True)
    reference = {"tokens": TOKENS, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                "peft": peft.__version__}, "models": {}}
    for index, spec in enumerate(MODELS):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        config = AutoConfig.for_model(spec.model_type, **{**COMMON, **spec.config})
        model_dir = os.path.join(out_dir, spec.name)
        adapter_dir = model_dir + "-lora"
        merged_dir = model_dir + "-merged"

        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        randomize(model, generator)
        model.save_pretrained(model_dir)
        # References are computed from the saved directories, so what is checked is what the files say.
        logits = forward_logits(load(model_dir))
        logits_fp64 = forward_logits(load(model_dir, torch.float64))

        # save_embedding_layers=False: with lm_head among the targets, peft would otherwise store the whole base
        # lm_head in the adapter too, which an adapter (and rlloop's loader) has no use for.
        random_adapter(load(model_dir), spec.lora_targets, generator, spec.lora_parameters).save_pretrained(
            adapter_dir, save_embedding_layers=False)
        adapted = PeftModel.from_pretrained(load(model_dir), adapter_dir).eval()
        lora_logits = forward_logits(adapted)
        adapted.merge_and_unload().save_pretrained(merged_dir)
        merged_logits = forward_logits(load(merged_dir))

        reference["models"][spec.name] = {
            "model_type": spec.model_type,
            "gguf": spec.gguf,
            "logits": as_rows(logits),
            "lora_logits": as_rows(lora_logits),
            "merged_logits": as_rows(merged_logits),
            # How far transformers' own fp32 is from fp64: the noise floor under the 1e-5 tolerance.
            "fp32_vs_fp64": (logits.double() - logits_fp64).abs().max().item(),
            # How much the adapter moves the logits: a check that ignored the adapter would fail by this much.
            "lora_vs_base": (lora_logits - logits).abs().max().item(),
        }
        if getattr(config, "num_experts", None):  # gpt-oss's num_local_experts answers to it too
            reference["models"][spec.name]["router"] = router_metrics(load(model_dir))
        if spec.name == "gpt-oss":
            reference["mxfp4_logits"] = as_rows(make_mxfp4(out_dir, model_dir, generator))
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)
    return reference


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: more threads only add overhead
    transformers.utils.logging.disable_progress_bar()
    for name, m in make(args.out_dir, args.seed)["models"].items():
        print(f"{name:16s} max|logits| {max(abs(v) for row in m['logits'] for v in row):.2f}  fp32-fp64 {m['fp32_vs_fp64']:.1e}"
              f"  lora-base {m['lora_vs_base']:.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()
