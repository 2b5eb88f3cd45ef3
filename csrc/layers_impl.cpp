// CPU kernels for the ops MLX's CPU backend composes from many small graph nodes or runs
// scalar (RMSNorm, RoPE, attention, logsumexp, sampling's row reductions): each here is one
// node. Compiled once per ISA like kernels_impl.cpp, with GCC's vector types of the ISA's
// width. Plain C maths only (see kernels_impl.cpp).

#include "gguf_kernels.h"
#include "kernels/dequant.h"  // fp16_to_fp32
#include "kernels/row_blocks.h"

#include <math.h>
#include <string.h>


#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // _mm512_reduce_add_ps, gather_ge's compares
#endif

#ifndef GMLX_ISA
#error "GMLX_ISA must name the namespace (generic, avx2, avx512, amx)"
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

// Vectors of the ISA's width (GCC's vector types): FW floats.
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
// FW float16 values (a KV cache's store) widened to floats
inline fvec vld(const uint16_t* p) {
#if defined(__AVX512F__)
  return (fvec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__AVX2__)
  return (fvec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  fvec v;
  for (int i = 0; i < FW; i++) v[i] = fp16_to_fp32(p[i]);
  return v;
#endif
}
inline float ld(const float* p) { return *p; }
inline float ld(const uint16_t* p) { return fp16_to_fp32(*p); }
inline void vst(float* p, fvec v) { memcpy(p, &v, sizeof v); }
inline fvec vset(float x) { return fvec{} + x; }

// e^x: 2^n p(r) with x = n ln2 + r, |r| <= ln2/2, p of degree 6 (relative error about 2e-7);
// inputs below -87 give 0, -inf included
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

inline float hsum(fvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int c = 0; c < FW; c++) s += v[c];
  return s;
#endif
}

}  // namespace

// ---- sampling: row reductions over a vocabulary ----

int64_t argmax_row(const float* x, int64_t n) {
  const int64_t nv = n / FW * FW;
  int64_t best = 0;
  float m = n ? x[0] : 0.f;
  if (nv) {  // per lane: its maximum and where it first occurs
    fvec vm = vld(x);
    ivec vi, lane;
    for (int c = 0; c < FW; c++) lane[c] = c;
    vi = lane;
    for (int64_t i = FW; i < nv; i += FW) {
      const fvec v = vld(x + i);
      const ivec gt = v > vm;
      vm = gt ? v : vm;
      vi = gt ? lane + (int32_t)i : vi;
    }
    m = vm[0];
    best = vi[0];
    for (int c = 1; c < FW; c++)
      if (vm[c] > m || (vm[c] == m && vi[c] < best)) {
        m = vm[c];
        best = vi[c];
      }
  }
  for (int64_t i = nv; i < n; i++)
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
  return best;
}

float exp_sum(const float* x, int64_t n, float m, float k, float* w) {
  // float lanes summed into a double every 4,096 entries: over a 262,144-token vocabulary, 4
  // lanes of float alone drifted 8e-5 from the log-sum
  constexpr int64_t BLOCK = 4096;
  const int64_t nv = n / FW * FW;
  double total = 0.0;
  for (int64_t b = 0; b < nv; b += BLOCK) {
    fvec acc = vset(0.f);
    for (int64_t i = b, end = b + BLOCK < nv ? b + BLOCK : nv; i < end; i += FW) {
      const fvec e = vexp((vld(x + i) - m) * k);
      if (w) vst(w + i, e);
      acc += e;
    }
    total += hsum(acc);
  }
  float sum = (float)total;
  for (int64_t i = nv; i < n; i++) {
    const float e = expf((x[i] - m) * k);
    if (w) w[i] = e;
    sum += e;
  }
  return sum;
}

int64_t gather_ge(const float* x, int64_t n, float t, int32_t* idx) {
  // few pass: a vector of FW at a time, looked into only when one of them does
  const int64_t nv = n / FW * FW;
  int64_t count = 0;
#if defined(__AVX512F__)
  const __m512 vt = _mm512_set1_ps(t);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < nv; i += FW) {
    const __mmask16 ge = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GE_OQ);
    if (!ge) continue;
    // compressed in a register, then stored whole (count + 16 <= i + 16 <= n): a compressing store
    // to memory is microcoded on AMD's Zen 4, many times slower
    const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)i));
    _mm512_storeu_si512(idx + count, _mm512_maskz_compress_epi32(ge, at));
    count += __builtin_popcount(ge);
  }
#else
  const fvec vt = vset(t);
  for (int64_t i = 0; i < nv; i += FW) {
#if defined(__AVX2__)
    const int ge = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ));
#else
    const ivec lanes = vld(x + i) >= vt;
    int ge = 0;
    for (int c = 0; c < FW; c++) ge |= (lanes[c] & 1) << c;
#endif
    if (!ge) continue;
    // without a branch: a flat row's vectors hold as many tokens below t as at or above it, and
    // mispredicting them cost more than these stores (each lane written, kept where ge)
    for (int c = 0; c < FW; c++) {
      idx[count] = (int32_t)(i + c);
      count += (ge >> c) & 1;
    }
  }
#endif
  for (int64_t i = nv; i < n; i++)
    if (x[i] >= t) idx[count++] = (int32_t)i;
  return count;
}

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
    y[r] = isfinite(mx) ? mx + logf(exp_sum(xr, N, mx, 1.f, nullptr)) : mx;
  }
}

void gated_act(const float* g, const float* u, float* h, int64_t n, int act) {
  // gelu_approx: 0.5 x (1 + tanh(c (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (e^2z + 1)
  const float c = 0.7978845608028654f, k3 = 0.044715f;
  const int64_t nv = n / FW * FW;
  for (int64_t i = 0; i < nv; i += FW) {
    const fvec x = vld(g + i);
    fvec a;
    if (act == GATED_SILU) {
      a = x / (1.f + vexp(-x));
    } else {
      const fvec t = 1.f - 2.f / (vexp((2.f * c) * (x + k3 * (x * x * x))) + 1.f);
      a = 0.5f * x * (1.f + t);
    }
    vst(h + i, a * vld(u + i));
  }
  for (int64_t i = nv; i < n; i++) {
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

// ---- attention for many query rows (prefill): flash attention over tiles of keys ----
//
// Per tile of ATTN_KEYS keys: S = (scale q) K^T and O += softmax-so-far(S) V as register-blocked
// outer products (ATTN_MR rows by two vectors), with each row's running maximum and sum
// rescaling O, so the work memory is a few tiles whatever the context and a causal block
// stops at its last row's keys.

namespace {

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

// O[:, d .. d + NV * FW) += P V for MR rows: P (MR x n, row stride ldp), V (n rows of stride vs)
template <int MR, int NV, class KV>
void pv_cols(const float* P, int64_t ldp, const KV* V, int64_t vs, int64_t n, int64_t D, int64_t d, float* O) {
  fvec acc[MR][NV];
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NV; c++) acc[r][c] = vld(O + r * D + d + c * FW);
  for (int64_t t = 0; t < n; t++) {
    fvec v[NV];
    for (int c = 0; c < NV; c++) v[c] = vld(V + t * vs + d + c * FW);
    for (int r = 0; r < MR; r++) {
      const float p = P[r * ldp + t];
      for (int c = 0; c < NV; c++) acc[r][c] += p * v[c];
    }
  }
  for (int r = 0; r < MR; r++)
    for (int c = 0; c < NV; c++) vst(O + r * D + d + c * FW, acc[r][c]);
}

template <int MR, class KV>
void pv_rows(const float* P, int64_t ldp, const KV* V, int64_t vs, int64_t n, int64_t D, float* O) {
  int64_t d = 0;
  for (; d + 2 * FW <= D; d += 2 * FW) pv_cols<MR, 2>(P, ldp, V, vs, n, D, d, O);
  for (; d + FW <= D; d += FW) pv_cols<MR, 1>(P, ldp, V, vs, n, D, d, O);
  for (; d < D; d++)
    for (int r = 0; r < MR; r++)
      for (int64_t t = 0; t < n; t++) O[r * D + d] += P[r * ldp + t] * ld(V + t * vs + d);
}

// O (rows x D) += P (rows x n, stride ldp) V: ATTN_MR rows at a time, then the rest
template <class KV>
void pv(const float* P, int64_t ldp, int64_t rows, const KV* V, int64_t vs, int64_t n, int64_t D, float* O) {
  row_blocks<ATTN_MR>(rows, [&](auto R, int64_t r) {
    pv_rows<decltype(R)::value>(P + r * ldp, ldp, V, vs, n, D, O + r * D);
  });
}

// Key and value rows ahead of the one being read that a decode step's attention prefetches: a
// KV cache streams from memory once a step, row after row, and the hardware prefetcher alone
// read it at two thirds of the bandwidth (8 batch rows of 2,048 keys, a KV head of 256: 16.7 against
// 25.8 GB/s; docs/ARCHITECTURE.md decision 34). Past a range's end a prefetch is dropped, never a fault.
constexpr int64_t ATTN_AHEAD = 8;

// O (R x D) += P (R x n, stride ldp) V, V's rows read in order, four at a time against every
// row's outputs (which stay in L1): a decode step's values then stream from memory once, where
// pv walks all n rows again for each slice of D. Each output sums its products in key order, as pv.
template <int R, class KV>
void pv_stream_rows(const float* P, int64_t ldp, const KV* V, int64_t vs, int64_t n, int64_t D, float* O) {
  const int64_t Dv = D / FW * FW;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const KV* v[4] = {V + t * vs, V + (t + 1) * vs, V + (t + 2) * vs, V + (t + 3) * vs};
    fvec p[R][4];
    for (int r = 0; r < R; r++)
      for (int k = 0; k < 4; k++) p[r][k] = vset(P[r * ldp + t + k]);
    for (int64_t d = 0; d < Dv; d += FW) {
      for (int k = 0; k < 4; k++) __builtin_prefetch(v[k] + ATTN_AHEAD * vs + d);
      const fvec a = vld(v[0] + d), b = vld(v[1] + d), c = vld(v[2] + d), e = vld(v[3] + d);
      for (int r = 0; r < R; r++) {
        fvec o = vld(O + r * D + d);
        o += p[r][0] * a;
        o += p[r][1] * b;
        o += p[r][2] * c;
        o += p[r][3] * e;
        vst(O + r * D + d, o);
      }
    }
    for (int64_t d = Dv; d < D; d++)
      for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) O[r * D + d] += P[r * ldp + t + k] * ld(v[k] + d);
  }
  for (; t < n; t++)
    for (int r = 0; r < R; r++) {
      const float pr = P[r * ldp + t];
      const KV* vt = V + t * vs;
      for (int64_t d = 0; d < D; d++) O[r * D + d] += pr * ld(vt + d);
    }
}

template <class KV>
void pv_stream(const float* P, int64_t ldp, int64_t rows, const KV* V, int64_t vs, int64_t n, int64_t D, float* O) {
  row_blocks<4>(rows, [&](auto R, int64_t r) {
    pv_stream_rows<decltype(R)::value>(P + r * ldp, ldp, V, vs, n, D, O + r * D);
  });
}

// S (R x T) = scale Q K^T for few rows (decode), K's rows read as they lie: two query rows by
// NK keys a step, so 2 NK independent accumulators hide the FMA's latency, each reduced once.
template <class KV>
void qk_rows(const float* Q, int64_t R, int64_t D, const KV* K, int64_t ks, int64_t T, float scale, float* S) {
  const int64_t Dv = D / FW * FW;
  auto keys = [&]<int NK>(int64_t t) {
    for (int64_t r = 0; r < R; r += 2) {
      const float* q0 = Q + r * D;
      const float* q1 = r + 1 < R ? q0 + D : q0;
      fvec acc[2][NK] = {};
      for (int64_t d = 0; d < Dv; d += FW) {
        if (r == 0)
          for (int j = 0; j < NK; j++) __builtin_prefetch(K + (t + j + ATTN_AHEAD) * ks + d);
        const fvec a0 = vld(q0 + d), a1 = vld(q1 + d);
        for (int j = 0; j < NK; j++) {
          const fvec kv = vld(K + (t + j) * ks + d);
          acc[0][j] += a0 * kv;
          acc[1][j] += a1 * kv;
        }
      }
      for (int j = 0; j < NK; j++) {
        const KV* kt = K + (t + j) * ks;
        float s0 = hsum(acc[0][j]), s1 = hsum(acc[1][j]);
        for (int64_t d = Dv; d < D; d++) {
          s0 += q0[d] * ld(kt + d);
          s1 += q1[d] * ld(kt + d);
        }
        S[r * T + t + j] = s0 * scale;
        if (r + 1 < R) S[(r + 1) * T + t + j] = s1 * scale;
      }
    }
  };
  int64_t t = 0;
  for (; t + 4 <= T; t += 4) keys.template operator()<4>(t);
  for (; t < T; t++) keys.template operator()<1>(t);
}

// Whether the mask lets a query see the key at element i of the mask: true, or a float above -inf.
inline bool mask_at(const AttentionArgs& a, int64_t i) {
  return a.mask_bool ? ((const uint8_t*)a.mask)[i] != 0 : ((const float*)a.mask)[i] != -INFINITY;
}

// Row s of the scores of query (b, h, l) against keys t0 .. t0 + width: -inf past the first
// `seen` and where the mask excludes a key, the mask's value added where it is float; returns the
// row's maximum.
float mask_row(const AttentionArgs& a, int64_t b, int64_t h, int64_t l, int64_t t0, int64_t seen, int64_t width,
               float* s) {
  for (int64_t j = seen; j < width; j++) s[j] = -INFINITY;
  if (a.mask) {
    const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2] + t0 * a.ms[3];
    for (int64_t j = 0; j < seen; j++) {
      if (a.mask_bool)
        s[j] = mask_at(a, base + j * a.ms[3]) ? s[j] : -INFINITY;
      else
        s[j] += ((const float*)a.mask)[base + j * a.ms[3]];
    }
  }
  const int64_t wv = width / FW * FW;
  fvec vmax = vset(-INFINITY);
  for (int64_t j = 0; j < wv; j += FW) {
    const fvec v = vld(s + j);
    vmax = v > vmax ? v : vmax;
  }
  float m = vmax[0];
  for (int c = 1; c < FW; c++) m = vmax[c] > m ? vmax[c] : m;
  for (int64_t j = wv; j < width; j++) m = s[j] > m ? s[j] : m;
  return m;
}

// The mask excludes every key t0 .. t0 + n from every query l0 .. l1 (of head h, batch row b).
bool masked_out(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, int64_t t0, int64_t n) {
  for (int64_t l = l0; l < l1; l++) {
    const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2] + t0 * a.ms[3];
    for (int64_t j = 0; j < n; j++)
      if (mask_at(a, base + j * a.ms[3])) return false;
  }
  return true;
}

template <class KV>
void attend_as(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1, float* scores,
               float* ml, float* o) {
  // Query heads h0..h1 share one KV head: each key and value row is read once for all of them.
  const int64_t L = a.L, T = a.T, D = a.D, n = t1 - t0, rows = (h1 - h0) * L;
  const int64_t kvh = h0 / (a.Hq / a.Hkv);
  const KV* kb = (const KV*)a.k + b * a.ks[0] + kvh * a.ks[1] + t0 * a.ks[2];
  const KV* vb = (const KV*)a.v + b * a.vs[0] + kvh * a.vs[1] + t0 * a.vs[2];
  qk_rows(a.q + (b * a.Hq + h0) * L * D, rows, D, kb, a.ks[2], n, a.scale, scores);
  for (int64_t r = 0; r < rows; r++) {
    const int64_t l = r % L;
    float* s = scores + r * n;
    // the last query row sees every key; row l sees the first T - L + 1 + l
    int64_t seen = a.causal ? T - L + 1 + l - t0 : n;
    seen = seen < 0 ? 0 : seen > n ? n : seen;
    const float m = mask_row(a, b, h0 + r / L, l, t0, seen, n, s);
    ml[2 * r] = m;
    ml[2 * r + 1] = m == -INFINITY ? 0.f : exp_sum(s, n, m, 1.f, s);
    if (m == -INFINITY) memset(s, 0, sizeof(float) * n);  // nothing to attend to here: no weight
  }
  memset(o, 0, sizeof(float) * rows * D);
  pv_stream(scores, n, rows, vb, a.vs[2], n, D, o);
}

template <class KV>
void attend_rows_as(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work) {
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
  const KV* kb = (const KV*)a.k + b * a.ks[0] + kvh * a.ks[1];
  const KV* vb = (const KV*)a.v + b * a.vs[0] + kvh * a.vs[1];
  // query l sees keys t <= T - L + l when causal: the block's last row bounds the tiles
  const int64_t t_end = a.causal ? T - L + l1 : T;
  for (int64_t t0 = 0; t0 < t_end; t0 += ATTN_KEYS) {
    const int64_t n = t_end - t0 < ATTN_KEYS ? t_end - t0 : ATTN_KEYS;
    if (a.mask && masked_out(a, b, h, l0, l1, t0, n)) continue;  // a sliding window's far keys
    for (int64_t j = 0; j < n; j++) {
      const KV* kr = kb + (t0 + j) * a.ks[2];
      for (int64_t d = 0; d < D; d++) Kt[d * ATTN_KEYS + j] = ld(kr + d);
    }
    if (n < ATTN_KEYS)
      for (int64_t d = 0; d < D; d++) memset(Kt + d * ATTN_KEYS + n, 0, sizeof(float) * (ATTN_KEYS - n));
    qk_tile(Q, Rp, D, Kt, S);
    for (int64_t i = 0; i < R; i++) {
      float* s = S + i * ATTN_KEYS;
      const int64_t l = l0 + i;
      int64_t seen = a.causal ? T - L + l + 1 - t0 : n;  // keys of this tile row i sees
      seen = seen < 0 ? 0 : seen > n ? n : seen;
      const float tmax = mask_row(a, b, h, l, t0, seen, ATTN_KEYS, s);
      if (tmax == -INFINITY) {  // nothing in this tile for the row: no weight
        memset(s, 0, sizeof(float) * ATTN_KEYS);
        continue;
      }
      const float mnew = tmax > mrow[i] ? tmax : mrow[i];
      const float c = expf(mrow[i] - mnew);  // 0 for the row's first keys
      const float sum = exp_sum(s, ATTN_KEYS, mnew, 1.f, s);
      lrow[i] = lrow[i] * c + sum;
      if (c != 1.f)
        for (int64_t d = 0; d < D; d++) O[i * D + d] *= c;
      mrow[i] = mnew;
    }
    pv(S, ATTN_KEYS, R, vb + t0 * a.vs[2], a.vs[2], n, D, O);  // the padding rows add nothing
  }
  float* out = a.out + ((b * a.Hq + h) * L + l0) * D;
  for (int64_t i = 0; i < R; i++) {  // a row that saw no key (all masked) gives zeros, not NaN
    const float inv = lrow[i] > 0.f ? 1.f / lrow[i] : 0.f;
    for (int64_t d = 0; d < D; d++) out[i * D + d] = O[i * D + d] * inv;
  }
}

}  // namespace

void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1, float* scores,
            float* ml, float* o) {
  if (a.kv_half)
    attend_as<uint16_t>(a, b, h0, h1, t0, t1, scores, ml, o);
  else
    attend_as<float>(a, b, h0, h1, t0, t1, scores, ml, o);
}

void attend_rows(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work) {
  if (a.kv_half)
    attend_rows_as<uint16_t>(a, b, h, l0, l1, work);
  else
    attend_rows_as<float>(a, b, h, l0, l1, work);
}

}  // namespace GMLX_ISA
}  // namespace gmlx_kernels

