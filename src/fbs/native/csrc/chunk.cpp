// The chunk head's online step (chunk.h).
#include "chunk.h"

#include "norm.h"

namespace fbs_chunk {
Weights make(const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key, const at::Tensor& w_query,
             const at::Tensor& w_out, double scale, int64_t label_i) {
  Weights w;
  w.keep = {w_bios, b_bios, w_key, w_query, w_out};
  for (const at::Tensor& t : w.keep)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "fbs chunk kernel: contiguous fp32 CPU tensors");
  w.d = w_key.size(1);
  w.R = w_key.size(0);
  w.nl = w_bios.size(0);
  TORCH_CHECK(w_query.sizes() == w_key.sizes() && w_out.size(0) == w.d && w_out.size(1) == w.R &&
                  w_bios.size(1) == w.d && b_bios.numel() == w.nl,
              "fbs chunk kernel: shapes");
  w.w_bios = w_bios.data_ptr<float>();
  w.b_bios = b_bios.data_ptr<float>();
  w.w_key = w_key.data_ptr<float>();
  w.w_query = w_query.data_ptr<float>();
  w.w_out = w_out.data_ptr<float>();
  w.scale = float(scale);
  w.label_i = label_i;
  return w;
}

State state(at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum, at::Tensor& open_count, int64_t R) {
  for (const at::Tensor* t : {&closed, &open_sum})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "fbs chunk kernel: contiguous fp32 CPU chunk states");
  for (const at::Tensor* t : {&n_closed, &open_count})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "fbs chunk kernel: int64 counts");
  const int64_t B = closed.size(0);
  TORCH_CHECK(closed.dim() == 3 && closed.size(2) == R && open_sum.numel() == B * R && n_closed.numel() == B &&
                  open_count.numel() == B,
              "fbs chunk kernel: chunk state shapes");
  return State{closed.data_ptr<float>(), n_closed.data_ptr<int64_t>(), open_sum.data_ptr<float>(),
               open_count.data_ptr<int64_t>(), B, closed.size(1)};
}

void rows(const Weights& w, const State& s, const float* X, const int64_t* RW, int64_t b, bool attend, float* C,
          float* LG, bool* start) {
  const int64_t d = w.d, R = w.R, nl = w.nl, Cs = s.C;
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(RW[i] >= 0 && RW[i] < s.batch, "fbs chunk kernel: row out of range");
  std::vector<float> kt(R), q(R), open(R), mixed(R), p(Cs + 1);
  for (int64_t i = 0; i < b; ++i) {
    const float* x = X + i * d;
    const int64_t r = RW[i];
    int64_t best = 0;
    for (int64_t k = 0; k < nl; ++k) {
      LG[i * nl + k] = fbs_norm::dot(w.w_bios + k * d, x, d) + w.b_bios[k];
      if (LG[i * nl + k] > LG[i * nl + best]) best = k;
    }
    for (int64_t j = 0; j < R; ++j) kt[j] = fbs_norm::dot(w.w_key + j * d, x, d);
    start[i] = best != w.label_i || s.open_count[r] == 0;
    float* os = s.open_sum + r * R;
    if (start[i] && s.open_count[r] > 0) {
      float* slot = s.closed + (r * Cs + s.n_closed[r] % Cs) * R;
      for (int64_t j = 0; j < R; ++j) slot[j] = os[j] / float(s.open_count[r]);
      s.n_closed[r] += 1;
    }
    if (start[i]) {
      std::copy_n(kt.data(), R, os);
      s.open_count[r] = 1;
    } else {
      for (int64_t j = 0; j < R; ++j) os[j] += kt[j];
      s.open_count[r] += 1;
    }
    if (!attend) continue;
    for (int64_t j = 0; j < R; ++j) q[j] = fbs_norm::dot(w.w_query + j * d, x, d);
    for (int64_t j = 0; j < R; ++j) open[j] = os[j] / float(s.open_count[r]);
    const int64_t nv = std::min<int64_t>(s.n_closed[r], Cs);
    const float* ring = s.closed + r * Cs * R;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nv; ++j) {
      p[j] = fbs_norm::dot(ring + j * R, q.data(), R) * w.scale;
      mx = std::max(mx, p[j]);
    }
    p[nv] = fbs_norm::dot(q.data(), open.data(), R) * w.scale;
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
    float* ci = C + i * d;
    for (int64_t k = 0; k < d; ++k) ci[k] = fbs_norm::dot(w.w_out + k * R, mixed.data(), R);
  }
}
}  // namespace fbs_chunk

std::tuple<at::Tensor, at::Tensor, std::vector<bool>> chunk_step(
    const at::Tensor& xn, const at::Tensor& rows, at::Tensor& closed, at::Tensor& n_closed, at::Tensor& open_sum,
    at::Tensor& open_count, const at::Tensor& w_bios, const at::Tensor& b_bios, const at::Tensor& w_key,
    const at::Tensor& w_query, const at::Tensor& w_out, double scale, int64_t label_i, bool attend) {
  const fbs_chunk::Weights w = fbs_chunk::make(w_bios, b_bios, w_key, w_query, w_out, scale, label_i);
  const fbs_chunk::State s = fbs_chunk::state(closed, n_closed, open_sum, open_count, w.R);
  TORCH_CHECK(xn.scalar_type() == at::kFloat && xn.is_contiguous() && xn.device().is_cpu(),
              "fbs chunk kernel: contiguous fp32 CPU tensors");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "fbs chunk kernel: int64 rows and counts");
  const int64_t b = rows.numel(), d = w.d;
  TORCH_CHECK(xn.numel() == b * d, "fbs chunk kernel: shapes");
  auto logits = at::empty({b, 1, w.nl}, xn.options());
  at::Tensor c = attend ? at::empty({b, 1, d}, xn.options()) : at::Tensor();
  std::unique_ptr<bool[]> st(new bool[b]);
  fbs_chunk::rows(w, s, xn.data_ptr<float>(), rows.data_ptr<int64_t>(), b, attend,
                  attend ? c.data_ptr<float>() : nullptr, logits.data_ptr<float>(), st.get());
  return {c, logits, std::vector<bool>(st.get(), st.get() + b)};
}
