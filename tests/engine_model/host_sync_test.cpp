// What one decoding step and one training step ask of ATen, counted with LibTorch's RecordFunction observers: the
// operators they run, and the ones that make a CUDA host wait for the device (a copy to the host, .item(), operators
// whose output size depends on data). A decode step may bring back exactly one thing, its sampled tokens (with their
// logprobs, in the same copy, through engine::to_host); anything else would stall the CPU behind the GPU at every
// token. The operator counts must not grow with the rows of a batch (no per-row loop issuing operators).
//
// Device and dtype from the environment (tests/test_device.hpp). On the CPU no copy crosses a device, so there the
// test sees the engine's to_host scopes, .item() and the data-dependent operators; on CUDA it also sees every real
// device-to-host copy_, which must all lie inside the one to_host of the step.
#include <gtest/gtest.h>

#include <ATen/record_function.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "model/builtin_models.hpp"
#include "kernels/device.hpp"
#include "engine/session_util.hpp"
#include "model/experts.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "test_device.hpp"
#include "tiny_models.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {

// What the operators seen between two take() calls asked for.
struct OpCounts {
  int operators = 0;
  // Those called by the engine itself, not from inside another operator (whose own calls are its implementation:
  // LibTorch 1.13's CPU bmm, for one, selects and multiplies each matrix of the batch in turn, where CUDA makes one
  // batched call).
  int top_level = 0;
  std::map<std::string, int> top_level_by_name;
  int to_host_scopes = 0;                  // engine::to_host calls
  int device_to_host = 0;                  // copy_ calls from a device to the host (CUDA only)
  int device_to_host_outside = 0;          // those not inside an engine::to_host
  // Conversions to the CPU (aten::to / aten::_to_copy naming the CPU device: .cpu(), .to(kCPU)) called by the engine
  // outside an engine::to_host. On CUDA each is a copy back and a wait; on the CPU they copy nothing, and torch::tensor
  // makes one too as it builds a host tensor (an index to upload), which the CPU cannot tell from .cpu(): the tests
  // compare these counts between a mixture-of-experts model and a dense one, whose forwards differ in the MLP alone.
  int to_cpu_outside = 0;
  std::map<std::string, int> host_syncs;   // operators that wait for the device, by name
  std::map<std::string, int> by_name;      // every operator, for the failure message

  std::string describe() const {
    std::string s;
    for (const auto& [name, n] : by_name) s.append(name).append(" x").append(std::to_string(n)).append("\n");
    return s;
  }
  std::string describe_top_level() const {
    std::string s;
    for (const auto& [name, n] : top_level_by_name)
      s.append(name).append(" x").append(std::to_string(n)).append("\n");
    return s;
  }
};

// Operators that return data the host must have first: .item() and the ones whose output shape is computed from
// values on the device.
const std::set<std::string>& syncing_operators() {
  // aten::bincount: its CUDA kernel reads the input's maximum back to size its output, whatever minlength says.
  static const std::set<std::string> names = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero",
                                              "aten::masked_select", "aten::_unique", "aten::_unique2",
                                              "aten::unique_dim", "aten::unique_consecutive", "aten::is_nonzero",
                                              "aten::equal", "aten::bincount"};
  return names;
}

bool is_cpu_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().device().is_cpu(); }

// Whether a call of aten::to / aten::_to_copy names the CPU as its target device.
template <class Inputs>
bool names_the_cpu(const Inputs& inputs) {
  for (const c10::IValue& v : inputs)
    if (v.isDevice() && v.toDevice().is_cpu()) return true;
  return false;
}

// Records every ATen operator call, on any thread, while it exists (one at a time).
class OpRecorder {
 public:
  OpRecorder() {
    take();
    at::enableRecordFunction(true);
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&OpRecorder::on_enter, &OpRecorder::on_exit)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  }
  ~OpRecorder() { at::removeCallback(handle_); }
  OpRecorder(const OpRecorder&) = delete;
  OpRecorder& operator=(const OpRecorder&) = delete;

  // The counts since the last take().
  static OpCounts take() {
    std::lock_guard lock(mutex_);
    return std::exchange(counts_, OpCounts{});
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    std::lock_guard lock(mutex_);
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (name == engine::kToHostScope) {
        ++counts_.to_host_scopes;
        ++to_host_depth_;
      }
      return nullptr;
    }
    const auto inputs = fn.inputs();
    if (name == "aten::copy_" && inputs.size() >= 2 && inputs[0].isTensor() && inputs[1].isTensor() &&
        is_cpu_tensor(inputs[0]) && !is_cpu_tensor(inputs[1])) {
      ++counts_.device_to_host;
      if (to_host_depth_ == 0) ++counts_.device_to_host_outside;
    }
    if ((name == "aten::to" || name == "aten::_to_copy") && to_host_depth_ == 0 && operator_depth_ == 0 &&
        names_the_cpu(inputs))
      ++counts_.to_cpu_outside;
    ++counts_.operators;
    ++counts_.by_name[name];
    if (operator_depth_++ == 0) {
      ++counts_.top_level;
      ++counts_.top_level_by_name[name];
    }
    if (syncing_operators().count(name)) ++counts_.host_syncs[name];
    return nullptr;
  }

  static void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (std::string(fn.name()) == engine::kToHostScope) --to_host_depth_;
    } else {
      --operator_depth_;
    }
  }

  at::CallbackHandle handle_;
  static inline thread_local int to_host_depth_ = 0;  // engine::to_host scopes open on this thread
  static inline thread_local int operator_depth_ = 0;  // operators open on this thread
  static inline std::mutex mutex_;
  static inline OpCounts counts_;
};

// Decodes `rows` samples of a prompt for a few steps and returns the counts of the third step (past the first,
// whose draw happens in the prefill, and any one-time set-up).
OpCounts decode_step_counts(Transformer& model, int rows) {
  SampleRequest req;
  req.prompt = ModelInput::from_tokens({3, 1, 4, 1, 5, 9, 2, 6});
  req.num_samples = rows;
  req.params = SamplingParams{.max_tokens = 8, .temperature = 1.0};
  DecodeRun run(model, req, nullptr, SampleStream(11), DecodePrecision::fp32, nullptr);
  DecodeRun* const runs[] = {&run};
  OpRecorder recorder;
  decode_step(runs);
  decode_step(runs);
  OpRecorder::take();
  decode_step(runs);
  OpCounts step = OpRecorder::take();
  EXPECT_EQ(run.rows(), rows) << "no sample may stop in these steps (no stop tokens, max_tokens 8)";
  return step;
}

void expect_one_copy_back(const OpCounts& step, const std::string& what) {
  EXPECT_EQ(step.to_host_scopes, 1) << what << ": the sampled tokens come back once per step, nothing else\n"
                                    << step.describe();
  // On the CPU nothing crosses a device; on CUDA the one copy is the to_host's.
  EXPECT_EQ(step.device_to_host, test_device::on_cuda() ? 1 : 0) << what << "\n" << step.describe();
  EXPECT_EQ(step.device_to_host_outside, 0) << what << ": a copy to the host outside engine::to_host";
  EXPECT_TRUE(step.host_syncs.empty()) << what << ": " << step.host_syncs.begin()->first << " waits for the device\n"
                                       << step.describe();
}

}  // namespace

// The decoding step CUDA runs (ATen's operators; on the CPU the same path runs for bf16 models).
TEST(HostSync, AnAtenDecodeStepCopiesTheTokensBackOnceAndNothingElse) {
  const torch::Device device(test_device::device());
  auto model = init_model(test_models::tiny_config("qwen3"), 5, device, torch::kBFloat16);
  const OpCounts two = decode_step_counts(*model, 2);
  const OpCounts six = decode_step_counts(*model, 6);
  expect_one_copy_back(two, "2 rows");
  expect_one_copy_back(six, "6 rows");
  EXPECT_GT(two.operators, 0);
  EXPECT_EQ(two.operators, six.operators) << "operators per step grow with the rows:\n2 rows:\n"
                                          << two.describe() << "6 rows:\n" << six.describe();
  std::cout << "operators per decode step (bf16, " << device << "): " << two.operators << "\n";
}

// Requests of several sessions decoding together (Transformer::decode_step): the base products run once over the
// rows of every group, so 3 groups of 2 rows make as many products as 1 group of 6 (one per projection per layer,
// and the unembedding); sessions whose adapters have one rank run theirs as batched products, as many for 3
// groups as for 2; and every row attends over its own blocks of the one paged pool in one gather, so that the
// step's operators do not grow with the number of requests at all.
TEST(HostSync, AGroupedDecodeStepRunsEachProductOnceForAnyNumberOfGroups) {
  const torch::Device device(test_device::device());
  const ModelConfig cfg = test_models::tiny_config("qwen3");
  auto base = init_model(cfg, 5, device, torch::kBFloat16);
  auto count_a_step = [&](int groups, std::int64_t rows_each, bool lora) {
    c10::InferenceMode inference;
    std::vector<std::shared_ptr<Transformer>> models;
    std::vector<KVCache> caches;
    std::vector<torch::Tensor> tokens;
    for (int g = 0; g < groups; ++g) {
      models.push_back(Transformer::sharing_base(*base));
      if (lora) models.back()->enable_lora(LoraOptions{4, 8, {"all-linear", "lm_head"}}, g);
      caches.emplace_back(base->kv_pools(), torch::kBFloat16, 1, 8);  // the base's pool, as the sampler's
      models.back()->hidden_states(torch::full({1, 3 + g}, 7, torch::TensorOptions(device).dtype(torch::kLong)),
                                   &caches.back());
      caches.back().repeat_batch(rows_each);
      tokens.push_back(torch::full({rows_each}, 5, torch::TensorOptions(device).dtype(torch::kLong)));
    }
    std::vector<DecodeGroup> step;
    for (int g = 0; g < groups; ++g) step.push_back({models[g].get(), &tokens[g], &caches[g]});
    OpRecorder recorder;
    base->decode_step(step);
    const OpCounts counts = OpRecorder::take();
    EXPECT_TRUE(counts.host_syncs.empty()) << counts.host_syncs.begin()->first << " waits for the device";
    EXPECT_EQ(counts.device_to_host, 0) << counts.describe();
    return counts;
  };
  auto count = [](const OpCounts& c, const std::string& name) {
    return c.by_name.count(name) ? c.by_name.at(name) : 0;
  };
  const std::int64_t linears = 7 * cfg.num_hidden_layers + 1;
  const OpCounts one = count_a_step(1, 6, false);
  EXPECT_EQ(count(one, "aten::linear"), linears);
  EXPECT_EQ(count(count_a_step(3, 2, false), "aten::linear"), linears);
  const OpCounts two_adapted = count_a_step(2, 3, true), three_adapted = count_a_step(3, 2, true);
  EXPECT_EQ(count(two_adapted, "aten::linear"), linears) << "the adapters' products are not per group";
  EXPECT_EQ(count(three_adapted, "aten::linear"), linears);
  // Two batched products per adapted linear, whatever the groups (attention may use bmm too, per group: the base
  // models' steps with as many groups take that out).
  const OpCounts two_plain = count_a_step(2, 3, false), three_plain = count_a_step(3, 2, false);
  EXPECT_EQ(count(two_adapted, "aten::bmm") - count(two_plain, "aten::bmm"), 2 * linears) << two_adapted.describe();
  EXPECT_EQ(count(three_adapted, "aten::bmm") - count(three_plain, "aten::bmm"), 2 * linears);
  // Every operator the step calls, attention and the cache's copy on write included, the same for 2 requests as
  // for 3.
  EXPECT_EQ(two_plain.top_level, three_plain.top_level)
      << two_plain.describe_top_level() << "--\n" << three_plain.describe_top_level();
  EXPECT_EQ(two_adapted.top_level, three_adapted.top_level)
      << two_adapted.describe_top_level() << "--\n" << three_adapted.describe_top_level();
  std::cout << "operators called per grouped decode step (bf16, " << device << "): " << two_adapted.top_level
            << " for 2 or 3 adapted requests\n";
}

// Prompts prefilled in decoding steps (chunked prefill: DecodeGroup chunks) are rows of the step like the others':
// a step holding 3 prompts' chunks beside a decoding request runs each base product once, as one holding 1 does,
// and nothing waits for the device.
TEST(HostSync, AStepPrefillingSeveralPromptsRunsEachProductOnce) {
  const torch::Device device(test_device::device());
  const ModelConfig cfg = test_models::tiny_config("qwen3");
  auto base = init_model(cfg, 5, device, torch::kBFloat16);
  const auto ids = torch::TensorOptions(device).dtype(torch::kLong);
  auto count_a_step = [&](int prompts) {
    c10::InferenceMode inference;
    KVCache decoding(base->kv_pools(), torch::kBFloat16, 1, 8);
    base->hidden_states(torch::full({1, 3}, 7, ids), &decoding);
    decoding.repeat_batch(2);
    const torch::Tensor next = torch::full({2}, 5, ids);
    std::vector<KVCache> caches;
    std::vector<torch::Tensor> chunks;
    for (int p = 0; p < prompts; ++p) {
      caches.emplace_back(base->kv_pools(), torch::kBFloat16, 1, 16);
      chunks.push_back(torch::full({5 + p}, 9 + p, ids));
    }
    std::vector<DecodeGroup> step = {{base.get(), &next, &decoding}};
    for (int p = 0; p < prompts; ++p) step.push_back({base.get(), &chunks[p], &caches[p]});
    OpRecorder recorder;
    const torch::Tensor logits = base->decode_step(step);
    const OpCounts counts = OpRecorder::take();
    EXPECT_EQ(logits.size(0), 2 + prompts) << "the decoding rows and each chunk's last";
    EXPECT_TRUE(counts.host_syncs.empty()) << counts.host_syncs.begin()->first << " waits for the device";
    EXPECT_EQ(counts.device_to_host, 0) << counts.describe();
    return counts.by_name.count("aten::linear") ? counts.by_name.at("aten::linear") : 0;
  };
  const std::int64_t linears = 7 * cfg.num_hidden_layers + 1;
  EXPECT_EQ(count_a_step(1), linears);
  EXPECT_EQ(count_a_step(3), linears);
}

// The CPU's fp32 decoder (CpuDecoder: its own kernels, a few ATen operators around them) holds the same rule.
TEST(HostSync, TheCpuDecoderStepCopiesTheTokensBackOnce) {
  if (test_device::on_cuda()) GTEST_SKIP() << "the CPU decoder runs on the CPU only";
  auto model = init_model(test_models::tiny_config("llama"), 5, torch::kCPU, torch::kFloat32);
  ASSERT_TRUE(CpuDecoder::supports(*model));
  const OpCounts two = decode_step_counts(*model, 2);
  const OpCounts six = decode_step_counts(*model, 6);
  expect_one_copy_back(two, "2 rows");
  EXPECT_EQ(two.operators, six.operators) << two.describe() << "--\n" << six.describe();
}

namespace {

// The counts of one forward_backward + optim_step of `datums` datums on a fresh full fine-tuning session (the
// session tests' service: the environment's device and dtype).
OpCounts training_step_counts(int datums, const std::string& base_model = "rlloop-tiny") {
  LocalSession session(SessionOptions{.base_model = base_model},
                       test_util::service_in(test_util::temp_dir("rlloop-host-sync", "training").string()));
  std::vector<Datum> batch;
  for (int i = 0; i < datums; ++i) batch.push_back(test_util::sft_datum("datum " + std::to_string(i) + " of a batch"));
  // A first step builds what every later step reuses (optimizer state, caches).
  session.forward_backward(batch, LossSpec::cross_entropy()).get();
  session.optim_step(AdamParams{.learning_rate = 1e-4}).get();
  OpRecorder recorder;
  session.forward_backward(batch, LossSpec::cross_entropy()).get();
  session.optim_step(AdamParams{.learning_rate = 1e-4}).get();
  return OpRecorder::take();
}

}  // namespace

TEST(HostSync, ATrainingStepRunsAsManyOperatorsForFourDatumsAsForTwo) {
  const OpCounts two = training_step_counts(2);
  const OpCounts four = training_step_counts(4);
  std::cout << "training step (forward_backward + optim_step, rlloop-tiny, " << test_device::dtype() << "): "
            << two.operators << " operators, " << two.to_host_scopes << " to_host, syncs:";
  for (const auto& [name, n] : two.host_syncs) std::cout << " " << name << " x" << n;
  std::cout << "\n";
  EXPECT_EQ(two.operators, four.operators) << "2 datums:\n" << two.describe() << "4 datums:\n" << four.describe();
  EXPECT_EQ(two.host_syncs, four.host_syncs);
  EXPECT_EQ(four.to_host_scopes, two.to_host_scopes);
  // The per-token logprobs the step returns come back in one copy; the loss and the optimizer's figures as scalars.
  EXPECT_EQ(two.to_host_scopes, 1) << two.describe();
  EXPECT_EQ(two.device_to_host, test_device::on_cuda() ? 1 : 0) << two.describe();
  EXPECT_EQ(two.device_to_host_outside, 0) << "a copy to the host outside engine::to_host";
}

// The same rules for a mixture-of-experts model (rlloop-tiny-moe: its experts' routing is data dependent, the one
// place a forward is tempted to ask the host how many rows each expert got), and for the forwards that prefill and
// train: their routing and their token checks stay on the device. A prefill or training forward brings nothing
// back at all; its router metrics come back once per forward (router_metrics), in one to_host.
namespace {

ModelConfig tiny_moe() { return *builtin_model("rlloop-tiny-moe"); }

torch::ScalarType test_dtype() { return test_device::dtype() == "bf16" ? torch::kBFloat16 : torch::kFloat32; }

int count_of(const OpCounts& c, const std::string& name) { return c.by_name.count(name) ? c.by_name.at(name) : 0; }

// `to_cpu`: the conversions to the CPU allowed (-1: not checked here).
void expect_nothing_back(const OpCounts& c, const std::string& what, int to_cpu = 0) {
  EXPECT_GT(c.operators, 100) << what << ": the recorder saw the forward";
  EXPECT_EQ(c.to_host_scopes, 0) << what << "\n" << c.describe();
  EXPECT_EQ(c.device_to_host, 0) << what << ": a copy to the host\n" << c.describe();
  if (to_cpu >= 0) {
    EXPECT_EQ(c.to_cpu_outside, to_cpu) << what << ": a conversion to the CPU\n" << c.describe();
  }
  EXPECT_TRUE(c.host_syncs.empty()) << what << ": " << c.host_syncs.begin()->first << " waits for the device\n"
                                    << c.describe();
}

}  // namespace

TEST(HostSync, AMixtureOfExpertsDecodeStepCopiesTheTokensBackOnceAndNothingElse) {
  const torch::Device device(test_device::device());
  // bf16: the ATen step and CUDA's expert layout (ExpertRows::padded); fp32 on the CPU: its step kernels for the
  // experts.
  for (const torch::ScalarType dtype : {torch::kBFloat16, torch::kFloat32}) {
    const std::string what = std::string("rlloop-tiny-moe, ") + (dtype == torch::kBFloat16 ? "bf16" : "fp32");
    auto model = init_model(tiny_moe(), 5, device, dtype);
    const OpCounts two = decode_step_counts(*model, 2);
    const OpCounts six = decode_step_counts(*model, 6);
    expect_one_copy_back(two, what + ", 2 rows");
    expect_one_copy_back(six, what + ", 6 rows");
    EXPECT_EQ(count_of(two, "aten::bincount"), 0);
    EXPECT_EQ(two.operators, six.operators) << what << ": operators per step grow with the rows:\n2 rows:\n"
                                            << two.describe() << "6 rows:\n" << six.describe();
    auto dense = init_model(*builtin_model("rlloop-tiny"), 5, device, dtype);
    EXPECT_EQ(two.to_cpu_outside, decode_step_counts(*dense, 2).to_cpu_outside)
        << what << ": a conversion to the CPU the dense model's step does not make\n" << two.describe();
  }
}

TEST(HostSync, APrefillForwardBringsNothingBack) {
  const torch::Device device(test_device::device());
  const auto ids = torch::TensorOptions(device).dtype(torch::kLong);
  int dense_to_cpu = -1;  // the dense model's, first: the index uploads' host tensors
  for (const ModelConfig& cfg : {*builtin_model("rlloop-tiny"), tiny_moe()}) {
    auto model = init_model(cfg, 5, device, test_dtype());
    c10::InferenceMode inference;
    // A prompt, then its continuation after the cache (prefill after a cache: attention over cached keys).
    KVCache cache(model->kv_pools(), test_dtype(), 1, 32);
    const torch::Tensor prompt = torch::arange(3, 15, ids).view({1, 12}), more = torch::arange(20, 25, ids).view({1, 5});
    model->logits(model->hidden_states(prompt, &cache));  // the pool and the RoPE tables made once
    KVCache fresh(model->kv_pools(), test_dtype(), 1, 32);
    OpRecorder recorder;
    model->logits(model->hidden_states(prompt, &fresh));
    model->logits(model->hidden_states(more, &fresh));
    const OpCounts c = OpRecorder::take();
    expect_nothing_back(c, cfg.model_type + " prefill", dense_to_cpu);
    EXPECT_EQ(count_of(c, "aten::bincount"), 0);
    if (cfg.num_experts == 0) dense_to_cpu = c.to_cpu_outside;
  }
}

TEST(HostSync, ATrainingForwardAndBackwardBringNothingBack) {
  const torch::Device device(test_device::device());
  const auto ids = torch::TensorOptions(device).dtype(torch::kLong);
  for (const ModelConfig& cfg : {*builtin_model("rlloop-tiny"), tiny_moe()}) {
    auto model = init_model(cfg, 5, device, test_dtype());
    const torch::Tensor input = torch::arange(3, 27, ids).view({2, 12});
    auto forward_backward = [&] {
      RouterTotals totals;
      ExpertRouting routing{{}, {}, torch::ones({24}, torch::TensorOptions(device)), &totals};
      const torch::Tensor hidden =
          model->hidden_states(input, nullptr, cfg.num_experts > 0 ? &routing : nullptr);
      model->logits(hidden).to(torch::kFloat32).log_softmax(-1).mean().backward();
      return totals;
    };
    forward_backward();
    OpRecorder recorder;
    const RouterTotals totals = forward_backward();
    expect_nothing_back(OpRecorder::take(), cfg.model_type + " training forward and backward");
    if (cfg.num_experts == 0) continue;
    // The router's metrics of the forward: one copy back, whatever the sparse layers.
    EXPECT_EQ(router_metrics(totals).count("router/aux_loss"), 1u);
    const OpCounts metrics = OpRecorder::take();
    EXPECT_EQ(metrics.to_host_scopes, 1) << metrics.describe();
    EXPECT_EQ(metrics.to_cpu_outside, 0) << metrics.describe();
    EXPECT_TRUE(metrics.host_syncs.empty()) << metrics.describe();
  }
}

// The experts' layout CUDA takes (ExpertRows::padded: no count read on the host), run on the CPU: nothing waits,
// and the outputs and gradients are those of the exact layout (each expert over exactly its rows).
TEST(HostSync, ThePaddedExpertLayoutWaitsForNothingAndEqualsTheExactOne) {
  const torch::Device device(test_device::device());
  const auto f = torch::TensorOptions(device).dtype(torch::kFloat64);
  torch::manual_seed(3);
  const std::int64_t N = 9, H = 8, I = 6, E = 5, k = 2;
  auto linear = [&](std::int64_t out, std::int64_t in) {
    Linear l;
    l.weight = torch::randn({out, in}, f).requires_grad_(true);
    return l;
  };
  std::vector<Expert> experts;
  for (std::int64_t e = 0; e < E; ++e) experts.push_back({linear(I, H), linear(I, H), linear(H, I)});
  const torch::Tensor x = torch::randn({N, H}, f);
  // Expert 4 gets no token at all; expert 0 gets most.
  const torch::Tensor logits = torch::randn({N, E}, f) + torch::tensor({2.0, 0.5, 0.0, -0.5, -50.0}, f);
  const Routes routes = route_top_k(logits, k, true, torch::kFloat64);
  torch::Tensor out[2];
  std::vector<torch::Tensor> grads[2];
  for (int i = 0; i < 2; ++i) {
    const ExpertRows layout = i == 0 ? ExpertRows::exact : ExpertRows::padded;
    const torch::Tensor input = x.clone().requires_grad_(true);
    OpRecorder recorder;
    out[i] = run_experts(input, routes, experts, nullptr, false, {}, layout);
    (out[i] * torch::linspace(-1, 1, N * H, f).view({N, H})).sum().backward();
    const OpCounts c = OpRecorder::take();
    if (layout == ExpertRows::padded) expect_nothing_back(c, "the padded layout");
    grads[i].push_back(input.grad());
    for (Expert& e : experts)
      for (Linear* l : {&e.gate, &e.up, &e.down}) {
        // The exact layout leaves an expert without rows out of the graph: no gradient, i.e. zeros.
        const torch::Tensor g = l->weight.grad();
        grads[i].push_back(g.defined() ? g.clone() : torch::zeros_like(l->weight));
        l->weight.mutable_grad() = torch::Tensor();
      }
  }
  EXPECT_LT((out[0] - out[1]).abs().max().item<double>(), 1e-12);
  for (std::size_t j = 0; j < grads[0].size(); ++j)
    EXPECT_LT((grads[0][j] - grads[1][j]).abs().max().item<double>(), 1e-12) << j;
}

// A mixture-of-experts model's training step through the session asks what the dense model's does (its loss and
// optimizer scalars, one copy of the logprobs) and one copy more: its router's metrics, once per step whatever the
// sparse layers.
TEST(HostSync, AMixtureOfExpertsTrainingStepWaitsAsTheDenseOnesDoesPlusItsRouterMetrics) {
  const OpCounts dense = training_step_counts(2);
  const OpCounts moe = training_step_counts(2, "rlloop-tiny-moe");
  EXPECT_EQ(moe.host_syncs, dense.host_syncs) << moe.describe();
  EXPECT_EQ(moe.to_host_scopes, dense.to_host_scopes + 1) << moe.describe();
  EXPECT_EQ(moe.device_to_host, test_device::on_cuda() ? 2 : 0) << moe.describe();
  EXPECT_EQ(moe.device_to_host_outside, 0) << "a copy to the host outside engine::to_host";
  EXPECT_EQ(moe.to_cpu_outside, dense.to_cpu_outside) << moe.describe();
}
