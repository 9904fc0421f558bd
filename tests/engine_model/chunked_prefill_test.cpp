// Chunked prefill: a prompt fed as rows of decoding steps, a chunk at a time beside other requests' one-token rows
// (DecodeGroup / CpuDecoder::Group chunks, DecodeRun's Prefill::in_steps), must give what prefilling it alone through
// the model's forward gives: the same logits at its last position, the same keys and values in its cache, and the
// same samples.
#include <gtest/gtest.h>

#include <cstdlib>

#include "model/builtin_models.hpp"
#include "model/cpu_decoder.hpp"
#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "tiny_models.hpp"
#include "model/transformer.hpp"

using namespace rlloop;
using namespace rlloop::engine;
using namespace rlloop::engine::test_models;

namespace {

std::shared_ptr<Transformer> random_base(torch::ScalarType dtype, const ModelConfig& cfg = tiny_config("qwen3")) {
  auto model = init_model(cfg, 7, torch::kCPU, dtype);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.uniform_(p.dim() == 1 ? 0.7 : -0.4, p.dim() == 1 ? 1.3 : 0.4);
  return model;
}

std::shared_ptr<Transformer> adapted(Transformer& base, std::int64_t seed) {
  auto model = Transformer::sharing_base(base);
  model->enable_lora({4, 8, {"all-linear", "lm_head"}}, seed);
  torch::NoGradGuard no_grad;
  for (auto& b : model->lora_b_parameters()) b.uniform_(-0.2, 0.2);
  return model;
}

double max_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>();
}

torch::Tensor random_tokens(std::int64_t n, int seed) {
  torch::manual_seed(seed);
  return torch::randint(64, {n}, torch::kLong);
}

// The keys and values of every layer of two caches of batch 1 agree.
void expect_same_cache(const KVCache& a, const KVCache& b, double tolerance, const std::string& what) {
  ASSERT_EQ(a.length, b.length) << what;
  for (std::size_t l = 0; l < a.layers(); ++l) {
    EXPECT_LT(max_difference(a.keys(l), b.keys(l)), tolerance) << what << ", layer " << l;
    EXPECT_LT(max_difference(a.values(l), b.values(l)), tolerance) << what << ", layer " << l;
  }
}

// A request decoding beside the chunks: a prompt prefilled for 2 rows, and the tokens they feed.
struct Decoding {
  std::shared_ptr<Transformer> model;
  KVCache cache;
  torch::Tensor tokens;
};

Decoding decoding(std::shared_ptr<Transformer> model, torch::ScalarType cache_dtype) {
  Decoding d{std::move(model), {}, random_tokens(2, 3)};
  d.cache = KVCache(d.model->kv_pools(), cache_dtype, 1, 16);
  d.model->hidden_states(random_tokens(5, 4).unsqueeze(0), &d.cache);
  d.cache.repeat_batch(2);
  return d;
}

// Two prompts (13 and 6 tokens, other adapters) fed through `step` in chunks of at most 8 tokens beside two
// decoding requests (adapters of the first prompt's rank: the two stack, the chunk runs its own), against each
// prefilled alone through hidden_states: their last logits and caches, and the decoding rows' logits against their
// models' own steps. `step(groups)` runs one step of DecodeGroup-shaped groups.
template <class Step>
void check_chunks(torch::ScalarType dtype, torch::ScalarType cache_dtype, double tolerance, Step&& step,
                  const ModelConfig& cfg = tiny_config("qwen3")) {
  // Made outside inference mode: a bf16 snapshot (RoundedWeights) reads the weights' version counters.
  auto base = random_base(dtype, cfg);
  std::vector<std::shared_ptr<Transformer>> decoding_models = {adapted(*base, 1), adapted(*base, 4)};
  std::vector<std::shared_ptr<Transformer>> models = {adapted(*base, 2), Transformer::sharing_base(*base)};
  c10::InferenceMode inference;
  std::vector<Decoding> others;
  for (auto& m : decoding_models) others.push_back(decoding(m, cache_dtype));
  const std::vector<torch::Tensor> prompts = {random_tokens(13, 5), random_tokens(6, 6)};
  std::vector<KVCache> caches;
  for (std::size_t i = 0; i < prompts.size(); ++i) caches.emplace_back(base->kv_pools(), cache_dtype, 1, 16);

  std::vector<std::int64_t> fed(prompts.size(), 0);
  std::vector<torch::Tensor> last(prompts.size());
  for (int s = 0; s < 2; ++s) {
    // Step 0: 8 tokens of the first prompt (no logits: its end is not there yet) and the whole second one; step 1
    // the first prompt's 5 others.
    std::vector<torch::Tensor> chunks;
    std::vector<std::size_t> fed_here;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      const std::int64_t n = std::min<std::int64_t>(8, prompts[i].size(0) - fed[i]);
      if (n == 0) continue;
      chunks.push_back(prompts[i].narrow(0, fed[i], n));
      fed_here.push_back(i);
    }
    std::vector<torch::Tensor> others_expected;
    std::vector<DecodeGroup> groups;
    for (Decoding& other : others) {
      KVCache alone = other.cache;  // copy on write
      others_expected.push_back(other.model->forward(other.tokens.unsqueeze(1), &alone).squeeze(1));
      groups.push_back({other.model.get(), &other.tokens, &other.cache});
    }
    std::vector<bool> ends;
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const std::size_t i = fed_here[c];
      ends.push_back(fed[i] + chunks[c].size(0) == prompts[i].size(0));
      groups.push_back({models[i].get(), &chunks[c], &caches[i], ends.back()});
    }
    const torch::Tensor logits = step(*base, groups);
    std::int64_t expected_rows = 4;
    for (bool e : ends) expected_rows += e ? 1 : 0;
    ASSERT_EQ(logits.size(0), expected_rows) << "step " << s << ": the decoding rows and each ending chunk's last";
    for (std::size_t o = 0; o < others.size(); ++o)
      EXPECT_LT(max_difference(logits.narrow(0, 2 * o, 2), others_expected[o]), tolerance)
          << "step " << s << ", decoding request " << o;
    std::int64_t row = 4;
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      fed[fed_here[c]] += chunks[c].size(0);
      if (ends[c]) last[fed_here[c]] = logits[row++];
    }
    for (std::size_t o = 0; o < others.size(); ++o) others[o].tokens = others_expected[o].argmax(-1);
  }
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    KVCache alone(base->kv_pools(), cache_dtype, 1, 16);
    const torch::Tensor expected = models[i]->forward(prompts[i].unsqueeze(0), &alone)[0][-1];
    EXPECT_LT(max_difference(last[i], expected), tolerance) << "prompt " << i;
    expect_same_cache(caches[i], alone, tolerance, "prompt " + std::to_string(i));
  }
}

}  // namespace

// The ATen step (CUDA's): in fp32 on the CPU the chunk's rows attend through the paged row kernel, in bf16 through
// the causal attention of a prefill over the chunk's gathered blocks. Adapters of one rank on the decoding request
// and the first prompt run stacked, their unembedding over the rows that ask for logits only.
TEST(ChunkedPrefill, ChunksInAtenStepsEqualEachPromptPrefilledAlone) {
  auto aten = [](Transformer& base, const std::vector<DecodeGroup>& groups) { return base.decode_step(groups); };
  {
    SCOPED_TRACE("fp32");
    check_chunks(torch::kFloat32, torch::kFloat32, 2e-5, aten);
  }
  {
    SCOPED_TRACE("bf16");
    check_chunks(torch::kBFloat16, torch::kBFloat16, 0.1, aten);
  }
  // gpt-oss's layers: attention sinks and a sliding window of 8 on layer 0 (the 13-token prompt's later rows see
  // only the last 8 positions), experts routed per row (more rows than the few-row expert kernels take).
  {
    SCOPED_TRACE("rlloop-tiny-gpt-oss");
    check_chunks(torch::kFloat32, torch::kFloat32, 2e-5, aten, *builtin_model("rlloop-tiny-gpt-oss"));
  }
}

// The CPU decoder's step, on one thread and on two (where a step without chunks splits its rows between threads).
TEST(ChunkedPrefill, ChunksInCpuDecoderStepsEqualEachPromptPrefilledAlone) {
  const int threads = at::get_num_threads();
  for (int n : {1, 2}) {
    at::set_num_threads(n);
    SCOPED_TRACE(std::to_string(n) + " thread(s)");
    for (DecodePrecision precision : {DecodePrecision::fp32, DecodePrecision::bf16}) {
      const bool bf16 = precision == DecodePrecision::bf16;
      SCOPED_TRACE(bf16 ? "bf16 precision" : "fp32");
      check_chunks(torch::kFloat32, CpuDecoder::cache_dtype(precision), bf16 ? 0.1 : 2e-5,
                   [&](Transformer&, const std::vector<DecodeGroup>& groups) {
                     std::vector<std::unique_ptr<CpuDecoder>> decoders;
                     std::vector<CpuDecoder::Group> cpu;
                     for (const DecodeGroup& g : groups) {
                       decoders.push_back(std::make_unique<CpuDecoder>(*g.model, precision));
                       cpu.push_back({&decoders.back()->weights(), g.tokens, g.cache, g.logits});
                     }
                     return decoders.front()->step(cpu);
                   });
    }
  }
  at::set_num_threads(threads);
}

TEST(ChunkedPrefill, RefusesAChunkForACacheOfSeveralSequences) {
  c10::InferenceMode inference;
  auto base = random_base(torch::kFloat32);
  Decoding two = decoding(Transformer::sharing_base(*base), torch::kFloat32);
  const torch::Tensor three = random_tokens(3, 1);
  const DecodeGroup group{two.model.get(), &three, &two.cache};
  try {
    base->decode_step({&group, 1});
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Transformer::decode_step: a group's tokens must be [rows] int64, one per cache row or a chunk of a "
              "cache of batch 1, got [3] for a cache of batch 2");
  }
  KVCache small(base->kv_pools(), torch::kFloat32, 1, 4);
  const DecodeGroup too_long{two.model.get(), &three, &small};
  small.length = 2;
  try {
    base->decode_step({&too_long, 1});
    ADD_FAILURE() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Transformer::decode_step: KV cache capacity 4 exceeded (2 cached + 3 new tokens)");
  }
}

namespace {

// Sets RLLOOP_DECODER for the scope.
class DecoderChoice {
 public:
  explicit DecoderChoice(const char* value) { setenv("RLLOOP_DECODER", value, 1); }
  ~DecoderChoice() { unsetenv("RLLOOP_DECODER"); }
};

SampleRequest request(std::vector<token_id> prompt, int samples, int max_tokens) {
  SampleRequest req;
  req.prompt = ModelInput::from_tokens(std::move(prompt));
  req.num_samples = samples;
  req.params.max_tokens = max_tokens;
  req.params.temperature = 1.0;
  return req;
}

}  // namespace

// Three requests, two prefilling in steps of at most 4 prompt tokens (the first taking 3 steps, the second waiting
// for its turn), one prefilled as it was made and decoding from the first step: every sample is the one sample()
// draws for its request alone, on the CPU decoder and on the ATen step. (At bf16 precision a prompt prefilled in
// steps is computed with the steps' rounded products, not the model's: ChunksInCpuDecoderSteps... bounds that.)
TEST(ChunkedPrefill, RequestsPrefilledInStepsSampleWhatEachSamplesAlone) {
  for (const char* decoder : {"auto", "aten"}) {
    {
      const DecodePrecision precision = DecodePrecision::fp32;
      SCOPED_TRACE(decoder);
      DecoderChoice choice(decoder);
      c10::InferenceMode inference;
      auto base = random_base(torch::kFloat32);
      auto lora = adapted(*base, 3);
      const std::vector<SampleRequest> requests = {request({5, 9, 11, 2, 7, 30, 31, 8, 1, 4}, 3, 6),
                                                   request({40, 41, 42, 43, 44, 45}, 2, 5),
                                                   request({12, 13, 14}, 2, 7)};
      std::vector<Transformer*> models = {lora.get(), base.get(), lora.get()};
      std::vector<std::unique_ptr<DecodeRun>> runs;
      for (std::size_t i = 0; i < requests.size(); ++i)
        runs.push_back(std::make_unique<DecodeRun>(*models[i], requests[i], nullptr, SampleStream(20 + i), precision,
                                                   nullptr, i < 2 ? Prefill::in_steps : Prefill::at_start));
      EXPECT_TRUE(runs[0]->prefilling());
      EXPECT_EQ(runs[0]->rows(), 3);  // what it will decode, counted from the start
      EXPECT_FALSE(runs[2]->prefilling());
      int steps = 0;
      for (;;) {
        std::vector<DecodeRun*> live;
        for (auto& r : runs)
          if (!r->done()) live.push_back(r.get());
        if (live.empty()) break;
        decode_step(live, 4);
        ++steps;
        if (steps == 2) {
          EXPECT_TRUE(runs[0]->prefilling()) << "10 prompt tokens take 3 steps of 4";
          EXPECT_TRUE(runs[1]->prefilling()) << "its turn comes after the first prompt's";
          EXPECT_TRUE(runs[1]->progress().sequences[0].tokens.empty());
        }
        ASSERT_LT(steps, 40);
      }
      for (std::size_t i = 0; i < requests.size(); ++i) {
        const SampleResponse alone = sample(*models[i], requests[i], nullptr, SampleStream(20 + i), precision);
        const SampleResponse stepped = runs[i]->take();
        ASSERT_EQ(stepped.sequences.size(), alone.sequences.size());
        for (std::size_t s = 0; s < alone.sequences.size(); ++s) {
          EXPECT_EQ(stepped.sequences[s].tokens, alone.sequences[s].tokens) << "request " << i << ", sample " << s;
          EXPECT_EQ(stepped.sequences[s].prefill_tokens, alone.sequences[s].prefill_tokens);
          ASSERT_EQ(stepped.sequences[s].logprobs.size(), alone.sequences[s].logprobs.size());
          for (std::size_t t = 0; t < alone.sequences[s].logprobs.size(); ++t)
            EXPECT_NEAR(stepped.sequences[s].logprobs[t], alone.sequences[s].logprobs[t], 1e-4)
                << "request " << i << ", sample " << s << ", token " << t;
        }
      }
    }
  }
}

TEST(ChunkedPrefill, RefusesABudgetOfNoTokens) {
  c10::InferenceMode inference;
  auto base = random_base(torch::kFloat32);
  DecodeRun run(*base, request({1, 2, 3}, 1, 2), nullptr, SampleStream(1), DecodePrecision::fp32, nullptr,
                Prefill::in_steps);
  DecodeRun* runs[] = {&run};
  EXPECT_THROW(decode_step(runs, 0), invalid_argument);
  EXPECT_TRUE(run.prefilling());
}
