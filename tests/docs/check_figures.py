#!/usr/bin/env python3
"""Every published figure names where it came from: the commit it was measured at and the command that measured it.

Checks README.md, bench/README.md, docs/*.md and examples/*/README.md (or the files given with --files). A figure is

  - a table of figures: a markdown table (a header row, a |---| row, body rows) with at least one body cell that is
    a number: digits with an optional sign, decimals, exponent, thousands commas, ranges or arrows between numbers,
    and an optional unit or suffix (%, x, s, ms, MB, tok/s, ...), markdown emphasis and a trailing "(...)" aside
    allowed: "95.1", "**1.34x**", "2.0e-06", "97.8%", "0.18 → 0.56", "62 s (1.4x)". Tables of names and words (a
    list of options, of files, of models) are not figures;
  - a line with a measured unit: a number followed by one of
      s, ms, us, µs, min, h (time: "32 s", "11 min 13 s", "0.5s"), tok/s, tokens/s, tokens per second,
      KB, KiB, MB, MiB, GB, GiB (sizes), x (a ratio, written against the number: "1.3x", "0.82x")
    as a whole word: "2 steps", "3 seeds", "x86", "0x1F", "4x4", "2 cores" are not figures. Code spans (`...`) are
    removed from a line first: `--timeout-s 60` and `RLLOOP_CPU_CACHE_MB=512` are settings, not figures, and a
    setting or a limit written in prose goes in a code span too ("polls every `2 s`", "default `1 MiB`"). Lines of
    fenced code blocks count (recorded output is a figure), except in blocks marked as a programming language
    (cpp, c++, python, py, js, json, cmake, yaml, toml), which hold code.

A figure's section is the text from the nearest heading above it (any level; the file's start when there is none)
to the next heading. The section must name
  - a commit: a word of 7 to 40 lowercase hex digits; when the checkout has its full history (not shallow), the
    word must be a commit of it (git cat-file), so an invented hash fails; without the history, a word with a digit
    and a letter, or one written after the word "commit" (2933634 is a commit, 3000000 a number); and
  - a command: a code span, a fenced block (bash, sh, console or unmarked) or an indented block whose line runs a
    program: after optional VAR=value settings and a "$ " prompt, its first word is a program's path (holds a "/"
    and has arguments, or is under build/ or a bin/, or ends in .sh, .py or .js: build/bin/rlloop, scripts/test.sh;
    not a source file such as src/engine/runtime/loss.cpp) or a known tool (ctest, cmake, python, python3, node, npm, bash,
    sh, rlloop, git, make, taskset, numactl, time, env, perf, llama-bench, llama-cli, curl, docker), or a word
    followed by a --flag (hf_logits --logprobs).
A section whose figures come from nowhere that can be found says so: the words "unsourced" (any case) in the
section stand for both, so that the gap is written where a reader sees it, not hidden.

Prints file:line: reason for each figure of a failing section (the first line of a table) and exits 1 when any
fails. --pending FILE... names files (relative to REPO_ROOT) whose problems are printed as pending but do not fail,
for docs whose owners have yet to source them; a pending file with no problem left fails, so that the list cannot
outlive its reason. --self-test runs the checker on sample documents with and without their sources and checks the
verdicts.

Usage: check_figures.py REPO_ROOT [--files FILE...] [--pending FILE...] | check_figures.py REPO_ROOT --self-test
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

UNITS = r"(?:s|ms|us|µs|min|h|tok/s|tokens/s|tokens per second|KB|KiB|MB|MiB|GB|GiB)"
NUMBER = r"\d(?:[\d,]*\d)?(?:\.\d+)?"
# A number, a space or none, a unit, and no word character after it ("2 steps" and "x86" are not figures).
UNIT_FIGURE = re.compile(r"(?<![\w.])" + NUMBER + r"(?:\s?" + UNITS + r"|x)(?![\w/])")
NUMERIC_CELL = re.compile(
    r"^[~≈<>≤≥+\-−]?\s*" + NUMBER + r"(?:e[+-]?\d+)?\s*(?:%|x|" + UNITS + r")?"
    r"(?:\s*(?:→|->|-|–|to|/|±)\s*[~≈+\-−]?" + NUMBER + r"(?:e[+-]?\d+)?\s*(?:%|x|" + UNITS + r")?)*"
    r"(?:\s*\([^)]*\))?$")
HEADING = re.compile(r"^#{1,6}\s")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
CODE_LANGUAGES = {"cpp", "c++", "c", "python", "py", "js", "javascript", "json", "cmake", "yaml", "toml", "jinja",
                  "text"}
SHELL_LANGUAGES = {"", "bash", "sh", "console", "shell"}
CODE_SPAN = re.compile(r"`([^`]+)`")
HASH = re.compile(r"(?<![\w/.-])([0-9a-f]{7,40})(?![\w-])")
AFTER_COMMIT = re.compile(r"\bcommits?\s+([0-9a-f]{7,40})(?![\w-])")
TOOLS = {"ctest", "cmake", "python", "python3", "node", "npm", "bash", "sh", "rlloop", "git", "make", "taskset",
         "numactl", "time", "env", "perf", "llama-bench", "llama-cli", "curl", "docker"}


def runs_something(text):
    """Whether a line of code (a span or a block's line) runs a program."""
    text = text.strip()
    if text.startswith("$ "):
        text = text[2:]
    words = text.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=\S*$", words[0]):
        words = words[1:]
    if not words or words[0].startswith("-") or words[0].startswith("#"):
        return False
    first = words[0]
    if "/" in first and not first.startswith("http") and re.match(r"^[\w./-]+$", first):
        # A path runs something when it is given arguments or is a program: under build/ or bin/, ./x, a script.
        return (len(words) > 1 or first.startswith(("build/", "./", "bin/")) or "/bin/" in first
                or first.endswith((".sh", ".py", ".js")))
    if first in TOOLS:
        return True
    return re.match(r"^[\w.-]+$", first) is not None and any(w.startswith("--") for w in words[1:])


class Section:
    def __init__(self, line):
        self.line = line  # the heading's line (0: the file's start)
        self.commits = set()
        self.command = False
        self.unsourced = False
        self.figures = []  # (line, what)


def parse(path):
    """The file's sections with what they name and the figures they hold."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    sections = [Section(0)]
    fence = None  # the open fence's language, None outside a block
    table_start = None
    for number, line in enumerate(lines, 1):
        section = sections[-1]
        opening = FENCE.match(line)
        if fence is not None:
            if opening and not opening.group(2):
                fence = None
                continue
            if fence in SHELL_LANGUAGES and runs_something(line):
                section.command = True
            if fence not in CODE_LANGUAGES and UNIT_FIGURE.search(line):
                section.figures.append((number, "a figure with a unit in a code block"))
            section.commits.update(HASH.findall(line) + ["commit " + h for h in AFTER_COMMIT.findall(line)])
            continue
        if opening:
            fence = opening.group(2).lower()
            continue
        if HEADING.match(line):
            sections.append(Section(number))
            section = sections[-1]
        if re.search(r"unsourced", line, re.IGNORECASE):
            section.unsourced = True
        if line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")) and runs_something(line):
            section.command = True
        spans = CODE_SPAN.findall(line)
        if any(runs_something(s) for s in spans):
            section.command = True
        section.commits.update(HASH.findall(line) + ["commit " + h for h in AFTER_COMMIT.findall(line)])
        prose = CODE_SPAN.sub("", line)
        # Tables: the header row, then |---|; a table of figures has a numeric body cell.
        if line.lstrip().startswith("|"):
            if table_start is None:
                table_start = number
            cells = [c.strip().strip("*_ ").strip() for c in line.strip().strip("|").split("|")]
            separator = all(re.match(r"^:?-{3,}:?$", c) for c in cells if c)
            if number > table_start + 1 and not separator and any(NUMERIC_CELL.match(c) for c in cells):
                if not any(start == table_start for start, _ in section.figures):
                    section.figures.append((table_start, "a table of figures"))
            continue
        table_start = None
        if UNIT_FIGURE.search(prose):
            section.figures.append((number, "a figure with a unit: '" + UNIT_FIGURE.search(prose).group(0) + "'"))
    return sections


def commit_exists(root, candidates, cache={}):
    """Whether one of the hex words is a commit; any of them when the history cannot say (a shallow checkout)."""
    if "full" not in cache:
        try:
            shallow = subprocess.run(["git", "-C", root, "rev-parse", "--is-shallow-repository"],
                                     capture_output=True, text=True, timeout=30)
            cache["full"] = shallow.returncode == 0 and shallow.stdout.strip() == "false"
        except (OSError, subprocess.SubprocessError):
            cache["full"] = False
    if not cache["full"]:
        return any(c.startswith("commit ") or (re.search(r"\d", c) and re.search(r"[a-f]", c)) for c in candidates)
    for c in candidates:
        c = c.removeprefix("commit ")
        if c not in cache:
            r = subprocess.run(["git", "-C", root, "cat-file", "-e", c + "^{commit}"], capture_output=True, timeout=30)
            cache[c] = r.returncode == 0
        if cache[c]:
            return True
    return False


def check(root, files):
    """file:line: reason for every figure whose section names no commit or no command."""
    problems = []
    for path in files:
        shown = os.path.relpath(path, root)
        for section in parse(path):
            if not section.figures or section.unsourced:
                continue
            missing = []
            if not commit_exists(root, section.commits):
                missing.append("no commit")
            if not section.command:
                missing.append("no command")
            if not missing:
                continue
            where = f"the section at line {section.line}" if section.line else "the text before the first heading"
            for number, what in section.figures:
                problems.append(f"{shown}:{number}: {what}, and {where} names {' and '.join(missing)}")
    return problems


def default_files(root):
    files = [os.path.join(root, "README.md"), os.path.join(root, "bench", "README.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(root, "examples", "*", "README.md")))
    return [f for f in files if os.path.exists(f)]


SAMPLE_SOURCED = """# Speed

Measured at commit {commit} with `build/bin/rlloop sample --model m --timing`:

| model | tokens/s |
|-------|----------|
| tiny  | **95.1** |

It is 1.3x the other.
"""

SAMPLE_CASES = [
    # (name, document, problems expected)
    ("sourced", SAMPLE_SOURCED, 0),
    ("no commit", SAMPLE_SOURCED.replace("at commit {commit} ", ""), 2),
    ("invented commit", SAMPLE_SOURCED.replace("{commit}", "abc1234"), 2),
    ("no command", SAMPLE_SOURCED.replace("`build/bin/rlloop sample --model m --timing`", "the tool"), 2),
    ("a heading between", SAMPLE_SOURCED.replace("| model", "## Table\n\n| model"), 2),
    ("unsourced", SAMPLE_SOURCED.replace("at commit {commit} ", "(unsourced) "), 0),
    ("prose only", "# Notes\n\nx86 machines with 2 cores run 3 seeds for 40 steps; see `--timeout-s 60`.\n\n"
                   "| option | meaning |\n|---|---|\n| `--seed` | the seed |\n", 0),
    ("time in prose", "# Notes\n\nThe tests take 11 min 13 s.\n", 1),
    ("output block", "# Run\n\n```\ntiming: 4 sequences, 95.1 tokens/s\n```\n", 1),
    ("code block", "# API\n\n```cpp\nauto t = 2.5x;  // 3 s\n```\n", 0),
    ("a source file is no command", SAMPLE_SOURCED.replace("`build/bin/rlloop sample --model m --timing`",
                                                           "`src/engine/sample.cpp`"), 2),
]


def self_test(root):
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True)
    commit = head.stdout.strip() if head.returncode == 0 else "0123abc"
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, doc, expected in SAMPLE_CASES:
            path = os.path.join(tmp, name.replace(" ", "_") + ".md")
            with open(path, "w", encoding="utf-8") as f:
                f.write(doc.replace("{commit}", commit))
            problems = check(root, [path])
            verdict = "ok" if len(problems) == expected else "WRONG"
            print(f"self-test {name}: {len(problems)} problem(s), expected {expected}: {verdict}")
            for p in problems:
                print("    " + p)
            failures += len(problems) != expected
    if failures:
        print(f"check_figures --self-test: {failures} case(s) judged wrongly")
        return 1
    print("check_figures --self-test: every sample judged as expected")
    return 0


def listed(argv, flag):
    """The arguments after `flag`, up to the next option."""
    if flag not in argv:
        return []
    rest = argv[argv.index(flag) + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    root = os.path.abspath(argv[1])
    if "--self-test" in argv:
        return self_test(root)
    files = listed(argv, "--files") or default_files(root)
    pending = set(listed(argv, "--pending"))
    problems, failed = check(root, files), False
    for p in problems:
        pended = p.split(":", 1)[0] in pending
        print(("pending (not failing): " if pended else "") + p)
        failed = failed or not pended
    for f in sorted(pending):
        if not any(p.startswith(f + ":") for p in problems):
            print(f"{f}: on the --pending list but every figure of it is sourced: take it off the list")
            failed = True
    held = [p for p in problems if p.split(":", 1)[0] in pending]
    if failed and len(problems) == len(held):
        print("check_figures: the --pending list names a file that passes")
        return 1
    if failed:
        print(f"check_figures: {len(problems) - len(held)} figure(s) in sections that name no commit or no command "
              "(add both, or write 'unsourced' where the source cannot be found; a setting or a limit, not a "
              "measurement, goes in a code span)")
        return 1
    print(f"check_figures: every figure of {len(files)} file(s) names its commit and command"
          + (f", except {len(held)} in the pending file(s) {', '.join(sorted(pending))}" if held else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
