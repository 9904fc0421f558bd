"""rlloop's "harmony" chat renderer against OpenAI's openai-harmony (HARMONY_GPT_OSS), token for token.

openai-harmony reads o200k_base.tiktoken; it runs offline from the file js-tiktoken's ranks make
(scripts/tokenizer/tiktoken_ranks.js writes it byte for byte as OpenAI publishes it, and harmony checks its sha256).
rlloop reads the same ranks as o200k_harmony.tiktoken. For each conversation: the generation prompt (harmony's
render_conversation_for_completion), the training example (render_conversation_for_training) and its weights (1
exactly on what the model writes after the last <|start|>assistant header it is given).

Usage: python harmony_match.py --rlloop build/bin/rlloop [--node node]
Fails (exit 1) on any difference, or when openai-harmony or js-tiktoken is missing (scripts/setup.sh --tests).
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]

# Conversations in rlloop's message form. For generation prompts harmony drops completed turns' analysis itself
# (auto_drop_analysis); the cases have at most one completed turn with reasoning, where rlloop and harmony agree.
GENERATION = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "User greets. Respond."},
     {"role": "user", "content": "Ünïcödé, emoji 👍🏽 and <code>x = 1;</code>\n\n  spaced  "}],
    [{"role": "system", "content": "Reply in French.\nBe terse."}, {"role": "user", "content": "Good morning"}],
]
# Training examples: the last message is the assistant's, trained on; its reasoning (after the last user message)
# is kept, rendered on the analysis channel.
TRAINING = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "2+2 = 4.", "reasoning_content": "Simple arithmetic: 2 plus 2 is 4."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "Geography. France -> Paris."}],
]


def harmony_messages(h, conversation, drop_completed_reasoning):
    """The conversation as openai-harmony messages: the default system message, a first system message as the
    developer's instructions, an assistant's reasoning on the analysis channel before its final answer."""
    msgs = [h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new())]
    last_user = max((i for i, m in enumerate(conversation) if m["role"] == "user"), default=-1)
    for i, m in enumerate(conversation):
        if m["role"] == "system":
            msgs.append(h.Message.from_role_and_content(
                h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(m["content"])))
        elif m["role"] == "user":
            msgs.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        else:
            if "reasoning_content" in m and not (drop_completed_reasoning and i < last_user):
                msgs.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["reasoning_content"])
                            .with_channel("analysis"))
            msgs.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"]).with_channel("final"))
    return msgs


def rlloop_render(rlloop, tokenizer, conversations, flags):
    lines = "".join(json.dumps(c) + "\n" for c in conversations)
    r = subprocess.run([rlloop, "tokenize", "--tokenizer", tokenizer, "--chat", "harmony", *flags], input=lines,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"harmony_match: rlloop tokenize failed ({r.returncode}): {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rlloop", required=True)
    ap.add_argument("--node", default=shutil.which("node") or "node")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as enc_dir:
        base = os.path.join(enc_dir, "o200k_base.tiktoken")
        w = subprocess.run([args.node, str(REPO / "scripts/tokenizer/tiktoken_ranks.js"), "o200k_base", base],
                           capture_output=True, text=True, check=False)
        if w.returncode != 0:
            sys.exit(f"harmony_match: FAILED: cannot write o200k_base.tiktoken from js-tiktoken (run scripts/setup.sh "
                     f"--tests): {w.stderr}")
        harmony_file = os.path.join(enc_dir, "o200k_harmony.tiktoken")
        shutil.copyfile(base, harmony_file)
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = enc_dir  # harmony reads the file there, never the network
        try:
            import openai_harmony as h
        except ImportError as e:
            sys.exit(f"harmony_match: FAILED: openai-harmony is missing (run scripts/setup.sh --tests): {e}")
        enc = h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
        keep_all = h.RenderConversationConfig(auto_drop_analysis=False)
        failures = 0

        def check(label, got, want):
            nonlocal failures
            ok = got == want
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label}")
            if not ok:
                print(f"  rlloop:  {got}\n  harmony: {want}\n  harmony text: {enc.decode(want)!r}")

        got = rlloop_render(args.rlloop, harmony_file, GENERATION, ["--generation-prompt"])
        for i, conv in enumerate(GENERATION):
            convo = h.Conversation.from_messages(harmony_messages(h, conv, drop_completed_reasoning=False))
            check(f"generation prompt {i} (harmony drops completed reasoning itself)", got[i]["tokens"],
                  enc.render_conversation_for_completion(convo, h.Role.ASSISTANT))

        got = rlloop_render(args.rlloop, harmony_file, TRAINING, [])
        for i, conv in enumerate(TRAINING):
            msgs = harmony_messages(h, conv, drop_completed_reasoning=True)
            want = enc.render_conversation_for_training(h.Conversation.from_messages(msgs), keep_all)
            check(f"training example {i} tokens", got[i]["tokens"], want)
            # What the model is given: everything up to the last assistant message's header.
            answer = 1 + ("reasoning_content" in conv[-1])
            prompt = enc.render_conversation_for_completion(h.Conversation.from_messages(msgs[:-answer]),
                                                            h.Role.ASSISTANT, keep_all)
            check(f"training example {i} weights", got[i]["weights"],
                  [0.0] * len(prompt) + [1.0] * (len(want) - len(prompt)))
        if failures:
            sys.exit(f"harmony_match: FAILED ({failures} differences)")
        print("harmony_match: all identical")


if __name__ == "__main__":
    main()
