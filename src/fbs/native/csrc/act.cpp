// The FFN's SiLU-gated product (act.h): AVX-512 where the CPU has it, else a loop compiled per instruction set
// (target_clones).
#include "act.h"

#ifdef FBS_X86
#include "arch/x86/avx512.h"
#endif

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

__attribute__((target_clones("avx512f", "avx2", "default"))) void silu_mul_portable(const float* g, const float* u,
                                                                                    float* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = g[c] / (1.0f + exp_poly(-g[c])) * u[c];
}

#ifdef FBS_X86
// 16 lanes at a time with the same exp polynomial (the portable loop does not vectorize: its clamps and floor
// compile to branches)
__attribute__((target("avx512f,fma"))) void silu_mul_avx512(const float* g, const float* u, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 mk = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(mk, g + c), uv = _mm512_maskz_loadu_ps(mk, u + c);
    const __m512 e = fbs_x86::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_mask_storeu_ps(out + c, mk, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
  }
}
#endif
}  // namespace

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
#ifdef FBS_X86
  static const bool wide = fbs::best_isa() >= fbs::kIsaAvx512;
  if (wide) {
    silu_mul_avx512(g, u, out, n);
    return;
  }
#endif
  silu_mul_portable(g, u, out, n);
}
}  // namespace fbs_act
