#include "model/expert_parallel.hpp"

#include <string>
#include <utility>

#include <rlloop/error.hpp>

#include "comm/group.hpp"

namespace rlloop::engine {
namespace {

// The all-to-all of rows as an autograd function: rank r sends send[j] rows to rank j and receives recv[j] from it;
// backward runs the exchange the other way with the gradients.
class RowExchange : public torch::autograd::Function<RowExchange> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& rows, dist::Group* group,
                               const std::vector<std::int64_t>& send, const std::vector<std::int64_t>& recv) {
    ctx->saved_data["group"] = static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(group));
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return group->all_to_all(rows, send, recv);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto* group = reinterpret_cast<dist::Group*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
    const std::vector<std::int64_t> send = ctx->saved_data["send"].toIntVector();
    const std::vector<std::int64_t> recv = ctx->saved_data["recv"].toIntVector();
    return {group->all_to_all(grads[0].contiguous(), recv, send), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor as_host(const torch::Tensor& t) { return t.to(torch::kCPU, torch::kLong).contiguous(); }

// The row sums of a host [W, per_rank] count matrix: the rows going to (or coming from) each rank.
std::vector<std::int64_t> rows_per_rank(const torch::Tensor& counts) {
  const torch::Tensor sums = counts.sum(1);
  return {sums.data_ptr<std::int64_t>(), sums.data_ptr<std::int64_t>() + sums.numel()};
}

// From `arriving` [W, per_rank] (rows from each rank for each local expert, ranks in order, each rank's rows sorted
// by expert): the arrival positions expert by expert (each expert's rows from rank 0 first) and each expert's count.
std::pair<torch::Tensor, torch::Tensor> expert_order(const torch::Tensor& arriving) {
  const std::int64_t W = arriving.size(0), per_rank = arriving.size(1);
  const std::int64_t* n = arriving.data_ptr<std::int64_t>();
  std::vector<std::int64_t> start(static_cast<std::size_t>(W * per_rank));
  for (std::int64_t i = 0, at = 0; i < W * per_rank; ++i) {
    start[static_cast<std::size_t>(i)] = at;
    at += n[i];
  }
  std::vector<std::int64_t> order, counts(static_cast<std::size_t>(per_rank), 0);
  for (std::int64_t e = 0; e < per_rank; ++e)
    for (std::int64_t j = 0; j < W; ++j) {
      const std::int64_t i = j * per_rank + e;
      for (std::int64_t r = 0; r < n[i]; ++r) order.push_back(start[static_cast<std::size_t>(i)] + r);
      counts[static_cast<std::size_t>(e)] += n[i];
    }
  return {torch::tensor(order, torch::kLong), torch::tensor(counts, torch::kLong)};
}

}  // namespace

ExpertShard ExpertShard::of(dist::Group& group, std::int64_t num_experts) {
  const int W = group.size();
  if (num_experts % W != 0)
    throw invalid_argument("expert parallelism: " + std::to_string(num_experts) + " experts do not split evenly over " +
                           std::to_string(W) + " ranks");
  const std::int64_t per_rank = num_experts / W;
  return {&group, group.rank() * per_rank, per_rank};
}

torch::Tensor run_experts_parallel(const torch::Tensor& x, const Routes& routes, const std::vector<Expert>& local,
                                   const ExpertAdapters* adapters, const ExpertShard& shard,
                                   const ExpertActivation& activation) {
  dist::Group& group = *shard.group;
  const std::int64_t W = group.size(), N = x.size(0), k = routes.experts.size(1);
  const std::int64_t E = W * shard.per_rank;
  // This rank's routes sorted by expert (stably), so each owner's rows are one run, in expert then token order.
  const torch::Tensor flat = routes.experts.reshape({N * k});
  const torch::Tensor order = std::get<1>(torch::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor token = torch::div(order, k, "floor");
  // Routes per expert, as [W, per_rank]: row j is what this rank sends rank j, expert by expert. Exchanged, row j
  // becomes what rank j sends here for each of this rank's experts: the arrival's layout (ranks in order, each
  // one's rows sorted by expert), with no expert ids to send.
  const torch::Tensor sending = torch::bincount(flat, {}, E).view({W, shard.per_rank});
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
  const torch::Tensor arriving = as_host(group.all_to_all(sending, ones, ones));  // [W, per_rank]
  const std::vector<std::int64_t> send = rows_per_rank(as_host(sending)), recv = rows_per_rank(arriving);
  const torch::Tensor rows = RowExchange::apply(x.index_select(0, token), &group, send, recv);

  // The arrived rows through this rank's experts, expert by expert (each expert's rows from rank 0, then rank 1, ...),
  // then back in arrival order.
  const auto [by_expert, counts] = expert_order(arriving);
  const torch::Tensor in_order = rows.index_select(0, by_expert.to(x.device()));
  torch::Tensor outputs = expert_products(in_order, counts, local, adapters, false, activation);
  // No row for this rank's experts: an empty output still tied to the rows and to the experts' adapters, so that
  // whether backward runs the exchanges here does not depend on the routes, only on what trains: with adapters on
  // the experts alone (the rows then need no gradient) the return exchange is in every rank's graph, as it is on a
  // rank whose experts got rows. (A rank that skipped an exchange would leave the others waiting.)
  if (outputs.size(0) == 0) {
    outputs = in_order.narrow(0, 0, 0) * 0;
    if (adapters)
      for (const torch::Tensor& a : {adapters->gate_up_a, adapters->down_a})
        if (a.defined() && a.requires_grad()) outputs = outputs + a.sum() * 0;
  }
  const torch::Tensor in_arrival_order = outputs.index_select(0, torch::argsort(by_expert).to(x.device()));
  const torch::Tensor back = RowExchange::apply(in_arrival_order, &group, recv, send);  // [N k, H], as sent
  const torch::Tensor weights = routes.weights.reshape({N * k}).index_select(0, order).unsqueeze(1);
  return torch::zeros_like(x).index_add(0, token, back * weights);
}

}  // namespace rlloop::engine
