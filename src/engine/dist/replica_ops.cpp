#include "dist/replica_ops.hpp"

#include <cmath>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>

#include <torch/torch.h>

#include <rlloop/error.hpp>

#include "runtime/batch.hpp"
#include "comm/codec.hpp"
#include "runtime/loss.hpp"
#include "runtime/session_model.hpp"

namespace rlloop::engine::dist {

namespace {

// A rank's reply in a gather or to an asynchronous share: its result, or the error its share met.
enum class Status : std::uint8_t { ok, failed };

// Rank 0: the first rank whose reply is a failure, as "rank R: message"; empty if every share succeeded.
std::string first_failure(const std::vector<std::string>& replies) {
  for (std::size_t r = 0; r < replies.size(); ++r) {
    ByteReader reader(replies[r]);
    if (reader.get<Status>() == Status::failed) return "rank " + std::to_string(r) + ": " + reader.get_string();
  }
  return {};
}

// Whether `name` is one of the tensors that differ from rank to rank: an expert's, under expert parallelism.
bool rank_own(const Transformer& model, const std::string& name) {
  return model.expert_parallel() && model.is_expert_tensor(name);
}

// The shape of a model and, over a shared frozen base, the bits of that base: equal on two ranks when they hold
// the same model (a full fine-tuning copy gets rank 0's weights anyway). An expert-parallel model's experts are
// each rank's own (other names on every rank): their count stands for them.
std::string model_fingerprint(const SessionModel& made) {
  const Transformer& model = *made.model;
  std::string shapes;
  std::size_t own = 0;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    if (rank_own(model, name))
      ++own;
    else
      shapes += name + c10::str(t.sizes()) + ";";
  };
  for (const auto& [name, t] : model.hf_state_dict()) add(name, t);
  for (const auto& [name, t] : made.model->named_trainable_parameters()) add(name, t);
  if (model.expert_parallel()) shapes += " expert tensors of this rank:" + std::to_string(own);
  if (made.shared_base)
    shapes += " frozen-weights:" + std::to_string(frozen_weights_hash(*made.shared_base, model.expert_parallel()));
  if (made.weights_hash) shapes += " weights read:" + std::to_string(*made.weights_hash);
  return shapes;
}

// The trainable tensors every rank holds alike: all but an expert-parallel model's experts.
std::vector<torch::Tensor> replicated_tensors(Transformer& model) {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : model.named_trainable_parameters())
    if (!rank_own(model, name)) out.push_back(t);
  return out;
}

// A rank with no datums in an expert-parallel pass: its sparse layers still take part in every exchange of the
// forward (and, with `backward`, of the backward), so it runs the model over no rows.
torch::Tensor idle_forward(Transformer& model, bool backward) {
  std::optional<torch::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();
  const auto device = model.parameters().front().device();
  return model.hidden_states(torch::zeros({0, 1}, torch::TensorOptions().dtype(torch::kLong).device(device)));
}
void idle_backward(const torch::Tensor& hidden) {
  if (hidden.requires_grad()) hidden.sum().backward();
}

// Sums a shard's outputs into the batch's (in rank order: the caller's datum order). The router's metrics (means
// over a shard's tokens) are summed weighted by the shard's tokens; mean_router_metrics divides once all are in.
void append_output(ForwardBackwardOutput& total, ForwardBackwardOutput&& part) {
  for (auto& o : part.loss_fn_outputs) total.loss_fn_outputs.push_back(std::move(o));
  total.training_tokens += part.training_tokens;
  total.loss_fn_output_type = part.loss_fn_output_type;
  for (const auto& [name, v] : part.metrics)
    total.metrics[name] += name.starts_with("router/") ? v * static_cast<double>(part.training_tokens) : v;
}

// The router's metrics of the whole batch: the shards' token-weighted mean (exact for router/z_loss and
// router/replay_mismatch; router/aux_loss, a product of two means, is approximated by its shards' weighted mean).
void mean_router_metrics(ForwardBackwardOutput& total) {
  for (auto& [name, v] : total.metrics)
    if (name.starts_with("router/") && total.training_tokens > 0) v /= static_cast<double>(total.training_tokens);
}

}  // namespace

std::string failure_reply(const std::exception& e) {
  ByteWriter w;
  w.put(Status::failed);
  w.put(std::string(e.what()));
  return w.take();
}

std::string ok_reply(const std::string& result) {
  ByteWriter w;
  w.put(Status::ok);
  return w.take() + result;
}

std::string reply_result(const std::string& reply, int rank) {
  ByteReader r(reply);
  if (r.get<Status>() == Status::failed)
    throw io_error("data-parallel rank " + std::to_string(rank) + ": " + r.get_string());
  return reply.substr(sizeof(Status));
}

std::vector<int> split_samples(int samples, int parts) {
  std::vector<int> bounds{0};
  for (int r = 0; r < parts; ++r) bounds.push_back(bounds.back() + samples / parts + (r < samples % parts ? 1 : 0));
  return bounds;
}

SamplePlacement place_samples(int samples, int parts, int first_rank) {
  const auto bounds = split_samples(samples, parts);
  SamplePlacement p{std::vector<int>(parts), std::vector<int>(parts)};
  for (int j = 0; j < parts; ++j) {
    const int rank = (first_rank + j) % parts;
    p.first[rank] = bounds[j];
    p.count[rank] = bounds[j + 1] - bounds[j];
  }
  return p;
}

std::vector<Share> shares_of(const std::vector<Datum>& data, int parts) {
  const auto bounds = split_by_tokens(data, parts);
  std::vector<Share> out(parts);
  for (int r = 0; r < parts; ++r) {
    out[r].data.assign(data.begin() + static_cast<std::ptrdiff_t>(bounds[r]),
                       data.begin() + static_cast<std::ptrdiff_t>(bounds[r + 1]));
    out[r].first = bounds[r];
  }
  return out;
}

std::string encode(const Share& share) {
  ByteWriter w;
  w.put(share.first);
  w.put(share.data);
  return w.take();
}

Share decode_share(const std::string& bytes) {
  ByteReader r(bytes);
  Share share;
  share.first = r.get<std::uint64_t>();
  share.data = r.get_data();
  return share;
}

std::vector<std::size_t> split_by_tokens(const std::vector<Datum>& data, int parts) {
  std::vector<double> prefix{0};
  for (const auto& d : data) prefix.push_back(prefix.back() + static_cast<double>(d.model_input.length()));
  std::vector<std::size_t> bounds{0};
  for (int r = 1; r < parts; ++r) {
    const double target = prefix.back() * r / parts;
    std::size_t i = bounds.back();
    // Advance while the next boundary is at least as close to this rank's share of the tokens.
    while (i < data.size() && std::abs(prefix[i + 1] - target) <= std::abs(prefix[i] - target)) ++i;
    bounds.push_back(i);
  }
  bounds.push_back(data.size());
  return bounds;
}

void open_replica(Group& group, const SessionModel* made, const std::string& error, const std::string& base_model,
                  bool shard) {
  ByteWriter w;
  // A LoRA model is sharded already (make_session_model sharded the base it shares).
  const bool cut = shard && made && !made->model->fully_sharded();
  const std::string refused = cut ? made->model->why_not_fully_shardable() : std::string();
  if (made && refused.empty()) {
    w.put(Status::ok);
    w.put(model_fingerprint(*made));
  } else {
    w.put(Status::failed);
    w.put(made ? refused : error);
  }
  const auto replies = group.gather(w.take());
  std::string verdict;  // empty: every rank holds the same model
  if (group.rank() == 0) {
    verdict = first_failure(replies);
    if (verdict.empty()) {
      ByteReader own(replies[0]);
      own.get<Status>();
      const std::string mine = own.get_string();
      for (std::size_t r = 1; r < replies.size() && verdict.empty(); ++r) {
        ByteReader theirs(replies[r]);
        theirs.get<Status>();
        if (theirs.get_string() != mine)
          verdict = "rank " + std::to_string(r) + " holds a different model for base model '" + base_model +
                    "' than rank 0 (other shapes or other frozen weights)";
      }
    }
  }
  group.broadcast(verdict);
  if (!verdict.empty()) throw invalid_argument("data-parallel session: " + verdict);
  // A model that was made sharded (each rank drew or read its own parts: init_sharded_model, load_sharded_model)
  // holds no trainable tensor every rank holds alike; any other gets rank 0's trainable weights.
  if (!made->model->trains_shards()) group.broadcast(replicated_tensors(*made->model));
  if (cut) made->model->set_fully_sharded(group);
}

ForwardBackwardOutput forward_share(Group& group, Transformer& model, const std::vector<Datum>& mine,
                                    const LossSpec& loss, bool backward) {
  ByteWriter w;
  std::string reply;
  try {
    ForwardBackwardOutput out;
    ClipCounts counts;
    ShardedPass gathered(model);  // a fully sharded model's root weights, for the whole pass
    if (!mine.empty()) {
      out = run_builtin_loss(model, mine, loss, backward, &counts);
    } else if (model.expert_parallel() || model.fully_sharded()) {
      const torch::Tensor hidden = idle_forward(model, backward);
      if (backward) idle_backward(hidden);
    }
    if (backward) gathered.reduce_gradients();
    w.put(Status::ok);
    w.put(out);
    w.put(counts.clipped);
    w.put(counts.bearing);
    reply = w.take();
  } catch (const std::exception& e) {
    reply = failure_reply(e);
  }
  const auto replies = group.gather(reply);
  if (group.rank() != 0) return {};
  if (auto failure = first_failure(replies); !failure.empty()) {
    // A share checked on rank 0 beforehand failed while running: the ranks' gradients may now differ.
    throw group_failure("data-parallel forward_backward failed on " + failure);
  }
  ForwardBackwardOutput total;
  ClipCounts counts;
  for (const auto& bytes : replies) {
    ByteReader r(bytes);
    r.get<Status>();
    append_output(total, r.get_forward_output());
    counts.clipped += r.get<double>();
    counts.bearing += r.get<double>();
  }
  // Fractions do not add up: recompute the loss's over the whole batch.
  if (auto it = total.metrics.find(std::string(loss_info(loss.fn).clip_metric)); it != total.metrics.end())
    it->second = counts.fraction();
  mean_router_metrics(total);
  return total;
}

namespace {

// Rank 0's part of custom_share: every share's forward outputs (`replies`) into `total`, the loss function over
// their logprobs, its metrics into `total`, and the reply that carries the gradients to every rank, or why there
// are none (the loss function's own error also in `fn_error`, rethrown once the workers know).
std::string custom_loss_gradients(const std::vector<std::string>& replies, const std::vector<Datum>& all,
                                  const CustomLossFn& fn, ForwardBackwardOutput& total, std::exception_ptr& fn_error) {
  ByteWriter w;
  try {
    if (auto failure = first_failure(replies); !failure.empty())
      throw group_failure("data-parallel forward_backward_custom failed on " + failure);
    for (const auto& bytes : replies) {
      ByteReader r(bytes);
      r.get<Status>();
      append_output(total, r.get_forward_output());
    }
    std::vector<std::vector<double>> logprobs;
    for (std::size_t i = 0; i < total.loss_fn_outputs.size(); ++i) logprobs.push_back(total.logprobs(i));
    CustomLossResult result = fn(all, logprobs);
    check_custom_gradients(result, logprobs);
    mean_router_metrics(total);
    Metrics router = std::move(total.metrics);
    total.metrics = result.metrics;
    total.metrics.insert(router.begin(), router.end());  // the loss function's own metrics win a clash
    total.metrics["loss:sum"] = result.loss;
    w.put(Status::ok);
    w.put(static_cast<std::uint64_t>(result.grad_logprobs.size()));
    for (const auto& g : result.grad_logprobs) w.put(g);
  } catch (const std::exception& e) {
    fn_error = std::current_exception();
    w = ByteWriter{};
    w.put(Status::failed);
    w.put(std::string(e.what()));
  }
  return w.take();
}

}  // namespace

ForwardBackwardOutput custom_share(Group& group, Transformer& model, const Share& mine, const std::vector<Datum>* all,
                                   const CustomLossFn* fn) {
  std::optional<CustomLossPass> pass;
  torch::Tensor idle;  // an expert-parallel or fully sharded rank without datums: its pass over no rows
  std::string reply;
  ShardedPass gathered(model);  // a fully sharded model's root weights, until the backward
  try {
    if (!mine.data.empty())
      pass = custom_loss_forward(model, mine.data);
    else if (model.expert_parallel() || model.fully_sharded())
      idle = idle_forward(model, /*backward=*/true);
    ByteWriter w;
    w.put(Status::ok);
    w.put(pass ? pass->output : ForwardBackwardOutput{});
    reply = w.take();
  } catch (const std::exception& e) {
    reply = failure_reply(e);
  }
  const auto replies = group.gather(reply);

  // Rank 0 runs the loss function over every share's logprobs and sends back the gradients, or why not.
  ForwardBackwardOutput total;
  std::exception_ptr fn_error;
  std::string grads;
  if (group.rank() == 0) grads = custom_loss_gradients(replies, *all, *fn, total, fn_error);
  group.broadcast(grads);
  ByteReader r(grads);
  if (r.get<Status>() == Status::failed) {
    // No rank runs a backward pass. Rank 0 reports the error (the loss function's own, as with one rank); the
    // workers drop their forward passes and wait for the next command.
    if (group.rank() == 0) std::rethrow_exception(fn_error);
    return {};
  }
  std::vector<std::vector<double>> grads_of_all(r.get_count());
  for (auto& g : grads_of_all) g = r.get_vector<double>();
  std::string done;
  try {
    if (pass) {
      if (mine.first + mine.data.size() > grads_of_all.size())
        throw io_error("data-parallel forward_backward_custom: the gradients do not cover this rank's datums");
      custom_loss_backward(*pass,
                           std::span<const std::vector<double>>(grads_of_all).subspan(mine.first, mine.data.size()));
    } else if (idle.defined()) {
      idle_backward(idle);
    }
    gathered.reduce_gradients();
    ByteWriter w;
    w.put(Status::ok);
    done = w.take();
  } catch (const std::exception& e) {
    done = failure_reply(e);
  }
  const auto finished = group.gather(done);
  if (group.rank() == 0)
    if (auto failure = first_failure(finished); !failure.empty())
      throw group_failure("data-parallel forward_backward_custom failed on " + failure);
  return total;
}

namespace {

// The optimizer's parameters that every rank holds alike (all but an expert-parallel model's experts), by index.
std::vector<std::size_t> replicated_parameters(const Transformer& model, const AdamW& optimizer) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < optimizer.parameters().size(); ++i)
    if (!rank_own(model, optimizer.parameters()[i].name)) out.push_back(i);
  return out;
}

// Every rank's gradients of the replicated parameters replaced by their sum over the ranks. (An expert's gradient
// is whole on the rank that holds it: the all-to-all's backward brought every rank's rows' share there.)
void sum_gradients(Group& group, const Transformer& model, AdamW& optimizer) {
  // One flat buffer: every gradient (zeros where a rank has none), then one flag per parameter that says how
  // many ranks had one, so a gradient no rank produced stays undefined as it would with one rank.
  // The buffer lives where the weights do (NCCL reduces CUDA tensors in place).
  const auto& ps = optimizer.parameters();
  const std::vector<std::size_t> summed = replicated_parameters(model, optimizer);
  const auto on =
      torch::TensorOptions().dtype(torch::kFloat32).device(ps.empty() ? torch::kCPU : ps[0].tensor.device());
  std::vector<torch::Tensor> parts;
  std::vector<float> defined(summed.size(), 0.0f);
  for (std::size_t j = 0; j < summed.size(); ++j) {
    const torch::Tensor grad = optimizer.gradient(summed[j]);
    if (grad.defined()) {
      parts.push_back(grad.detach().to(torch::kFloat32).reshape(-1));
      defined[j] = 1.0f;
    } else {
      parts.push_back(torch::zeros({ps[summed[j]].tensor.numel()}, on));
    }
  }
  parts.push_back(torch::tensor(defined, torch::kFloat32).to(on.device()));
  auto flat = torch::cat(parts);
  group.allreduce_sum(flat);
  {
    torch::NoGradGuard no_grad;
    std::int64_t at = 0;
    const auto count = static_cast<std::int64_t>(summed.size());
    const auto flags = flat.narrow(0, flat.numel() - count, count).to(torch::kCPU);
    const float* ranks_with_grad = flags.data_ptr<float>();
    for (std::size_t j = 0; j < summed.size(); ++j) {
      const auto& p = ps[summed[j]].tensor;
      const auto n = p.numel();
      if (ranks_with_grad[j] > 0) optimizer.set_gradient(summed[j], flat.narrow(0, at, n).view(p.sizes()));
      at += n;
    }
  }
}

// The norm of the whole model's gradient, as one rank holding all of it would compute it, where each rank holds a
// part of some parameters: the squares of those `differs` names (an expert's under expert parallelism, after
// sum_gradients; every shard of a fully sharded model, whose padding is zero) are added over the ranks, the others'
// (alike on every rank) counted once.
double grad_norm_over_ranks(Group& group, AdamW& optimizer, const std::function<bool(const std::string&)>& differs) {
  torch::NoGradGuard no_grad;
  const auto& ps = optimizer.parameters();
  const auto on = torch::TensorOptions().dtype(torch::kFloat64).device(ps[0].tensor.device());
  torch::Tensor replicated = torch::zeros({1}, on), own = torch::zeros({1}, on);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const torch::Tensor g = optimizer.gradient(i);
    if (!g.defined()) continue;
    (differs(ps[i].name) ? own : replicated).add_(g.to(torch::kFloat64).pow(2).sum());
  }
  group.allreduce_sum(own);
  return std::sqrt((replicated + own).item<double>());
}

// A checkpoint's tensors by name, as bytes: name, dtype, shape and the CPU copy's bytes of each.
void put_tensors(ByteWriter& w, const TensorMap& tensors) {
  w.put(static_cast<std::uint64_t>(tensors.size()));
  for (const auto& [name, t] : tensors) {
    const torch::Tensor cpu = t.detach().to(torch::kCPU).contiguous();
    w.put(name);
    w.put(static_cast<std::int8_t>(cpu.scalar_type()));
    w.put(cpu.sizes().vec());
    w.put(std::string(static_cast<const char*>(cpu.data_ptr()), cpu.nbytes()));
  }
}

TensorMap get_tensors(ByteReader& r) {
  TensorMap out;
  for (std::size_t n = r.get_count(); n > 0; --n) {
    std::string name = r.get_string();
    const auto dtype = static_cast<torch::ScalarType>(r.get<std::int8_t>());
    const auto shape = r.get_vector<std::int64_t>();
    const std::string bytes = r.get_string();
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(dtype));
    if (static_cast<std::size_t>(t.nbytes()) != bytes.size())
      throw io_error("data-parallel message: tensor '" + name + "' has " + std::to_string(bytes.size()) +
                     " bytes for its shape's " + std::to_string(t.nbytes()));
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    out.emplace(std::move(name), std::move(t));
  }
  return out;
}

// A rank's part of a checkpoint as bytes (load_state of an expert-parallel or fully sharded session).
std::string encode_part(const TensorMap& weights, const TensorMap& optimizer, const TensorMap& gradients,
                        std::int64_t step) {
  ByteWriter w;
  put_tensors(w, weights);
  put_tensors(w, optimizer);
  put_tensors(w, gradients);
  w.put(step);
  return w.take();
}

// Loads `part` (encode_part's) where `load_here`: the weights by name, a fresh optimizer with (`with_optimizer`)
// the saved state and step, and the saved gradients; then every rank reports to rank 0, which throws naming a rank
// that could not.
void load_part_and_report(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                          const std::string& part, bool load_here) {
  std::string reply;
  try {
    if (load_here) {
      ByteReader r(part);
      const TensorMap weights = get_tensors(r), opt = get_tensors(r), gradients = get_tensors(r);
      const auto saved_step = r.get<std::int64_t>();
      load_trainable(model, weights);
      optimizer = make_optimizer(model);
      if (with_optimizer) optimizer->load_state_tensors(opt, saved_step);
      optimizer->zero_grad();
      const auto& ps = optimizer->parameters();
      for (std::size_t i = 0; i < ps.size(); ++i)
        if (auto it = gradients.find(ps[i].name); it != gradients.end()) optimizer->set_gradient(i, it->second);
    }
    ByteWriter w;
    w.put(Status::ok);
    reply = w.take();
  } catch (const std::exception& e) {
    reply = failure_reply(e);
  }
  const auto replies = group.gather(reply);
  if (group.rank() == 0)
    if (auto failure = first_failure(replies); !failure.empty())
      throw group_failure("data-parallel load_state failed on " + failure);
}

}  // namespace

Metrics optim_step_share(Group& group, Transformer& model, AdamW& optimizer, const AdamParams& params) {
  // Fully sharded: each rank's shards already hold the sum of every rank's gradient (reduce-scattered); the norm
  // is the whole model's.
  if (model.trains_shards())
    return optimizer.step(params, grad_norm_over_ranks(group, optimizer, [](const std::string&) { return true; }));
  sum_gradients(group, model, optimizer);
  if (!model.expert_parallel()) return optimizer.step(params);
  return optimizer.step(
      params, grad_norm_over_ranks(group, optimizer, [&](const std::string& name) { return rank_own(model, name); }));
}

void fold_gradients_share(Group& group, Transformer& model, AdamW& optimizer) {
  if (model.trains_shards()) return;  // its shards' gradients are summed already (gather_shards_share saves them)
  sum_gradients(group, model, optimizer);
  if (group.rank() == 0) return;
  for (std::size_t i : replicated_parameters(model, optimizer)) optimizer.clear_gradient(i);
}

NamedState gather_experts_share(Group& group, Transformer& model, AdamW& optimizer, bool with_optimizer,
                                bool with_gradients) {
  NamedState own;  // rank 0 reads its own in place: it sends nothing
  if (group.rank() != 0) {
    for (auto& [name, t] : model.named_trainable_parameters())
      if (rank_own(model, name)) own.weights[name] = t;
    if (with_optimizer)
      for (auto& [name, t] : optimizer.state_tensors())
        if (rank_own(model, name)) own.optimizer[name] = t;
    const auto& ps = optimizer.parameters();
    for (std::size_t i = 0; with_gradients && i < ps.size(); ++i)
      if (const torch::Tensor g = optimizer.gradient(i); g.defined() && rank_own(model, ps[i].name))
        own.gradients[ps[i].name] = g.to(torch::kFloat32);
  }
  ByteWriter w;
  put_tensors(w, own.weights);
  put_tensors(w, own.optimizer);
  put_tensors(w, own.gradients);
  const auto replies = group.gather(w.take());
  NamedState others;
  for (std::size_t r = 1; r < replies.size(); ++r) {
    ByteReader reader(replies[r]);
    others.weights.merge(get_tensors(reader));
    others.optimizer.merge(get_tensors(reader));
    others.gradients.merge(get_tensors(reader));
  }
  return others;
}

namespace {
// What of `tensors` rank `rank` holds: the tensors every rank holds, and its own experts'.
TensorMap rank_slice(const Transformer& model, const TensorMap& tensors, int rank) {
  TensorMap out;
  for (const auto& [name, t] : tensors) {
    const int owner = model.expert_rank_of(name);
    if (owner < 0 || owner == rank) out.emplace(name, t);
  }
  return out;
}
}  // namespace

void load_state_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                      const NamedState* state, std::int64_t step) {
  // Each rank gets its slice of the checkpoint (rank 0's holds nothing: it loaded the whole one).
  std::vector<std::string> slices;
  if (group.rank() == 0) {
    slices.resize(static_cast<std::size_t>(group.size()));
    TensorMap experts;  // the replicated parameters' gradients stay on rank 0, as after fold_gradients
    for (const auto& [name, g] : state->gradients)
      if (rank_own(model, name)) experts.emplace(name, g);
    for (int r = 1; r < group.size(); ++r)
      slices[static_cast<std::size_t>(r)] =
          encode_part(rank_slice(model, state->weights, r),
                      with_optimizer ? rank_slice(model, state->optimizer, r) : TensorMap{},
                      rank_slice(model, experts, r), step);
  }
  load_part_and_report(group, model, optimizer, with_optimizer, group.scatter(slices), group.rank() != 0);
}

NamedState gather_shards_share(Group& group, Transformer& model, AdamW& optimizer, bool with_optimizer,
                               bool with_gradients) {
  torch::NoGradGuard no_grad;
  NamedState out;
  const bool root = group.rank() == 0;
  // Every rank walks the same names in the same order: each one is an all-gather.
  auto gather = [&](TensorMap& into, const std::string& key, const std::string& weight, const torch::Tensor& part,
                    const torch::Device& on) {
    torch::Tensor whole = model.unshard(weight, part.to(on));
    if (root) into[key] = whole.to(torch::kCPU);
  };
  const auto& ps = optimizer.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const torch::Device device = ps[i].tensor.device();
    gather(out.weights, ps[i].name, ps[i].name, ps[i].tensor, device);
    if (with_gradients) {
      const torch::Tensor g = optimizer.gradient(i);
      gather(out.gradients, ps[i].name, ps[i].name, g.defined() ? g : torch::zeros_like(ps[i].tensor), device);
    }
  }
  const torch::Device device = ps.empty() ? torch::Device(torch::kCPU) : ps[0].tensor.device();
  if (with_optimizer)
    for (const auto& [key, part] : optimizer.state_tensors())
      gather(out.optimizer, key, AdamW::parameter_of_state(key), part, device);
  return out;
}

void load_shards_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer,
                       const NamedState* state, std::int64_t step) {
  std::vector<std::string> parts;
  std::string refused;  // rank 0: why the checkpoint cannot be cut (a name or shape the model lacks)
  if (group.rank() == 0) {
    try {
      for (int r = 0; r < group.size(); ++r) {
        TensorMap weights, opt, gradients;
        for (const auto& [name, t] : state->weights) weights[name] = model.shard_of(name, t, r);
        if (with_optimizer)
          for (const auto& [key, t] : state->optimizer) opt[key] = model.shard_of(AdamW::parameter_of_state(key), t, r);
        for (const auto& [name, g] : state->gradients) gradients[name] = model.shard_of(name, g, r);
        parts.push_back(encode_part(weights, opt, gradients, step));
      }
    } catch (const std::exception& e) {
      refused = e.what();
      parts.assign(static_cast<std::size_t>(group.size()), std::string());
    }
  }
  group.broadcast(refused);
  if (!refused.empty()) {
    if (group.rank() == 0) throw invalid_argument("load_state: " + refused);
    return;
  }
  load_part_and_report(group, model, optimizer, with_optimizer, group.scatter(parts), /*load_here=*/true);
}

void sync_state_share(Group& group, Transformer& model, std::unique_ptr<AdamW>& optimizer, bool with_optimizer) {
  group.broadcast(replicated_tensors(model));
  if (!with_optimizer) {
    optimizer = make_optimizer(model);
  } else {
    std::string step;
    if (group.rank() == 0) {
      ByteWriter w;
      w.put(optimizer->step_count());
      step = w.take();
    }
    group.broadcast(step);
    ByteReader r(step);
    optimizer->set_step(r.get<std::int64_t>());
    group.broadcast(optimizer->state());
    optimizer->sync_parameters();  // bf16 parameters: their masters' rounding, as on rank 0
  }
  optimizer->zero_grad();
}

void load_sampler_share(Group& group, Transformer& model, const TensorMap* checkpoint) {
  if (!model.expert_parallel()) {
    group.broadcast(replicated_tensors(model));
    return;
  }
  std::vector<std::string> slices;
  if (group.rank() == 0) {
    slices.resize(static_cast<std::size_t>(group.size()));
    for (int r = 1; r < group.size(); ++r) {
      ByteWriter w;
      put_tensors(w, rank_slice(model, *checkpoint, r));
      slices[static_cast<std::size_t>(r)] = w.take();
    }
  }
  const std::string bytes = group.scatter(slices);
  if (group.rank() == 0) return;
  ByteReader r(bytes);
  load_trainable(model, get_tensors(r));
}

namespace {

// The sum of the version counters of `model`'s trainable tensors: it changes with every optimizer step and load.
std::uint64_t weights_version(Transformer& model) {
  std::uint64_t v = 0;
  for (auto& [name, t] : model.named_trainable_parameters()) v += static_cast<std::uint64_t>(t._version());
  return v;
}

// This rank's tensor-parallel slice of the batch's model, with the service's KV budget: the one kept from an
// earlier batch while the weights are unchanged on every rank (one all-reduce of a flag says), else cut again (one
// gather of a sharded model's layers, one at a time) and kept.
std::shared_ptr<Transformer> slice_for_batch(Group& group, const LockstepBatch& mine) {
  TensorParallelSlice fresh;
  TensorParallelSlice& kept = mine.slice ? *mine.slice : fresh;
  const std::uint64_t version = weights_version(*mine.model);
  const auto device = mine.model->parameters().front().device();
  torch::Tensor stale = torch::full({1}, kept.model && kept.version == version ? 0.0f : 1.0f,
                                    torch::TensorOptions().device(device));
  group.allreduce_sum(stale);
  if (stale.item<float>() != 0.0f) {
    kept.model.reset();  // the old slice goes before the new one is cut
    kept.model = mine.model->tensor_parallel(group);
    kept.model->kv_pools()->set_capacity_bytes(mine.kv_capacity_bytes);
    kept.version = version;
  }
  return kept.model;
}

// Rank 0's part of a tensor-parallel sample_lockstep_share: every rank drew the same samples, so each request's are
// rank 0's (`own`), unless a rank's share failed (the first such rank named).
std::vector<LockstepOutcome> tensor_parallel_outcomes(const std::vector<std::string>& replies,
                                                      std::vector<SampleResponse>& own) {
  std::vector<LockstepOutcome> out(own.size());
  for (std::size_t rank = 0; rank < replies.size(); ++rank) {
    ByteReader r(replies[rank]);
    for (std::size_t i = 0; i < own.size(); ++i) {
      if (r.get<Status>() == Status::ok) {
        r.get_sequences();
      } else if (const std::string why = r.get_string(); out[i].error.empty()) {
        out[i].error = "rank " + std::to_string(rank) + ": " + why;
      }
    }
  }
  for (std::size_t i = 0; i < own.size(); ++i)
    if (out[i].error.empty()) out[i].response = std::move(own[i]);
  return out;
}

// Each run's response into `own` (by request, in order) and, as the reply to rank 0, this rank's sequences of each
// request or why its share failed.
std::string take_responses(const std::vector<LockstepShare>& shares, std::vector<std::unique_ptr<DecodeRun>>& runs,
                           std::vector<SampleResponse>& own) {
  ByteWriter w;
  for (std::size_t i = 0; i < shares.size(); ++i) {
    if (!shares[i].error.empty()) {
      w.put(Status::failed);
      w.put(shares[i].error);
      continue;
    }
    if (runs[i]) own[i] = runs[i]->take();
    w.put(Status::ok);
    w.put(own[i].sequences);
  }
  return w.take();
}

// One forward of a lockstep on a fully sharded model: its root weights gathered for it, no graph (nothing on
// another model).
struct StepPass {
  torch::NoGradGuard no_grad;
  ShardedPass pass;
  explicit StepPass(Transformer& model) : pass(model) {}
};

// Rank 0's part of sample_lockstep_share: each request's response from every rank's sequences (`replies`, in
// sample_lockstep_share's layout) and its own response (`own`), or the first failure a rank reported.
std::vector<LockstepOutcome> lockstep_outcomes(const std::vector<std::string>& replies,
                                               const std::vector<SamplePlacement>& placements,
                                               std::vector<SampleResponse>& own) {
  const std::size_t n = placements.size();
  std::vector<LockstepOutcome> out(n);
  std::vector<ByteReader> readers(replies.begin(), replies.end());
  for (std::size_t i = 0; i < n; ++i) {
    const SamplePlacement& placement = placements[i];
    LockstepOutcome& outcome = out[i];
    // Each rank decoded a contiguous run of the samples: every sequence goes to its index. Rank 0's response
    // carries what only it computes (prompt logprobs: such a request is all rank 0's).
    std::vector<SampledSequence> all(std::accumulate(placement.count.begin(), placement.count.end(), std::size_t{0}));
    for (std::size_t rank = 0; rank < readers.size(); ++rank) {
      ByteReader& r = readers[rank];
      if (r.get<Status>() == Status::failed) {
        const std::string why = r.get_string();
        if (outcome.error.empty()) outcome.error = "rank " + std::to_string(rank) + ": " + why;
        continue;
      }
      auto sequences = r.get_sequences();
      for (std::size_t j = 0; j < sequences.size(); ++j) all.at(placement.first[rank] + j) = std::move(sequences[j]);
    }
    if (!outcome.error.empty()) continue;
    outcome.response = std::move(own[i]);
    outcome.response.sequences = std::move(all);
  }
  return out;
}

}  // namespace

std::vector<LockstepOutcome> sample_lockstep_share(Group& group, LockstepBatch& mine) {
  const std::shared_ptr<Transformer> slice = mine.tensor_parallel ? slice_for_batch(group, mine) : nullptr;
  Transformer& model = slice ? *slice : *mine.model;
  const std::size_t n = mine.shares.size();
  std::vector<std::unique_ptr<DecodeRun>> runs(n);
  auto idle = [&] { idle_forward(model, /*backward=*/false); };
  // A forward's exchanges: the sparse layers' all-to-alls, a sharded model's per-layer all-gathers (its root's
  // all-gather is StepPass's, outside what is counted), a tensor-parallel slice's all-reduces.
  auto exchanges = [&] {
    const CollectiveStats s = group.stats();
    return s.alltoall_calls + s.allgather_calls + s.allreduce_calls;
  };
  // The runs, in the batch's order. A run that prefills as it is made owes the others that forward: a rank without a
  // share of its request, or whose run failed before the forward's first exchange (a KV block the pool cannot give),
  // runs it over no rows. (One failing inside the forward, between two exchanges, leaves the others waiting: the
  // group fails at its timeout.)
  for (std::size_t i = 0; i < n; ++i) {
    LockstepShare& share = mine.shares[i];
    StepPass pass(model);
    const std::uint64_t before = exchanges();
    if (share.error.empty() && share.req.num_samples > 0) {
      try {
        runs[i] = std::make_unique<DecodeRun>(model, share.req, share.stop_check, share.stream, mine.precision,
                                              mine.rounded, Prefill::in_steps);
        if (share.on_step) {
          if (!runs[i]->prefilling()) share.on_step(runs[i]->progress());  // the first tokens, from that forward
          runs[i]->on_step = share.on_step;
        }
      } catch (const std::exception& e) {
        share.error = e.what();
        runs[i].reset();
      }
    }
    if (share.at_once && exchanges() == before) idle();
  }
  const auto device = model.parameters().front().device();
  for (;;) {
    std::vector<DecodeRun*> decoding;
    for (auto& run : runs)
      if (run && !run->done()) decoding.push_back(run.get());
    torch::Tensor active = torch::full({1}, decoding.empty() ? 0.0f : 1.0f, torch::TensorOptions().device(device));
    group.allreduce_sum(active);
    if (active.item<float>() == 0.0f) break;
    StepPass pass(model);
    if (decoding.empty()) {
      idle();
      continue;
    }
    const std::uint64_t before = exchanges();
    try {
      decode_step(decoding, mine.prefill_tokens);
    } catch (const std::exception& e) {
      for (std::size_t i = 0; i < n; ++i)
        if (runs[i] && !runs[i]->done()) {
          mine.shares[i].error = e.what();
          runs[i].reset();
        }
      if (exchanges() == before) idle();
    }
  }
  std::vector<SampleResponse> own(n);
  const auto replies = group.gather(take_responses(mine.shares, runs, own));
  if (group.rank() != 0) return {};
  if (mine.tensor_parallel) return tensor_parallel_outcomes(replies, own);
  return lockstep_outcomes(replies, mine.placements, own);
}

std::vector<double> logprobs_lockstep_share(Group& group, Transformer& model, const std::vector<token_id>& tokens) {
  std::vector<double> out;
  std::exception_ptr error;  // rank 0's, thrown once the others are through: the group's next command lines up
  StepPass pass(model);
  if (group.rank() == 0) {
    try {
      out = compute_logprobs(model, tokens);
    } catch (...) {
      error = std::current_exception();
    }
  } else {
    idle_forward(model, /*backward=*/false);
  }
  acknowledge(group);
  if (error) std::rethrow_exception(error);
  return out;
}

void acknowledge(Group& group) { group.gather({}); }

}  // namespace rlloop::engine::dist
