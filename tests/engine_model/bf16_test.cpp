// The "bf16" sampling precision's pieces: rounding to bf16, the few-row product on rounded operands (the
// AVX512_BF16 kernel where this CPU has it, the widened-fp32 fallback always), and the bf16 decoding step
// against the fp32 model.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include <rlloop/error.hpp>

#include "kernels/bf16_gemm.hpp"
#include "model/cpu_decoder.hpp"
#include "kernels/decode_attention.hpp"
#include "io/model_io.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

TEST(Bf16, RoundsToNearestWithTiesToEven) {
  EXPECT_EQ(to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(to_bf16(-2.5f), 0xC020);
  EXPECT_EQ(to_bf16(from_bits(0x3F808000)), 0x3F80);  // halfway, the even neighbour is below
  EXPECT_EQ(to_bf16(from_bits(0x3F818000)), 0x3F82);  // halfway, the even neighbour is above
  EXPECT_EQ(to_bf16(from_bits(0x3F808001)), 0x3F81);  // just above halfway
  EXPECT_EQ(to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // just below halfway
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to infinity
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(from_bits(0x7F800001)))));  // a NaN whose payload is all low bits
  EXPECT_EQ(from_bf16(0x3F80), 1.0f);
  EXPECT_EQ(from_bf16(0xC020), -2.5f);
  // Every bf16 value is a float: rounding it again changes nothing.
  for (std::uint32_t b = 0; b < 0x7F80; b += 97) EXPECT_EQ(to_bf16(from_bf16(static_cast<std::uint16_t>(b))), b);
}

// X [M, K] and W [N, K] rounded to bf16, their product in double: what Bf16Weight::multiply computes up to
// the order of its fp32 sums.
torch::Tensor rounded_product(const torch::Tensor& x, const torch::Tensor& w) {
  auto round = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat64); };
  return torch::matmul(round(x), round(w).t());
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(Bf16Weight, ProductOfRoundedOperandsIncludingTails) {
  torch::manual_seed(21);
  std::vector<Bf16Weight::Storage> storages{Bf16Weight::Storage::widened};
  if (bf16_dot_supported()) storages.push_back(Bf16Weight::Storage::bf16);
  // {M, N, K}: every remainder of the kernel's 4 x 4 blocks and 32-value steps (K not a multiple of 32 pads
  // the rows), one row, and a product big enough to be split across threads.
  for (auto [M, N, K] : {std::tuple{5, 7, 16},
                         {7, 11, 24},
                         {1, 4, 32},
                         {4, 12, 40},
                         {3, 9, 12},
                         {16, 130, 70},
                         {6, 5, 8},
                         {16, 2050, 768}}) {
    auto x = torch::randn({M, K}), w = torch::randn({N, K}), y0 = torch::randn({M, N});
    const auto expected = rounded_product(x, w);
    const double tol = 1e-5 * std::sqrt(K) * expected.abs().max().item<double>();
    for (auto storage : storages) {
      SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) +
                   (storage == Bf16Weight::Storage::bf16 ? " bf16" : " widened"));
      const Bf16Weight weight(w.data_ptr<float>(), N, K, storage);
      EXPECT_EQ(weight.stored_as_bf16(), storage == Bf16Weight::Storage::bf16);
      auto y = torch::empty({M, N});
      weight.multiply(x.data_ptr<float>(), M, y.data_ptr<float>(), false);
      EXPECT_LT(max_abs_diff(y, expected), tol);
      auto acc = y0.clone();
      weight.multiply(x.data_ptr<float>(), M, acc.data_ptr<float>(), true);
      EXPECT_LT(max_abs_diff(acc, expected + y0.to(torch::kFloat64)), tol);
    }
  }
}

TEST(Bf16Rounding, RowsGiveToBf16OfEveryValue) {
  // The vectorised rounding of KV-cache rows against the scalar one, bit for bit: ties both ways, values just
  // off ties, infinities, the largest float, NaNs (one with only low payload bits), zeros, denormals, and a
  // tail that is not a multiple of 8 lanes.
  std::vector<float> values{1.0f,
                            from_bits(0x3F808000),
                            from_bits(0x3F818000),
                            from_bits(0x3F808001),
                            from_bits(0x3F807FFF),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::quiet_NaN(),
                            from_bits(0x7F800001),
                            0.0f,
                            -0.0f,
                            1e-40f,
                            -3e-39f};
  torch::manual_seed(26);
  auto random = torch::randn({29}) * 100;
  for (std::int64_t i = 0; i < random.numel(); ++i) values.push_back(random[i].item<float>());
  if (!simd::has_avx2_fma()) GTEST_SKIP() << "no AVX2 here: the row rounding is the scalar one";
  std::vector<std::uint16_t> out(values.size());
  to_bf16(values.data(), out.data(), static_cast<std::int64_t>(values.size()));
  for (std::size_t i = 0; i < values.size(); ++i) EXPECT_EQ(out[i], to_bf16(values[i])) << "value " << values[i];
}

TEST(DecodeAttention, Bf16CacheGivesTheFp32KernelOnWidenedValues) {
  // Keys and values stored as bf16 bits are widened exactly on load: the result is the fp32 kernel's on the
  // widened values, bit for bit (D = 12 takes the portable path).
  torch::manual_seed(27);
  for (auto [S, D] : {std::pair{1, 64}, {7, 64}, {13, 32}, {40, 128}, {9, 12}}) {
    SCOPED_TRACE("S=" + std::to_string(S) + " D=" + std::to_string(D));
    auto q = torch::randn({D}), K = torch::randn({S, D}), V = torch::randn({S, D});
    std::vector<std::uint16_t> kb(S * D), vb(S * D);
    to_bf16(K.data_ptr<float>(), kb.data(), S * D);
    to_bf16(V.data_ptr<float>(), vb.data(), S * D);
    std::vector<float> kw(S * D), vw(S * D), p(S), from_bits_out(D), from_floats_out(D);
    for (std::int64_t i = 0; i < S * D; ++i) kw[i] = from_bf16(kb[i]), vw[i] = from_bf16(vb[i]);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    attend_row(q.data_ptr<float>(), kb.data(), vb.data(), S, D, scale, p.data(), from_bits_out.data());
    attend_row(q.data_ptr<float>(), kw.data(), vw.data(), S, D, scale, p.data(), from_floats_out.data());
    for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(from_bits_out[d], from_floats_out[d]) << "column " << d;
  }
}

TEST(Bf16Weight, GroupGivesEachProductAsAlone) {
  // One rounding of the input and one parallel region for several weights give each product bit for bit
  // what multiply() gives alone; weights of different widths in one group are an error.
  torch::manual_seed(23);
  const std::int64_t M = 16, K = 72;  // the fp32 kernel's multiple of 8 (widened storage), padded to 96 in bf16
  std::vector<Bf16Weight::Storage> storages{Bf16Weight::Storage::widened};
  if (bf16_dot_supported()) storages.push_back(Bf16Weight::Storage::bf16);
  auto x = torch::randn({M, K});
  for (auto storage : storages) {
    SCOPED_TRACE(storage == Bf16Weight::Storage::bf16 ? "bf16" : "widened");
    std::vector<Bf16Weight> weights;
    std::vector<torch::Tensor> alone, grouped;
    std::vector<Bf16Product> products;
    for (std::int64_t N : {5, 1030, 3}) {
      auto w = torch::randn({N, K});
      weights.emplace_back(w.data_ptr<float>(), N, K, storage);
      alone.push_back(torch::randn({M, N}));
      grouped.push_back(alone.back().clone());
    }
    for (std::size_t i = 0; i < weights.size(); ++i) {
      weights[i].multiply(x.data_ptr<float>(), M, alone[i].data_ptr<float>(), i == 1);
      products.push_back({&weights[i], grouped[i].data_ptr<float>(), i == 1});
    }
    Bf16Weight::multiply_group(x.data_ptr<float>(), M, products);
    for (std::size_t i = 0; i < weights.size(); ++i) EXPECT_TRUE(torch::equal(grouped[i], alone[i])) << "weight " << i;

    auto narrow = torch::randn({4, K - 1});
    const Bf16Weight other(narrow.data_ptr<float>(), 4, K - 1, storage);
    auto y = torch::empty({M, 4});
    products.push_back({&other, y.data_ptr<float>(), false});
    try {
      Bf16Weight::multiply_group(x.data_ptr<float>(), M, products);
      ADD_FAILURE() << "weights of different widths were accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("the same columns"), std::string::npos) << e.what();
    }
  }
}

TEST(Bf16Weight, RoundsWeightsAndInputsAsToBf16Does) {
  // One-column products with a factor of 1 expose the rounding itself: W [N, 1] times X = 1 gives round(W),
  // X [M, 1] times W = 1 gives round(X), exactly (no sums). Ties, values just off ties, large, negative.
  const std::vector<float> values{1.0f,
                                  from_bits(0x3F808000),
                                  from_bits(0x3F818000),
                                  from_bits(0x3F808001),
                                  from_bits(0x3F807FFF),
                                  -3.14159f,
                                  65504.0f,
                                  1e30f,
                                  -7.5e-20f,
                                  0.1f};
  const auto n = static_cast<std::int64_t>(values.size());
  std::vector<Bf16Weight::Storage> storages{Bf16Weight::Storage::widened};
  if (bf16_dot_supported()) storages.push_back(Bf16Weight::Storage::bf16);
  const float one = 1.0f;
  for (auto storage : storages) {
    SCOPED_TRACE(storage == Bf16Weight::Storage::bf16 ? "bf16" : "widened");
    std::vector<float> y(n);
    Bf16Weight(values.data(), n, 1, storage).multiply(&one, 1, y.data(), false);
    for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], from_bf16(to_bf16(values[i]))) << "weight " << values[i];
    Bf16Weight(&one, 1, 1, storage).multiply(values.data(), n, y.data(), false);
    for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], from_bf16(to_bf16(values[i]))) << "input " << values[i];
  }
}

TEST(Bf16Weight, RoundingIsVisibleAgainstTheFp32Product) {
  // The rounding is real (not an fp32 product in disguise) and of bf16's size: 8 significant bits, so
  // relative errors near 2^-9 per operand that partly cancel over K terms.
  torch::manual_seed(22);
  const std::int64_t M = 8, N = 64, K = 256;
  auto x = torch::randn({M, K}), w = torch::randn({N, K});
  const Bf16Weight weight(w.data_ptr<float>(), N, K);
  auto y = torch::empty({M, N});
  weight.multiply(x.data_ptr<float>(), M, y.data_ptr<float>(), false);
  const double err = max_abs_diff(y, torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t()));
  EXPECT_GT(err, 1e-3);
  EXPECT_LT(err, 0.5);  // |y| ~ sqrt(K) = 16
}

TEST(Bf16Weight, Bf16StorageNeedsTheInstructions) {
  if (bf16_dot_supported()) GTEST_SKIP() << "this CPU has AVX512_BF16";
  const float w[4] = {1, 2, 3, 4};
  EXPECT_THROW(Bf16Weight(w, 2, 2, Bf16Weight::Storage::bf16), rlloop::invalid_argument);
}

// The fp32 model's next-token logprobs for 4 steps of 3 rows after `prompt`: the rows start from `first` and
// then follow the argmax; the tokens fed at each step are appended to `fed` when it is empty, else replayed.
std::vector<torch::Tensor> fp32_logprobs(Transformer& model, const torch::Tensor& prompt,
                                         std::vector<torch::Tensor>& fed) {
  KVCache cache = KVCache::allocate(model.config(), 1, 12, torch::kCPU, torch::kFloat32);
  model.hidden_states(prompt, &cache);
  cache.repeat_batch(3);
  const bool record = fed.empty();
  auto tokens = torch::tensor(std::vector<std::int64_t>{1, 63, 20}, torch::kLong);
  std::vector<torch::Tensor> out;
  for (int step = 0; step < 4; ++step) {
    if (!record) tokens = fed[step];
    if (record) fed.push_back(tokens);
    out.push_back(torch::log_softmax(model.forward(tokens.unsqueeze(1), &cache).squeeze(1), -1));
    tokens = out.back().argmax(-1);
  }
  return out;
}

TEST(CpuDecoder, Bf16StepsStayCloseToTheFp32Model) {
  // Decode 4 steps of 3 rows with the bf16 decoder (bf16 products and KV cache) and with
  // Transformer::forward (fp32) from one prefilled prompt: next-token logprobs differ by bf16 rounding only
  // (nonzero, and small next to the spread of these std-0.3 weights' logits). The LoRA case checks that the
  // fp32 adapters still apply next to the rounded base weights: dropping them moves the logprobs several
  // times more than the rounding does.
  struct Case {
    const char* type;
    bool tied, lora;
  };
  for (auto [type, tied, lora] :
       {Case{"llama", true, false}, {"qwen2", false, false}, {"qwen3", false, false}, {"qwen2", false, true}}) {
    SCOPED_TRACE(std::string(type) + (lora ? " + LoRA" : ""));
    auto model = init_model(tiny_config(type, tied, 64), 23, torch::kCPU, torch::kFloat32);
    if (lora) model->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}}, 3);
    {
      torch::NoGradGuard no_grad;  // weights of a trained model's size, so that logits spread
      torch::manual_seed(28);
      for (auto& p : model->parameters())
        if (p.dim() == 2) p.normal_(0.0, 0.3);
    }
    c10::InferenceMode inference;
    auto prompt = torch::tensor(std::vector<std::int64_t>{3, 17, 5, 42, 8}, torch::kLong).unsqueeze(0);
    std::vector<torch::Tensor> fed;
    const std::vector<torch::Tensor> want = fp32_logprobs(*model, prompt, fed);

    KVCache cache = KVCache::allocate(model->config(), 1, 12, torch::kCPU, torch::kFloat32);
    model->hidden_states(prompt, &cache);
    cache.convert(CpuDecoder::cache_dtype(DecodePrecision::bf16));
    cache.repeat_batch(3);
    CpuDecoder decoder(*model, DecodePrecision::bf16);
    double largest = 0.0;
    for (int step = 0; step < 4; ++step)
      largest = std::max(largest, max_abs_diff(torch::log_softmax(decoder.step(fed[step], cache), -1), want[step]));
    EXPECT_GT(largest, 1e-3);  // fp32 decoding stays below 1e-5 here
    EXPECT_LT(largest, 0.4);   // measured: llama 0.09, qwen2 0.14, qwen3 0.08, qwen2 + LoRA 0.14
    if (!lora) continue;
    double adapter_effect = 0.0;
    for (auto& b : model->lora_b_parameters()) b.zero_();  // the model without its adapters
    const std::vector<torch::Tensor> plain = fp32_logprobs(*model, prompt, fed);
    for (int step = 0; step < 4; ++step)
      adapter_effect = std::max(adapter_effect, max_abs_diff(plain[step], want[step]));
    EXPECT_GT(adapter_effect, 3 * largest);  // measured: 14.8
  }
}

TEST(RoundedWeights, CurrentUntilAWeightIsUpdatedInPlace) {
  // A decoder reuses a current snapshot and replaces one whose weights were updated since: any in-place update
  // counts (even one that leaves the values as they were), under NoGradGuard (the optimizer) and under
  // InferenceMode alike. A snapshot is never current for another model, even one with equal weights.
  auto model = init_model(tiny_config("llama", false, 64), 29, torch::kCPU, torch::kFloat32);
  torch::Tensor q;
  for (const auto& item : model->named_parameters())
    if (item.key().find("layers_0_self_attn_q_proj_weight") != std::string::npos) q = item.value();
  ASSERT_TRUE(q.defined());
  auto snapshot = std::make_shared<const RoundedWeights>(*model);
  EXPECT_TRUE(snapshot->current(*model));
  EXPECT_EQ(CpuDecoder(*model, DecodePrecision::bf16, snapshot).rounded(), snapshot);
  EXPECT_EQ(CpuDecoder(*model, DecodePrecision::fp32, snapshot).rounded(), nullptr);
  {
    torch::NoGradGuard no_grad;
    q.add_(0.0);
  }
  EXPECT_FALSE(snapshot->current(*model));
  const auto fresh = CpuDecoder(*model, DecodePrecision::bf16, snapshot).rounded();
  ASSERT_NE(fresh, nullptr);
  EXPECT_NE(fresh, snapshot);
  EXPECT_TRUE(fresh->current(*model));
  {
    c10::InferenceMode inference;
    q.mul_(1.0);
  }
  EXPECT_FALSE(fresh->current(*model));
  auto twin = init_model(tiny_config("llama", false, 64), 29, torch::kCPU, torch::kFloat32);
  EXPECT_FALSE(RoundedWeights(*model).current(*twin));
}

TEST(CpuDecoder, CacheMustMatchThePrecision) {
  // The bf16 decoder reads and writes a bf16 cache; handing either decoder the other's cache is an error
  // naming what to do, not a misread buffer.
  auto model = init_model(tiny_config("llama", true, 64), 24, torch::kCPU, torch::kFloat32);
  c10::InferenceMode inference;
  auto tokens = torch::tensor(std::vector<std::int64_t>{1, 2}, torch::kLong);
  for (auto precision : {DecodePrecision::fp32, DecodePrecision::bf16}) {
    const bool bf16 = precision == DecodePrecision::bf16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    EXPECT_EQ(CpuDecoder::cache_dtype(precision), bf16 ? torch::kBFloat16 : torch::kFloat32);
    KVCache cache = KVCache::allocate(model->config(), 2, 4, torch::kCPU, torch::kFloat32);
    cache.convert(bf16 ? torch::kFloat32 : torch::kBFloat16);  // the wrong one
    CpuDecoder decoder(*model, precision);
    try {
      decoder.step(tokens, cache);
      ADD_FAILURE() << "a cache of the other precision was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(bf16 ? "must hold bf16 (KVCache::convert)" : "must hold fp32"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(cache.length, 0);
    cache.convert(CpuDecoder::cache_dtype(precision));
    EXPECT_EQ(decoder.step(tokens, cache).sizes(), (std::vector<std::int64_t>{2, model->config().vocab_size}));
    EXPECT_EQ(cache.length, 1);
  }
}

TEST(KVCache, ConvertKeepsTheFilledPositionsRounded) {
  auto model = init_model(tiny_config("qwen2", false, 64), 25, torch::kCPU, torch::kFloat32);
  c10::InferenceMode inference;
  KVCache cache = KVCache::allocate(model->config(), 1, 8, torch::kCPU, torch::kFloat32);
  model->hidden_states(torch::tensor(std::vector<std::int64_t>{4, 9, 2}, torch::kLong).unsqueeze(0), &cache);
  const KVCache before = cache;  // keeps the fp32 blocks: convert moves `cache` to the bf16 pool
  cache.convert(torch::kBFloat16);
  ASSERT_EQ(cache.length, 3);
  EXPECT_EQ(cache.dtype(), torch::kBFloat16);
  EXPECT_EQ(before.dtype(), torch::kFloat32);
  for (std::size_t l = 0; l < cache.layers(); ++l) {
    for (auto [converted, original] : {std::pair{cache.keys(l), before.keys(l)}, {cache.values(l), before.values(l)}}) {
      ASSERT_EQ(converted.sizes(), original.sizes());
      ASSERT_EQ(converted.scalar_type(), torch::kBFloat16);
      const auto* bits = reinterpret_cast<const std::uint16_t*>(converted.data_ptr());
      const float* f = original.data_ptr<float>();
      for (std::int64_t i = 0; i < original.numel(); ++i)
        ASSERT_EQ(bits[i], to_bf16(f[i])) << "layer " << l << " at " << i;
    }
  }
}

}  // namespace
