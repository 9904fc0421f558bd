// Chat renderer tests: supervised weights, the cross_entropy datum, generation prompts, stop settings and
// response parsing. Exact agreement of Qwen3 rendering with its Jinja template is checked by chat_match.js.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>

#include "test_support.hpp"

namespace rlloop {
namespace {
using V = std::vector<token_id>;

const std::vector<Message> kConversation = {
    {"system", "Be brief.", std::nullopt}, {"user", "2+2?", std::nullopt},   {"assistant", "4", std::nullopt},
    {"user", "3+3?", std::nullopt},        {"assistant", "6", std::nullopt},
};

// The decoded text of the weighted tokens.
std::string trained_text(const Tokenizer& tok, const SupervisedExample& ex) {
  V ids;
  for (std::size_t i = 0; i < ex.tokens.size(); ++i)
    if (ex.weights[i] > 0) ids.push_back(ex.tokens[i]);
  return tok.decode(ids);
}

TEST(Qwen3Chat, SupervisedWeightsCoverTheAssistantAnswer) {
  auto tok = test::qwen3();
  auto r = make_chat_renderer("qwen3", tok);
  const auto last = r->build_supervised_example(kConversation, TrainOn::last_assistant);
  ASSERT_EQ(last.tokens.size(), last.weights.size());
  EXPECT_EQ(tok->decode(last.tokens), r->render_text(kConversation, false));
  EXPECT_EQ(trained_text(*tok, last), "<think>\n\n</think>\n\n6<|im_end|>");
  const auto all = r->build_supervised_example(kConversation, TrainOn::all_assistant);
  EXPECT_EQ(trained_text(*tok, all), "4<|im_end|><think>\n\n</think>\n\n6<|im_end|>");
  // With thinking off the empty think block belongs to the prompt.
  auto off = make_chat_renderer("qwen3_no_thinking", tok);
  EXPECT_EQ(trained_text(*tok, off->build_supervised_example(kConversation)), "6<|im_end|>");
}

TEST(Qwen3Chat, DatumShiftsTokensAndWeights) {
  auto r = make_chat_renderer("qwen3", test::qwen3());
  const auto ex = r->build_supervised_example(kConversation);
  const Datum d = ex.to_datum();
  EXPECT_EQ(d.model_input.tokens(), V(ex.tokens.begin(), ex.tokens.end() - 1));
  const auto& target = d.loss_fn_inputs.at("target_tokens");
  ASSERT_EQ(target.int_data.size(), ex.tokens.size() - 1);
  EXPECT_EQ(target.int_data.front(), ex.tokens[1]);
  EXPECT_EQ(target.int_data.back(), ex.tokens.back());
  EXPECT_EQ(d.loss_fn_inputs.at("weights").float_data, std::vector<float>(ex.weights.begin() + 1, ex.weights.end()));
  // The final <|im_end|> is trained, the newline after it is not.
  const auto& w = d.loss_fn_inputs.at("weights").float_data;
  EXPECT_EQ(w[w.size() - 2], 1.0f);
  EXPECT_EQ(w.back(), 0.0f);
  EXPECT_THROW(SupervisedExample{}.to_datum(), invalid_argument);
}

TEST(Qwen3Chat, GenerationPromptStopsAndParsing) {
  auto tok = test::qwen3();
  auto r = make_chat_renderer("qwen3", tok);
  const std::vector<Message> prompt(kConversation.begin(), kConversation.end() - 1);
  const std::string text = tok->decode(r->build_generation_prompt(prompt).tokens());
  EXPECT_TRUE(text.ends_with("<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")) << text;
  auto off = make_chat_renderer("qwen3_no_thinking", tok);
  EXPECT_TRUE(
      tok->decode(off->build_generation_prompt(prompt).tokens()).ends_with("assistant\n<think>\n\n</think>\n\n"));
  EXPECT_EQ(r->stop_token_ids(), (V{151645, 151643}));
  const auto params = r->sampling_params({.max_tokens = 7});
  EXPECT_EQ(params.max_tokens, 7);
  EXPECT_EQ(params.stop_token_ids, (V{151645, 151643}));

  auto sampled = tok->encode("<think>\nadd them\n</think>\n\nIt is 6.<|im_end|>ignored");
  const auto parsed = r->parse_response(sampled);
  EXPECT_TRUE(parsed.complete);
  EXPECT_EQ(parsed.message.role, "assistant");
  EXPECT_EQ(parsed.message.content, "It is 6.");
  EXPECT_EQ(parsed.message.reasoning_content, "add them");
  const auto cut = r->parse_response(tok->encode("no end yet"));
  EXPECT_FALSE(cut.complete);
  EXPECT_EQ(cut.message.content, "no end yet");
}

TEST(RoleColonChat, WorksWithTheByteTokenizer) {
  auto tok = load_tokenizer("byte");
  auto r = make_chat_renderer("role_colon", tok);
  const std::vector<Message> conv = {{"user", "2+2?", std::nullopt}, {"assistant", "4", std::nullopt}};
  EXPECT_EQ(r->render_text(conv, false), "User: 2+2?\n\nAssistant: 4\n\n");
  const auto ex = r->build_supervised_example(conv);
  EXPECT_EQ(trained_text(*tok, ex), " 4\n\n");
  EXPECT_EQ(tok->decode(r->build_generation_prompt(std::span(conv).first(1)).tokens()), "User: 2+2?\n\nAssistant:");
  EXPECT_EQ(r->stop_token_ids(), V{byte_tokens::endoftext});
  const auto parsed = r->parse_response(tok->encode(" 4\n\nUser: more"));
  EXPECT_TRUE(parsed.complete);
  EXPECT_EQ(parsed.message.content, "4");
}

TEST(ChatMl, RendersAndTrainsEndToken) {
  auto tok = test::qwen3();
  auto r = make_chat_renderer("chatml", tok);
  const std::vector<Message> conv = {{"user", "hi", std::nullopt}, {"assistant", "hello", std::nullopt}};
  EXPECT_EQ(r->render_text(conv, false), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n");
  EXPECT_EQ(trained_text(*tok, r->build_supervised_example(conv)), "hello<|im_end|>");
}

namespace {
// GPT-2's vocabulary plus a format's special tokens as added tokens (ids 60000, 60001, ...): enough to check a chat
// format and its weights.
std::string gpt2_with_added_tokens(const std::vector<std::string>& added) {
  std::string j = R"({"model": {"type": "BPE", "vocab": )";
  std::ifstream enc(test::gpt2_dir() / "encoder.json");
  j += std::string(std::istreambuf_iterator<char>(enc), {});
  j += R"(, "merges": [)";
  std::ifstream bpe(test::gpt2_dir() / "vocab.bpe");
  std::string line;
  bool first = true;
  std::getline(bpe, line);  // #version
  while (std::getline(bpe, line))
    if (!line.empty()) j += (first ? "" : ",") + nlohmann::json(line).dump(), first = false;
  nlohmann::json tokens = nlohmann::json::array();
  for (std::size_t i = 0; i < added.size(); ++i) tokens.push_back({{"id", 60000 + i}, {"content", added[i]}});
  j += R"(]}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false}, "decoder": {"type": "ByteLevel"},
    "added_tokens": )" + tokens.dump() + "}";
  return j;
}
}  // namespace

TEST(Llama3Chat, UsesHeadersAndEotWithATokenizerThatHasThem) {
  test::TempDir dir;
  const std::string j = gpt2_with_added_tokens(
      {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});  // ids 60000..60003
  auto tok = load_tokenizer(dir.write("tokenizer.json", j));
  auto r = make_chat_renderer("llama3", tok);
  const std::vector<Message> conv = {{"user", "  hi \n", std::nullopt}, {"assistant", "hello", std::nullopt}};
  EXPECT_EQ(r->render_text(conv, true),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant"
            "<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(trained_text(*tok, r->build_supervised_example(conv)), "hello<|eot_id|>");
  EXPECT_EQ(r->stop_token_ids(), V{60003});
  EXPECT_EQ(r->parse_response(tok->encode("fine<|eot_id|>")).message.content, "fine");
}

// Gemma 2's template: <bos>, user and model turns with trimmed content, the answer and its <end_of_turn> trained; a
// system message and roles out of turn are refused as the template refuses them; its template is recognised.
TEST(GemmaChat, TurnsOfUserAndModelWithATokenizerThatHasThem) {
  test::TempDir dir;
  auto tok = load_tokenizer(dir.write(
      "tokenizer.json", gpt2_with_added_tokens({"<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"})));
  auto r = make_chat_renderer("gemma", tok);
  const std::vector<Message> conv = {{"user", "  hi \n", std::nullopt}, {"assistant", "hello", std::nullopt}};
  EXPECT_EQ(r->render_text(conv, true),
            "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
            "<start_of_turn>model\n");
  EXPECT_EQ(trained_text(*tok, r->build_supervised_example(conv)), "hello<end_of_turn>");
  EXPECT_EQ(r->stop_token_ids(), (V{60002, 60003}));
  EXPECT_EQ(r->parse_response(tok->encode("fine<end_of_turn>", true)).message.content, "fine");
  const std::vector<Message> with_system = {{"system", "be brief", std::nullopt}, {"user", "hi", std::nullopt}};
  EXPECT_NE(test::error_of([&] { r->render_text(with_system, true); }).find("gemma: the system role is not supported"),
            std::string::npos)
      << "as the template's raise_exception";
  const std::vector<Message> twice = {{"user", "a", std::nullopt}, {"user", "b", std::nullopt}};
  EXPECT_NE(test::error_of([&] { r->render_text(twice, true); }).find("gemma: message 1 has role 'user'"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { make_chat_renderer("gemma", load_tokenizer("byte")); }).find("<bos>"),
            std::string::npos);
}

TEST(ChatRenderers, BadInputIsNamed) {
  EXPECT_THROW(make_chat_renderer("vicuna", load_tokenizer("byte")), invalid_argument);
  EXPECT_THROW(make_chat_renderer("llama3", test::qwen3()), invalid_argument);  // no <|eot_id|>
  auto r = make_chat_renderer("chatml", test::qwen3());
  const std::vector<Message> bad_role = {{"robot", "x", std::nullopt}};
  EXPECT_THROW(r->render_text(bad_role, true), invalid_argument);
  const std::vector<Message> no_assistant = {{"user", "x", std::nullopt}};
  EXPECT_THROW(r->build_supervised_example(no_assistant), invalid_argument);
}

}  // namespace
}  // namespace rlloop
