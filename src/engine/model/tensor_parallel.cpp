#include "model/tensor_parallel.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include <torch/torch.h>

#include "comm/group.hpp"

namespace rlloop::engine {

TensorParallel::TensorParallel(dist::Group& group, std::int64_t vocab_size)
    : group_(&group), vocab_rows_(vocab_size / group.size()) {}

int TensorParallel::rank() const { return group_->rank(); }
int TensorParallel::size() const { return group_->size(); }

torch::Tensor TensorParallel::sum(const torch::Tensor& part) const {
  c10::InferenceMode normal_tensors(false);
  const bool widen = !part.is_cuda() && (part.scalar_type() == torch::kBFloat16 || part.scalar_type() == torch::kHalf);
  torch::Tensor total = widen ? part.to(torch::kFloat32) : part.clone();
  torch::Tensor flat = total.view(-1);
  group_->allreduce_sum(flat);
  return widen ? total.to(part.scalar_type()) : total;
}

torch::Tensor TensorParallel::embed(const torch::Tensor& embed, const torch::Tensor& ids) const {
  const torch::Tensor local = ids - vocab_first();
  const torch::Tensor mine = (local >= 0) & (local < vocab_rows_);
  const torch::Tensor rows = torch::embedding(embed, local.clamp(0, vocab_rows_ - 1));
  return sum(rows * mine.unsqueeze(-1).to(rows.scalar_type()));
}

torch::Tensor TensorParallel::gather_vocabulary(const torch::Tensor& part) const {
  const std::int64_t W = size(), n = part.numel() / std::max<std::int64_t>(part.size(-1), 1);
  // [W, n, V / W]: every rank's columns of every row, then the rows with their columns side by side in rank order.
  const torch::Tensor all = group_->all_gather(part.contiguous().view(-1)).view({W, n, part.size(-1)});
  std::vector<std::int64_t> shape = part.sizes().vec();
  shape.back() *= W;
  return all.permute({1, 0, 2}).reshape(shape);
}

torch::Tensor tensor_parallel_slice(const torch::Tensor& whole, at::IntArrayRef local, int rank, bool rank_zero_only) {
  torch::NoGradGuard no_grad;
  if (whole.dim() != static_cast<std::int64_t>(local.size()))
    throw std::logic_error("tensor_parallel_slice: the slice has another rank of dimensions");
  if (rank_zero_only) return rank == 0 ? whole.clone() : torch::zeros_like(whole);
  for (std::int64_t d = 0; d < whole.dim(); ++d)
    if (whole.size(d) != local[static_cast<std::size_t>(d)])
      return whole.narrow(d, rank * local[static_cast<std::size_t>(d)], local[static_cast<std::size_t>(d)]).clone();
  return whole.clone();
}

}  // namespace rlloop::engine
