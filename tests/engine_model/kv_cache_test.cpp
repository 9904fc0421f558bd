// The paged KV cache (kv_cache.hpp): samples of one prompt hold its blocks once, a shared block is copied only
// when written, finished rows return their blocks, and every block comes back when a request ends.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#include "io/model_io.hpp"
#include "runtime/sampler.hpp"
#include "tiny_models.hpp"

namespace rlloop::engine {
namespace {

using test_models::tiny_config;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

torch::Tensor ids_of(const std::vector<std::int64_t>& tokens) {
  return torch::tensor(tokens, torch::kLong).unsqueeze(0);
}

std::int64_t blocks_in_use(Transformer& model) { return model.kv_pools()->pool(torch::kFloat32).blocks_in_use(); }

// 16 samples of a 1,024-token prompt (issue 26, must-show 3): the prompt's 64 blocks are held once, and each sample
// adds only the blocks of its own tokens; 16 full copies would hold 16 times the prompt. With a prompt that ends
// inside a block, that block is the one each sample copies (copy on write), and no other.
TEST(PagedKVCache, SixteenSamplesOfALongPromptHoldItsBlocksOnce) {
  auto model = init_model(tiny_config("qwen3", false, 2048), 7, torch::kCPU, torch::kFloat32);
  for (const std::int64_t prompt_length : {1024, 1000}) {
    SCOPED_TRACE("prompt of " + std::to_string(prompt_length));
    std::vector<token_id> prompt;
    for (std::int64_t i = 0; i < prompt_length; ++i) prompt.push_back(static_cast<token_id>((i * 37 + 11) % 64));
    SampleRequest req;
    req.prompt = ModelInput::from_tokens(prompt);
    req.num_samples = 16;
    req.params.max_tokens = 20;
    req.params.temperature = 1.0;
    const std::int64_t prompt_blocks = (prompt_length + kKVBlockTokens - 1) / kKVBlockTokens;
    const std::int64_t full_prompt_blocks = prompt_length / kKVBlockTokens;
    {
      DecodeRun run(*model, req, {}, SampleStream(3), DecodePrecision::fp32, nullptr);
      EXPECT_EQ(blocks_in_use(*model), prompt_blocks) << "after the prefill, before any sample wrote";
      DecodeRun* const runs[] = {&run};
      decode_step(runs);  // every sample writes its first token's keys
      // Full prompt blocks shared; each sample's first token in a block of its own (its copy of the prompt's partial
      // last block, or a fresh one).
      const std::int64_t held = blocks_in_use(*model);
      EXPECT_EQ(held, full_prompt_blocks + 16);
      const KVBlockPool& pool = model->kv_pools()->pool(torch::kFloat32);
      const std::int64_t copies = 16 * (prompt_length / kKVBlockTokens + 1);
      std::cout << "KV of 16 samples of a " << prompt_length << "-token prompt after one token: " << held
                << " blocks (" << held * pool.bytes_per_block() << " bytes), 16 full copies: " << copies
                << " blocks (" << copies * pool.bytes_per_block() << " bytes), ratio "
                << static_cast<double>(held) / static_cast<double>(copies) << "\n";
      while (!run.done()) decode_step(runs);
      const SampleResponse r = run.take();
      ASSERT_EQ(r.sequences.size(), 16u);
      // The samples differ (their own streams) although they share the prompt's blocks.
      EXPECT_NE(r.sequences[0].tokens, r.sequences[1].tokens);
      // Sampled logprobs are those of the whole sequence computed afresh, so no sample read another's keys.
      for (int s : {0, 15}) {
        std::vector<token_id> whole = prompt;
        whole.insert(whole.end(), r.sequences[s].tokens.begin(), r.sequences[s].tokens.end());
        const std::vector<double> ref = compute_logprobs(*model, whole);
        for (std::size_t t = 0; t < r.sequences[s].tokens.size(); ++t)
          ASSERT_NEAR(r.sequences[s].logprobs[t], ref[prompt.size() + t], 1e-4) << "sample " << s << ", token " << t;
      }
    }
    EXPECT_EQ(blocks_in_use(*model), 0) << "a finished request returns every block";
  }
}

// A copy of a cache shares its blocks; each copy writes its own positions into a block of its own, so both continue
// as if alone; the copy's release leaves the original's blocks intact.
TEST(PagedKVCache, CopiesShareBlocksAndWriteTheirOwn) {
  auto model = init_model(tiny_config("llama", true), 9, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  const std::vector<std::int64_t> prompt = {5, 9, 2, 33, 4};
  KVCache cache(model->kv_pools(), torch::kFloat32, 1, 40);
  model->forward(ids_of(prompt), &cache);
  EXPECT_EQ(blocks_in_use(*model), 1);
  torch::Tensor mine, theirs;
  {
    KVCache copy = cache;
    EXPECT_EQ(blocks_in_use(*model), 1) << "a copy holds no block of its own before it writes";
    EXPECT_EQ(model->kv_pools()->pool(torch::kFloat32).references(copy.blocks(0)[0]), 2);
    theirs = model->forward(ids_of({7}), &copy)[0][0];
    EXPECT_EQ(blocks_in_use(*model), 2) << "the written block was copied";
    EXPECT_NE(copy.blocks(0)[0], cache.blocks(0)[0]);
  }
  EXPECT_EQ(blocks_in_use(*model), 1);
  mine = model->forward(ids_of({8}), &cache)[0][0];
  auto with = [&](std::int64_t token) {
    std::vector<std::int64_t> seq = prompt;
    seq.push_back(token);
    return model->forward(ids_of(seq))[0][5];
  };
  EXPECT_LT(max_abs_diff(theirs, with(7)), 1e-5);
  EXPECT_LT(max_abs_diff(mine, with(8)), 1e-5);
  // Across a block boundary: 20 more positions take the cache to 26, two blocks.
  std::vector<std::int64_t> more(20, 3);
  model->forward(ids_of(more), &cache);
  EXPECT_EQ(cache.length, 26);
  EXPECT_EQ(cache.blocks(0).size(), 2u);
  EXPECT_EQ(cache.keys(0).sizes(), (std::vector<std::int64_t>{1, 2, 26, 8}));
}

// Rows that leave the batch (finished samples) give back the blocks only they held, and no other row's moves.
TEST(PagedKVCache, FinishedRowsReturnTheirOwnBlocks) {
  auto model = init_model(tiny_config("qwen2"), 4, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  KVCache cache(model->kv_pools(), torch::kFloat32, 1, 64);
  model->forward(ids_of(std::vector<std::int64_t>(16, 1)), &cache);  // exactly one full block
  cache.repeat_batch(4);
  model->forward(torch::tensor({10, 11, 12, 13}, torch::kLong).unsqueeze(1), &cache);
  EXPECT_EQ(blocks_in_use(*model), 1 + 4);
  const std::int64_t kept_block = cache.blocks(2)[1];
  const torch::Tensor kept_keys = cache.keys(1).narrow(0, 2, 1);
  cache.select_batch(torch::tensor({2}, torch::kLong));
  EXPECT_EQ(blocks_in_use(*model), 1 + 1);
  EXPECT_EQ(cache.blocks(0)[1], kept_block) << "the kept row's blocks did not move";
  EXPECT_TRUE(torch::equal(cache.keys(1), kept_keys));
  EXPECT_THROW(cache.select_batch(torch::tensor({1}, torch::kLong)), invalid_argument);
}

TEST(PagedKVCache, RefusesWritesPastItsCapacity) {
  auto model = init_model(tiny_config("llama"), 2, torch::kCPU, torch::kFloat32);
  torch::NoGradGuard no_grad;
  KVCache cache(model->kv_pools(), torch::kFloat32, 1, 4);
  try {
    model->forward(ids_of({1, 2, 3, 4, 5}), &cache);
    ADD_FAILURE() << "5 positions were written into a cache of 4";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Transformer::hidden_states: KV cache capacity 4 exceeded (0 cached + 5 new tokens)");
  }
  EXPECT_EQ(cache.length, 0);
  EXPECT_EQ(blocks_in_use(*model), 0);
  EXPECT_THROW(KVCache(model->kv_pools(), torch::kFloat32, 0, 4), invalid_argument);
}

}  // namespace
}  // namespace rlloop::engine
