#include "wire/runtime.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <type_traits>

#include <rlloop/error.hpp>
#include <rlloop/limits.hpp>

#include "wire/loss_config.hpp"
#include "wire/read.hpp"

namespace rlloop::wire {

using namespace read;

// ---- numbers on the wire ----------------------------------------------------------------------------------------

json wire_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

namespace {
// Every double a writer below emits goes through wire_number.
template <class Range>
json wire_numbers(const Range& values) {
  json out = json::array();
  for (double v : values) out.push_back(wire_number(v));
  return out;
}
json wire_metrics(const Metrics& metrics) {
  json out = json::object();
  for (const auto& [k, v] : metrics) out[k] = wire_number(v);
  return out;
}
}  // namespace

// ---- ModelInput / TensorData / Datum -------------------------------------------------------------------------

json to_json(const ModelInput& in) {
  json chunks = json::array();
  for (const auto& c : in.chunks) chunks.push_back({{"type", "encoded_text"}, {"tokens", c.tokens}});
  return {{"chunks", std::move(chunks)}};
}

ModelInput model_input_from_json(const json& j, const std::string& path) {
  object(j, path);
  ModelInput out;
  const std::string cpath = join(path, "chunks");
  const json& chunks = array(need(j, path, "chunks"), cpath);
  if (chunks.empty()) fail(cpath, "needs at least one chunk");
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const std::string p = at(cpath, i);
    object(chunks[i], p);
    const std::string type = string(need(chunks[i], p, "type"), join(p, "type"));
    if (type != "encoded_text") fail(join(p, "type"), "unsupported chunk type '" + type + "' (expected encoded_text)");
    const std::string tpath = join(p, "tokens");
    const json& tokens = array(need(chunks[i], p, "tokens"), tpath);
    EncodedTextChunk chunk;
    chunk.tokens.reserve(tokens.size());
    for (std::size_t k = 0; k < tokens.size(); ++k)
      chunk.tokens.push_back(
          static_cast<token_id>(integer(tokens[k], at(tpath, k), 0, std::numeric_limits<token_id>::max())));
    out.chunks.push_back(std::move(chunk));
  }
  return out;
}

json to_json(const TensorData& t) {
  json j{{"dtype", to_string(t.dtype)}};
  if (t.dtype == DType::float32)
    j["data"] = wire_numbers(t.float_data);
  else
    j["data"] = t.int_data;
  j["shape"] = t.shape.empty() ? std::vector<std::int64_t>{static_cast<std::int64_t>(t.size())} : t.shape;
  return j;
}

namespace {
// Flattens nested `data` row-major, recording the shape and checking that it is rectangular.
void flatten(const json& j, const std::string& path, std::size_t depth, std::vector<std::int64_t>& shape,
             std::vector<const json*>& leaves) {
  if (!j.is_array()) {
    if (depth == 0) fail(path, "expected an array");
    if (depth != shape.size()) fail(path, "ragged nested array");
    leaves.push_back(&j);
    return;
  }
  if (depth == shape.size()) {
    if (!leaves.empty()) fail(path, "ragged nested array");
    shape.push_back(static_cast<std::int64_t>(j.size()));
  } else if (depth > shape.size() || shape[depth] != static_cast<std::int64_t>(j.size())) {
    fail(path, "ragged nested array");
  }
  for (std::size_t i = 0; i < j.size(); ++i) flatten(j[i], at(path, i), depth + 1, shape, leaves);
}
}  // namespace

TensorData tensor_from_json(const json& j, const std::string& path) {
  object(j, path);
  TensorData t;
  const std::string dtype = string(need(j, path, "dtype"), join(path, "dtype"));
  if (dtype == "float32" || dtype == "float64")
    t.dtype = DType::float32;
  else if (dtype == "int64" || dtype == "int32")
    t.dtype = DType::int64;
  else
    fail(join(path, "dtype"), "unsupported dtype '" + dtype + "' (expected float32 or int64)");

  const std::string dpath = join(path, "data");
  std::vector<std::int64_t> inferred;
  std::vector<const json*> leaves;
  flatten(need(j, path, "data"), dpath, 0, inferred, leaves);
  if (t.dtype == DType::float32) {
    t.float_data.reserve(leaves.size());
    for (const json* v : leaves) {
      if (!v->is_number()) fail(dpath, "expected numbers");
      t.float_data.push_back(v->get<float>());
    }
  } else {
    t.int_data.reserve(leaves.size());
    for (const json* v : leaves) {
      if (!v->is_number()) fail(dpath, "expected integers");
      const double d = v->get<double>();
      if (!v->is_number_integer() && d != std::floor(d)) fail(dpath, "expected integers");
      // 2^63 is exactly representable; anything at or beyond it would not fit (casting it is undefined).
      if (!v->is_number_integer() && !(d >= -9223372036854775808.0 && d < 9223372036854775808.0))
        fail(dpath, "integer out of the int64 range");
      if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
        fail(dpath, "integer out of the int64 range");
      t.int_data.push_back(v->is_number_integer() ? v->get<std::int64_t>() : static_cast<std::int64_t>(d));
    }
  }
  t.shape = inferred;
  if (const json* s = find(j, "shape")) {
    const std::string spath = join(path, "shape");
    array(*s, spath);
    std::vector<std::int64_t> shape;
    std::int64_t product = 1;
    for (std::size_t i = 0; i < s->size(); ++i) {
      shape.push_back(integer((*s)[i], at(spath, i), 0));
      if (__builtin_mul_overflow(product, shape.back(), &product)) fail(spath, "shape holds too many elements");
    }
    if (product != static_cast<std::int64_t>(leaves.size()))
      fail(spath,
           "shape holds " + std::to_string(product) + " elements but data holds " + std::to_string(leaves.size()));
    t.shape = std::move(shape);
  }
  return t;
}

json to_json(const Datum& d) {
  json inputs = json::object();
  for (const auto& [k, v] : d.loss_fn_inputs) inputs[k] = to_json(v);
  return {{"modelInput", to_json(d.model_input)}, {"lossFnInputs", std::move(inputs)}};
}

Datum datum_from_json(const json& j, const std::string& path) {
  object(j, path);
  only_keys(j, path, {"modelInput", "lossFnInputs"});
  Datum d;
  d.model_input = model_input_from_json(need(j, path, "modelInput"), join(path, "modelInput"));
  if (const json* inputs = find(j, "lossFnInputs")) {
    const std::string ipath = join(path, "lossFnInputs");
    object(*inputs, ipath);
    for (auto it = inputs->begin(); it != inputs->end(); ++it) {
      if (!is_known_loss_input(it.key()))
        fail(join(ipath, it.key()), "unknown loss input (expected " + rlloop::detail::one_of(kLossInputs) + ")");
      d.loss_fn_inputs[it.key()] = tensor_from_json(it.value(), join(ipath, it.key()));
    }
  }
  return d;
}

// ---- losses, sampling and optimizer settings -----------------------------------------------------------------

void write_loss(json& j, const LossSpec& loss) {
  j["lossFnName"] = to_string(loss.fn);
  const auto config = loss_config(loss);
  if (!config.empty()) j["lossFnConfig"] = config;
}

LossSpec loss_from_json(const json& obj, const std::string& path) {
  const std::string name = string(need(obj, path, "lossFnName"), join(path, "lossFnName"));
  std::map<std::string, double> config;
  if (const json* c = find(obj, "lossFnConfig")) {
    const std::string cpath = join(path, "lossFnConfig");
    object(*c, cpath);
    for (auto it = c->begin(); it != c->end(); ++it) config[it.key()] = number(it.value(), join(cpath, it.key()));
  }
  try {
    return loss_from_config(name, config);
  } catch (const invalid_argument& e) {
    fail(path, e.what());
  }
}

json to_json(const SamplingParams& p) {
  json j{{"maxTokens", p.max_tokens}, {"temperature", p.temperature}, {"topK", p.top_k}, {"topP", p.top_p}};
  // The wire's seed is a 32-bit Integer: a wider seed is sent as its low 32 bits (two's complement).
  if (p.seed) j["seed"] = static_cast<std::int32_t>(static_cast<std::uint32_t>(*p.seed));
  if (!p.stop.empty()) j["stop"] = p.stop;
  // Token-id stops are an rlloop extension (the spec's stop takes strings only).
  if (!p.stop_token_ids.empty()) j["stopTokenIds"] = p.stop_token_ids;
  return j;
}

SamplingParams sampling_params_from_json(const json& j, const std::string& path) {
  object(j, path);
  only_keys(j, path, {"maxTokens", "temperature", "topK", "topP", "seed", "stop", "stopTokenIds"});
  SamplingParams p;
  // Types here; the bounds are rlloop/limits.hpp's, checked by validate() below.
  constexpr std::int64_t int32_min = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  p.max_tokens = static_cast<int>(integer(need(j, path, "maxTokens"), join(path, "maxTokens"), int32_min, int32_max));
  if (const json* v = find(j, "temperature")) p.temperature = number(*v, join(path, "temperature"));
  if (const json* v = find(j, "topK"))
    p.top_k = static_cast<int>(integer(*v, join(path, "topK"), int32_min, int32_max));
  if (const json* v = find(j, "topP")) p.top_p = number(*v, join(path, "topP"));
  if (const json* v = find(j, "seed"))
    p.seed = integer(*v, join(path, "seed"), std::numeric_limits<std::int32_t>::min(),
                     std::numeric_limits<std::int32_t>::max());
  if (const json* v = find(j, "stop")) {
    const std::string spath = join(path, "stop");
    array(*v, spath);
    for (std::size_t i = 0; i < v->size(); ++i) p.stop.push_back(string((*v)[i], at(spath, i)));
  }
  if (const json* v = find(j, "stopTokenIds")) {
    const std::string spath = join(path, "stopTokenIds");
    array(*v, spath);
    for (std::size_t i = 0; i < v->size(); ++i)
      p.stop_token_ids.push_back(
          static_cast<token_id>(integer((*v)[i], at(spath, i), 0, std::numeric_limits<token_id>::max())));
  }
  validate(p, Naming::sagemaker_at(path));
  return p;
}

json to_json(const AdamParams& a) {
  json j{{"learningRate", a.learning_rate},
         {"beta1", a.beta1},
         {"beta2", a.beta2},
         {"eps", a.eps},
         {"weightDecay", a.weight_decay},
         {"loraPlusLrRatio", a.lora_plus_lr_ratio}};
  if (a.grad_clip_norm) j["gradClipNorm"] = *a.grad_clip_norm;
  return j;
}

AdamParams adam_from_json(const json& j, const std::string& path) {
  object(j, path);
  only_keys(j, path, {"learningRate", "beta1", "beta2", "eps", "weightDecay", "gradClipNorm", "loraPlusLrRatio"});
  AdamParams a;
  auto read = [&](const char* key, double lo, double hi) {
    return in_range(number(*find(j, key), join(path, key)), join(path, key), lo, hi);
  };
  need(j, path, "learningRate");
  a.learning_rate = read("learningRate", 0, 0.01);
  if (find(j, "beta1")) a.beta1 = read("beta1", 0, 0.999999);
  if (find(j, "beta2")) a.beta2 = read("beta2", 0, 0.999999);
  if (find(j, "eps")) a.eps = read("eps", 1e-16, 0.01);
  if (find(j, "weightDecay")) a.weight_decay = read("weightDecay", 0, 1);
  if (find(j, "gradClipNorm")) a.grad_clip_norm = read("gradClipNorm", 0, 100);
  if (find(j, "loraPlusLrRatio")) a.lora_plus_lr_ratio = read("loraPlusLrRatio", 1, 100);
  return a;
}

// ---- requests ------------------------------------------------------------------------------------------------

namespace {
std::vector<Datum> datum_list(const json& obj, const std::string& path) {
  const std::string lpath = join(path, "datumList");
  const json& list = array(need(obj, path, "datumList"), lpath);
  if (list.empty()) fail(lpath, "needs at least one datum");
  std::vector<Datum> out;
  out.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) out.push_back(datum_from_json(list[i], at(lpath, i)));
  return out;
}
json batch_json(const BatchOp& op) {
  json list = json::array();
  for (const auto& d : op.data) list.push_back(to_json(d));
  json j{{"datumList", std::move(list)}};
  write_loss(j, op.loss);
  return j;
}
}  // namespace

namespace {
std::string description(const json& c, const std::string& p) {
  if (const json* d = find(c, "description")) {
    std::string s = string(*d, join(p, "description"));
    if (s.size() > limits::description_max)
      fail(join(p, "description"), "longer than " + std::to_string(limits::description_max) + " characters");
    return s;
  }
  return {};
}
BatchOp batch_from_json(const json& c, const std::string& p) {
  only_keys(c, p, {"datumList", "lossFnName", "lossFnConfig"});
  return BatchOp{datum_list(c, p), loss_from_json(c, p)};
}

// The union of call C's requests (IsResult false) or results: exactly one member, named by one of the bindings,
// read and written by its codecs.
template <bool IsResult, class Variant, class... Ops>
Variant read_member(const std::string& member, const json& c, const std::string& p, op::List<Ops...>) {
  std::optional<Variant> out;
  auto one = [&]<class Op>(std::type_identity<Op>) {
    using B = Binding<Op>;
    if (member != B::name) return false;
    if constexpr (IsResult)
      out.emplace(std::in_place_type<typename B::Result>, B::read_result(c, p));
    else
      out.emplace(std::in_place_type<typename B::Request>, B::read(c, p));
    return true;
  };
  (one(std::type_identity<Ops>{}) || ...);
  return std::move(*out);  // union_member accepted only the bindings' names
}
template <Call C, bool IsResult, class Variant>
Variant read_union(const json& j, const std::string& path) {
  using Carried = CarriedOperations<C>;
  const std::string member = union_member(j, path, Unions<Carried>::names);
  const std::string p = join(path, member);
  const json& c = object(j.at(member), p);
  return read_member<IsResult, Variant>(member, c, p, Carried{});
}
template <Call C, bool IsResult, class Variant>
json write_union(const Variant& v) {
  return std::visit(
      [](const auto& o) -> json {
        using B = Binding<OperationOfShape<std::decay_t<decltype(o)>, C>>;
        if constexpr (IsResult)
          return {{B::name, B::write_result(o)}};
        else
          return {{B::name, B::write(o)}};
      },
      v);
}
}  // namespace

json Binding<op::Forward>::write(const ForwardOp& r) { return batch_json(r); }
ForwardOp Binding<op::Forward>::read(const json& c, const std::string& p) { return ForwardOp{batch_from_json(c, p)}; }
json Binding<op::ForwardBackward>::write(const ForwardBackwardOp& r) { return batch_json(r); }
ForwardBackwardOp Binding<op::ForwardBackward>::read(const json& c, const std::string& p) {
  return ForwardBackwardOp{batch_from_json(c, p)};
}

json Binding<op::OptimStep>::write(const OptimizerStepOp& r) { return {{"adamParamsConfig", to_json(r.adam)}}; }
OptimizerStepOp Binding<op::OptimStep>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"adamParamsConfig"});
  return OptimizerStepOp{adam_from_json(need(c, p, "adamParamsConfig"), join(p, "adamParamsConfig"))};
}

json Binding<op::SaveWeightsForSampler>::write(const SaveWeightsOp& r) {
  json c{{"mergeWeights", r.merge_weights}};
  if (r.peft_adapter) c["rlloopPeftAdapter"] = true;  // written only when set: AWS's models lack it
  if (!r.description.empty()) c["description"] = r.description;
  return c;
}
SaveWeightsOp Binding<op::SaveWeightsForSampler>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"mergeWeights", "rlloopPeftAdapter", "description"});
  SaveWeightsOp o;
  if (const json* m = find(c, "mergeWeights")) o.merge_weights = boolean(*m, join(p, "mergeWeights"));
  if (const json* m = find(c, "rlloopPeftAdapter")) o.peft_adapter = boolean(*m, join(p, "rlloopPeftAdapter"));
  if (o.merge_weights && o.peft_adapter)
    fail(join(p, "rlloopPeftAdapter"), "is exclusive with mergeWeights");
  o.description = description(c, p);
  return o;
}

json Binding<op::SaveState>::write(const SaveStateOp& r) {
  json c = json::object();
  if (!r.description.empty()) c["description"] = r.description;
  return c;
}
SaveStateOp Binding<op::SaveState>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"description"});
  return SaveStateOp{description(c, p)};
}

json Binding<op::LoadState>::write(const LoadStateOp& r) {
  return {{"modelPackageArn", r.model_package_arn}, {"loadOptimizer", r.load_optimizer}};
}
LoadStateOp Binding<op::LoadState>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"modelPackageArn", "loadOptimizer"});
  LoadStateOp o;
  o.model_package_arn = string(need(c, p, "modelPackageArn"), join(p, "modelPackageArn"));
  if (o.model_package_arn.empty()) fail(join(p, "modelPackageArn"), "must not be empty");
  o.load_optimizer = boolean(need(c, p, "loadOptimizer"), join(p, "loadOptimizer"));
  return o;
}

json to_json(const TrainingOperation& op) { return write_union<Call::training, false>(op); }

TrainingOperation training_operation_from_json(const json& j, const std::string& path) {
  return read_union<Call::training, false, TrainingOperation>(j, path);
}

json to_json(const ExecuteTrainingRequest& r) {
  json j{{"sequenceNumber", r.sequence_number}, {"operationConfig", to_json(r.operation)}};
  if (r.client_token) j["clientToken"] = *r.client_token;
  return j;
}

bool is_valid_client_token(const std::string& s) { return is_label(s, limits::client_token_max); }

ExecuteTrainingRequest execute_training_request_from_json(const json& j) {
  object(j, "");
  only_keys(j, "", {"sequenceNumber", "clientToken", "operationConfig"});
  ExecuteTrainingRequest r;
  r.sequence_number =
      integer(need(j, "", "sequenceNumber"), "sequenceNumber", 1, std::numeric_limits<std::int32_t>::max());
  if (const json* t = find(j, "clientToken")) {
    r.client_token = string(*t, "clientToken");
    validate_label(*r.client_token, limits::client_token_max, "clientToken");
  }
  r.operation = training_operation_from_json(need(j, "", "operationConfig"), "operationConfig");
  return r;
}

json to_json(const SampleRequest& r) {
  json j{{"prompt", to_json(r.prompt)}, {"numSamples", r.num_samples}, {"samplingParams", to_json(r.params)}};
  if (r.include_prompt_logprobs) j["includePromptLogprobs"] = true;
  if (r.topk_prompt_logprobs > 0) j["topkPromptLogprobs"] = r.topk_prompt_logprobs;
  if (r.model_path) j["modelPackageArn"] = *r.model_path;
  if (r.include_routed_experts) j["includeRoutedExperts"] = true;
  return j;
}

namespace {
// A modelPackageArn member: absent (nullopt, or an error when required) or a non-empty string.
std::optional<std::string> package_arn(const json& c, const std::string& p, bool required) {
  const json* a = find(c, "modelPackageArn");
  if (!a) {
    if (required) need(c, p, "modelPackageArn");
    return std::nullopt;
  }
  std::string s = string(*a, join(p, "modelPackageArn"));
  if (s.empty()) fail(join(p, "modelPackageArn"), "must not be empty");
  return s;
}
}  // namespace

json Binding<op::Sample>::write(const SampleRequest& r) { return to_json(r); }
SampleRequest Binding<op::Sample>::read(const json& c, const std::string& p) {
  only_keys(c, p,
            {"prompt", "numSamples", "samplingParams", "includePromptLogprobs", "topkPromptLogprobs", "modelPackageArn",
             "includeRoutedExperts"});
  SampleRequest r;
  r.prompt = model_input_from_json(need(c, p, "prompt"), join(p, "prompt"));
  constexpr std::int64_t int32_min = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  r.num_samples = static_cast<int>(integer(need(c, p, "numSamples"), join(p, "numSamples"), int32_min, int32_max));
  r.params = sampling_params_from_json(need(c, p, "samplingParams"), join(p, "samplingParams"));
  if (const json* v = find(c, "includePromptLogprobs"))
    r.include_prompt_logprobs = boolean(*v, join(p, "includePromptLogprobs"));
  if (const json* v = find(c, "topkPromptLogprobs"))
    r.topk_prompt_logprobs = static_cast<int>(integer(*v, join(p, "topkPromptLogprobs"), int32_min, int32_max));
  r.model_path = package_arn(c, p, false);
  if (const json* v = find(c, "includeRoutedExperts"))
    r.include_routed_experts = boolean(*v, join(p, "includeRoutedExperts"));
  validate(r, Naming::sagemaker_at(p));  // the bounds; the model's context and vocabulary at submission
  return r;
}

json Binding<op::ComputeLogprobs>::write(const ComputeLogprobsRequest& r) {
  json c{{"prompt", to_json(r.prompt)}};
  if (r.model_path) c["modelPackageArn"] = *r.model_path;
  return c;
}
ComputeLogprobsRequest Binding<op::ComputeLogprobs>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"prompt", "modelPackageArn"});
  return ComputeLogprobsRequest{model_input_from_json(need(c, p, "prompt"), join(p, "prompt")),
                                package_arn(c, p, false)};
}

json Binding<op::LoadWeightsForSampling>::write(const LoadWeightsForSamplingOp& r) {
  return {{"modelPackageArn", r.model_package_arn}};
}
LoadWeightsForSamplingOp Binding<op::LoadWeightsForSampling>::read(const json& c, const std::string& p) {
  only_keys(c, p, {"modelPackageArn"});
  return LoadWeightsForSamplingOp{*package_arn(c, p, true)};
}

json to_json(const SamplingOperation& op) { return write_union<Call::sampling, false>(op); }

SamplingOperation sampling_operation_from_json(const json& j, const std::string& path) {
  return read_union<Call::sampling, false, SamplingOperation>(j, path);
}

SamplingOperation execute_sampling_request_from_json(const json& j) {
  read::object(j, "");
  read::only_keys(j, "", {"operationConfig"});
  return sampling_operation_from_json(read::need(j, "", "operationConfig"), "operationConfig");
}

// ---- results -------------------------------------------------------------------------------------------------

json to_json(const ForwardBackwardOutput& o) {
  json outputs = json::array();
  for (const auto& m : o.loss_fn_outputs) {
    json one = json::object();
    for (const auto& [k, v] : m) one[k] = to_json(v);
    outputs.push_back(std::move(one));
  }
  return {{"lossFnOutputs", std::move(outputs)},
          {"lossFnOutputType", o.loss_fn_output_type},
          {"metrics", wire_metrics(o.metrics)},
          {"tokenUsage", {{"trainingTokens", o.training_tokens}}}};
}

namespace {
Metrics metrics_from_json(const json& obj, const std::string& path) {
  Metrics m;
  if (const json* v = find(obj, "metrics")) {
    const std::string mpath = join(path, "metrics");
    object(*v, mpath);
    for (auto it = v->begin(); it != v->end(); ++it) m[it.key()] = number(it.value(), join(mpath, it.key()));
  }
  return m;
}
}  // namespace

ForwardBackwardOutput forward_backward_output_from_json(const json& j, const std::string& path) {
  object(j, path);
  ForwardBackwardOutput o;
  if (const json* outs = find(j, "lossFnOutputs")) {
    const std::string opath = join(path, "lossFnOutputs");
    array(*outs, opath);
    for (std::size_t i = 0; i < outs->size(); ++i) {
      const std::string p = at(opath, i);
      object((*outs)[i], p);
      std::map<std::string, TensorData> m;
      for (auto it = (*outs)[i].begin(); it != (*outs)[i].end(); ++it)
        m[it.key()] = tensor_from_json(it.value(), join(p, it.key()));
      o.loss_fn_outputs.push_back(std::move(m));
    }
  }
  if (const json* t = find(j, "lossFnOutputType")) o.loss_fn_output_type = string(*t, join(path, "lossFnOutputType"));
  o.metrics = metrics_from_json(j, path);
  if (const json* u = find(j, "tokenUsage")) {
    object(*u, join(path, "tokenUsage"));
    if (const json* t = find(*u, "trainingTokens"))
      o.training_tokens = integer(*t, join(path, "tokenUsage.trainingTokens"), 0);
  }
  return o;
}

json Binding<op::Forward>::write_result(const ForwardResult& r) { return to_json(r.output); }
ForwardResult Binding<op::Forward>::read_result(const json& c, const std::string& p) {
  return ForwardResult{forward_backward_output_from_json(c, p)};
}
json Binding<op::ForwardBackward>::write_result(const ForwardBackwardResult& r) { return to_json(r.output); }
ForwardBackwardResult Binding<op::ForwardBackward>::read_result(const json& c, const std::string& p) {
  return ForwardBackwardResult{forward_backward_output_from_json(c, p)};
}
json Binding<op::OptimStep>::write_result(const OptimStepOutput& r) { return {{"metrics", wire_metrics(r.metrics)}}; }
OptimStepOutput Binding<op::OptimStep>::read_result(const json& c, const std::string& p) {
  return OptimStepOutput{metrics_from_json(c, p)};
}
json Binding<op::SaveWeightsForSampler>::write_result(const SaveWeightsResult& r) {
  json c = json::object();
  if (r.model_package_arn) c["modelPackageArn"] = *r.model_package_arn;
  return c;
}
SaveWeightsResult Binding<op::SaveWeightsForSampler>::read_result(const json& c, const std::string& p) {
  SaveWeightsResult r;
  if (const json* a = find(c, "modelPackageArn")) r.model_package_arn = string(*a, join(p, "modelPackageArn"));
  return r;
}
json Binding<op::SaveState>::write_result(const SaveStateResult& r) {
  return {{"modelPackageArn", r.model_package_arn}};
}
SaveStateResult Binding<op::SaveState>::read_result(const json& c, const std::string& p) {
  return SaveStateResult{string(need(c, p, "modelPackageArn"), join(p, "modelPackageArn"))};
}
json Binding<op::LoadState>::write_result(const LoadStateOutput&) { return json::object(); }
LoadStateOutput Binding<op::LoadState>::read_result(const json&, const std::string&) { return LoadStateOutput{}; }

json to_json(const TrainingResult& r) { return write_union<Call::training, true>(r); }

TrainingResult training_result_from_json(const json& j, const std::string& path) {
  return read_union<Call::training, true, TrainingResult>(j, path);
}

json to_json(const SampledSequence& s) {
  json j{{"stopReason", to_string(s.stop_reason)},
         {"tokens", s.tokens},
         {"logprobs", wire_numbers(s.logprobs)},
         {"tokenUsage", {{"prefill", s.prefill_tokens}, {"decode", s.decode_tokens}}}};
  if (s.routed_experts) j["routedExperts"] = to_json(*s.routed_experts);
  return j;
}

json to_json(const SampleResponse& r) {
  json seqs = json::array();
  for (const auto& s : r.sequences) seqs.push_back(to_json(s));
  json j{{"sequences", std::move(seqs)}};
  if (r.prompt_logprobs) j["promptLogprobs"] = wire_numbers(*r.prompt_logprobs);
  if (r.topk_prompt_logprobs) {
    json rows = json::array();
    for (const auto& row : *r.topk_prompt_logprobs) {
      json one = json::array();
      for (const auto& t : row) one.push_back({{"tokenId", t.token}, {"logprob", wire_number(t.logprob)}});
      rows.push_back(std::move(one));
    }
    j["topkPromptLogprobs"] = std::move(rows);
  }
  return j;
}

namespace {
std::vector<double> doubles(const json& j, const std::string& path) {
  array(j, path);
  std::vector<double> out;
  out.reserve(j.size());
  for (std::size_t i = 0; i < j.size(); ++i) out.push_back(number(j[i], at(path, i)));
  return out;
}

// A prompt's logprobs: the first token has no preceding context, so its entry is null (the SageMaker SDK's
// List[Optional[float]]); rlloop's C++ API keeps 0.0 there.
json prompt_logprobs_json(const std::vector<double>& logprobs) {
  json out = wire_numbers(logprobs);
  if (!out.empty()) out[0] = nullptr;
  return out;
}
std::vector<double> prompt_logprobs_from_json(const json& j, const std::string& path) {
  if (j.is_array() && !j.empty() && j[0].is_null()) {
    json rest = j;
    rest[0] = 0.0;
    return doubles(rest, path);
  }
  return doubles(j, path);
}
}  // namespace

SampleResponse sample_response_from_json(const json& j, const std::string& path) {
  object(j, path);
  SampleResponse r;
  const std::string spath = join(path, "sequences");
  const json& seqs = array(need(j, path, "sequences"), spath);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const std::string p = at(spath, i);
    object(seqs[i], p);
    SampledSequence s;
    const std::string reason = string(need(seqs[i], p, "stopReason"), join(p, "stopReason"));
    if (reason == "stop")
      s.stop_reason = StopReason::stop;
    else if (reason == "length")
      s.stop_reason = StopReason::length;
    else
      fail(join(p, "stopReason"), "unknown stop reason '" + reason + "' (expected stop or length)");
    const std::string tpath = join(p, "tokens");
    const json& tokens = array(need(seqs[i], p, "tokens"), tpath);
    for (std::size_t k = 0; k < tokens.size(); ++k)
      s.tokens.push_back(
          static_cast<token_id>(integer(tokens[k], at(tpath, k), 0, std::numeric_limits<token_id>::max())));
    if (const json* lp = find(seqs[i], "logprobs")) s.logprobs = doubles(*lp, join(p, "logprobs"));
    if (const json* u = find(seqs[i], "tokenUsage")) {
      const std::string upath = join(p, "tokenUsage");
      object(*u, upath);
      s.prefill_tokens = integer(need(*u, upath, "prefill"), join(upath, "prefill"), 0);
      s.decode_tokens = integer(need(*u, upath, "decode"), join(upath, "decode"), 0);
    }
    if (const json* e = find(seqs[i], "routedExperts"))
      s.routed_experts = tensor_from_json(*e, join(p, "routedExperts"));
    r.sequences.push_back(std::move(s));
  }
  if (const json* pl = find(j, "promptLogprobs")) r.prompt_logprobs = doubles(*pl, join(path, "promptLogprobs"));
  if (const json* tk = find(j, "topkPromptLogprobs")) {
    const std::string kpath = join(path, "topkPromptLogprobs");
    array(*tk, kpath);
    std::vector<std::vector<TokenLogprob>> rows;
    for (std::size_t i = 0; i < tk->size(); ++i) {
      const std::string rpath = at(kpath, i);
      array((*tk)[i], rpath);
      std::vector<TokenLogprob> row;
      for (std::size_t k = 0; k < (*tk)[i].size(); ++k) {
        const std::string p = at(rpath, k);
        const json& e = object((*tk)[i][k], p);
        row.push_back({static_cast<token_id>(
                           integer(need(e, p, "tokenId"), join(p, "tokenId"), 0, std::numeric_limits<token_id>::max())),
                       number(need(e, p, "logprob"), join(p, "logprob"))});
      }
      rows.push_back(std::move(row));
    }
    r.topk_prompt_logprobs = std::move(rows);
  }
  return r;
}

json Binding<op::Sample>::write_result(const SampleResponse& r) { return to_json(r); }
SampleResponse Binding<op::Sample>::read_result(const json& c, const std::string& p) {
  return sample_response_from_json(c, p);
}
json Binding<op::ComputeLogprobs>::write_result(const ComputeLogprobsResult& r) {
  return {{"logprobs", prompt_logprobs_json(r.logprobs)}};
}
ComputeLogprobsResult Binding<op::ComputeLogprobs>::read_result(const json& c, const std::string& p) {
  return ComputeLogprobsResult{prompt_logprobs_from_json(need(c, p, "logprobs"), join(p, "logprobs"))};
}
json Binding<op::LoadWeightsForSampling>::write_result(const LoadWeightsForSamplingResult&) { return json::object(); }
LoadWeightsForSamplingResult Binding<op::LoadWeightsForSampling>::read_result(const json&, const std::string&) {
  return LoadWeightsForSamplingResult{};
}

json to_json(const SamplingResult& r) { return write_union<Call::sampling, true>(r); }

SamplingResult sampling_result_from_json(const json& j, const std::string& path) {
  return read_union<Call::sampling, true, SamplingResult>(j, path);
}

namespace {
OperationStatus operation_status(const json& j, const std::string& path) {
  const std::string s = string(j, path);
  if (auto status = operation_status_from_string(s)) return *status;
  fail(path, "unknown operation status '" + s + "'");
}

template <class Result>
json state_json(const OperationState<Result>& s) {
  json j{{"status", to_string(s.status)}};
  if (s.result) j["operationResult"] = to_json(*s.result);
  if (s.error_details) j["errorDetails"] = *s.error_details;
  if (s.training_tokens) j["tokenUsage"] = {{"trainingTokens", *s.training_tokens}};
  return j;
}
}  // namespace

json to_json(const TrainingOperationState& s) { return state_json(s); }
json to_json(const SamplingOperationState& s) { return state_json(s); }

TrainingOperationState training_state_from_json(const json& j) {
  object(j, "");
  TrainingOperationState s;
  s.status = operation_status(need(j, "", "status"), "status");
  if (const json* r = find(j, "operationResult")) s.result = training_result_from_json(*r, "operationResult");
  if (const json* e = find(j, "errorDetails")) s.error_details = string(*e, "errorDetails");
  if (const json* u = find(j, "tokenUsage"))
    if (const json* t = find(object(*u, "tokenUsage"), "trainingTokens"))
      s.training_tokens = integer(*t, "tokenUsage.trainingTokens", 0);
  return s;
}

SamplingOperationState sampling_state_from_json(const json& j) {
  object(j, "");
  SamplingOperationState s;
  s.status = operation_status(need(j, "", "status"), "status");
  if (const json* r = find(j, "operationResult")) s.result = sampling_result_from_json(*r, "operationResult");
  if (const json* e = find(j, "errorDetails")) s.error_details = string(*e, "errorDetails");
  return s;
}

// ---- rlloop extensions: session info, usage and capabilities (not in the SageMaker spec) ---------------------

namespace {
// The member names of the two token-usage shapes: rlloop's own reports, and BillableTokenUsage.
struct UsageNames {
  const char* prefill;
  const char* sample;
  const char* training;
};
constexpr UsageNames kUsageNames{"prefill", "sample", "training"};
constexpr UsageNames kBillableUsageNames{"PrefillTokenCount", "SampleTokenCount", "TrainingTokenCount"};

json usage_to_json(const TokenUsage& u, const UsageNames& n) {
  return {{n.prefill, u.prefill}, {n.sample, u.sample}, {n.training, u.training}};
}

// Absent members read as 0.
TokenUsage usage_from_json(const json& j, const std::string& path, const UsageNames& n) {
  object(j, path);
  TokenUsage u;
  if (const json* v = find(j, n.prefill)) u.prefill = integer(*v, join(path, n.prefill), 0);
  if (const json* v = find(j, n.sample)) u.sample = integer(*v, join(path, n.sample), 0);
  if (const json* v = find(j, n.training)) u.training = integer(*v, join(path, n.training), 0);
  return u;
}
}  // namespace

json to_json(const TokenUsage& u) { return usage_to_json(u, kUsageNames); }

TokenUsage token_usage_from_json(const json& j, const std::string& path) {
  return usage_from_json(j, path, kUsageNames);
}

json billable_usage_to_json(const TokenUsage& u) { return usage_to_json(u, kBillableUsageNames); }

TokenUsage billable_usage_from_json(const json& j, const std::string& path) {
  return usage_from_json(j, path, kBillableUsageNames);
}

json to_json(const LoraOptions& l) {
  return {{"rank", l.rank}, {"alpha", l.alpha}, {"targetModules", l.target_modules}};
}

LoraOptions lora_from_json(const json& j, const std::string& path) {
  object(j, path);
  LoraOptions l;
  // Service output (session info): the bounds were the creator's to check.
  l.rank =
      static_cast<int>(integer(need(j, path, "rank"), join(path, "rank"), 0, std::numeric_limits<std::int32_t>::max()));
  l.alpha = static_cast<int>(
      integer(need(j, path, "alpha"), join(path, "alpha"), 1, std::numeric_limits<std::int32_t>::max()));
  if (const json* m = find(j, "targetModules")) {
    l.target_modules.clear();
    const std::string mpath = join(path, "targetModules");
    array(*m, mpath);
    for (std::size_t i = 0; i < m->size(); ++i) l.target_modules.push_back(string((*m)[i], at(mpath, i)));
  }
  return l;
}

json to_json(const SessionInfo& s) {
  json j{{"name", s.name},
         {"baseModel", s.base_model},
         {"modelType", s.model_type},
         {"chatRenderer", s.chat_renderer},
         {"vocabSize", s.vocab_size},
         {"maxPositionEmbeddings", s.max_position_embeddings},
         {"numParameters", s.num_parameters},
         {"numTrainableParameters", s.num_trainable_parameters},
         {"tokenizer", s.tokenizer},
         {"device", s.device},
         {"step", s.step}};
  if (s.lora) j["lora"] = to_json(*s.lora);
  if (s.eos_token_id) j["eosTokenId"] = *s.eos_token_id;
  if (s.experts.any())
    j["experts"] = {{"numExperts", s.experts.num_experts},
                    {"expertsPerToken", s.experts.experts_per_token},
                    {"sparseLayers", s.experts.sparse_layers}};
  return j;
}

SessionInfo session_info_from_json(const json& j, const std::string& path) {
  object(j, path);
  SessionInfo s;
  auto str = [&](const char* key, std::string& out) {
    if (const json* v = find(j, key)) out = string(*v, join(path, key));
  };
  auto num = [&](const char* key, std::int64_t& out) {
    if (const json* v = find(j, key)) out = integer(*v, join(path, key));
  };
  str("name", s.name);
  str("baseModel", s.base_model);
  str("modelType", s.model_type);
  str("chatRenderer", s.chat_renderer);
  str("tokenizer", s.tokenizer);
  str("device", s.device);
  num("vocabSize", s.vocab_size);
  num("maxPositionEmbeddings", s.max_position_embeddings);
  num("numParameters", s.num_parameters);
  num("numTrainableParameters", s.num_trainable_parameters);
  num("step", s.step);
  if (const json* l = find(j, "lora")) s.lora = lora_from_json(*l, join(path, "lora"));
  if (const json* e = find(j, "eosTokenId"))
    s.eos_token_id = static_cast<token_id>(integer(*e, join(path, "eosTokenId"), 0));
  if (const json* e = find(j, "experts")) {
    const std::string epath = join(path, "experts");
    object(*e, epath);
    s.experts.num_experts = integer(need(*e, epath, "numExperts"), join(epath, "numExperts"), 1);
    s.experts.experts_per_token = integer(need(*e, epath, "expertsPerToken"), join(epath, "expertsPerToken"), 1);
    s.experts.sparse_layers = integer(need(*e, epath, "sparseLayers"), join(epath, "sparseLayers"), 1);
  }
  return s;
}

json to_json(const ServerCapabilities& c) {
  return {{"baseModels", c.base_models},
          {"lossFunctions", c.loss_functions},
          {"supportsFullFinetune", c.supports_full_finetune},
          {"maxLoraRank", c.max_lora_rank}};
}

ServerCapabilities capabilities_from_json(const json& j, const std::string& path) {
  object(j, path);
  ServerCapabilities c;
  auto strings = [&](const char* key, std::vector<std::string>& out) {
    if (const json* v = find(j, key)) {
      array(*v, join(path, key));
      for (std::size_t i = 0; i < v->size(); ++i) out.push_back(string((*v)[i], at(join(path, key), i)));
    }
  };
  strings("baseModels", c.base_models);
  strings("lossFunctions", c.loss_functions);
  if (const json* v = find(j, "supportsFullFinetune"))
    c.supports_full_finetune = boolean(*v, join(path, "supportsFullFinetune"));
  if (const json* v = find(j, "maxLoraRank")) c.max_lora_rank = integer(*v, join(path, "maxLoraRank"), 0);
  return c;
}

}  // namespace rlloop::wire
