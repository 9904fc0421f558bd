// Byte-level BPE encoding and decoding.
#include "bpe_tokenizer.hpp"

#include <algorithm>
#include <bit>
#include <limits>
#include <queue>

#include "byte_level.hpp"
#include "unicode.hpp"

namespace rlloop::tokenizer_detail {

void MergeTable::build(const std::vector<Entry>& entries) {
  std::size_t cap = 16;
  while (cap < entries.size() * 2) cap <<= 1;
  slots_.assign(cap, Entry{kEmpty, 0, 0});
  mask_ = cap - 1;
  shift_ = 64 - std::countr_zero(cap);
  for (const Entry& e : entries) {
    std::size_t i = slot(e.key);
    while (slots_[i].key != kEmpty && slots_[i].key != e.key) i = (i + 1) & mask_;
    if (slots_[i].key == kEmpty) slots_[i] = e;  // a repeated pair keeps its first (lowest) rank
  }
}

BpeTokenizer::BpeTokenizer(BpeSpec spec)
    : source_(std::move(spec.source)), pattern_(spec.pattern), nfc_(spec.nfc), merge_by_rank_(spec.merge_by_rank) {
  auto fail = [&](const std::string& what) { throw invalid_argument("load_tokenizer: '" + source_ + "': " + what); };
  token_id max_id = -1;
  for (const auto& [bytes, id] : spec.vocab) max_id = std::max(max_id, id);
  for (const auto& t : spec.added_tokens) max_id = std::max(max_id, t.id);
  if (max_id < 0) fail("the vocabulary is empty");
  id_to_bytes_.resize(static_cast<std::size_t>(max_id) + 1);
  id_kind_.assign(id_to_bytes_.size(), 0);
  bytes_to_id_.reserve(spec.vocab.size());
  for (auto& [bytes, id] : spec.vocab) {
    if (id < 0) fail("token '" + bytes_to_byte_level(bytes) + "' has a negative id");
    if (id_kind_[id]) fail("id " + std::to_string(id) + " is used by two tokens");
    id_to_bytes_[id] = bytes;
    id_kind_[id] = 1;
    bytes_to_id_.emplace(std::move(bytes), id);
  }
  // Some trained vocabularies lack a few bytes (SmolLM2 has no token for 21 of them, such as 0x04 and 0xFF); a
  // vocabulary without the printable ASCII ones is not byte-level BPE at all.
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id_.end() && b >= '!' && b <= '~')
      fail("the vocabulary has no token for byte " + std::to_string(b) + " (not a byte-level BPE vocabulary)");
    byte_ids_[b] = it == bytes_to_id_.end() ? kNoToken : it->second;
  }
  std::vector<MergeTable::Entry> entries;
  entries.reserve(spec.merges.size());
  std::int32_t rank = 0;
  for (const auto& [a, b] : spec.merges) {
    auto ia = bytes_to_id_.find(a), ib = bytes_to_id_.find(b), im = bytes_to_id_.find(a + b);
    if (ia == bytes_to_id_.end() || ib == bytes_to_id_.end() || im == bytes_to_id_.end())
      fail("merge " + std::to_string(rank) + " ('" + bytes_to_byte_level(a) + "' '" + bytes_to_byte_level(b) +
           "') uses a token that is not in the vocabulary");
    entries.push_back({(static_cast<std::uint64_t>(static_cast<std::uint32_t>(ia->second)) << 32) |
                           static_cast<std::uint32_t>(ib->second),
                       rank++, im->second});
  }
  merges_.build(entries);
  for (auto& t : spec.added_tokens) {
    if (t.content.empty()) fail("added token " + std::to_string(t.id) + " has empty content");
    if (id_kind_[t.id] == 1 && id_to_bytes_[t.id] != t.content)
      fail("added token '" + t.content + "' reuses id " + std::to_string(t.id));
    id_to_bytes_[t.id] = t.content;
    id_kind_[t.id] = t.special ? 3 : 2;
    added_first_byte_[static_cast<unsigned char>(t.content[0])] = true;
    added_.push_back(std::move(t));
  }
  std::stable_sort(added_.begin(), added_.end(),
                   [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  if (spec.eos_token) {
    eos_ = token_to_id(*spec.eos_token);
    if (!eos_) fail("eos token '" + *spec.eos_token + "' is not in the vocabulary");
  }
}

const AddedToken* BpeTokenizer::match_added(std::string_view text, std::size_t i, bool allow_special) const {
  if (!added_first_byte_[static_cast<unsigned char>(text[i])]) return nullptr;
  for (const AddedToken& t : added_)
    if ((allow_special || !t.special) && text.compare(i, t.content.size(), t.content) == 0) return &t;
  return nullptr;
}

std::vector<token_id> BpeTokenizer::encode(std::string_view text, bool allow_special) const {
  std::vector<token_id> out;
  out.reserve(text.size() / 3 + 4);
  std::size_t segment = 0;
  for (std::size_t i = 0; i < text.size();) {
    if (const AddedToken* t = match_added(text, i, allow_special)) {
      encode_ordinary(text.substr(segment, i - segment), out);
      out.push_back(t->id);
      i += t->content.size();
      segment = i;
    } else {
      ++i;
    }
  }
  encode_ordinary(text.substr(segment), out);
  return out;
}

void BpeTokenizer::encode_ordinary(std::string_view text, std::vector<token_id>& out) const {
  if (text.empty()) return;
  std::string normalized;
  if (nfc_ && !trivially_nfc(text)) {
    normalized = nfc(text);
    text = normalized;
  }
  split_pieces(pattern_, text, [&](std::size_t b, std::size_t e) { encode_piece(text.substr(b, e - b), out); });
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<token_id>& out) const {
  if (piece.size() == 1) {
    if (const token_id id = byte_ids_[static_cast<unsigned char>(piece[0])]; id != kNoToken) out.push_back(id);
    return;
  }
  const bool cacheable = piece.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    if (auto it = cache_.find(piece); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<token_id> word = merge_by_rank_ ? merge_by_rank(piece) : merge_by_table(piece);
  out.insert(out.end(), word.begin(), word.end());
  if (cacheable) {
    std::lock_guard lock(cache_mutex_);
    if (cache_.size() >= kCacheMaxEntries) cache_.clear();
    cache_.emplace(std::string(piece), std::move(word));
  }
}

std::vector<token_id> BpeTokenizer::merge_by_table(std::string_view piece) const {
  std::vector<token_id> word(piece.size());
  for (std::size_t k = 0; k < piece.size(); ++k) word[k] = byte_ids_[static_cast<unsigned char>(piece[k])];
  // Repeatedly apply the lowest-ranked merge present, to every non-overlapping occurrence left to right:
  // the procedure of the original GPT-2 encoder, which the Hugging Face implementation reproduces.
  while (word.size() > 1) {
    std::int32_t best = std::numeric_limits<std::int32_t>::max();
    token_id a = 0, b = 0, merged = 0;
    for (std::size_t k = 0; k + 1 < word.size(); ++k) {
      if (word[k] == kNoToken || word[k + 1] == kNoToken) continue;
      const MergeTable::Entry* m = merges_.find(word[k], word[k + 1]);
      if (m && m->rank < best) best = m->rank, a = word[k], b = word[k + 1], merged = m->merged;
    }
    if (best == std::numeric_limits<std::int32_t>::max()) break;
    std::size_t o = 0;
    for (std::size_t k = 0; k < word.size();) {
      if (k + 1 < word.size() && word[k] == a && word[k + 1] == b) {
        word[o++] = merged;
        k += 2;
      } else {
        word[o++] = word[k++];
      }
    }
    word.resize(o);
  }
  // A byte without a token yields nothing; it still kept its neighbours from merging across it, as in llama.cpp.
  std::erase(word, kNoToken);
  return word;
}

std::vector<token_id> BpeTokenizer::merge_by_rank(std::string_view piece) const {
  // A piece that is a token is that token, as tiktoken looks it up before merging (the merges need not reach it).
  if (auto it = bytes_to_id_.find(piece); it != bytes_to_id_.end()) return {it->second};
  // tiktoken's rule: the adjacent pair whose bytes are the token of the lowest rank merges, the leftmost of equal
  // ones. The parts are a list over byte offsets (part k spans [k, next[k])) and the candidate pairs a heap of
  // (rank, start): n log n where rescanning every pair after each merge would be n^2 (a long run of one symbol is
  // one piece). A popped pair is current when its part still starts there and its rank is the pair's now (a rank
  // names one token's bytes, so the same rank is the same pair).
  constexpr token_id kNone = std::numeric_limits<token_id>::max();
  const std::size_t n = piece.size();
  std::vector<std::size_t> next(n), prev(n);
  for (std::size_t k = 0; k < n; ++k) next[k] = k + 1, prev[k] = k - 1;  // prev[0] wraps: no predecessor
  std::vector<bool> starts(n, true);
  auto pair_rank = [&](std::size_t k) {
    if (next[k] >= n) return kNone;
    const std::size_t end = next[next[k]];
    auto it = bytes_to_id_.find(piece.substr(k, end - k));
    return it == bytes_to_id_.end() ? kNone : it->second;
  };
  std::vector<token_id> rank(n);
  using Candidate = std::pair<token_id, std::size_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto update = [&](std::size_t k) {
    rank[k] = pair_rank(k);
    if (rank[k] != kNone) heap.emplace(rank[k], k);
  };
  for (std::size_t k = 0; k < n; ++k) update(k);
  while (!heap.empty()) {
    const auto [r, k] = heap.top();
    heap.pop();
    if (!starts[k] || rank[k] != r) continue;  // a pair that changed since
    const std::size_t q = next[k];
    starts[q] = false;
    next[k] = next[q];
    if (next[k] < n) prev[next[k]] = k;
    update(k);
    if (k > 0) update(prev[k]);
  }
  std::vector<token_id> word;
  for (std::size_t k = 0; k < n; k = next[k]) {
    auto it = bytes_to_id_.find(piece.substr(k, next[k] - k));
    if (it != bytes_to_id_.end()) word.push_back(it->second);  // every byte is a token of a tiktoken vocabulary
  }
  return word;
}

std::string BpeTokenizer::decode(std::span<const token_id> ids, bool skip_special) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (token_id id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= id_to_bytes_.size() || id_kind_[id] == 0)
      throw invalid_argument("decode: token id " + std::to_string(id) + " is out of range [0, " +
                             std::to_string(id_to_bytes_.size()) + ") or unused in '" + source_ + "'");
    if (skip_special && id_kind_[id] == 3) continue;
    out.append(id_to_bytes_[id]);
  }
  return out;
}

std::optional<token_id> BpeTokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : added_)
    if (t.content == token) return t.id;
  // Accept both the vocab-file spelling ("Ġthe") and the raw text (" the").
  if (auto raw = byte_level_to_bytes(token))
    if (auto it = bytes_to_id_.find(*raw); it != bytes_to_id_.end()) return it->second;
  if (auto it = bytes_to_id_.find(token); it != bytes_to_id_.end()) return it->second;
  return std::nullopt;
}

}  // namespace rlloop::tokenizer_detail
