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

#include "device.hpp"
#include "engine/session_util.hpp"
#include "model_io.hpp"
#include "sampler.hpp"
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
  static const std::set<std::string> names = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                                              "aten::_unique", "aten::_unique2", "aten::unique_dim",
                                              "aten::unique_consecutive", "aten::is_nonzero", "aten::equal"};
  return names;
}

bool is_cpu_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().device().is_cpu(); }

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
OpCounts training_step_counts(int datums) {
  LocalSession session(SessionOptions{.base_model = "rlloop-tiny"},
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
