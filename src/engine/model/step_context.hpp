// The row and KV layout of one forward, built once and read by every layer (the ATen backend, aten_ops.hpp): the
// RoPE rows of its positions, the attention scale and, with a cache, where each row's keys and values go and where
// its earlier ones lie in the paged pool; in a decoding step of several batches (Transformer::decode_step), which
// rows belong to which model (its adapters) and cache, and the layout of their adapters' batched products.
// The model's weights are not here (model_weights.hpp): a step context says where rows are, not what they compute.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include <torch/torch.h>

#include "model/experts.hpp"
#include "model/kv_cache.hpp"
#include "model/linear.hpp"
#include "model/model_config.hpp"

namespace rlloop::engine {

struct ModelWeights;

// Rows [row0, row0 + rows) of a decoding step of several batches (Transformer::decode_step): one batch of
// sequences, with its own model's adapters (`weights`: the base weights are every group's); its cache's slots and
// blocks are in the step's layout (StepContext::step).
struct RowGroup {
  const ModelWeights* weights;
  std::int64_t row0, rows;
  bool chunk = false;  // rows are consecutive positions of one sequence (a prompt's chunk), not one per sequence
};

// What every layer of one forward shares: the RoPE rows of its positions, the attention scale, the cache (and how
// many positions it held before this forward).
struct StepContext {
  torch::Tensor cos, sin;
  double scale;
  KVCache* cache;
  std::int64_t past;
  // With a cache: the pool slots this forward's keys and values go to ([B * T], row-major, on the model's device)
  // and, when the cache held positions before (past > 0), every row's block table [B, blocks] to read them back.
  torch::Tensor slots, tables;
  // A decoding step of several batches: x is [1, rows of every group, H], one new token per row (a new token of a
  // sequence, or a position of a prompt's chunk; the rows sit where one sequence's positions would: RoPE's cos / sin
  // rows are the rows' own positions), and each group's rows attend over its own cache. Empty otherwise.
  std::span<const RowGroup> groups = {};
  // With groups: the step's layout over the caches' one pool (on the host), and its block tables [R, blocks] and key
  // counts [R] on the model's device (slots above are the rows' new positions).
  const DecodeSlots* step = nullptr;
  KVBlockPool* pool = nullptr;
  torch::Tensor lengths;
  // With two or more groups of one token per sequence, for their adapters' batched products (add_stacked_adapters;
  // a prompt's chunk, many rows of one sequence, would pad every other group to its length, and runs its own):
  // stacked group g's rows padded to the largest one's count, rows_max (padded_rows[g * rows_max + i] = the step row
  // of its row i, its last row where it has fewer), where each of their rows lands among them (unpadded_rows), each
  // one's LoRA scale (lora_scales [G], float64), and, in a step with chunks, the step rows they cover
  // (stacked_rows; undefined: every row); all on the model's device. padded_rows undefined: nothing stacked.
  torch::Tensor padded_rows, unpadded_rows, lora_scales, stacked_rows;
  // In a step with prompt chunks, for the attention of its one-token groups in one call: their rows (on the model's
  // device; undefined without chunks) and their longest key count.
  torch::Tensor single_rows;
  std::int64_t single_longest = 0;
  std::int64_t rows_max = 0;
  // Routing replay and recording (hidden_states' `routing`), or null.
  ExpertRouting* routing = nullptr;

  // A forward of [B, T] tokens at positions past.. (RoPE rows cos / sin), with `cache` extended by them when given:
  // the cache's new slots and, past > 0, its block tables on `device`.
  static StepContext prefill(torch::Tensor cos, torch::Tensor sin, double scale, KVCache* cache, std::int64_t B,
                             std::int64_t T, torch::Device device);
  // A decoding step over `rows` (each group's LoRA scale in `scales`) whose caches' layout is `step`, over `pool`:
  // one copy of the layout to `device`, the RoPE rows of each row's position from the tables.
  static StepContext decode(std::span<const RowGroup> rows, const std::vector<double>& scales, const DecodeSlots& step,
                            KVBlockPool& pool, const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                            double scale, torch::Device device);
  // The layout add_stacked_adapters reads for the step's row groups (padded_rows): over the groups of one token per
  // sequence, when there are two or more; each group's LoRA scale in `scales`.
  void set_stacked_layout(std::span<const RowGroup> rows, const std::vector<double>& scales, torch::Device device);
};

// hidden_states' checks of its input ids [B, T] (on the host: their range) and of `cache` (its shape, device and
// room for them); `idle_rank`: an expert-parallel or fully sharded rank may run a forward of no sequences.
void check_forward_input(const ModelConfig& cfg, torch::Device device, const torch::Tensor& input_ids,
                         const KVCache* cache, bool idle_rank);
// decode_step's checks of one group's tokens and cache; whether it is a prompt's chunk.
bool check_decode_group(const ModelConfig& cfg, torch::Device device, const torch::Tensor& tokens, const KVCache& c);

// Stores keys or values [N, kv_heads, D] at `slots` [N] of a pool's storage, in the storage's dtype.
void store_slots(const torch::Tensor& storage, const torch::Tensor& slots, const torch::Tensor& rows);

// The first `S` positions of rows whose block tables are `tables` [B, blocks], from a pool's storage [slots, kv_heads,
// D]: [B, kv_heads, S, D] in `dtype` (the layout causal_attention reads; the last dimension contiguous).
torch::Tensor gather_positions(const torch::Tensor& storage, const torch::Tensor& tables, std::int64_t S,
                               torch::ScalarType dtype);

// With two or more groups that all adapt this linear at one rank and dtype, their low-rank products run as two
// batched products over the groups' rows (padded to the largest group's count) instead of two products per group,
// so the operators of a step do not grow with its groups (Punica's SGMV, in ATen operators). Adds them to y [1, R,
// out] and returns true; false (nothing done) where it does not apply.
template <class Of>
bool add_stacked_adapters(torch::Tensor& y, const torch::Tensor& h, const StepContext& in, Of&& of) {
  if (!in.padded_rows.defined()) return false;
  std::vector<torch::Tensor> a, b;
  for (const RowGroup& g : in.groups) {
    if (g.chunk) continue;  // not stacked (StepContext::padded_rows)
    const Linear& adapted = of(g);
    const torch::Tensor& first = a.empty() ? adapted.lora_a : a.front();
    if (!adapted.lora_a.defined() || adapted.lora_a.size(0) != first.size(0) ||
        adapted.lora_a.scalar_type() != first.scalar_type())
      return false;
    a.push_back(adapted.lora_a);
    b.push_back(adapted.lora_b);
  }
  const auto G = static_cast<std::int64_t>(a.size());
  const torch::Tensor x =
      h[0].to(a.front().scalar_type()).index_select(0, in.padded_rows).view({G, in.rows_max, h.size(2)});
  torch::Tensor d = torch::bmm(torch::bmm(x, torch::stack(a).transpose(1, 2)), torch::stack(b).transpose(1, 2));
  d = d * in.lora_scales.to(d.scalar_type()).view({G, 1, 1});  // [G, rows_max, out]
  const torch::Tensor rows = d.view({G * in.rows_max, d.size(2)}).index_select(0, in.unpadded_rows);
  if (in.stacked_rows.defined())
    y[0].index_add_(0, in.stacked_rows, rows.to(y.scalar_type()));
  else
    y[0].add_(rows.to(y.scalar_type()));
  return true;
}

// The linear `of` picks out of a group's model (a projection of a layer, or lm_head) applied to h: with row groups,
// the base product once over every row and each group's adapter over its own rows; otherwise the model's own.
template <class Of>
torch::Tensor project(const Linear& own, const torch::Tensor& h, const StepContext& in, Of&& of) {
  if (in.groups.empty()) return own.apply(h);
  torch::Tensor y = own.apply_base(h, /*few_rows=*/true);
  const bool stacked = add_stacked_adapters(y, h, in, of);
  for (const RowGroup& g : in.groups) {
    if (stacked && !g.chunk) continue;
    const Linear& adapted = of(g);
    if (!adapted.lora_a.defined()) continue;
    torch::Tensor rows = y.narrow(1, g.row0, g.rows);
    rows.add_(adapted.adapter_delta(h.narrow(1, g.row0, g.rows), y.scalar_type()), adapted.lora_scale);
  }
  return y;
}

}  // namespace rlloop::engine
