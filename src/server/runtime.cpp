// Runtime REST API (docs/wire.md): training and sampling operations, plus rlloop's read-only extensions
// (session info, base models, capabilities, usage).
#include <algorithm>
#include <chrono>
#include <optional>
#include <regex>
#include <type_traits>
#include <variant>

#include <rlloop/detail/visit.hpp>

#include <boost/asio/steady_timer.hpp>

#include "server/api_impl.hpp"

namespace rlloop::server {

namespace {
// The model package an operation names (loadState, loadWeightsForSampling, a sample or logprobs of saved weights).
std::optional<std::string> package_named(const std::variant<wire::TrainingOperation, wire::SamplingOperation>& op) {
  auto named = [](const auto& o) -> std::optional<std::string> {
    using T = std::decay_t<decltype(o)>;
    if constexpr (std::is_same_v<T, wire::LoadStateOp> || std::is_same_v<T, wire::LoadWeightsForSamplingOp>)
      return o.model_package_arn;
    else if constexpr (std::is_same_v<T, SampleRequest> || std::is_same_v<T, ComputeLogprobsRequest>)
      return o.model_path;
    else if constexpr (std::is_same_v<T, wire::ForwardOp> || std::is_same_v<T, wire::ForwardBackwardOp> ||
                       std::is_same_v<T, wire::OptimizerStepOp> || std::is_same_v<T, wire::SaveWeightsOp> ||
                       std::is_same_v<T, wire::SaveStateOp>)
      return std::nullopt;
    else
      static_assert(rlloop::detail::unhandled_alternative<T>, "an operation whose model package the runtime misses");
  };
  return std::visit([&](const auto& u) { return std::visit(named, u); }, op);
}

// What the wire reader could not check: the batch against the session's vocabulary, its experts and its loss's
// inputs, a prompt against the model's context. Throws invalid_argument.
void validate_submission(const std::variant<wire::TrainingOperation, wire::SamplingOperation>& op,
                         const SessionHost& s) {
  auto check = [&](const auto& o) {
    using T = std::decay_t<decltype(o)>;
    if constexpr (std::is_same_v<T, wire::ForwardOp> || std::is_same_v<T, wire::ForwardBackwardOp>) {
      validate_batch(o.data, o.loss.fn, s.vocab_size, s.info.experts);
    } else if constexpr (std::is_same_v<T, SampleRequest>) {
      // The bounds were checked by the wire reader; the model's vocabulary and context are known here.
      validate(o, Naming::sagemaker_at("operationConfig.sample"),
               ModelShape{s.info.max_position_embeddings, s.vocab_size});
      if (o.include_routed_experts && !s.info.experts.any())
        throw invalid_argument("operationConfig.sample.includeRoutedExperts: the model has no experts");
    } else if constexpr (std::is_same_v<T, ComputeLogprobsRequest>) {
      validate_model_input(o.prompt, s.vocab_size, "prompt: ");
    } else if constexpr (std::is_same_v<T, wire::OptimizerStepOp> || std::is_same_v<T, wire::SaveWeightsOp> ||
                         std::is_same_v<T, wire::SaveStateOp> || std::is_same_v<T, wire::LoadStateOp> ||
                         std::is_same_v<T, wire::LoadWeightsForSamplingOp>) {
      // checked whole by the wire reader
    } else {
      static_assert(rlloop::detail::unhandled_alternative<T>, "an operation the runtime does not validate");
    }
  };
  std::visit([&](const auto& u) { std::visit(check, u); }, op);
}
}  // namespace

namespace {

std::vector<std::string> segments(const std::string& path) {
  std::vector<std::string> out;
  std::size_t start = 1;
  while (start <= path.size()) {
    std::size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    out.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

Response json_response(const json& j) { return Response{200, "application/json", {}, j.dump()}; }

[[noreturn]] void not_found_error(const std::string& message) {
  throw api_error("ResourceNotFoundException", 404, message);
}

// An operation that is not (or no longer) there: one the session issued had its result expire (docs/wire.md,
// "Retention"); an operation of another kind or session is "not found", as the spec says.
[[noreturn]] void operation_not_found(const SessionHost& s, const std::string& id) {
  if (s.issued_locked(id)) {
    const Retention& r = s.retention();
    not_found_error("operation " + id + " of training session " + s.name +
                    " expired: a session keeps the results of its " + std::to_string(r.results) +
                    " most recent finished operations, each for " + std::to_string(r.result_age.count()) + " s");
  }
  not_found_error("operation " + id + " does not exist in training session " + s.name);
}

// rlloop's long-poll on Get*OperationResult: `?waitSeconds=N` (0-20, as SQS's WaitTimeSeconds) answers as soon
// as the operation is terminal, or after N seconds with its current state. A client then learns of a result
// without polling late or often (bench/server). Other query parameters are ignored. Without the parameter:
// nullopt (the server's Options::default_result_wait applies).
std::optional<std::chrono::milliseconds> wait_seconds(const std::string& target) {
  const auto v = query_value(target, "waitSeconds");
  if (!v) return std::nullopt;
  if (v->empty() || v->size() > 2 || !std::all_of(v->begin(), v->end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoi(*v) > 20)
    throw api_error("ValidationException", 400, "waitSeconds must be an integer in [0, 20]");
  return std::chrono::seconds(std::stoi(*v));
}

// A long-poll answers with its operation's state at the first of: the operation becomes terminal (the session
// worker wakes it), its deadline (a timer on the reply's executor), Api::interrupt_waits. No thread waits for
// it. The caller holds s->mu and saw the operation not terminal.
void long_poll(Api::Impl& im, const std::shared_ptr<SessionHost>& s, const std::shared_ptr<OperationRecord>& op,
               std::chrono::milliseconds wait, const Reply& reply) {
  auto timer = std::make_shared<boost::asio::steady_timer>(reply.executor(), wait);
  // Only the timer's own pending wait owns it, so it always dies on its executor; the answer, made there,
  // cancels it when another wake-up came first.
  auto answer = [s, op, weak = std::weak_ptr(timer)] {
    if (auto t = weak.lock()) t->cancel();
    std::lock_guard lock(s->mu);
    return json_response(op->state);
  };
  auto wake = [reply, answer] { reply.post(answer); };
  timer->async_wait([timer, wake](const boost::system::error_code&) { wake(); });
  s->on_done_locked(*op, wake);
  if (!im.add_poll(timer, wake)) wake();  // the server is closing: answer now
}

}  // namespace

std::string Api::Impl::new_operation_id() {
  // Unique within the process (prefixed by its start time); never journaled, as these samples are never listed.
  static const std::string boot = std::to_string(static_cast<long long>(now_seconds() * 1000) % 100000000);
  return "op-" + boot + "-" + std::to_string(next_operation++);
}

json Api::Impl::usage_report(const std::shared_ptr<TenantState>& t) {
  json sessions_json = json::array();
  {
    std::lock_guard lock(mu);
    for (const auto& [key, s] : sessions) {
      if (key.first != t->config.id) continue;
      std::lock_guard slock(s->mu);
      sessions_json.push_back({{"trainingSessionName", s->name}, {"usage", wire::to_json(s->usage)}});
    }
  }
  std::lock_guard lock(t->mu);
  return {{"tenant", t->config.id}, {"usage", wire::to_json(t->usage)}, {"sessions", std::move(sessions_json)}};
}

Handled Api::Impl::session_info(SessionHost& s) {
  std::shared_ptr<AnySession> session;
  {
    std::lock_guard lock(s.mu);
    session = s.session;
  }
  if (!session) throw api_error("ConflictException", 409, "Training session " + s.name + " has no live model");
  json info = wire::to_json(session->info());
  info["usage"] = wire::to_json(session->usage());
  return json_response(info);
}

Handled Api::Impl::get_operation(const sigv4::HttpRequest& req, const std::shared_ptr<SessionHost>& s,
                                 const std::string& id, bool sampling, const Reply& reply) {
  if (!is_label(id, limits::operation_id_max))
    throw api_error(
        "ValidationException", 400,
        "operationId: must be 1-" + std::to_string(limits::operation_id_max) + " characters of [a-zA-Z0-9-]");
  const std::chrono::milliseconds wait = wait_seconds(req.target).value_or(options.default_result_wait);
  std::lock_guard lock(s->mu);
  const std::shared_ptr<OperationRecord> op = s->find_operation_locked(id, now_seconds());
  if (!op) operation_not_found(*s, id);
  if (op->sampling != sampling) not_found_error("operation " + id + " does not exist in training session " + s->name);
  if (wait.count() <= 0 || terminal_state(op->state)) return json_response(op->state);
  long_poll(*this, s, op, wait, reply);
  return std::nullopt;
}

Handled Api::Impl::submit_operation(const sigv4::HttpRequest& req, const std::shared_ptr<TenantState>& t,
                                    SessionHost& s, bool training) {
  const bool sampling = !training;
  json body;
  // Every json::exception, not only parse_error: a number like 1e999 throws out_of_range, and is as much the
  // client's mistake (a 400, not a 500).
  try {
    body = json::parse(req.body);
  } catch (const json::exception& e) {
    throw api_error("ValidationException", 400, std::string("request body is not valid JSON: ") + e.what());
  }
  auto op = std::make_shared<OperationRecord>();
  op->sampling = sampling;
  op->retrievable = true;
  op->body = body;
  std::optional<std::string> token;
  std::int64_t seq = -1;
  try {
    if (training) {
      auto r = wire::execute_training_request_from_json(body);
      token = r.client_token;
      seq = r.sequence_number;
      op->op = std::move(r.operation);
      op->digest = request_digest(std::to_string(seq) + ":" + body["operationConfig"].dump());
    } else {
      op->op = wire::execute_sampling_request_from_json(body);
      // The API has no clientToken on sampling requests, so rlloop takes one from the
      // Idempotency-Key header (IETF httpapi draft): a header the real service ignores, unlike an unknown
      // body member. A retried sample then runs, and is billed, once.
      if (auto key = req.header("Idempotency-Key")) {
        validate_label(*key, limits::client_token_max, "Idempotency-Key");
        token = *key;
      }
      op->digest = request_digest("sampling:" + body["operationConfig"].dump());
    }
  } catch (const invalid_argument& e) {
    throw api_error("ValidationException", 400, e.what());
  }
  return json_response({{"operationId", accept_operation(t, s, op, token,
                                                        training ? "clientToken" : "Idempotency-Key", seq)}});
}

std::string Api::Impl::accept_operation(const std::shared_ptr<TenantState>& t, SessionHost& s,
                                        const std::shared_ptr<OperationRecord>& op,
                                        const std::optional<std::string>& token, const std::string& token_field,
                                        std::int64_t seq) {
  const bool training = !op->sampling;
  // A model package the tenant does not own (another account's, or none) is known now: a 404 at submission, not
  // an operation that fails later.
  if (const auto arn = package_named(op->op)) {
    std::lock_guard tenant_lock(t->mu);
    if (!t->checkpoints.count(*arn))
      throw api_error("ResourceNotFoundException", 404,
                      "model package '" + *arn + "' does not exist in this account");
  }

  std::lock_guard lock(s.mu);
  const double now = now_seconds();
  s.require_takes_operations_locked();
  if (token) {
    if (const ClientTokenRecord* known = s.find_client_token_locked(*token, now)) {
      if (known->digest != op->digest)
        throw api_error("ValidationException", 400,
                        token_field + " " + *token + " was already used with different parameters");
      return known->operation_id;  // an idempotent retry: not executed twice
    }
  }
  // Checked before queuing so that a bad batch is a 400 now, not a Failed operation later.
  try {
    validate_submission(op->op, s);
  } catch (const invalid_argument& e) {
    throw api_error("ValidationException", 400, e.what());
  }
  if (training) {
    if (seq <= s.last_sequence_number)
      throw api_error("ValidationException", 400,
                      "sequenceNumber " + std::to_string(seq) + " must be greater than the last received " +
                          std::to_string(s.last_sequence_number));
    s.last_sequence_number = seq;
  }
  op->id = s.new_operation_id_locked();
  s.accept_locked(op, token, seq, now);
  return op->id;
}

Handled Api::Impl::runtime(const sigv4::HttpRequest& req, const std::string& path,
                           const std::shared_ptr<TenantState>& t, const Reply& reply) {
  if (is_openai_path(path)) return openai(req, path, t, reply);
  const auto seg = segments(path);
  const bool get = req.method == "GET", post = req.method == "POST";
  if (seg.size() == 2 && seg[0] == "v1" && get) {
    if (seg[1] == "usage") return json_response(usage_report(t));
    if (seg[1] == "base-models") return json_response({{"baseModels", backend.list_base_models()}});
    if (seg[1] == "capabilities") return json_response(wire::to_json(backend.capabilities()));
  }
  if (seg.size() < 4 || seg[0] != "v1" || seg[1] != "training-sessions")
    not_found_error("no route for " + req.method + " " + path);
  const std::string& name = seg[2];
  try {
    validate_session_name(name, "trainingSessionName");
  } catch (const invalid_argument& e) {
    throw api_error("ValidationException", 400, e.what());
  }

  std::shared_ptr<SessionHost> s;
  {
    std::lock_guard lock(mu);
    auto it = sessions.find({t->config.id, name});
    if (it == sessions.end()) not_found_error("Training session " + name + " does not exist");
    s = it->second;
  }
  const std::string& kind = seg[3];
  const bool training = kind == "operations", sampling = kind == "sampling-operations";

  if (seg.size() == 4 && kind == "info" && get) return session_info(*s);

  if (seg.size() == 5 && get && (training || sampling)) return get_operation(req, s, seg[4], sampling, reply);

  if (seg.size() == 4 && post && (training || sampling)) return submit_operation(req, t, *s, training);
  not_found_error("no route for " + req.method + " " + path);
}

}  // namespace rlloop::server
