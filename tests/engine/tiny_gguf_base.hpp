// The small GGUF base of the GGUF tests: a Llama with random weights (2 layers, hidden 64, grouped-query attention:
// 4 query heads over 2 key/value heads, so that the q/k row order matters) and a byte-level BPE vocabulary of 300,
// matrices of a given type, vectors F32. engine_gguf_export_test writes it in place; write_gguf_base.cpp writes it
// for the command-line tests.
#pragma once
#include <map>
#include <string>

#include <torch/torch.h>

#include <rlloop/gguf.hpp>

#include "io/gguf_export.hpp"
#include "model/transformer.hpp"

namespace rlloop::test_gguf {

// A GGUF file's metadata for a byte-level BPE tokenizer over `vocab` ids: the 256 bytes, one merge, fillers.
inline std::map<std::string, gguf::Value> tokenizer_metadata(std::int64_t vocab) {
  gguf::Array tokens, types;
  for (int b = 0; b < vocab; ++b) {
    std::string t;
    if (b < 256) {  // GPT-2's byte alphabet: printable bytes stand for themselves, the others for 256 + rank
      const auto printable = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE; };
      char32_t cp = static_cast<char32_t>(b);
      if (!printable(b)) {
        cp = 256;
        for (int c = 0; c < b; ++c) cp += printable(c) ? 0 : 1;
      }
      t = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                    : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    } else {
      t = b == 256 ? "ab" : "<filler" + std::to_string(b) + ">";
    }
    tokens.push_back({t});
    types.push_back({std::int32_t{1}});
  }
  return {{"tokenizer.ggml.model", {std::string("gpt2")}},
          {"tokenizer.ggml.pre", {std::string("gpt-2")}},
          {"tokenizer.ggml.tokens", {tokens}},
          {"tokenizer.ggml.token_type", {types}},
          {"tokenizer.ggml.merges", {gguf::Array{{std::string("a b")}}}},
          {"tokenizer.ggml.eos_token_id", {std::uint32_t{10}}},
          {"general.name", {std::string("tiny test base")}}};
}

// Writes the base to `path` with its matrices as `type` (seeded: the same weights every time). `hidden` widens it
// (FFN 2 x hidden, head_dim hidden / 4): at 256 every matrix's rows are whole K-quant super-blocks.
inline void save_tiny_base(const std::string& path, gguf::TensorType type, std::int64_t hidden = 64) {
  engine::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 300;
  c.hidden_size = hidden;
  c.intermediate_size = 2 * hidden;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = hidden / 4;
  c.max_position_embeddings = 256;
  c.validate();
  torch::manual_seed(5);
  engine::Transformer model(c, torch::TensorOptions().dtype(torch::kFloat32));
  auto weights = model.hf_state_dict();
  for (auto& [name, t] : weights)
    t = name.find("norm") != std::string::npos ? 1 + 0.1 * torch::randn(t.sizes()) : 0.1 * torch::randn(t.sizes());
  model.load_hf_state_dict(weights);
  engine::save_gguf_model(model, path, type, tokenizer_metadata(c.vocab_size));
}

}  // namespace rlloop::test_gguf
