#!/usr/bin/env python3
"""No catch-all over the operations or the journal's record kinds (issue 44, "What it must show" 4), beside
tests/core/no_catch_all_test.py (LossFn):

1. A visitor written as an `if constexpr (std::is_same_v<T, ...>)` chain ends in
   `else static_assert(rlloop::detail::unhandled_alternative<T>, ...)`, so that an operation no branch handles stops
   the build instead of running through a branch meant for another one (or none).
2. No chain of std::get_if / std::holds_alternative over the operations' request and result shapes (those bound in
   src/wire/operations.hpp): two or more in one function are a dispatch that silently skips an operation it forgets.
   One such test alone (is this a sample?) is a question, not a dispatch.
3. The journal's record kinds (`type == "..."` chains in src/server/journal.cpp) end in an `else` that throws.

Usage: no_operation_catch_all_test.py ROOT [DIR ...]   scans ROOT/DIR (default: src/wire src/server)
       no_operation_catch_all_test.py --self-test      checks the scanner on snippets
Exit status 1 lists each offence as path:line.
"""
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "core"))
from no_catch_all_test import matching, strip_comments_and_strings  # noqa: E402

IS_SAME_IF = re.compile(r"\bif\s+constexpr\s*\(\s*std::is_same_v\s*<")
ELSE = re.compile(r"\s*else\b")
ELSE_IF_CONSTEXPR = re.compile(r"\s*else\s+if\s+constexpr\s*\(")
FUNCTION_START = re.compile(r"^[A-Za-z].*[)]\s*(const\s*)?(override\s*)?\{\s*$", re.M)
KIND_IF = re.compile(r"\bif\s*\(\s*type\s*==\s*\"")
BOUND = re.compile(r"Bound<\s*Call::\w+\s*,\s*(\w+)\s*,\s*(\w+)\s*>")


def statement_end(code, i):
    """Index just past the statement starting at or after i (a braced block or one statement ending in ';')."""
    while i < len(code) and code[i].isspace():
        i += 1
    if i < len(code) and code[i] == "{":
        return matching(code, i, "{", "}")
    depth = 0
    for j in range(i, len(code)):
        if code[j] in "({[":
            depth += 1
        elif code[j] in ")}]":
            depth -= 1
        elif code[j] == ";" and depth == 0:
            return j + 1
    return len(code)


def chain_tail(code, start, head):
    """Follows an if / else-if chain from the `if` at `start`; returns the final else's text, or None without one."""
    i = start
    while True:
        cond_open = code.index("(", i + len("if"))
        i = statement_end(code, matching(code, cond_open, "(", ")"))
        m = ELSE.match(code, i)
        if not m:
            return None
        nxt = head.match(code, i)
        if nxt:
            i = code.index("if", i)
            continue
        return code[m.end():statement_end(code, m.end())]


def is_same_catch_alls(code):
    found, inner = [], set()
    for m in IS_SAME_IF.finditer(code):
        if m.start() in inner:
            continue
        # Skip an `if` that is itself a chain's `else if`.
        before = code[:m.start()].rstrip()
        if before.endswith("else"):
            continue
        tail = chain_tail(code, m.start(), ELSE_IF_CONSTEXPR)
        if tail is None or "unhandled_alternative" not in tail:
            found.append(code.count("\n", 0, m.start()) + 1)
    return found


def kind_catch_alls(code):
    found = []
    for m in KIND_IF.finditer(code):
        if code[:m.start()].rstrip().endswith("else"):
            continue
        tail = chain_tail(code, m.start(), re.compile(r"\s*else\s+if\s*\("))
        # A chain that returns from each branch has no else; one with an else must reject the unknown kind.
        if tail is not None and "throw" not in tail:
            found.append(code.count("\n", 0, m.start()) + 1)
    return found


def alternative_chains(code, shapes):
    if not shapes:
        return []
    test = re.compile(r"std::(?:get_if|holds_alternative)\s*<\s*(?:rlloop::)?(?:wire::)?(" + "|".join(shapes) +
                      r")\s*>")
    found = []
    starts = [m.start() for m in FUNCTION_START.finditer(code)] + [len(code)]
    for a, b in zip(starts, starts[1:]):
        hits = list(test.finditer(code, a, b))
        if len(hits) >= 2:
            found.append(code.count("\n", 0, hits[1].start()) + 1)
    return found


def shapes_of(root):
    path = root / "src" / "wire" / "operations.hpp"
    if not path.exists():
        return []
    return sorted({name for pair in BOUND.findall(path.read_text()) for name in pair})


def offences(text, shapes, journal):
    code = strip_comments_and_strings(text)
    out = [(n, "an is_same_v visitor chain without `else static_assert(unhandled_alternative<T>)`")
           for n in is_same_catch_alls(code)]
    out += [(n, "a chain of get_if / holds_alternative over the operations: visit them exhaustively")
            for n in alternative_chains(code, shapes)]
    if journal:
        out += [(n, "a chain over journal record kinds whose else does not reject the unknown kind")
                for n in kind_catch_alls(text_with_strings(text))]
    return out


def text_with_strings(text):
    """Comments blanked, string literals kept (the journal's kinds are strings)."""
    return re.sub(r"//[^\n]*", lambda m: " " * len(m.group(0)), text)


def scan(root, dirs):
    shapes = shapes_of(root)
    bad = []
    for d in dirs:
        for path in sorted((root / d).rglob("*")):
            if path.suffix in (".cpp", ".hpp") and path.is_file():
                text = path.read_text(encoding="utf-8", errors="replace")
                for line, why in offences(text, shapes, path.name == "journal.cpp"):
                    bad.append(f"{path.relative_to(root)}:{line}: {why}")
    return bad


def self_test():
    shapes = ["ForwardOp", "LoadStateOp", "SampleRequest"]
    exhaustive = ("auto f = [](const auto& o) {\n  using T = std::decay_t<decltype(o)>;\n"
                  "  if constexpr (std::is_same_v<T, A>) return 1;\n"
                  "  else if constexpr (std::is_same_v<T, B>) { return 2; }\n"
                  "  else static_assert(rlloop::detail::unhandled_alternative<T>, \"x\");\n};\n")
    cases = [
        (exhaustive, False, []),
        (exhaustive.replace("static_assert(rlloop::detail::unhandled_alternative<T>, \"x\");", "return 0;"), False,
         [3]),
        (exhaustive.replace("  else static_assert(rlloop::detail::unhandled_alternative<T>, \"x\");\n", ""), False,
         [3]),
        ("int f(V v) {\n  if (std::get_if<wire::ForwardOp>(&v)) return 1;\n"
         "  if (std::holds_alternative<LoadStateOp>(v)) return 2;\n  return 0;\n}\n", False, [3]),
        ("bool is_sample(V v) {\n  return std::holds_alternative<SampleRequest>(v);\n}\n", False, []),
        ("void apply() {\n  if (type == \"a\") {\n    x();\n  } else if (type == \"b\") {\n    y();\n"
         "  } else {\n    throw E(\"unknown\");\n  }\n}\n", True, []),
        ("void apply() {\n  if (type == \"a\") {\n    x();\n  } else if (type == \"b\") {\n    y();\n"
         "  } else {\n    z();\n  }\n}\n", True, [2]),
        ("// if constexpr (std::is_same_v<T, A>) return 1; else return 0;\n", False, []),
    ]
    ok = True
    for snippet, journal, expected in cases:
        got = sorted(n for n, _ in offences(snippet, shapes, journal))
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
    dirs = argv[2:] or ["src/wire", "src/server"]
    shapes = shapes_of(root)
    if not shapes:
        print("no operation shapes found in src/wire/operations.hpp")
        return 1
    bad = scan(root, dirs)
    for b in bad:
        print(b)
    print(f"{len(bad)} catch-all(s) over operations or journal kinds under {', '.join(dirs)} "
          f"({len(shapes)} operation shapes)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
