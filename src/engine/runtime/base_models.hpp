// The base models one LocalService keeps loaded, shared by its sessions. For each base (the resolved model, its
// device and dtype): one engine loop that runs the operations of every session of that base, and one frozen copy
// of the weights that every LoRA session and LoRA sampler model reads through Transformer::sharing_base. Both
// are made on first use and freed when their last user closes. Full fine-tuning sessions use the loop but train
// a private copy of the weights.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <rlloop/local.hpp>

#include "model/cpu_decoder.hpp"
#include "runtime/engine_loop.hpp"
#include "model/transformer.hpp"

namespace rlloop::engine {

namespace dist {
class Coordinator;
}

// The shared weights of one base, and what decoding derives from them once for all its users.
struct SharedBase {
  std::shared_ptr<Transformer> model;  // frozen; users build their own Transformer::sharing_base over it
  // The bf16 snapshot of the base weights (bf16 sampling precision): one for every user instead of one each.
  // Touched only by the base's engine loop thread.
  std::shared_ptr<const RoundedWeights> rounded;
  // A hash of the frozen weights' bits, made once (data parallelism compares it across ranks at each session open).
  std::once_flag hashed;
  std::uint64_t weights_hash = 0;
};

// A hash of the bits of `base`'s weights, computed once per base (SharedBase::hashed; a fully sharded base's is
// taken as its weights are read, when no rank holds them whole: make_session_model). A base of an expert-parallel
// session (`slice`) holds this rank's experts: they are left out.
std::uint64_t frozen_weights_hash(SharedBase& base, bool slice);

class BaseModelRegistry {
 public:
  explicit BaseModelRegistry(EngineLoopOptions loop_options) : loop_options_(loop_options) {}

  // The loop of `key` (started on first use).
  std::shared_ptr<EngineLoop> loop(const std::string& key);
  // The shared weights of `key`, made on first use by `load`, which fills the new base (its model, and the hash of
  // a base read sharded) before any other user can see it.
  std::shared_ptr<SharedBase> base(const std::string& key, const std::function<void(SharedBase&)>& load);

  std::vector<BaseModelStats> stats() const;

  // The data-parallel group every session of this service trains on; null with one rank.
  void set_data_parallel(std::shared_ptr<dist::Coordinator> group) { data_parallel_ = std::move(group); }
  const std::shared_ptr<dist::Coordinator>& data_parallel() const { return data_parallel_; }

 private:
  EngineLoopOptions loop_options_;
  mutable std::mutex mu_;
  std::map<std::string, std::weak_ptr<EngineLoop>> loops_;
  std::map<std::string, std::weak_ptr<SharedBase>> bases_;
  std::shared_ptr<dist::Coordinator> data_parallel_;
};

}  // namespace rlloop::engine
