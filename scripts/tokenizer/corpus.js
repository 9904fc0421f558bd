// The text corpus of the tokenizer exact-match test and benchmark: all of GSM8K train (questions and answers),
// source code, and generated edge cases. Deterministic: the same inputs always give the same corpus.
// As a program: node scripts/tokenizer/corpus.js [--gsm8k FILE] > corpus.jsonl (one JSON string per line).
'use strict';
const fs = require('fs');
const path = require('path');

const REPO = path.resolve(__dirname, '..', '..');
// The external data folder of the tests (tests/external_data.hpp): $RLLOOP_DATA_DIR, else ../shared/data.
const DATA_DIR = process.env.RLLOOP_DATA_DIR || path.resolve(REPO, '..', 'shared', 'data');
const DEFAULT_GSM8K = path.join(DATA_DIR, 'gsm8k', 'train.jsonl');
const DEFAULT_NPM = path.join(REPO, 'third_party', 'npm', 'node_modules');

const QWEN_SPECIALS = [
  '<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|object_ref_start|>', '<|object_ref_end|>', '<|box_start|>',
  '<|box_end|>', '<|quad_start|>', '<|quad_end|>', '<|vision_start|>', '<|vision_end|>', '<|vision_pad|>',
  '<|image_pad|>', '<|video_pad|>', '<tool_call>', '</tool_call>', '<|fim_prefix|>', '<|fim_middle|>',
  '<|fim_suffix|>', '<|fim_pad|>', '<|repo_name|>', '<|file_sep|>', '<tool_response>', '</tool_response>',
  '<think>', '</think>',
];

function gsm8kTexts(file) {
  if (!fs.existsSync(file)) throw new Error(`GSM8K train file not found at ${file} (set RLLOOP_DATA_DIR)`);
  const out = [];
  for (const line of fs.readFileSync(file, 'utf8').split('\n')) {
    if (!line.trim()) continue;
    const r = JSON.parse(line);
    out.push(r.question, r.answer);
  }
  return out;
}

// Source files cut into chunks of 30 lines: C++, shell, JavaScript, TypeScript, CMake, Markdown.
function sourceTexts(npmDir) {
  const roots = [path.join(REPO, 'include'), path.join(REPO, 'src'), path.join(REPO, 'scripts'),
                 path.join(REPO, 'cmake'), path.join(npmDir, 'gpt-3-encoder'),
                 path.join(npmDir, '@lenml', 'tokenizers', 'src')];
  const files = [];
  const walk = (d) => {
    if (!fs.existsSync(d)) return;
    for (const e of fs.readdirSync(d, { withFileTypes: true }).sort((a, b) => (a.name < b.name ? -1 : 1))) {
      const p = path.join(d, e.name);
      if (e.isDirectory()) walk(p);
      else if (/\.(cpp|hpp|h|sh|js|ts|cmake|md|txt)$/.test(e.name) && !e.name.endsWith('.inc')) files.push(p);
    }
  };
  roots.forEach(walk);
  const out = [];
  for (const f of files) {
    const lines = fs.readFileSync(f, 'utf8').split('\n');
    for (let i = 0; i < lines.length; i += 30) out.push(lines.slice(i, i + 30).join('\n'));
  }
  return out;
}

// A small deterministic PRNG (mulberry32) so the fuzz texts are the same on every machine.
function rng(seed) {
  return () => {
    seed |= 0; seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function edgeCases() {
  const out = [];
  const ws = [' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', ' \n', '\n ', ' \t \n', '\u00a0', '\u2003', '\u3000',
              '\u2028', '\u0085', '\ufeff', '\u000b', '\u000c', '\n\n\n   '];
  const words = ['hello', 'World', 'x', 'I', 'naïve', 'café', 'Ünïcödé', 'Straße', 'привет', 'γειά', 'مرحبا',
                 'שלום', 'नमस्ते', '你好', '世界', 'こんにちは', 'カタカナ', '안녕하세요', 'ไทย', 'a1b2'];
  // Whitespace runs around words, at the start, in the middle, at the end.
  for (const w of ws) {
    for (const v of ['a', 'Hello', '1', '!', '你']) {
      out.push(w + v, v + w, v + w + v, w + v + w, w.repeat(3) + v + w.repeat(2) + v);
    }
    out.push(w, w.repeat(7));
  }
  // Digits.
  for (let n = 1; n <= 16; ++n) out.push('1234567890123456'.slice(0, n), ' ' + '9876543210987654'.slice(0, n), 'x' + '5'.repeat(n));
  out.push('3.14159', '1,000,000', '$12.50', '-42', '2024-01-01T12:34:56Z', '0x1F', '1e-10', '١٢٣٤٥', '１２３',
           '²³', 'Ⅻ', '½', '⑧', '𝟘𝟙𝟚', '12abc34', 'abc123def', ' 123 456 ');
  // Contractions, both cases and odd quote runs.
  for (const c of ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D", "'x"]) {
    out.push('it' + c, 'IT' + c + ' go', ' ' + c, c, "''" + c, c + c);
  }
  out.push("don't", "I'm sure they'll've", "rock 'n' roll", "''''", "' s", "'\n", "O'Neil's");
  // Emoji and other multi-byte UTF-8 (2, 3 and 4 bytes), ZWJ sequences, flags, skin tones, variation selectors.
  out.push('👍', '👍🏽', '👨‍👩‍👧‍👦', '🇫🇷🇯🇵', '❤️', 'a👍b', ' 😀😀😀', '🤖 robots', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢', '𐍈', '€£¥',
           '→←↑↓', '∑∫√∞', '«quotes»', '“smart” ‘quotes’', '—–-', '…', '\u200b', '\u200d', 'e\u0301', 'n\u0303',
           'a\u0308\u0304', 'ệ', 'e\u0323\u0302', '\u1100\u1161\u11a8', 'Å', '\u212b', 'ﬁ', '\u0344');
  // Every special token, alone, in text, adjacent, and broken.
  for (const s of QWEN_SPECIALS) {
    out.push(s, 'a' + s + 'b', ' ' + s + ' ', s + s, s + '\n' + s, s.slice(0, -1), s.slice(1), '<' + s + '>');
  }
  out.push('<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n');
  // Invalid UTF-8: JavaScript strings cannot hold it, so the corpus carries what a decoder makes of it (U+FFFD);
  // raw invalid bytes are covered by the GoogleTest round trip.
  const dec = new TextDecoder('utf-8');
  for (const bytes of [[0xff], [0xc3], [0xe2, 0x82], [0x80, 0x80], [0xed, 0xa0, 0x80], [0xf5, 0x80], [0xc0, 0xaf]]) {
    const b = Buffer.from([0x61, ...bytes, 0x20, 0x62]);
    out.push(dec.decode(b));
  }
  // Random mixtures.
  const pool = [...'abcXYZ019 \t\n\r.,;:!?\'"()[]{}<>/\\|-_=+*&^%$#@~`', 'é', 'ß', 'ñ', '中', '文', 'ا', 'ب', 'ह',
                '\u0301', '\u0308', '\u0327', '😀', '🎉', '\u00a0', '\u3000', '٣', '<|im_end|>', '<think>',
                '<|endoftext|>', "'s", "'LL", '  ', '\n\n', 'the', ' and', '12345'];
  const r = rng(20240611);
  for (let i = 0; i < 3000; ++i) {
    const n = 1 + Math.floor(r() * 40);
    let s = '';
    for (let k = 0; k < n; ++k) s += pool[Math.floor(r() * pool.length)];
    out.push(s);
  }
  return out;
}

function buildCorpus({ gsm8k = DEFAULT_GSM8K, npmDir = DEFAULT_NPM } = {}) {
  const parts = { gsm8k: gsm8kTexts(gsm8k), source: sourceTexts(npmDir), edge: edgeCases() };
  const texts = [...parts.gsm8k, ...parts.source, ...parts.edge].filter((s) => s.length > 0);
  return { texts, counts: Object.fromEntries(Object.entries(parts).map(([k, v]) => [k, v.length])) };
}

// Conversations for the chat-template checks (chat_match.js, gguf_match.js): system prompts, several turns,
// reasoning, tool results, odd whitespace.
const CHAT_CONVERSATIONS = [
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
module.exports = { buildCorpus, CHAT_CONVERSATIONS, QWEN_SPECIALS, DEFAULT_GSM8K, DEFAULT_NPM, REPO };

if (require.main === module) {
  const args = process.argv.slice(2);
  const gi = args.indexOf('--gsm8k');
  const { texts } = buildCorpus(gi >= 0 ? { gsm8k: args[gi + 1] } : {});
  process.stdout.write(texts.map((t) => JSON.stringify(t)).join('\n') + '\n');
}
