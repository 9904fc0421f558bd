// OpenAI-compatible sampling on live training sessions: GET /v1/models, POST /v1/chat/completions and
// /v1/completions (model = a session name or one of the tenant's checkpoint ARNs), and the SageMaker pass-through
// POST /training-sessions/{name}/sample[-with-response-stream]. Requests run as sampling operations in the
// session's queue, so they are ordered with training and billed like any other; `usage` is exactly what was billed.
// Streaming sends the sampled tokens as server-sent events once the sample is done (the engine samples a whole
// batch at a time), decoded with a StreamDecoder so no event carries half a UTF-8 character.
#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include <rlloop/chat.hpp>
#include <rlloop/tokenizer.hpp>

#include "server/api_impl.hpp"
#include "wire/openai.hpp"

namespace rlloop::server {

namespace {

using wire::openai::Request;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::int64_t unix_now() { return static_cast<std::int64_t>(now_seconds()); }

// The training session a checkpoint belongs to: its model-package ARN ends "model-package/<session>/<n>"
// (SessionHost::add_checkpoint). nullopt for an ARN of another shape.
std::optional<std::string> checkpoint_session(const std::string& arn) {
  constexpr std::string_view marker = "model-package/";
  const auto at = arn.find(marker);
  if (at == std::string::npos) return std::nullopt;
  const std::string tail = arn.substr(at + marker.size());
  return tail.substr(0, tail.rfind('/'));
}

// Tokenizers and chat renderers are loaded once per tokenizer spec and shared (both are immutable).
struct ModelText {
  std::shared_ptr<const Tokenizer> tokenizer;
  std::shared_ptr<const ChatRenderer> renderer;
};

ModelText model_text(const SessionInfo& info) {
  static std::mutex mu;
  static std::map<std::string, ModelText> cache;
  std::lock_guard lock(mu);
  const std::string key = info.tokenizer + "|" + info.chat_renderer;
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  ModelText m;
  m.tokenizer = load_tokenizer(info.tokenizer);
  try {
    m.renderer = make_chat_renderer(default_chat_renderer(info.tokenizer, info.chat_renderer), m.tokenizer);
  } catch (const invalid_argument&) {
    m.renderer = make_chat_renderer("role_colon", m.tokenizer);  // a tokenizer without the format's special tokens
  }
  return cache[key] = m;
}

// One sampled sequence as OpenAI shows it: the tokens (without the stop token) for logprobs, the visible text
// and, for streaming, the piece of it each token adds (the pieces concatenate to `text`).
struct Choice {
  std::vector<token_id> tokens;
  std::vector<double> logprobs;
  std::vector<std::string> pieces;
  std::string text;
  std::string finish_reason;
};

// Cuts text at the first of the caller's stop strings (OpenAI leaves the stop sequence out).
bool cut_at_stop(std::string& text, const std::vector<std::string>& stops) {
  std::size_t cut = std::string::npos;
  for (const auto& s : stops) cut = std::min(cut, text.find(s));
  if (cut == std::string::npos) return false;
  text.resize(cut);
  return true;
}

// Presents byte pieces as "tokens" 0..n-1, so StreamDecoder turns any byte window into valid UTF-8 pieces with
// the same rules it applies to a model's tokens.
class BytePieces final : public Tokenizer {
 public:
  explicit BytePieces(std::vector<std::string> pieces) : pieces_(std::move(pieces)) {}
  std::vector<token_id> encode(std::string_view, bool) const override { return {}; }
  std::string decode(std::span<const token_id> ids, bool) const override {
    std::string out;
    for (token_id id : ids) out += pieces_.at(static_cast<std::size_t>(id));
    return out;
  }
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(pieces_.size()); }
  std::optional<token_id> token_to_id(std::string_view) const override { return std::nullopt; }
  std::optional<token_id> eos_token_id() const override { return std::nullopt; }

 private:
  std::vector<std::string> pieces_;
};

Choice make_choice(const SampledSequence& seq, const Request& r, const ModelText& m,
                   const std::vector<token_id>& stop_ids) {
  Choice c;
  for (std::size_t i = 0; i < seq.tokens.size(); ++i) {
    if (std::find(stop_ids.begin(), stop_ids.end(), seq.tokens[i]) != stop_ids.end()) break;
    c.tokens.push_back(seq.tokens[i]);
    c.logprobs.push_back(i < seq.logprobs.size() ? seq.logprobs[i] : 0.0);
  }
  // The raw bytes of each token, and the part of them that is the answer: the renderer's parse of a chat turn
  // (its header space and end-of-turn removed), or all of a completion; then the caller's stop strings.
  std::vector<std::string> raw;
  std::string all;
  for (token_id t : c.tokens) all += raw.emplace_back(m.tokenizer->decode(std::span<const token_id>(&t, 1)));
  const std::string content = r.chat ? m.renderer->parse_response(seq.tokens).message.content : all;
  // The answer ends the turn (after a reasoning part, which may say the same words): found from the end.
  std::size_t start = all.rfind(content);
  std::string visible = content;
  const bool user_stop = cut_at_stop(visible, r.params.stop);
  c.finish_reason = seq.stop_reason == StopReason::stop || user_stop ? "stop" : "length";
  if (start == std::string::npos) raw = {visible}, start = 0, all = visible;  // not a window: one piece
  const std::size_t end = start + visible.size();
  std::size_t pos = 0;
  for (auto& piece : raw) {  // clip each token's bytes to [start, end)
    const std::size_t begin = pos;
    pos += piece.size();
    const std::size_t a = std::max(begin, start), b = std::min(pos, end);
    piece = a < b ? piece.substr(a - begin, b - a) : std::string();
  }
  const std::size_t n = raw.size();
  BytePieces bytes(std::move(raw));
  StreamDecoder d(bytes);
  for (std::size_t k = 0; k < n; ++k) {
    std::string piece = d.push(static_cast<token_id>(k));
    if (k + 1 == n) piece += d.finish();
    c.text += piece;
    c.pieces.push_back(std::move(piece));
  }
  return c;
}

json token_entry(const Tokenizer& tok, token_id id, double lp) {
  const std::string piece = tok.decode(std::span<const token_id>(&id, 1));
  json bytes = json::array();
  for (unsigned char b : piece) bytes.push_back(b);
  return {{"token", piece}, {"logprob", lp}, {"bytes", bytes}, {"top_logprobs", json::array()}};
}

json chat_logprobs(const Tokenizer& tok, const Choice& c, std::size_t from, std::size_t to) {
  json content = json::array();
  for (std::size_t i = from; i < to; ++i) content.push_back(token_entry(tok, c.tokens[i], c.logprobs[i]));
  return {{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs(const Tokenizer& tok, const Choice& c, std::size_t from, std::size_t to) {
  json tokens = json::array(), lps = json::array(), offsets = json::array();
  std::size_t offset = 0;
  for (std::size_t i = from; i < to; ++i) {
    const std::string piece = tok.decode(std::span<const token_id>(&c.tokens[i], 1));
    tokens.push_back(piece);
    lps.push_back(c.logprobs[i]);
    offsets.push_back(offset);
    offset += piece.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", nullptr}, {"text_offset", offsets}};
}

// The request body in the sampler's terms; a bad field is OpenAI's invalid_request_error naming it.
Request parse_request(const std::string& body, bool chat, bool model_required) {
  try {
    return wire::openai::parse_request(body, chat, model_required);
  } catch (const invalid_argument& e) {
    throw api_error("invalid_request_error", 400, e.what());
  }
}

}  // namespace

bool is_openai_path(const std::string& path) {
  if (path == "/v1/models" || path == "/v1/chat/completions" || path == "/v1/completions") return true;
  const std::string prefix = "/training-sessions/";
  return path.rfind(prefix, 0) == 0 && (path.ends_with("/sample") || path.ends_with("/sample-with-response-stream"));
}

bool is_openai_client_path(const std::string& path) {
  return is_openai_path(path) && path.rfind("/training-sessions/", 0) != 0;
}

namespace {
// The request field an error message names: rlloop's parsers start with it, quoted ("'temperature' must be ...")
// or followed by a colon ("messages: ..."); a field path keeps its first segment, as OpenAI's param does.
json param_of(const std::string& message) {
  std::string field;
  if (message.starts_with('\'')) {
    const auto close = message.find('\'', 1);
    if (close != std::string::npos) field = message.substr(1, close - 1);
  } else if (const auto colon = message.find(": "); colon != std::string::npos) {
    field = message.substr(0, colon);
  }
  field = field.substr(0, field.find_first_of(".["));
  const bool is_name = !field.empty() && std::all_of(field.begin(), field.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
  return is_name ? json(field) : json(nullptr);
}
}  // namespace

json openai_error_body(const api_error& e) {
  // OpenAI's own codes travel as `code` under the type its API gives them; a request error has no code but names
  // its field in `param`. The service's other errors (throttling, conflicts, AWS-named ones) keep their name in
  // both, as before.
  if (e.code() == "invalid_request_error")
    return {{"message", e.what()}, {"type", "invalid_request_error"}, {"param", param_of(e.what())}, {"code", nullptr}};
  if (e.code() == "invalid_api_key" || e.code() == "model_not_found")
    return {{"message", e.what()}, {"type", "invalid_request_error"}, {"param", nullptr}, {"code", e.code()}};
  return {{"message", e.what()}, {"type", e.code()}, {"param", nullptr}, {"code", e.code()}};
}

namespace {
// Checks what can be checked before a sampling operation is queued (with s->mu held).
void check_sampleable_locked(const SessionHost& s, const SampleRequest& request) {
  s.require_takes_operations_locked();
  try {
    // Every bound (rlloop/limits.hpp), and now the rendered prompt against the model's vocabulary and context.
    validate(request, Naming::openai_api(), ModelShape{s.info.max_position_embeddings, s.vocab_size});
  } catch (const invalid_argument& e) {
    throw api_error("invalid_request_error", 400, e.what());
  }
}

// The error of a sampling operation that did not complete (with s->mu held); none when it completed.
std::optional<std::string> sampling_failure_locked(const OperationRecord& op) {
  if (status_of(op.state) == wire::OperationStatus::completed && op.sample_result) return std::nullopt;
  return "sampling failed: " + op.state.value("errorDetails", op.state.value("status", ""));
}
}  // namespace

void Api::Impl::sample_now(const std::shared_ptr<SessionHost>& s, SampleRequest request, const Reply& reply,
                           std::function<Response(const OperationRecord&)> then) {
  auto op = std::make_shared<OperationRecord>();
  op->sampling = true;
  std::lock_guard lock(s->mu);
  check_sampleable_locked(*s, request);
  op->op = wire::SamplingOperation{std::move(request)};
  op->id = new_operation_id();
  // The worker that finishes the sample only posts the answer; it is made on the reply's executor.
  s->on_done_locked(*op, [s, op, reply, then = std::move(then)] {
    reply.post([s, op, then] {
      {
        std::lock_guard l(s->mu);
        if (auto failure = sampling_failure_locked(*op)) throw api_error("invalid_request_error", 400, *failure);
      }
      return then(*op);
    });
  });
  s->enqueue_locked(op);
}

void Api::Impl::stream_now(const std::shared_ptr<SessionHost>& s, SampleRequest request, const Reply& reply,
                           std::function<Response(const std::shared_ptr<OperationRecord>&)> stream) {
  auto op = std::make_shared<OperationRecord>();
  op->sampling = true;
  op->stream = std::make_shared<SampleStream>();
  {
    std::lock_guard lock(s->mu);
    check_sampleable_locked(*s, request);
    op->op = wire::SamplingOperation{std::move(request)};
    op->id = new_operation_id();
    s->on_done_locked(*op, [progress = op->stream] { progress->finish(); });
    s->enqueue_locked(op);
  }
  reply.post([op, stream = std::move(stream)] { return stream(op); });
}

namespace {
// The answer to a completed OpenAI / pass-through sample: one JSON body.
Response completion(const Request& r, const ModelText& m, const std::vector<token_id>& stop_ids,
                    const OperationRecord& op);
// Server-sent events following a sample while it decodes.
Response streamed_completion(const Request& r, const ModelText& m, const std::vector<token_id>& stop_ids,
                             std::size_t hold_back, std::shared_ptr<SessionHost> s,
                             std::shared_ptr<OperationRecord> op);
}  // namespace

namespace {

bool takes_operations(SessionHost& s) {
  std::lock_guard lock(s.mu);
  return s.takes_operations_locked();
}

// GET /v1/models: the tenant's live sessions, and the checkpoints of each.
Response list_models(Api::Impl& api, TenantState& t) {
  std::vector<std::shared_ptr<SessionHost>> mine;
  {
    std::lock_guard lock(api.mu);
    for (const auto& [key, s] : api.sessions)
      if (key.first == t.config.id) mine.push_back(s);
  }
  json data = json::array();
  std::set<std::string> names;
  for (auto& s : mine) {
    if (!takes_operations(*s)) continue;
    names.insert(s->name);
    data.push_back({{"id", s->name},
                    {"object", "model"},
                    {"created", static_cast<std::int64_t>(s->creation_time)},
                    {"owned_by", t.config.id}});
  }
  std::lock_guard lock(t.mu);
  for (const auto& [arn, p] : t.checkpoints) {
    const auto session = checkpoint_session(arn);
    if (session && names.count(*session))
      data.push_back({{"id", arn}, {"object", "model"}, {"created", 0}, {"owned_by", t.config.id}});
  }
  return Response{200, "application/json", {}, dump({{"object", "list"}, {"data", data}})};
}

// What a sampling request names: the parsed body, the live session, and the checkpoint's weights when it names
// one (a model-package ARN) instead of the session's own.
struct SampleTarget {
  Request request;
  std::shared_ptr<SessionHost> session;
  std::optional<std::string> model_path;
};

std::shared_ptr<SessionHost> find_live(Api::Impl& api, const TenantState& t, const std::string& name) {
  std::lock_guard lock(api.mu);
  auto it = api.sessions.find({t.config.id, name});
  if (it == api.sessions.end())
    throw api_error("model_not_found", 404,
                    "The model '" + name + "' does not exist (no live training session of that name)");
  return it->second;
}

// POST /training-sessions/{name}/sample[-with-response-stream]: the session by its path, a checkpoint by the
// X-Amzn-SageMaker-Model-Package header; a body with `prompt` and no `messages` is a completion, else a chat.
SampleTarget passthrough_target(Api::Impl& api, const sigv4::HttpRequest& req, const std::string& path,
                                TenantState& t) {
  const std::string rest = path.substr(std::string("/training-sessions/").size());
  const std::string name = rest.substr(0, rest.find('/'));
  try {
    validate_session_name(name, "trainingSessionName");
  } catch (const invalid_argument& e) {
    throw api_error("ValidationException", 400, e.what());
  }
  if (rest != name + "/sample" && rest != name + "/sample-with-response-stream")
    throw api_error("ResourceNotFoundException", 404, "no route for POST " + path);
  SampleTarget target;
  json peek = json::parse(req.body, nullptr, false);
  const bool chat = !(peek.is_object() && peek.contains("prompt") && !peek.contains("messages"));
  target.request = parse_request(req.body, chat, false);
  if (path.ends_with("-with-response-stream")) target.request.stream = true;
  target.session = find_live(api, t, name);
  if (auto pkg = req.header("X-Amzn-SageMaker-Model-Package")) {
    std::lock_guard lock(t.mu);
    if (!t.checkpoints.count(*pkg))
      throw api_error("ResourceNotFoundException", 404, "model package " + *pkg + " does not exist");
    target.model_path = *pkg;
  }
  target.request.model = target.model_path.value_or(name);
  return target;
}

// POST /v1/chat/completions or /v1/completions: `model` names a live session or one of its checkpoints.
SampleTarget openai_target(Api::Impl& api, const sigv4::HttpRequest& req, const std::string& path, TenantState& t) {
  SampleTarget target;
  target.request = parse_request(req.body, path == "/v1/chat/completions", true);
  const std::string& model = target.request.model;
  if (model.rfind("arn:", 0) != 0) {
    target.session = find_live(api, t, model);
    return target;
  }
  {
    std::lock_guard lock(t.mu);
    if (!t.checkpoints.count(model))
      throw api_error("model_not_found", 404, "The model '" + model + "' does not exist");
  }
  const auto session = checkpoint_session(model);
  if (!session) throw api_error("model_not_found", 404, "The model '" + model + "' is not a checkpoint ARN");
  target.session = find_live(api, t, *session);
  target.model_path = model;
  return target;
}

// The sampler's request for an OpenAI request: the rendered chat (or the prompt's tokens) and every way it
// stops — the caller's strings, the chat format's end of turn, the tokenizer's and the model's end of text.
struct PreparedSample {
  SampleRequest request;
  std::vector<token_id> stop_ids;
};

PreparedSample prepare_sample(const Request& r, const ModelText& m, const SessionInfo& info,
                              const std::optional<std::string>& model_path) {
  PreparedSample p;
  SampleRequest& sreq = p.request;
  sreq.num_samples = r.n;
  sreq.params = r.params;
  sreq.model_path = model_path;
  if (r.chat) {
    try {
      sreq.prompt = m.renderer->build_generation_prompt(r.messages);
    } catch (const invalid_argument& e) {
      throw api_error("invalid_request_error", 400, std::string("messages: ") + e.what());
    }
    for (const auto& stop : m.renderer->stop_sequences()) sreq.params.stop.push_back(stop);
    p.stop_ids = m.renderer->stop_token_ids();
  } else {
    sreq.prompt = ModelInput::from_tokens(r.prompt ? m.tokenizer->encode(*r.prompt, false) : r.prompt_tokens);
    if (auto eos = m.tokenizer->eos_token_id()) p.stop_ids.push_back(*eos);
  }
  if (info.eos_token_id) p.stop_ids.push_back(*info.eos_token_id);
  sreq.params.stop_token_ids = p.stop_ids;
  return p;
}

}  // namespace

Handled Api::Impl::openai(const sigv4::HttpRequest& req, const std::string& path, const std::shared_ptr<TenantState>& t,
                          const Reply& reply) {
  if (path == "/v1/models") {
    if (req.method != "GET") throw api_error("invalid_request_error", 405, "use GET /v1/models");
    return list_models(*this, *t);
  }
  if (req.method != "POST") throw api_error("invalid_request_error", 405, "use POST " + path);
  const bool passthrough = path.rfind("/training-sessions/", 0) == 0;
  SampleTarget target = passthrough ? passthrough_target(*this, req, path, *t) : openai_target(*this, req, path, *t);
  const auto& s = target.session;
  SessionInfo info;
  {
    std::lock_guard lock(s->mu);
    info = s->info;
  }
  if (info.tokenizer.empty())
    throw api_error("ConflictException", 409, "Training session " + s->name + " is not running yet");
  const ModelText m = model_text(info);
  PreparedSample prepared = prepare_sample(target.request, m, info, target.model_path);
  const Request& r = target.request;
  const auto& stop_ids = prepared.stop_ids;

  if (r.stream) {
    // Tokens that a later one could still change (completing a stop string, a UTF-8 character or the chat
    // format's end of turn) are held back: a stop string of L bytes spans at most L tokens.
    std::size_t hold_back = 1;
    for (const auto& stop : prepared.request.params.stop) hold_back = std::max(hold_back, stop.size() + 1);
    stream_now(s, std::move(prepared.request), reply,
               [s, r, m, stop_ids, hold_back](const std::shared_ptr<OperationRecord>& op) {
                 return streamed_completion(r, m, stop_ids, hold_back, s, op);
               });
  } else {
    sample_now(s, std::move(prepared.request), reply,
               [r, m, stop_ids](const OperationRecord& op) { return completion(r, m, stop_ids, op); });
  }
  return std::nullopt;
}

namespace {
Response completion(const Request& r, const ModelText& m, const std::vector<token_id>& stop_ids,
                    const OperationRecord& op) {
  std::vector<Choice> choices;
  for (const auto& seq : op.sample_result->sequences) choices.push_back(make_choice(seq, r, m, stop_ids));
  const TokenUsage billed = op.billed;
  const std::string id = (r.chat ? "chatcmpl-" : "cmpl-") + op.id;
  const std::int64_t created = unix_now();
  const std::string object = r.chat ? "chat.completion" : "text_completion";

  json out_choices = json::array();
  for (std::size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json lp = r.logprobs ? (r.chat ? chat_logprobs(*m.tokenizer, c, 0, c.tokens.size())
                                   : completion_logprobs(*m.tokenizer, c, 0, c.tokens.size()))
                         : json(nullptr);
    if (r.chat)
      out_choices.push_back({{"index", i},
                             {"message", {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}}},
                             {"logprobs", lp},
                             {"finish_reason", c.finish_reason}});
    else
      out_choices.push_back({{"index", i}, {"text", c.text}, {"logprobs", lp}, {"finish_reason", c.finish_reason}});
  }
  json out{{"id", id},
           {"object", object},
           {"created", created},
           {"model", r.model},
           {"system_fingerprint", "rlloop"},
           {"choices", out_choices},
           {"usage", wire::openai::usage_to_json(billed)}};
  return Response{200, "application/json", {}, dump(out)};
}

// The chunks of a streamed answer (OpenAI's server-sent events): per choice its role (chat), a chunk per token
// that adds text (or carries a logprob), its finish_reason; then usage and [DONE]. Each returns false once the
// client is gone.
class ChunkWriter {
 public:
  ChunkWriter(const Request& r, const Tokenizer& tok, std::string id, const StreamWriter& write)
      : r_(r), tok_(tok), id_(std::move(id)), created_(unix_now()), write_(write) {}

  bool role(std::size_t i) {
    if (!r_.chat) return true;
    return event(json::array({{{"index", i},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}}));
  }
  // Pieces [from, to) of choice i.
  bool pieces(std::size_t i, const Choice& c, std::size_t from, std::size_t to) {
    for (std::size_t k = from; k < to && k < c.pieces.size(); ++k) {
      if (c.pieces[k].empty() && !r_.logprobs) continue;
      const std::size_t t1 = std::min(k + 1, c.tokens.size()), t0 = std::min(k, t1);
      json lp = r_.logprobs ? (r_.chat ? chat_logprobs(tok_, c, t0, t1) : completion_logprobs(tok_, c, t0, t1))
                            : json(nullptr);
      json ch =
          r_.chat
              ? json{{"index", i}, {"delta", {{"content", c.pieces[k]}}}, {"logprobs", lp}, {"finish_reason", nullptr}}
              : json{{"index", i}, {"text", c.pieces[k]}, {"logprobs", lp}, {"finish_reason", nullptr}};
      if (!event(json::array({ch}))) return false;
    }
    return true;
  }
  bool finish(std::size_t i, const Choice& c) {
    return event(json::array(
        {r_.chat
             ? json{{"index", i}, {"delta", json::object()}, {"logprobs", nullptr}, {"finish_reason", c.finish_reason}}
             : json{{"index", i}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", c.finish_reason}}}));
  }
  bool usage(const TokenUsage& billed) {
    if (!r_.include_usage) return true;
    const json u = wire::openai::usage_to_json(billed);
    return event(json::array(), &u);
  }
  bool error(const std::string& message) {
    return write_("data: " + dump(json{{"error", {{"message", message}, {"type", "server_error"}}}}) + "\n\n");
  }
  bool done() { return write_("data: [DONE]\n\n"); }

 private:
  bool event(json choices, const json* usage = nullptr) {
    json c{{"id", id_},
           {"object", r_.chat ? "chat.completion.chunk" : "text_completion"},
           {"created", created_},
           {"model", r_.model},
           {"system_fingerprint", "rlloop"},
           {"choices", std::move(choices)}};
    if (usage)
      c["usage"] = *usage;
    else if (r_.include_usage)
      c["usage"] = nullptr;
    return write_("data: " + dump(c) + "\n\n");
  }

  const Request& r_;
  const Tokenizer& tok_;
  std::string id_;
  std::int64_t created_;
  const StreamWriter& write_;
};

Response streamed_completion(const Request& r, const ModelText& m, const std::vector<token_id>& stop_ids,
                             std::size_t hold_back, std::shared_ptr<SessionHost> s,
                             std::shared_ptr<OperationRecord> op) {
  Response res;
  res.content_type = "text/event-stream";
  res.stream = [=](const StreamWriter& write) {
    ChunkWriter out(r, *m.tokenizer, (r.chat ? "chatcmpl-" : "cmpl-") + op->id, write);
    std::vector<std::size_t> sent;  // pieces sent per choice
    SampleStream& progress = *op->stream;
    std::uint64_t seen = 0;
    for (;;) {
      SampleResponse so_far;
      {
        std::unique_lock lock(progress.mu);
        progress.changed.wait(lock, [&] { return progress.done || progress.version != seen; });
        if (progress.done) break;
        seen = progress.version;
        so_far = progress.so_far;
      }
      // The pieces no later token can change, as the finished choice will have them.
      for (std::size_t i = 0; i < so_far.sequences.size(); ++i) {
        if (i == sent.size()) {
          if (!out.role(i)) return;
          sent.push_back(0);
        }
        const Choice c = make_choice(so_far.sequences[i], r, m, stop_ids);
        const std::size_t safe = c.pieces.size() > hold_back ? c.pieces.size() - hold_back : 0;
        if (safe <= sent[i]) continue;
        if (!out.pieces(i, c, sent[i], safe)) return;
        sent[i] = safe;
      }
    }
    TokenUsage billed;
    std::shared_ptr<SampleResponse> result;
    {
      std::lock_guard lock(s->mu);
      if (auto failure = sampling_failure_locked(*op)) {
        out.error(*failure);
        return;
      }
      billed = op->billed;
      result = op->sample_result;
    }
    for (std::size_t i = 0; i < result->sequences.size(); ++i) {
      if (i == sent.size()) {
        if (!out.role(i)) return;
        sent.push_back(0);
      }
      const Choice c = make_choice(result->sequences[i], r, m, stop_ids);
      if (!out.pieces(i, c, sent[i], c.pieces.size()) || !out.finish(i, c)) return;
    }
    if (out.usage(billed)) out.done();
  };
  return res;
}
}  // namespace

}  // namespace rlloop::server
