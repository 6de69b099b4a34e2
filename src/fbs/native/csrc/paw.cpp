// PAW's decode step (paw.h).
#include "paw.h"

#include <ATen/Parallel.h>

#include <functional>

#include "norm.h"

namespace {
// y (n) += a x (n)
__attribute__((target_clones("avx512f", "avx2", "default"))) void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += a * x[j];
}

// The conv over a window of k expected embeddings u (k, d) pooled: with S = sum_r u_r, sum_r y_r =
// k b + w_1 S + w_0 (S - u_(k-1)) + w_2 (S - u_0) (the zero padding drops one term of each shifted sum); divided by k.
// w: the taps (3, d).
__attribute__((target_clones("avx512f", "avx2", "default"))) void pool_window(const float* u, int64_t k, int64_t d,
                                                                              const float* w, const float* b,
                                                                              float* pooled) {
  std::copy_n(u, d, pooled);
  for (int64_t r = 1; r < k; ++r)
    for (int64_t j = 0; j < d; ++j) pooled[j] += u[r * d + j];
  const float* first = u;
  const float* last = u + (k - 1) * d;
  const float kf = float(k);
  for (int64_t j = 0; j < d; ++j) {
    const float S = pooled[j];
    pooled[j] = (kf * b[j] + w[d + j] * S + w[j] * (S - last[j]) + w[2 * d + j] * (S - first[j])) / kf;
  }
}

constexpr int64_t kGroup = 4;  // horizons whose logits one pass over the head keys computes

// The logits of kGroup horizons' queries q (kGroup, R) over the preview vocabulary: lg (kGroup, N) = scale q keys_t,
// keys_t the head keys transposed (R, N); per 32 keys the kGroup x 32 sums stay in registers, the last N % 32 one by
// one.
__attribute__((target_clones("avx512f", "avx2", "default"))) void group_logits(const float* q, const float* keys_t,
                                                                               int64_t N, int64_t R, float scale,
                                                                               float* lg) {
  typedef float v16 __attribute__((vector_size(64)));
  int64_t i = 0;
  for (; i + 32 <= N; i += 32) {
    v16 acc[kGroup][2] = {};
    for (int64_t j = 0; j < R; ++j) {
      v16 k0, k1;
      std::memcpy(&k0, keys_t + j * N + i, sizeof k0);
      std::memcpy(&k1, keys_t + j * N + i + 16, sizeof k1);
      for (int64_t h = 0; h < kGroup; ++h) {
        acc[h][0] += q[h * R + j] * k0;
        acc[h][1] += q[h * R + j] * k1;
      }
    }
    for (int64_t h = 0; h < kGroup; ++h) {
      acc[h][0] *= scale;
      acc[h][1] *= scale;
      std::memcpy(lg + h * N + i, &acc[h][0], sizeof acc[h][0]);
      std::memcpy(lg + h * N + i + 16, &acc[h][1], sizeof acc[h][1]);
    }
  }
  for (; i < N; ++i)
    for (int64_t h = 0; h < kGroup; ++h) {
      float acc = 0.f;
      for (int64_t j = 0; j < R; ++j) acc += q[h * R + j] * keys_t[j * N + i];
      lg[h * N + i] = acc * scale;
    }
}

// One horizon: its logits lg (N values, then 'other' at lg[N]), the softmax of the top_k of them (ties to the lower
// index, as the order torch.topk returns them in) and u = their expectation under the preview embeddings emb (N, d).
// sel: scratch of N + 1 floats.
void expectation(const float* lg, int64_t N, int64_t top_k, const float* emb, int64_t d, float* sel,
                 std::vector<int32_t>& idx, float* u) {
  // the top_k-th largest value, then the indices above it and as many equal to it as fit, in index order
  std::copy_n(lg, N + 1, sel);
  std::nth_element(sel, sel + top_k - 1, sel + N + 1, std::greater<float>());
  const float kth = sel[top_k - 1];
  idx.clear();
  for (int64_t i = 0; i <= N; ++i)
    if (lg[i] > kth) idx.push_back(int32_t(i));
  for (int64_t i = 0; i <= N && int64_t(idx.size()) < top_k; ++i)
    if (lg[i] == kth) idx.push_back(int32_t(i));
  std::sort(idx.begin(), idx.end(), [lg](int32_t a, int32_t b) { return lg[a] > lg[b] || (lg[a] == lg[b] && a < b); });
  const float mx = lg[idx[0]];
  float z = 0.f;
  float* p = sel;  // the scratch is free again
  for (int64_t i = 0; i < top_k; ++i) z += (p[i] = std::exp(lg[idx[i]] - mx));
  std::fill_n(u, d, 0.f);
  for (int64_t i = 0; i < top_k; ++i)
    if (idx[i] < N) axpy(p[i] / z, emb + int64_t(idx[i]) * d, u, d);
}
}  // namespace

namespace fbs_paw {
Weights make(const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
             const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
             const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb,
             const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& w_down, const at::Tensor& w_up) {
  Weights w;
  w.keep = {w_window, b_window, w_query, mix, bias, keys_t, other, emb, conv_w, conv_b, w_down, w_up};
  for (const at::Tensor& t : w.keep)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "fbs paw kernel: contiguous fp32 CPU tensors");
  const int64_t d = emb.size(1), R = w_query.size(0), N = keys_t.size(1);
  TORCH_CHECK(k_max >= 1 && w_window.numel() == d && b_window.numel() == 1 && w_query.size(1) == d &&
                  mix.size(0) == k_max * R && mix.size(1) == R && bias.size(0) == k_max && bias.size(1) == R &&
                  keys_t.size(0) == R && other.numel() == k_max && emb.size(0) == N && conv_w.numel() == 3 * d &&
                  conv_b.numel() == d && w_down.size(0) == R && w_down.size(1) == d && w_up.size(0) == d &&
                  w_up.size(1) == R && top_k >= 1 && top_k <= N + 1 && fixed_k <= k_max,
              "fbs paw kernel: shapes");
  w.w_window = w_window.data_ptr<float>();
  w.b_window = b_window.data_ptr<float>();
  w.w_query = w_query.data_ptr<float>();
  w.mix = mix.data_ptr<float>();
  w.bias = bias.data_ptr<float>();
  w.keys_t = keys_t.data_ptr<float>();
  w.other = other.data_ptr<float>();
  w.emb = emb.data_ptr<float>();
  w.conv_w = conv_w.data_ptr<float>();
  w.conv_b = conv_b.data_ptr<float>();
  w.w_down = w_down.data_ptr<float>();
  w.w_up = w_up.data_ptr<float>();
  w.fixed_k = fixed_k;
  w.k_max = k_max;
  w.top_k = top_k;
  w.d = d;
  w.R = R;
  w.N = N;
  w.head_scale = float(head_scale);
  return w;
}

void rows(const Weights& w, const float* X, int64_t M, float* Z, float* ZL, float* KS, int64_t* KH, float* WW) {
  const int64_t d = w.d, R = w.R, N = w.N, k_max = w.k_max, top_k = w.top_k;
  // the window and the query of every row
  const int64_t qmax = (k_max + kGroup - 1) / kGroup * kGroup;  // queries padded to whole groups (zeros)
  std::vector<float> c(M * R), q(M * qmax * R, 0.f), u(M * k_max * d);
  for (int64_t m = 0; m < M; ++m) {
    const float* x = X + m * d;
    if (w.fixed_k >= 0) {
      KS[m] = float(w.fixed_k);
    } else {
      const float s = fbs_norm::dot(w.w_window, x, d) + w.b_window[0];
      KS[m] = float(k_max) * (1.f / (1.f + std::exp(-s)));
    }
    KH[m] = std::min<int64_t>(k_max, int64_t(std::floor(KS[m])));
    if (WW)
      for (int64_t r = 0; r < k_max; ++r) WW[m * k_max + r] = r < KH[m] ? 1.f : 0.f;
    if (KH[m] == 0) continue;
    float* cm = c.data() + m * R;
    for (int64_t j = 0; j < R; ++j) cm[j] = fbs_norm::dot(w.w_query + j * d, x, d);
    for (int64_t r = 0; r < KH[m]; ++r)
      for (int64_t j = 0; j < R; ++j) {
        const int64_t row = r * R + j;
        q[(m * qmax + r) * R + j] = cm[j] + fbs_norm::dot(w.mix + row * R, cm, R) + w.bias[row];
      }
  }
  // every (row, group of kGroup horizons) of the windows: logits, then each horizon's expectation, over the threads
  const int64_t groups = (k_max + kGroup - 1) / kGroup;
  at::parallel_for(0, M * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> lg(kGroup * (N + 1)), sel(N + 1);
    std::vector<int32_t> idx;
    idx.reserve(N + 1);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / groups, r0 = i % groups * kGroup;
      if (r0 >= KH[m]) continue;
      const int64_t h = std::min(kGroup, KH[m] - r0);
      group_logits(q.data() + (m * qmax + r0) * R, w.keys_t, N, R, w.head_scale, lg.data());
      for (int64_t g = h - 1; g >= 0; --g) {  // each horizon's N logits, then its 'other' logit
        std::memmove(lg.data() + g * (N + 1), lg.data() + g * N, N * sizeof(float));
        lg[g * (N + 1) + N] = w.other[r0 + g];
      }
      for (int64_t g = 0; g < h; ++g)
        expectation(lg.data() + g * (N + 1), N, top_k, w.emb, d, sel.data(), idx, u.data() + (m * k_max + r0 + g) * d);
    }
  });
  // per row: the conv over its window, the pool, down and up
  std::vector<float> pooled(d);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t k = KH[m];
    float* zl = ZL + m * R;
    float* zm = Z + m * d;
    if (k == 0) {
      std::fill_n(zl, R, 0.f);
      std::fill_n(zm, d, 0.f);
      continue;
    }
    pool_window(u.data() + m * k_max * d, k, d, w.conv_w, w.conv_b, pooled.data());
    for (int64_t j = 0; j < R; ++j) zl[j] = fbs_norm::dot(w.w_down + j * d, pooled.data(), d);
    for (int64_t j = 0; j < d; ++j) zm[j] = fbs_norm::dot(w.w_up + j * R, zl, R);
  }
}
}  // namespace fbs_paw

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> paw_step(
    const at::Tensor& xn, const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
    const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
    const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb, const at::Tensor& conv_w,
    const at::Tensor& conv_b, const at::Tensor& w_down, const at::Tensor& w_up) {
  const fbs_paw::Weights w = fbs_paw::make(w_window, b_window, fixed_k, k_max, w_query, mix, bias, keys_t, other,
                                           head_scale, top_k, emb, conv_w, conv_b, w_down, w_up);
  TORCH_CHECK(xn.scalar_type() == at::kFloat && xn.is_contiguous() && xn.device().is_cpu() && xn.size(-1) == w.d,
              "fbs paw kernel: contiguous fp32 CPU rows (..., ", w.d, ")");
  const int64_t M = xn.numel() / w.d;
  std::vector<int64_t> shape(xn.sizes().begin(), xn.sizes().end());
  auto z = at::empty(shape, xn.options());
  shape.back() = w.R;
  auto zlow = at::empty(shape, xn.options());
  shape.pop_back();
  auto k_soft = at::empty(shape, xn.options());
  auto k_hard = at::empty(shape, xn.options().dtype(at::kLong));
  shape.push_back(k_max);
  auto window = at::empty(shape, xn.options());
  fbs_paw::rows(w, xn.data_ptr<float>(), M, z.data_ptr<float>(), zlow.data_ptr<float>(), k_soft.data_ptr<float>(),
                k_hard.data_ptr<int64_t>(), window.data_ptr<float>());
  return {z, zlow, k_soft, k_hard, window};
}
