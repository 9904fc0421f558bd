// Readers for tokenizer files on disk: Hugging Face tokenizer.json and GPT-2 encoder.json + vocab.bpe.
#pragma once
#include <filesystem>

#include "bpe_tokenizer.hpp"

namespace rlloop::tokenizer_detail {

// Reads a Hugging Face tokenizer.json (byte-level BPE). The eos token comes from a tokenizer_config.json
// beside it when there is one. Throws invalid_argument (malformed file), unsupported (a model or component
// rlloop does not implement), io_error (unreadable).
BpeSpec read_tokenizer_json(const std::filesystem::path& path);

// Reads the GPT-2 pair encoder.json + vocab.bpe from a directory.
BpeSpec read_gpt2_files(const std::filesystem::path& dir);

}  // namespace rlloop::tokenizer_detail
