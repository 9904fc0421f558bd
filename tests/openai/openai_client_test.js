// The official `openai` npm package, used as a Node user would, against `rlloop serve`: chat completions
// (plain, streaming, n > 1, stop, seed, logprobs), completions and models; usage must equal the server's billing.
// Usage: node openai_client_test.js <rlloop binary> <node_modules dir>. Exits non-zero on any failure.
'use strict';
const assert = require('node:assert/strict');
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const [rlloop, modulesArg] = process.argv.slice(2);
const modulesDir = modulesArg && path.resolve(modulesArg);
if (!rlloop || !modulesDir) throw new Error('usage: node openai_client_test.js <rlloop> <node_modules>');
let OpenAI;
try {
  OpenAI = require(path.join(modulesDir, 'openai'));
} catch (e) {
  console.error(`the openai npm package is missing from ${modulesDir}: run scripts/setup.sh --tests (${e.message})`);
  process.exit(1);
}

const KEY = 'sk-rlloop-test';
// Starts `rlloop serve` on --port 0 (the kernel picks a free port, so no test beside this one can take it first)
// and reads the real port from its {"event":"listening",...,"port":N} log line.
async function startServer(dir) {
  fs.writeFileSync(path.join(dir, 'tenants.json'), JSON.stringify({ tenants: [{ id: 'node', bearerKeys: [KEY] }] }));
  const child = spawn(rlloop, ['serve', '--tenants', path.join(dir, 'tenants.json'), '--port', '0',
    '--data-dir', path.join(dir, 'data'), '--device', 'cpu', '--threads', '1'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  child.stdout.on('data', (d) => { log += d; });
  child.stderr.on('data', (d) => { log += d; });
  const listening = () => log.match(/"event":"listening"[^\n]*"port":(\d+)[^\n]*\n/);  // whole lines only
  for (let i = 0; i < 600 && !listening(); i++) {
    if (child.exitCode !== null) throw new Error(`rlloop serve exited: ${log}`);
    await new Promise((r) => setTimeout(r, 50));
  }
  const m = listening();
  if (!m) throw new Error(`rlloop serve did not start: ${log}`);
  return { child, port: Number(m[1]) };
}

// Control plane and usage are not OpenAI calls: plain fetch with the same bearer key.
async function call(base, pathname, init = {}) {
  const res = await fetch(base + pathname, { ...init, headers: { Authorization: `Bearer ${KEY}`, ...(init.headers || {}) } });
  const text = await res.text();
  if (!res.ok) throw new Error(`${pathname}: HTTP ${res.status} ${text}`);
  return JSON.parse(text);
}

async function createSession(base, name) {
  await call(base, '/', {
    method: 'POST',
    headers: { 'X-Amz-Target': 'SageMaker.CreateTrainingSession', 'Content-Type': 'application/x-amz-json-1.1' },
    body: JSON.stringify({
      TrainingSessionName: name, RoleArn: 'arn:aws:iam::000000000000:role/rlloop',
      LoraConfig: { Rank: 4, Alpha: 8 }, ModelConfig: { BaseModelArn: 'rlloop-tiny' },
      OutputConfig: { S3Location: { Path: 's3://bucket/out/' } },
    }),
  });
  for (let i = 0; i < 400; i++) {
    const d = await call(base, '/', { method: 'POST', headers: { 'X-Amz-Target': 'SageMaker.DescribeTrainingSession' },
      body: JSON.stringify({ TrainingSessionName: name }) });
    if (d.TrainingSessionDetail.TrainingSessionStatus === 'Running') return;
    await new Promise((r) => setTimeout(r, 25));
  }
  throw new Error(`session ${name} never ran`);
}

const sessionUsage = async (base, name) =>
  (await call(base, '/v1/usage')).sessions.find((s) => s.trainingSessionName === name).usage;

async function main() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'rlloop-openai-'));
  const { child: server, port } = await startServer(dir);
  const base = `http://127.0.0.1:${port}`;
  let checks = 0;
  try {
    await createSession(base, 'chat');
    const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: KEY, maxRetries: 0 });

    // Models: the live session is listed.
    const models = await client.models.list();
    assert.ok(models.data.some((m) => m.id === 'chat'), 'session listed in /v1/models'); checks++;

    // Non-streaming chat completion; usage equals what billing counted for it.
    const messages = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Say hi' }];
    let before = await sessionUsage(base, 'chat');
    const plain = await client.chat.completions.create({ model: 'chat', messages, max_tokens: 12, seed: 5, temperature: 0.8, top_p: 0.95, logprobs: true });
    let after = await sessionUsage(base, 'chat');
    assert.equal(plain.object, 'chat.completion');
    assert.equal(plain.choices.length, 1);
    assert.equal(plain.choices[0].message.role, 'assistant');
    assert.equal(typeof plain.choices[0].message.content, 'string');
    assert.ok(['stop', 'length'].includes(plain.choices[0].finish_reason));
    assert.equal(plain.usage.prompt_tokens, after.prefill - before.prefill, 'prompt_tokens = billed prefill');
    assert.equal(plain.usage.completion_tokens, after.sample - before.sample, 'completion_tokens = billed sample');
    assert.equal(plain.usage.total_tokens, plain.usage.prompt_tokens + plain.usage.completion_tokens);
    assert.ok(plain.usage.completion_tokens >= 1 && plain.usage.completion_tokens <= 12);
    const lps = plain.choices[0].logprobs.content;
    // One entry per sampled token, less a final end-of-turn token.
    if (plain.choices[0].finish_reason === 'length') assert.equal(lps.length, plain.usage.completion_tokens);
    else assert.ok(lps.length <= plain.usage.completion_tokens);
    for (const t of lps) assert.ok(t.logprob <= 0 && Number.isFinite(t.logprob), 'logprobs are log-probabilities');
    checks++;

    // The same request again (same seed) gives the same text: seeds reach the sampler.
    const again = await client.chat.completions.create({ model: 'chat', messages, max_tokens: 12, seed: 5, temperature: 0.8, top_p: 0.95 });
    assert.equal(again.choices[0].message.content, plain.choices[0].message.content); checks++;

    // Streaming: chunks then [DONE] (the SDK stops at it); the concatenated deltas are the non-streamed text.
    before = await sessionUsage(base, 'chat');
    const stream = await client.chat.completions.create({ model: 'chat', messages, max_tokens: 12, seed: 5, temperature: 0.8, top_p: 0.95,
      stream: true, stream_options: { include_usage: true } });
    let text = '', finish = null, usage = null, chunks = 0;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      chunks++;
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (c.delta && c.delta.content) text += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    after = await sessionUsage(base, 'chat');
    assert.equal(text, plain.choices[0].message.content, 'streamed text = non-streamed text');
    assert.equal(finish, plain.choices[0].finish_reason);
    assert.ok(chunks >= 3);
    assert.ok(usage, 'include_usage sends a usage chunk');
    assert.equal(usage.prompt_tokens, after.prefill - before.prefill);
    assert.equal(usage.completion_tokens, after.sample - before.sample);
    checks++;

    // n > 1: n choices; the prompt is counted once (OpenAI's convention, and what the session bills), completions
    // are summed over the choices.
    before = await sessionUsage(base, 'chat');
    const multi = await client.chat.completions.create({ model: 'chat', messages, max_tokens: 6, n: 3, seed: 11 });
    after = await sessionUsage(base, 'chat');
    assert.equal(multi.choices.length, 3);
    assert.deepEqual(multi.choices.map((c) => c.index), [0, 1, 2]);
    assert.equal(multi.usage.prompt_tokens, after.prefill - before.prefill);
    assert.equal(multi.usage.completion_tokens, after.sample - before.sample);
    assert.equal(multi.usage.prompt_tokens, plain.usage.prompt_tokens, 'the same prompt, counted once for n = 3');
    checks++;

    // stop: a completion of a prompt, stopped at a string that the unstopped completion contains.
    const free = await client.completions.create({ model: 'chat', prompt: 'the cat', max_tokens: 24, seed: 3, temperature: 1 });
    assert.equal(free.object, 'text_completion');
    const full = free.choices[0].text;
    const cp = [...full];
    const stopAt = cp.findIndex((ch, i) => i >= 2 && /^[ -~]$/.test(ch));  // a printable ASCII character
    if (stopAt >= 0) {
      const stopString = cp[stopAt];
      const stopped = await client.completions.create({ model: 'chat', prompt: 'the cat', max_tokens: 24, seed: 3, temperature: 1, stop: [stopString] });
      assert.equal(stopped.choices[0].text, full.slice(0, full.indexOf(stopString)), 'text ends before the stop string');
      assert.equal(stopped.choices[0].finish_reason, 'stop');
      checks++;
    }
    const chatStop = await client.chat.completions.create({ model: 'chat', messages, max_tokens: 12, seed: 5, temperature: 0.8, top_p: 0.95, stop: ['\n\n'] });
    assert.ok(!chatStop.choices[0].message.content.includes('\n\n')); checks++;

    // Errors come back as OpenAI errors with the right status.
    await assert.rejects(client.chat.completions.create({ model: 'nope', messages }), (e) => e.status === 404); checks++;
    await assert.rejects(client.chat.completions.create({ model: 'chat', messages, temperature: 7 }), (e) => e.status === 400 && /temperature/.test(e.message) && e.param === 'temperature' && e.type === 'invalid_request_error'); checks++;
    const bad = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'wrong', maxRetries: 0 });
    await assert.rejects(bad.models.list(),
      (e) => e instanceof OpenAI.AuthenticationError && e.status === 401 && e.code === 'invalid_api_key'); checks++;

    // Billing total equals the sum over sessions.
    const report = await call(base, '/v1/usage');
    assert.equal(report.usage.sample, report.sessions.reduce((a, s) => a + s.usage.sample, 0)); checks++;
    console.log(`openai client test: ${checks} checks passed`);
  } finally {
    server.kill('SIGTERM');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
