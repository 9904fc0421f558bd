// A frozen base kept in GGUF blocks (quantized_matrix.hpp) against the same model with those blocks dequantized to
// fp32: the fast row dequantization equals gguf::dequantize bit for bit, the few-row products and the differentiable
// product equal ATen's on the dequantized matrix, and a model over quantized matrices gives the dense model's logits,
// LoRA gradients and decoding steps (fp32 and bf16 precision) within 1e-5. Runs on every kernel path
// (scripts/test.sh: native, AVX2, portable).
#include <gtest/gtest.h>

#include <cmath>

#include <cstring>
#include <random>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "model/cpu_decoder.hpp"
#include "io/model_io.hpp"
#include "kernels/quantized_matrix.hpp"
#include "kernels/small_gemm.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;

namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }
// The largest difference relative to the largest value of `b`: for products whose sums the kernels (and ATen's
// and BLAS's, per CPU kernel level) order differently.
double relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return max_abs_diff(a, b) / b.abs().max().item<double>();
}
// What two fp32 sums of `terms` products in different orders (two BLAS libraries: OpenBLAS in the kernels, MKL in
// the PyPI wheel's ATen) may differ by, relative: rounding errors that grow like a random walk, sqrt(terms) units
// of 2^-24, with a factor 4 for the largest of many outputs.
double reordered_sum_bound(double terms) { return 4.0 * std::sqrt(terms) * std::ldexp(1.0, -24); }

// `rows` x `cols` values of `type` with random quantized values and random (finite, normal) block scales: the
// formats whose scales lead each block (d, or d and m).
std::shared_ptr<const QuantizedMatrix> random_matrix(gguf::TensorType type, std::int64_t rows, std::int64_t cols,
                                                     std::uint32_t seed) {
  const auto layout = *gguf::block_layout(type);
  const std::int64_t row_bytes = cols / layout.elements * layout.bytes;
  auto blocks = torch::empty({rows, row_bytes}, torch::kUInt8);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.002f, 0.05f);
  auto* b = blocks.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0; i < blocks.numel(); ++i) b[i] = static_cast<std::uint8_t>(byte(rng));
  const bool has_min = type == gguf::TensorType::q4_1 || type == gguf::TensorType::q5_1;
  for (std::int64_t at = 0; at < blocks.numel(); at += layout.bytes) {
    const std::uint16_t d = gguf::float_to_half(scale(rng)), m = gguf::float_to_half(-8 * scale(rng));
    std::memcpy(b + at, &d, 2);
    if (has_min) std::memcpy(b + at + 2, &m, 2);
  }
  return std::make_shared<const QuantizedMatrix>(type, rows, cols, blocks);
}

// A Llama whose matrix shapes are whole 32-value blocks (hidden 32, FFN 64), tied or not.
ModelConfig block_config(const std::string& type, bool tied) {
  auto j = test_models::tiny_config(type, tied, 64).to_json();
  j["intermediate_size"] = 64;
  return ModelConfig::from_json(j);
}

// The same model twice: one over random quantized matrices (Q4_1 projections, a Q8_0 embedding, a Q4_0 lm_head
// when untied), one with those matrices dequantized into ordinary parameters; norms and biases shared values.
struct Twins {
  std::shared_ptr<Transformer> quantized, dense;
};
Twins twins(const std::string& type, bool tied) {
  const ModelConfig cfg = block_config(type, tied);
  auto dense = init_model(cfg, 31, torch::kCPU, torch::kFloat32);
  TensorMap weights = dense->hf_state_dict();
  QuantizedTensors blocks;
  std::uint32_t seed = 1;
  for (auto& [name, t] : weights) {
    if (t.dim() != 2) continue;
    const auto kind = name == "model.embed_tokens.weight" ? gguf::TensorType::q8_0
                      : name == "lm_head.weight"          ? gguf::TensorType::q4_0
                                                          : gguf::TensorType::q4_1;
    auto matrix = random_matrix(kind, t.size(0), t.size(1), seed++);
    t = matrix->dequantize();
    blocks.emplace(name, std::move(matrix));
  }
  dense->load_hf_state_dict(weights);
  auto quantized = std::make_shared<Transformer>(cfg, torch::TensorOptions().dtype(torch::kFloat32), blocks);
  TensorMap rest;
  for (const auto& [name, t] : weights)
    if (!blocks.count(name)) rest.emplace(name, t);
  quantized->load_hf_state_dict(rest);
  return {quantized, dense};
}

}  // namespace

TEST(QuantizedMatrix, RowsAreGgufDequantizeBitForBit) {
  for (auto type : {gguf::TensorType::q4_0, gguf::TensorType::q4_1, gguf::TensorType::q5_0, gguf::TensorType::q5_1,
                    gguf::TensorType::q8_0}) {
    SCOPED_TRACE(gguf::to_string(type));
    auto m = random_matrix(type, 7, 96, 11);
    std::vector<float> want(7 * 96);
    const auto bytes = std::span<const std::uint8_t>(m->blocks().data_ptr<std::uint8_t>(), m->bytes());
    gguf::dequantize(type, bytes, want);
    auto all = m->dequantize();
    EXPECT_EQ(std::memcmp(all.data_ptr<float>(), want.data(), want.size() * sizeof(float)), 0);
    std::vector<float> some(2 * 96);
    m->dequantize_rows(3, 5, some.data());
    EXPECT_EQ(std::memcmp(some.data(), want.data() + 3 * 96, some.size() * sizeof(float)), 0);
    auto looked_up = m->rows_of(torch::tensor(std::vector<std::int64_t>{6, 0, 6}).view({1, 3}));
    ASSERT_EQ(looked_up.sizes(), (std::vector<std::int64_t>{1, 3, 96}));
    EXPECT_TRUE(torch::equal(looked_up[0][0], all[6]) && torch::equal(looked_up[0][1], all[0]));
  }
}

TEST(QuantizedMatrix, ConstructionChecksTheBlocks) {
  auto blocks = torch::zeros({4, 20}, torch::kUInt8);  // one Q4_1 block (20 bytes) per row of 32 values
  EXPECT_NO_THROW(QuantizedMatrix(gguf::TensorType::q4_1, 4, 32, blocks));
  auto message = [&](auto make) {
    try {
      make();
    } catch (const invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { QuantizedMatrix(gguf::TensorType::q4_1, 4, 40, blocks); }).find("not rows of whole blocks"),
            std::string::npos);
  EXPECT_NE(message([&] { QuantizedMatrix(gguf::TensorType::q8_0, 4, 32, blocks); }).find("[4, 34]"),
            std::string::npos);
}

TEST(QuantizedMatrix, ProductsEqualTheDequantizedMatrixes) {
  // Few-row products (the kernel's 3-row blocks and their tails, M past the kernel's 64-row limit) and a group
  // with `accumulate`, against ATen on the dequantized matrix: fp32 sums of 96 terms in another order (relative
  // 1e-6; measured up to 4e-7). Where BLAS computes the tiles (M past the kernel's limit, or the kernels compiled
  // out) this runs on one thread: a lone product's few tiles run on the calling thread, where OpenBLAS uses its
  // own threads, and a group's inside a parallel region, where it does not, and its Haswell/Zen kernels sum edge
  // tiles in another order on another thread count (kernels_test.cpp's SmallGemm says the same).
  auto a = random_matrix(gguf::TensorType::q4_1, 100, 96, 3), b = random_matrix(gguf::TensorType::q8_0, 37, 96, 4);
  const int threads = at::get_num_threads();
  for (std::int64_t M : {1, 3, 5, 17, 70}) {
    SCOPED_TRACE("M=" + std::to_string(M));
    at::set_num_threads(small_gemm_applies(M, 96) ? threads : 1);
    torch::manual_seed(M);
    auto X = torch::randn({M, 96});
    auto ya = torch::empty({M, 100});
    a->multiply(X.data_ptr<float>(), M, ya.data_ptr<float>(), false);
    EXPECT_LT(relative_diff(ya, torch::matmul(X, a->dequantize().t())), 1e-6);
    auto start = torch::randn({M, 37}), yb = start.clone();
    auto yc = torch::empty({M, 100});
    const std::vector<QuantizedMatrix::Product> group{{b.get(), yb.data_ptr<float>(), true},
                                                      {a.get(), yc.data_ptr<float>(), false}};
    QuantizedMatrix::multiply_group(X.data_ptr<float>(), M, group);
    EXPECT_LT(relative_diff(yb - start, torch::matmul(X, b->dequantize().t())), 1e-6);
    EXPECT_TRUE(torch::equal(yc, ya));  // each output computed as alone
  }
  at::set_num_threads(threads);
}

TEST(QuantizedMatrix, LinearIsDifferentiableInItsInputAndChunksLargeMatrices) {
  // 8,200 x 576 values are more than one 4M-value piece: the forward fills y piece by piece and backward sums
  // the pieces' input gradients.
  auto w = random_matrix(gguf::TensorType::q8_0, 8200, 576, 5);
  const auto dense = w->dequantize();
  torch::manual_seed(6);
  auto x = torch::randn({2, 3, 576}).set_requires_grad(true);
  auto x2 = x.detach().clone().set_requires_grad(true);
  auto y = quantized_linear(x, w), want = torch::linear(x2, dense);
  // fp32 sums of 576 (forward) and 8,200 (backward, over two pieces) terms in another order.
  EXPECT_LT(relative_diff(y, want), reordered_sum_bound(576));
  auto dy = torch::randn(y.sizes());
  y.backward(dy);
  want.backward(dy);
  EXPECT_LT(relative_diff(x.grad(), x2.grad()), reordered_sum_bound(8200));
}

TEST(Int8Rows, QuantizeToTheNearestStepOfEachBlock) {
  torch::manual_seed(8);
  auto X = torch::randn({3, 64}) * torch::tensor(std::vector<float>{1e-3f, 1.0f, 50.0f}).unsqueeze(1);
  X[2].narrow(0, 32, 32).zero_();  // an all-zero block: scale 0, every value 0
  const Int8Rows q = Int8Rows::quantize(X.data_ptr<float>(), 3, 64);
  ASSERT_EQ(q.d.size(), 6u);
  EXPECT_EQ(q.d[5], 0.0f);
  for (std::int64_t b = 0; b < 6; ++b) {
    int sum = 0, largest = 0;
    for (int j = 0; j < 32; ++j) {
      const int v = q.q[b * 32 + j];
      sum += v;
      largest = std::max(largest, std::abs(v));
      EXPECT_LE(std::abs(v * q.d[b] - X.data_ptr<float>()[b * 32 + j]), 0.5001 * q.d[b] + 1e-30);
    }
    if (q.d[b] > 0) {
      EXPECT_EQ(largest, 127);  // the block's largest value uses the whole range
    }
    EXPECT_FLOAT_EQ(q.s[b], q.d[b] * static_cast<float>(sum));
  }
}

TEST(QuantizedMatrix, Int8ProductsAreTheBlocksExactDotProducts) {
  // Against the exact product of the dequantized matrix and the dequantized input (double): the integer sums are
  // exact, so only the fp32 accumulation of the blocks' terms rounds.
  for (auto type : {gguf::TensorType::q4_0, gguf::TensorType::q4_1, gguf::TensorType::q8_0}) {
    SCOPED_TRACE(gguf::to_string(type));
    auto w = random_matrix(type, 50, 128, 12);
    ASSERT_TRUE(w->int8_products());
    const auto W = w->dequantize().to(torch::kFloat64);
    for (std::int64_t M : {1, 5, 9}) {
      torch::manual_seed(M);
      auto X = torch::randn({M, 128});
      const Int8Rows q = Int8Rows::quantize(X.data_ptr<float>(), M, 128);
      auto Xq = torch::empty({M, 128}, torch::kFloat64);
      for (std::int64_t i = 0; i < M * 128; ++i) Xq.data_ptr<double>()[i] = q.q[i] * double(q.d[i / 32]);
      const auto want = torch::matmul(Xq, W.t());
      auto start = torch::randn({M, 50}), Y = start.clone();
      const QuantizedMatrix::Product product{w.get(), Y.data_ptr<float>(), true};
      QuantizedMatrix::multiply_group_int8(q, {&product, 1});
      EXPECT_LT(max_abs_diff((Y - start).to(torch::kFloat64), want) / want.abs().max().item<double>(), 1e-6);
      // And near the fp32 product: the input's 8-bit rounding only.
      const auto fp32 = torch::matmul(X.to(torch::kFloat64), W.t());
      EXPECT_LT(max_abs_diff((Y - start).to(torch::kFloat64), fp32) / fp32.abs().max().item<double>(), 0.02);
    }
  }
  EXPECT_FALSE(random_matrix(gguf::TensorType::q5_0, 2, 32, 1)->int8_products());
}

TEST(QuantizedBase, ModelEqualsTheDequantizedModel) {
  for (auto [type, tied] : {std::pair{"llama", true}, {"qwen2", false}, {"qwen3", false}}) {
    SCOPED_TRACE(type);
    auto [q, d] = twins(type, tied);
    EXPECT_GT(q->quantized_bytes(), 0);
    EXPECT_EQ(d->quantized_bytes(), 0);
    std::int64_t q_values = q->quantized_values(), d_values = 0;
    for (const auto& p : q->parameters()) q_values += p.numel();
    for (const auto& p : d->parameters()) d_values += p.numel();
    EXPECT_EQ(q_values, d_values);
    // The base weights read back dequantized, as the dense model holds them.
    const TensorMap qs = q->hf_state_dict(), ds = d->hf_state_dict();
    ASSERT_EQ(qs.size(), ds.size());
    for (const auto& [name, t] : ds) EXPECT_TRUE(torch::equal(qs.at(name), t)) << name;

    // Training: logits and the LoRA adapters' gradients.
    const LoraOptions lora{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}};
    auto qa = Transformer::sharing_base(*q), da = Transformer::sharing_base(*d);
    qa->enable_lora(lora, 3);
    da->enable_lora(lora, 3);
    for (auto* m : {qa.get(), da.get()}) {
      torch::NoGradGuard no_grad;
      torch::manual_seed(9);
      for (auto& b : m->lora_b_parameters()) b.normal_(0.0, 0.1);
    }
    auto ids = torch::tensor(std::vector<std::int64_t>{3, 17, 5, 42, 8, 63, 0, 11}).view({2, 4});
    auto ql = qa->forward(ids), dl = da->forward(ids);
    EXPECT_LT(max_abs_diff(ql, dl), 1e-5);
    torch::log_softmax(ql, -1).select(-1, 7).sum().backward();
    torch::log_softmax(dl, -1).select(-1, 7).sum().backward();
    const auto qp = qa->named_trainable_parameters(), dp = da->named_trainable_parameters();
    ASSERT_EQ(qp.size(), dp.size());
    for (std::size_t i = 0; i < qp.size(); ++i) {
      ASSERT_TRUE(qp[i].second.grad().defined()) << qp[i].first;
      EXPECT_LT(max_abs_diff(qp[i].second.grad(), dp[i].second.grad()), 1e-5) << qp[i].first;
    }

    // Decoding: the prefilled prompt then steps of 3 rows, fp32 precision equal to the dense decoder; bf16
    // precision reads the blocks as they are (nothing rounded but the KV cache and the products' inputs).
    c10::InferenceMode inference;
    auto prompt = ids.narrow(0, 0, 1);
    std::vector<torch::Tensor> bf16_steps;
    for (auto precision : {DecodePrecision::fp32, DecodePrecision::bf16, DecodePrecision::int8}) {
      KVCache qc = KVCache::allocate(qa->config(), 1, 16, torch::kCPU, torch::kFloat32);
      KVCache dc = KVCache::allocate(da->config(), 1, 16, torch::kCPU, torch::kFloat32);
      qa->hidden_states(prompt, &qc);
      da->hidden_states(prompt, &dc);
      qc.convert(CpuDecoder::cache_dtype(precision));
      qc.repeat_batch(3);
      dc.repeat_batch(3);
      CpuDecoder qdec(*qa, precision), ddec(*da, DecodePrecision::fp32);
      EXPECT_FALSE(qdec.shares_base(ddec));
      EXPECT_TRUE(qdec.shares_base(CpuDecoder(*qa, precision)));
      for (int step = 0; step < 3; ++step) {
        auto tokens = torch::tensor(std::vector<std::int64_t>{step, 20 + step, 63 - step});
        auto got = torch::log_softmax(qdec.step(tokens, qc), -1);
        auto want = torch::log_softmax(ddec.step(tokens, dc), -1);
        // bf16: the KV cache rounded, the weights not; the bound of Bf16StepsStayCloseToTheFp32Model (measured
        // here: up to 0.18). int8: the products' inputs rounded to 8 bits besides, which these random weights (whose
        // logits spread over tens of nats) amplify: measured up to 1.2. On SmolLM2 it stays within llama.cpp's own
        // distance to fp32 (GgufExport.Int8SamplingOnSmolLM2StaysWithinLlamaCppsDistance).
        const double bound = precision == DecodePrecision::fp32 ? 1e-5 : precision == DecodePrecision::bf16 ? 0.4 : 2.0;
        EXPECT_LT(max_abs_diff(got, want), bound);
        if (precision == DecodePrecision::bf16) bf16_steps.push_back(got);
        if (precision == DecodePrecision::int8) {  // the integer products ran: only they differ from bf16
          EXPECT_GT(max_abs_diff(got, bf16_steps.at(step)), 1e-4);
        }
      }
    }
  }
}

TEST(QuantizedBase, FullFineTuningAndBadMatricesAreRefused) {
  auto [q, d] = twins("llama", false);
  try {
    q->named_trainable_parameters();
    ADD_FAILURE() << "full fine-tuning of a quantized model was accepted";
  } catch (const conflict& e) {
    EXPECT_NE(std::string(e.what()).find("full fine-tuning needs dense weights"), std::string::npos);
  }
  const ModelConfig cfg = block_config("llama", false);
  auto expect_error = [&](const QuantizedTensors& blocks, const std::string& part) {
    try {
      Transformer(cfg, torch::TensorOptions().dtype(torch::kFloat32), blocks);
      ADD_FAILURE() << "accepted; wanted an error with " << part;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error({{"model.layers.0.mlp.up_proj.weight", random_matrix(gguf::TensorType::q4_1, 32, 32, 1)}},
               "tensor 'model.layers.0.mlp.up_proj.weight' has shape [32, 32], the model expects [64, 32]");
  expect_error({{"model.layers.9.mlp.up_proj.weight", random_matrix(gguf::TensorType::q4_1, 64, 32, 1)}},
               "no matrix of this llama model is named 'model.layers.9.mlp.up_proj.weight'");
}
