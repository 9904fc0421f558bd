#!/usr/bin/env python3
"""Writes tests/fuzz/parser_corpus/: small GGUF, safetensors, tokenizer.json and tiktoken files, each valid or
damaged in one named way, and expected.txt, what parser_corpus_test must see for each ("ok" or a phrase of the
refusal). Deterministic: running it again rewrites the same bytes (the committed files are its output).

The damaged files aim at the places where a reader trusts a number from the file: lengths, counts, dimensions,
offsets, ids. scripts/sanitize.sh replays them under ASan + UBSan (tests/fuzz/README.md).
    python3 tests/fuzz/make_parser_corpus.py
"""
import json
import os
import shutil
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parser_corpus")

# --- GGUF ---------------------------------------------------------------------------------------------------------
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
T_F32, T_F16, T_Q8_0 = 0, 1, 8


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def byte_level(b):
    """Byte b in GPT-2's byte-level alphabet."""
    printable = lambda c: ord("!") <= c <= ord("~") or 0xA1 <= c <= 0xAC or c >= 0xAE
    if printable(b):
        return chr(b)
    return chr(256 + sum(1 for c in range(b) if not printable(c)))


BPE_TOKENS = [byte_level(b) for b in range(256)] + ["Ġt", "he", "<|end|>"]
BPE_MERGES = ["Ġ t", "h e"]


def kv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_str(key, value):
    return kv(key, STR, gstr(value))


def kv_u32(key, value):
    return kv(key, U32, struct.pack("<I", value))


def kv_i32(key, value):
    return kv(key, I32, struct.pack("<i", value))


def kv_strings(key, values):
    return kv(key, ARR, struct.pack("<IQ", STR, len(values)) + b"".join(gstr(v) for v in values))


def kv_int32s(key, values):
    return kv(key, ARR, struct.pack("<IQ", I32, len(values)) + b"".join(struct.pack("<i", v) for v in values))


def kv_f32s(key, values):
    return kv(key, ARR, struct.pack("<IQ", F32, len(values)) + b"".join(struct.pack("<f", v) for v in values))


def bpe_metadata(tokens=None, merges=None, eos=258, types=None, model="gpt2", pre="gpt-2"):
    tokens = BPE_TOKENS if tokens is None else tokens
    types = [1] * (len(tokens) - 1) + [3] if types is None else types  # the last token is a control token
    kvs = [kv_str("general.architecture", "llama"), kv_str("tokenizer.ggml.model", model),
           kv_str("tokenizer.ggml.pre", pre), kv_strings("tokenizer.ggml.tokens", tokens),
           kv_int32s("tokenizer.ggml.token_type", types),
           kv_strings("tokenizer.ggml.merges", BPE_MERGES if merges is None else merges)]
    if eos is not None:
        kvs.append(kv_u32("tokenizer.ggml.eos_token_id", eos))
    return kvs


def spm_metadata(types=None, scores=None):
    pieces = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + ["▁", "▁h", "he", "▁he"]
    types = [2, 3, 3] + [6] * 256 + [1] * 4 if types is None else types
    scores = [0.0] * 3 + [0.0] * 256 + [-1.0, -2.0, -3.0, -0.5] if scores is None else scores
    return [kv_str("general.architecture", "llama"), kv_str("tokenizer.ggml.model", "llama"),
            kv_strings("tokenizer.ggml.tokens", pieces), kv_f32s("tokenizer.ggml.scores", scores),
            kv_int32s("tokenizer.ggml.token_type", types)]


def tensor_info(name, dims, ttype, offset):
    return gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ttype, offset)


# Three tensors: F32 [4], F16 [2] and one Q8_0 block of 32 (scale 0.5, values -16..15).
TENSOR_DATA = [
    ("w.f32", [4], T_F32, struct.pack("<4f", 1.0, -2.0, 0.25, 8.0)),
    ("w.f16", [2], T_F16, struct.pack("<2H", 0x3C00, 0xC000)),
    ("w.q8", [32], T_Q8_0, struct.pack("<H", 0x3800) + bytes((q & 0xFF) for q in range(-16, 16))),
]


def gguf(kvs, tensors=TENSOR_DATA, version=3, alignment=32, infos=None, counts=None, magic=0x46554747):
    """A GGUF file: header, metadata, tensor infos, the data section at the alignment. `infos` replaces the tensor
    infos written from `tensors`; `counts` replaces the header's (tensor count, key count)."""
    data, offsets = b"", []
    for _, _, _, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        offsets.append(len(data))
        data += raw
    if infos is None:
        infos = [tensor_info(n, d, t, off) for (n, d, t, _), off in zip(tensors, offsets)]
    n_tensors, n_kvs = counts if counts else (len(infos), len(kvs))
    head = struct.pack("<IIQQ", magic, version, n_tensors, n_kvs) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


def gguf_cases():
    valid = gguf(bpe_metadata())
    meta = bpe_metadata()
    kv_end = 24 + sum(len(k) for k in meta)  # where the tensor infos begin
    nested = kv("deep", ARR, struct.pack("<IQ", ARR, 1) * 40 + struct.pack("<IQ", U8, 0))
    one = lambda dims, ttype=T_F32, off=0: [tensor_info("w", dims, ttype, off)]
    return [
        ("valid_bpe", valid, "ok"),
        ("valid_spm", gguf(spm_metadata()), "ok"),
        ("empty", b"", "is not a GGUF file"),
        ("not_gguf", b"GGML" + valid[4:], "is not a GGUF file"),
        ("big_endian", struct.pack(">IIQQ", 0x47475546, 3, 0, 0), "big-endian"),
        ("version_1", gguf(meta, version=1), "GGUF version"),
        ("header_only", valid[:24], "cannot fit"),
        ("cut_in_metadata", valid[:kv_end // 2], "does not fit in the"),
        ("cut_in_tensor_infos", valid[:kv_end + 20], "3 tensor infos cannot fit"),
        ("cut_in_data", valid[:len(valid) - 20], "ends past the file"),
        ("key_count_huge", gguf(meta, counts=(3, 1 << 61)), "metadata entries cannot fit"),
        ("tensor_count_huge", gguf(meta, counts=(1 << 61, len(meta))), "tensor infos cannot fit"),
        ("key_length_huge", struct.pack("<IIQQQ", 0x46554747, 3, 0, 1, (1 << 64) - 1) + b"x" * 16, "claims"),
        ("string_length_huge", gguf([gstr("k") + struct.pack("<IQ", STR, 1 << 62)]), "claims"),
        ("array_count_huge", gguf([gstr("k") + struct.pack("<IIQ", ARR, U32, 1 << 62)]), "does not fit"),
        ("string_array_count_huge", gguf([gstr("k") + struct.pack("<IIQ", ARR, STR, (1 << 64) - 1)]),
         "does not fit"),
        ("arrays_nested_deep", gguf([nested]), "nested deeper"),
        ("array_of_unknown_type", gguf([gstr("k") + struct.pack("<IIQ", ARR, 13, 1)]), "unknown array element"),
        ("value_type_unknown", gguf([gstr("k") + struct.pack("<I", 0xFFFFFFFF)]), "unknown value type"),
        ("bool_of_2", gguf([kv("b", BOOL, b"\x02")]), "a bool holds 2"),
        ("key_twice", gguf(meta + [kv_u32("tokenizer.ggml.eos_token_id", 1)]), "appears twice"),
        ("alignment_0", gguf(meta + [kv_u32("general.alignment", 0)]), "general.alignment"),
        ("alignment_3", gguf(meta + [kv_u32("general.alignment", 3)]), "general.alignment"),
        ("tensor_no_dims", gguf(meta, infos=one([])), "dimensions (1 to 4"),
        ("tensor_5_dims", gguf(meta, infos=one([1, 1, 1, 1, 1])), "dimensions (1 to 4"),
        ("tensor_dim_0", gguf(meta, infos=one([0])), "a dimension of"),
        ("tensor_dims_overflow", gguf(meta, infos=one([1 << 31, 1 << 31, 4])), "a dimension of 4"),
        ("tensor_dim_2_63", gguf(meta, infos=one([1 << 63])), "a dimension of"),
        ("tensor_type_unknown", gguf(meta, infos=one([4], ttype=1000)), "which rlloop does not read"),
        ("tensor_q8_partial_block", gguf(meta, infos=one([31], ttype=T_Q8_0)), "are not whole"),
        ("tensor_offset_unaligned", gguf(meta, infos=one([4], off=4)), "not a multiple of the alignment"),
        ("tensor_offset_past_end", gguf(meta, infos=one([4], off=1 << 40)), "ends past the file"),
        ("tensor_offset_wraps", gguf(meta, infos=one([8], off=(1 << 64) - 32)), "ends past the file"),
        ("tensor_name_twice", gguf(meta, infos=one([4]) * 2), "appears twice"),
        ("tok_no_model", gguf(meta[:1]), "holds no tokenizer"),
        ("tok_model_unknown", gguf(bpe_metadata(model="bert")), "tokenizer.ggml.model 'bert' is not supported"),
        ("tok_pre_unknown", gguf(bpe_metadata(pre="fancy")), "pre-tokenizer tokenizer.ggml.pre 'fancy'"),
        ("tok_eos_is_vocab_size", gguf(bpe_metadata(eos=len(BPE_TOKENS))), "is not a token id"),
        ("tok_eos_huge", gguf(bpe_metadata(eos=0xFFFFFFFF)), "is not a token id"),
        ("tok_eos_negative", gguf(bpe_metadata(eos=None) + [kv_i32("tokenizer.ggml.eos_token_id", -1)]),
         "is not a token id"),
        ("tok_types_short", gguf(bpe_metadata(types=[1] * 10)), "10 entries for 259 tokens"),
        ("tok_tokens_not_strings", gguf([kv_str("tokenizer.ggml.model", "gpt2"), kv_str("tokenizer.ggml.pre", "gpt-2"),
                                         kv_int32s("tokenizer.ggml.tokens", [1, 2]),
                                         kv_strings("tokenizer.ggml.merges", [])]),
         "not a string (in an array of strings)"),
        ("tok_no_tokens", gguf(meta[:3] + meta[5:]), "tokenizer.ggml.tokens"),
        ("tok_empty_vocab", gguf(bpe_metadata(tokens=[], types=[], merges=[], eos=None)), "the vocabulary is empty"),
        ("tok_merge_unknown_token", gguf(bpe_metadata(merges=["Ġ t", "q zz"])), "not in the vocabulary"),
        ("tok_merge_without_space", gguf(bpe_metadata(merges=["Ġt"])), "Ġt"),
        ("tok_token_not_byte_level", gguf(bpe_metadata(tokens=BPE_TOKENS[:-2] + ["\x01e", "<|end|>"],
                                                       merges=["Ġ t"])), "byte-level"),
        ("tok_spm_type_7", gguf(spm_metadata(types=[2, 3, 3] + [6] * 256 + [1, 1, 1, 7])),
         "llama.cpp's types are 1 to 6"),
        ("tok_spm_scores_short", gguf(spm_metadata(scores=[0.0] * 5)), "tokenizer.ggml.scores"),
    ]


# --- safetensors -------------------------------------------------------------------------------------------------
def safetensors(header, data=b"", length=None):
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def safetensors_cases():
    f32 = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    entry = lambda **kw: {"w": dict({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, **kw)}
    return [
        ("valid", safetensors(dict(entry(), __metadata__={"format": "pt"}), f32), "ok"),
        ("valid_empty_tensor", safetensors({"e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [0, 0]}}), "ok"),
        ("shorter_than_length", b"\x10\0\0", "shorter than the 8-byte header length"),
        ("length_past_file", safetensors(entry(), f32, length=1 << 20), "malformed or truncated header"),
        ("length_huge", safetensors(entry(), f32, length=(1 << 64) - 1), "malformed or truncated header"),
        ("header_not_json", safetensors(b"{\"w\": ", f32), "invalid JSON"),
        ("header_not_object", safetensors([1, 2], f32), "not a JSON object"),
        ("entry_not_object", safetensors({"w": 3}, f32), "expected an object with dtype"),
        ("offsets_negative", safetensors(entry(data_offsets=[-16, 0]), f32), "two non-negative integers"),
        ("offsets_three", safetensors(entry(data_offsets=[0, 8, 16]), f32), "two non-negative integers"),
        ("offsets_reversed", safetensors(entry(data_offsets=[16, 0]), f32), "end before they begin"),
        ("span_too_short", safetensors(entry(data_offsets=[0, 12]), f32), "span 12 bytes"),
        ("past_the_data", safetensors(entry(data_offsets=[8, 24]), f32), "is truncated: tensor 'w'"),
        ("offset_huge", safetensors(entry(data_offsets=[(1 << 64) - 16, (1 << 64) - 1]), f32),
         "span 15 bytes"),
        ("dtype_unknown", safetensors(entry(dtype="F8_E4M3"), f32), "unsupported dtype 'F8_E4M3'"),
        ("shape_negative", safetensors(entry(shape=[-2, -2]), f32), "non-negative integers"),
        ("shape_float", safetensors(entry(shape=[2.0, 2]), f32), "non-negative integers"),
        # 2^32 * 2^32 elements wrap a 64-bit count to 0, which an empty data span would match.
        ("shape_product_wraps", safetensors(entry(shape=[1 << 32, 1 << 32], data_offsets=[0, 0]), f32),
         "elements overflow"),
        ("shape_times_size_wraps", safetensors(entry(shape=[1 << 62], data_offsets=[0, 0]), f32),
         "elements overflow"),
    ]


# --- tokenizer.json and tiktoken -----------------------------------------------------------------------------------
def tokenizer_json(vocab=None, merges=None, added=None, model_type="BPE", pre=None, raw=None):
    if raw is not None:
        return raw
    vocab = {byte_level(b): b for b in range(256)} | {"ab": 256} if vocab is None else vocab
    doc = {"model": {"type": model_type, "vocab": vocab, "merges": ["a b"] if merges is None else merges},
           "normalizer": None,
           "pre_tokenizer": pre or {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "decoder": {"type": "ByteLevel"},
           "added_tokens": [{"id": 257, "content": "<|eos|>", "special": True}] if added is None else added}
    return json.dumps(doc, ensure_ascii=False).encode()


def tokenizer_json_cases():
    valid = tokenizer_json()
    return [
        ("valid", valid, "ok"),
        ("truncated", valid[:len(valid) // 2], "not valid JSON"),
        ("not_object", b"[1, 2]", "not a JSON object"),
        ("no_merges", b'{"model": {"type": "BPE", "vocab": {}}}', "model.merges"),
        ("merge_unknown", tokenizer_json(merges=["a zz"]), "not in the vocabulary"),
        ("vocab_id_negative", tokenizer_json(vocab={byte_level(b): b for b in range(256)} | {"ab": -5}), "negative id"),
        # Refused, but as "id 0 is used by two tokens": the reader keeps the low 32 bits of an id.
        ("vocab_id_huge", tokenizer_json(vocab={byte_level(b): b for b in range(256)} | {"ab": 1 << 40}),
         "load_tokenizer: "),
        ("vocab_id_float", tokenizer_json(vocab={byte_level(b): b for b in range(256)} | {"ab": 2.5}), "'ab'"),
        ("added_id_huge", tokenizer_json(added=[{"id": 1 << 62, "content": "<x>", "special": True}]),
         "load_tokenizer: "),
        ("model_wordpiece", tokenizer_json(model_type="WordPiece"), "model type 'WordPiece'"),
        ("number_overflow", valid.replace(b'"ab": 256', b'"ab": 1e999'), "not valid JSON"),
    ]


def b64(data):
    import base64
    return base64.b64encode(data).decode()


def tiktoken(extra=b""):
    lines = [f"{b64(bytes([b]))} {b}" for b in range(256)] + [f"{b64(b'ab')} 256"]
    return ("\n".join(lines) + "\n").encode() + extra


def tiktoken_cases():
    return [
        ("valid", tiktoken(), "ok"),
        ("rank_not_number", tiktoken(b"YWI= x\n"), "line 258"),
        ("rank_huge", tiktoken(b"YWJj 99999999999999999999\n"), "line 258"),
        ("rank_negative", tiktoken(b"YWJj -4\n"), "line 258"),
        ("token_not_base64", tiktoken(b"!!!! 257\n"), "line 258"),
        ("token_bad_padding", tiktoken(b"YW=j 257\n"), "line 258"),
        ("no_rank", tiktoken(b"YWJj\n"), "line 258"),
        ("empty_file", b"", "has no token for byte"),
    ]


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    expected = []

    def put(relative, data, outcome):
        path = os.path.join(OUT, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        expected.append(f"{relative}\t{outcome}")

    for name, data, outcome in gguf_cases():
        put(f"gguf/{name}.gguf", data, outcome)
    for name, data, outcome in safetensors_cases():
        put(f"safetensors/{name}.safetensors", data, outcome)
    for name, data, outcome in tokenizer_json_cases():
        put(f"tokenizer_json/{name}/tokenizer.json", data, outcome)
    for name, data, outcome in tiktoken_cases():
        put(f"tiktoken/{name}/cl100k_base.tiktoken", data, outcome)
    with open(os.path.join(OUT, "expected.txt"), "w") as f:
        f.write("# file<TAB>outcome: \"ok\" (reads, and a tokenizer round-trips text) or a phrase of the refusal;\n")
        f.write("# written by tests/fuzz/make_parser_corpus.py, checked by parser_corpus_test.\n")
        f.write("\n".join(expected) + "\n")


if __name__ == "__main__":
    main()
