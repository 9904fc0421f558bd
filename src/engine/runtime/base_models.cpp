#include "runtime/base_models.hpp"

#include <cstring>

namespace rlloop::engine {

// FNV-1a, word by word.
std::uint64_t frozen_weights_hash(SharedBase& base, bool slice) {
  std::call_once(base.hashed, [&] {
    std::uint64_t hash = 1469598103934665603ull;
    for (const auto& [name, t] : base.model->hf_state_dict()) {
      if (slice && base.model->is_expert_tensor(name)) continue;
      auto cpu = t.detach().to(torch::kCPU).contiguous();
      const auto* bytes = static_cast<const std::uint8_t*>(cpu.data_ptr());
      for (std::size_t i = 0; i + 8 <= cpu.nbytes(); i += 8) {
        std::uint64_t w;
        std::memcpy(&w, bytes + i, 8);
        hash = (hash ^ w) * 1099511628211ull;
      }
    }
    base.weights_hash = hash;
  });
  return base.weights_hash;
}

std::shared_ptr<EngineLoop> BaseModelRegistry::loop(const std::string& key) {
  std::lock_guard lock(mu_);
  if (auto loop = loops_[key].lock()) return loop;
  auto loop = std::make_shared<EngineLoop>(loop_options_);
  loops_[key] = loop;
  return loop;
}

std::shared_ptr<SharedBase> BaseModelRegistry::base(const std::string& key,
                                                    const std::function<void(SharedBase&)>& load) {
  // Loading under the lock: two sessions created at once load the base once.
  std::lock_guard lock(mu_);
  if (auto base = bases_[key].lock()) return base;
  auto base = std::make_shared<SharedBase>();
  load(*base);
  bases_[key] = base;
  return base;
}

std::vector<BaseModelStats> BaseModelRegistry::stats() const {
  std::lock_guard lock(mu_);
  std::vector<BaseModelStats> out;
  for (const auto& [key, weak] : loops_) {
    auto loop = weak.lock();
    if (!loop) continue;
    const EngineLoopStats s = loop->stats();
    BaseModelStats b;
    b.base = key;
    b.sessions = s.lanes;
    auto it = bases_.find(key);
    // Each user of the shared weights holds one reference to them.
    b.shared_weight_users = it == bases_.end() ? 0 : static_cast<int>(it->second.use_count());
    if (auto shared = it == bases_.end() ? nullptr : it->second.lock()) {
      b.shared_weight_bytes = shared->model->quantized_bytes();
      for (const auto& p : shared->model->parameters()) b.shared_weight_bytes += p.numel() * p.element_size();
    }
    b.active_requests = s.active_requests;
    b.active_rows = s.active_rows;
    b.queued_operations = s.queued_operations;
    b.peak_batch_rows = s.peak_batch_rows;
    b.kv_reserved_bytes = s.kv_reserved_bytes;
    b.peak_kv_reserved_bytes = s.peak_kv_reserved_bytes;
    b.peak_batch_requests = s.peak_batch_requests;
    b.decode_steps = s.decode_steps;
    out.push_back(b);
  }
  return out;
}

}  // namespace rlloop::engine
