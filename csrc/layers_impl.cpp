// CPU kernels for the transformer ops MLX's CPU backend composes from many small graph
// nodes (RMSNorm, RoPE, attention for a few query rows): each here is one node. Compiled
// once per ISA like kernels_impl.cpp; the loops are written in 8-lane blocks so the
// compiler vectorizes them for the ISA's flags. Plain C maths only (see kernels_impl.cpp).

#include "gguf_kernels.h"

#include <math.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef GMLX_ISA
#error "GMLX_ISA must name the namespace (generic, avx2, avx512)"
#endif

namespace gmlx_kernels {
namespace GMLX_ISA {

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p of degree 6 (relative error
// about 2e-7); inputs below -87 give 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// sum over i of e^(x[i] - mx)
inline float sum_exp(const float* x, int64_t n, float mx) {
  float s = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (int j = 0; j < 8; j++) s += lanes[j];
#endif
  for (; i < n; i++) s += expf(x[i] - mx);
  return s;
}

}  // namespace

void logsumexp_rows(const float* x, float* y, int64_t rows, int64_t N) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * N;
    float m[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 8 <= N; i += 8)
      for (int j = 0; j < 8; j++) m[j] = xr[i + j] > m[j] ? xr[i + j] : m[j];
    float mx = m[0];
    for (int j = 1; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    for (; i < N; i++) mx = xr[i] > mx ? xr[i] : mx;
    // all -inf: -inf (as MLX); an inf or NaN maximum passes through
    y[r] = isfinite(mx) ? mx + logf(sum_exp(xr, N, mx)) : mx;
  }
}

void gated_act(const float* g, const float* u, float* h, int64_t n, int act) {
  // gelu_approx: 0.5 x (1 + tanh(c (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (e^2z + 1)
  const float c = 0.7978845608028654f, k3 = 0.044715f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    __m256 a;
    if (act == GATED_SILU) {
      a = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    } else {
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 z = _mm256_mul_ps(_mm256_set1_ps(2.f * c), _mm256_fmadd_ps(_mm256_set1_ps(k3), x3, x));
      const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(z), one)));
      a = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, t));
    }
    _mm256_storeu_ps(h + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) {
    const float x = g[i];
    const float a = act == GATED_SILU ? x / (1.f + expf(-x)) : 0.5f * x * (1.f + tanhf(c * (x + k3 * x * x * x)));
    h[i] = a * u[i];
  }
}

void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float inv = 1.f / sqrtf(dot(xr, xr, D) / (float)D + eps);
    if (w)
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d];
    else
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv;
  }
}

void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1, float* cs) {
  const int64_t half = a.dims / 2;
  float* c = cs;
  float* s = cs + half;
  int64_t last_pos_row = -1;
  for (int64_t r = r0; r < r1; r++) {
    // row r of (N, L, D): position offset(n) + l, the same for every head of a batch row
    const int64_t n = r / a.L, l = r % a.L;
    const int64_t b = n / a.heads;
    const int64_t pos_row = b * a.L + l;
    if (pos_row != last_pos_row) {
      const float pos = ((float)l + (float)(a.offsets ? a.offsets[a.offsets_per_batch ? b : 0] : a.offset)) * a.scale;
      for (int64_t i = 0; i < half; i++) {
        const float theta = pos * a.inv_freq[i];
        c[i] = cosf(theta);
        s[i] = sinf(theta);
      }
      last_pos_row = pos_row;
    }
    const float* xr = a.x + r * a.D;
    float* yr = a.y + r * a.D;
    if (a.traditional) {
      for (int64_t i = 0; i < half; i++) {
        const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
        yr[2 * i] = x0 * c[i] - x1 * s[i];
        yr[2 * i + 1] = x0 * s[i] + x1 * c[i];
      }
    } else {
      for (int64_t i = 0; i < half; i++) {
        const float x0 = xr[i], x1 = xr[i + half];
        yr[i] = x0 * c[i] - x1 * s[i];
        yr[i + half] = x0 * s[i] + x1 * c[i];
      }
    }
    for (int64_t d = a.dims; d < a.D; d++) yr[d] = xr[d];
  }
}

void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, float* scores) {
  // Query heads h0..h1 share one KV head: each key and value row is read once for all of them.
  const int64_t L = a.L, T = a.T, D = a.D, rows = (h1 - h0) * L;
  const int64_t kvh = h0 / (a.Hq / a.Hkv);
  const float* kb = a.k + b * a.ks[0] + kvh * a.ks[1];
  const float* vb = a.v + b * a.vs[0] + kvh * a.vs[1];
  const float* q = a.q + (b * a.Hq + h0) * L * D;
  float* out = a.out + (b * a.Hq + h0) * L * D;
  const float neg_inf = -INFINITY;
  for (int64_t t = 0; t < T; t++) {
    const float* kt = kb + t * a.ks[2];
    for (int64_t r = 0; r < rows; r++) scores[r * T + t] = dot(q + r * D, kt, D) * a.scale;
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t h = h0 + r / L, l = r % L;
    float* sr = scores + r * T;
    if (a.mask) {
      const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2];
      if (a.mask_bool) {
        const uint8_t* m = (const uint8_t*)a.mask + base;
        for (int64_t t = 0; t < T; t++)
          if (!m[t * a.ms[3]]) sr[t] = neg_inf;
      } else {
        const float* m = (const float*)a.mask + base;
        for (int64_t t = 0; t < T; t++) sr[t] += m[t * a.ms[3]];
      }
    }
    if (a.causal)  // the last query row sees every key; row l sees the first T - L + 1 + l
      for (int64_t t = T - L + 1 + l; t < T; t++) sr[t] = neg_inf;
    float mx = neg_inf;
    for (int64_t t = 0; t < T; t++) mx = sr[t] > mx ? sr[t] : mx;
    float sum = 0.f;
    if (mx == neg_inf) {  // nothing to attend to (a padding row): zeros, not NaN
      for (int64_t t = 0; t < T; t++) sr[t] = 0.f;
    } else {
      for (int64_t t = 0; t < T; t++) {
        sr[t] = expf(sr[t] - mx);
        sum += sr[t];
      }
      const float inv = 1.f / sum;
      for (int64_t t = 0; t < T; t++) sr[t] *= inv;
    }
    float* o = out + r * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
  }
  for (int64_t t = 0; t < T; t++) {
    const float* vt = vb + t * a.vs[2];
    for (int64_t r = 0; r < rows; r++) {
      const float p = scores[r * T + t];
      if (p != 0.f) axpy(out + r * D, p, vt, D);
    }
  }
}

}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
