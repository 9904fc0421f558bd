// Parsing of tokenizer.json (byte-level BPE, or SentencePiece-style BPE with byte fallback) and encoder.json +
// vocab.bpe.
#include "tokenizer_files.hpp"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "byte_level.hpp"
#include "spm_tokenizer.hpp"

namespace rlloop::tokenizer_detail {
namespace fs = std::filesystem;
using nlohmann::json;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io_error("load_tokenizer: cannot open '" + path.string() + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw io_error("load_tokenizer: cannot read '" + path.string() + "'");
  return std::move(ss).str();
}

namespace {

json parse_json(const fs::path& path) {
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number beyond a double (1e999)
    throw invalid_argument("load_tokenizer: '" + path.string() +
                           "' is not valid JSON (truncated or malformed?): " + e.what());
  }
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?";
}

// The split pattern implied by a tokenizer.json pre_tokenizer section.
SplitPattern read_pre_tokenizer(const json& pre, const std::string& source) {
  auto bad = [&](const std::string& what) {
    throw unsupported("load_tokenizer: '" + source + "': pre_tokenizer " + what +
                      " is not supported (rlloop implements byte-level BPE as in GPT-2, Llama 3 and Qwen2/3)");
  };
  auto check_byte_level = [&](const json& bl, bool want_regex) {
    if (bl.value("add_prefix_space", false)) bad("ByteLevel with add_prefix_space=true");
    if (bl.value("use_regex", true) != want_regex)
      bad("ByteLevel with use_regex=" + std::string(want_regex ? "false" : "true"));
  };
  if (type_of(pre) == "ByteLevel") {
    check_byte_level(pre, true);
    return SplitPattern::gpt2;
  }
  if (type_of(pre) != "Sequence" || !pre.contains("pretokenizers") || !pre["pretokenizers"].is_array() ||
      pre["pretokenizers"].size() != 2)
    bad("'" + type_of(pre) + "'");
  const json& split = pre["pretokenizers"][0];
  const json& bl = pre["pretokenizers"][1];
  if (type_of(split) == "Digits" && type_of(bl) == "ByteLevel") {
    if (!split.value("individual_digits", false)) bad("Digits with individual_digits=false");
    check_byte_level(bl, true);
    return SplitPattern::gpt2_digits;
  }
  if (type_of(split) != "Split" || type_of(bl) != "ByteLevel")
    bad("Sequence [" + type_of(split) + ", " + type_of(bl) + "]");
  check_byte_level(bl, false);
  if (split.value("behavior", std::string("Isolated")) != "Isolated" || split.value("invert", false))
    bad("Split with behavior other than Isolated");
  if (!split.contains("pattern") || !split["pattern"].is_object() || !split["pattern"].contains("Regex") ||
      !split["pattern"]["Regex"].is_string())
    bad("Split without a Regex pattern");
  const auto regex = split["pattern"]["Regex"].get<std::string>();
  SplitPattern p;
  if (!split_pattern_from_regex(regex, p)) bad("Split regex '" + regex + "'");
  return p;
}

std::optional<std::string> read_eos(const fs::path& config_path) {
  if (!fs::exists(config_path)) return std::nullopt;
  const json cfg = parse_json(config_path);
  if (!cfg.is_object() || !cfg.contains("eos_token")) return std::nullopt;
  const json& e = cfg["eos_token"];
  if (e.is_string()) return e.get<std::string>();
  if (e.is_object() && e.contains("content") && e["content"].is_string()) return e["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

std::string byte_level_token(const std::string& token, const std::string& source) {
  auto bytes = byte_level_to_bytes(token);
  if (!bytes)
    throw invalid_argument("load_tokenizer: '" + source + "': token '" + token +
                           "' is not written in the byte-level alphabet (not a byte-level BPE vocabulary)");
  return *bytes;
}

std::pair<std::string, std::string> byte_level_merge(const std::string& line, const std::string& source) {
  const auto space = line.find(' ');
  if (space == std::string::npos || space == 0 || space + 1 >= line.size() ||
      line.find(' ', space + 1) != std::string::npos)
    throw invalid_argument("load_tokenizer: '" + source + "': merge '" + line + "' is not two tokens");
  return {byte_level_token(line.substr(0, space), source), byte_level_token(line.substr(space + 1), source)};
}

namespace {

// A merge as its two tokens' texts: "a b" or ["a", "b"].
std::pair<std::string, std::string> merge_pair(const json& m, const std::string& source) {
  if (m.is_string()) {
    const auto line = m.get<std::string>();
    const auto space = line.find(' ');
    if (space != std::string::npos && space > 0 && space + 1 < line.size() &&
        line.find(' ', space + 1) == std::string::npos)
      return {line.substr(0, space), line.substr(space + 1)};
  } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    return {m[0].get<std::string>(), m[1].get<std::string>()};
  }
  throw invalid_argument("load_tokenizer: '" + source + "': a merge is neither \"a b\" nor [\"a\", \"b\"]: " +
                         m.dump());
}

// Llama 2's and Mistral's tokenizer.json: BPE with byte_fallback over "▁"-spaced text, with the normalizer
// Sequence [Prepend("▁"), Replace(" ", "▁")] and no pre-tokenizer (their "legacy" form), or no normalizer and the
// pre-tokenizer Metaspace (prepend_scheme "first": the prefix only at the start of the input, not after a special
// token; "always"; or "never"; never before text that starts with a space).
SpmSpec spm_spec_from_json(const json& j, const fs::path& path) {
  const std::string source = path.string();
  const std::string space = "\xE2\x96\x81";
  const json& model = j["model"];
  auto refuse = [&](const std::string& what) {
    throw unsupported("load_tokenizer: '" + source + "': " + what + " is not supported with byte_fallback (rlloop " +
                      "reads the normalizer Sequence [Prepend(\"▁\"), Replace(\" \", \"▁\")] and no pre_tokenizer, " +
                      "or no normalizer and the pre_tokenizer Metaspace without split)");
  };
  const json norm = j.value("normalizer", json());
  const json pre = j.value("pre_tokenizer", json());
  const bool legacy = type_of(norm) == "Sequence" && norm.contains("normalizers") && norm["normalizers"].is_array() &&
                      norm["normalizers"].size() == 2 && type_of(norm["normalizers"][0]) == "Prepend" &&
                      norm["normalizers"][0].value("prepend", std::string()) == space &&
                      type_of(norm["normalizers"][1]) == "Replace" &&
                      norm["normalizers"][1].value("content", std::string()) == space &&
                      norm["normalizers"][1].contains("pattern") &&
                      norm["normalizers"][1]["pattern"].value("String", std::string()) == " ";
  SpmSpec spec;
  spec.source = source;
  if (legacy) {
    if (!pre.is_null()) refuse("pre_tokenizer '" + type_of(pre) + "' after the Prepend/Replace normalizer");
  } else if (norm.is_null() && type_of(pre) == "Metaspace") {
    // The non-legacy form: Metaspace writes the spaces as "▁" and prepends one as prepend_scheme says.
    if (pre.value("replacement", space) != space || pre.value("split", false))
      refuse("pre_tokenizer " + pre.dump());
    const std::string scheme = pre.value("prepend_scheme", std::string(pre.value("add_prefix_space", true) ? "always"
                                                                                                        : "never"));
    if (scheme != "always" && scheme != "first" && scheme != "never") refuse("pre_tokenizer " + pre.dump());
    spec.add_space_prefix = scheme != "never";
    spec.prefix_after_special = scheme == "always";
    spec.prefix_unless_space = true;
  } else {
    refuse("normalizer " + (norm.is_null() ? std::string("none") : norm.dump()) + " with pre_tokenizer " +
           (pre.is_null() ? std::string("none") : pre.dump()));
  }
  auto place = [&](token_id id, const std::string& text, PieceType type) {
    if (id < 0 || id > 10'000'000) throw invalid_argument("load_tokenizer: '" + source + "': token id " +
                                                          std::to_string(id) + " of '" + text + "' is out of range");
    if (static_cast<std::size_t>(id) >= spec.pieces.size()) spec.pieces.resize(static_cast<std::size_t>(id) + 1,
                                                                                {"", 0.0f, PieceType::unused});
    spec.pieces[static_cast<std::size_t>(id)] = {text, 0.0f, type};
  };
  for (const auto& [piece, id] : model["vocab"].items()) {
    if (!id.is_number_integer())
      throw invalid_argument("load_tokenizer: '" + source + "': vocab entry '" + piece + "' has a non-integer id");
    const bool is_byte = piece.size() == 6 && piece.starts_with("<0x") && piece.back() == '>';
    place(id.get<token_id>(), piece, is_byte ? PieceType::byte : PieceType::normal);
  }
  const std::string unk = model.value("unk_token", std::string());
  for (const json& t : j.value("added_tokens", json::array())) {
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
        !t["content"].is_string())
      throw invalid_argument("load_tokenizer: '" + source + "': an added token lacks an integer id or a string " +
                             "content: " + t.dump());
    const auto content = t["content"].get<std::string>();
    const PieceType type = !t.value("special", true) ? PieceType::user_defined
                           : content == unk          ? PieceType::unknown
                                                     : PieceType::control;
    place(t["id"].get<token_id>(), content, type);
  }
  for (const json& m : model["merges"]) spec.merges.push_back(merge_pair(m, source));
  auto id_of = [&](const std::string& text) -> std::optional<token_id> {
    for (std::size_t i = 0; i < spec.pieces.size(); ++i)
      if (spec.pieces[i].text == text && !text.empty()) return static_cast<token_id>(i);
    return std::nullopt;
  };
  if (!unk.empty()) spec.unk = id_of(unk);
  if (const auto eos = read_eos(path.parent_path() / "tokenizer_config.json")) spec.eos = id_of(*eos);
  return spec;
}

BpeSpec bpe_spec_from_json(const json& j, const fs::path& path) {
  const std::string source = path.string();
  auto malformed = [&](const std::string& what) {
    throw invalid_argument("load_tokenizer: '" + source + "': " + what);
  };
  if (!j.is_object()) malformed("the top level is not a JSON object");
  if (!j.contains("model") || !j["model"].is_object()) malformed("no \"model\" object");
  const json& model = j["model"];
  const std::string model_type = model.contains("type") ? type_of(model) : "BPE";
  if (model_type != "BPE")
    throw unsupported("load_tokenizer: '" + source + "': model type '" + model_type +
                      "' is not supported (rlloop reads byte-level BPE tokenizers)");
  if (!model.contains("vocab") || !model["vocab"].is_object()) malformed("model.vocab is missing or not an object");
  if (!model.contains("merges") || !model["merges"].is_array()) malformed("model.merges is missing or not an array");
  if (model.value("byte_fallback", false))
    throw unsupported("load_tokenizer: '" + source + "': BPE byte_fallback needs model.vocab and model.merges");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty())
      throw unsupported("load_tokenizer: '" + source + "': BPE " + key + " is not supported");

  BpeSpec spec;
  spec.source = source;
  const json normalizer = j.value("normalizer", json());
  if (normalizer.is_null())
    spec.nfc = false;
  else if (type_of(normalizer) == "NFC")
    spec.nfc = true;
  else
    throw unsupported("load_tokenizer: '" + source + "': normalizer '" + type_of(normalizer) +
                      "' is not supported (only NFC or none)");
  const json pre = j.value("pre_tokenizer", json());
  if (pre.is_null())
    throw unsupported("load_tokenizer: '" + source + "': a tokenizer without pre_tokenizer is not supported");
  spec.pattern = read_pre_tokenizer(pre, source);
  const json decoder = j.value("decoder", json());
  if (!decoder.is_null() && type_of(decoder) != "ByteLevel")
    throw unsupported("load_tokenizer: '" + source + "': decoder '" + type_of(decoder) +
                      "' is not supported (only ByteLevel)");

  spec.vocab.reserve(model["vocab"].size());
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer()) malformed("vocab entry '" + token + "' has a non-integer id");
    spec.vocab.emplace_back(byte_level_token(token, source), id.get<token_id>());
  }
  spec.merges.reserve(model["merges"].size());
  for (const json& m : model["merges"]) {
    const auto [a, b] = merge_pair(m, source);
    spec.merges.emplace_back(byte_level_token(a, source), byte_level_token(b, source));
  }
  if (j.contains("added_tokens")) {
    if (!j["added_tokens"].is_array()) malformed("added_tokens is not an array");
    for (const json& t : j["added_tokens"]) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string())
        malformed("an added token lacks an integer id or a string content: " + t.dump());
      spec.added_tokens.push_back({t["content"].get<std::string>(), t["id"].get<token_id>(), t.value("special", true)});
    }
  }
  spec.eos_token = read_eos(path.parent_path() / "tokenizer_config.json");
  if (!spec.eos_token)
    for (const auto& t : spec.added_tokens)
      if (t.content == "<|endoftext|>") spec.eos_token = t.content;
  return spec;
}

}  // namespace

std::shared_ptr<const Tokenizer> load_tokenizer_json(const fs::path& path) {
  const json j = parse_json(path);
  if (j.is_object() && j.contains("model") && j["model"].is_object() && j["model"].value("byte_fallback", false) &&
      j["model"].contains("vocab") && j["model"]["vocab"].is_object() && j["model"].contains("merges") &&
      j["model"]["merges"].is_array())
    return std::make_shared<SpmTokenizer>(spm_spec_from_json(j, path));
  return std::make_shared<BpeTokenizer>(bpe_spec_from_json(j, path));
}

BpeSpec read_tokenizer_json(const fs::path& path) { return bpe_spec_from_json(parse_json(path), path); }

BpeSpec read_gpt2_files(const fs::path& dir) {
  const fs::path encoder_path = dir / "encoder.json", merges_path = dir / "vocab.bpe";
  BpeSpec spec;
  spec.source = encoder_path.string();
  const json enc = parse_json(encoder_path);
  if (!enc.is_object())
    throw invalid_argument("load_tokenizer: '" + spec.source + "' is not a JSON object of token -> id");
  for (const auto& [token, id] : enc.items()) {
    if (!id.is_number_integer())
      throw invalid_argument("load_tokenizer: '" + spec.source + "': entry '" + token + "' has a non-integer id");
    spec.vocab.emplace_back(byte_level_token(token, spec.source), id.get<token_id>());
  }
  std::istringstream lines(read_file(merges_path));
  std::string line;
  bool first = true;
  while (std::getline(lines, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (first && line.starts_with("#version")) {
      first = false;
      continue;
    }
    first = false;
    if (line.empty()) continue;
    spec.merges.push_back(byte_level_merge(line, merges_path.string()));
  }
  spec.pattern = SplitPattern::gpt2;
  spec.nfc = false;
  // GPT-2's only special token; tiktoken and Hugging Face treat it as a special added token.
  for (const auto& [bytes, id] : spec.vocab)
    if (bytes == "<|endoftext|>") {
      spec.added_tokens.push_back({bytes, id, true});
      spec.eos_token = bytes;
    }
  return spec;
}

}  // namespace rlloop::tokenizer_detail
