#!/usr/bin/env python3
"""No function over 80 lines in the engine, the wire layer or the server (issue 44, must-show 5).

A function's length is the lines from the first line of its signature (template line included) to its closing
brace. The scan matches braces over the source with comments, string and character literals and preprocessor lines
removed: a brace at namespace or class scope opens a namespace, a class (whose members are scanned in turn), a
function (its whole body is one function: lambdas and local classes inside count towards it) or anything else (an
enum, an initializer), told apart by the text before it. A constructor's member initializers written with braces
are part of its signature, not its body.

Usage: function_length_test.py ROOT [--allow FILE] [--limit N] [--max-file-lines PATH=N ...]   (ROOT: the
       repository; scans src/engine, src/wire, src/server; PATH, relative to ROOT, may have at most N lines)
       function_length_test.py --self-test
The allow-list names the functions not yet split, one "path:qualified name" a line ('#' comments): they may stay
over the limit, every other function may not, and an entry that is no longer over it (or no longer there) fails the
test too, so the list only shrinks.
"""
import argparse
import os
import re
import sys
import tempfile

DIRS = ("src/engine", "src/wire", "src/server")
SUFFIXES = (".cpp", ".hpp", ".h", ".cc")


def strip_source(text):
    """The text with comments, literals and preprocessor lines blanked (newlines kept, so lines still count)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append("\n")
                    i += 2
                    continue
                i += 1
            continue
        line_start = False
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("\n" * text.count("\n", i, end))
            i = end
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20])
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = ")" + raw.group(1) + '"'
            end = text.find(close, i + raw.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
            continue
        if c in "\"'":
            # A digit separator (1'000) is no character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        if c == "\n":
            line_start = True
        out.append(c)
        i += 1
    return "".join(out)


OPERATOR = re.compile(r"\boperator\s*(\(\s*\)|[^\s(]+)")
ACCESS = re.compile(r"^\s*(public|private|protected)\s*:")
TEMPLATE = re.compile(r"^\s*template\s*<")


def drop_template_prefix(header):
    h = header
    while True:
        m = TEMPLATE.match(h)
        if not m:
            return h
        depth, j = 0, m.end() - 1
        while j < len(h):
            if h[j] == "<":
                depth += 1
            elif h[j] == ">":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        h = h[j + 1:]


def top_level(header, ch):
    """Whether `ch` occurs in header outside parentheses."""
    depth = 0
    for c in header:
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == ch and depth == 0:
            return True
    return False


def classify(header):
    """'namespace', 'class', 'function' or 'other' for the text before a brace at namespace or class scope."""
    h = ACCESS.sub("", header).strip()
    if re.match(r"^(inline\s+)?namespace\b", h) or re.match(r'^extern\s*""', h):
        return "namespace", None
    h = drop_template_prefix(h).strip()
    if re.match(r"^(class|struct|union)\b", h):
        m = re.match(r"^(class|struct|union)\s+(?:\[\[[^\]]*\]\]\s*|alignas\s*\([^)]*\)\s*)*([\w:]+)", h)
        return "class", (m.group(2) if m else "")
    if re.match(r"^enum\b", h):
        return "other", None
    plain = OPERATOR.sub("operator", h)
    if "(" not in plain or top_level(plain.split("(")[0], "="):
        return "other", None
    # A lambda or initializer: '=' outside parentheses before the body, or the header ends in one.
    if top_level(plain, "=") and not re.search(r"\)\s*(const\s*)?=\s*(default|delete|0)\s*$", plain):
        return "other", None
    m = re.search(r"((?:[\w~]+\s*::\s*)*(?:operator|~?\w+))\s*(?:<[^()]*>)?\s*\(", plain)
    return "function", (re.sub(r"\s+", "", m.group(1)) if m else "?")


def functions(text):
    """(qualified name, first line, last line) of every function defined at namespace or class scope."""
    s = strip_source(text)
    found = []
    scopes = []  # (kind, name) of each open brace at namespace / class scope
    header_start = 0
    i, n = 0, len(s)
    init_list = re.compile(r"\)\s*(noexcept\s*)?:(?!:)")
    while i < n:
        c = s[i]
        if c in ";}" or (c == ":" and ACCESS.match(s[header_start:i + 1])):
            if c == "}" and scopes:
                scopes.pop()
            header_start = i + 1
            i += 1
            continue
        if c != "{":
            i += 1
            continue
        header = s[header_start:i]
        # A member initialised with braces in a constructor's initializer list: part of the signature.
        if init_list.search(header) and re.search(r"[\w>]\s*$", header) and \
                not re.search(r"\b(const|override|final|noexcept|mutable)\s*$", header):
            i = matching(s, i) + 1
            continue
        kind, name = classify(header)
        if kind in ("namespace", "class"):
            scopes.append((kind, name))
            header_start = i + 1
            i += 1
            continue
        end = matching(s, i)
        if kind == "function":
            lead = len(header) - len(header.lstrip())
            access = ACCESS.match(header)
            if access:
                lead = access.end() + len(header[access.end():]) - len(header[access.end():].lstrip())
            first = s.count("\n", 0, header_start + lead) + 1
            last = s.count("\n", 0, end) + 1
            classes = [nm for k, nm in scopes if k == "class" and nm]
            found.append(("::".join(classes + [name]), first, last))
        header_start = end + 1
        i = end + 1
    return found


def matching(s, i):
    depth = 0
    for j in range(i, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


def scan(root, limit):
    """{"path:name": lines} of the functions over `limit` lines under root's DIRS."""
    over = {}
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if not f.endswith(SUFFIXES):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                rel = os.path.relpath(path, root)
                for name, first, last in functions(text):
                    lines = last - first + 1
                    if lines > limit:
                        key = f"{rel}:{name}"
                        over[key] = max(lines, over.get(key, 0))
    return over


def read_allow(path):
    allowed = []
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.split("#", 1)[0].strip()
                if line:
                    allowed.append(line)
    return allowed


def check(root, allow_path, limit):
    over = scan(root, limit)
    allowed = read_allow(allow_path)
    problems = []
    for key, lines in sorted(over.items()):
        if key not in allowed:
            problems.append(f"{key}: {lines} lines (over {limit}; split it)")
    for key in allowed:
        if key not in over:
            problems.append(f"{key}: allow-listed but no longer over {limit} lines: remove it from "
                            f"{os.path.basename(allow_path)}")
    for p in problems:
        print(p)
    print(f"{len(over)} function(s) over {limit} lines, {len(allowed)} allow-listed, {len(problems)} problem(s)")
    return 1 if problems else 0


def body(lines):
    return "\n".join(f"  x += {i};" for i in range(lines))


def self_test():
    """A planted 81-line function is found and an 80-line one is not, in the shapes the scan must tell apart."""
    # Lines of a definition: signature line + body lines + closing brace.
    src = "\n".join([
        "#include <array>",
        "namespace a {",
        "const std::array<int, 3> kTable = {1, 2, 3};",
        "// void commented(int x) {",
        "struct Holder {",
        "  int x = 0;",
        "  void member_ok() {", body(78), "  }",
        " public:",
        "  void member_long() {", body(79), "  }",
        "};",
        "Holder::Holder(int v) : x_{v}, y_(v) {", body(78), "}",
        'int planted(const char* s = "}{") {', body(79), "}",
        "}  // namespace a",
    ]) + "\n"
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "src/engine/model"))
        with open(os.path.join(root, "src/engine/model/planted.cpp"), "w") as fh:
            fh.write(src)
        over = scan(root, 80)
        want = {"src/engine/model/planted.cpp:planted": 81,
                "src/engine/model/planted.cpp:Holder::member_long": 81}
        if over != want:
            print(f"self-test: found {over}, want {want}")
            return 1
        allow = os.path.join(root, "allow.txt")
        with open(allow, "w") as fh:
            fh.write("# planted\nsrc/engine/model/planted.cpp:planted\n"
                     "src/engine/model/planted.cpp:Holder::member_long\n")
        if check(root, allow, 80) != 0:
            print("self-test: the allow-listed functions failed")
            return 1
        with open(allow, "a") as fh:
            fh.write("src/engine/model/planted.cpp:Holder::member_ok\n")  # not over: a stale entry
        if check(root, allow, 80) == 0:
            print("self-test: a stale allow-list entry passed")
            return 1
        with open(allow, "w") as fh:
            fh.write("src/engine/model/planted.cpp:planted\n")
        if check(root, allow, 80) == 0:
            print("self-test: an 81-line member function missing from the allow-list passed")
            return 1
    print("self-test passed")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", nargs="?")
    ap.add_argument("--allow")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-file-lines", action="append", default=[], metavar="PATH=N",
                    help="a file (relative to ROOT) that may have at most N lines")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.root:
        ap.error("ROOT is required")
    status = check(args.root, args.allow, args.limit)
    for spec in args.max_file_lines:
        path, _, most = spec.rpartition("=")
        with open(os.path.join(args.root, path)) as f:
            lines = sum(1 for _ in f)
        if lines > int(most):
            print(f"{path} has {lines} lines, over its {most}: move a part with one job into a file of its own")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
