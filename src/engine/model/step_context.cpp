#include "model/step_context.hpp"

#include <algorithm>

#include <rlloop/error.hpp>

#include "kernels/device.hpp"
#include "model/model_weights.hpp"

namespace rlloop::engine {

StepContext StepContext::prefill(torch::Tensor cos, torch::Tensor sin, double scale, KVCache* cache, std::int64_t B,
                                 std::int64_t T, torch::Device device) {
  const std::int64_t past = cache ? cache->length : 0;
  StepContext in{std::move(cos), std::move(sin), scale, cache, past};
  if (!cache) return in;
  cache->prepare_append(T);
  std::vector<std::int64_t> slots, tables;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) slots.push_back(cache->slot(b, past + t));
  in.slots = to_device(torch::tensor(slots, torch::kLong), device);
  if (past > 0) {
    for (std::int64_t b = 0; b < B; ++b) tables.insert(tables.end(), cache->blocks(b).begin(), cache->blocks(b).end());
    in.tables = to_device(torch::tensor(tables, torch::kLong), device).view({B, -1});
  }
  return in;
}

StepContext StepContext::decode(std::span<const RowGroup> rows, const std::vector<double>& scales,
                                const DecodeSlots& step, KVBlockPool& pool, const torch::Tensor& cos_table,
                                const torch::Tensor& sin_table, double scale, torch::Device device) {
  std::int64_t R = 0;
  for (const RowGroup& g : rows) R += g.rows;
  // The rows of the one-token groups, in a step with prompt chunks (single_rows).
  std::vector<std::int64_t> single;
  std::int64_t single_longest = 0;
  bool chunks = false;
  for (const RowGroup& g : rows) chunks = chunks || g.chunk;
  for (const RowGroup& g : rows) {
    if (!chunks || g.chunk) continue;
    for (std::int64_t r = g.row0; r < g.row0 + g.rows; ++r) {
      single.push_back(r);
      single_longest = std::max(single_longest, step.lengths[r]);
    }
  }
  // The step's layout in one copy to the device: every row's slot, key count and block table (and those rows).
  std::vector<std::int64_t> layout(step.slots);
  layout.insert(layout.end(), step.lengths.begin(), step.lengths.end());
  layout.insert(layout.end(), step.tables.begin(), step.tables.end());
  layout.insert(layout.end(), single.begin(), single.end());
  const torch::Tensor on_device = to_device(torch::tensor(layout, torch::kLong), device);
  StepContext in{{}, {}, scale, nullptr, 0};
  in.set_stacked_layout(rows, scales, device);
  in.step = &step;
  in.pool = &pool;
  in.slots = on_device.narrow(0, 0, R);
  in.lengths = on_device.narrow(0, R, R);
  in.tables = on_device.narrow(0, 2 * R, R * step.max_blocks).view({R, step.max_blocks});
  if (chunks) {
    in.single_rows = on_device.narrow(0, 2 * R + R * step.max_blocks, static_cast<std::int64_t>(single.size()));
    in.single_longest = single_longest;
  }
  const torch::Tensor positions = in.lengths - 1;
  in.cos = cos_table.index_select(0, positions);
  in.sin = sin_table.index_select(0, positions);
  return in;
}

void StepContext::set_stacked_layout(std::span<const RowGroup> rows, const std::vector<double>& scales,
                                     torch::Device device) {
  groups = rows;
  padded_rows = unpadded_rows = lora_scales = stacked_rows = torch::Tensor();
  rows_max = 0;
  std::vector<std::size_t> stacked;
  for (std::size_t gi = 0; gi < rows.size(); ++gi)
    if (!rows[gi].chunk) stacked.push_back(gi);
  if (stacked.size() < 2) return;
  std::vector<std::int64_t> padded, unpadded, covered;
  std::vector<double> stacked_scales;
  for (std::size_t gi : stacked) rows_max = std::max(rows_max, rows[gi].rows);
  for (std::size_t s = 0; s < stacked.size(); ++s) {
    const RowGroup& g = rows[stacked[s]];
    for (std::int64_t i = 0; i < rows_max; ++i) padded.push_back(g.row0 + std::min(i, g.rows - 1));
    for (std::int64_t i = 0; i < g.rows; ++i) {
      unpadded.push_back(static_cast<std::int64_t>(s) * rows_max + i);
      covered.push_back(g.row0 + i);
    }
    stacked_scales.push_back(scales[stacked[s]]);
  }
  padded_rows = to_device(torch::tensor(padded, torch::kLong), device);
  unpadded_rows = to_device(torch::tensor(unpadded, torch::kLong), device);
  lora_scales = to_device(torch::tensor(stacked_scales, torch::kFloat64), device);
  if (stacked.size() < rows.size()) stacked_rows = to_device(torch::tensor(covered, torch::kLong), device);
}

void check_forward_input(const ModelConfig& cfg, torch::Device device, const torch::Tensor& input_ids,
                         const KVCache* cache, bool idle_rank) {
  if (input_ids.dim() != 2 || input_ids.scalar_type() != torch::kLong)
    throw invalid_argument("Transformer::hidden_states: input_ids must be an int64 [batch, tokens] tensor, got " +
                           std::string(c10::toString(input_ids.scalar_type())) + " " + shape_string(input_ids.sizes()));
  const std::int64_t B = input_ids.size(0), T = input_ids.size(1);
  // No sequences at all only for an expert-parallel rank without datums: it still takes part in every exchange.
  if ((B == 0 && !(idle_rank && !cache)) || T == 0)
    throw invalid_argument("Transformer::hidden_states: empty input " + shape_string(input_ids.sizes()));
  // Ids on the host are checked there, before they are uploaded. Ids already on a device are not read back (that
  // would make the host wait at every prefill and training forward): they come from the sampler (inside the
  // vocabulary by construction) or from a session, which checked its datums' and prompts' tokens on the host.
  if (input_ids.device().is_cpu()) {
    const torch::Tensor host = input_ids.contiguous();
    const std::int64_t* id = host.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < host.numel(); ++i)
      if (id[i] < 0 || id[i] >= cfg.vocab_size)
        throw invalid_argument("Transformer::hidden_states: token id " + std::to_string(id[i]) +
                               " is outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")");
  }
  if (!cache) return;
  const std::int64_t past = cache->length;
  if (!cache->fits(cfg) || cache->batch() != B)
    throw invalid_argument("Transformer::hidden_states: the KV cache has " + std::to_string(cache->layers()) +
                           " layers, batch " + std::to_string(cache->batch()) + " and " +
                           std::to_string(cache->kv_heads()) + " KV heads of " + std::to_string(cache->head_dim()) +
                           ", the model " + std::to_string(cfg.num_hidden_layers) + " layers and " +
                           std::to_string(cfg.num_key_value_heads) + " of " + std::to_string(cfg.head_dim) +
                           ", the input batch " + std::to_string(B));
  if (cache->device() != device)
    throw invalid_argument("Transformer::hidden_states: the KV cache is on " + cache->device().str() +
                           ", the model on " + device.str());
  if (past + T > cache->capacity)
    throw invalid_argument("Transformer::hidden_states: KV cache capacity " + std::to_string(cache->capacity) +
                           " exceeded (" + std::to_string(past) + " cached + " + std::to_string(T) + " new tokens)");
}

bool check_decode_group(const ModelConfig& cfg, torch::Device device, const torch::Tensor& tokens, const KVCache& c) {
  const std::int64_t n = tokens.numel();
  if (!c.fits(cfg))
    throw invalid_argument("Transformer::decode_step: a group's KV cache has " + std::to_string(c.layers()) +
                           " layers of " + std::to_string(c.kv_heads()) + " KV heads, the model " +
                           std::to_string(cfg.num_hidden_layers) + " of " + std::to_string(cfg.num_key_value_heads));
  if (tokens.dim() != 1 || tokens.scalar_type() != torch::kLong || n == 0 || (c.batch() != n && c.batch() != 1))
    throw invalid_argument("Transformer::decode_step: a group's tokens must be [rows] int64, one per cache row or a "
                           "chunk of a cache of batch 1, got " + shape_string(tokens.sizes()) +
                           " for a cache of batch " + std::to_string(c.batch()));
  if (tokens.device() != device || c.device() != device)
    throw invalid_argument("Transformer::decode_step: a group's tokens and cache must be on the model's device (" +
                           device.str() + ")");
  const bool chunk = c.batch() != n;
  const std::int64_t last = c.length + (chunk ? n : 1) - 1;  // the last position the group feeds
  // The RoPE tables end there (and an index past them would be a device-side assert on CUDA).
  if (last >= cfg.max_position_embeddings)
    throw invalid_argument("Transformer::decode_step: position " + std::to_string(last) +
                           " is past the model's context (max_position_embeddings " +
                           std::to_string(cfg.max_position_embeddings) + ")");
  if (last >= c.capacity)
    throw invalid_argument("Transformer::decode_step: KV cache capacity " + std::to_string(c.capacity) +
                           (chunk ? " exceeded (" + std::to_string(c.length) + " cached + " + std::to_string(n) +
                                        " new tokens)"
                                  : std::string(" is full")));
  return chunk;
}

void store_slots(const torch::Tensor& storage, const torch::Tensor& slots, const torch::Tensor& rows) {
  torch::NoGradGuard no_grad;  // a cache is state, not part of a graph (the pool's tensors never require grad)
  storage.index_copy_(0, slots, rows.detach().to(storage.scalar_type()));
}

torch::Tensor gather_positions(const torch::Tensor& storage, const torch::Tensor& tables, std::int64_t S,
                               torch::ScalarType dtype) {
  const std::int64_t B = tables.size(0), blocks = tables.size(1), nkv = storage.size(1), D = storage.size(2);
  torch::Tensor rows = storage.view({-1, kKVBlockTokens, nkv, D})
                           .index_select(0, tables.reshape({B * blocks}))
                           .view({B, blocks * kKVBlockTokens, nkv, D})
                           .narrow(1, 0, S)
                           .transpose(1, 2);
  return rows.scalar_type() == dtype ? rows : rows.to(dtype);
}

}  // namespace rlloop::engine
