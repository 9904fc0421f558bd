#!/usr/bin/env python3
"""No catch-all over LossFn: a `switch` over a LossFn (one with a `case LossFn::...` label, or whose subject names
LossFn or a spec's `.fn`) must list every enumerator and have no `default:`, so that -Wswitch (-Werror in CI) stops
the build at a loss that some switch forgets. An `if` chain ending in a fallback is the same catch-all; this test
cannot see those, which is why the losses' rows (rlloop/loss.hpp) replace such chains rather than sit beside them.

Usage: no_catch_all_test.py ROOT [DIR ...]   scans ROOT/DIR (default: src include) for *.cpp / *.hpp
       no_catch_all_test.py --self-test      checks the scanner on snippets with and without a catch-all
Exit status 1 lists each offending switch as path:line.
"""
import pathlib
import re
import sys

SWITCH = re.compile(r"\bswitch\s*\(")
LOSS_CASE = re.compile(r"\bcase\s+(?:rlloop::)?LossFn::")
LOSS_SUBJECT = re.compile(r"\bLossFn\b|(?:\.|->)fn\b")
DEFAULT = re.compile(r"\bdefault\s*:")


def strip_comments_and_strings(text):
    """Blanks comments, string and character literals, keeping line breaks so line numbers stay right."""
    out, i, n = [], 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote:
                j += 2 if text[j] == "\\" else 1
            out.append(quote + " " * (min(j, n) - i - 1) + quote)
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def matching(text, start, open_char, close_char):
    """Index just past the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_char:
            depth += 1
        elif text[i] == close_char:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def own_level(body):
    """The switch body without the bodies of switches nested in it (their labels are theirs)."""
    out, i = [], 0
    while True:
        m = SWITCH.search(body, i)
        if not m:
            out.append(body[i:])
            return "".join(out)
        out.append(body[i:m.start()])
        brace = body.find("{", matching(body, m.end() - 1, "(", ")"))
        i = len(body) if brace < 0 else matching(body, brace, "{", "}")


def catch_alls(text):
    """Line numbers of the switches over LossFn in `text` that have a default label."""
    code = strip_comments_and_strings(text)
    found = []
    for m in SWITCH.finditer(code):
        subject_end = matching(code, m.end() - 1, "(", ")")
        brace = code.find("{", subject_end)
        if brace < 0:
            continue
        body = own_level(code[brace + 1:matching(code, brace, "{", "}") - 1])
        over_loss = LOSS_CASE.search(body) or LOSS_SUBJECT.search(code[m.end():subject_end - 1])
        if over_loss and DEFAULT.search(body):
            found.append(code.count("\n", 0, m.start()) + 1)
    return found


def scan(root, dirs):
    bad = []
    for d in dirs:
        for path in sorted((root / d).rglob("*")):
            if path.suffix in (".cpp", ".hpp", ".h", ".cc") and path.is_file():
                for line in catch_alls(path.read_text(encoding="utf-8", errors="replace")):
                    bad.append(f"{path.relative_to(root)}:{line}")
    return bad


def self_test():
    cases = {
        # A default beside LossFn cases: caught.
        "switch (spec.fn) {\n case LossFn::ppo: return 1;\n default: return 0;\n}": [1],
        # Every enumerator, no default: fine.
        "switch (f) {\n case LossFn::ppo: return 1;\n case LossFn::dro: return 2;\n}": [],
        # Only a default, but the subject is a spec's fn: caught.
        "int x;\n switch (loss.fn) { default: break; }": [2],
        # A default in a switch over something else, nested in one over LossFn: not the LossFn switch's.
        "switch (f) {\n case LossFn::ppo:\n  switch (c) { case 'a': break; default: break; }\n  break;\n}": [],
        # The LossFn switch nested in another switch with a default: only the inner one counts, and it is clean.
        "switch (k) {\n case 1:\n  switch (f) { case LossFn::ppo: break; }\n  break;\n default: break;\n}": [],
        # Words in comments and strings do not count.
        "// switch (spec.fn) { default: }\nconst char* s = \"switch (x.fn) { default: }\";": [],
    }
    ok = True
    for snippet, expected in cases.items():
        got = catch_alls(snippet)
        if got != expected:
            ok = False
            print(f"self-test: expected {expected}, got {got} for:\n{snippet}\n")
    print("self-test " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv):
    if len(argv) >= 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) < 2:
        print(__doc__)
        return 2
    root = pathlib.Path(argv[1])
    dirs = argv[2:] or ["src", "include"]
    bad = scan(root, dirs)
    for b in bad:
        print(f"{b}: a switch over LossFn with a default label: list every enumerator instead (-Wswitch checks it)")
    print(f"{len(bad)} catch-all switch(es) over LossFn under {', '.join(dirs)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
