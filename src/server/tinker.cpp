// Tinker's routes (/api/v1/..., docs/tinker_protocol.md, section 0): sessions, training models,
// samplers and futures over the hosted sessions the SageMaker routes serve, so both protocols share the engine loop,
// the journal, billing and tenants. Requests are JSON except forward_backward (protobuf; JSON from tinker 0.12); the
// results of forward_backward and asample are protobuf when the client asks for it (0.38), else JSON (0.12). Every
// POST that does work answers with a request id at once; retrieve_future holds the request up to kHold for the
// result, then answers try_again.
#include "server/tinker.hpp"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <optional>
#include <variant>

#include <boost/asio/steady_timer.hpp>

#include "server/api_impl.hpp"
#include "server/tinker_internal.hpp"
#include "wire/read.hpp"
#include "wire/tinker/codec.hpp"

namespace rlloop::server {

namespace {

namespace rd = wire::read;
namespace tk = wire::tinker;
using Kind = TinkerRoutes::Kind;
using namespace tinker_routes;

// How long retrieve_future holds a request for its result (the SDK's own read timeout is 45 s).
constexpr std::chrono::seconds kHold{25};
// LoRA's alpha for the models Tinker's clients create: the SDK sends none, so the server chooses.
constexpr int kLoraAlpha = 32;

Response proto_ok(std::string bytes) { return Response{200, "application/x-protobuf", {}, std::move(bytes)}; }

// The error a failed future answers: the SDK raises RequestFailedError(message, category).
Response failed(const std::string& message, const char* category) {
  return json_ok({{"error", message}, {"category", category}});
}

Response try_again(const std::string& request_id) {
  return json_ok({{"type", "try_again"}, {"request_id", request_id}, {"queue_state", "active"}});
}

// A checkpoint's name: the last segment of its tinker:// path.
void check_checkpoint_name(const std::string& name) {
  if (name.empty() || name.size() > 128 || name.find('/') != std::string::npos)
    user_error("path: a checkpoint name must be 1-128 characters without '/', got '" + name + "'");
}

}  // namespace

// ---- lookups ---------------------------------------------------------------------------------------------------

namespace {

std::shared_ptr<SessionHost> host_of(Api::Impl& im, const std::string& tenant, const std::string& name) {
  std::lock_guard lock(im.mu);
  const auto it = im.sessions.find({tenant, name});
  if (it == im.sessions.end()) not_found("the model's session " + name + " no longer exists");
  return it->second;
}

std::string new_request(TinkerRoutes& r, TinkerRoutes::Future f) {
  std::lock_guard lock(r.mu);
  const std::string id = "future-" + std::to_string(r.next_id++);
  r.futures.emplace(id, std::move(f));
  return id;
}

}  // namespace

// ---- submitting operations -------------------------------------------------------------------------------------

namespace {

// Queues `operation` (a training one when `seq` >= 0) on the model's session; returns the operation's id.
std::string queue(Api::Impl& im, const std::shared_ptr<TenantState>& t, const TinkerRoutes::Model& model,
                  std::int64_t seq, std::variant<wire::TrainingOperation, wire::SamplingOperation> operation) {
  auto host = host_of(im, t->config.id, model.host);
  auto op = std::make_shared<OperationRecord>();
  op->retrievable = true;
  op->sampling = std::holds_alternative<wire::SamplingOperation>(operation);
  // The journal's body is the SageMaker request of the same operation: a restarted server runs it again from there.
  if (op->sampling)
    op->body = {{"operationConfig", wire::to_json(std::get<wire::SamplingOperation>(operation))}};
  else
    op->body = wire::to_json(wire::ExecuteTrainingRequest{seq, std::nullopt,
                                                          std::get<wire::TrainingOperation>(operation)});
  op->digest = request_digest(op->body.dump());
  op->op = std::move(operation);
  try {
    return im.accept_operation(t, *host, op, std::nullopt, "seq_id", seq);
  } catch (const api_error& e) {
    // A stopped model (its session finished) is the client's mistake to stop on, not a 409 the SDK retries.
    user_error(e.status() == 409 ? "model " + host->name + " takes no more operations: " + e.what() : e.what());
  }
}

// Queues `operation` and answers with the future of it; a retried seq_id gets its first request id back.
json submit(Api::Impl& im, const std::shared_ptr<TenantState>& t, const std::string& model_id, std::int64_t seq,
            std::variant<wire::TrainingOperation, wire::SamplingOperation> operation, TinkerRoutes::Future future) {
  TinkerRoutes& r = *im.tinker;
  const auto model = find_owned(r, r.models, model_id, t->config.id, "model");
  if (seq >= 0) {
    std::lock_guard lock(r.mu);
    const auto& seen = r.models.at(model_id).requests;
    if (const auto it = seen.find(seq); it != seen.end()) return {{"request_id", it->second}, {"model_id", model_id}};
  }
  future.operation = queue(im, t, model, seq, std::move(operation));
  future.tenant = t->config.id;
  future.host = model.host;
  future.model_id = model_id;
  const std::string id = new_request(r, std::move(future));
  if (seq >= 0) {
    std::lock_guard lock(r.mu);
    r.models.at(model_id).requests[seq] = id;
  }
  return {{"request_id", id}, {"model_id", model_id}};
}

// forward_backward, and the JSON generation's forward (`forward_route`): a protobuf ForwardBackwardRequest
// (tinker >= 0.38, forward-only by its flag) or a JSON body (tinker 0.12), told apart by Content-Type.
json forward_backward(Api::Impl& im, const sigv4::HttpRequest& req, const std::shared_ptr<TenantState>& t,
                      bool forward_route) {
  const char* route = forward_route ? "forward: " : "forward_backward: ";
  const auto type = req.header("Content-Type").value_or("");
  const bool proto = type.find("application/x-protobuf") != std::string::npos;
  if (!proto && type.find("application/json") == std::string::npos)
    user_error(std::string(route) + "send a protobuf ForwardBackwardRequest (Content-Type application/x-protobuf, "
               "tinker >= 0.38) or a JSON one (application/json, tinker 0.12), not '" + type + "'");
  if (proto && forward_route) user_error("forward: send a protobuf request to forward_backward, with forward_only");
  if (req.header("Content-Encoding"))
    user_error(std::string(route) +
               "compressed bodies are not accepted (client/config's proto_compress_fwdbwd is off)");
  tk::ForwardBackwardCall call;
  try {
    call = proto ? tk::forward_backward_from_proto(req.body) : tk::forward_backward_from_json(parse_body(req),
                                                                                             forward_route);
  } catch (const invalid_argument& e) {
    user_error(route + std::string(e.what()));
  }
  if (call.loss.fn == LossFn::stable_reinforce) {
    const auto model = find_owned(*im.tinker, im.tinker->models, call.model_id, t->config.id, "model");
    try {
      im.tinker->stability.apply(model.session_id, call, now_seconds());
    } catch (const invalid_argument& e) {
      user_error(route + std::string(e.what()));
    }
  }
  wire::TrainingOperation op;
  if (call.forward_only)
    op = wire::ForwardOp{{std::move(call.data), call.loss}};
  else
    op = wire::ForwardBackwardOp{{std::move(call.data), call.loss}};
  return submit(im, t, call.model_id, call.seq_id, std::move(op), {.kind = Kind::forward});
}

json optim_step(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "", {"model_id", "seq_id", "adam_params", "type"});
  const AdamParams adam = tk::adam_params_from_json(rd::need(body, "", "adam_params"), "adam_params");
  return submit(im, t, need_string(body, "model_id"), rd::integer(rd::need(body, "", "seq_id"), "seq_id", 0),
                wire::TrainingOperation{wire::OptimizerStepOp{adam}}, {.kind = Kind::optim_step});
}

json save_weights(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "", {"model_id", "path", "seq_id", "overwrite", "ttl_seconds", "user_metadata", "type"});
  const std::string name = need_string(body, "path");
  check_checkpoint_name(name);
  return submit(im, t, need_string(body, "model_id"), rd::integer(rd::need(body, "", "seq_id"), "seq_id", 0),
                wire::TrainingOperation{wire::SaveStateOp{}},
                {.kind = Kind::save_state, .name = name, .ttl_seconds = ttl_of(body)});
}

// Named: a sampler checkpoint at a tinker:// path; unnamed: a sampler of the session's (sampling_session_seq_id).
json save_weights_for_sampler(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "",
                {"model_id", "path", "sampling_session_seq_id", "kind", "seq_id", "ttl_seconds", "user_metadata",
                 "type"});
  const std::string model_id = need_string(body, "model_id");
  TinkerRoutes::Future future{.kind = Kind::save_sampler, .ttl_seconds = ttl_of(body)};
  if (const json* path = rd::find(body, "path")) {
    future.name = rd::string(*path, "path");
    check_checkpoint_name(future.name);
  } else {
    const auto n = rd::integer(rd::need(body, "", "sampling_session_seq_id"), "sampling_session_seq_id", 0);
    const auto model = find_owned(*im.tinker, im.tinker->models, model_id, t->config.id, "model");
    future.kind = Kind::sampler_session;
    future.name = model.session_id + ":sample:" + std::to_string(n);
  }
  return submit(im, t, model_id, rd::integer(rd::need(body, "", "seq_id"), "seq_id", 0),
                wire::TrainingOperation{wire::SaveWeightsOp{}}, future);
}

// The model's LoRA adapters as a PEFT adapter directory, an "external" checkpoint whose files
// get_external_weights_urls hands out.
json save_weights_external(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "", {"model_id", "path", "seq_id", "ttl_seconds", "age_encryption_recipients", "type"});
  const std::string name = need_string(body, "path");
  check_checkpoint_name(name);
  if (const json* age = rd::find(body, "age_encryption_recipients"); age && !age->is_null() && !age->empty())
    user_error("age_encryption_recipients: encrypting exported files is not supported by this server");
  return submit(im, t, need_string(body, "model_id"), rd::integer(rd::need(body, "", "seq_id"), "seq_id", 0),
                wire::TrainingOperation{wire::SaveWeightsOp{.peft_adapter = true}},
                {.kind = Kind::save_external, .name = name, .ttl_seconds = ttl_of(body)});
}

// Keeps sample `request_id`'s result for stable_reinforce once it is in (at once when it already is). The sampler's
// session is the prefix of its id, "<session>:sample:<n>", as both of its creating routes name it.
void record_for_stability(Api::Impl& im, const std::shared_ptr<TenantState>& t, const std::string& sampler_id,
                          const std::string& request_id, std::vector<token_id> prompt) {
  TinkerRoutes& r = *im.tinker;
  const auto f = find_owned(r, r.futures, request_id, t->config.id, "request");
  r.stability.expect(sampler_id.substr(0, sampler_id.find(":sample:")), request_id, std::move(prompt),
                     now_seconds());
  const auto host = host_of(im, t->config.id, f.host);
  std::unique_lock lock(host->mu);
  const auto op = host->find_operation_locked(f.operation, now_seconds());
  if (!op) return;
  // Weak: the operation holds this callback until it runs.
  auto keep = [tinker = std::weak_ptr(im.tinker), request_id, weak_op = std::weak_ptr(op)] {
    const auto routes = tinker.lock();
    const auto done = weak_op.lock();
    if (routes && done) routes->stability.complete(request_id, done->sample_result);
  };
  if (!terminal_state(op->state)) return host->on_done_locked(*op, std::move(keep));
  lock.unlock();
  keep();
}

json asample(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::object(body, "");
  const std::string sampler_id = need_string(body, "sampling_session_id");
  const auto sampler = find_owned(*im.tinker, im.tinker->samplers, sampler_id, t->config.id, "sampling session");
  const auto model = find_owned(*im.tinker, im.tinker->models, sampler.model_id, t->config.id, "model");
  const auto host = host_of(im, t->config.id, model.host);
  std::optional<token_id> eos;
  {
    std::lock_guard lock(host->mu);
    eos = host->info.eos_token_id;
  }
  tk::SampleCall call = tk::sample_call_from_json(body, eos);
  call.request.model_path = sampler.model_package;
  const int n = call.request.num_samples;
  auto prompt = call.record_stability_info ? call.request.prompt.tokens() : std::vector<token_id>{};
  json answer =
      submit(im, t, sampler.model_id, -1, wire::SamplingOperation{std::move(call.request)}, {.kind = Kind::sample});
  if (call.record_stability_info)
    record_for_stability(im, t, sampler_id, answer["request_id"].get<std::string>(), std::move(prompt));
  answer["sample_sequence_ids"] = json::array();
  for (int i = 0; i < n; ++i)
    answer["sample_sequence_ids"].push_back(answer["request_id"].get<std::string>() + "-" + std::to_string(i));
  answer.erase("model_id");
  return answer;
}

}  // namespace

// ---- sessions, models, samplers ----------------------------------------------------------------------------------

namespace {

json create_session(TinkerRoutes& r, const std::shared_ptr<TenantState>& t) {
  static const std::string boot = operation_tag(now_seconds());
  std::lock_guard lock(r.mu);
  const std::string id = "tinker-" + boot + "-" + std::to_string(r.next_id++);
  r.sessions[id] = TinkerRoutes::Session{t->config.id, now_seconds(), false, {}};
  r.persist_locked("session", id);
  return {{"session_id", id}};
}

TinkerRoutes::Session& live_session_locked(TinkerRoutes& r, const std::string& id, const std::string& tenant) {
  const auto it = r.sessions.find(id);
  if (it == r.sessions.end() || it->second.tenant != tenant) not_found("session '" + id + "' does not exist");
  if (it->second.finished) throw api_error("Gone", 410, "session '" + id + "' is finished");
  return it->second;
}

// The LoRA target modules of Tinker's flags.
std::vector<std::string> lora_targets(const json& lora) {
  auto flag = [&](const char* key) {
    const json* v = rd::find(lora, key);
    return v ? rd::boolean(*v, rd::join("lora_config", key)) : true;
  };
  std::vector<std::string> targets;
  if (flag("train_attn")) targets.insert(targets.end(), {"q_proj", "k_proj", "v_proj", "o_proj"});
  if (flag("train_mlp")) targets.insert(targets.end(), {"gate_proj", "up_proj", "down_proj"});
  if (flag("train_unembed")) targets.push_back("lm_head");
  if (targets.empty()) user_error("lora_config: at least one of train_attn, train_mlp, train_unembed must be true");
  return targets;
}

// A new training model of session `session_id`: a hosted session named after it. Returns the model id.
std::string new_model(Api::Impl& im, const std::shared_ptr<TenantState>& t, const std::string& session_id,
                      std::int64_t seq, const std::string& base_model, const LoraOptions& lora, std::int64_t seed) {
  TinkerRoutes& r = *im.tinker;
  {
    std::lock_guard lock(r.mu);
    live_session_locked(r, session_id, t->config.id);
  }
  const auto served = im.backend.list_base_models();
  if (std::find(served.begin(), served.end(), base_model) == served.end()) {
    std::string list;
    for (const auto& m : served) list += (list.empty() ? "" : ", ") + m;
    user_error("base_model '" + base_model + "' is not served here (served: " + list + ")");
  }
  const std::string model_id = session_id + ":train:" + std::to_string(seq);
  const std::string host = session_id + "-train-" + std::to_string(seq);
  SessionOptions options{.base_model = base_model, .lora = lora, .seed = seed, .name = host};
  const std::string arn =
      "arn:aws:sagemaker:" + im.options.region + ":" + t->config.account_id + ":training-session/" + host;
  try {
    im.host_session(t, host, arn, options, json{{"tinkerModelId", model_id}});
  } catch (const api_error& e) {
    throw api_error(e.code(), e.status() == 404 ? 404 : 400, e.what());
  }
  std::lock_guard lock(r.mu);
  r.models[model_id] = TinkerRoutes::Model{t->config.id, session_id, host,          base_model,
                                           lora.rank,    lora.target_modules, {}, now_seconds()};
  r.sessions[session_id].models.push_back(model_id);
  r.persist_locked("model", model_id);
  r.persist_locked("session", session_id);
  return model_id;
}

json create_model(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "",
                {"session_id", "model_seq_id", "base_model", "lora_config", "optimizer_config", "user_metadata",
                 "type"});
  if (const json* o = rd::find(body, "optimizer_config")) {
    const std::string type = rd::string(rd::need(rd::object(*o, "optimizer_config"), "optimizer_config", "type"),
                                        "optimizer_config.type");
    if (type != "adamw") user_error("optimizer_config.type: only adamw is served, not " + type);
  }
  const json& lora_json = rd::object(rd::need(body, "", "lora_config"), "lora_config");
  rd::only_keys(lora_json, "lora_config", {"rank", "train_unembed", "train_mlp", "train_attn", "seed"});
  LoraOptions lora;
  lora.rank = static_cast<int>(rd::integer(rd::need(lora_json, "lora_config", "rank"), "lora_config.rank", 1, 1024));
  lora.alpha = kLoraAlpha;
  lora.target_modules = lora_targets(lora_json);
  const json* seed = rd::find(lora_json, "seed");
  const std::string model_id = new_model(im, t, need_string(body, "session_id"),
                                         rd::integer(rd::need(body, "", "model_seq_id"), "model_seq_id", 0),
                                         need_string(body, "base_model"), lora,
                                         seed ? rd::integer(*seed, "lora_config.seed") : 0);
  const auto model = find_owned(*im.tinker, im.tinker->models, model_id, t->config.id, "model");
  return {{"request_id", new_request(*im.tinker, {.tenant = t->config.id, .kind = Kind::created, .host = model.host,
                                                  .model_id = model_id})},
          {"model_id", model_id}};
}

json get_info(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  const std::string model_id = need_string(body, "model_id");
  const auto model = find_owned(*im.tinker, im.tinker->models, model_id, t->config.id, "model");
  const auto host = host_of(im, t->config.id, model.host);
  std::string arch;
  {
    std::lock_guard lock(host->mu);
    arch = host->info.model_type;
  }
  return {{"model_id", model_id},
          {"model_data", {{"model_name", model.base_model}, {"arch", arch}, {"tokenizer_id", model.base_model}}},
          {"is_lora", true},
          {"lora_rank", model.rank},
          {"model_name", model.base_model},
          {"type", "get_info"}};
}

json create_sampling_session(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "", {"session_id", "sampling_session_seq_id", "model_path", "base_model", "type"});
  const std::string session_id = need_string(body, "session_id");
  const auto n = rd::integer(rd::need(body, "", "sampling_session_seq_id"), "sampling_session_seq_id", 0);
  const json* path = rd::find(body, "model_path");
  if (!path)
    user_error("create_sampling_session: sampling a base model is not served; sample saved weights (model_path, "
               "or TrainingClient.save_weights_and_get_sampling_client)");
  const std::string model_path = rd::string(*path, "model_path");
  TinkerRoutes& r = *im.tinker;
  const auto checkpoint = find_owned(r, r.checkpoints, model_path, t->config.id, "checkpoint");
  if (checkpoint.type == "external")
    user_error("create_sampling_session: " + model_path + " is external weights (a PEFT adapter to download); "
               "sample a sampler_weights or weights path");
  find_owned(r, r.models, checkpoint.model_id, t->config.id, "model");  // its model, whose session decodes, exists
  std::lock_guard lock(r.mu);
  live_session_locked(r, session_id, t->config.id);
  const std::string id = session_id + ":sample:" + std::to_string(n);
  r.samplers[id] = {t->config.id, checkpoint.model_id, checkpoint.model_package, checkpoint.base_model, model_path};
  r.persist_locked("sampler", id);
  return {{"sampling_session_id", id}};
}

// Create-by-load: a new model with the checkpoint's base and LoRA, whose first operation, queued once its session
// runs (nothing waits for the model to load), loads the checkpoint.
json create_by_load(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t,
                    const TinkerRoutes::Checkpoint& checkpoint, bool optimizer) {
  TinkerRoutes& r = *im.tinker;
  const LoraOptions lora{checkpoint.rank, kLoraAlpha, checkpoint.target_modules};
  const std::string model_id =
      new_model(im, t, need_string(body, "session_id"),
                rd::integer(rd::need(body, "", "model_seq_id"), "model_seq_id", 0), checkpoint.base_model, lora, 0);
  const auto model = find_owned(r, r.models, model_id, t->config.id, "model");
  const std::string request_id =
      new_request(r, {.tenant = t->config.id, .kind = Kind::load_weights, .host = model.host, .model_id = model_id});
  auto load = [&im, t, model, request_id, op = wire::LoadStateOp{checkpoint.model_package, optimizer}] {
    std::string operation, error;
    try {
      operation = queue(im, t, model, 0, wire::TrainingOperation{op});
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard lock(im.tinker->mu);
    auto& f = im.tinker->futures.at(request_id);
    f.operation = operation;
    f.error = error;
    im.tinker->models.at(f.model_id).requests[0] = request_id;
  };
  const auto host = host_of(im, t->config.id, model.host);
  std::unique_lock lock(host->mu);
  if (host->status == wire::SessionStatus::created) {
    host->on_started_locked(load);
  } else {
    lock.unlock();
    load();
  }
  return {{"request_id", request_id}, {"model_id", model_id}};
}

// load_weights on a training model (model_id), or create-by-load (session_id + model_seq_id).
json load_weights(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t) {
  rd::only_keys(body, "",
                {"model_id", "seq_id", "session_id", "model_seq_id", "path", "optimizer", "base_model",
                 "user_metadata", "optimizer_config", "weights_access_token", "type"});
  const std::string path = need_string(body, "path");
  const auto checkpoint = find_owned(*im.tinker, im.tinker->checkpoints, path, t->config.id, "checkpoint");
  const bool optimizer = rd::find(body, "optimizer") && rd::boolean(body["optimizer"], "optimizer");
  if (checkpoint.type != "training")
    user_error("load_weights: " + path + " is not a training checkpoint (its type: " + checkpoint.type +
               "); load a save_state checkpoint");
  const json* model_id = rd::find(body, "model_id");
  if (!model_id) return create_by_load(im, body, t, checkpoint, optimizer);
  return submit(im, t, rd::string(*model_id, "model_id"), rd::integer(rd::need(body, "", "seq_id"), "seq_id", 0),
                wire::TrainingOperation{wire::LoadStateOp{checkpoint.model_package, optimizer}},
                {.kind = Kind::load_weights});
}

}  // namespace

// ---- results ---------------------------------------------------------------------------------------------------

namespace {

// The result of a finished operation future as the SDK reads it: a sample's and a forward's as protobuf (`proto`,
// the client asked for it) or JSON.
Response operation_result(TinkerRoutes& r, const TinkerRoutes::Future& f, const OperationRecord& op, bool proto) {
  if (f.kind == Kind::sample) {
    if (!op.sample_result)
      return failed(wire::sampling_state_from_json(op.state).error_details.value_or("the sample did not run"), "user");
    return proto ? proto_ok(tk::sample_response_to_proto(*op.sample_result))
                 : json_ok(tk::sample_response_to_json(*op.sample_result));
  }
  const auto state = wire::training_state_from_json(op.state);
  if (state.status != wire::OperationStatus::completed || !state.result)
    return failed(state.error_details.value_or("the operation was skipped: one before it failed"),
                  state.status == wire::OperationStatus::failed ? "user" : "server");
  const auto& result = *state.result;
  switch (f.kind) {
    case Kind::forward: {
      const auto* fwd = std::get_if<wire::ForwardResult>(&result);
      const ForwardBackwardOutput& out =
          fwd ? fwd->output : std::get<wire::ForwardBackwardResult>(result).output;
      return proto ? proto_ok(tk::forward_backward_output_to_proto(out))
                   : json_ok(tk::forward_backward_output_to_json(out));
    }
    case Kind::optim_step:
      return json_ok({{"metrics", std::get<OptimStepOutput>(result).metrics}, {"type", "optim_step"}});
    case Kind::save_state:
      return json_ok({{"path", register_checkpoint(r, f, std::get<wire::SaveStateResult>(result).model_package_arn,
                                                   "training")},
                      {"type", "save_weights"}});
    case Kind::save_sampler:
      return json_ok({{"path", register_checkpoint(r, f, *std::get<wire::SaveWeightsResult>(result).model_package_arn,
                                                   "sampler")},
                      {"type", "save_weights_for_sampler"}});
    case Kind::save_external:
      return json_ok({{"path", register_checkpoint(r, f, *std::get<wire::SaveWeightsResult>(result).model_package_arn,
                                                   "external")},
                      {"type", "save_weights_external"}});
    case Kind::sampler_session: {
      std::lock_guard lock(r.mu);
      const auto& model = r.models.at(f.model_id);
      r.samplers[f.name] = {f.tenant, f.model_id, *std::get<wire::SaveWeightsResult>(result).model_package_arn,
                            model.base_model, ""};
      r.persist_locked("sampler", f.name);
      return json_ok({{"sampling_session_id", f.name}, {"type", "save_weights_for_sampler"}});
    }
    case Kind::load_weights:
      return json_ok({{"type", "load_weights"}});
    case Kind::created:
    case Kind::sample:
      break;
  }
  throw std::logic_error("tinker operation_result: not an operation future");
}

// The future's answer now, with host.mu held: its result when it is ready, else try_again. A future without its
// operation yet (create-by-load's, queued once the session runs) waits for the session's start.
Response answer_locked(TinkerRoutes& r, const std::string& request_id, const TinkerRoutes::Future& f,
                       const SessionHost& host, const std::shared_ptr<OperationRecord>& op, bool proto) {
  if (!f.error.empty()) return failed(f.error, "user");
  if (op) return terminal_state(op->state) ? operation_result(r, f, *op, proto) : try_again(request_id);
  if (f.kind != Kind::created) return try_again(request_id);  // its operation is being queued
  if (host.status == wire::SessionStatus::created) return try_again(request_id);
  if (host.status == wire::SessionStatus::running || host.status == wire::SessionStatus::blocked)
    return json_ok({{"model_id", f.model_id}, {"type", "create_model"}});
  return failed("the model could not be created: " + host.error_details, "user");
}

// Answers `reply` with the future's result once it is ready, or with try_again after kHold: the first of the
// operation (or the session's start) finishing, the timer, the server closing. Nothing waits on a thread.
Handled retrieve(Api::Impl& im, const std::string& request_id, const TinkerRoutes::Future& f,
                 const std::shared_ptr<SessionHost>& host, const Reply& reply, bool proto) {
  TinkerRoutes& r = *im.tinker;
  std::unique_lock lock(host->mu);
  std::shared_ptr<OperationRecord> op;
  if (!f.operation.empty()) {
    op = host->find_operation_locked(f.operation, now_seconds());
    if (!op) throw api_error("Gone", 410, "the result of request " + request_id + " expired");
  }
  const bool started = host->status != wire::SessionStatus::created;
  const bool ready = !f.error.empty() || (op ? terminal_state(op->state) : started);
  if (ready) return answer_locked(r, request_id, f, *host, op, proto);
  auto timer = std::make_shared<boost::asio::steady_timer>(reply.executor(), kHold);
  auto answer = [&r, f, host, op, request_id, proto, weak = std::weak_ptr(timer)] {
    if (auto t = weak.lock()) t->cancel();
    std::lock_guard answer_lock(host->mu);
    return answer_locked(r, request_id, f, *host, op, proto);
  };
  auto wake = [reply, answer] { reply.post(answer); };
  timer->async_wait([timer, wake](const boost::system::error_code&) { wake(); });
  if (op)
    host->on_done_locked(*op, wake);
  else
    host->on_started_locked(wake);
  lock.unlock();
  if (!im.add_poll(timer, wake)) wake();
  return std::nullopt;
}

Handled retrieve_future(Api::Impl& im, const json& body, const std::shared_ptr<TenantState>& t, const Reply& reply,
                        bool proto) {
  rd::only_keys(body, "", {"request_id", "allow_metadata_only", "type"});
  const std::string id = need_string(body, "request_id");
  const auto f = find_owned(*im.tinker, im.tinker->futures, id, t->config.id, "request");
  return retrieve(im, id, f, host_of(im, t->config.id, f.host), reply, proto);
}

json heartbeat(TinkerRoutes& r, const json& body, const std::shared_ptr<TenantState>& t) {
  std::lock_guard lock(r.mu);
  live_session_locked(r, need_string(body, "session_id"), t->config.id).last_heartbeat = now_seconds();
  return {{"type", "session_heartbeat"}};
}

// Marks session `id` finished and returns its models' hosted sessions, for the caller to stop once r.mu is released.
std::vector<std::string> finish_locked(TinkerRoutes& r, const std::string& id) {
  TinkerRoutes::Session& s = r.sessions.at(id);
  s.finished = true;
  r.persist_locked("session", id);
  r.stability.drop(id);
  std::vector<std::string> hosts;
  for (const auto& m : s.models) hosts.push_back(r.models.at(m).host);
  return hosts;
}

// Stops the hosted sessions of a finished Tinker session: their workers end and their models are freed; their
// checkpoints stay loadable.
void stop_hosts(Api::Impl& im, const std::string& tenant, const std::vector<std::string>& hosts) {
  for (const auto& name : hosts) {
    std::shared_ptr<SessionHost> host;
    {
      std::lock_guard lock(im.mu);
      if (const auto it = im.sessions.find({tenant, name}); it != im.sessions.end()) host = it->second;
    }
    if (host) host->stop();
  }
}

// sessions/{id}/finish: the session's models stop (their checkpoints stay).
json finish(Api::Impl& im, const std::string& session_id, const std::shared_ptr<TenantState>& t) {
  std::vector<std::string> hosts;
  {
    std::lock_guard lock(im.tinker->mu);
    live_session_locked(*im.tinker, session_id, t->config.id);
    hosts = finish_locked(*im.tinker, session_id);
  }
  stop_hosts(im, t->config.id, hosts);
  return json::object();
}

std::vector<std::string> path_segments(const std::string& path) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start < path.size();) {
    std::size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    out.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// The GET routes: capabilities, a sampler, training runs, their checkpoints and external weights' files.
json get_route(Api::Impl& im, const sigv4::HttpRequest& req, const std::vector<std::string>& seg,
               const std::shared_ptr<TenantState>& t) {
  if (seg.size() == 1 && seg[0] == "get_server_capabilities") {
    json models = json::array();
    for (const auto& m : im.backend.list_base_models())
      models.push_back({{"model_name", m}, {"trainable", true}, {"sampleable", true}});
    return {{"supported_models", models}};
  }
  if (seg.size() == 2 && seg[0] == "samplers") {
    const auto s = find_owned(*im.tinker, im.tinker->samplers, seg[1], t->config.id, "sampler");
    json j{{"sampler_id", seg[1]}, {"base_model", s.base_model}};
    if (!s.model_path.empty()) j["model_path"] = s.model_path;
    return j;
  }
  if (auto answer = checkpoint_get_route(im, req, seg, t)) return *answer;
  not_found("no Tinker route GET /api/v1/" + (seg.empty() ? std::string() : seg[0]));
}

// The JSON POST routes that answer at once.
std::optional<json> post_route(Api::Impl& im, const std::string& route, const json& body,
                               const std::shared_ptr<TenantState>& t) {
  TinkerRoutes& r = *im.tinker;
  if (route == "client/config") return json{{"parallel_fwdbwd_chunks", false}, {"fwdbwd_max_chunk_len", 1024}};
  if (route == "client/dynamic_config") return json::object();
  if (route == "telemetry") return json{{"status", "accepted"}};
  if (route == "create_session") return create_session(r, t);
  if (route == "session_heartbeat") return heartbeat(r, body, t);
  if (route == "create_model") return create_model(im, body, t);
  if (route == "get_info") return get_info(im, body, t);
  if (route == "optim_step") return optim_step(im, body, t);
  if (route == "save_weights") return save_weights(im, body, t);
  if (route == "save_weights_for_sampler") return save_weights_for_sampler(im, body, t);
  if (route == "save_weights_external") return save_weights_external(im, body, t);
  if (route == "load_weights") return load_weights(im, body, t);
  if (route == "create_sampling_session") return create_sampling_session(im, body, t);
  if (route == "asample") return asample(im, body, t);
  if (route == "weights_info") return weights_info(r, body, t);
  const auto seg = path_segments(route);
  if (seg.size() == 3 && seg[0] == "sessions" && seg[2] == "finish") return finish(im, seg[1], t);
  return std::nullopt;
}

// The reaper's deletion of an expired checkpoint: never throws (an exception would end the server); a failure is
// reported, and the next look tries again.
void delete_expired(Api::Impl& im, const std::string& tenant, const std::string& path) {
  try {
    delete_checkpoint(im, tenant, path);
  } catch (const api_error&) {
    // deleted meanwhile by its client
  } catch (const std::exception& e) {
    if (im.tinker->report) im.tinker->report("the expired checkpoint " + path + " was not deleted: " + e.what());
  }
}

}  // namespace

bool is_tinker_path(const std::string& path) { return path.rfind("/api/v1/", 0) == 0; }

void Api::Impl::start_tinker_reaper() {
  const auto timeout = options.tinker_session_timeout;
  // Looks a few times per timeout, so a silent session goes within about 1.25 timeouts.
  const auto period = std::max<std::chrono::milliseconds>(std::chrono::milliseconds(100), timeout / 4);
  tinker->reaper = std::thread([this, timeout, period] {
    TinkerRoutes& r = *tinker;
    std::unique_lock lock(r.mu);
    while (!r.wake.wait_for(lock, period, [&] { return r.stopping; })) {
      std::vector<std::pair<std::string, std::vector<std::string>>> silent;  // tenant, hosts
      const double now = now_seconds();
      for (auto& [id, s] : r.sessions)
        if (!s.finished && now - s.last_heartbeat > static_cast<double>(timeout.count()))
          silent.emplace_back(s.tenant, finish_locked(r, id));
      const auto expired = expired_checkpoints_locked(r, now);
      if (silent.empty() && expired.empty()) continue;
      lock.unlock();
      for (const auto& [tenant, hosts] : silent) stop_hosts(*this, tenant, hosts);
      for (const auto& [tenant, path] : expired) delete_expired(*this, tenant, path);
      lock.lock();
    }
  });
}

void TinkerRoutes::stop_reaper() {
  {
    std::lock_guard lock(mu);
    stopping = true;
  }
  wake.notify_all();
  if (reaper.joinable()) reaper.join();
}

void Api::Impl::stop_tinker_reaper() { tinker->stop_reaper(); }

Handled Api::Impl::tinker_api(const sigv4::HttpRequest& req, const std::string& path,
                              const std::shared_ptr<TenantState>& t, const Reply& reply) {
  const std::string route = path.substr(std::string("/api/v1/").size());
  try {
    if (req.method == "GET") return json_ok(get_route(*this, req, path_segments(route), t));
    // The RestClient's changes to a checkpoint: DELETE, PUT .../ttl, POST or DELETE .../publish.
    if (req.method == "PUT" || req.method == "DELETE" || route.ends_with("/publish")) {
      if (auto answer = checkpoint_change(*this, req, path_segments(route), t)) return json_ok(*answer);
      not_found("no Tinker route " + req.method + " /api/v1/" + route);
    }
    if (req.method != "POST") not_found("no Tinker route " + req.method + " /api/v1/" + route);
    if (route == "forward_backward" || route == "forward")
      return json_ok(forward_backward(*this, req, t, route == "forward"));
    const json body = parse_body(req);
    rd::object(body, "");
    // Results the SDK reads as protobuf when it asks for them (tinker >= 0.38), else as JSON (0.12).
    const bool proto = req.header("Accept").value_or("").find("application/x-protobuf") != std::string::npos;
    if (route == "retrieve_future") return retrieve_future(*this, body, t, reply, proto);
    if (auto answer = post_route(*this, route, body, t)) return json_ok(*answer);
  } catch (const invalid_argument& e) {  // a field the readers refused
    user_error(e.what());
  }
  not_found("no Tinker route POST /api/v1/" + route);
}

}  // namespace rlloop::server
