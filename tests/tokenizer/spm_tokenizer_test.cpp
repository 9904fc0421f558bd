// The GGUF "llama" tokenizer (SentencePiece pieces with scores, as llama.cpp runs it) on a small vocabulary
// written here: the space prefix and "▁", merges by score rather than by position, byte pieces for what no piece
// covers, special and user-defined pieces, decoding, and malformed files. scripts/tokenizer/gguf_spm_match.js holds
// it to llama.cpp itself on Llama 2's vocabulary.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <rlloop/chat.hpp>
#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>

#include "test_support.hpp"

namespace rlloop {
namespace {

using V = std::vector<token_id>;
const std::string kSpace = "\xE2\x96\x81";

using test::error_of;

// <unk> <s> </s>, the 256 byte pieces (ids 3..258), then ordinary pieces with their scores and <tool>.
struct SpmVocab {
  std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
  std::vector<float> scores{0, 0, 0};
  std::vector<std::int32_t> types{2, 3, 3};
  SpmVocab() {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      add(name, 0, 6);
    }
    // Scores chosen so that the best merge is not the leftmost: "▁abc" becomes "▁" + "abc" ("bc" first).
    for (auto [piece, score] : {std::pair{kSpace, -6.0f}, {"a", -7.0f}, {"b", -7.0f}, {"c", -7.0f},
                                {kSpace + "a", -5.0f}, {"ab", -3.0f}, {"bc", -1.0f}, {"abc", -2.0f},
                                {kSpace + "ab", -4.0f}, {"x", -7.0f}})
      add(piece, score, 1);
    add("<tool>", 0, 4);
  }
  void add(const std::string& t, float score, std::int32_t type) {
    tokens.push_back(t);
    scores.push_back(score);
    types.push_back(type);
  }
  token_id id(const std::string& t) const {
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == t) return static_cast<token_id>(i);
    ADD_FAILURE() << "no piece " << t;
    return -1;
  }
  std::map<std::string, gguf::Value> metadata() const {
    gguf::Array t, s, ty;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      t.push_back({tokens[i]});
      s.push_back({scores[i]});
      ty.push_back({types[i]});
    }
    return {{"general.architecture", {std::string("llama")}}, {"tokenizer.ggml.model", {std::string("llama")}},
            {"tokenizer.ggml.tokens", {t}}, {"tokenizer.ggml.scores", {s}}, {"tokenizer.ggml.token_type", {ty}}};
  }
  std::string write(const test::TempDir& dir, const std::string& name,
                    const std::map<std::string, gguf::Value>& changes = {}) const {
    auto m = metadata();
    for (const auto& [k, v] : changes) m[k] = v;
    const std::string path = (dir.path / name).string();
    gguf::write(path, m, {});
    return path;
  }
};

TEST(SpmTokenizer, MergesTheBestScoredPairFirstAndFallsBackToBytes) {
  test::TempDir dir;
  const SpmVocab v;
  const auto tok = load_tokenizer(v.write(dir, "spm.gguf"));
  // "▁abc": "bc" (-1) merges first, then "abc" (-2); "▁a" and "ab" were the leftmost pairs but scored lower.
  EXPECT_EQ(tok->encode("abc"), (V{v.id(kSpace), v.id("abc")}));
  // Spaces are "▁"; "▁ab" (-4) wins over "ab" + "▁a" once "bc" is not there to take the "b".
  EXPECT_EQ(tok->encode("x ab"), (V{v.id(kSpace), v.id("x"), v.id(kSpace + "ab")}));
  // "é" has no piece: its two UTF-8 bytes as byte pieces.
  EXPECT_EQ(tok->encode("\xC3\xA9"), (V{v.id(kSpace), v.id("<0xC3>"), v.id("<0xA9>")}));
  EXPECT_EQ(tok->vocab_size(), static_cast<std::int64_t>(v.tokens.size()));
  EXPECT_EQ(tok->eos_token_id(), 2);  // llama.cpp's default for this model
  EXPECT_EQ(tok->token_to_id(kSpace + "ab"), v.id(kSpace + "ab"));
  EXPECT_EQ(tok->token_to_id(" ab"), v.id(kSpace + "ab"));  // the raw text finds the piece
}

TEST(SpmTokenizer, SpecialPiecesSplitTheTextAndEachStretchAfterOneGetsTheSpacePrefix) {
  test::TempDir dir;
  const SpmVocab v;
  const auto tok = load_tokenizer(v.write(dir, "spm.gguf"));
  const token_id s = v.id("<s>"), end = v.id("</s>"), tool = v.id("<tool>"), space = v.id(kSpace);
  EXPECT_EQ(tok->encode("<s>abc</s>x"), (V{s, space, v.id("abc"), end, space, v.id("x")}));
  // Not matched as special: "<", "s", ">" have no pieces and become bytes; user-defined <tool> is still matched.
  const V as_text = tok->encode("<s><tool>x", false);
  EXPECT_EQ(as_text, (V{space, v.id("<0x3C>"), v.id("<0x73>"), v.id("<0x3E>"), tool, space, v.id("x")}));
  // Without the space prefix only the spaces in the text become "▁".
  const auto plain = load_tokenizer(v.write(dir, "plain.gguf", {{"tokenizer.ggml.add_space_prefix", {false}}}));
  EXPECT_EQ(plain->encode("abc"), (V{v.id("abc")}));
  EXPECT_EQ(plain->encode("x abc"), (V{v.id("x"), space, v.id("abc")}));
}

TEST(SpmTokenizer, DecodesPiecesBytesAndSpecialsPieceByPiece) {
  test::TempDir dir;
  const SpmVocab v;
  const auto tok = load_tokenizer(v.write(dir, "spm.gguf"));
  // The prefix space stays (decoding is concatenative: piece by piece gives the same text).
  for (const char* text : {"abc", "x ab  abc", "\xC3\xA9 x"})
    EXPECT_EQ(tok->decode(tok->encode(text)), std::string(" ") + text) << text;
  const V ids = tok->encode("x ab  abc");
  std::string pieces;
  for (token_id id : ids) pieces += tok->decode(V{id});
  EXPECT_EQ(pieces, tok->decode(ids));
  // Control pieces show unless skipped, <tool> always.
  EXPECT_EQ(tok->decode(tok->encode("<s>abc</s><tool>")), "<s> abc</s><tool>");
  EXPECT_EQ(tok->decode(tok->encode("<s>abc</s><tool>"), true), " abc<tool>");
  EXPECT_EQ(error_of([&] { tok->decode(V{100000}); }).find("decode: token id 100000 is out of range"), 0u);
}

TEST(SpmTokenizer, MalformedVocabulariesNameTheFileAndTheField) {
  test::TempDir dir;
  const SpmVocab v;
  const std::string scores = error_of([&] {
    load_tokenizer(v.write(dir, "scores.gguf", {{"tokenizer.ggml.scores", {gguf::Array{{1.0f}}}}}));
  });
  EXPECT_NE(scores.find("scores.gguf': tokenizer.ggml.scores must be an array of"), std::string::npos) << scores;
  SpmVocab bad_type = v;
  bad_type.types[5] = 9;
  EXPECT_NE(error_of([&] { load_tokenizer(bad_type.write(dir, "type.gguf")); }).find("token 5 has type 9"),
            std::string::npos);
  for (const char* bad : {"<0xZZ>", "<0x-1>", "<0x1>>", "<0x123>"}) {
    SpmVocab bad_byte = v;
    bad_byte.tokens[3] = bad;
    EXPECT_NE(error_of([&] { load_tokenizer(bad_byte.write(dir, "byte.gguf")); })
                  .find(std::string("byte piece 3 is '") + bad + "'"),
              std::string::npos)
        << bad;
  }
  const std::string eos = error_of([&] {
    load_tokenizer(v.write(dir, "eos.gguf", {{"tokenizer.ggml.eos_token_id", {std::uint32_t{70000}}}}));
  });
  EXPECT_NE(eos.find("tokenizer.ggml.eos_token_id 70000 is not a token id"), std::string::npos) << eos;
}

// Hugging Face's form (tokenizer.json, BPE with byte_fallback): the merge list decides, by rank, and only listed
// pairs merge. "▁abc" with merges "a b" (rank 0), "ab c", "▁ ab": a+b first, then ab+c; "▁ abc" is not listed.
std::string spm_json(const std::string& normalizer) {
  const std::string sp = kSpace;
  return R"({"model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>", "vocab": {"<unk>": 0, "<s>": 1,)"
         R"( "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, ")" + sp + R"(": 5, "a": 6, "b": 7, "c": 8, "ab": 9, "abc": 10,)"
         R"( ")" + sp + R"(ab": 11}, "merges": ["a b", "ab c", ")" + sp + R"( ab"]},)"
         R"( "added_tokens": [{"id": 0, "content": "<unk>", "special": true},)"
         R"( {"id": 1, "content": "<s>", "special": true}, {"id": 2, "content": "</s>", "special": true}],)"
         R"( "normalizer": )" + normalizer + R"(, "pre_tokenizer": null})";
}
const std::string kLegacyNormalizer = R"({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": ")" +
                                      kSpace + R"("}, {"type": "Replace", "pattern": {"String": " "}, "content": ")" +
                                      kSpace + R"("}]})";

TEST(SpmTokenizer, HuggingFaceTokenizerJsonMergesByRankAndFallsBackToBytesFirst) {
  test::TempDir dir;
  const auto tok = load_tokenizer(dir.write("tokenizer.json", spm_json(kLegacyNormalizer)));
  EXPECT_EQ(tok->encode("abc"), (V{5, 10}));     // "▁ abc" is not a listed merge
  EXPECT_EQ(tok->encode("ab"), (V{11}));          // "▁ ab" is
  EXPECT_EQ(tok->encode("<s>\xC3\xA9"), (V{1, 5, 3, 4}));  // é has no piece: its bytes, before any merge
  EXPECT_EQ(tok->encode("\xE2\x82\xAC"), (V{5, 0}));     // € has no piece and no byte pieces: one <unk> (fused)
  EXPECT_EQ(tok->decode(tok->encode("ab abc")), " ab abc");
  const std::string error = error_of([&] { load_tokenizer(dir.write("nfkc.json", spm_json(R"({"type": "NFKC"})"))); });
  EXPECT_NE(error.find("nfkc.json': normalizer {\"type\":\"NFKC\"} with pre_tokenizer none is not supported"),
            std::string::npos)
      << error;
}

// The non-legacy form: no normalizer, Metaspace as the pre-tokenizer. "first" puts the prefix only at the start
// of the input; "always" after special tokens too, as the legacy normalizer does; neither before a space.
TEST(SpmTokenizer, MetaspaceFirstPrefixesOnlyTheStartOfTheInput) {
  test::TempDir dir;
  auto metaspace = [&](const std::string& scheme, bool split = false) {
    std::string json = spm_json("null");
    const std::string pre = R"("pre_tokenizer": {"type": "Metaspace", "replacement": ")" + kSpace +
                            R"(", "prepend_scheme": ")" + scheme + R"(", "split": )" + (split ? "true" : "false") +
                            "}";
    json.replace(json.find(R"("pre_tokenizer": null)"), std::string(R"("pre_tokenizer": null)").size(), pre);
    return dir.write(scheme + (split ? "-split" : "") + ".json", json);
  };
  const auto first = load_tokenizer(metaspace("first"));
  EXPECT_EQ(first->encode("ab<s>ab"), (V{11, 1, 9}));       // "▁ab", then "ab" without a prefix
  EXPECT_EQ(first->encode("<s>ab ab"), (V{1, 9, 11}));      // the text after a leading <s> has none either
  EXPECT_EQ(load_tokenizer(metaspace("always"))->encode("ab<s>ab"), (V{11, 1, 11}));
  EXPECT_EQ(load_tokenizer(metaspace("never"))->encode("ab ab"), (V{9, 11}));
  EXPECT_EQ(first->encode(" ab"), (V{11}));  // text that starts with a space gets no second one
  EXPECT_NE(error_of([&] { load_tokenizer(metaspace("first", true)); }).find("is not supported with byte_fallback"),
            std::string::npos);
}

// Llama 2 Chat on a SentencePiece vocabulary: each stretch of text after <s> or </s> gets its own "▁", so the
// weights come from encoding prefixes of the whole text (gguf_spm_match.js holds the text and ids to the template
// and llama.cpp on Llama 2's vocabulary).
TEST(SpmTokenizer, Llama2ChatWeighsTheAnswersAndChecksTheRoles) {
  test::TempDir dir;
  const SpmVocab v;
  const std::string plain = v.write(dir, "spm.gguf");
  const std::string templated = v.write(
      dir, "chat.gguf", {{"tokenizer.chat_template", {std::string("{{ bos_token + '[INST] <<SYS>>' }}")}}});
  EXPECT_EQ(default_chat_renderer(templated, "llama3"), "llama2");
  EXPECT_EQ(default_chat_renderer(plain, "llama3"), "role_colon");  // not llama3: no header tokens in the vocabulary
  const auto tok = load_tokenizer(plain);
  const auto r = make_chat_renderer("llama2", tok);
  const std::vector<Message> chat = {{"system", "sys", std::nullopt}, {"user", " ab ", std::nullopt},
                                     {"assistant", "abc\n", std::nullopt}, {"user", "x", std::nullopt},
                                     {"assistant", "c", std::nullopt}};
  EXPECT_EQ(r->render_text(chat, false),
            "<s>[INST] <<SYS>>\nsys\n<</SYS>>\n\n ab [/INST] abc </s><s>[INST] x [/INST] c </s>");
  EXPECT_EQ(r->render_text(std::span(chat).first(4), true),
            "<s>[INST] <<SYS>>\nsys\n<</SYS>>\n\n ab [/INST] abc </s><s>[INST] x [/INST]");
  auto trained = [&](TrainOn on) {
    const SupervisedExample ex = r->build_supervised_example(chat, on);
    EXPECT_EQ(ex.tokens, tok->encode(r->render_text(chat, false)));
    std::vector<token_id> ids;
    for (std::size_t i = 0; i < ex.tokens.size(); ++i)
      if (ex.weights[i] > 0) ids.push_back(ex.tokens[i]);
    return tok->decode(ids);
  };
  EXPECT_EQ(trained(TrainOn::last_assistant), " c </s>");
  EXPECT_EQ(trained(TrainOn::all_assistant), " abc </s> c </s>");
  const V answer = tok->encode(" abc </s>");
  EXPECT_EQ(r->parse_response(answer).message.content, "abc");
  EXPECT_TRUE(r->parse_response(answer).complete);
  EXPECT_EQ(r->stop_token_ids(), (V{v.id("</s>")}));
  // The template's raise_exception, and what a generation prompt needs.
  const std::vector<Message> twice = {{"user", "a", std::nullopt}, {"user", "b", std::nullopt}};
  EXPECT_NE(error_of([&] { r->render_text(twice, true); }).find("llama2: message 1 has role 'user'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { r->build_generation_prompt(std::span(chat).first(3)); }).find("end with a user message"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make_chat_renderer("llama2", load_tokenizer("byte")); }).find("needs the token '<s>'"),
            std::string::npos);
}

TEST(SpmTokenizer, CorruptedVocabulariesLoadOrAreRefusedNeverACrash) {
  // 1,500 copies of the vocabulary file with 1 to 4 random bytes overwritten (in the pieces, scores, types, keys or
  // lengths): each is refused with rlloop's error, or loads and then encodes and decodes, every id included.
  test::TempDir dir;
  std::string whole;
  {
    std::ifstream in(SpmVocab().write(dir, "whole.gguf"), std::ios::binary);
    whole.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::mt19937 rng(5);
  int loaded = 0, refused = 0;
  for (int i = 0; i < 1500; ++i) {
    std::string bytes = whole;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng() % 256);
    try {
      const auto tok = load_tokenizer(dir.write("corrupt.gguf", bytes));
      tok->encode("<s>x ab\xC3\xA9 abc</s><tool>");
      std::vector<token_id> all(static_cast<std::size_t>(tok->vocab_size()));
      for (std::size_t id = 0; id < all.size(); ++id) all[id] = static_cast<token_id>(id);
      tok->decode(all);
      ++loaded;
    } catch (const rlloop::error&) {
      ++refused;
    }
  }
  EXPECT_EQ(loaded + refused, 1500);
  EXPECT_GT(loaded, 100);
  EXPECT_GT(refused, 100);
}

}  // namespace
}  // namespace rlloop
