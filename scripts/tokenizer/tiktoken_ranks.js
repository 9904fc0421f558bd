// OpenAI's encodings as js-tiktoken ships them, written as tiktoken rank files ("<base64 token> <rank>" per line,
// in rank order: byte for byte the files OpenAI publishes, e.g. o200k_base.tiktoken's sha256 446a9538...1a2d) for
// rlloop to load, and js-tiktoken's own encoder of each as the reference.
'use strict';
const fs = require('fs');
const path = require('path');

// { tiktoken, ranks }: js-tiktoken's Tiktoken class and the encoding `name`'s ranks, from the npm folder `npmDir`.
function jsTiktoken(npmDir, name) {
  const dist = path.join(npmDir, 'js-tiktoken', 'dist');
  const { Tiktoken } = require(path.join(dist, 'lite.cjs'));
  const ranks = require(path.join(dist, 'ranks', `${name}.cjs`));
  return { Tiktoken, ranks: ranks.default || ranks };
}

// Writes `ranks` (js-tiktoken's compressed form: lines "! <first rank> <base64> <base64> ...") to `file` as a
// tiktoken rank file.
function writeRankFile(ranks, file) {
  const entries = [];
  for (const line of ranks.bpe_ranks.split('\n')) {
    if (!line) continue;
    const [, first, ...tokens] = line.split(' ');
    tokens.forEach((token, i) => entries.push([Number.parseInt(first, 10) + i, token]));
  }
  entries.sort((a, b) => a[0] - b[0]);
  fs.writeFileSync(file, entries.map(([rank, token]) => `${token} ${rank}\n`).join(''));
}

module.exports = { jsTiktoken, writeRankFile };

// node scripts/tokenizer/tiktoken_ranks.js ENCODING FILE [--npm DIR]: writes that encoding's rank file.
if (require.main === module) {
  const [name, file] = process.argv.slice(2);
  const at = process.argv.indexOf('--npm');
  const npmDir = at >= 0 ? process.argv[at + 1] : require('./corpus.js').DEFAULT_NPM;
  if (!name || !file) {
    console.error('usage: tiktoken_ranks.js ENCODING FILE [--npm DIR]');
    process.exit(2);
  }
  writeRankFile(jsTiktoken(npmDir, name).ranks, file);
}
