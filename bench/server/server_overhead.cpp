// A GRPO-like step (16 prompts x 8 samples of 10 tokens, forward_backward on the 128 sequences, optim_step) on
// rlloop-small, timed on a LocalSession and through rlloop-server on loopback (RemoteSession -> HTTP -> server ->
// LocalSession), alternating steps so both see the same machine load. Prints per-step medians and the ratio.
// Usage: bench_server_overhead [steps=5] [threads=0 (LibTorch threads; 0 = all cores)] [poll_max_ms] [long_poll_s]
// (the last two default to RemoteOptions': 20 ms, 10 s; long_poll_s 0 = plain polling)
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <rlloop/local.hpp>
#include <rlloop/remote.hpp>

#include "server/server.hpp"

using namespace rlloop;
using clk = std::chrono::steady_clock;

namespace {

constexpr int kPrompts = 16, kSamples = 8, kTokens = 10;

template <class S>
double grpo_step(S& s, int step) {
  const auto t0 = clk::now();
  std::vector<Future<SampleResponse>> futures;
  std::vector<std::vector<token_id>> prompts;
  for (int p = 0; p < kPrompts; ++p) {
    const std::string text = "prompt " + std::to_string(p) + ": 2+" + std::to_string(p) + "=";
    prompts.emplace_back(text.begin(), text.end());
    SampleRequest r{ModelInput::from_tokens(prompts.back()), kSamples,
                    SamplingParams{.max_tokens = kTokens, .seed = step * 100 + p}};
    futures.push_back(s.sample(r));
  }
  std::vector<Datum> batch;
  for (int p = 0; p < kPrompts; ++p) {
    const SampleResponse out = futures[p].get();
    for (std::size_t k = 0; k < out.sequences.size(); ++k) {
      std::vector<token_id> all = prompts[p];
      all.insert(all.end(), out.sequences[k].tokens.begin(), out.sequences[k].tokens.end());
      if (all.size() < 2) continue;
      Datum d;
      d.model_input = ModelInput::from_tokens({all.begin(), all.end() - 1});
      d.loss_fn_inputs["target_tokens"] = TensorData::from_tokens(std::vector<token_id>(all.begin() + 1, all.end()));
      // Advantage-weighted completion tokens (prompt tokens weigh 0), as a GRPO policy loss would.
      std::vector<float> w(all.size() - 1, 0.0f);
      const float adv = (k % 2 == 0 ? 1.0f : -1.0f) / kSamples;
      for (std::size_t i = prompts[p].size() - 1; i < w.size(); ++i) w[i] = adv;
      d.loss_fn_inputs["weights"] = TensorData::from_floats(w);
      batch.push_back(std::move(d));
    }
  }
  auto fb = s.forward_backward(batch, LossSpec::cross_entropy());
  auto st = s.optim_step(AdamParams{.learning_rate = 1e-4});
  fb.get();
  st.get();
  return std::chrono::duration<double, std::milli>(clk::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 0;
  const auto dir = std::filesystem::temp_directory_path() / ("rlloop-bench-server-" + std::to_string(::getpid()));
  configure_engine_process({.num_threads = threads});  // for the served sessions and the local ones alike
  LocalServiceOptions lo;
  lo.device = "cpu";
  lo.checkpoint_dir = (dir / "local").string();
  LocalServiceOptions so = lo;
  so.checkpoint_dir = (dir / "served").string();

  server::Options opts;
  opts.tenants = {server::Tenant{"bench", "111122223333", {}, {"bench-key"}, 4, 1 << 26}};
  opts.log = [](const std::string&) {};
  server::Server srv(opts, server::make_backend(std::make_shared<LocalService>(so)));
  srv.start();
  RemoteOptions ro;
  ro.endpoint = "http://127.0.0.1:" + std::to_string(srv.port());
  ro.bearer_key = "bench-key";
  if (argc > 3) ro.poll_max = std::chrono::milliseconds(std::atoi(argv[3]));
  if (argc > 4) ro.long_poll = std::chrono::seconds(std::atoi(argv[4]));

  SessionOptions session{"rlloop-small", LoraOptions{8, 16, {"all-linear"}}, 0, "bench"};
  LocalService local_service(lo);
  auto local = local_service.create_session(session);
  RemoteService remote_service(ro);
  auto remote = remote_service.create_session(session);

  grpo_step(*local, 0);  // warm-up (allocations, thread pools, connections)
  grpo_step(*remote, 0);
  std::vector<double> lt, rt;
  for (int i = 1; i <= steps; ++i) {
    lt.push_back(grpo_step(*local, i));
    rt.push_back(grpo_step(*remote, i));
    std::printf("step %d: local %.1f ms, server %.1f ms\n", i, lt.back(), rt.back());
  }
  const double l = median(lt), r = median(rt);
  std::printf(
      "GRPO-like step on rlloop-small (%d prompts x %d samples x %d tokens + forward_backward + optim_step), median of "
      "%d:\n",
      kPrompts, kSamples, kTokens, steps);
  std::printf(
      "  local  %.1f ms\n  server %.1f ms\n  ratio  %.3fx (target <= 1.15x; LibTorch threads %d, poll_max %lld ms, "
      "long_poll %lld s)\n",
      l, r, r / l, threads, static_cast<long long>(ro.poll_max.count()), static_cast<long long>(ro.long_poll.count()));
  remote->stop();
  srv.stop();
  std::filesystem::remove_all(dir);
  return 0;
}
