#!/usr/bin/env python3
"""A local session asks its executor, it does not branch on the parallel mode.

src/engine/session/executor.hpp: LocalSession delegates every operation to one executor (single rank, data
parallel, expert parallel; make_executor is the one place that tells them apart). This check keeps it so:

  - local_session.cpp and session_core.cpp hold no branch on the mode: no `group ? ... : ...`, `if (group ...)`,
    `group && ...`, no `expert_parallel()` or `expert_group()` call (comments and strings are not read);
  (function length is engine_function_length's check: tests/engine/function_length_test.py).

  no_mode_branches_test.py SRC_ENGINE_DIR              check the tree; prints each finding and exits 1
  no_mode_branches_test.py SRC_ENGINE_DIR --self-test  check a copy with three branches planted in
                                                       local_session.cpp (and one in a comment): exactly those
                                                       three must be reported
"""
import os
import re
import shutil
import sys
import tempfile

MODE_AGNOSTIC = ['session/local_session.cpp', 'session/session_core.cpp']
BRANCHES = [
    (re.compile(r'\bgroup\s*\?'), 'a `group ? ... : ...` on the mode'),
    (re.compile(r'\bif\s*\(\s*!?\s*(?:[\w>.-]*(?:->|\.))?group\b'), 'an `if` on the group'),
    (re.compile(r'\bgroup\s*(?:&&|\|\|)'), 'a `group &&` / `group ||` on the mode'),
    (re.compile(r'\bexpert_parallel\s*\(\s*\)'), 'an expert_parallel() check'),
    (re.compile(r'\bexpert_group\s*\('), 'an expert_group() check'),
]


def code_only(text):
    """`text` with comments, string and character literals blanked (newlines kept, so line numbers hold)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith('//', i):
            j = text.find('\n', i)
            i = n if j < 0 else j
        elif text.startswith('/*', i):
            j = text.find('*/', i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', text[i:j]))
            i = j
        elif text.startswith('R"(', i):
            j = text.find(')"', i + 3)
            j = n if j < 0 else j + 2
            out.append('""' + re.sub(r'[^\n]', ' ', text[i + 2:j]))
            i = j
        elif c in '"\'':
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == '\\' else 1
            out.append(c + ' ' * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def branches(path, rel):
    found = []
    with open(path) as f:
        lines = code_only(f.read()).split('\n')
    for number, line in enumerate(lines, 1):
        for pattern, what in BRANCHES:
            if pattern.search(line):
                found.append(f'{rel}:{number}: {what}: {line.strip()}')
    return found


def problems(root):
    found = []
    for rel in MODE_AGNOSTIC:
        found += branches(os.path.join(root, rel), rel)
    return found


def self_test(root):
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, 'engine')
        shutil.copytree(os.path.join(root, 'session'), os.path.join(copy, 'session'))
        with open(os.path.join(copy, 'session', 'local_session.cpp'), 'a') as f:
            f.write('\nint planted(Impl* impl_) {\n'
                    '  // group ? in a comment: not a branch\n'
                    '  const int a = impl_->group ? 1 : 0;\n'
                    '  if (impl_->group) return a;\n'
                    '  return impl_->model->expert_parallel();\n'
                    '}\n')
        found = problems(copy)
    kinds = ['a `group ? ... : ...`', 'an `if` on the group', 'an expert_parallel() check']
    ok = len(found) == len(kinds) and all(
        p.startswith('session/local_session.cpp:') and k in p for p, k in zip(found, kinds))
    if not ok:
        print('no_mode_branches self-test: expected exactly', kinds, 'in session/local_session.cpp\ngot', found)
        return 1
    print('no_mode_branches self-test: the three planted branches reported, the one in a comment not')
    return 0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    if sys.argv[2:] == ['--self-test']:
        return self_test(root)
    found = problems(root)
    for p in found:
        print(p)
    if not found:
        print(f'no_mode_branches: {", ".join(MODE_AGNOSTIC)} hold no branch on the parallel mode')
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
