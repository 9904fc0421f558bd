#include "model/kv_cache.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include <rlloop/error.hpp>

#include "kernels/device.hpp"

namespace rlloop::engine {

// ------------------------------------------------------------------------------------------- KVBlockPool

KVBlockPool::KVBlockPool(const ModelConfig& cfg, torch::Device device, torch::ScalarType dtype)
    : layers_(cfg.num_hidden_layers),
      kv_heads_(cfg.num_key_value_heads),
      head_dim_(cfg.head_dim),
      device_(device),
      dtype_(dtype),
      keys_(static_cast<std::size_t>(cfg.num_hidden_layers)),
      values_(static_cast<std::size_t>(cfg.num_hidden_layers)) {}

void KVBlockPool::grow(std::int64_t blocks) {
  const auto old_blocks = static_cast<std::int64_t>(references_.size());
  // Ordinary tensors even when the first request arrives in inference mode: a cache filled under InferenceMode
  // can then still be written by a prefill that runs under no_grad only.
  c10::InferenceMode normal(false);
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().device(device_).dtype(dtype_);
  // Every new tensor first, then the swap: running out of memory half way leaves the pool as it was.
  std::vector<torch::Tensor> keys, values;
  for (auto [from, to] : {std::pair{&keys_, &keys}, {&values_, &values}})
    for (const torch::Tensor& t : *from) {
      // Unused slots are never read (attention stops at each row's length), so they need no zeroing.
      to->push_back(torch::empty({blocks * kKVBlockTokens, kv_heads_, head_dim_}, opts));
      if (old_blocks > 0) to->back().narrow(0, 0, old_blocks * kKVBlockTokens).copy_(t);
    }
  keys_ = std::move(keys);
  values_ = std::move(values);
  references_.resize(static_cast<std::size_t>(blocks), 0);
  for (std::int64_t b = blocks - 1; b >= old_blocks; --b) free_.push_back(b);  // the lowest block is taken first
}

std::int64_t KVBlockPool::allocate() {
  std::lock_guard lock(mutex_);
  if (free_.empty())
    grow(std::max({std::int64_t{16}, 2 * static_cast<std::int64_t>(references_.size()), capacity_blocks_}));
  const std::int64_t block = free_.back();
  free_.pop_back();
  references_[block] = 1;
  return block;
}

void KVBlockPool::retain(std::int64_t block) {
  std::lock_guard lock(mutex_);
  ++references_.at(static_cast<std::size_t>(block));
}

void KVBlockPool::release(std::int64_t block) {
  std::lock_guard lock(mutex_);
  int& refs = references_.at(static_cast<std::size_t>(block));
  if (refs <= 0) throw std::logic_error("KVBlockPool::release: block " + std::to_string(block) + " is not in use");
  if (--refs > 0) return;
  free_.push_back(block);
  if (free_.size() == references_.size()) {
    // The last block of the last request: the storage goes too, so that an idle pool holds no memory (the next
    // request grows it again, copying nothing while it grows from empty).
    for (auto* list : {&keys_, &values_})
      for (auto& t : *list) t = torch::Tensor();
    references_.clear();
    free_.clear();
  }
}

std::int64_t KVBlockPool::references(std::int64_t block) const {
  std::lock_guard lock(mutex_);
  return references_.at(static_cast<std::size_t>(block));
}

void KVBlockPool::copy_blocks(std::span<const std::pair<std::int64_t, std::int64_t>> copies) {
  if (copies.empty()) return;
  const auto n = static_cast<std::int64_t>(copies.size());
  std::vector<std::int64_t> blocks;  // every source, then every destination: one copy to the device
  for (const auto& copy : copies) blocks.push_back(copy.first);
  for (const auto& copy : copies) blocks.push_back(copy.second);
  torch::NoGradGuard no_grad;
  const torch::Tensor on_device = to_device(torch::tensor(blocks, torch::kLong), device_);
  const torch::Tensor from_blocks = on_device.narrow(0, 0, n), to_blocks = on_device.narrow(0, n, n);
  for (auto* list : {&keys_, &values_})
    for (auto& t : *list) {
      const torch::Tensor blocks = t.view({-1, kKVBlockTokens, kv_heads_, head_dim_});
      blocks.index_copy_(0, to_blocks, blocks.index_select(0, from_blocks));
    }
}

std::int64_t KVBlockPool::blocks_in_use() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::int64_t>(references_.size() - free_.size());
}

void KVBlockPool::set_capacity_blocks(std::int64_t blocks) {
  std::lock_guard lock(mutex_);
  capacity_blocks_ = std::max<std::int64_t>(blocks, 0);
}

bool KVBlockPool::fits(const ModelConfig& cfg) const {
  return layers_ == cfg.num_hidden_layers && kv_heads_ == cfg.num_key_value_heads && head_dim_ == cfg.head_dim;
}

std::int64_t KVBlockPool::bytes_per_block() const {
  return 2 * layers_ * kKVBlockTokens * kv_heads_ * head_dim_ * static_cast<std::int64_t>(c10::elementSize(dtype_));
}

// ---------------------------------------------------------------------------------------------- KVPools

KVPools::KVPools(const ModelConfig& cfg, torch::Device device) : cfg_(cfg), device_(device) {}

KVBlockPool& KVPools::pool(torch::ScalarType dtype) {
  std::lock_guard lock(mutex_);
  auto& slot = pools_[dtype];
  if (!slot) {
    slot = std::make_unique<KVBlockPool>(cfg_, device_, dtype);
    slot->set_capacity_blocks(capacity_bytes_ / slot->bytes_per_block());
  }
  return *slot;
}

void KVPools::set_capacity_bytes(std::int64_t bytes) {
  std::lock_guard lock(mutex_);
  capacity_bytes_ = std::max<std::int64_t>(bytes, 0);
  for (auto& [dtype, pool] : pools_) pool->set_capacity_blocks(capacity_bytes_ / pool->bytes_per_block());
}

// ---------------------------------------------------------------------------------------------- KVCache

KVCache::KVCache(std::shared_ptr<KVPools> pools, torch::ScalarType dtype, std::int64_t batch, std::int64_t capacity)
    : capacity(capacity), pools_(std::move(pools)) {
  if (batch <= 0 || capacity <= 0)
    throw invalid_argument("KVCache: batch and capacity must be positive, got batch " + std::to_string(batch) +
                           ", capacity " + std::to_string(capacity));
  if (!pools_) throw invalid_argument("KVCache: no block pools");
  pool_ = &pools_->pool(dtype);
  tables_.resize(static_cast<std::size_t>(batch));
}

KVCache KVCache::allocate(const ModelConfig& cfg, std::int64_t batch, std::int64_t capacity, torch::Device device,
                          torch::ScalarType dtype) {
  return KVCache(std::make_shared<KVPools>(cfg, device), dtype, batch, capacity);
}

KVCache::KVCache(const KVCache& other)
    : length(other.length), capacity(other.capacity), pools_(other.pools_), pool_(other.pool_),
      tables_(other.tables_) {
  for (const auto& table : tables_)
    for (std::int64_t b : table) pool_->retain(b);
}

KVCache& KVCache::operator=(const KVCache& other) {
  if (this != &other) *this = KVCache(other);
  return *this;
}

KVCache::KVCache(KVCache&& other) noexcept
    : length(other.length), capacity(other.capacity), pools_(std::move(other.pools_)), pool_(other.pool_),
      tables_(std::move(other.tables_)) {
  other.pool_ = nullptr;
  other.tables_.clear();
}

KVCache& KVCache::operator=(KVCache&& other) noexcept {
  if (this != &other) {
    release_all();
    length = other.length;
    capacity = other.capacity;
    pools_ = std::move(other.pools_);
    pool_ = other.pool_;
    tables_ = std::move(other.tables_);
    other.pool_ = nullptr;
    other.tables_.clear();
  }
  return *this;
}

KVCache::~KVCache() { release_all(); }

void KVCache::release_all() {
  if (!pool_) return;
  for (const auto& table : tables_)
    for (std::int64_t b : table) pool_->release(b);
  tables_.clear();
}

torch::ScalarType KVCache::dtype() const { return pool_ ? pool_->dtype() : torch::kFloat32; }
torch::Device KVCache::device() const { return pool_ ? pool_->device() : torch::Device(torch::kCPU); }

void KVCache::prepare_append(std::int64_t count) {
  std::vector<std::pair<std::int64_t, std::int64_t>> copies;
  prepare_append(count, copies);
  pool_->copy_blocks(copies);
}

void KVCache::prepare_append(std::int64_t count, std::vector<std::pair<std::int64_t, std::int64_t>>& copies) {
  if (length + count > capacity)
    throw invalid_argument("KV cache capacity " + std::to_string(capacity) + " exceeded (" + std::to_string(length) +
                           " cached + " + std::to_string(count) + " new tokens)");
  if (count <= 0) return;
  const std::int64_t first = length / kKVBlockTokens, last = (length + count - 1) / kKVBlockTokens;
  for (auto& table : tables_) {
    // Only the block holding position `length` can be filled already, and so shared: later ones are new.
    for (std::int64_t b = first; b <= last; ++b) {
      if (b < static_cast<std::int64_t>(table.size())) {
        const std::int64_t block = table[b];
        if (pool_->references(block) == 1) continue;
        // Still held by another row after this release, so it cannot be reused before the copy is made.
        const std::int64_t own = pool_->allocate();
        copies.emplace_back(block, own);
        pool_->release(block);
        table[b] = own;
      } else {
        table.push_back(pool_->allocate());
      }
    }
  }
}

void KVCache::repeat_batch(std::int64_t times) {
  if (times <= 0) throw invalid_argument("KVCache::repeat_batch: times must be positive");
  std::vector<std::vector<std::int64_t>> repeated;
  repeated.reserve(tables_.size() * static_cast<std::size_t>(times));
  for (const auto& table : tables_)
    for (std::int64_t t = 0; t < times; ++t) {
      repeated.push_back(table);
      if (t > 0)
        for (std::int64_t b : table) pool_->retain(b);
    }
  tables_ = std::move(repeated);
}

void KVCache::select_batch(const torch::Tensor& index) {
  const torch::Tensor idx = index.to(torch::kCPU, torch::kLong).contiguous();
  const std::int64_t* rows = idx.data_ptr<std::int64_t>();
  std::vector<std::vector<std::int64_t>> kept;
  for (std::int64_t i = 0; i < idx.numel(); ++i) {
    if (rows[i] < 0 || rows[i] >= batch())
      throw invalid_argument("KVCache::select_batch: row " + std::to_string(rows[i]) + " is outside the batch of " +
                             std::to_string(batch()));
    kept.push_back(tables_[rows[i]]);
    for (std::int64_t b : kept.back()) pool_->retain(b);
  }
  release_all();
  tables_ = std::move(kept);
}

void KVCache::convert(torch::ScalarType dtype) {
  if (!pool_ || dtype == pool_->dtype()) return;
  KVBlockPool& to = pools_->pool(dtype);
  std::vector<std::vector<std::int64_t>> converted;
  std::map<std::int64_t, std::int64_t> moved;  // a block shared by several rows stays shared
  c10::InferenceMode normal(false);
  torch::NoGradGuard no_grad;
  for (const auto& table : tables_) {
    converted.emplace_back();
    for (std::int64_t b : table) {
      auto [it, fresh] = moved.try_emplace(b, -1);
      if (fresh) {
        it->second = to.allocate();
        for (std::size_t l = 0; l < pool_->layers(); ++l) {
          to.keys(l).narrow(0, it->second * kKVBlockTokens, kKVBlockTokens)
              .copy_(pool_->keys(l).narrow(0, b * kKVBlockTokens, kKVBlockTokens));
          to.values(l).narrow(0, it->second * kKVBlockTokens, kKVBlockTokens)
              .copy_(pool_->values(l).narrow(0, b * kKVBlockTokens, kKVBlockTokens));
        }
      } else {
        to.retain(it->second);
      }
      converted.back().push_back(it->second);
    }
  }
  release_all();
  pool_ = &to;
  tables_ = std::move(converted);
}

torch::Tensor KVCache::gather(const torch::Tensor& storage) const {
  std::vector<std::int64_t> slots;
  for (std::int64_t r = 0; r < batch(); ++r)
    for (std::int64_t p = 0; p < length; ++p) slots.push_back(slot(r, p));
  const torch::Tensor index = torch::tensor(slots, torch::kLong).to(storage.device());
  return storage.index_select(0, index).view({batch(), length, storage.size(1), storage.size(2)}).transpose(1, 2)
      .contiguous();
}

torch::Tensor KVCache::keys(std::size_t layer) const { return gather(pool_->keys(layer)); }
torch::Tensor KVCache::values(std::size_t layer) const { return gather(pool_->values(layer)); }

// ------------------------------------------------------------------------------------------ DecodeSlots

DecodeSlots prepare_decode_step(std::span<KVCache* const> caches, std::span<const std::int64_t> new_tokens,
                                const char* who) {
  DecodeSlots out;
  if (!new_tokens.empty() && new_tokens.size() != caches.size())
    throw std::logic_error("prepare_decode_step: one count of new tokens per cache");
  auto count = [&](std::size_t c) { return new_tokens.empty() ? caches[c]->batch() : new_tokens[c]; };
  for (std::size_t c = 0; c < caches.size(); ++c) {
    const KVCache& cache = *caches[c];
    if (&cache.pool() != &caches.front()->pool())
      throw invalid_argument(std::string(who) + ": the groups' KV caches must share one block pool (the model's "
                             "kv_pools() at one dtype)");
    if (count(c) != cache.batch() && cache.batch() != 1)
      throw invalid_argument(std::string(who) + ": " + std::to_string(count(c)) + " new tokens for a cache of " +
                             std::to_string(cache.batch()) + " sequences (one each, or a chunk of one sequence)");
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> copies;
  for (std::size_t c = 0; c < caches.size(); ++c) {
    KVCache& cache = *caches[c];
    out.advance.push_back(cache.batch() == count(c) ? 1 : count(c));
    cache.prepare_append(out.advance.back(), copies);
    out.max_blocks = std::max(out.max_blocks, (cache.length + out.advance.back() - 1) / kKVBlockTokens + 1);
  }
  if (!caches.empty()) caches.front()->pool().copy_blocks(copies);
  for (std::size_t c = 0; c < caches.size(); ++c) {
    const KVCache& cache = *caches[c];
    for (std::int64_t r = 0; r < cache.batch(); ++r) {
      const auto& table = cache.blocks(r);
      for (std::int64_t p = cache.length; p < cache.length + out.advance[c]; ++p) {
        for (std::int64_t b = 0; b < out.max_blocks; ++b)
          out.tables.push_back(table[std::min<std::int64_t>(b, static_cast<std::int64_t>(table.size()) - 1)]);
        out.lengths.push_back(p + 1);
        out.slots.push_back(cache.slot(r, p));
      }
    }
  }
  return out;
}

}  // namespace rlloop::engine
