#include <gtest/gtest.h>

#include <type_traits>

#include <rlloop/rlloop.hpp>

using namespace rlloop;

TEST(ModelInput, FlattensChunksInOrder) {
  ModelInput in = ModelInput::from_tokens({1, 2});
  in.append({3}).append({4, 5});
  EXPECT_EQ(in.length(), 5u);
  EXPECT_EQ(in.tokens(), (std::vector<token_id>{1, 2, 3, 4, 5}));
}

namespace {
Datum sft_datum(std::vector<token_id> in, std::vector<std::int64_t> targets) {
  Datum d;
  d.model_input = ModelInput::from_tokens(std::move(in));
  d.loss_fn_inputs["weights"] = TensorData::from_floats(std::vector<float>(targets.size(), 1.0f));
  d.loss_fn_inputs["target_tokens"] = TensorData::from_ints(std::move(targets));
  return d;
}
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST(ValidateBatch, NamesTheProblem) {
  std::vector<Datum> ok{sft_datum({1, 2, 3}, {2, 3, 4})};
  EXPECT_NO_THROW(validate_batch(ok, LossFn::cross_entropy, 10));
  EXPECT_EQ(message_of([&] { validate_batch(ok, LossFn::cross_entropy, 4); }),
            "datum 0: target token 4 at position 2 is out of range [0, 4)");
  std::vector<Datum> bad_id{sft_datum({1, 12, 3}, {2, 3, 4})};
  EXPECT_EQ(message_of([&] { validate_batch(bad_id, LossFn::cross_entropy, 10); }),
            "datum 0: token id 12 at position 1 is out of range [0, 10)");
  std::vector<Datum> empty{sft_datum({}, {})};
  EXPECT_EQ(message_of([&] { validate_batch(empty, LossFn::cross_entropy, 10); }), "datum 0: model input is empty");
  std::vector<Datum> short_w{sft_datum({1, 2, 3}, {2, 3, 4})};
  short_w[0].loss_fn_inputs["weights"] = TensorData::from_floats({1.0f});
  EXPECT_EQ(message_of([&] { validate_batch(short_w, LossFn::cross_entropy, 10); }),
            "datum 0: loss input 'weights' has 1 values but the model input has 3 tokens");
  std::vector<Datum> rl{sft_datum({1, 2}, {2, 3})};
  EXPECT_EQ(message_of([&] { validate_batch(rl, LossFn::ppo, 10); }),
            "datum 0: loss 'ppo' needs loss input 'advantages'");
  rl[0].loss_fn_inputs["advantages"] = TensorData::from_floats({1.0f, std::nanf("")});
  rl[0].loss_fn_inputs["logprobs"] = TensorData::from_floats({-1.0f, -1.0f});
  EXPECT_EQ(message_of([&] { validate_batch(rl, LossFn::ppo, 10); }),
            "datum 0: loss input 'advantages' holds a non-finite value at position 1");
  EXPECT_EQ(message_of([&] { validate_batch(std::vector<Datum>{}, LossFn::ppo, 10); }), "the batch holds no datum");
}

TEST(Future, ReadyAndFailedFutures) {
  auto f = Future<int>::ready(7);
  EXPECT_TRUE(f.is_ready());
  EXPECT_EQ(f.get(), 7);
  auto g = Future<int>::failed(std::make_exception_ptr(conflict("busy")));
  EXPECT_THROW(g.get(), conflict);
}

TEST(Future, ATemporaryFutureGivesItsResultByValue) {
  // A held future lends its result; a temporary one copies it out, so that a range over a member of the result
  // does not outlive the shared state the result lives in.
  static_assert(std::is_same_v<decltype(std::declval<Future<std::vector<int>>&>().get()), const std::vector<int>&>);
  static_assert(std::is_same_v<decltype(std::declval<Future<std::vector<int>>>().get()), std::vector<int>>);
  std::vector<int> seen;
  for (int v : Future<std::vector<int>>::ready({3, 1, 4}).get()) seen.push_back(v);
  EXPECT_EQ(seen, (std::vector<int>{3, 1, 4}));
  EXPECT_THROW(Future<int>::failed(std::make_exception_ptr(conflict("busy"))).get(), conflict);
}
