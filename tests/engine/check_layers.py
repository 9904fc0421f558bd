#!/usr/bin/env python3
"""The engine's layers include downward only.

src/engine/CMakeLists.txt names the layers, lowest first (kernels, comm, model, io, runtime, dist, session). Every
.cpp/.hpp under src/engine must live in one of those folders, and every `#include "..."` it makes must resolve (next
to the file, else from src/engine) to a file of its own layer or a lower one.

  check_layers.py SRC_ENGINE_DIR              check the tree; prints each offending include and exits 1
  check_layers.py SRC_ENGINE_DIR --self-test  check a copy of the tree with a kernel that includes a model header,
                                              and a stray file at the top: both must be reported
"""
import os
import re
import shutil
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
LAYERS_LINE = re.compile(r'set\(RLLOOP_ENGINE_LAYERS ([a-z ]+)\)')


def layers_of(root):
    with open(os.path.join(root, 'CMakeLists.txt')) as f:
        m = LAYERS_LINE.search(f.read())
    if not m:
        sys.exit(f'check_layers: no set(RLLOOP_ENGINE_LAYERS ...) in {root}/CMakeLists.txt')
    return m.group(1).split()


def problems(root):
    layers = layers_of(root)
    rank = {name: i for i, name in enumerate(layers)}
    found = []
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(('.cpp', '.hpp')):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            layer = rel.split(os.sep)[0]
            if layer not in rank:
                found.append(f'{rel}: not in a layer folder ({", ".join(layers)})')
                continue
            with open(path) as f:
                text = f.read()
            for included in INCLUDE.findall(text):
                beside = os.path.normpath(os.path.join(dirpath, included))
                target = beside if os.path.exists(beside) else os.path.normpath(os.path.join(root, included))
                if not os.path.exists(target):
                    continue  # a header of another module (src/, include/), not of the engine
                target_layer = os.path.relpath(target, root).split(os.sep)[0]
                if target_layer not in rank:
                    found.append(f'{rel}: includes "{included}", which is in no layer')
                elif rank[target_layer] > rank[layer]:
                    allowed = ', '.join(layers[:rank[layer] + 1])
                    found.append(f'{rel}: includes "{included}" of layer {target_layer}; '
                                 f'{layer} may include only {allowed}')
    return found


def self_test(root):
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, 'engine')
        shutil.copytree(root, copy)
        with open(os.path.join(copy, 'kernels', 'simd.hpp'), 'a') as f:
            f.write('\n#include "model/transformer.hpp"\n')
        open(os.path.join(copy, 'stray.cpp'), 'w').close()
        found = problems(copy)
    want = ['kernels/simd.hpp: includes "model/transformer.hpp" of layer model; kernels may include only kernels',
            'stray.cpp: not in a layer folder']
    missing = [w for w in want if not any(p.startswith(w) for p in found)]
    if missing or len(found) != 2:
        print('check_layers self-test: expected exactly', want, '\ngot', found)
        return 1
    print('check_layers self-test: both planted faults reported')
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
        print(f'check_layers: every include in {root} goes to its own layer or a lower one')
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
