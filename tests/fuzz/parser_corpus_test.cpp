// The parsers of files a user hands rlloop (GGUF models and their tokenizers, safetensors headers, tokenizer.json,
// tiktoken rank files) on parser_corpus/: each file valid or damaged in one named way (make_parser_corpus.py,
// expected.txt), then on deterministic byte-level damage of the valid ones. A file is read or refused with
// rlloop's error and the phrase expected.txt names; nothing else escapes (std::bad_alloc, std::length_error,
// nlohmann's exceptions). scripts/sanitize.sh runs this under ASan + UBSan, where an unchecked length, offset or id
// is a failed test even when it happens to read memory that is there.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <rlloop/error.hpp>
#include <rlloop/gguf.hpp>
#include <rlloop/tokenizer.hpp>

#include "io/safetensors_header.hpp"  // src/engine/io

namespace fs = std::filesystem;
using namespace rlloop;

namespace {

const fs::path kCorpus = fs::path(RLLOOP_SOURCE_DIR) / "tests/fuzz/parser_corpus";

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A scratch folder of this process (tiktoken files are named by their encoding, so each sits in a folder).
fs::path scratch(const std::string& relative, const std::string& bytes) {
  const fs::path p = fs::temp_directory_path() / ("rlloop-parser-corpus-" + std::to_string(::getpid())) / relative;
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  return p;
}

// A tokenizer put to work: what it makes of text with a space, digits and bytes outside ASCII, and back.
void exercise(const Tokenizer& tokenizer) {
  const auto ids = tokenizer.encode("Hello the world, 12345 \xC3\xA9t\xC3\xA9");
  (void)tokenizer.decode(ids);
}

// What parser_corpus_test does with a file of each kind; throws what the reader throws.
void read_gguf(const fs::path& path) {
  const auto file = gguf::File::open(path.string());
  for (const auto& t : file.tensors()) (void)file.dequantize(t);
  exercise(*load_tokenizer(path.string()));
}

// As read_safetensors (src/engine/io/model_io.cpp) reads a file's header, without LibTorch.
engine::SafetensorsHeader read_safetensors_header(const fs::path& path) {
  const std::string bytes = read_bytes(path);
  std::uint64_t length = 0;
  if (bytes.size() >= 8) std::memcpy(&length, bytes.data(), 8);
  engine::check_safetensors_header_length(length, bytes.size(), path.string());
  return engine::parse_safetensors_header(bytes.substr(8, length), bytes.size(), path.string());
}

void read_tokenizer_file(const fs::path& path) { exercise(*load_tokenizer(path.string())); }

void read_any(const std::string& relative, const fs::path& path) {
  const std::string kind = relative.substr(0, relative.find('/'));
  if (kind == "gguf") return read_gguf(path);
  if (kind == "safetensors") return (void)read_safetensors_header(path);
  if (kind == "tokenizer_json" || kind == "tiktoken") return read_tokenizer_file(path);
  FAIL() << "parser_corpus/" << relative << ": no reader for '" << kind << "'";
}

// "ok", or the class of rlloop error and its message; anything else that escapes fails the test here.
struct Outcome {
  std::string kind;  // "ok", "invalid_argument", "unsupported", "not_found", "io_error", "escaped"
  std::string message;
};

Outcome outcome_of(const std::string& relative, const fs::path& path) {
  try {
    read_any(relative, path);
    return {"ok", ""};
  } catch (const invalid_argument& e) {
    return {"invalid_argument", e.what()};
  } catch (const unsupported& e) {
    return {"unsupported", e.what()};
  } catch (const not_found& e) {
    return {"not_found", e.what()};
  } catch (const io_error& e) {
    return {"io_error", e.what()};
  } catch (const std::exception& e) {
    return {"escaped", std::string(typeid(e).name()) + ": " + e.what()};
  }
}

std::vector<std::pair<std::string, std::string>> expected_outcomes() {
  std::ifstream in(kCorpus / "expected.txt");
  std::vector<std::pair<std::string, std::string>> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto tab = line.find('\t');
    out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
  }
  return out;
}

}  // namespace

TEST(ParserCorpus, EachFileReadsOrIsRefusedWithWhatIsWrongInIt) {
  const auto expected = expected_outcomes();
  std::set<std::string> listed;
  std::map<std::string, int> kinds;
  for (const auto& [relative, want] : expected) {
    listed.insert(relative);
    const fs::path path = kCorpus / relative;
    const Outcome got = outcome_of(relative, path);
    ++kinds[relative.substr(0, relative.find('/'))];
    if (want == "ok") {
      EXPECT_EQ(got.kind, "ok") << relative << ": " << got.message;
      continue;
    }
    EXPECT_NE(got.kind, "ok") << relative << ": read, but expected a refusal naming '" << want << "'";
    EXPECT_NE(got.kind, "escaped") << relative << ": " << got.message;
    EXPECT_NE(got.message.find(want), std::string::npos) << relative << ": refused, but not for '" << want
                                                        << "': " << got.message;
    EXPECT_NE(got.message.find(path.string()), std::string::npos) << relative << ": names no file: " << got.message;
  }
  // Every file of the corpus is checked (a file without a line would be replayed by nobody).
  for (const auto& entry : fs::recursive_directory_iterator(kCorpus)) {
    if (!entry.is_regular_file() || entry.path().filename() == "expected.txt") continue;
    EXPECT_TRUE(listed.count(fs::relative(entry.path(), kCorpus).string())) << entry.path() << " has no line";
  }
  const std::map<std::string, int> golden{{"gguf", 49}, {"safetensors", 19}, {"tiktoken", 8}, {"tokenizer_json", 11}};
  EXPECT_EQ(kinds, golden);
}

TEST(ParserCorpus, TheValidFilesReadAsWritten) {
  // What make_parser_corpus.py wrote: the tensors' values, the tokenizers' merges and special tokens.
  const auto file = gguf::File::open((kCorpus / "gguf/valid_bpe.gguf").string());
  EXPECT_EQ(file.dequantize(file.tensor("w.f32")), (std::vector<float>{1.0f, -2.0f, 0.25f, 8.0f}));
  EXPECT_EQ(file.dequantize(file.tensor("w.f16")), (std::vector<float>{1.0f, -2.0f}));
  std::vector<float> q8;
  for (int q = -16; q < 16; ++q) q8.push_back(0.5f * static_cast<float>(q));
  EXPECT_EQ(file.dequantize(file.tensor("w.q8")), q8);
  const auto bpe = load_tokenizer((kCorpus / "gguf/valid_bpe.gguf").string());
  EXPECT_EQ(bpe->encode(" the"), (std::vector<token_id>{256, 257}));  // "Ġt" then "he"
  EXPECT_EQ(bpe->encode("<|end|>"), (std::vector<token_id>{258}));    // the control token, whole
  EXPECT_EQ(bpe->eos_token_id(), 258);
  EXPECT_EQ(bpe->decode(bpe->encode("Hello the world")), "Hello the world");
  const auto spm = load_tokenizer((kCorpus / "gguf/valid_spm.gguf").string());
  EXPECT_EQ(spm->encode("he"), (std::vector<token_id>{262}));  // "▁he": the space prefix, then the best merges
  EXPECT_EQ(spm->encode("hello"), (std::vector<token_id>{262, 111, 111, 114}));  // "▁he", then <0x6C> <0x6C> <0x6F>
  const auto header = read_safetensors_header(kCorpus / "safetensors/valid.safetensors");
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.tensors[0].name, "w");
  EXPECT_EQ(header.tensors[0].dtype, "F32");
  EXPECT_EQ(header.tensors[0].shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(header.tensors[0].begin, 0u);
  EXPECT_EQ(header.tensors[0].end, 16u);
  EXPECT_EQ(header.data_start + 16, fs::file_size(kCorpus / "safetensors/valid.safetensors"));
  EXPECT_EQ(load_tokenizer((kCorpus / "tiktoken/valid/cl100k_base.tiktoken").string())->encode("abab"),
            (std::vector<token_id>{256, 256}));
  EXPECT_EQ(load_tokenizer((kCorpus / "tokenizer_json/valid/tokenizer.json").string())->encode("ab<|eos|>"),
            (std::vector<token_id>{256, 257}));
}

namespace {

// `count` copies of `whole`, each with 1 to 4 random bytes overwritten (seeded), read as `name` in a scratch
// folder; how many ended each way.
std::map<std::string, int> damage(const std::string& whole, const std::string& kind, const std::string& name,
                                  int count, unsigned seed) {
  std::mt19937 rng(seed);
  std::map<std::string, int> counts;
  for (int i = 0; i < count; ++i) {
    std::string bytes = whole;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng() % 256);
    const auto path = scratch(kind + "/damaged/" + name, bytes);
    const Outcome got = outcome_of(kind + "/damaged/" + name, path);
    EXPECT_NE(got.kind, "escaped") << kind << " " << i << ": " << got.message;
    ++counts[got.kind];
  }
  return counts;
}

}  // namespace

TEST(ParserCorpus, DamagedBytesAreReadOrRefusedNeverACrash) {
  // The valid files with random bytes overwritten. The counts for these seeds are golden: a check a reader drops
  // moves files from a refusal to "ok" (or, unchecked, to a crash that the sanitized run reports).
  const auto gguf_counts =
      damage(read_bytes(kCorpus / "gguf/valid_bpe.gguf"), "gguf", "model.gguf", 1500, 43);
  const auto spm_counts = damage(read_bytes(kCorpus / "gguf/valid_spm.gguf"), "gguf", "model.gguf", 500, 44);
  const auto st_counts =
      damage(read_bytes(kCorpus / "safetensors/valid.safetensors"), "safetensors", "m.safetensors", 500, 45);
  const auto tik_counts = damage(read_bytes(kCorpus / "tiktoken/valid/cl100k_base.tiktoken"), "tiktoken",
                                 "cl100k_base.tiktoken", 300, 46);
  const auto json_counts = damage(read_bytes(kCorpus / "tokenizer_json/valid/tokenizer.json"), "tokenizer_json",
                                  "tokenizer.json", 300, 47);
  std::ostringstream got;
  for (const auto* counts : {&gguf_counts, &spm_counts, &st_counts, &tik_counts, &json_counts}) {
    got << "{";
    for (const auto& [kind, n] : *counts) got << "{\"" << kind << "\", " << n << "}, ";
    got << "}\n";
  }
  SCOPED_TRACE("counts:\n" + got.str());
  using Counts = std::map<std::string, int>;
  EXPECT_EQ(gguf_counts, (Counts{{"invalid_argument", 1345}, {"ok", 153}, {"unsupported", 2}}));
  EXPECT_EQ(spm_counts, (Counts{{"invalid_argument", 461}, {"ok", 39}}));
  EXPECT_EQ(st_counts, (Counts{{"io_error", 474}, {"ok", 26}}));
  EXPECT_EQ(tik_counts, (Counts{{"invalid_argument", 294}, {"ok", 6}}));
  EXPECT_EQ(json_counts, (Counts{{"invalid_argument", 296}, {"ok", 3}, {"unsupported", 1}}));
}
