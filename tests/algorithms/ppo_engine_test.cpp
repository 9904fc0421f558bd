// PPO with a critic on rlloop-tiny: a toy reward (share of digits in a 2-token completion) rises, and a
// session without a value head is refused by name.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <rlloop/algorithms/ppo.hpp>
#include <rlloop/local.hpp>
#include <rlloop/tokenizer.hpp>

#include "toy_loop.hpp"

using namespace rlloop;
using namespace rlloop::algorithms;

namespace {
LocalServiceOptions cpu_service() {
  LocalServiceOptions s;
  s.checkpoint_dir = (std::filesystem::temp_directory_path() / ("rlloop-ppo-" + std::to_string(::getpid()))).string();
  s.device = "cpu";
  configure_engine_process({.num_threads = 1});
  return s;
}
}  // namespace

TEST(Ppo, RaisesTheRewardAndFitsTheCritic) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  SessionOptions opts{.base_model = "rlloop-tiny", .seed = 3, .value_head = true};
  auto client = service.create_training_client(opts);
  PPO<LocalSession> ppo(client, load_tokenizer(client),
                        {.group_size = 8,
                         .sampling = {.max_tokens = 2, .temperature = 1.0, .seed = 11},
                         .epochs = 2,
                         .substeps = 2,
                         .adam = {.learning_rate = 2e-2}});
  const std::vector<toy::LetterProblem> problems{{"n="}, {"k="}, {"x="}, {"y="}};
  const toy::ShareOf digits{"0123456789"};
  std::vector<PolicyGradientStats> stats;
  for (int s = 0; s < 30; ++s) stats.push_back(ppo.step(problems, digits));
  const double first = (stats[0].reward_mean + stats[1].reward_mean + stats[2].reward_mean) / 3;
  const double last = (stats[27].reward_mean + stats[28].reward_mean + stats[29].reward_mean) / 3;
  EXPECT_LT(first, 0.2);
  EXPECT_GT(last, first + 0.4);
  EXPECT_EQ(client.get_info().step, 30 * 2 * 2);  // epochs x substeps optimizer steps per PPO step
  // The critic's own learning is tested in engine_session_test (ValueHeadLearnsReturns...); here it must at
  // least have been trained every step.
  for (const auto& st : stats) EXPECT_GT(st.value_loss, 0.0);

  auto plain = service.create_full_training_client("rlloop-tiny");
  try {
    PPO<LocalSession> bad(plain, load_tokenizer(plain), {});
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs a value head"), std::string::npos);
  }
}
