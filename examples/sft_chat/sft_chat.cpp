// Supervised fine-tuning on a small chat set: conversations rendered with the "role_colon" format
// ("User: ...\n\nAssistant: ...") and the byte tokenizer, trained on the assistant turns only (the renderer's
// weights are 0 on user text). The per-token loss drops, and greedy replies to the training questions show
// what the model memorised.
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <rlloop/algorithms/sft.hpp>
#include <rlloop/chat.hpp>
#include <rlloop/local.hpp>
#include <rlloop/rlloop.hpp>

using namespace rlloop;

namespace {

// A small self-written chat set: two-turn conversations, so the second assistant turn depends on the first.
std::vector<std::vector<Message>> chat_set() {
  const std::vector<std::pair<std::string, std::string>> qa{
      {"What is the capital of France?", "Paris."},
      {"What is the capital of Japan?", "Tokyo."},
      {"What is the capital of Italy?", "Rome."},
      {"What colour is the sky?", "Blue, on a clear day."},
      {"What colour is grass?", "Green."},
      {"How many legs does a cat have?", "Four."},
      {"How many legs does a bird have?", "Two."},
      {"What is 2+2?", "4."},
      {"What is 3+5?", "8."},
      {"Say hello.", "Hello!"},
      {"Name a fruit.", "An apple."},
      {"What do bees make?", "Honey."},
  };
  std::vector<std::vector<Message>> out;
  for (const auto& [q, a] : qa) {
    out.push_back({{"user", q, {}}, {"assistant", a, {}}});
    out.push_back(
        {{"user", q, {}}, {"assistant", a, {}}, {"user", "Thanks!", {}}, {"assistant", "You are welcome.", {}}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "rlloop-small";
  int steps = 300, batch = 8;
  double lr = 2e-3;
  std::int64_t seed = 1;
  CLI::App app{"SFT on a small chat set with the role_colon renderer (CPU)."};
  app.add_option("--model", model, "base model (byte tokenizer): rlloop-tiny, rlloop-small or a model directory");
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--batch", batch, "conversations per step");
  app.add_option("--lr", lr, "learning rate");
  app.add_option("--seed", seed, "seed for the model and batch order");
  CLI11_PARSE(app, argc, argv);
  const auto t0 = std::chrono::steady_clock::now();

  configure_engine_process();  // this process: every core, the caching CPU allocator
  LocalServiceOptions svc;
  svc.checkpoint_dir = "runs/sft_chat/checkpoints";
  ServiceClient<LocalService> service{LocalService(svc)};
  auto client = service.create_full_training_client(model, seed);
  auto tok = load_tokenizer(client);
  auto renderer = make_chat_renderer("role_colon", tok);
  const auto chats = chat_set();

  std::vector<Datum> data;
  for (const auto& c : chats) data.push_back(renderer->build_supervised_example(c, TrainOn::all_assistant).to_datum());
  std::printf("rlloop sft_chat: %s, %zu conversations; first one as the model sees it:\n%s\n", model.c_str(),
              chats.size(), renderer->render_text(chats[1], false).c_str());

  algorithms::Sft<LocalSession> sft(client, {.adam = {.learning_rate = lr, .beta2 = 0.99}});
  std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
  for (int s = 1; s <= steps; ++s) {
    std::vector<Datum> b;
    for (int i = 0; i < batch; ++i) b.push_back(data[rng() % data.size()]);
    const auto st = sft.step(b);
    if (s == 1 || s % 50 == 0)
      std::printf("step %4d  loss per assistant token %.4f  (%.0f tokens)\n", s, st.loss_per_token, st.weight);
  }

  // Greedy replies, stopping where the next user turn would start.
  const auto params = renderer->sampling_params({.max_tokens = 40, .temperature = 0.0});
  auto sampler = client.live_sampling_client();
  int exact = 0;
  for (std::size_t i = 0; i < chats.size(); i += 2) {
    const std::vector<Message> prompt{chats[i][0]};
    const auto seq = sampler.sample(renderer->build_generation_prompt(prompt), 1, params).get().sequences[0];
    auto reply = renderer->parse_response(seq.tokens).message.content;
    // The turn's trailing blank line is trained but what follows it is not, so a reply can run on in newlines
    // until max_tokens: trim them.
    reply.erase(reply.find_last_not_of(" \n") + 1);
    exact += reply == chats[i][1].content ? 1 : 0;
    if (i < 8) std::printf("  User: %-34s Assistant: %s\n", prompt[0].content.c_str(), reply.c_str());
  }
  std::printf("exact replies: %d / %zu\ntime: %.0f s\n", exact, chats.size() / 2,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
