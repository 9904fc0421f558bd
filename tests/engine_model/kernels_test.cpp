// The engine's hand-written CPU kernels against the plain ATen formulation they replace: causal attention
// (forward and gradients; GQA, a KV-cache prefix, strided rows), the fused RMSNorm, RoPE and SwiGLU, the
// few-row matrix product, one decoded token's attention, and the dispatch-free decoding step against
// Transformer::forward on the same cache (Llama, Qwen2 biases, Qwen3 q/k norms, LoRA).
#include <gtest/gtest.h>

#include <limits>

#include "kernels/attention.hpp"
#include "model/cpu_decoder.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/device.hpp"
#include "kernels/fused_ops.hpp"
#include "io/model_io.hpp"
#include "kernels/small_gemm.hpp"
#include "tiny_models.hpp"
#include "kernels/token_draw.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

torch::Tensor randn(at::IntArrayRef shape, torch::ScalarType dtype, bool grad = true) {
  return torch::randn(shape, torch::TensorOptions().dtype(dtype)).set_requires_grad(grad);
}

struct AttentionCase {
  std::int64_t B, nh, nkv, T, S, D;
  bool strided_values;  // values as a transposed view (rows not adjacent), as the training path passes them
};

// Forward and all three gradients of causal_attention and causal_attention_reference on the same inputs.
void check_attention(const AttentionCase& c, torch::ScalarType dtype, double tol) {
  SCOPED_TRACE("B=" + std::to_string(c.B) + " heads=" + std::to_string(c.nh) + "/" + std::to_string(c.nkv) +
               " T=" + std::to_string(c.T) + " S=" + std::to_string(c.S));
  torch::manual_seed(7);
  auto q = randn({c.B, c.nh, c.T, c.D}, dtype);
  // Keys live in a larger buffer (a KV cache of capacity S + 3) and are passed as a narrowed view.
  auto key_buffer = randn({c.B, c.nkv, c.S + 3, c.D}, dtype);
  auto v_src = c.strided_values ? randn({c.B, c.S, c.nkv, c.D}, dtype) : randn({c.B, c.nkv, c.S, c.D}, dtype);
  auto upstream = torch::randn({c.B, c.T, c.nh * c.D}, torch::TensorOptions().dtype(dtype));
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));

  auto run = [&](auto&& attention) {
    for (auto* t : {&q, &key_buffer, &v_src}) t->mutable_grad() = torch::Tensor();
    auto keys = key_buffer.narrow(2, 0, c.S);
    auto values = c.strided_values ? v_src.transpose(1, 2) : v_src;
    auto out = attention(q, keys, values, scale);
    (out * upstream).sum().backward();
    return std::vector<torch::Tensor>{out.detach(), q.grad().clone(), key_buffer.grad().clone(), v_src.grad().clone()};
  };
  auto fast = run(causal_attention);
  auto ref = run(causal_attention_reference);
  const char* names[] = {"output", "dq", "dk", "dv"};
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(fast[i].sizes(), ref[i].sizes()) << names[i];
    EXPECT_LT(max_abs_diff(fast[i], ref[i]), tol) << names[i];
  }
  // The cache slots past S get no gradient.
  EXPECT_EQ(fast[2].narrow(2, c.S, 3).abs().max().item<double>(), 0.0);
}

TEST(Parallel, EngineKernelsSplitAcrossThreads) {
  // The engine's at::parallel_for calls were once silently serial (built without OpenMP): 2 threads, 1 used.
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_EQ(rlloop::engine::threads_in_parallel_region(2), 2);
  EXPECT_EQ(rlloop::engine::threads_in_parallel_region(1), 1);
  at::set_num_threads(threads);
}

TEST(CausalAttention, MatchesReferenceInDouble) {
  check_attention({2, 4, 2, 5, 5, 8, true}, torch::kFloat64, 1e-12);    // training: GQA, transposed values
  check_attention({2, 4, 4, 6, 6, 16, false}, torch::kFloat64, 1e-12);  // no GQA
  check_attention({3, 6, 2, 3, 10, 8, false}, torch::kFloat64, 1e-12);  // a cached prefix of 7 positions
  check_attention({2, 4, 1, 1, 9, 8, false}, torch::kFloat64, 1e-12);   // one decoded token, multi-query
  check_attention({2, 4, 2, 1, 1, 8, true}, torch::kFloat64, 1e-12);    // a one-token sequence
}

TEST(CausalAttention, MatchesReferenceInFloat) {
  check_attention({4, 4, 4, 32, 32, 32, true}, torch::kFloat32, 1e-5);
  check_attention({2, 8, 2, 4, 20, 16, false}, torch::kFloat32, 1e-5);
}

TEST(CausalAttention, ChecksShapes) {
  auto q = torch::zeros({1, 3, 2, 4}), kv = torch::zeros({1, 2, 2, 4});
  try {
    causal_attention(q, kv, kv, 1.0);
    FAIL() << "no error for 3 query heads over 2 KV heads";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of the KV heads"), std::string::npos) << e.what();
  }
}

// The ATen decoding step's attention (CUDA, bf16): rows of different lengths padded to one, each equal to its own
// attention over its own keys (the reference, one row at a time), whatever lies past a row's length (NaN here: a
// pool's unwritten slots hold anything).
TEST(DecodeAttention, PaddedRowsEqualEachRowAlone) {
  torch::manual_seed(12);
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const std::int64_t R = 3, nh = 4, nkv = 2, S = 20, D = 8;
    const auto opts = torch::TensorOptions().dtype(dtype);
    const torch::Tensor q = torch::randn({R, nh, 1, D}, opts), k = torch::randn({R, nkv, S, D}, opts),
                        v = torch::randn({R, nkv, S, D}, opts);
    const std::vector<std::int64_t> lengths = {20, 7, 1};
    for (std::int64_t r = 0; r < R; ++r) {
      k[r].narrow(1, lengths[r], S - lengths[r]).fill_(std::numeric_limits<double>::quiet_NaN());
      v[r].narrow(1, lengths[r], S - lengths[r]).fill_(std::numeric_limits<double>::quiet_NaN());
    }
    const torch::Tensor out = decode_attention(q, k, v, torch::tensor(lengths, torch::kLong), 0.35);
    ASSERT_EQ(out.sizes(), (std::vector<std::int64_t>{R, 1, nh * D}));
    for (std::int64_t r = 0; r < R; ++r) {
      const auto keys = [&](const torch::Tensor& t) { return t.narrow(0, r, 1).narrow(2, 0, lengths[r]); };
      const torch::Tensor alone = causal_attention_reference(q.narrow(0, r, 1), keys(k), keys(v), 0.35);
      EXPECT_LT(max_abs_diff(out.narrow(0, r, 1).to(torch::kFloat32), alone.to(torch::kFloat32)),
                dtype == torch::kFloat32 ? 1e-5 : 2e-2)
          << "row " << r;
    }
  }
}

// gpt-oss's attention (windowed_attention): with no sinks and a window wider than the keys it is causal attention;
// with a window, each query is plain attention over its last `window` keys; with sinks, each head's sink logit joins
// the softmax and takes its share of the probability (the formula, written out); gradients reach the sinks. The
// decoding step's form (decode_attention with sinks and a window) is the last query's row.
TEST(WindowedAttention, WindowsAndSinksFollowTheirDefinitions) {
  torch::manual_seed(21);
  const std::int64_t B = 2, nh = 4, nkv = 2, T = 9, D = 8, window = 3;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor q = torch::randn({B, nh, T, D}, f64), k = torch::randn({B, nkv, T, D}, f64),
                      v = torch::randn({B, nkv, T, D}, f64);
  const double scale = 0.3;
  EXPECT_LT(max_abs_diff(windowed_attention(q, k, v, scale, {}, T), causal_attention_reference(q, k, v, scale)),
            1e-12);

  const torch::Tensor windowed = windowed_attention(q, k, v, scale, {}, window);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t first = std::max<std::int64_t>(0, t - window + 1), n = t - first + 1;
    // Query t alone over keys [first, t]: the last query of a causal attention over those keys.
    const torch::Tensor alone = causal_attention_reference(q.narrow(2, t, 1), k.narrow(2, first, n),
                                                           v.narrow(2, first, n), scale);
    EXPECT_LT(max_abs_diff(windowed.narrow(1, t, 1), alone), 1e-12) << "query " << t;
  }

  const torch::Tensor sinks = torch::randn({nh}, f64).requires_grad_(true);
  const torch::Tensor with_sinks = windowed_attention(q, k, v, scale, sinks, window);
  for (std::int64_t h = 0; h < nh; ++h) {
    const std::int64_t t = T - 1, first = t - window + 1;
    const torch::Tensor keys = k[0][h / 2].narrow(0, first, window), values = v[0][h / 2].narrow(0, first, window);
    const torch::Tensor logits = torch::cat({torch::mv(keys, q[0][h][t]) * scale, sinks.detach()[h].view({1})});
    const torch::Tensor p = torch::softmax(logits, 0).narrow(0, 0, window);
    EXPECT_LT(max_abs_diff(with_sinks[0][t].narrow(0, h * D, D), torch::mv(values.t(), p)), 1e-12) << "head " << h;
  }
  with_sinks.sum().backward();
  ASSERT_TRUE(sinks.grad().defined());
  EXPECT_GT(sinks.grad().abs().min().item<double>(), 0.0);

  // One decoded query per row over padded keys, as the ATen decoding step calls it.
  const torch::Tensor lengths = torch::tensor(std::vector<std::int64_t>{T, T}, torch::kLong);
  const torch::Tensor decoded = decode_attention(q.narrow(2, T - 1, 1), k, v, lengths, scale, sinks.detach(), window);
  // (Its softmax is fp32's whatever the inputs' dtype, as the decoding step's on every device.)
  EXPECT_LT(max_abs_diff(decoded.squeeze(1), with_sinks.detach().select(1, T - 1)), 1e-6);
}

// Gemma 2's soft-capped attention: each scaled logit s becomes cap * tanh(s / cap) before the mask and the softmax
// (the formula, written out for every head of the last query, in a window); a cap far above the logits changes
// nothing; the decoding step's form is the last query's row.
TEST(WindowedAttention, SoftCapFollowsItsDefinition) {
  torch::manual_seed(22);
  const std::int64_t B = 1, nh = 4, nkv = 2, T = 7, D = 8, window = 4;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor q = 2 * torch::randn({B, nh, T, D}, f64), k = 2 * torch::randn({B, nkv, T, D}, f64),
                      v = torch::randn({B, nkv, T, D}, f64);
  const double scale = 0.4, cap = 1.5;
  const torch::Tensor capped = windowed_attention(q, k, v, scale, {}, window, cap);
  for (std::int64_t h = 0; h < nh; ++h) {
    const std::int64_t t = T - 1, first = t - window + 1;
    const torch::Tensor keys = k[0][h / 2].narrow(0, first, window), values = v[0][h / 2].narrow(0, first, window);
    const torch::Tensor p = torch::softmax(torch::tanh(torch::mv(keys, q[0][h][t]) * scale / cap) * cap, 0);
    EXPECT_LT(max_abs_diff(capped[0][t].narrow(0, h * D, D), torch::mv(values.t(), p)), 1e-12) << "head " << h;
  }
  const torch::Tensor uncapped = windowed_attention(q, k, v, scale, {}, window);
  EXPECT_GT(max_abs_diff(capped, uncapped), 0.05);  // the logits reach past the cap, so it bites
  EXPECT_LT(max_abs_diff(windowed_attention(q, k, v, scale, {}, window, 1e6), uncapped), 1e-9);

  const torch::Tensor lengths = torch::tensor(std::vector<std::int64_t>{T}, torch::kLong);
  const torch::Tensor decoded = decode_attention(q.narrow(2, T - 1, 1), k, v, lengths, scale, {}, window, cap);
  EXPECT_LT(max_abs_diff(decoded.squeeze(1), capped.select(1, T - 1)), 1e-6);
}

// The CPU kernel over paged keys (blocks in any order, rows nkv * D apart) computes exactly what it computes over the
// same keys stored contiguously: a block holds a multiple of its four-key passes.
TEST(DecodeAttention, PagedKernelEqualsContiguousBitForBit) {
  torch::manual_seed(13);
  const std::int64_t nh = 4, nkv = 2, D = 16, blocks = 6;
  const torch::Tensor keys = torch::randn({blocks * kKVBlockTokens, nkv, D}),
                      values = torch::randn({blocks * kKVBlockTokens, nkv, D});
  // Two rows: 37 positions in blocks 4, 1, 5 (the last one partly filled), and 16 in block 2.
  const std::vector<std::int64_t> tables = {4, 1, 5, 2, 2, 2}, lengths = {37, 16};
  const torch::Tensor q = torch::randn({2, nh, D});
  torch::Tensor out = torch::empty({2, nh, D});
  attend_paged(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
               PagedRows{tables.data(), 3, lengths.data(), 2}, nh, nkv, D, 0.25f, out.data_ptr<float>());
  for (std::int64_t r = 0; r < 2; ++r)
    for (std::int64_t h = 0; h < nh; ++h) {
      std::vector<std::int64_t> slots;
      for (std::int64_t p = 0; p < lengths[r]; ++p)
        slots.push_back(tables[r * 3 + p / kKVBlockTokens] * kKVBlockTokens + p % kKVBlockTokens);
      const torch::Tensor index = torch::tensor(slots, torch::kLong);
      const torch::Tensor K = keys.index_select(0, index).select(1, h / 2).contiguous();  // [S, D]
      const torch::Tensor V = values.index_select(0, index).select(1, h / 2).contiguous();
      std::vector<float> p(static_cast<std::size_t>(lengths[r])), want(D);
      attend_row(q[r][h].contiguous().data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>(), lengths[r], D,
                 0.25f, p.data(), want.data());
      const float* got = out[r][h].data_ptr<float>();
      for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(got[d], want[d]) << "row " << r << ", head " << h << ", " << d;
    }
}

TEST(FusedOps, RmsNormMatchesFormulaWithGradients) {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    auto x = randn({3, 70, 24}, dtype);  // 210 rows: several reduction blocks of 64
    auto w = randn({24}, dtype);
    auto upstream = torch::randn({3, 70, 24}, torch::TensorOptions().dtype(dtype));
    auto fused = rms_norm(x, w, 1e-6);
    (fused * upstream).sum().backward();
    auto dx = x.grad().clone(), dw = w.grad().clone();
    x.mutable_grad() = torch::Tensor();
    w.mutable_grad() = torch::Tensor();
    // The formula in the input dtype (rms_norm_reference normalises in fp32, as HF does).
    auto plain = w * (x * torch::rsqrt(x.square().mean(-1, true) + 1e-6));
    (plain * upstream).sum().backward();
    EXPECT_LT(max_abs_diff(fused, plain), tol);
    EXPECT_LT(max_abs_diff(dx, x.grad()), tol);
    EXPECT_LT(max_abs_diff(dw, w.grad()), tol * 10);  // a sum over 210 rows
  }
}

TEST(FusedOps, RmsNormWithFrozenWeightGivesOnlyInputGradient) {
  auto x = randn({4, 8}, torch::kFloat32);
  auto w = torch::ones({8});
  rms_norm(x, w, 1e-5).sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
}

TEST(FusedOps, SwigluMatchesFormulaWithGradients) {
  torch::manual_seed(5);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
    auto g = randn({5, 40000}, dtype), u = randn({5, 40000}, dtype);  // several parallel chunks
    auto upstream = torch::randn({5, 40000}, torch::TensorOptions().dtype(dtype));
    auto fused = swiglu(g, u);
    (fused * upstream).sum().backward();
    auto dg = g.grad().clone(), du = u.grad().clone();
    g.mutable_grad() = torch::Tensor();
    u.mutable_grad() = torch::Tensor();
    auto plain = swiglu_reference(g, u);
    (plain * upstream).sum().backward();
    EXPECT_LT(max_abs_diff(fused, plain), tol);
    EXPECT_LT(max_abs_diff(dg, g.grad()), tol);
    EXPECT_LT(max_abs_diff(du, u.grad()), tol);
  }
}

TEST(FusedOps, SwigluInPlaceMatchesFormulaInDouble) {
  // The decoding step's SwiGLU: both signs, values whose e^-g would overflow a float (g = -100), a tail that
  // is not a multiple of the 8-lane kernel.
  torch::manual_seed(6);
  const std::int64_t n = 1003;
  auto g = torch::cat({torch::linspace(-100, 100, 41), torch::randn({n - 41}) * 4});
  auto u = torch::randn({n});
  auto expected = g.to(torch::kFloat64) / (1 + torch::exp(-g.to(torch::kFloat64))) * u.to(torch::kFloat64);
  auto out = g.clone();
  swiglu_in_place(out.data_ptr<float>(), u.data_ptr<float>(), n);
  for (std::int64_t i = 0; i < n; ++i) {
    const double want = expected[i].item<double>(), got = out[i].item<float>();
    EXPECT_NEAR(got, want, 1e-6 * std::abs(want) + 1e-30) << "g = " << g[i].item<float>();
  }
}

TEST(FusedOps, RopeMatchesReferenceWithGradients) {
  torch::manual_seed(8);
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-6;
    auto x = randn({2, 5, 3, 8}, dtype);  // [B, T, heads, D]
    auto cos = torch::randn({5, 8}, torch::TensorOptions().dtype(dtype));
    auto sin = torch::randn({5, 8}, torch::TensorOptions().dtype(dtype));
    auto upstream = torch::randn({2, 3, 5, 8}, torch::TensorOptions().dtype(dtype));
    auto fused = rope(x, cos, sin);
    ASSERT_EQ(fused.sizes(), upstream.sizes());
    EXPECT_TRUE(fused.is_contiguous());
    (fused * upstream).sum().backward();
    auto dx = x.grad().clone();
    x.mutable_grad() = torch::Tensor();
    auto plain = rope_reference(x, cos, sin);
    (plain * upstream).sum().backward();
    EXPECT_LT(max_abs_diff(fused, plain), tol);
    EXPECT_LT(max_abs_diff(dx, x.grad()), tol);
  }
}

TEST(SmallGemm, MatchesMatmulIncludingTails) {
  torch::manual_seed(9);
  // {M, N, K}: rows and columns that leave every remainder of the kernel's 4-row and 3-column blocks, a
  // BLAS-only K, more rows than the kernel takes, and a product big enough to be split across threads.
  for (auto [M, N, K] : {std::tuple{5, 7, 16},
                         {7, 11, 24},
                         {2, 8, 8},
                         {4, 12, 16},
                         {6, 9, 8},
                         {16, 130, 64},
                         {3, 9, 12},
                         {80, 33, 32},
                         {16, 2050, 768},
                         {16, 2049, 768}}) {
    SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K));
    auto x = torch::randn({M, K}), w = torch::randn({N, K}), y0 = torch::randn({M, N});
    auto expected = torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t());
    auto y = torch::empty({M, N});
    linear_rows(x.data_ptr<float>(), M, w.data_ptr<float>(), N, K, y.data_ptr<float>(), false);
    EXPECT_LT(max_abs_diff(y.to(torch::kFloat64), expected), 1e-4 * std::sqrt(K));
    auto acc = y0.clone();
    linear_rows(x.data_ptr<float>(), M, w.data_ptr<float>(), N, K, acc.data_ptr<float>(), true);
    EXPECT_LT(max_abs_diff(acc.to(torch::kFloat64), expected + y0.to(torch::kFloat64)), 1e-4 * std::sqrt(K));
  }
}

TEST(SmallGemm, GroupGivesEachProductAsAloneOnAnyThreadCount) {
  // One parallel region over several products of the same input gives each of them bit for bit what it gets
  // alone on one thread, with 1, 2 and 3 threads taking chunks: thread ranges cross product boundaries (a big
  // product next to small ones whose column counts leave every remainder), some accumulate; M = 1 is a
  // sampler's last live row; K = 12 takes the BLAS path. Where BLAS computes (K = 12, and every shape when the
  // kernels are compiled out), "alone" is on the same thread count: OpenBLAS's own result depends on its threads
  // (its Haswell/Zen kernels split the columns between them and sum the edge tiles in another order; seen on an
  // AVX2 EPYC), so only the grouping, not BLAS, is held to "any thread count" there.
  torch::manual_seed(11);
  const int threads = at::get_num_threads();
  for (auto [M, K] : {std::pair{16, 768}, {1, 768}, {5, 64}, {3, 12}}) {
    SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K));
    const std::vector<std::int64_t> columns{7, 2048, 1, 770};
    auto x = torch::randn({M, K});
    std::vector<torch::Tensor> weights, initial;
    for (std::size_t i = 0; i < columns.size(); ++i) {
      weights.push_back(torch::randn({columns[i], K}));
      initial.push_back(torch::randn({M, columns[i]}));
    }
    const auto alone_on = [&](int n) {
      at::set_num_threads(n);
      std::vector<torch::Tensor> alone;
      for (std::size_t i = 0; i < columns.size(); ++i) {
        alone.push_back(initial[i].clone());
        linear_rows(x.data_ptr<float>(), M, weights[i].data_ptr<float>(), columns[i], K, alone[i].data_ptr<float>(),
                    i % 2 == 1);
      }
      return alone;
    };
    const bool own_kernel = small_gemm_applies(M, K);
    const std::vector<torch::Tensor> alone_on_one = alone_on(1);
    for (int n : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(n) + " threads");
      const std::vector<torch::Tensor> alone = own_kernel ? alone_on_one : alone_on(n);
      at::set_num_threads(n);
      std::vector<torch::Tensor> grouped;
      std::vector<RowProduct> products;
      for (std::size_t i = 0; i < columns.size(); ++i) {
        grouped.push_back(initial[i].clone());
        products.push_back({weights[i].data_ptr<float>(), columns[i], grouped[i].data_ptr<float>(), i % 2 == 1});
      }
      linear_rows_group(x.data_ptr<float>(), M, K, products);
      for (std::size_t i = 0; i < columns.size(); ++i)
        EXPECT_TRUE(torch::equal(grouped[i], alone[i])) << "product " << i;
    }
  }
  at::set_num_threads(threads);
}

TEST(DecodeAttention, RowMatchesSoftmaxFormula) {
  torch::manual_seed(10);
  // {S, D}: key counts around the kernel's 4- and 8-wide steps; D = 12 takes the portable path.
  for (auto [S, D] : {std::pair{1, 8}, {7, 32}, {13, 64}, {40, 128}, {6, 80}, {9, 12}}) {
    SCOPED_TRACE("S=" + std::to_string(S) + " D=" + std::to_string(D));
    for (double spread : {1.0, 30.0}) {  // 30: scores far apart, many probabilities underflow to zero
      auto q = torch::randn({D}) * spread, K = torch::randn({S, D}), V = torch::randn({S, D});
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      auto expected =
          torch::matmul(torch::softmax(torch::matmul(K.to(torch::kFloat64), q.to(torch::kFloat64)) * scale, 0),
                        V.to(torch::kFloat64));
      std::vector<float> p(S), out(D);
      attend_row(q.data_ptr<float>(), K.data_ptr<float>(), V.data_ptr<float>(), S, D, scale, p.data(), out.data());
      auto got = torch::tensor(out).to(torch::kFloat64);
      EXPECT_LT(max_abs_diff(got, expected), 1e-5);
    }
  }
}

// Reference in double: the first index whose cumulative softmax(l / T) exceeds u, and log_softmax(l)[token].
std::pair<std::int64_t, double> reference_draw(const torch::Tensor& row, double temperature, double u) {
  auto l = row.to(torch::kFloat64);
  auto w = torch::softmax(l / temperature, 0);
  auto cdf = w.cumsum(0);
  std::int64_t token = 0;
  while (token + 1 < l.size(0) && cdf[token].item<double>() <= u) ++token;
  return {token, torch::log_softmax(l, 0)[token].item<double>()};
}

TEST(TokenDraw, MatchesInverseCdfOfSoftmaxAndReportsTemperatureOneLogprobs) {
  torch::manual_seed(11);
  // Vocabularies around the 8-wide steps and the 1024-entry blocks; some entries -inf (masked tokens).
  for (std::int64_t V : {5, 8, 1003, 4100}) {
    auto logits = torch::randn({6, V}) * 3;
    logits.index_put_({0, 1}, -std::numeric_limits<float>::infinity());
    const std::vector<double> u = {0.0, 0.013, 0.25, 0.5, 0.77, 0.9999};
    for (double T : {1.0, 0.6, 2.5}) {
      SCOPED_TRACE("V=" + std::to_string(V) + " T=" + std::to_string(T));
      std::vector<std::int64_t> tokens(6);
      std::vector<float> logprobs(6);
      draw_tokens(logits.data_ptr<float>(), 6, V, V, T, u.data(), tokens.data(), logprobs.data());
      for (int r = 0; r < 6; ++r) {
        auto [token, logprob] = reference_draw(logits[r], T, u[r]);
        EXPECT_EQ(tokens[r], token) << "row " << r;
        EXPECT_NEAR(logprobs[r], logprob, 1e-5) << "row " << r;
      }
      EXPECT_NE(tokens[0], 1);  // a -inf logit is never drawn, even at u = 0
    }
  }
}

TEST(TokenDraw, EvenlySpacedUniformsReproduceTheProbabilities) {
  const std::vector<float> logits = {std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)};
  constexpr int N = 1000;
  std::vector<double> u(N);
  for (int i = 0; i < N; ++i) u[i] = (i + 0.5) / N;
  std::vector<std::int64_t> tokens(N);
  std::vector<float> logprobs(N);
  draw_tokens(logits.data(), N, 4, /*row_stride=*/0, 1.0, u.data(), tokens.data(), logprobs.data());
  std::vector<int> counts(4, 0);
  for (auto t : tokens) ++counts[t];
  for (int k = 0; k < 4; ++k) EXPECT_NEAR(counts[k], N * (k + 1) / 10.0, 1.0) << "token " << k;
  EXPECT_NEAR(logprobs[N - 1], std::log(0.4), 1e-6);
}

TEST(TokenDraw, HugeTemperatureIsUniformOverUnmaskedTokens) {
  // 1 / T rounds to 0 in float: every finite logit gets weight 1, masked ones still 0 (not NaN).
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = {0.0f, 5.0f, -3.0f, 1.0f, 2.0f, 0.5f, -1.0f, 4.0f, -inf};  // 9: tail past 8 lanes
  std::vector<float> wide(16, 1.0f);
  wide[3] = -inf, wide[12] = -inf;
  for (const auto* row : {&logits, &wide}) {
    const auto V = static_cast<std::int64_t>(row->size());
    std::vector<double> u = {0.0, 0.999999};
    std::int64_t tokens[2];
    float logprobs[2];
    draw_tokens(row->data(), 2, V, 0, 1e46, u.data(), tokens, logprobs);
    EXPECT_EQ(tokens[0], 0);                               // u = 0: the first unmasked token
    EXPECT_EQ(tokens[1], row == &logits ? V - 2 : V - 1);  // u -> 1: the last unmasked one
    EXPECT_TRUE(std::isfinite(logprobs[0]) && std::isfinite(logprobs[1]));
  }
}

TEST(TokenDraw, RowsSplitAcrossThreadsGiveTheSerialResultAndErrors) {
  const int threads = at::get_num_threads();
  torch::manual_seed(12);
  const std::int64_t A = 64, V = 32768;  // enough work for several parallel chunks
  auto logits = torch::randn({A, V}) * 2;
  std::vector<double> u(A);
  for (std::int64_t r = 0; r < A; ++r) u[r] = (r * 0.618034) - std::floor(r * 0.618034);
  auto run = [&](int n) {
    at::set_num_threads(n);
    std::vector<std::int64_t> tokens(A);
    std::vector<float> logprobs(A);
    draw_tokens(logits.data_ptr<float>(), A, V, V, 0.8, u.data(), tokens.data(), logprobs.data());
    return std::pair{tokens, logprobs};
  };
  const auto serial = run(1), parallel = run(2);
  EXPECT_EQ(serial.first, parallel.first);
  EXPECT_EQ(serial.second, parallel.second);
  logits.index_put_({A - 3, 100}, std::numeric_limits<float>::quiet_NaN());  // a late row: another thread's chunk
  at::set_num_threads(2);
  std::vector<std::int64_t> tokens(A);
  std::vector<float> logprobs(A);
  try {
    draw_tokens(logits.data_ptr<float>(), A, V, V, 0.8, u.data(), tokens.data(), logprobs.data());
    ADD_FAILURE() << "no error for a NaN logit";
  } catch (const rlloop::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("row 61 of the decoding batch are NaN"), std::string::npos) << e.what();
  }
  at::set_num_threads(threads);
}

TEST(TokenDraw, GreedyTakesTheFirstLargestLogit) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::int64_t token = -1;
  float logprob = 0;
  draw_tokens(logits.data(), 1, 9, 9, 0.0, nullptr, &token, &logprob);
  EXPECT_EQ(token, 1);
  auto expected = torch::log_softmax(torch::tensor(logits).to(torch::kFloat64), 0)[1].item<double>();
  EXPECT_NEAR(logprob, expected, 1e-6);
}

TEST(TokenDraw, NonFiniteLogitsAreAnErrorNamingTheRow) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits(2 * 16, 0.0f);
  const double u[2] = {0.5, 0.5};
  std::int64_t tokens[2];
  float logprobs[2];
  logits[16 + 9] = nan;
  try {
    draw_tokens(logits.data(), 2, 16, 16, 1.0, u, tokens, logprobs);
    ADD_FAILURE() << "no error for a NaN logit";
  } catch (const rlloop::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("row 1 of the decoding batch are NaN"), std::string::npos) << e.what();
  }
  std::fill(logits.begin(), logits.begin() + 16, -inf);
  logits[16 + 9] = 0.0f;
  EXPECT_THROW(draw_tokens(logits.data(), 2, 16, 16, 1.0, u, tokens, logprobs), rlloop::invalid_argument);
}

// Prefill a prompt for 3 rows with the model, then decode 4 steps with CpuDecoder on one cache and
// Transformer::forward on a copy: logits and cached keys/values agree.
void check_decoder(Transformer& model) {
  c10::InferenceMode inference;
  const auto& cfg = model.config();
  auto prompt = torch::tensor(std::vector<std::int64_t>{3, 17, 5, 42, 8}, torch::kLong).unsqueeze(0);
  KVCache fast = KVCache::allocate(cfg, 1, 12, torch::kCPU, torch::kFloat32);
  model.hidden_states(prompt, &fast);
  fast.repeat_batch(3);
  KVCache slow = fast;  // copy on write: the two share the prompt's blocks and write their own
  CpuDecoder decoder(model);
  auto tokens = torch::tensor(std::vector<std::int64_t>{1, 63, 20}, torch::kLong);
  for (int step = 0; step < 4; ++step) {
    auto a = decoder.step(tokens, fast);
    auto b = model.forward(tokens.unsqueeze(1), &slow).squeeze(1);
    ASSERT_EQ(fast.length, slow.length);
    EXPECT_LT(max_abs_diff(a, b), 2e-5) << "step " << step;
    for (std::size_t l = 0; l < fast.layers(); ++l) {
      EXPECT_LT(max_abs_diff(fast.keys(l), slow.keys(l)), 1e-5);
      EXPECT_LT(max_abs_diff(fast.values(l), slow.values(l)), 1e-5);
    }
    tokens = a.argmax(-1);
  }
}

TEST(CpuDecoder, MatchesModelForwardAcrossFamilies) {
  const int threads = at::get_num_threads();
  // One thread: one pass over all rows; two: the rows of each step split between the threads.
  for (int n : {1, 2}) {
    at::set_num_threads(n);
    for (auto [type, tied] : {std::pair{"llama", true}, {"qwen2", false}, {"qwen3", false}}) {
      SCOPED_TRACE(std::string(type) + ", " + std::to_string(n) + " thread(s)");
      auto model = init_model(tiny_config(type, tied, 64), 11, torch::kCPU, torch::kFloat32);
      check_decoder(*model);
    }
  }
  at::set_num_threads(threads);
}

TEST(CpuDecoder, AppliesLoraAdapters) {
  auto model = init_model(tiny_config("qwen2", false, 64), 12, torch::kCPU, torch::kFloat32);
  model->enable_lora(LoraOptions{.rank = 4, .alpha = 8, .target_modules = {"all-linear", "lm_head"}}, 3);
  {
    torch::NoGradGuard no_grad;
    for (auto& b : model->lora_b_parameters()) b.normal_(0.0, 0.05);  // a trained-looking adapter
  }
  check_decoder(*model);
}

TEST(CpuDecoder, RejectsMismatchedRows) {
  auto model = init_model(tiny_config("llama", true, 64), 13, torch::kCPU, torch::kFloat32);
  c10::InferenceMode inference;
  KVCache cache = KVCache::allocate(model->config(), 2, 8, torch::kCPU, torch::kFloat32);
  CpuDecoder decoder(*model);
  EXPECT_THROW(decoder.step(torch::zeros({3}, torch::kLong), cache), std::exception);
  EXPECT_THROW(decoder.step(torch::full({2}, 64, torch::kLong), cache), std::exception);  // outside the vocabulary
}

}  // namespace
