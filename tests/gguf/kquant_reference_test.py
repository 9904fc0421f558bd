#!/usr/bin/env python3
"""rlloop's Q4_K and Q6_K blocks read by gguf-py (llama.cpp's own Python package, pinned in
scripts/python-requirements.txt). gguf-py writes a file of F32 tensors (weights as models have them, and the cases
that stress a quantizer: offsets, one sign, zeros, constants, sub-blocks of very different sizes, outliers);
rlloop's quantizer and writer store them as Q4_K and as Q6_K (gguf_dump --rewrite); gguf-py reads those files and
dequantizes every block with gguf.quants.dequantize, which must give (1) exactly rlloop's own dequantization of the
same file, float32 bit for bit, and (2) values within each format's error of those gguf-py wrote. (2) holds the
writer to the format as gguf-py reads it: a scale, min or code in the wrong bits moves the values far off.

    third_party/venv/bin/python tests/gguf/kquant_reference_test.py build/tests/gguf/gguf_dump
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import gguf
from gguf.constants import GGMLQuantizationType as Q

COLS = 1024  # 4 super-blocks per row

# The largest rms error of a super-block, relative to its largest |value|: measured 0.0275 (Q4_K) and 0.0068 (Q6_K)
# over these tensors; a 4-bit code's step over a sub-block's range is 1/15 of it, a 6-bit one's 1/63 of twice its
# largest value.
RMS_BOUND = {Q.Q4_K: 0.035, Q.Q6_K: 0.009}
# Weights as models have them (zero-mean normal): rms error relative to the values' rms, measured 0.0717 and 0.0170.
NORMAL_BOUND = {Q.Q4_K: 0.085, Q.Q6_K: 0.02}


def tensors(rng):
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    spread = normal(2, COLS) * np.repeat(10.0 ** rng.uniform(-3, 0, (2, COLS // 32)), 32, axis=1)
    outliers = normal(2, COLS) * 0.02
    outliers[:, rng.choice(COLS, 6, replace=False)] = 1.0
    return {
        "normal": normal(8, COLS) * 0.02,   # a model's matrix
        "wide": normal(2, COLS) * 3.0,
        "offset": normal(2, COLS) * 0.1 + 0.3,  # every sub-block above zero: Q4_K's min stays at 0
        "negative": -np.abs(normal(2, COLS)) * 0.5,
        "zeros": np.zeros((1, COLS), np.float32),
        "constant": np.full((1, COLS), 0.75, np.float32),
        "spread": spread.astype(np.float32),  # sub-blocks from 1e-3 to 1 within a super-block
        "outliers": outliers,
    }


def main():
    dump = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "f32.gguf"
        written = tensors(np.random.default_rng(11))
        w = gguf.GGUFWriter(str(source), arch="llama")
        for name, data in written.items():
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

        for qtype in [Q.Q4_K, Q.Q6_K]:
            out = Path(tmp) / f"{qtype.name}.gguf"
            run = subprocess.run([dump, "--rewrite", str(source), str(out), qtype.name], capture_output=True, text=True)
            if run.returncode != 0:
                failures.append(f"gguf_dump --rewrite {qtype.name} failed: {run.stderr.strip()}")
                continue
            mine = subprocess.run([dump, str(out)], capture_output=True, text=True, check=True)
            rlloop_bits = {t["name"]: np.array(t["bits"], dtype=np.uint64).astype(np.uint32)
                           for t in json.loads(mine.stdout)["tensors"]}
            reader = gguf.GGUFReader(str(out))
            worst_block = 0.0
            for t in reader.tensors:
                want = written[t.name]
                if t.tensor_type != qtype:
                    failures.append(f"{qtype.name}: {t.name} is stored as {t.tensor_type.name}")
                    continue
                values = gguf.quants.dequantize(np.asarray(t.data), qtype).astype(np.float32).reshape(want.shape)
                ours = rlloop_bits[t.name]
                bits = values.reshape(-1).view(np.uint32)
                differ = int(np.count_nonzero(ours != bits)) if ours.shape == bits.shape else -1
                if differ != 0:
                    failures.append(f"{qtype.name}: {t.name}: {differ} of {bits.size} values differ from rlloop's")
                error = (values - want).astype(np.float64)
                blocks_err = np.sqrt(np.mean(error.reshape(-1, 256) ** 2, axis=1))
                blocks_max = np.abs(want.reshape(-1, 256)).max(axis=1)
                relative = np.where(blocks_max > 0, blocks_err / np.where(blocks_max > 0, blocks_max, 1), blocks_err)
                worst = float(relative.max())
                worst_block = max(worst_block, worst)
                if worst > RMS_BOUND[qtype]:
                    failures.append(f"{qtype.name}: {t.name}: a super-block's rms error is {worst:.4f} of its "
                                    f"largest value (bound {RMS_BOUND[qtype]})")
                if t.name == "zeros" and np.any(values != 0):
                    failures.append(f"{qtype.name}: zeros do not come back as zeros")
                if t.name == "normal":
                    rel = float(np.sqrt(np.mean(error ** 2)) / np.sqrt(np.mean(want.astype(np.float64) ** 2)))
                    print(f"{qtype.name}: normal weights' rms error {rel:.4f} of their rms")
                    if rel > NORMAL_BOUND[qtype]:
                        failures.append(f"{qtype.name}: normal weights' rms error {rel:.4f} (bound "
                                        f"{NORMAL_BOUND[qtype]})")
            print(f"{qtype.name}: {len(reader.tensors)} tensors dequantized by gguf-py as by rlloop; the largest "
                  f"super-block rms error {worst_block:.4f} of its largest value")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("rlloop's Q4_K and Q6_K blocks read by gguf-py: rlloop's values bit for bit, within each format's error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
