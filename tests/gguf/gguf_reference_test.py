#!/usr/bin/env python3
"""GGUF files written by gguf-py (llama.cpp's own Python package) and read by rlloop (gguf_dump): every metadata
value type, nested arrays, a non-default alignment, and tensors of every type rlloop reads, whose values rlloop
must dequantize to exactly gguf-py's (compared as float32 bit patterns, NaN-free by construction). Quantized blocks
are random bytes with finite scales, so every bit of every field is exercised, not only what a quantizer emits.

Then the other way: rlloop writes the file again (gguf_dump --rewrite) with its F32 tensors stored as F32, F16,
BF16 and Q8_0, and gguf-py reads what rlloop wrote: the same metadata (every type, nested arrays, the alignment), the
other tensors' bytes unchanged, and the converted tensors byte for byte what gguf-py's own quantizer (llama.cpp's
reference rounding) makes of the same values, including halfway cases, subnormals, overflow and NaN.

    third_party/venv/bin/python tests/gguf/gguf_reference_test.py build/tests/gguf/gguf_dump
"""
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# The byte offsets of each block's f16 scale fields (ggml-common.h), set to finite random halves.
HALF_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q2_K: [80, 82],
               Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.MXFP4: []}


def random_blocks(rng, qtype, rows, cols):
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        halves = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        raw[:, at:at + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, cols // block * size)


# Values where rounding is decided: halves' ties (odd and even), their subnormals and overflow, bfloat16 ties, zero
# signs, and a block (the second) whose largest value is tiny. Finite, so that every block's Q8_0 scale is.
EDGE_VALUES = np.array(
    [1 + 2**-11, 1 + 3 * 2**-11, 65504, 65519.99, 2**-25, 3 * 2**-25, 2**-24 * 1.5, 5.96e-8, -0.0, 0.0,
     1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-11), 1e-3, -1e-3, 2**-20, 1e30, -1e-30] + [0.0] * 14 +
    [1e-6, -2e-6, 3e-6, 4e-7] * 8, dtype=np.float32)


def check_rewrites(dump, path, tmp, failures):
    """rlloop's writer: path rewritten as each type, read back by gguf-py."""
    source = gguf.GGUFReader(str(path))
    source_fields = {k: f.contents() for k, f in source.fields.items() if not k.startswith("GGUF.")}
    for qtype in [Q.F32, Q.F16, Q.BF16, Q.Q8_0]:
        out = Path(tmp) / f"rewritten_{qtype.name}.gguf"
        run = subprocess.run([dump, "--rewrite", str(path), str(out), qtype.name], capture_output=True, text=True)
        if run.returncode != 0:
            failures.append(f"gguf_dump --rewrite {qtype.name} failed: {run.stderr.strip()}")
            continue
        back = gguf.GGUFReader(str(out))
        fields = {k: f.contents() for k, f in back.fields.items() if not k.startswith("GGUF.")}
        if fields != source_fields:
            differ = sorted(k for k in set(fields) | set(source_fields) if fields.get(k) != source_fields.get(k))
            failures.append(f"rewritten as {qtype.name}: metadata differs at {differ}")
        if back.alignment != source.alignment:
            failures.append(f"rewritten as {qtype.name}: alignment {back.alignment} != {source.alignment}")
        before = {t.name: t for t in source.tensors}
        converted = 0
        for t in back.tensors:
            s = before.pop(t.name, None)
            if s is None:
                failures.append(f"rewritten as {qtype.name}: unexpected tensor {t.name}")
                continue
            if s.tensor_type == Q.F32:
                want = np.ascontiguousarray(gguf.quants.quantize(np.asarray(s.data, dtype=np.float32), qtype))
                want_type = qtype
                converted += 1
            else:
                want, want_type = np.asarray(s.data), s.tensor_type
            if t.tensor_type != want_type:
                failures.append(f"rewritten as {qtype.name}: {t.name} is {t.tensor_type.name}, not {want_type.name}")
                continue
            got_bytes = np.asarray(t.data).view(np.uint8).reshape(-1)
            want_bytes = want.view(np.uint8).reshape(-1)
            if got_bytes.shape != want_bytes.shape or not np.array_equal(got_bytes, want_bytes):
                bad = int(np.count_nonzero(got_bytes != want_bytes)) if got_bytes.shape == want_bytes.shape else -1
                failures.append(f"rewritten as {qtype.name}: {t.name}: {bad} bytes differ from gguf-py's")
            if list(t.shape) != list(s.shape):
                failures.append(f"rewritten as {qtype.name}: {t.name} shape {list(t.shape)} != {list(s.shape)}")
        if before:
            failures.append(f"rewritten as {qtype.name}: tensors missing: {sorted(before)}")
        print(f"rewritten as {qtype.name}: {len(back.tensors)} tensors ({converted} converted), metadata compared")


def main():
    dump = sys.argv[1]
    rng = np.random.default_rng(7)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "all.gguf"
        w = gguf.GGUFWriter(str(path), arch="llama")
        w.add_custom_alignment(64)
        scalars = {
            "t.u8": (w.add_uint8, 200, "uint8"), "t.i8": (w.add_int8, -100, "int8"),
            "t.u16": (w.add_uint16, 60000, "uint16"), "t.i16": (w.add_int16, -30000, "int16"),
            "t.u32": (w.add_uint32, 4_000_000_000, "uint32"), "t.i32": (w.add_int32, -2_000_000_000, "int32"),
            "t.f32": (w.add_float32, 0.25, "float32"), "t.u64": (w.add_uint64, 2**63 + 5, "uint64"),
            "t.i64": (w.add_int64, -(2**62), "int64"), "t.f64": (w.add_float64, math.pi, "float64"),
            "t.bool": (w.add_bool, True, "bool"), "t.str": (w.add_string, "héllo ✓", "string"),
        }
        for key, (add, value, _) in scalars.items():
            add(key, value)
        w.add_array("t.ints", [1, -2, 3])
        w.add_array("t.strs", ["a", "", "ccc"])
        w.add_array("t.nested", [[1, 2], [3]])
        expected = {}
        qtypes = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                  Q.Q6_K, Q.MXFP4]
        for qtype in qtypes:
            name = f"w.{qtype.name}"
            rows, cols = 3, 512
            if qtype == Q.F32:
                data = rng.standard_normal((rows, cols)).astype(np.float32)
                data[0, :len(EDGE_VALUES)] = EDGE_VALUES
                w.add_tensor(name, data)
                values = data
            elif qtype == Q.F16:
                data = rng.standard_normal((rows, cols)).astype(np.float16)
                w.add_tensor(name, data)
                values = data.astype(np.float32)
            else:
                raw = (gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
                       if qtype == Q.BF16 else random_blocks(rng, qtype, rows, cols))
                w.add_tensor(name, raw, raw_dtype=qtype)
                values = gguf.quants.dequantize(raw, qtype)
            expected[name] = (qtype.name, [cols, rows], values.astype(np.float32).reshape(-1).view(np.uint32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

        run = subprocess.run([dump, str(path)], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"gguf_dump failed: {run.stderr}")
        got = json.loads(run.stdout)

        def check(cond, what):
            if not cond:
                failures.append(what)

        check(got["version"] == 3, f"version {got['version']}")
        check(got["alignment"] == 64, f"alignment {got['alignment']}")
        meta = got["metadata"]
        for key, (_, value, type_name) in scalars.items():
            entry = meta.get(key)
            check(entry is not None and entry["type"] == type_name, f"{key}: type {entry and entry['type']}")
            if entry is not None:
                ok = (abs(entry["value"] - value) < 1e-12) if type_name.startswith("float") else entry["value"] == value
                check(ok, f"{key}: {entry['value']!r} != {value!r}")
        check(meta["t.ints"]["value"] == [1, -2, 3], f"t.ints: {meta['t.ints']}")
        check(meta["t.strs"]["value"] == ["a", "", "ccc"], f"t.strs: {meta['t.strs']}")
        check(meta["t.nested"]["value"] == [[1, 2], [3]], f"t.nested: {meta['t.nested']}")
        check(meta["general.architecture"]["value"] == "llama", "general.architecture")
        tensors = {t["name"]: t for t in got["tensors"]}
        check(len(tensors) == len(expected), f"{len(tensors)} tensors, wrote {len(expected)}")
        for name, (type_name, shape, bits) in expected.items():
            t = tensors.get(name)
            if t is None:
                failures.append(f"{name}: missing")
                continue
            check(t["type"] == type_name, f"{name}: type {t['type']}")
            check(t["shape"] == shape, f"{name}: shape {t['shape']} != {shape}")
            mine = np.array(t["bits"], dtype=np.uint64).astype(np.uint32)
            differ = int(np.count_nonzero(mine != bits)) if mine.shape == bits.shape else -1
            check(differ == 0, f"{name}: {differ} of {bits.size} values differ from gguf-py's dequantization")
            print(f"{name}: {bits.size} values, {'identical' if differ == 0 else f'{differ} differ'}")
        check_rewrites(dump, path, tmp, failures)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("gguf-py's files read by rlloop and rlloop's read by gguf-py: metadata and every tensor type identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
