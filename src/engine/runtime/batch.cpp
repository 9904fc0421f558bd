#include "runtime/batch.hpp"

#include <algorithm>
#include <cmath>

#include <rlloop/limits.hpp>

#include "kernels/device.hpp"
#include "runtime/loss.hpp"
#include "runtime/target_logprobs.hpp"

namespace rlloop::engine {
namespace {

struct PaddedBatch {
  torch::Tensor ids, targets, mask;  // [B, T]
  std::vector<std::int64_t> lengths;
  std::int64_t total_tokens = 0;
  // The datums' loss input "routed_experts" in the ids' layout, [B * T, sparse layers, k] int64 (padding routed to
  // experts 0..k-1, its outputs masked out everywhere); undefined when the batch carries no routes.
  torch::Tensor routes;
};

// Right-pads every datum to the longest one. With causal attention, padding at the end cannot change the
// logits of real positions, so no attention mask is needed.
void check_lengths(const std::vector<Datum>& data, const ModelConfig& cfg) {
  std::int64_t T = 0;
  for (const auto& d : data) T = std::max(T, static_cast<std::int64_t>(d.model_input.length()));
  if (T > cfg.max_position_embeddings)
    throw invalid_argument("a datum has " + std::to_string(T) + " tokens, more than the model's " +
                           std::to_string(cfg.max_position_embeddings) + " positions");
}

PaddedBatch pad_batch(const std::vector<Datum>& data, const ModelConfig& cfg) {
  check_lengths(data, cfg);
  PaddedBatch b;
  std::int64_t T = 0;
  for (const auto& d : data) {
    b.lengths.push_back(static_cast<std::int64_t>(d.model_input.length()));
    T = std::max(T, b.lengths.back());
    b.total_tokens += b.lengths.back();
  }
  const auto B = static_cast<std::int64_t>(data.size());
  b.ids = torch::zeros({B, T}, torch::kInt64);
  b.targets = torch::zeros({B, T}, torch::kInt64);
  b.mask = torch::zeros({B, T}, torch::kFloat32);
  auto ids = b.ids.accessor<std::int64_t, 2>();
  auto targets = b.targets.accessor<std::int64_t, 2>();
  auto mask = b.mask.accessor<float, 2>();
  for (std::int64_t i = 0; i < B; ++i) {
    std::int64_t t = 0;
    for (const auto& c : data[i].model_input.chunks)
      for (token_id tok : c.tokens) ids[i][t++] = tok;
    // The value loss needs no targets; every other loss has them (validated before).
    auto tt = data[i].loss_fn_inputs.find("target_tokens");
    for (std::int64_t j = 0; j < b.lengths[i]; ++j) {
      if (tt != data[i].loss_fn_inputs.end())
        targets[i][j] = tt->second.dtype == DType::int64 ? tt->second.int_data[j]
                                                         : static_cast<std::int64_t>(tt->second.float_data[j]);
      mask[i][j] = 1.0f;
    }
  }
  if (data.front().loss_fn_inputs.count("routed_experts")) {  // every datum has them (validate_routes)
    const std::int64_t layers = data.front().loss_fn_inputs.at("routed_experts").shape[1];
    const std::int64_t k = cfg.num_experts_per_tok;
    b.routes = torch::arange(k, torch::kInt64).repeat({B * T, layers, 1});
    for (std::int64_t i = 0; i < B; ++i) {  // exactly the datum's tokens' routes (validate_routes checked the size)
      const std::int64_t* ids = data[i].loss_fn_inputs.at("routed_experts").int_data.data();
      std::copy(ids, ids + b.lengths[i] * layers * k, b.routes.data_ptr<std::int64_t>() + i * T * layers * k);
    }
  }
  return b;
}

// A [B, T] float tensor of one loss input (zero where absent or padded).
torch::Tensor padded_input(const std::vector<Datum>& data, const std::string& key, std::int64_t T, float fill) {
  auto out = torch::full({static_cast<std::int64_t>(data.size()), T}, 0.0f, torch::kFloat32);
  auto acc = out.accessor<float, 2>();
  for (std::size_t i = 0; i < data.size(); ++i) {
    auto it = data[i].loss_fn_inputs.find(key);
    const auto n = static_cast<std::int64_t>(data[i].model_input.length());
    if (it == data[i].loss_fn_inputs.end()) {
      for (std::int64_t j = 0; j < n; ++j) acc[i][j] = fill;
      continue;
    }
    const auto values = it->second.as_doubles();
    for (std::int64_t j = 0; j < n; ++j) acc[i][j] = static_cast<float>(values[j]);
  }
  return out;
}

// The final hidden states of the batch. A model with experts routes by the batch's routes when it carries them
// (routing replay), and its router's metrics over the real tokens go to `router` (router_metrics).
torch::Tensor batch_hidden_states(Transformer& model, const PaddedBatch& b, torch::Device device, Metrics& router) {
  const torch::Tensor ids = b.ids.to(device);
  if (model.config().num_experts == 0) return model.hidden_states(ids);
  RouterTotals totals;
  ExpertRouting routing{b.routes, {}, b.mask.reshape({-1}), &totals};
  torch::Tensor hidden = model.hidden_states(ids, nullptr, &routing);
  for (const auto& [name, value] : router_metrics(totals)) router[name] = value;
  return hidden;
}

// Logprob of each target token, [B, T] fp32, with the graph unless grad is off; the logits a chunk at a time
// (target_logprobs.hpp).
torch::Tensor target_logprobs(Transformer& model, const PaddedBatch& b, torch::Device device, Metrics& router) {
  return engine::target_logprobs(model, batch_hidden_states(model, b, device, router), b.targets.to(device));
}

torch::Device model_device(Transformer& model) { return model.parameters().front().device(); }

ForwardBackwardOutput make_output(const torch::Tensor& lp, const PaddedBatch& b) {
  ForwardBackwardOutput out;
  auto cpu = to_host(lp.detach()).contiguous();
  const float* base = cpu.data_ptr<float>();
  const std::int64_t T = cpu.size(1);
  for (std::size_t i = 0; i < b.lengths.size(); ++i) {
    const float* row = base + static_cast<std::int64_t>(i) * T;
    out.loss_fn_outputs.push_back({{"logprobs", TensorData::from_floats(std::vector<float>(row, row + b.lengths[i]))}});
  }
  out.training_tokens = b.total_tokens;
  return out;
}

}  // namespace

namespace {
// "loss:sum" and, for a loss that clips, its clip metric (its row of kLosses names it).
void add_loss_metrics(ForwardBackwardOutput& out, const LossSpec& loss, const LossValue& value) {
  out.metrics["loss:sum"] = value.loss.item<double>();
  if (const std::string_view clip = loss_info(loss.fn).clip_metric; !clip.empty())
    out.metrics[std::string(clip)] = value.clip_fraction();
}

// The critic: values from the value head, regressed on "returns". Outputs "values" per datum.
ForwardBackwardOutput run_value_loss(Transformer& model, const std::vector<Datum>& data, const LossSpec& loss,
                                     const PaddedBatch& b, bool backward, ClipCounts* counts) {
  const auto device = model_device(model);
  const std::int64_t T = b.ids.size(1);
  Metrics router;
  auto v = model.values(batch_hidden_states(model, b, device, router));
  bool has_old = true;
  for (const auto& d : data) has_old = has_old && d.loss_fn_inputs.count("old_values");
  torch::Tensor old_values;
  if (has_old) old_values = padded_input(data, "old_values", T, 0.0f).to(device);
  LossTensors in;
  in.mask = b.mask.to(device);
  in.weights = padded_input(data, "weights", T, 1.0f).to(device);
  in.returns = padded_input(data, "returns", T, 0.0f).to(device);
  in.old_values = old_values;
  auto value = builtin_loss(loss, v, in);
  if (backward) value.loss.backward();

  ForwardBackwardOutput out;
  auto cpu = to_host(v.detach()).contiguous();
  for (std::size_t i = 0; i < b.lengths.size(); ++i) {
    const float* row = cpu.data_ptr<float>() + static_cast<std::int64_t>(i) * T;
    out.loss_fn_outputs.push_back({{"values", TensorData::from_floats(std::vector<float>(row, row + b.lengths[i]))}});
  }
  out.training_tokens = b.total_tokens;
  add_loss_metrics(out, loss, value);
  out.metrics.insert(router.begin(), router.end());
  if (counts) *counts = value.counts();
  return out;
}
}  // namespace

void validate_builtin_batch(const ModelConfig& cfg, const std::vector<Datum>& data, const LossSpec& loss) {
  loss.validate();
  validate_batch(data, loss.fn, cfg.vocab_size, cfg.expert_shape());
  check_lengths(data, cfg);
}

void validate_custom_input(const ModelConfig& cfg, const std::vector<Datum>& data) {
  validate_custom_batch(data, cfg.vocab_size, cfg.expert_shape());
  check_lengths(data, cfg);
}

void check_loss_fits_model(const Transformer& model, const LossSpec& loss) {
  const LossInfo& info = loss_info(loss.fn);
  if (info.output == LossOutput::values && !model.has_value_head())
    throw invalid_argument("loss '" + std::string(info.name) +
                           "' needs a session created with a value head (SessionOptions::value_head)");
}

ForwardBackwardOutput run_builtin_loss(Transformer& model, const std::vector<Datum>& data, const LossSpec& loss,
                                       bool backward, ClipCounts* counts) {
  validate_builtin_batch(model.config(), data, loss);
  check_loss_fits_model(model, loss);
  auto b = pad_batch(data, model.config());
  const auto device = model_device(model);
  const std::int64_t T = b.ids.size(1);
  std::optional<torch::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();
  switch (loss_info(loss.fn).output) {
    case LossOutput::values:
      return run_value_loss(model, data, loss, b, backward, counts);
    case LossOutput::logprobs:
      break;
  }

  Metrics router;
  auto lp = target_logprobs(model, b, device, router);
  LossTensors in;
  in.mask = b.mask.to(device);
  in.weights = padded_input(data, "weights", T, 1.0f).to(device);
  in.advantages = padded_input(data, "advantages", T, 0.0f).to(device);
  in.sampler_logprobs = padded_input(data, "logprobs", T, 0.0f).to(device);
  for (const auto& d : data)
    if (d.loss_fn_inputs.count("sequence_ratio_mask")) {
      in.ratio_mask = padded_input(data, "sequence_ratio_mask", T, std::nanf("")).to(device);
      break;
    }
  auto value = builtin_loss(loss, lp, in);
  if (backward) value.loss.backward();

  auto out = make_output(lp, b);
  add_loss_metrics(out, loss, value);
  out.metrics.insert(router.begin(), router.end());
  if (counts) *counts = value.counts();
  return out;
}

struct CustomLossPass::Graph {
  torch::Tensor lp;  // [B, T] with the graph
  torch::Tensor mask;
  torch::Device device = torch::kCPU;
};

CustomLossPass::CustomLossPass() = default;
CustomLossPass::CustomLossPass(CustomLossPass&&) noexcept = default;
CustomLossPass& CustomLossPass::operator=(CustomLossPass&&) noexcept = default;
CustomLossPass::~CustomLossPass() = default;

CustomLossPass custom_loss_forward(Transformer& model, const std::vector<Datum>& data) {
  validate_custom_input(model.config(), data);
  auto b = pad_batch(data, model.config());
  CustomLossPass pass;
  pass.graph = std::make_unique<CustomLossPass::Graph>();
  pass.graph->device = model_device(model);
  pass.graph->lp = target_logprobs(model, b, pass.graph->device, pass.output.metrics);
  pass.graph->mask = b.mask;
  Metrics router = std::move(pass.output.metrics);
  pass.output = make_output(pass.graph->lp, b);
  pass.output.metrics = std::move(router);
  for (std::size_t i = 0; i < data.size(); ++i) pass.logprobs.push_back(pass.output.logprobs(i));
  return pass;
}

void check_custom_gradients(const CustomLossResult& result, const std::vector<std::vector<double>>& logprobs) {
  if (result.grad_logprobs.size() != logprobs.size())
    throw invalid_argument("forward_backward_custom: the loss function returned gradients for " +
                           std::to_string(result.grad_logprobs.size()) + " datums, expected " +
                           std::to_string(logprobs.size()));
  for (std::size_t i = 0; i < logprobs.size(); ++i) {
    const auto& g = result.grad_logprobs[i];
    if (g.size() != logprobs[i].size())
      throw invalid_argument("forward_backward_custom: gradient of datum " + std::to_string(i) + " has " +
                             std::to_string(g.size()) + " values, expected " + std::to_string(logprobs[i].size()));
    for (std::size_t j = 0; j < g.size(); ++j)
      if (!std::isfinite(g[j]))
        throw invalid_argument("forward_backward_custom: gradient of datum " + std::to_string(i) +
                               " is not finite at position " + std::to_string(j));
  }
}

void custom_loss_backward(CustomLossPass& pass, std::span<const std::vector<double>> grad_logprobs) {
  auto grad = torch::zeros_like(pass.graph->mask);
  auto acc = grad.accessor<float, 2>();
  for (std::size_t i = 0; i < grad_logprobs.size(); ++i)
    for (std::size_t j = 0; j < grad_logprobs[i].size(); ++j)
      acc[static_cast<std::int64_t>(i)][static_cast<std::int64_t>(j)] = static_cast<float>(grad_logprobs[i][j]);
  pass.graph->lp.backward(grad.to(pass.graph->device));
  pass.graph.reset();
}

ForwardBackwardOutput run_custom_loss(Transformer& model, const std::vector<Datum>& data, const CustomLossFn& fn) {
  if (!fn) throw invalid_argument("forward_backward_custom: no loss function given");
  CustomLossPass pass = custom_loss_forward(model, data);
  CustomLossResult result = fn(data, pass.logprobs);
  check_custom_gradients(result, pass.logprobs);
  custom_loss_backward(pass, result.grad_logprobs);
  ForwardBackwardOutput out = std::move(pass.output);
  Metrics router = std::move(out.metrics);
  out.metrics = result.metrics;
  out.metrics.insert(router.begin(), router.end());  // the loss function's own metrics win a clash
  out.metrics["loss:sum"] = result.loss;
  return out;
}

void validate_sample_request(const SampleRequest& req, const ModelConfig& cfg, bool has_tokenizer) {
  // The bounds and the model's shape are rlloop/limits.hpp's; only the tokenizer is this engine's to know.
  validate(req, Naming{}, ModelShape{cfg.max_position_embeddings, cfg.vocab_size});
  if (!req.params.stop.empty() && !has_tokenizer)
    throw invalid_argument("SamplingParams.stop: stop strings need the model's tokenizer, which could not be loaded");
}

StopStringCheck make_stop_string_check(const Tokenizer& tokenizer, std::vector<std::string> stops) {
  std::size_t longest = 0;
  for (const auto& s : stops) longest = std::max(longest, s.size());
  return [&tokenizer, stops = std::move(stops), longest](std::span<const token_id> generated) {
    // Every token decodes to at least one byte, so the last `longest` tokens cover any new occurrence;
    // an older one would have stopped the sequence already.
    const std::size_t n = std::min(generated.size(), longest);
    const std::string tail = tokenizer.decode(generated.subspan(generated.size() - n));
    for (const auto& s : stops)
      if (tail.find(s) != std::string::npos) return true;
    return false;
  };
}

}  // namespace rlloop::engine
