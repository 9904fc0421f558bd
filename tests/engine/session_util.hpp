// Shared helpers for the LocalSession tests: byte-level data, scratch directories, errors as text, and a gate
// that holds a base model's engine loop.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

#include "test_device.hpp"

namespace test_util {
using namespace rlloop;

inline std::vector<token_id> bytes(const std::string& s) {
  std::vector<token_id> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

// Next-token SFT example over the whole text: input = text[:-1], target = text[1:], weight 1.
inline Datum sft_datum(const std::string& text) {
  auto t = bytes(text);
  Datum d;
  d.model_input = ModelInput::from_tokens(std::vector<token_id>(t.begin(), t.end() - 1));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(t.begin() + 1, t.end()));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(t.size() - 1, 1.0f));
  return d;
}

inline SessionOptions tiny(std::optional<LoraOptions> lora = std::nullopt, std::int64_t seed = 0) {
  SessionOptions o;
  o.base_model = "rlloop-tiny";
  o.lora = std::move(lora);
  o.seed = seed;
  return o;
}

// Also configures this process: one thread, as bit-exact comparisons across processes need the same reduction
// order, and the caching CPU allocator, as the CLI runs sessions. The device and dtype are the environment's
// (tests/test_device.hpp: the CPU in fp32 unless RLLOOP_TEST_DEVICE / RLLOOP_TEST_DTYPE say otherwise).
inline LocalServiceOptions service_in(const std::string& dir) {
  configure_engine_process({.num_threads = 1});
  LocalServiceOptions s;
  s.checkpoint_dir = dir;
  s.device = test_device::device();
  s.dtype = test_device::dtype();
  return s;
}

// How far two computations of one logprob may be apart on the test device and dtype.
inline double lp_tol() { return test_device::logprob_tolerance(); }

// A fresh directory under the system's temporary one, named for the test and this process.
inline std::filesystem::path temp_dir(const std::string& prefix, const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / (prefix + "-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// The message of the rlloop::error fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const rlloop::error& e) {
    return e.what();
  }
  return "(no error)";
}

// Holds the engine loop of `session`'s base model in a custom loss until release(): every operation of every
// session on that base submitted meanwhile waits, so what is submitted next reaches the loop at once. Gates
// queue like any operation; wait_held() returns once the loop runs this one (it is no longer a queued operation).
class LoopGate {
 public:
  explicit LoopGate(LocalSession& session) {
    auto opened = released_.get_future().share();
    auto entered = std::make_shared<std::promise<void>>();
    held_ = entered->get_future();
    done_ = session.forward_backward_custom(
        {sft_datum("gate")}, [opened, entered](const std::vector<Datum>&, const std::vector<std::vector<double>>& lp) {
          entered->set_value();
          opened.wait();
          CustomLossResult r;
          for (const auto& row : lp) r.grad_logprobs.emplace_back(row.size(), 0.0);
          return r;
        });
  }
  void wait_held() { held_.wait(); }
  void release() {
    released_.set_value();
    done_.get();
  }

 private:
  std::promise<void> released_;
  std::future<void> held_;
  Future<ForwardBackwardOutput> done_;
};

}  // namespace test_util
