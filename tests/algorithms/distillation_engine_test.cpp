// On-policy distillation on rlloop-small (public API only): a teacher SFT-trained to answer sums, a fresh student
// distilled from it (both fully fine-tuned: LoRA adapters on this randomly initialised base learned the format far
// slower, the teacher's SFT loss 5.41 -> 4.04 in 40 steps against 0.73); the per-token reverse KL on the student's
// own samples of 16 held-out prompts must halve within 20 steps (measured 5.36 -> 1.75). A teacher whose tokenizer is
// another is refused, naming both.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <rlloop/algorithms/distillation.hpp>
#include <rlloop/algorithms/sft.hpp>
#include <rlloop/envs/arithmetic.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rewards/math.hpp>
#include <rlloop/tokenizer.hpp>

#include "tokenizer/test_support.hpp"  // error_of

using namespace rlloop;
using namespace rlloop::algorithms;
using rlloop::test::error_of;

namespace {
namespace fs = std::filesystem;

fs::path temp_dir() { return fs::temp_directory_path() / ("rlloop-distill-" + std::to_string(::getpid())); }

LocalServiceOptions cpu_service() {
  LocalServiceOptions s;
  s.checkpoint_dir = temp_dir().string();
  s.device = "cpu";
  configure_engine_process({.num_threads = 1});
  return s;
}

using Student = TrainingClient<LocalSession>;
using TeacherClient = SamplingClient<LocalSession>;

// The teacher: rlloop-small fully fine-tuned (SFT) on "a+b=" -> "#### N" + EOS.
TeacherClient train_teacher(ServiceClient<LocalService>& service, const Tokenizer& tokenizer, int steps) {
  auto teacher = service.create_full_training_client("rlloop-small", /*seed=*/1);
  Sft<LocalSession> sft(teacher, {.adam = {.learning_rate = 3e-3}});
  envs::ArithmeticTask task(envs::ArithmeticOptions::for_difficulty(2), /*seed=*/11);
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    std::vector<Datum> batch;
    for (const auto& p : task.sample(32, envs::Split::train)) {
      auto completion = tokenizer.encode(p.target);
      completion.push_back(*tokenizer.eos_token_id());
      batch.push_back(completion_datum(tokenizer.encode(p.prompt), completion));
    }
    const double loss = sft.step(batch).loss_per_token;
    (s == 0 ? first : last) = loss;
  }
  std::printf("teacher SFT: loss per token %.3f -> %.3f in %d steps\n", first, last, steps);
  EXPECT_LT(last, 0.5 * first);  // it learned the format, so it is not the student's starting point
  return teacher.live_sampling_client();
}

// A teacher behind "another service": scores through a session, names its tokenizer itself.
struct NamedTeacher {
  TeacherClient inner;
  std::string name;
  Future<std::vector<double>> compute_logprobs(const ModelInput& input) const { return inner.compute_logprobs(input); }
  std::string tokenizer_name() const { return name; }
};
static_assert(Teacher<TeacherClient> && Teacher<NamedTeacher>);

// The byte tokenizer with two byte ids swapped: the same size, another vocabulary.
struct SwappedBytes final : Tokenizer {
  std::shared_ptr<const Tokenizer> bytes = load_tokenizer("byte");
  static token_id swap(token_id id) { return id == 'a' ? 'b' : id == 'b' ? 'a' : id; }
  std::vector<token_id> encode(std::string_view text, bool allow_special) const override {
    auto ids = bytes->encode(text, allow_special);
    for (auto& id : ids) id = swap(id);
    return ids;
  }
  std::string decode(std::span<const token_id> ids, bool skip_special) const override {
    std::vector<token_id> swapped(ids.begin(), ids.end());
    for (auto& id : swapped) id = swap(id);
    return bytes->decode(swapped, skip_special);
  }
  std::int64_t vocab_size() const override { return bytes->vocab_size(); }
  std::optional<token_id> token_to_id(std::string_view t) const override { return bytes->token_to_id(t); }
  std::optional<token_id> eos_token_id() const override { return bytes->eos_token_id(); }
};

// A byte-level BPE tokenizer.json: the 256 bytes in GPT-2's alphabet (ids in byte order) and the merge "1 2" -> 256.
std::string byte_level_bpe_json() {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 256;  // GPT-2 maps the bytes it does not print to code points from 256 on
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    vocab[cp < 0x80 ? std::string(1, static_cast<char>(cp))
                    : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))}] = b;
  }
  vocab["12"] = 256;
  const nlohmann::json j = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"1 2"}}}},
      {"normalizer", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}};
  return j.dump();
}

}  // namespace

TEST(Distillation, HalvesTheReverseKlToATrainedTeacherIn20Steps) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  const auto tokenizer = load_tokenizer("byte");
  const TeacherClient teacher = train_teacher(service, *tokenizer, 40);

  auto student = service.create_full_training_client("rlloop-small", /*seed=*/2);
  Distillation<LocalSession, TeacherClient> distill(student, tokenizer, teacher, tokenizer,
                                                    {.group_size = 8,
                                                     .sampling = {.max_tokens = 8, .temperature = 1.0, .seed = 5},
                                                     .adam = {.learning_rate = 5e-3}});

  // 16 held-out prompts, 4 samples each, fixed seeds: the measure before and after.
  envs::ArithmeticTask task(envs::ArithmeticOptions::for_difficulty(2), /*seed=*/23);
  std::vector<std::vector<token_id>> held_out;
  for (const auto& p : task.sample(16, envs::Split::held_out)) held_out.push_back(tokenizer->encode(p.prompt));
  const SamplingParams eval{.max_tokens = 8, .temperature = 1.0, .seed = 1000};
  const ReverseKl before = measure_reverse_kl(student.live_sampling_client(), teacher, held_out, 4, eval);

  const rewards::MathAnswerReward reward;
  std::vector<DistillationStats> stats;
  for (int s = 0; s < 20; ++s) stats.push_back(distill.step(task.sample(16, envs::Split::train), reward));
  const ReverseKl after = measure_reverse_kl(student.live_sampling_client(), teacher, held_out, 4, eval);

  std::printf("held-out reverse KL per token: %.3f -> %.3f (%lld -> %lld tokens); teacher logprob %.3f -> %.3f\n",
              before.per_token, after.per_token, static_cast<long long>(before.tokens),
              static_cast<long long>(after.tokens), before.teacher_logprob, after.teacher_logprob);
  std::printf("training batch reverse KL per step:");
  for (const auto& st : stats) std::printf(" %.2f", st.reverse_kl);
  std::printf("\n");
  EXPECT_GT(before.per_token, 1.0);  // the teacher is far from the untrained student
  EXPECT_GT(before.tokens, 16 * 4);
  EXPECT_GT(after.tokens, 16 * 4);
  EXPECT_LE(after.per_token, 0.5 * before.per_token);
  EXPECT_GT(after.teacher_logprob, before.teacher_logprob);  // the teacher likes the student's samples more

  // The step statistics: what the loop did, and the same fall on the training batches.
  for (std::size_t s = 0; s < stats.size(); ++s) {
    EXPECT_EQ(stats[s].step, static_cast<std::int64_t>(s));
    EXPECT_EQ(stats[s].staleness, 0);
    EXPECT_GT(stats[s].sampled_tokens, 0);
    EXPECT_LE(stats[s].sampled_tokens, 16 * 8 * 8);  // problems x samples x max_tokens
    EXPECT_GT(stats[s].trained_tokens, stats[s].sampled_tokens);  // the prompts are read too
    EXPECT_TRUE(std::isfinite(stats[s].loss));
  }
  const auto mean_kl = [&](std::size_t from) {
    return (stats[from].reverse_kl + stats[from + 1].reverse_kl + stats[from + 2].reverse_kl) / 3;
  };
  EXPECT_LT(mean_kl(17), 0.6 * mean_kl(0));
  EXPECT_EQ(student.get_info().step, 20);  // one optimizer step per distillation step (substeps = 1)
  EXPECT_EQ(distill.state().step, 20);
  EXPECT_EQ(distill.state().batches_submitted, 20);
  fs::remove_all(temp_dir());
}

TEST(Distillation, RefusesATeacherWithAnotherTokenizerNamingBoth) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  auto student = service.create_lora_training_client("rlloop-small", {.rank = 4, .alpha = 8, .seed = 3});
  const TeacherClient base = service.create_lora_training_client("rlloop-small", {.seed = 4}).live_sampling_client();
  const auto bytes = load_tokenizer("byte");

  // A teacher reading a BPE vocabulary of its own (a tokenizer.json beside it).
  const fs::path dir = temp_dir() / "other-tokenizer";
  fs::create_directories(dir);
  const std::string path = (dir / "tokenizer.json").string();
  std::ofstream(path) << byte_level_bpe_json();
  const auto other = load_tokenizer(path);
  const NamedTeacher named{base, path};
  const std::string msg = error_of([&] { Distillation<LocalSession, NamedTeacher>(student, bytes, named, other, {}); });
  EXPECT_NE(msg.find("the student's tokenizer 'byte' (260 ids, fingerprint "), std::string::npos) << msg;
  EXPECT_NE(msg.find("the teacher's tokenizer '" + path + "' (257 ids, fingerprint "), std::string::npos) << msg;

  // The same size but two ids exchanged is another tokenizer too; a SamplingClient teacher is named by its session.
  const auto swapped = std::make_shared<SwappedBytes>();
  EXPECT_EQ(tokenizer_fingerprint(*swapped).vocab_size, tokenizer_fingerprint(*bytes).vocab_size);
  EXPECT_NE(tokenizer_fingerprint(*swapped), tokenizer_fingerprint(*bytes));
  const std::string swapped_msg =
      error_of([&] { Distillation<LocalSession, TeacherClient>(student, swapped, base, bytes, {}); });
  EXPECT_NE(swapped_msg.find("is not the teacher's tokenizer 'byte' (260 ids"), std::string::npos) << swapped_msg;

  // One tokenizer loaded twice is the same one; a bad option is named.
  EXPECT_EQ(tokenizer_fingerprint(*bytes), tokenizer_fingerprint(*load_tokenizer("byte")));
  EXPECT_NO_THROW((Distillation<LocalSession, TeacherClient>(student, bytes, base, load_tokenizer("byte"), {})));
  EXPECT_NE(error_of([&] {
              Distillation<LocalSession, TeacherClient>(student, bytes, base, bytes, {.kl_coef = -1});
            }).find("DistillationOptions::kl_coef"),
            std::string::npos);
  fs::remove_all(temp_dir());
}

// A training session's forward pass scores a batch as its live sampling client scores each input: inputs of
// different lengths (so the batch is padded) and one of a single token (nothing to predict: 0.0); an empty input
// is refused, as compute_logprobs refuses it.
TEST(Distillation, TrainingTeacherScoresABatchAsComputeLogprobsScoresEachInput) {
  ServiceClient<LocalService> service{LocalService(cpu_service())};
  auto client = service.create_lora_training_client("rlloop-small", {.rank = 4, .alpha = 8, .seed = 5});
  const auto tokenizer = load_tokenizer("byte");
  const TrainingTeacher<LocalSession> teacher(client);
  static_assert(BatchTeacher<TrainingTeacher<LocalSession>> && !BatchTeacher<TeacherClient>);
  EXPECT_EQ(teacher.tokenizer_name(), "byte");

  const std::vector<ModelInput> inputs = {ModelInput::from_tokens(tokenizer->encode("12+30=42")),
                                          ModelInput::from_tokens(tokenizer->encode("7+8=15 and more text here")),
                                          ModelInput::from_tokens({65})};
  const auto batch = teacher.compute_logprobs_batch(inputs);
  ASSERT_EQ(batch.size(), inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<double> one = teacher.compute_logprobs(inputs[i]).get();
    ASSERT_EQ(batch[i].size(), inputs[i].length()) << "input " << i;
    ASSERT_EQ(one.size(), batch[i].size()) << "input " << i;
    for (std::size_t t = 0; t < one.size(); ++t)
      EXPECT_NEAR(batch[i][t], one[t], 1e-4) << "input " << i << " token " << t;
  }
  EXPECT_EQ(batch[0][0], 0.0);
  EXPECT_LT(batch[1].back(), 0.0);  // a real logprob, not a padded zero
  EXPECT_EQ(batch[2], std::vector<double>{0.0});
  const std::vector<ModelInput> with_empty = {inputs[0], ModelInput{}};
  EXPECT_EQ(error_of([&] { teacher.compute_logprobs_batch(with_empty); }), "TrainingTeacher: input 1 is empty");

  // teacher_logprobs asks it once and slices each completion out of its scores.
  const std::vector<std::vector<token_id>> prompts = {tokenizer->encode("12+"), tokenizer->encode("7+8=")};
  const std::vector<std::vector<token_id>> completions = {tokenizer->encode("30=42"), tokenizer->encode("15")};
  const auto scored = teacher_logprobs(teacher, prompts, completions);
  ASSERT_EQ(scored.size(), 2u);
  ASSERT_EQ(scored[1].size(), 2u);
  EXPECT_NEAR(scored[1][1], teacher.compute_logprobs(ModelInput::from_tokens(tokenizer->encode("7+8=15"))).get()[5],
              1e-4);
  fs::remove_all(temp_dir());
}
