// The tokenizer in a GGUF file's metadata, on files built byte by byte: ids (digits split first under "smollm",
// control and user-defined tokens, a byte without a token), the same ids from the equivalent tokenizer.json, the
// chat renderer a template calls for, and each malformed or unsupported file named in its error.
// scripts/tokenizer/gguf_match.js holds the real SmolLM2 file to llama.cpp's own tokenizer.
#include <cstdint>
#include <string>
#include <vector>

#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>

#include "test_support.hpp"

namespace rlloop {
namespace {

using V = std::vector<token_id>;

using test::error_of;

// Byte b in GPT-2's byte-level alphabet (printable bytes stand for themselves, the rest for 256 + their rank).
std::string byte_level(int b) {
  char32_t cp = static_cast<char32_t>(b);
  const auto printable = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE; };
  if (!printable(b)) {
    cp = 256;
    for (int c = 0; c < b; ++c) cp += printable(c) ? 0 : 1;
  }
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

// GGUF metadata, little-endian; no tensors.
struct Metadata {
  std::string body;
  std::uint64_t count = 0;
  template <class T>
  void put(T v) {
    body.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void str(const std::string& s) {
    put<std::uint64_t>(s.size());
    body += s;
  }
  void key(const std::string& k, std::uint32_t type) {
    str(k);
    put(type);
    ++count;
  }
  void string(const std::string& k, const std::string& v) {
    key(k, 8);
    str(v);
  }
  void u32(const std::string& k, std::uint32_t v) {
    key(k, 4);
    put(v);
  }
  void strings(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    put<std::uint32_t>(8);
    put<std::uint64_t>(v.size());
    for (const auto& s : v) str(s);
  }
  void int32s(const std::string& k, const std::vector<std::int32_t>& v) {
    key(k, 9);
    put<std::uint32_t>(5);
    put<std::uint64_t>(v.size());
    for (auto x : v) put(x);
  }
  std::string file() const {
    Metadata h;
    h.put<std::uint32_t>(0x46554747);
    h.put<std::uint32_t>(3);
    h.put<std::uint64_t>(0);
    h.put<std::uint64_t>(count);
    return h.body + body;
  }
};

// Byte tokens 0..255 (byte 4 left out, as SmolLM2 leaves it out) then "Ġt" (merge "Ġ t"), the control token
// <|im_end|> and the user-defined <tool>.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<std::int32_t> types;
  token_id id(const std::string& t) const {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == t) return static_cast<token_id>(i);
    ADD_FAILURE() << "no token " << t;
    return -1;
  }
};
Vocab tiny_vocab() {
  Vocab v;
  for (int b = 0; b < 256; ++b)
    if (b != 4) {
      v.tokens.push_back(byte_level(b));
      v.types.push_back(1);
    }
  for (auto [t, type] : {std::pair{byte_level(' ') + "t", 1}, {"<|im_end|>", 3}, {"<tool>", 4}}) {
    v.tokens.push_back(t);
    v.types.push_back(type);
  }
  return v;
}

// The vocabulary's BPE tokens (its two added ones left out) as tokenizer.json's "vocab" object.
std::string vocab_json(const Vocab& v) {
  std::string vocab = "{";
  for (std::size_t i = 0; i + 2 < v.tokens.size(); ++i) {
    const std::string& t = v.tokens[i];
    vocab += (i ? ", \"" : "\"") + (t == "\"" ? "\\\"" : t == "\\" ? "\\\\" : t) + "\": " + std::to_string(i);
  }
  return vocab + "}";
}

struct GgufTokenizer {
  std::string model = "gpt2", pre = "smollm", chat_template;
  bool with_types = true;
  std::uint32_t eos = 0;  // 0: the control token
  std::string write(const test::TempDir& dir, const std::string& name) const {
    const Vocab v = tiny_vocab();
    Metadata m;
    m.string("general.architecture", "llama");
    m.string("tokenizer.ggml.model", model);
    m.string("tokenizer.ggml.pre", pre);
    m.strings("tokenizer.ggml.tokens", v.tokens);
    if (with_types) m.int32s("tokenizer.ggml.token_type", v.types);
    m.strings("tokenizer.ggml.merges", {byte_level(' ') + " t"});
    m.u32("tokenizer.ggml.eos_token_id", eos ? eos : static_cast<std::uint32_t>(v.id("<|im_end|>")));
    if (!chat_template.empty()) m.string("tokenizer.chat_template", chat_template);
    return dir.write(name, m.file());
  }
};

TEST(GgufTokenizer, SplitsDigitsFirstMatchesAddedTokensAndDropsBytesWithoutAToken) {
  test::TempDir dir;
  const Vocab v = tiny_vocab();
  const auto tok = load_tokenizer(GgufTokenizer{}.write(dir, "tiny.gguf"));
  const token_id space = v.id(byte_level(' ')), space_t = v.id(byte_level(' ') + "t");
  const token_id im_end = v.id("<|im_end|>"), tool = v.id("<tool>");
  // "smollm": " 12" is " ", "1", "2" (the space does not join the digits); " t" merges.
  EXPECT_EQ(tok->encode("a 12 t<|im_end|><tool>"),
            (V{v.id("a"), space, v.id("1"), v.id("2"), space_t, im_end, tool}));
  // Control tokens are text when special tokens are not matched; user-defined ones are matched regardless.
  const V as_text = tok->encode("<|im_end|><tool>", false);
  EXPECT_EQ(as_text.size(), 11u);
  EXPECT_EQ(as_text.back(), tool);
  // Byte 4 has no token: it yields nothing and keeps " " and "t" around it apart.
  EXPECT_EQ(tok->encode(std::string(" \x04t", 3)), (V{space, v.id("t")}));
  EXPECT_EQ(tok->eos_token_id(), im_end);
  EXPECT_EQ(tok->vocab_size(), static_cast<std::int64_t>(v.tokens.size()));
  EXPECT_EQ(tok->decode(tok->encode("a 12 t<|im_end|><tool>")), "a 12 t<|im_end|><tool>");
  EXPECT_EQ(tok->decode(tok->encode("a 12 t<|im_end|>"), true), "a 12 t");
}

TEST(GgufTokenizer, EqualsTheTokenizerJsonWithDigitsBeforeByteLevel) {
  test::TempDir dir;
  const Vocab v = tiny_vocab();
  const std::string vocab = vocab_json(v);
  const std::string json = R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": [")" + byte_level(' ') +
                           R"( t"]}, "normalizer": null, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" +
                           R"({"type": "Digits", "individual_digits": true}, )" +
                           R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}]}})";
  const auto from_json = load_tokenizer(dir.write("tokenizer.json", json));
  const auto from_gguf = load_tokenizer(GgufTokenizer{}.write(dir, "tiny.gguf"));
  for (const char* text : {"x 2024\n\n7 items, 3.5% off  9", "  12ab 3\t4", "Ⅻ ٣ ½"})
    EXPECT_EQ(from_json->encode(text), from_gguf->encode(text)) << text;
  EXPECT_EQ(from_gguf->encode(" 3"), (V{v.id(byte_level(' ')), v.id("3")}));
}

TEST(GgufTokenizer, Gpt4oSplitsAsTheO200kRegexOfATokenizerJson) {
  test::TempDir dir;
  const Vocab v = tiny_vocab();
  const std::string vocab = vocab_json(v);
  // gpt-oss's tokenizer.json pre-tokenizer: o200k's regex (JSON-escaped), then ByteLevel without its own regex.
  const std::string o200k =
      R"([^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+)"
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+)"
      R"([\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|)"
      R"(\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+)";
  const std::string json = R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": [")" + byte_level(' ') +
                           R"( t"]}, "normalizer": null, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" +
                           R"({"type": "Split", "pattern": {"Regex": ")" + o200k +
                           R"("}, "behavior": "Isolated", "invert": false}, )" +
                           R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]}})";
  const auto from_json = load_tokenizer(dir.write("tokenizer.json", json));
  GgufTokenizer gpt4o;
  gpt4o.pre = "gpt-4o";
  const auto from_gguf = load_tokenizer(gpt4o.write(dir, "gpt4o.gguf"));
  for (const char* text : {"x 2024\n\n7 items, 3.5% off  9", "HELLOworld don't STOP'S t", "naïve Ǆemo 中文 t/\n"})
    EXPECT_EQ(from_json->encode(text), from_gguf->encode(text)) << text;
  EXPECT_EQ(from_gguf->encode("12345 t"), (V{v.id("1"), v.id("2"), v.id("3"), v.id("4"), v.id("5"),
                                             v.id(byte_level(' ') + "t")}));
}

TEST(GgufTokenizer, TheChatTemplateChoosesTheRenderer) {
  test::TempDir dir;
  GgufTokenizer smollm2;
  smollm2.chat_template =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}...";
  EXPECT_EQ(default_chat_renderer(smollm2.write(dir, "smollm2.gguf"), "llama3"), "smollm2");
  GgufTokenizer gpt_oss;  // gpt-oss's template writes harmony's headers
  gpt_oss.chat_template = "{{- '<|start|>' + message.role }}{{- '<|channel|>final<|message|>' + content + '<|end|>' }}";
  EXPECT_EQ(default_chat_renderer(gpt_oss.write(dir, "gpt-oss.gguf"), "llama3"), "harmony");
  GgufTokenizer gemma;  // Gemma 2's turns
  gemma.chat_template = "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}";
  EXPECT_EQ(default_chat_renderer(gemma.write(dir, "gemma.gguf"), "role_colon"), "gemma");
  // Without a template it recognises, the family's format.
  EXPECT_EQ(default_chat_renderer(GgufTokenizer{}.write(dir, "plain.gguf"), "llama3"), "llama3");
  EXPECT_EQ(default_chat_renderer("byte", "llama3"), "role_colon");
  EXPECT_EQ(default_chat_renderer((dir.path / "tokenizer.json").string(), "chatml"), "chatml");
  EXPECT_EQ(default_chat_renderer((dir.path / "tokenizer.json").string(), ""), "role_colon");
  // A model_type where the family's renderer name belongs is refused, not turned into some format.
  try {
    default_chat_renderer((dir.path / "tokenizer.json").string(), "llama");
    ADD_FAILURE() << "a model_type was taken for a renderer";
  } catch (const invalid_argument& e) {
    EXPECT_STREQ(e.what(), "default_chat_renderer: 'llama' is not a renderer name (pass SessionInfo::chat_renderer, "
                           "the model family's)");
  }
}

TEST(GgufTokenizer, UnsupportedAndMalformedFilesNameTheFileAndTheField) {
  test::TempDir dir;
  GgufTokenizer bert;
  bert.model = "bert";
  const auto bert_path = bert.write(dir, "bert.gguf");
  EXPECT_THROW(load_tokenizer(bert_path), unsupported);
  EXPECT_NE(error_of([&] { load_tokenizer(bert_path); }).find("tokenizer.ggml.model 'bert' is not supported"),
            std::string::npos);
  GgufTokenizer falcon;
  falcon.pre = "falcon";
  const std::string pre_error = error_of([&] { load_tokenizer(falcon.write(dir, "falcon.gguf")); });
  EXPECT_NE(pre_error.find("falcon.gguf': pre-tokenizer tokenizer.ggml.pre 'falcon' is not supported"),
            std::string::npos)
      << pre_error;
  EXPECT_NE(pre_error.find("smollm"), std::string::npos) << pre_error;
  GgufTokenizer eos;
  eos.eos = 100000;
  EXPECT_NE(error_of([&] { load_tokenizer(eos.write(dir, "eos.gguf")); })
                .find("tokenizer.ggml.eos_token_id 100000 is not a token id"),
            std::string::npos);
  Metadata none;
  none.string("general.architecture", "llama");
  EXPECT_NE(error_of([&] { load_tokenizer(dir.write("none.gguf", none.file())); })
                .find("none.gguf' holds no tokenizer (no tokenizer.ggml.model"),
            std::string::npos);
  // Without token types every token is ordinary: <|im_end|> is then spelled out, never matched.
  GgufTokenizer untyped;
  untyped.with_types = false;
  EXPECT_EQ(load_tokenizer(untyped.write(dir, "untyped.gguf"))->encode("<|im_end|>").size(), 10u);
  const std::string whole = GgufTokenizer{}.write(dir, "whole.gguf");
  std::string bytes;
  {
    std::ifstream in(whole, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_THROW(load_tokenizer(dir.write("cut.gguf", bytes.substr(0, bytes.size() / 2))), invalid_argument);
}

}  // namespace
}  // namespace rlloop
