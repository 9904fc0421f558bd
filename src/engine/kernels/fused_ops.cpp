#include "kernels/fused_ops.hpp"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernels/simd.hpp"

namespace rlloop::engine {
namespace {

bool fused_dtype(const torch::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kFloat64);
}

// Rows per block of the weight-gradient reduction: blocks are fixed by the shape, not the thread count, and
// their partial sums are added in order, so results are bit-identical across runs and thread counts.
constexpr std::int64_t kRowsPerBlock = 64;

class RmsNormFn : public torch::autograd::Function<RmsNormFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               double eps) {
    x = x.contiguous();
    weight = weight.contiguous();
    const std::int64_t H = x.size(-1), rows = x.numel() / H;
    auto y = torch::empty_like(x);
    auto inv_rms = torch::empty({rows}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = weight.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      scalar_t* rp = inv_rms.data_ptr<scalar_t>();
      at::parallel_for(0, rows, kRowsPerBlock, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) rp[r] = rms_norm_row(xp + r * H, wp, yp + r * H, H, eps);
      });
    });
    ctx->save_for_backward({x, weight, inv_rms});
    return y;
  }

  // With g = dy * w:  dx = r * (g - x * r^2 * sum(g * x) / H),  dw = sum over rows of dy * x * r.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &inv_rms = saved[2];
    const torch::Tensor dy = grads[0].contiguous();
    const std::int64_t H = x.size(-1), rows = x.numel() / H;
    const std::int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const bool want_dw = ctx->needs_input_grad(1);
    auto dx = torch::empty_like(x);
    auto partial_dw = torch::zeros({want_dw ? blocks : 0, H}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_backward", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      const scalar_t* wp = weight.data_ptr<scalar_t>();
      const scalar_t* rp = inv_rms.data_ptr<scalar_t>();
      const scalar_t* dyp = dy.data_ptr<scalar_t>();
      scalar_t* dxp = dx.data_ptr<scalar_t>();
      at::parallel_for(0, blocks, 1, [&](std::int64_t block_begin, std::int64_t block_end) {
        for (std::int64_t blk = block_begin; blk < block_end; ++blk) {
          scalar_t* dw = want_dw ? partial_dw.data_ptr<scalar_t>() + blk * H : nullptr;
          for (std::int64_t r = blk * kRowsPerBlock; r < std::min(rows, (blk + 1) * kRowsPerBlock); ++r) {
            const scalar_t *xr = xp + r * H, *dyr = dyp + r * H;
            const scalar_t inv = rp[r];
            double dot = 0;
            for (std::int64_t i = 0; i < H; ++i) dot += static_cast<double>(dyr[i]) * wp[i] * xr[i];
            const auto c = static_cast<scalar_t>(dot * inv * inv / static_cast<double>(H));
            scalar_t* dxr = dxp + r * H;
            for (std::int64_t i = 0; i < H; ++i) dxr[i] = inv * (dyr[i] * wp[i] - xr[i] * c);
            if (dw)
              for (std::int64_t i = 0; i < H; ++i) dw[i] += dyr[i] * xr[i] * inv;
          }
        }
      });
    });
    torch::Tensor dw;
    if (want_dw) dw = partial_dw.sum(0);
    return {dx, dw, torch::Tensor()};
  }
};

#if RLLOOP_SIMD_X86
// silu(g) = g s with s = sigmoid(g) = 1 / (1 + e^-g), computed from t = e^-|g| <= 1 (never overflows):
// s = 1 / (1 + t) for g >= 0 and t / (1 + t) below.
__attribute__((target("avx2,fma"))) void swiglu_avx2(float* gate, const float* up, std::int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 t = simd::exp_nonpositive(_mm256_or_ps(g, sign));  // e^-|g|
    const __m256 numerator = _mm256_blendv_ps(one, t, g);           // t where the sign bit of g is set
    const __m256 s = _mm256_div_ps(numerator, _mm256_add_ps(one, t));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
#endif  // RLLOOP_SIMD_X86

// sigmoid(gate) comes from ATen (its vectorised exp is several times faster than a scalar std::exp loop) and
// is kept for the backward pass, which then needs no exp at all; the rest is one fused pass each way.
class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor gate, torch::Tensor up) {
    gate = gate.contiguous();
    up = up.contiguous();
    auto sig = torch::sigmoid(gate);
    auto out = torch::empty_like(gate);
    AT_DISPATCH_FLOATING_TYPES(gate.scalar_type(), "swiglu", [&] {
      const scalar_t *gp = gate.data_ptr<scalar_t>(), *sp = sig.data_ptr<scalar_t>(), *up_p = up.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, gate.numel(), 16384, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) op[i] = gp[i] * sp[i] * up_p[i];
      });
    });
    ctx->save_for_backward({gate, up, sig});
    return out;
  }

  // silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1], &sig = saved[2];
    const torch::Tensor dy = grads[0].contiguous();
    auto d_gate = torch::empty_like(gate), d_up = torch::empty_like(up);
    AT_DISPATCH_FLOATING_TYPES(gate.scalar_type(), "swiglu_backward", [&] {
      const scalar_t *gp = gate.data_ptr<scalar_t>(), *up_p = up.data_ptr<scalar_t>(), *dyp = dy.data_ptr<scalar_t>();
      const scalar_t* sp = sig.data_ptr<scalar_t>();
      scalar_t *dgp = d_gate.data_ptr<scalar_t>(), *dup = d_up.data_ptr<scalar_t>();
      at::parallel_for(0, gate.numel(), 16384, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) {
          const scalar_t s = sp[i], g = gp[i];
          dgp[i] = dyp[i] * up_p[i] * s * (scalar_t(1) + g * (scalar_t(1) - s));
          dup[i] = dyp[i] * g * s;
        }
      });
    });
    return {d_gate, d_up};
  }
};

// Forward and backward are one pass each, and the [B, T, heads] -> [B, heads, T] transpose is done on the way.
class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor cos,
                               torch::Tensor sin) {
    x = x.contiguous();
    cos = cos.contiguous();
    sin = sin.contiguous();
    const std::int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
    auto out = torch::empty({B, H, T, D}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rope", [&] {
      const scalar_t *xp = x.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, B * T * H, 256, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) {  // r = (b, t, h), the source row order
          const std::int64_t b = r / (T * H), t = (r / H) % T, h = r % H;
          rope_row(xp + r * D, op + ((b * H + h) * T + t) * D, cp + t * D, sp + t * D, D);
        }
      });
    });
    ctx->save_for_backward({cos, sin});
    return out;
  }

  // dx_i = dy_i cos_i + dy_{i+h} sin_{i+h},  dx_{i+h} = dy_{i+h} cos_{i+h} - dy_i sin_i.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const torch::Tensor dy = grads[0].contiguous();
    const std::int64_t B = dy.size(0), H = dy.size(1), T = dy.size(2), D = dy.size(3), half = D / 2;
    auto dx = torch::empty({B, T, H, D}, dy.options());
    AT_DISPATCH_FLOATING_TYPES(dy.scalar_type(), "rope_backward", [&] {
      const scalar_t *dyp = dy.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
      scalar_t* dxp = dx.data_ptr<scalar_t>();
      at::parallel_for(0, B * T * H, 256, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) {
          const std::int64_t b = r / (T * H), t = (r / H) % T, h = r % H;
          const scalar_t* g = dyp + ((b * H + h) * T + t) * D;
          const scalar_t *c = cp + t * D, *s = sp + t * D;
          scalar_t* d = dxp + r * D;
          for (std::int64_t i = 0; i < half; ++i) {
            d[i] = g[i] * c[i] + g[i + half] * s[i + half];
            d[i + half] = g[i + half] * c[i + half] - g[i] * s[i];
          }
        }
      });
    });
    return {dx, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (!fused_dtype(x) || cos.scalar_type() != x.scalar_type() || x.dim() != 4 || x.size(3) % 2 != 0 ||
      cos.size(0) != x.size(1))
    return rope_reference(x, cos, sin);
  return RopeFn::apply(x, cos, sin);
}

torch::Tensor rope_reference(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const torch::Tensor heads = x.transpose(1, 2);  // [B, heads, T, D]
  const std::int64_t half = heads.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-heads.narrow(-1, half, half), heads.narrow(-1, 0, half)}, -1);
  // `rotated` is contiguous and `heads` (a transposed view) is not; the sum takes its first operand's layout, so
  // this order yields a contiguous [B, heads, T, D] result (addition commutes exactly, the values are HF's).
  return rotated * sin + heads * cos;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (!fused_dtype(x) || weight.scalar_type() != x.scalar_type() || weight.dim() != 1 || weight.size(0) != x.size(-1))
    return rms_norm_reference(x, weight, eps);
  return RmsNormFn::apply(x, weight, eps);
}

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const bool is_fp32 = x.scalar_type() == torch::kFloat32;
  torch::Tensor xf = is_fp32 ? x : x.to(torch::kFloat32);
  torch::Tensor normed = xf * torch::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps);
  if (!is_fp32) normed = normed.to(x.scalar_type());
  return weight * normed;
}

void swiglu_in_place(float* gate, const float* up, std::int64_t n) {
#if RLLOOP_SIMD_X86
  if (simd::has_avx2_fma()) return swiglu_avx2(gate, up, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  if (!fused_dtype(gate) || up.scalar_type() != gate.scalar_type() || up.sizes() != gate.sizes())
    return swiglu_reference(gate, up);
  return SwigluFn::apply(gate, up);
}

torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up) { return torch::silu(gate) * up; }

}  // namespace rlloop::engine
