// The FFN's SiLU-gated product (act.h), compiled per instruction set and chosen at load (target_clones).
#include "act.h"

namespace fbs_act {
namespace {
inline float exp_poly(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365478515625f, x));
  const float t = x * 1.44269504088896341f + 0.5f;
  const float ti = float(int32_t(t));
  const float n = ti > t ? ti - 1.f : ti;  // floor(x / ln2 + 1/2)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  bits += int32_t(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
}  // namespace

__attribute__((target_clones("avx512f", "avx2", "default"))) void silu_mul(const float* g, const float* u, float* out,
                                                                           int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = g[c] / (1.0f + exp_poly(-g[c])) * u[c];
}
}  // namespace fbs_act
