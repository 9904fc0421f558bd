#include "comm/codec.hpp"

namespace rlloop::engine::dist {

void ByteWriter::put(const std::string& s) {
  put(static_cast<std::uint64_t>(s.size()));
  bytes_.append(s);
}

void ByteWriter::put(const TensorData& t) {
  put(t.dtype);
  put(t.shape);
  put(t.float_data);
  put(t.int_data);
}

void ByteWriter::put(const Datum& d) {
  put(static_cast<std::uint64_t>(d.model_input.chunks.size()));
  for (const auto& c : d.model_input.chunks) put(c.tokens);
  put(static_cast<std::uint64_t>(d.loss_fn_inputs.size()));
  for (const auto& [name, t] : d.loss_fn_inputs) {
    put(name);
    put(t);
  }
}

void ByteWriter::put(const std::vector<Datum>& data) {
  put(static_cast<std::uint64_t>(data.size()));
  for (const auto& d : data) put(d);
}

// LossSpec and AdamParams are written member by member, bound here by a structured binding of all of them: a member
// added to either stops this from compiling until the writer and its reader carry it (a rank that dropped a loss
// setting would silently train with another loss); DataParallel.TheCodecCarriesEveryLossAndOptimizerSetting
// round-trips every member.
void ByteWriter::put(const LossSpec& loss) {
  const auto& [fn, epsilon_low, epsilon_high, beta, value_clip, truncation, kl_coeff] = loss;
  put(fn);
  put(epsilon_low);
  put(epsilon_high);
  put(beta);
  put(value_clip);
  put(truncation);
  put(kl_coeff);
}

void ByteWriter::put(const AdamParams& p) {
  const auto& [learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm, lora_plus_lr_ratio] = p;
  put(learning_rate);
  put(beta1);
  put(beta2);
  put(eps);
  put(weight_decay);
  put(grad_clip_norm.has_value());
  put(grad_clip_norm.value_or(0.0));
  put(lora_plus_lr_ratio);
}

void ByteWriter::put(const SessionOptions& o) {
  put(o.base_model);
  put(o.lora.has_value());
  if (o.lora) {
    put(o.lora->rank);
    put(o.lora->alpha);
    put(static_cast<std::uint64_t>(o.lora->target_modules.size()));
    for (const auto& m : o.lora->target_modules) put(m);
  }
  put(o.seed);
  put(o.name);
  put(o.value_head);
}

void ByteWriter::put(const Metrics& m) {
  put(static_cast<std::uint64_t>(m.size()));
  for (const auto& [name, v] : m) {
    put(name);
    put(v);
  }
}

void ByteWriter::put(const ForwardBackwardOutput& out) {
  put(static_cast<std::uint64_t>(out.loss_fn_outputs.size()));
  for (const auto& outputs : out.loss_fn_outputs) {
    put(static_cast<std::uint64_t>(outputs.size()));
    for (const auto& [name, t] : outputs) {
      put(name);
      put(t);
    }
  }
  put(out.loss_fn_output_type);
  put(out.metrics);
  put(out.training_tokens);
}

void ByteWriter::put(const SampleRequest& req) {
  put(req.prompt.tokens());
  put(req.num_samples);
  const SamplingParams& p = req.params;
  put(p.max_tokens);
  put(p.temperature);
  put(p.top_k);
  put(p.top_p);
  put(p.seed.has_value());
  put(p.seed.value_or(0));
  put(static_cast<std::uint64_t>(p.stop.size()));
  for (const auto& s : p.stop) put(s);
  put(p.stop_token_ids);
  put(req.include_routed_experts);
}

void ByteWriter::put(const std::vector<SampledSequence>& sequences) {
  put(static_cast<std::uint64_t>(sequences.size()));
  for (const auto& s : sequences) {
    put(s.stop_reason);
    put(s.tokens);
    put(s.logprobs);
    put(s.prefill_tokens);
    put(s.decode_tokens);
    put(s.routed_experts.has_value());
    if (s.routed_experts) put(*s.routed_experts);
  }
}

std::string ByteReader::get_string() {
  const auto n = get<std::uint64_t>();
  return std::string(take(n), n);
}

TensorData ByteReader::get_tensor_data() {
  TensorData t;
  t.dtype = get<DType>();
  t.shape = get_vector<std::int64_t>();
  t.float_data = get_vector<float>();
  t.int_data = get_vector<std::int64_t>();
  return t;
}

Datum ByteReader::get_datum() {
  Datum d;
  d.model_input.chunks.resize(get_count());
  for (auto& c : d.model_input.chunks) c.tokens = get_vector<token_id>();
  for (auto n = get_count(); n > 0; --n) {
    std::string name = get_string();
    d.loss_fn_inputs[name] = get_tensor_data();
  }
  return d;
}

std::vector<Datum> ByteReader::get_data() {
  std::vector<Datum> data(get_count());
  for (auto& d : data) d = get_datum();
  return data;
}

LossSpec ByteReader::get_loss_spec() {
  LossSpec loss;
  loss.fn = get<LossFn>();
  if (static_cast<std::size_t>(loss.fn) >= kLossCount) fail();  // no row of kLosses: a malformed message
  loss.epsilon_low = get<double>();
  loss.epsilon_high = get<double>();
  loss.beta = get<double>();
  loss.value_clip = get<double>();
  loss.truncation = get<double>();
  loss.kl_coeff = get<double>();
  return loss;
}

AdamParams ByteReader::get_adam_params() {
  AdamParams p;
  p.learning_rate = get<double>();
  p.beta1 = get<double>();
  p.beta2 = get<double>();
  p.eps = get<double>();
  p.weight_decay = get<double>();
  const bool clip = get<bool>();
  const double norm = get<double>();
  if (clip) p.grad_clip_norm = norm;
  p.lora_plus_lr_ratio = get<double>();
  return p;
}

SessionOptions ByteReader::get_session_options() {
  SessionOptions o;
  o.base_model = get_string();
  if (get<bool>()) {
    LoraOptions lora;
    lora.rank = get<int>();
    lora.alpha = get<int>();
    lora.target_modules.resize(get_count());
    for (auto& m : lora.target_modules) m = get_string();
    o.lora = lora;
  }
  o.seed = get<std::int64_t>();
  o.name = get_string();
  o.value_head = get<bool>();
  return o;
}

Metrics ByteReader::get_metrics() {
  Metrics m;
  for (auto n = get_count(); n > 0; --n) {
    std::string name = get_string();
    m[name] = get<double>();
  }
  return m;
}

ForwardBackwardOutput ByteReader::get_forward_output() {
  ForwardBackwardOutput out;
  out.loss_fn_outputs.resize(get_count());
  for (auto& outputs : out.loss_fn_outputs)
    for (auto n = get_count(); n > 0; --n) {
      std::string name = get_string();
      outputs[name] = get_tensor_data();
    }
  out.loss_fn_output_type = get_string();
  out.metrics = get_metrics();
  out.training_tokens = get<std::int64_t>();
  return out;
}

SampleRequest ByteReader::get_sample_request() {
  SampleRequest req;
  req.prompt = ModelInput::from_tokens(get_vector<token_id>());
  req.num_samples = get<int>();
  SamplingParams& p = req.params;
  p.max_tokens = get<int>();
  p.temperature = get<double>();
  p.top_k = get<int>();
  p.top_p = get<double>();
  const bool seeded = get<bool>();
  const auto seed = get<std::int64_t>();
  if (seeded) p.seed = seed;
  p.stop.resize(get_count());
  for (auto& s : p.stop) s = get_string();
  p.stop_token_ids = get_vector<token_id>();
  req.include_routed_experts = get<bool>();
  return req;
}

std::vector<SampledSequence> ByteReader::get_sequences() {
  std::vector<SampledSequence> out(get_count());
  for (auto& s : out) {
    s.stop_reason = get<StopReason>();
    s.tokens = get_vector<token_id>();
    s.logprobs = get_vector<double>();
    s.prefill_tokens = get<std::int64_t>();
    s.decode_tokens = get<std::int64_t>();
    if (get<bool>()) s.routed_experts = get_tensor_data();
  }
  return out;
}

}  // namespace rlloop::engine::dist
