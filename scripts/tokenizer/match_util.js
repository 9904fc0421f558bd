// What the tokenizer match scripts share: their command line, running `rlloop tokenize` over lines of JSON, and
// comparing its outputs with a reference's, input by input, printing the first mismatches and counting them.
'use strict';
const fs = require('fs');
const { spawnSync } = require('child_process');

// The value after `name` on the command line, or `fallback`.
function arg(name, fallback) {
  const at = process.argv.indexOf(name);
  return at >= 0 ? process.argv[at + 1] : fallback;
}

// A missing input: exit 77 (skipped) outside CI, 1 under CI=true, naming it.
function skip(script, what) {
  console.error(`${script}: ${what}`);
  process.exit(process.env.CI === 'true' ? 1 : 77);
}

// The --rlloop binary, or exit 1 saying how to pass it.
function rlloopBinary(script) {
  const rlloop = arg('--rlloop');
  if (!rlloop || !fs.existsSync(rlloop)) {
    console.error(`${script}: rlloop binary not found ('${rlloop}'); pass --rlloop build/bin/rlloop`);
    process.exit(1);
  }
  return rlloop;
}

// A function (tokenizer, flags, values) -> the parsed output lines of `rlloop tokenize --tokenizer T FLAGS` fed
// one JSON value per line; exits the script (named in the message) when rlloop fails or answers short.
function tokenizeWith(rlloop, script) {
  return (tokenizer, flags, values) => {
    const input = values.map((v) => JSON.stringify(v)).join('\n') + '\n';
    const r = spawnSync(rlloop, ['tokenize', '--tokenizer', tokenizer, ...flags], { input, maxBuffer: 1 << 30 });
    if (r.status !== 0) {
      console.error(`${script}: rlloop tokenize ${flags.join(' ')} failed (${r.status}): ${r.stderr}`);
      process.exit(1);
    }
    const lines = r.stdout.toString('utf8').split('\n');
    lines.pop();
    if (lines.length !== values.length) {
      console.error(`${script}: rlloop tokenize returned ${lines.length} lines for ${values.length} inputs`);
      process.exit(1);
    }
    return lines.map((l) => JSON.parse(l));
  };
}

// compare(label, inputs, got, want) prints "ok"/"FAIL" with the count of identical outputs and the first five
// mismatches (the reference named `reference`); failures() is the total of mismatches so far.
function comparer(reference) {
  let failures = 0;
  const name = (reference + ':').padEnd(11);
  return {
    compare(label, inputs, got, want) {
      let bad = 0;
      for (let i = 0; i < inputs.length; ++i) {
        if (JSON.stringify(got[i]) === JSON.stringify(want[i])) continue;
        if (++bad <= 5)
          console.error(`MISMATCH [${label}] input=${JSON.stringify(inputs[i]).slice(0, 200)}\n` +
                        `  rlloop:    ${JSON.stringify(got[i]).slice(0, 300)}\n` +
                        `  ${name}${JSON.stringify(want[i]).slice(0, 300)}`);
      }
      console.log(`${bad ? 'FAIL' : 'ok  '} ${label}: ${inputs.length - bad}/${inputs.length} identical`);
      failures += bad;
    },
    failures: () => failures,
  };
}

module.exports = { arg, skip, rlloopBinary, tokenizeWith, comparer };
