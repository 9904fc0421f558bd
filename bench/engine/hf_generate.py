#!/usr/bin/env python3
"""Hugging Face transformers' generate on the weights gpu_check's decode stage sampled from (exported in HF layout):
the reference rate for rlloop's decode tokens/s, same rows, prompt and new tokens. One JSON line, stage
"hf_generate". Run by scripts/gpu_check.sh.

  hf_generate.py --model DIR [--device cuda] [--dtype bf16] [--rows 64] [--prompt-tokens 32] [--new-tokens 128]
"""
import argparse
import json
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    # Loaded as stored (fp32) and converted: the keyword for the dtype changed across transformers versions.
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model).to(device=a.device, dtype=dtype).eval()
    # gpu_check's prompt: 32 copies of token 7; every row samples (temperature 1, no top-k / top-p) to exactly
    # new_tokens tokens, as rlloop's rows do without stop tokens.
    prompt = torch.full((a.rows, a.prompt_tokens), 7, dtype=torch.long, device=a.device)
    settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.new_tokens,
                    min_new_tokens=a.new_tokens, pad_token_id=0)

    def run():
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    run()  # warm-up
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    new = (out.shape[1] - a.prompt_tokens) * a.rows
    print(json.dumps({"stage": "hf_generate", "rows": a.rows, "new_tokens": a.new_tokens,
                      "tokens_per_s": new / seconds, "transformers": transformers.__version__,
                      "torch": torch.__version__, "ok": True}), flush=True)


if __name__ == "__main__":
    main()
