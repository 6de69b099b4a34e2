// PAW's decode step (fbs.model.preview.ParafoveaWindow.forward with a hard window and the depthwise-conv
// compression), each row on its own, in one call. Per row x (d):
//   k~ = k_max sigmoid(w_window . x + b_window) (or fixed_k), k = floor(k~)
//   c = W_query x;  for r = 1..k:  q_r = c + A_r^T c + bias_r,  logits_r = [scale K q_r ; other_r] over the preview
//     vocabulary (+1 'other' class);  u_r = sum over the top_k logits of softmax(top_k) E_v[i] ('other' embeds to 0)
//   y_r = conv_b + w_0 u_(r-1) + w_1 u_r + w_2 u_(r+1) (u_0 = u_(k+1) = 0);  pooled = sum_r y_r / max(k, 1)
//   zlow = W_down pooled (0 when k = 0);  z = W_up zlow.
// mix is the stacked [A_1^T; ...; A_kmax^T] (k_max R, R), keys_t the head keys transposed (R, N), conv_w
// the conv's taps (3, d). Returns (z (M, d), zlow (M, R), k~ (M,), k (M,) int64,
// the hard window's weights (M, k_max): 1 for r <= k, else 0).
// A row's results do not depend on the other rows of the call or on the thread count.
#pragma once

#include <tuple>

#include "common.h"

namespace fbs_paw {
// A PAW module's weights as the step reads them (pointers into the tensors it keeps)
struct Weights {
  std::vector<at::Tensor> keep;
  const float *w_window = nullptr, *b_window = nullptr, *w_query = nullptr, *mix = nullptr, *bias = nullptr,
              *keys_t = nullptr, *other = nullptr, *emb = nullptr, *conv_w = nullptr, *conv_b = nullptr,
              *w_down = nullptr, *w_up = nullptr;
  int64_t fixed_k = -1, k_max = 0, top_k = 0, d = 0, R = 0, N = 0;
  float head_scale = 1.f;
};
// The weights from paw_step's arguments, shapes checked.
Weights make(const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
             const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
             const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb,
             const at::Tensor& conv_w, const at::Tensor& conv_b, const at::Tensor& w_down, const at::Tensor& w_up);
// The step of M rows X (M, d): Z (M, d), ZL (M, R), KS and KH (M), WW (M, k_max) or null.
void rows(const Weights& w, const float* X, int64_t M, float* Z, float* ZL, float* KS, int64_t* KH, float* WW);
}  // namespace fbs_paw

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> paw_step(
    const at::Tensor& xn, const at::Tensor& w_window, const at::Tensor& b_window, int64_t fixed_k, int64_t k_max,
    const at::Tensor& w_query, const at::Tensor& mix, const at::Tensor& bias, const at::Tensor& keys_t,
    const at::Tensor& other, double head_scale, int64_t top_k, const at::Tensor& emb, const at::Tensor& conv_w,
    const at::Tensor& conv_b, const at::Tensor& w_down, const at::Tensor& w_up);
