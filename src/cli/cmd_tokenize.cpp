// `rlloop tokenize`: a line-oriented bridge to the tokenizers, used by the exact-match test script.
// Encode: one JSON string per stdin line -> one JSON array of ids per stdout line. --decode: the reverse.
// --chat RENDERER: one JSON array of messages per line -> {"text", "tokens", "weights"} per line; "auto" is the
// renderer of the tokenizer's own chat template (default_chat_renderer).
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>
#include <rlloop/tokenizer.hpp>

#include "command.hpp"

namespace {

std::vector<rlloop::Message> parse_messages(const nlohmann::json& in, std::size_t line_no) {
  const auto where = "line " + std::to_string(line_no);
  if (!in.is_array()) throw rlloop::invalid_argument(where + " is not a JSON array of messages");
  std::vector<rlloop::Message> out;
  for (const auto& m : in) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw rlloop::invalid_argument(where + ": a message needs string \"role\" and \"content\": " + m.dump());
    rlloop::Message msg{m["role"].get<std::string>(), m["content"].get<std::string>(), std::nullopt};
    if (m.contains("reasoning_content") && m["reasoning_content"].is_string())
      msg.reasoning_content = m["reasoning_content"].get<std::string>();
    out.push_back(std::move(msg));
  }
  return out;
}

int run(int argc, char** argv) {
  CLI::App app{"Encode (or --decode) JSON lines on stdin with a tokenizer"};
  std::string spec;
  bool decode = false, no_special = false, skip_special = false, generation_prompt = false;
  std::string chat, train_on = "last";
  app.add_option("--tokenizer", spec,
                 "\"byte\", a tokenizer.json, a model directory, a GPT-2 encoder.json directory, a tiktoken rank file "
                 "(o200k_base.tiktoken, o200k_harmony.tiktoken, cl100k_base.tiktoken), or a .gguf file")
      ->required();
  app.add_flag("--decode", decode, "read JSON arrays of ids, write JSON strings");
  app.add_flag("--no-special", no_special, "encode special-token text as ordinary text");
  app.add_flag("--skip-special", skip_special, "leave special tokens out when decoding");
  app.add_option("--chat", chat,
                 "render conversations (JSON arrays of messages) with this chat renderer (\"auto\": the one the "
                 "tokenizer's chat template calls for)");
  app.add_flag("--generation-prompt", generation_prompt, "with --chat: render a generation prompt");
  app.add_option("--train-on", train_on, "with --chat: which assistant messages get weight 1")
      ->check(CLI::IsMember({"last", "all"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const auto tok = rlloop::load_tokenizer(spec);
  if (chat == "auto") chat = rlloop::default_chat_renderer(spec, "");
  const auto renderer = chat.empty() ? nullptr : rlloop::make_chat_renderer(chat, tok);
  std::ios::sync_with_stdio(false);
  std::string line, out;
  std::size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    nlohmann::json in;
    try {
      in = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw rlloop::invalid_argument("line " + std::to_string(line_no) + " is not JSON: " + e.what());
    }
    if (renderer) {
      const auto messages = parse_messages(in, line_no);
      nlohmann::json j;
      j["text"] = renderer->render_text(messages, generation_prompt);
      if (generation_prompt) {
        j["tokens"] = renderer->build_generation_prompt(messages).tokens();
      } else {
        const auto ex = renderer->build_supervised_example(
            messages, train_on == "all" ? rlloop::TrainOn::all_assistant : rlloop::TrainOn::last_assistant);
        j["tokens"] = ex.tokens;
        j["weights"] = ex.weights;
      }
      out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else if (decode) {
      if (!in.is_array())
        throw rlloop::invalid_argument("line " + std::to_string(line_no) + " is not a JSON array of ids");
      std::vector<rlloop::token_id> ids;
      for (const auto& v : in) {
        if (!v.is_number_integer())
          throw rlloop::invalid_argument("line " + std::to_string(line_no) + ": id " + v.dump() + " is not an integer");
        ids.push_back(v.get<rlloop::token_id>());
      }
      // Decoded bytes that are not valid UTF-8 are written with U+FFFD, as JSON strings must be Unicode.
      out =
          nlohmann::json(tok->decode(ids, skip_special)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
      if (!in.is_string()) throw rlloop::invalid_argument("line " + std::to_string(line_no) + " is not a JSON string");
      out = nlohmann::json(tok->encode(in.get_ref<const std::string&>(), !no_special)).dump();
    }
    out.push_back('\n');
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  std::fflush(stdout);
  return 0;
}

rlloop::cli::RegisterCommand reg({"tokenize", "encode JSON strings to token ids (or --decode) with a tokenizer", &run});

}  // namespace
