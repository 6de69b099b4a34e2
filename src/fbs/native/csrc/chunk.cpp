// The chunk head's online step (chunk.h).
#include "chunk.h"

#include "norm.h"

std::tuple<at::Tensor, at::Tensor, std::vector<bool>> chunk_step(
    const at::Tensor& xn, const at::Tensor& rows, at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum,
    at::Tensor& open_count, const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
    const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i, bool attend) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&xn, &closed, &open_sum, &w_bios, &b_bios, &w_key, &w_query, &w_out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "fbs chunk kernel: contiguous fp32 CPU tensors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&rows, &n_closed, &open_count})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "fbs chunk kernel: int64 rows and counts");
  const int64_t b = rows.numel(), d = xn.size(-1), C = closed.size(1), R = closed.size(2), nl = w_bios.size(0);
  TORCH_CHECK(xn.numel() == b * d && w_key.size(0) == R && w_key.size(1) == d && w_query.sizes() == w_key.sizes() &&
                  w_out.size(0) == d && w_out.size(1) == R && w_bios.size(1) == d && b_bios.numel() == nl,
              "fbs chunk kernel: shapes");
  const int64_t* RW = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(RW[i] >= 0 && RW[i] < closed.size(0), "fbs chunk kernel: row out of range");
  const float* X = xn.data_ptr<float>();
  float* CL = closed.data_ptr<float>();
  int64_t* NC = n_closed.data_ptr<int64_t>();
  float* OS = open_sum.data_ptr<float>();
  int64_t* OC = open_count.data_ptr<int64_t>();
  auto logits = at::empty({b, 1, nl}, xn.options());
  float* LG = logits.data_ptr<float>();
  at::Tensor c = attend ? at::empty({b, 1, d}, xn.options()) : at::Tensor();
  std::vector<bool> start(b);
  std::vector<float> kt(R), q(R), open(R), mixed(R), p(C + 1);
  for (int64_t i = 0; i < b; ++i) {
    const float* x = X + i * d;
    const int64_t r = RW[i];
    int64_t best = 0;
    for (int64_t k = 0; k < nl; ++k) {
      LG[i * nl + k] = fbs_norm::dot(w_bios.data_ptr<float>() + k * d, x, d) + b_bios.data_ptr<float>()[k];
      if (LG[i * nl + k] > LG[i * nl + best]) best = k;
    }
    for (int64_t j = 0; j < R; ++j) kt[j] = fbs_norm::dot(w_key.data_ptr<float>() + j * d, x, d);
    start[i] = best != label_i || OC[r] == 0;
    float* os = OS + r * R;
    if (start[i] && OC[r] > 0) {
      float* slot = CL + (r * C + NC[r] % C) * R;
      for (int64_t j = 0; j < R; ++j) slot[j] = os[j] / float(OC[r]);
      NC[r] += 1;
    }
    if (start[i]) {
      std::copy_n(kt.data(), R, os);
      OC[r] = 1;
    } else {
      for (int64_t j = 0; j < R; ++j) os[j] += kt[j];
      OC[r] += 1;
    }
    if (!attend) continue;
    for (int64_t j = 0; j < R; ++j) q[j] = fbs_norm::dot(w_query.data_ptr<float>() + j * d, x, d);
    for (int64_t j = 0; j < R; ++j) open[j] = os[j] / float(OC[r]);
    const int64_t nv = std::min<int64_t>(NC[r], C);
    const float* ring = CL + r * C * R;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nv; ++j) {
      p[j] = fbs_norm::dot(ring + j * R, q.data(), R) * float(scale);
      mx = std::max(mx, p[j]);
    }
    p[nv] = fbs_norm::dot(q.data(), open.data(), R) * float(scale);
    mx = std::max(mx, p[nv]);
    float z = 0.f;
    for (int64_t j = 0; j <= nv; ++j) {
      p[j] = std::exp(p[j] - mx);
      z += p[j];
    }
    for (int64_t k = 0; k < R; ++k) mixed[k] = p[nv] / z * open[k];
    for (int64_t j = 0; j < nv; ++j) {
      const float a = p[j] / z;
      for (int64_t k = 0; k < R; ++k) mixed[k] += a * ring[j * R + k];
    }
    float* ci = c.data_ptr<float>() + i * d;
    for (int64_t k = 0; k < d; ++k) ci[k] = fbs_norm::dot(w_out.data_ptr<float>() + k * R, mixed.data(), R);
  }
  return {c, logits, start};
}
