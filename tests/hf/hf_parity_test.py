#!/usr/bin/env python3
"""rlloop's engine against Hugging Face transformers and peft, in fp32 (see README.md).

  hf_parity_test.py HF_LOGITS    (the hf_logits tool built from hf_logits.cpp)

For the tiny random models (Llama, Qwen2, Qwen3, Qwen3-MoE, gpt-oss, Mistral, Gemma 2) that make_models.py writes into a
temporary directory:
  base      rlloop's logits for transformers' saved model            == transformers' logits
  lora      rlloop with peft's saved adapter                         == peft's adapted logits
  merged    rlloop on peft's merged model                            == peft's merged model's logits
  peft      peft with the adapter rlloop exported (save_peft_adapter) == rlloop's adapted logits
  export    transformers on rlloop's merged export (save_model)      == rlloop's adapted logits
each within TOLERANCE in max absolute difference. Fails, never skips, when the pinned packages are missing.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

TOLERANCE = 1e-5
CHECKS = ["base", "lora", "merged", "peft", "export", "router"]

sys.dont_write_bytecode = True  # importing make_models must not leave __pycache__ in the source tree
try:
    import torch
    import transformers
    from peft import PeftModel

    import make_models
except ImportError as e:
    sys.exit(f"hf_parity_test: {e}; scripts/setup.sh --tests installs the pinned packages into third_party/venv")


def hf_logits(tool, *args):
    """rlloop's logits from the hf_logits tool, as a [tokens, vocab] tensor."""
    tokens = ",".join(map(str, make_models.TOKENS))
    run = subprocess.run([tool, args[0], tokens, *args[1:]], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"hf_logits {' '.join(args)} failed ({run.returncode}): {run.stderr.strip()}")
    return json.loads(run.stdout)


def max_diff(a, b):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item()


def check_model(tool, root, name, ref):
    """The five differences for one model."""
    model_dir = os.path.join(root, name)
    peft_export, merged_export = model_dir + "-rlloop-peft", model_dir + "-rlloop-merged"

    base_out = hf_logits(tool, model_dir)
    base = torch.tensor(base_out["logits"])
    adapted = torch.tensor(hf_logits(tool, model_dir, "--adapter", model_dir + "-lora", "--export-peft", peft_export,
                                     "--export-merged", merged_export)["logits"])
    merged = torch.tensor(hf_logits(tool, model_dir + "-merged")["logits"])
    # PEFT reads rlloop's adapter onto transformers' base, transformers reads rlloop's merged model.
    peft_on_export = make_models.forward_logits(PeftModel.from_pretrained(make_models.load(model_dir), peft_export))
    hf_on_export = make_models.forward_logits(make_models.load(merged_export))
    diffs = {
        "base": max_diff(base, ref["logits"]),
        "lora": max_diff(adapted, ref["lora_logits"]),
        "merged": max_diff(merged, ref["merged_logits"]),
        "peft": max_diff(peft_on_export, adapted),
        "export": max_diff(hf_on_export, adapted),
    }
    if "router" in ref:  # models with experts: the router's metrics against transformers' aux_loss
        mine = base_out.get("router", {})
        diffs["router"] = max(abs(mine.get(k, float("inf")) - v) for k, v in ref["router"].items())
    return diffs


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tool = sys.argv[1]
    torch.set_num_threads(1)  # tiny models: more threads only add overhead, and ctest may run tests side by side
    transformers.utils.logging.disable_progress_bar()
    start = time.time()
    failures = []
    with tempfile.TemporaryDirectory(prefix="rlloop-hf-") as root:
        reference = make_models.make(root)
        print(f"transformers {transformers.__version__}, peft {reference['versions']['peft']}, "
              f"torch {torch.__version__}; {len(make_models.TOKENS)} tokens; models made in "
              f"{time.time() - start:.1f} s")
        print(f"max |difference| per check (tolerance {TOLERANCE:.0e}); fp32-fp64 is transformers' own rounding")
        print(f"{'model':16s}" + "".join(f"{c:>10s}" for c in CHECKS) + f"{'fp32-fp64':>11s}")
        worst = dict.fromkeys(CHECKS, 0.0)
        for name, ref in reference["models"].items():
            diffs = check_model(tool, root, name, ref)
            print(f"{name:16s}" + "".join(f"{diffs[c]:10.1e}" if c in diffs else f"{'-':>10s}" for c in CHECKS)
                  + f"{ref['fp32_vs_fp64']:11.1e}")
            for check, diff in diffs.items():
                worst[check] = max(worst[check], diff)
                if not diff <= TOLERANCE:
                    failures.append(f"{name} {check}: max |difference| {diff:.3e} > {TOLERANCE:.0e}")
        # gpt-oss in MXFP4 (OpenAI's release format): rlloop's dequantization on load against transformers'.
        mxfp4 = max_diff(torch.tensor(hf_logits(tool, os.path.join(root, "gpt-oss-mxfp4"))["logits"]),
                         reference["mxfp4_logits"])
        print(f"{'gpt-oss-mxfp4':16s}{mxfp4:10.1e}  (base only: its experts as OpenAI ships them)")
        if not mxfp4 <= TOLERANCE:
            failures.append(f"gpt-oss-mxfp4 base: max |difference| {mxfp4:.3e} > {TOLERANCE:.0e}")
    print(f"{'worst':16s}" + "".join(f"{worst[c]:10.1e}" for c in CHECKS))
    print(f"total {time.time() - start:.1f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
