// What the preference examples (DPO / IPO and KTO) set up alike: the output folder, a local service that
// checkpoints into it, a full fine-tuning client of the model, its tokenizer, and the frozen reference: a
// snapshot of the starting weights, whose logprobs the algorithms cache.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

namespace rlloop::examples {

struct PreferenceSetup {
  ServiceClient<LocalService> service;
  TrainingClient<LocalSession> client;
  std::shared_ptr<const Tokenizer> tokenizer;
  SamplingClient<LocalSession> reference;
};

inline PreferenceSetup preference_setup(const std::string& model, std::int64_t seed, const std::string& out_dir) {
  std::filesystem::create_directories(out_dir);
  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = (std::filesystem::path(out_dir) / "checkpoints").string();
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = service.create_full_training_client(model, seed);
  auto tokenizer = rlloop::load_tokenizer(client);
  auto reference = client.save_weights_and_get_sampling_client("reference");
  return {std::move(service), std::move(client), std::move(tokenizer), std::move(reference)};
}

}  // namespace rlloop::examples
