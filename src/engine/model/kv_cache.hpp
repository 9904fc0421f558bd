// The paged KV cache: keys and values live in fixed-size blocks of one pool per base model, device and dtype, and
// each sequence holds a table of its blocks (vLLM's PagedAttention layout). Sequences forked from one prompt share
// the prompt's blocks; a block shared by several sequences is copied only when one of them writes into it (the
// prompt's last, partly filled block), and a sequence that ends returns its blocks without moving anyone else's.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "kernels/kv_block.hpp"
#include "model/model_config.hpp"

namespace rlloop::engine {

// The blocks of one (base model, device, dtype): per layer a key and a value tensor of [blocks * kKVBlockTokens,
// kv_heads, head_dim], so a position's keys for every KV head are one contiguous row ("slot" = block *
// kKVBlockTokens + offset). Blocks are reference counted. The storage is allocated at the first block, for the
// pool's capacity (KVPools::set_capacity_bytes: the KV budget, so a pool never grows while its requests fit), and
// grows (doubling, contents copied) only when no block is free, so the tensors returned by keys()/values() are valid
// until the next allocate(). It is freed when the last block is released (an idle pool holds no memory). On the CPU
// only the blocks written take memory: untouched pages of the storage are never faulted in. A pool serves one thread
// at a time (the engine loop of its base); its bookkeeping is locked all the same.
class KVBlockPool {
 public:
  KVBlockPool(const ModelConfig& cfg, torch::Device device, torch::ScalarType dtype);
  KVBlockPool(const KVBlockPool&) = delete;
  KVBlockPool& operator=(const KVBlockPool&) = delete;

  // A free block with one reference (the storage grows when none is free).
  std::int64_t allocate();
  void retain(std::int64_t block);
  // Drops one reference; the block is free again at zero.
  void release(std::int64_t block);
  std::int64_t references(std::int64_t block) const;
  // Copies every layer's keys and values of each pair's first block into its second: a gather and a scatter per
  // layer for keys and for values, whatever the number of blocks.
  void copy_blocks(std::span<const std::pair<std::int64_t, std::int64_t>> copies);

  const torch::Tensor& keys(std::size_t layer) const { return keys_[layer]; }
  const torch::Tensor& values(std::size_t layer) const { return values_[layer]; }
  std::size_t layers() const { return keys_.size(); }
  std::int64_t kv_heads() const { return kv_heads_; }
  // True when a model of `cfg` can keep its keys and values here (layers, KV heads, head_dim).
  bool fits(const ModelConfig& cfg) const;
  std::int64_t head_dim() const { return head_dim_; }
  torch::Device device() const { return device_; }
  torch::ScalarType dtype() const { return dtype_; }

  std::int64_t blocks_in_use() const;
  // The blocks the storage is allocated for at once (0: grow from 16, doubling).
  void set_capacity_blocks(std::int64_t blocks);
  // Bytes of one block over every layer, keys and values.
  std::int64_t bytes_per_block() const;

 private:
  void grow(std::int64_t blocks);  // with mutex_ held

  std::int64_t layers_, kv_heads_, head_dim_;
  torch::Device device_;
  torch::ScalarType dtype_;
  std::vector<torch::Tensor> keys_, values_;
  std::int64_t capacity_blocks_ = 0;
  std::vector<int> references_;   // per block
  std::vector<std::int64_t> free_;  // blocks with no reference, the next one last
  mutable std::mutex mutex_;
};

// The pools of one base model's device, one per cache dtype (the CPU decoder's bf16 precision keeps its cache in
// bf16 beside an fp32 model), shared by every model over that base (Transformer::kv_pools).
class KVPools {
 public:
  KVPools(const ModelConfig& cfg, torch::Device device);
  KVBlockPool& pool(torch::ScalarType dtype);
  // Each pool's storage is allocated for this many bytes at its first block (LocalServiceOptions::kv_cache_mb);
  // 0: grown as needed.
  void set_capacity_bytes(std::int64_t bytes);

 private:
  ModelConfig cfg_;
  torch::Device device_;
  std::map<torch::ScalarType, std::unique_ptr<KVBlockPool>> pools_;
  std::int64_t capacity_bytes_ = 0;
  mutable std::mutex mutex_;
};

// The cache of one batch of sequences that advance together (one sample request's samples): every row has the same
// `length` (positions filled), a block table, and room for at most `capacity` positions. Copying a cache shares its
// blocks (copy on write), so a copy is as independent as a deep copy. Writers call prepare_append before writing
// positions [length, length + count) and advance `length` after.
class KVCache {
 public:
  KVCache() = default;
  // An empty cache of `batch` rows for up to `capacity` positions, its blocks from `pools`' pool of `dtype`.
  KVCache(std::shared_ptr<KVPools> pools, torch::ScalarType dtype, std::int64_t batch, std::int64_t capacity);
  // The same over pools of its own (a cache used alone: tests, tools).
  static KVCache allocate(const ModelConfig& cfg, std::int64_t batch, std::int64_t capacity, torch::Device device,
                          torch::ScalarType dtype);
  KVCache(const KVCache& other);
  KVCache& operator=(const KVCache& other);
  KVCache(KVCache&& other) noexcept;
  KVCache& operator=(KVCache&& other) noexcept;
  ~KVCache();

  std::int64_t length = 0;
  std::int64_t capacity = 0;

  std::int64_t batch() const { return static_cast<std::int64_t>(tables_.size()); }
  std::size_t layers() const { return pool_ ? pool_->layers() : 0; }
  std::int64_t kv_heads() const { return pool_ ? pool_->kv_heads() : 0; }
  std::int64_t head_dim() const { return pool_ ? pool_->head_dim() : 0; }
  // True when a model of `cfg` can keep its keys and values here (false for a default-constructed cache).
  bool fits(const ModelConfig& cfg) const { return pool_ && pool_->fits(cfg); }
  torch::ScalarType dtype() const;
  torch::Device device() const;
  KVBlockPool& pool() const { return *pool_; }
  const std::shared_ptr<KVPools>& pools() const { return pools_; }
  // Row r's blocks, in position order.
  const std::vector<std::int64_t>& blocks(std::int64_t row) const { return tables_[row]; }
  // Where position `pos` of row `row` is stored in the pool's [slots, kv_heads, head_dim] tensors.
  std::int64_t slot(std::int64_t row, std::int64_t pos) const {
    return tables_[row][pos / kKVBlockTokens] * kKVBlockTokens + pos % kKVBlockTokens;
  }

  // Makes positions [length, length + count) of every row writable: allocates the blocks they need and copies a
  // block this row shares with another before it is written (copy on write). Throws past capacity.
  void prepare_append(std::int64_t count);
  // The same, leaving the copies to the caller: appends (shared block, its row's new block) pairs to `copies`, to
  // be made (KVBlockPool::copy_blocks) before anything reads or writes those blocks. A decoding step makes every
  // cache's copies at once.
  void prepare_append(std::int64_t count, std::vector<std::pair<std::int64_t, std::int64_t>>& copies);
  // Repeats every row `times` times (row i -> rows i*times ...): the copies share the blocks.
  void repeat_batch(std::int64_t times);
  // Keeps only the rows at `index` (int64, on any device), in that order; the others' blocks are released.
  void select_batch(const torch::Tensor& index);
  // Moves the cache to the pool of `dtype` (the filled positions converted, rounding to nearest).
  void convert(torch::ScalarType dtype);
  // Layer `layer`'s keys / values of every row as one tensor [batch, kv_heads, length, head_dim] (a copy).
  torch::Tensor keys(std::size_t layer) const;
  torch::Tensor values(std::size_t layer) const;

 private:
  void release_all();
  torch::Tensor gather(const torch::Tensor& storage) const;

  std::shared_ptr<KVPools> pools_;
  KVBlockPool* pool_ = nullptr;
  std::vector<std::vector<std::int64_t>> tables_;
};

// One decoding step's view of several caches of one pool, a row per new token: every row's block table padded to
// the longest ([rows, max_blocks], the padding repeating the row's last block), its key count after the step
// (its new position + 1) and the slot its new key and value go to.
struct DecodeSlots {
  std::vector<std::int64_t> tables;
  std::int64_t max_blocks = 0;
  std::vector<std::int64_t> lengths;
  std::vector<std::int64_t> slots;
  std::vector<std::int64_t> advance;  // per cache: the positions the step adds (1, or its chunk's length)
  std::int64_t rows() const { return static_cast<std::int64_t>(lengths.size()); }
};
// Prepares every cache for the step's new positions and lays out the step. All caches must share one pool.
// new_tokens[c]: cache c's rows in the step, either one new token per sequence (its batch) or, with a batch of one,
// that many consecutive positions of its sequence (a chunk of a prompt: a row attends over the keys up to its own
// position, the chunk's earlier ones included). Empty: one token per sequence everywhere. The caches' lengths are
// left as they were: the step adds `advance` to them once their keys are stored.
DecodeSlots prepare_decode_step(std::span<KVCache* const> caches, std::span<const std::int64_t> new_tokens,
                                const char* who);

}  // namespace rlloop::engine
