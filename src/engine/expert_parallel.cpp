#include "expert_parallel.hpp"

#include <string>

#include <rlloop/error.hpp>

#include "dist/group.hpp"

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

std::vector<std::int64_t> as_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kCPU, torch::kLong).contiguous();
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
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
                                   const ExpertShard& shard, const ExpertActivation& activation) {
  dist::Group& group = *shard.group;
  const std::int64_t W = group.size(), N = x.size(0), k = routes.experts.size(1);
  const std::int64_t E = W * shard.per_rank;
  // This rank's routes sorted by expert (stably), so each owner's rows are one run, in expert then token order.
  const torch::Tensor flat = routes.experts.reshape({N * k});
  const torch::Tensor order = std::get<1>(torch::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor token = torch::div(order, k, "floor");
  const torch::Tensor experts = flat.index_select(0, order);
  const std::vector<std::int64_t> send =
      as_vector(torch::bincount(flat, {}, E).view({W, shard.per_rank}).sum(1));  // routes to each rank
  // How many rows each rank sends here, then which expert each of them is for.
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(W), 1);
  const std::vector<std::int64_t> recv =
      as_vector(group.all_to_all(torch::tensor(send, torch::kLong), ones, ones));
  const torch::Tensor arrived = group.all_to_all(experts.to(torch::kCPU), send, recv).to(x.device()) - shard.first;
  const torch::Tensor rows = RowExchange::apply(x.index_select(0, token), &group, send, recv);

  // The arrived rows through this rank's experts: sorted by expert, one product per expert, back in arrival order.
  const torch::Tensor by_expert = std::get<1>(torch::sort(arrived, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor counts = torch::bincount(arrived, {}, shard.per_rank).cpu();
  const torch::Tensor outputs = expert_products(rows.index_select(0, by_expert), counts, local, nullptr, false,
                                                activation);
  const torch::Tensor in_arrival_order = outputs.index_select(0, torch::argsort(by_expert));
  const torch::Tensor back = RowExchange::apply(in_arrival_order, &group, recv, send);  // [N k, H], as sent
  const torch::Tensor weights = routes.weights.reshape({N * k}).index_select(0, order).unsqueeze(1);
  return torch::zeros_like(x).index_add(0, token, back * weights);
}

}  // namespace rlloop::engine
