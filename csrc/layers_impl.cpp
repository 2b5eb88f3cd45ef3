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

// ---- attention for many query rows (prefill): flash attention over tiles of keys ----
//
// Per tile of ATTN_KEYS keys: S = (scale q) K^T and O += softmax-so-far(S) V as register-blocked
// outer products (ATTN_MR rows by two vectors), with each row's running maximum and sum
// rescaling O, so the work memory is a few tiles whatever the context and a causal block
// stops at its last row's keys. GCC's vector types give each ISA its own width.

namespace gmlx_kernels {
namespace GMLX_ISA {

namespace {

#if defined(__AVX512F__)
constexpr int FW = 16;
#elif defined(__AVX2__)
constexpr int FW = 8;
#else
constexpr int FW = 4;
#endif
typedef float fvec __attribute__((vector_size(FW * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(FW * sizeof(int32_t))));
static_assert(ATTN_KEYS % (2 * FW) == 0);

inline fvec vld(const float* p) {
  fvec v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline void vst(float* p, fvec v) { memcpy(p, &v, sizeof v); }
inline fvec vset(float x) { return fvec{} + x; }

// e^x as exp8 does (inputs below -87 give 0, -inf included)
inline fvec vexp(fvec x) {
  const fvec lo = vset(-87.3f), hi = vset(88.3f), round = vset(12582912.f);  // + 1.5 * 2^23 rounds
  const ivec under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const fvec n = (x * 1.44269504f + round) - round;
  fvec r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  fvec p = vset(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
  return under ? vset(0.f) : p * (fvec)e;
}

// S (rows x ATTN_KEYS) = Q (rows x D) Kt (D x ATTN_KEYS); rows a multiple of ATTN_MR
void qk_tile(const float* Q, int64_t rows, int64_t D, const float* Kt, float* S) {
  for (int64_t i = 0; i < rows; i += ATTN_MR)
    for (int64_t j = 0; j < ATTN_KEYS; j += 2 * FW) {
      fvec acc[ATTN_MR][2] = {};
      for (int64_t d = 0; d < D; d++) {
        const fvec k0 = vld(Kt + d * ATTN_KEYS + j), k1 = vld(Kt + d * ATTN_KEYS + j + FW);
        for (int r = 0; r < ATTN_MR; r++) {
          const float q = Q[(i + r) * D + d];
          acc[r][0] += q * k0;
          acc[r][1] += q * k1;
        }
      }
      for (int r = 0; r < ATTN_MR; r++) {
        vst(S + (i + r) * ATTN_KEYS + j, acc[r][0]);
        vst(S + (i + r) * ATTN_KEYS + j + FW, acc[r][1]);
      }
    }
}

// O[:, d .. d + NV * FW) += P (rows x ATTN_KEYS, n used) V (n rows of stride vs)
template <int NV>
void pv_cols(const float* P, int64_t rows, const float* V, int64_t vs, int64_t n, int64_t D, int64_t d, float* O) {
  for (int64_t i = 0; i < rows; i += ATTN_MR) {
    fvec acc[ATTN_MR][NV];
    for (int r = 0; r < ATTN_MR; r++)
      for (int c = 0; c < NV; c++) acc[r][c] = vld(O + (i + r) * D + d + c * FW);
    for (int64_t t = 0; t < n; t++) {
      fvec v[NV];
      for (int c = 0; c < NV; c++) v[c] = vld(V + t * vs + d + c * FW);
      for (int r = 0; r < ATTN_MR; r++) {
        const float p = P[(i + r) * ATTN_KEYS + t];
        for (int c = 0; c < NV; c++) acc[r][c] += p * v[c];
      }
    }
    for (int r = 0; r < ATTN_MR; r++)
      for (int c = 0; c < NV; c++) vst(O + (i + r) * D + d + c * FW, acc[r][c]);
  }
}

void pv_tile(const float* P, int64_t rows, const float* V, int64_t vs, int64_t n, int64_t D, float* O) {
  int64_t d = 0;
  for (; d + 2 * FW <= D; d += 2 * FW) pv_cols<2>(P, rows, V, vs, n, D, d, O);
  for (; d + FW <= D; d += FW) pv_cols<1>(P, rows, V, vs, n, D, d, O);
  for (; d < D; d++)
    for (int64_t i = 0; i < rows; i++)
      for (int64_t t = 0; t < n; t++) O[i * D + d] += P[i * ATTN_KEYS + t] * V[t * vs + d];
}

}  // namespace

void attend_rows(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work) {
  const int64_t D = a.D, T = a.T, L = a.L, R = l1 - l0;
  const int64_t Rp = (R + ATTN_MR - 1) / ATTN_MR * ATTN_MR;  // padding rows: zero queries
  float* Q = work;               // Rp x D, times scale
  float* O = Q + Rp * D;         // Rp x D
  float* S = O + Rp * D;         // Rp x ATTN_KEYS: scores, then their exponentials
  float* Kt = S + Rp * ATTN_KEYS;  // D x ATTN_KEYS
  float* mrow = Kt + D * ATTN_KEYS;  // per row: the running maximum and sum
  float* lrow = mrow + Rp;
  const float* q = a.q + ((b * a.Hq + h) * L + l0) * D;
  for (int64_t i = 0; i < R * D; i++) Q[i] = q[i] * a.scale;
  memset(Q + R * D, 0, sizeof(float) * (Rp - R) * D);
  memset(O, 0, sizeof(float) * Rp * D);
  for (int64_t i = 0; i < Rp; i++) {
    mrow[i] = -INFINITY;
    lrow[i] = 0.f;
  }
  const int64_t kvh = h / (a.Hq / a.Hkv);
  const float* kb = a.k + b * a.ks[0] + kvh * a.ks[1];
  const float* vb = a.v + b * a.vs[0] + kvh * a.vs[1];
  // query l sees keys t <= T - L + l when causal: the block's last row bounds the tiles
  const int64_t t_end = a.causal ? T - L + l1 : T;
  for (int64_t t0 = 0; t0 < t_end; t0 += ATTN_KEYS) {
    const int64_t n = t_end - t0 < ATTN_KEYS ? t_end - t0 : ATTN_KEYS;
    for (int64_t j = 0; j < n; j++) {
      const float* kr = kb + (t0 + j) * a.ks[2];
      for (int64_t d = 0; d < D; d++) Kt[d * ATTN_KEYS + j] = kr[d];
    }
    if (n < ATTN_KEYS)
      for (int64_t d = 0; d < D; d++) memset(Kt + d * ATTN_KEYS + n, 0, sizeof(float) * (ATTN_KEYS - n));
    qk_tile(Q, Rp, D, Kt, S);
    for (int64_t i = 0; i < R; i++) {
      float* s = S + i * ATTN_KEYS;
      const int64_t l = l0 + i;
      int64_t seen = a.causal ? T - L + l + 1 - t0 : n;  // keys of this tile row i sees
      seen = seen < 0 ? 0 : seen > n ? n : seen;
      for (int64_t j = seen; j < ATTN_KEYS; j++) s[j] = -INFINITY;
      if (a.mask) {
        const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2] + t0 * a.ms[3];
        if (a.mask_bool) {
          const uint8_t* m = (const uint8_t*)a.mask + base;
          for (int64_t j = 0; j < seen; j++)
            if (!m[j * a.ms[3]]) s[j] = -INFINITY;
        } else {
          const float* m = (const float*)a.mask + base;
          for (int64_t j = 0; j < seen; j++) s[j] += m[j * a.ms[3]];
        }
      }
      fvec vmax = vset(-INFINITY);
      for (int64_t j = 0; j < ATTN_KEYS; j += FW) {
        const fvec v = vld(s + j);
        vmax = v > vmax ? v : vmax;
      }
      float tmax = vmax[0];
      for (int c = 1; c < FW; c++) tmax = vmax[c] > tmax ? vmax[c] : tmax;
      if (tmax == -INFINITY) {  // nothing in this tile for the row: no weight
        memset(s, 0, sizeof(float) * ATTN_KEYS);
        continue;
      }
      const float mnew = tmax > mrow[i] ? tmax : mrow[i];
      const float c = expf(mrow[i] - mnew);  // 0 for the row's first keys
      fvec vsum = vset(0.f);
      for (int64_t j = 0; j < ATTN_KEYS; j += FW) {
        const fvec p = vexp(vld(s + j) - mnew);
        vst(s + j, p);
        vsum += p;
      }
      float sum = 0.f;
      for (int k = 0; k < FW; k++) sum += vsum[k];
      lrow[i] = lrow[i] * c + sum;
      if (c != 1.f)
        for (int64_t d = 0; d < D; d++) O[i * D + d] *= c;
      mrow[i] = mnew;
    }
    pv_tile(S, Rp, vb + t0 * a.vs[2], a.vs[2], n, D, O);
  }
  float* out = a.out + ((b * a.Hq + h) * L + l0) * D;
  for (int64_t i = 0; i < R; i++) {  // a row that saw no key (all masked) gives zeros, not NaN
    const float inv = lrow[i] > 0.f ? 1.f / lrow[i] : 0.f;
    for (int64_t d = 0; d < D; d++) out[i * D + d] = O[i * D + d] * inv;
  }
}

}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
