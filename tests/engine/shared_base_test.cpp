// Many sessions on one base model: one shared copy of the base weights, one engine loop, sampling requests of
// different sessions decoded in one batch, and none of it visible in any session's results.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <atomic>
#include <chrono>
#include <thread>

#include "io/checkpoint.hpp"
#include "runtime/engine_loop.hpp"
#include "session_util.hpp"

using namespace rlloop;
using namespace test_util;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) { return test_util::temp_dir("rlloop-shared-base-test", name); }

LoraOptions lora(int rank, std::vector<std::string> targets = {"all-linear"}) {
  return LoraOptions{rank, 2 * rank, std::move(targets)};
}

// The one stats entry of a service using a single base model.
BaseModelStats only_base(const LocalService& service) {
  auto stats = service.base_model_stats();
  EXPECT_EQ(stats.size(), 1u);
  return stats.empty() ? BaseModelStats{} : stats[0];
}

// Gives the session's adapters weights of their own: one SFT step on its own text.
void train_apart(LocalSession& s, int i) {
  s.forward_backward({sft_datum("tenant " + std::to_string(i) + " says " + std::string(i + 1, 'a' + i))},
                     LossSpec{LossFn::cross_entropy})
      .get();
  s.optim_step(AdamParams{.learning_rate = 5e-2}).get();
}

// The i-th tenant's request: its own prompt, number of samples, temperature, top-p, stops and length.
SampleRequest request_of(int i) {
  SampleRequest r;
  r.prompt = ModelInput::from_tokens(bytes(std::string("q") + std::to_string(i) + std::string(i % 5, 'x') + "="));
  r.num_samples = 1 + i % 3;
  r.params.max_tokens = 6 + (i * 7) % 23;
  r.params.temperature = i % 4 == 0 ? 0.0 : 0.6 + 0.1 * (i % 14);  // within limits::temperature_max
  r.params.top_p = i % 3 == 1 ? 0.9 : 1.0;
  r.params.top_k = i % 5 == 2 ? 20 : -1;
  r.params.seed = 1000 + i;
  if (i % 4 == 3) r.params.stop_token_ids = {'a' + i % 3, 'e'};
  if (i % 6 == 5) r.params.stop = {"xa"};
  r.include_prompt_logprobs = i % 7 == 1;
  return r;
}

// How far a logprob may move with the rows beside it: the last digits on the CPU (both decoding steps), the dtype's
// tolerance on CUDA, where cuBLAS may choose another algorithm for another number of rows.
double batch_tolerance() { return test_device::on_cuda() ? lp_tol() : 1e-5; }

void expect_same_samples(const SampleResponse& alone, const SampleResponse& batched, const std::string& what) {
  ASSERT_EQ(alone.sequences.size(), batched.sequences.size()) << what;
  for (std::size_t s = 0; s < alone.sequences.size(); ++s) {
    const auto &a = alone.sequences[s], &b = batched.sequences[s];
    EXPECT_EQ(a.tokens, b.tokens) << what << ", sample " << s;
    EXPECT_EQ(a.stop_reason, b.stop_reason) << what << ", sample " << s;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << what;
    for (std::size_t t = 0; t < a.logprobs.size(); ++t)
      EXPECT_NEAR(a.logprobs[t], b.logprobs[t], batch_tolerance()) << what << ", sample " << s << ", token " << t;
  }
  EXPECT_EQ(alone.prompt_logprobs, batched.prompt_logprobs) << what;
}

}  // namespace

TEST(SharedBase, LoraSessionsShareOneBaseAndFullFineTuningKeepsItsOwn) {
  auto dir = temp_dir("structure");
  LocalService service(service_in(dir.string()));
  auto a = service.create_session(tiny(lora(8), 1));
  auto b = service.create_session(tiny(lora(4, {"q_proj", "v_proj"}), 2));
  auto full = service.create_session(tiny(std::nullopt, 3));
  BaseModelStats s = only_base(service);
  EXPECT_EQ(s.sessions, 3);
  EXPECT_EQ(s.shared_weight_users, 2);  // the two LoRA sessions; the full fine-tuning one has its own copy
  EXPECT_NE(s.base.find("builtin:rlloop-tiny"), std::string::npos) << s.base;

  // Every session counts every weight it computes with; only LoRA sessions count just their adapters as theirs.
  const SessionInfo ia = a->info(), ifull = full->info();
  EXPECT_EQ(ia.num_parameters - ia.num_trainable_parameters, ifull.num_parameters);

  // A sampler model opened from a LoRA checkpoint reads the shared base too (its session is a fourth user).
  auto ref = a->save_weights_for_sampler("a-sampler").get();
  auto sampler = service.open_sampler(ref.path);
  s = only_base(service);
  EXPECT_EQ(s.sessions, 4);
  EXPECT_EQ(s.shared_weight_users, 3);

  sampler.reset();
  b.reset();
  s = only_base(service);
  EXPECT_EQ(s.sessions, 2);
  EXPECT_EQ(s.shared_weight_users, 1);
  a.reset();
  full.reset();
  EXPECT_TRUE(service.base_model_stats().empty()) << "the base and its loop are freed with their last session";
}

TEST(SharedBase, LoraSamplerCheckpointsHoldAdaptersOnlyAndNameTheirBase) {
  auto dir = temp_dir("adapters");
  LocalService service(service_in(dir.string()));
  auto a = service.create_session(tiny(lora(2, {"q_proj"}), 1));
  auto full = service.create_session(tiny(std::nullopt, 1));
  train_apart(*a, 0);
  // The checkpoint holds the adapters and nothing of the base; its metadata names the base it needs.
  auto ref = a->save_weights_for_sampler("adapters-only").get();
  const engine::StateContents state = engine::read_state_dir(ref.path, false);
  std::int64_t saved = 0;
  for (const auto& [name, t] : state.weights) {
    EXPECT_NE(name.find(".lora_"), std::string::npos) << name;
    saved += t.numel();
  }
  EXPECT_EQ(saved, a->info().num_trainable_parameters);
  EXPECT_EQ(state.meta.base_model, "rlloop-tiny");
  // A full fine-tuning session's checkpoint holds every base weight.
  const engine::StateContents whole = engine::read_state_dir(full->save_weights_for_sampler("full").get().path, false);
  EXPECT_EQ(whole.weights.count("model.embed_tokens.weight"), 1u);

  // Loaded against another base it is refused by name, before any shape is compared.
  SessionOptions other = tiny(lora(8), 1);
  other.base_model = "rlloop-small";
  auto on_small = service.create_session(other);
  const std::string err = error_of([&] { on_small->load_state(ref.path, false).get(); });
  EXPECT_NE(err.find("was trained on base model 'rlloop-tiny'"), std::string::npos) << err;
  EXPECT_NE(err.find("'rlloop-small'"), std::string::npos) << err;
  EXPECT_EQ(service.base_model_stats().size(), 2u);
}

// A request's tokens and logprobs are the same whether it runs alone or beside 15 other sessions' requests with
// other adapters, ranks, temperatures, top-p, stops and lengths.
void check_batch_invariance(int threads) {
  auto dir = temp_dir("invariance-" + std::to_string(threads));
  LocalServiceOptions options = service_in(dir.string());
  configure_engine_process({.num_threads = threads});  // read by the engine loop's thread when it starts
  LocalService service(options);
  constexpr int kSessions = 16;
  std::vector<std::shared_ptr<LocalSession>> sessions;
  for (int i = 0; i < kSessions; ++i) {
    const int rank = 2 << (i % 4);  // 2, 4, 8, 16
    sessions.push_back(
        service.create_session(tiny(i % 5 == 4 ? lora(rank, {"q_proj", "down_proj", "lm_head"}) : lora(rank), 10 + i)));
    train_apart(*sessions.back(), i);
  }
  std::vector<SampleResponse> alone;
  for (int i = 0; i < kSessions; ++i) alone.push_back(sessions[i]->sample(request_of(i)).get());
  EXPECT_EQ(only_base(service).peak_batch_requests, 1);

  LoopGate gate(*sessions[0]);
  std::vector<Future<SampleResponse>> together;
  for (int i = 0; i < kSessions; ++i) together.push_back(sessions[i]->sample(request_of(i)));
  gate.release();
  for (int i = 0; i < kSessions; ++i)
    expect_same_samples(alone[i], together[i].get(),
                        "session " + std::to_string(i) + " with " + std::to_string(threads) + " thread(s)");
  const BaseModelStats s = only_base(service);
  EXPECT_EQ(s.peak_batch_requests, kSessions) << "every request decoded in the same steps";
  EXPECT_GT(s.peak_batch_rows, kSessions);
}

TEST(SharedBase, SamplesDoNotDependOnWhatTheyAreBatchedWith) { check_batch_invariance(1); }
TEST(SharedBase, SamplesDoNotDependOnWhatTheyAreBatchedWithOnTwoThreads) { check_batch_invariance(2); }

// One session's own sampling requests, in flight together, decode in the same steps and give what each gives
// alone; the operation queued after them waits for them, and a request queued after that sees its effect.
TEST(SharedBase, OneSessionsSamplingRequestsDecodeTogetherAndTheStepAfterThemWaits) {
  LocalService service(service_in(temp_dir("own-requests").string()));
  auto session = service.create_session(tiny(lora(8), 3));
  train_apart(*session, 0);
  constexpr int kRequests = 6;
  std::vector<SampleResponse> alone;
  for (int i = 0; i < kRequests; ++i) alone.push_back(session->sample(request_of(i)).get());
  EXPECT_EQ(only_base(service).peak_batch_requests, 1);

  LoopGate gate(*session);
  std::vector<Future<SampleResponse>> together;
  for (int i = 0; i < kRequests; ++i) together.push_back(session->sample(request_of(i)));
  auto pass = session->forward_backward({sft_datum("after the samples")}, LossSpec{LossFn::cross_entropy});
  auto step = session->optim_step(AdamParams{.learning_rate = 5e-2});
  auto after_step = session->sample(request_of(0));
  gate.release();
  for (int i = 0; i < kRequests; ++i)
    expect_same_samples(alone[i], together[i].get(), "request " + std::to_string(i) + " beside the others");
  pass.get();
  step.get();
  const SampleResponse changed = after_step.get();
  double moved = 0;
  for (std::size_t t = 0; t < changed.sequences[0].logprobs.size() && t < alone[0].sequences[0].logprobs.size(); ++t)
    moved = std::max(moved, std::abs(changed.sequences[0].logprobs[t] - alone[0].sequences[0].logprobs[t]));
  EXPECT_GT(moved, 1e-3) << "the request after the optimizer step samples from the stepped adapters";
  EXPECT_EQ(only_base(service).peak_batch_requests, kRequests) << "the requests before the step, and only they";
}

// Training on the shared loop gives, bit for bit, what a session of its own gives, in each session's order.
TEST(SharedBase, TrainingResultsEqualAnUnsharedSession) {
  auto dir = temp_dir("training");
  LocalServiceOptions options = service_in(dir.string());
  LocalService service(options);
  std::vector<std::shared_ptr<LocalSession>> shared;
  for (int i = 0; i < 3; ++i) shared.push_back(service.create_session(tiny(lora(8), 20 + i)));
  auto full_shared = service.create_session(tiny(std::nullopt, 30));

  auto run = [](LocalSession& s, int i) {
    std::vector<Future<ForwardBackwardOutput>> fb;
    std::vector<Future<OptimStepOutput>> steps;
    for (int step = 0; step < 3; ++step) {
      fb.push_back(s.forward_backward({sft_datum("step " + std::to_string(step) + " of " + std::to_string(i))},
                                      LossSpec{LossFn::cross_entropy}));
      steps.push_back(s.optim_step(AdamParams{.learning_rate = 1e-2}));
    }
    std::vector<double> losses;
    for (auto& f : fb) losses.push_back(f.get().metrics.at("loss:sum"));
    for (auto& f : steps) f.get();
    SampleRequest r;
    r.prompt = ModelInput::from_tokens(bytes("after="));
    r.num_samples = 2;
    r.params.max_tokens = 12;
    r.params.seed = 7;
    return std::make_pair(losses, s.sample(r).get());
  };
  // Submitted from several threads at once, interleaving on the one loop.
  std::vector<std::future<std::pair<std::vector<double>, SampleResponse>>> concurrent;
  for (int i = 0; i < 3; ++i)
    concurrent.push_back(std::async(std::launch::async, [&, i] { return run(*shared[i], i); }));
  auto full_result = std::async(std::launch::async, [&] { return run(*full_shared, 3); });

  for (int i = 0; i < 4; ++i) {
    LocalSession own(i < 3 ? tiny(lora(8), 20 + i) : tiny(std::nullopt, 30), options);
    auto expected = run(own, i);
    auto got = i < 3 ? concurrent[i].get() : full_result.get();
    EXPECT_EQ(expected.first, got.first) << "session " << i << ": losses";
    // The final samples of the four sessions decode together: equal as batching keeps them (tokens, 1e-5).
    expect_same_samples(expected.second, got.second, "session " + std::to_string(i));
  }
}

TEST(SharedBase, OneTenantsUpdateFailureOrBadInputNeverShowsInAnothers) {
  auto dir = temp_dir("isolation");
  LocalService service(service_in(dir.string()));
  auto a = service.create_session(tiny(lora(8), 1));
  auto b = service.create_session(tiny(lora(8), 2));
  train_apart(*b, 1);
  const SampleRequest rb = request_of(2);
  const SampleResponse before = b->sample(rb).get();
  const auto logprobs_before = b->compute_logprobs({ModelInput::from_tokens(bytes("isolated")), {}}).get();

  // A's training steps change A's adapters only.
  for (int i = 0; i < 3; ++i) train_apart(*a, i);
  const SampleResponse after = b->sample(rb).get();
  expect_same_samples(before, after, "B after A's optimizer steps");
  EXPECT_EQ(logprobs_before, b->compute_logprobs({ModelInput::from_tokens(bytes("isolated")), {}}).get());

  // A's bad requests, batched with B's, fail alone with their own message.
  SampleRequest bad_top_p = request_of(3);
  bad_top_p.params.top_p = 0;
  SampleRequest bad_token = request_of(4);
  bad_token.prompt = ModelInput::from_tokens({1, 2, 100000});
  LoopGate gate(*a);
  auto f1 = a->sample(bad_top_p);
  auto f2 = b->sample(rb);
  auto f3 = a->sample(bad_token);
  auto f4 = b->sample(rb);
  gate.release();
  EXPECT_NE(error_of([&] { f1.get(); }).find("top_p"), std::string::npos);
  EXPECT_NE(error_of([&] { f3.get(); }).find("100000"), std::string::npos);
  expect_same_samples(before, f2.get(), "B beside A's bad top_p");
  expect_same_samples(before, f4.get(), "B beside A's bad token");
  // And A keeps working.
  EXPECT_EQ(a->sample(request_of(5)).get().sequences.size(), 3u);

  // Billing is per session: B is billed for B's four requests, whatever ran beside them.
  std::int64_t sampled = 0, prefilled = 0;
  for (const SampleResponse* r : {&before, &after, &f2.get(), &f4.get()}) {
    for (const auto& s : r->sequences) sampled += s.decode_tokens;
    prefilled += static_cast<std::int64_t>(rb.prompt.length());
  }
  prefilled += 2 * static_cast<std::int64_t>(bytes("isolated").size());  // the two compute_logprobs calls
  EXPECT_EQ(b->usage().sample, sampled);
  EXPECT_EQ(b->usage().prefill, prefilled);
}

TEST(SharedBase, TheRowBudgetIsKeptAndNoRequestStarves) {
  auto dir = temp_dir("budget");
  LocalServiceOptions options = service_in(dir.string());
  options.max_batch_rows = 4;
  LocalService service(options);
  std::vector<std::shared_ptr<LocalSession>> sessions;
  for (int i = 0; i < 6; ++i) sessions.push_back(service.create_session(tiny(lora(4), i)));
  SampleRequest two;
  two.prompt = ModelInput::from_tokens(bytes("go="));
  two.num_samples = 2;
  two.params.max_tokens = 10;
  two.params.seed = 3;
  SampleRequest big = two;
  big.num_samples = 7;  // more than the whole budget: runs alone

  LoopGate gate(*sessions[0]);
  std::vector<Future<SampleResponse>> futures;
  for (int round = 0; round < 3; ++round)
    for (int i = 0; i < 6; ++i) futures.push_back(sessions[i]->sample(i == 2 && round == 1 ? big : two));
  gate.release();
  for (std::size_t k = 0; k < futures.size(); ++k)
    EXPECT_EQ(futures[k].get().sequences.size(), k == 8 ? 7u : 2u) << "request " << k;
  const BaseModelStats s = only_base(service);
  EXPECT_EQ(s.peak_batch_rows, 7) << "the budget of 4 rows, exceeded only by the request that ran alone";
  EXPECT_EQ(s.peak_batch_requests, 2);
}

// The KV budget (kv_cache_mb): each request counts at the most its samples can take. rlloop-tiny's fp32 blocks are
// 4 KiB (2 layers x keys and values x 16 positions x 2 KV heads x 8 values x 4 bytes; bf16's 2 KiB); 3 samples of up
// to 1,000 tokens after a 3-token prompt may fill 1,002 positions each, 63 blocks: 189 blocks, 756 KiB a request in
// fp32. With 2 MiB (bf16: 1 MiB) two requests decode at once (6 of the 64 rows), the third waits.
TEST(SharedBase, TheKvBudgetIsKeptAndNoRequestStarves) {
  auto dir = temp_dir("kv-budget");
  LocalServiceOptions options = service_in(dir.string());
  const std::int64_t value_bytes = test_device::dtype() == "bf16" ? 2 : 4;
  options.kv_cache_mb = value_bytes / 2;
  LocalService service(options);
  std::vector<std::shared_ptr<LocalSession>> sessions;
  for (int i = 0; i < 4; ++i) sessions.push_back(service.create_session(tiny(lora(4), i)));
  SampleRequest request;
  request.prompt = ModelInput::from_tokens(bytes("go="));
  request.num_samples = 3;
  request.params.max_tokens = 1000;
  request.params.seed = 5;

  LoopGate gate(*sessions[0]);
  std::vector<Future<SampleResponse>> futures;
  for (int round = 0; round < 2; ++round)
    for (auto& session : sessions) futures.push_back(session->sample(request));
  gate.release();
  for (auto& f : futures) EXPECT_EQ(f.get().sequences.size(), 3u);
  // A result arrives before the loop has counted its request out; an operation after it runs after that.
  sessions[0]->compute_logprobs({ModelInput::from_tokens(bytes("x=")), {}}).get();
  const BaseModelStats s = only_base(service);
  const std::int64_t per_request = 189 * 1024 * value_bytes;
  EXPECT_EQ(s.peak_kv_reserved_bytes, 2 * per_request);
  EXPECT_EQ(s.peak_batch_requests, 2) << "the KV budget, not the rows (64), bounds the batch";
  EXPECT_EQ(s.kv_reserved_bytes, 0) << "every finished request gave its reservation back";
}

// Prompts prefilled three tokens per step (prefill_chunk_tokens 3: every prompt over several steps, beside the
// others' chunks and decoding rows) give the samples that each gives alone in a service whose steps take a prompt
// whole; a stream sees its first token when the prompt is done and one more per step after it.
TEST(SharedBase, PromptsPrefilledInSmallChunksSampleWhatEachSamplesAlone) {
  // Token for token only in fp32: bf16 rounds a prompt's keys and values computed three rows at a time differently
  // from the whole prompt's, and one moved logit moves a sampled token and everything after it. (The GPU bundle's
  // prefill stage compares bf16 chunked and whole greedy sequences with a bound: docs/gpu_check.md.)
  if (test_device::dtype() != "fp32") GTEST_SKIP() << "compares chunked and whole prefill token for token (fp32)";
  constexpr int kSessions = 6;
  auto open = [&](const std::string& name, std::int64_t chunk) {
    LocalServiceOptions options = service_in(temp_dir(name).string());
    options.prefill_chunk_tokens = chunk;
    auto service = std::make_unique<LocalService>(options);
    std::vector<std::shared_ptr<LocalSession>> sessions;
    for (int i = 0; i < kSessions; ++i) {
      sessions.push_back(service->create_session(tiny(lora(4), 20 + i)));
      train_apart(*sessions.back(), i);
    }
    return std::pair{std::move(service), sessions};
  };
  auto [whole_service, whole] = open("chunks-whole", 512);
  std::vector<SampleResponse> alone;
  for (int i = 0; i < kSessions; ++i) {
    SampleRequest r = request_of(i);
    r.include_prompt_logprobs = false;  // a request asking for them prefills whole, at admission
    alone.push_back(whole[i]->sample(r).get());
  }
  auto [chunked_service, chunked] = open("chunks-three", 3);
  std::vector<std::size_t> streamed;  // session 1's first sample's token count at each call
  LoopGate gate(*chunked[0]);
  std::vector<Future<SampleResponse>> together;
  for (int i = 0; i < kSessions; ++i) {
    SampleRequest r = request_of(i);
    r.include_prompt_logprobs = false;
    if (i == 1)
      together.push_back(chunked[i]->sample(r, [&](const SampleResponse& so_far) {
        streamed.push_back(so_far.sequences[0].tokens.size());
      }));
    else
      together.push_back(chunked[i]->sample(r));
  }
  gate.release();
  for (int i = 0; i < kSessions; ++i)
    expect_same_samples(alone[i], together[i].get(), "session " + std::to_string(i));
  ASSERT_FALSE(streamed.empty());
  EXPECT_EQ(streamed.front(), 1u) << "the first call comes with the first token";
  for (std::size_t c = 1; c < streamed.size(); ++c) EXPECT_LE(streamed[c] - streamed[c - 1], 1u) << "call " << c;
  EXPECT_EQ(streamed.back(), alone[1].sequences[0].tokens.size());
  EXPECT_EQ(only_base(*chunked_service).peak_batch_requests, kSessions);
}

TEST(SharedBase, ABadBudgetIsAClearError) {
  LocalServiceOptions options = service_in(temp_dir("bad-budget").string());
  options.max_batch_rows = 0;
  EXPECT_NE(error_of([&] { LocalService service(options); }).find("max_batch_rows must be at least 1, got 0"),
            std::string::npos);
  options.max_batch_rows = 4;
  options.kv_cache_mb = -1;
  EXPECT_NE(error_of([&] { LocalService service(options); }).find("kv_cache_mb must not be negative, got -1"),
            std::string::npos);
  options.kv_cache_mb = 16;
  options.prefill_chunk_tokens = 0;
  EXPECT_NE(error_of([&] { LocalService service(options); }).find("prefill_chunk_tokens must be at least 1, got 0"),
            std::string::npos);
}

// An operation that finishes elsewhere (data parallelism: another rank's samples) holds its own lane until it is
// ready, and only its lane: the loop runs the other lanes' operations meanwhile.
TEST(EngineLoop, ADeferredOperationHoldsItsLaneNotTheLoop) {
  auto loop = std::make_shared<engine::EngineLoop>();
  auto waiting = engine::EngineLoop::open_lane(loop);
  auto other = engine::EngineLoop::open_lane(loop);
  std::atomic<bool> arrived{false};
  std::atomic<int> polls{0};
  auto deferred = waiting->submit_deferred<int>([&] {
    return engine::EngineLoop::Deferred<int>{[&] {
                                               ++polls;
                                               return arrived.load();
                                             },
                                             [] { return 42; }};
  });
  auto next_on_lane = waiting->submit<int>([] { return 7; });
  // The other lane's operation runs while the deferred one waits.
  EXPECT_EQ(other->submit<int>([] { return 1; }).get(), 1);
  EXPECT_FALSE(deferred.is_ready());
  EXPECT_FALSE(next_on_lane.wait_for(std::chrono::milliseconds(50)));  // its own lane waits, in order
  EXPECT_GT(polls.load(), 0);
  arrived = true;
  EXPECT_EQ(deferred.get(), 42);
  EXPECT_EQ(next_on_lane.get(), 7);
  // An error starting it is its future's, and the lane goes on.
  auto failed = waiting->submit_deferred<int>(
      []() -> engine::EngineLoop::Deferred<int> { throw invalid_argument("no such rank"); });
  EXPECT_EQ(error_of([&] { failed.get(); }), "no such rank");
  EXPECT_EQ(waiting->submit<int>([] { return 3; }).get(), 3);
}
