// Readers for tokenizer files on disk: Hugging Face tokenizer.json, GPT-2 encoder.json + vocab.bpe, tiktoken's
// rank files, and the tokenizer in a GGUF file's metadata (byte-level BPE or SentencePiece).
#pragma once
#include <filesystem>
#include <memory>

#include "bpe_tokenizer.hpp"

namespace rlloop::tokenizer_detail {

// A file's bytes; io_error naming it when it cannot be read.
std::string read_file(const std::filesystem::path& path);

// Reads a Hugging Face tokenizer.json (byte-level BPE). The eos token comes from a tokenizer_config.json
// beside it when there is one. Throws invalid_argument (malformed file), unsupported (a model or component
// rlloop does not implement), io_error (unreadable).
BpeSpec read_tokenizer_json(const std::filesystem::path& path);
// The tokenizer a Hugging Face tokenizer.json describes: byte-level BPE (read_tokenizer_json), or SentencePiece-style
// BPE with byte fallback (Llama 2, Mistral: model.byte_fallback, spm_tokenizer.hpp, merged by rank).
std::shared_ptr<const Tokenizer> load_tokenizer_json(const std::filesystem::path& path);

// Reads a tiktoken rank file (one "<base64 of the token's bytes> <rank>" line per token, OpenAI's published
// o200k_base.tiktoken, o200k_harmony's and cl100k_base.tiktoken): the encoding is named by the file's stem, which
// gives the split pattern and the special tokens. Tokens merge by tiktoken's rule (BpeSpec::merge_by_rank).
// unsupported for another stem, invalid_argument naming the line for a malformed one.
BpeSpec read_tiktoken_file(const std::filesystem::path& path);

// Reads the GPT-2 pair encoder.json + vocab.bpe from a directory.
BpeSpec read_gpt2_files(const std::filesystem::path& dir);

// Reads the tokenizer llama.cpp's converter stored in a GGUF file (tokenizer.ggml.*): the "gpt2" model (byte-level
// BPE) with the pre-tokenizers "gpt-2", "smollm", "llama-bpe"/"llama3" and "qwen2"; control tokens become special
// added tokens, user-defined ones plain added tokens. Throws like read_tokenizer_json, and unsupported for another
// model or pre-tokenizer, naming it and the file.
BpeSpec read_gguf_tokenizer(const std::filesystem::path& path);
// The tokenizer of a GGUF file, whichever model it is: "gpt2" (read_gguf_tokenizer) or "llama" (SentencePiece,
// spm_tokenizer.hpp). Throws as read_gguf_tokenizer.
std::shared_ptr<const Tokenizer> load_gguf_tokenizer(const std::filesystem::path& path);

// A token written in the byte-level alphabet (GPT-2's bytes_to_unicode) as its raw bytes; invalid_argument naming
// `source` when it is not written in that alphabet.
std::string byte_level_token(const std::string& token, const std::string& source);
// A merge line "a b" as the raw bytes of its two tokens.
std::pair<std::string, std::string> byte_level_merge(const std::string& line, const std::string& source);

}  // namespace rlloop::tokenizer_detail
