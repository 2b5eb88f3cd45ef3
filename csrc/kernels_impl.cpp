// The kernels, compiled once per ISA (see CMakeLists.txt): GMLX_ISA names the
// namespace, the compiler flags decide which vector path below is used.
//
// Scheme: a thread owns a range of output rows (columns of y). It dequantizes
// ROW_TILE weight rows at a time into a small float buffer (L1/L2 resident),
// then runs an MR x NR register-blocked dot-product micro-kernel over every
// activation row. Each weight byte is read from memory once per call whatever
// the batch, so decode streams the weights once per step, and prefill does
// MR*NR multiply-adds per load pair (compute-bound).
//
// Only plain C and intrinsics here: no std:: templates (they are inline and a
// linker could pick this ISA's copy for generic callers).

#include "gguf_kernels.h"

#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef GMLX_ISA
#error "GMLX_ISA must name the namespace (generic, avx2, avx512)"
#endif

namespace gmlx_kernels {
namespace GMLX_ISA {
namespace {

inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half -> normal float
      int e = -1;
      do { mant <<= 1; e++; } while ((mant & 0x400) == 0);
      mant &= 0x3ff;
      bits = sign | (uint32_t)(127 - 15 - e) << 23 | mant << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return fp16_to_fp32(h);
}

// ---- dequantize one block into y (plain loops; the compiler vectorizes them) ----

inline void deq_q8_0(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b);
  const int8_t* q = (const int8_t*)(b + 2);
  for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
}

inline void deq_q4_0(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
    y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}

inline void deq_q4_1(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)(qs[j] & 0x0F) + m;
    y[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}

inline void deq_q5_0(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b);
  uint32_t qh;
  memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; j++) {
    const int h0 = (int)((qh >> j) << 4) & 0x10;
    const int h1 = (int)(qh >> (j + 12)) & 0x10;
    y[j] = d * (float)(((int)(qs[j] & 0x0F) | h0) - 16);
    y[j + 16] = d * (float)(((int)(qs[j] >> 4) | h1) - 16);
  }
}

inline void deq_q5_1(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  uint32_t qh;
  memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; j++) {
    const int h0 = (int)((qh >> j) << 4) & 0x10;
    const int h1 = (int)(qh >> (j + 12)) & 0x10;
    y[j] = d * (float)((int)(qs[j] & 0x0F) | h0) + m;
    y[j + 16] = d * (float)((int)(qs[j] >> 4) | h1) + m;
  }
}

inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void deq_q4_k(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; j++) {
    int sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * (float)sc, m1 = dmin * (float)m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * (float)sc, m2 = dmin * (float)m;
    for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

inline void deq_q5_k(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; j++) {
    int sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * (float)sc, m1 = dmin * (float)m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * (float)sc, m2 = dmin * (float)m;
    const int s1 = 2 * j, s2 = 2 * j + 1;
    for (int l = 0; l < 32; l++) y[l] = d1 * (float)((ql[l] & 0x0F) | (((qh[l] >> s1) & 1) << 4)) - m1;
    for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)((ql[l] >> 4) | (((qh[l] >> s2) & 1) << 4)) - m2;
    ql += 32;
    y += 64;
  }
}

inline void deq_q6_k(const uint8_t* b, float* __restrict y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = f16_at(b + 208);
  for (int n = 0; n < 2; n++) {
    float ds[8];
    for (int i = 0; i < 8; i++) ds[i] = d * (float)sc[i];
    for (int half = 0; half < 2; half++) {  // l in [0,16) uses scales is=0, [16,32) is=1
      const float a0 = ds[half], a1 = ds[half + 2], a2 = ds[half + 4], a3 = ds[half + 6];
      for (int i = 0; i < 16; i++) {
        const int l = half * 16 + i;
        const int q1 = (int)((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = (int)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = a0 * (float)q1;
        y[l + 32] = a1 * (float)q2;
        y[l + 64] = a2 * (float)q3;
        y[l + 96] = a3 * (float)q4;
      }
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

template <void (*DEQ)(const uint8_t*, float* __restrict), int BS, int TS>
void deq_row_t(const uint8_t* row, int64_t K, float* __restrict y) {
  const int64_t nb = K / BS;
  for (int64_t i = 0; i < nb; i++) DEQ(row + i * TS, y + i * BS);
}

void dequant_row(int type, const uint8_t* row, int64_t K, float* y) {
  switch (type) {
    case Q8_0: deq_row_t<deq_q8_0, 32, 34>(row, K, y); break;
    case Q4_0: deq_row_t<deq_q4_0, 32, 18>(row, K, y); break;
    case Q4_1: deq_row_t<deq_q4_1, 32, 20>(row, K, y); break;
    case Q5_0: deq_row_t<deq_q5_0, 32, 22>(row, K, y); break;
    case Q5_1: deq_row_t<deq_q5_1, 32, 24>(row, K, y); break;
    case Q4_K: deq_row_t<deq_q4_k, 256, 144>(row, K, y); break;
    case Q5_K: deq_row_t<deq_q5_k, 256, 176>(row, K, y); break;
    case Q6_K: deq_row_t<deq_q6_k, 256, 210>(row, K, y); break;
    default: break;  // rejected before dispatch
  }
}

// ---- micro-kernel: y[m, n] = dot(x[m], w[n]) for an MR x NR tile ----

#if defined(__AVX512F__)
constexpr int VW = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int VW = 8;
struct vec { float v[8]; };
inline vec vzero() { vec r; for (int i = 0; i < 8; i++) r.v[i] = 0.f; return r; }
inline vec vload(const float* p) { vec r; for (int i = 0; i < 8; i++) r.v[i] = p[i]; return r; }
inline vec vfma(vec a, vec b, vec c) { for (int i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
inline float vsum(vec v) {
  float s0 = (v.v[0] + v.v[4]) + (v.v[1] + v.v[5]);
  float s1 = (v.v[2] + v.v[6]) + (v.v[3] + v.v[7]);
  return s0 + s1;
}
#endif

// K is a multiple of 32, so of VW.
template <int MR, int NR>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t K) {
  vec acc[MR][NR];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) acc[i][j] = vzero();
  for (int64_t k = 0; k < K; k += VW) {
    vec xv[MR];
    for (int i = 0; i < MR; i++) xv[i] = vload(x + i * ldx + k);
    for (int j = 0; j < NR; j++) {
      const vec wv = vload(w + j * ldw + k);
      for (int i = 0; i < MR; i++) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < NR; j++) y[i * ldy + j] = vsum(acc[i][j]);
}

constexpr int MR = 3;
constexpr int NR = 4;

void matmul_rows(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const int64_t K = a.K, M = a.M, N = a.N;
  for (int64_t t = n0; t < n1; t += ROW_TILE) {
    const int64_t rows = (n1 - t < ROW_TILE) ? n1 - t : ROW_TILE;
    for (int64_t r = 0; r < rows; r++) dequant_row(a.type, a.w + (t + r) * a.row_bytes, K, scratch + r * K);
    // activation rows outermost within the tile: their MR rows stay in L1 across the tile's weights
    int64_t m = 0;
    for (; m < M; m += MR) {
      const int64_t mr = (M - m < MR) ? M - m : MR;
      const float* xm = a.x + m * K;
      float* ym = a.y + m * N + t;
      int64_t r = 0;
      for (; r + NR <= rows; r += NR) {
        if (mr == 3) micro<3, NR>(xm, K, scratch + r * K, K, ym + r, N, K);
        else if (mr == 2) micro<2, NR>(xm, K, scratch + r * K, K, ym + r, N, K);
        else micro<1, NR>(xm, K, scratch + r * K, K, ym + r, N, K);
      }
      for (; r < rows; r++) {
        if (mr == 3) micro<3, 1>(xm, K, scratch + r * K, K, ym + r, N, K);
        else if (mr == 2) micro<2, 1>(xm, K, scratch + r * K, K, ym + r, N, K);
        else micro<1, 1>(xm, K, scratch + r * K, K, ym + r, N, K);
      }
    }
  }
}

// ---- decode: activations quantized to int8 per 32 (as llama.cpp's Q8_0), integer dot products ----
//
// For few activation rows the float path is bound by unpacking weights to float; here the
// weight block is unpacked to int8 once and multiplied with each row's int8 block by
// maddubs/madd (32 products in 2 instructions). The activation rounding this adds is at most
// half a step of each 32-block's own max/127 (the bound tests/test_kernels.py checks).

#if defined(__AVX2__) && defined(__FMA__)
#define GMLX_INT8_PATH 1

inline __m256 sum_u8_i8_float(__m256i u, __m256i y) {  // u unsigned (< 64), y signed
  const __m256i dot = _mm256_maddubs_epi16(u, y);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)));
}

inline __m256i bytes_from_bits_32(const uint8_t* x) {
  uint32_t x32;
  memcpy(&x32, x, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

inline __m256i nibbles_32(const uint8_t* qs) {  // 16 bytes -> 32 codes: low nibbles, then high
  const __m128i t = _mm_loadu_si128((const __m128i*)qs);
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 m) {
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// 32 floats (v[0..3]) -> 32 int8 codes at out, scale max|v|/127; v becomes the residual v - d*q.
inline float quant_block(__m256 v[4], int8_t* out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_andnot_ps(sign_bit, v[0]);
  for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, v[i]));
  const float amax = hmax8(m);
  const float d = amax / 127.f;
  const __m256 mul = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f), dv = _mm256_set1_ps(d);
  __m256i q[4];
  for (int i = 0; i < 4; i++) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(r);
    v[i] = _mm256_fnmadd_ps(r, dv, v[i]);
  }
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  // packs interleave the 128-bit lanes: restore element order
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)out, p);
  return d;
}

// x (K floats) -> LEVELS int8 codes per element (level 2 codes the residual of level 1):
// q[l*stride_q + k], d[l*stride_d + b]; xs[b] = sum of the coded values of block b (floats).
template <int LEVELS>
void quantize_row_q8(const float* x, int64_t K, int8_t* q, int64_t stride_q, float* d, int64_t stride_d, float* xs) {
  for (int64_t b = 0; b < K / 32; b++) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    for (int l = 0; l < LEVELS; l++) d[l * stride_d + b] = quant_block(v, q + l * stride_q + b * 32);
    // what the codes represent: x minus the last residual
    __m256 s = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) s = _mm256_add_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + b * 32 + 8 * i), v[i]));
    xs[b] = hsum8(s);
  }
}

constexpr int MMAX = 8;  // activation rows the integer path takes at once

struct XQ {
  const int8_t* q;   // LEVELS x M rows of K
  const float* d;    // LEVELS x M rows of K/32
  const float* s;    // M rows of K/32: sums of the coded activations per block
  int64_t K, M;
};

// One weight row against M (<= MMAX) quantized activation rows; writes out[m] for each m.
// MC > 0: the row count is the compile-time MC (accumulators stay in registers); else M.
//
// Each product is added into one of U * LEVELS accumulators per row rather than one: a single
// chain would wait out the FMA's latency at every block, and for one or two rows (decode) that
// latency, not memory, bounded the LM head.
template <int TYPE, int LEVELS, int MC>
inline void row_dot(const uint8_t* w, const XQ& x, int M_, float* out) {
  constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
  constexpr int MR = MC > 0 ? MC : MMAX;
  const int M = MC > 0 ? MC : M_;
  const int64_t LQ = x.M * x.K, LD = x.M * (x.K / 32);  // level strides
  const int64_t K = x.K, nb32 = K / 32;
  __m256 acc[U][LEVELS][MR];
  float mins[MR];
  for (int m = 0; m < M; m++) {
    mins[m] = 0.f;
    for (int u = 0; u < U; u++)
      for (int l = 0; l < LEVELS; l++) acc[u][l][m] = _mm256_setzero_ps();
  }
  if constexpr (TYPE == Q8_0 || TYPE == Q4_0 || TYPE == Q5_0) {
    constexpr int TS = TYPE == Q8_0 ? 34 : TYPE == Q4_0 ? 18 : 22;
    auto block = [&](int64_t b, __m256 (&a)[LEVELS][MR]) {
      const uint8_t* blk = w + b * TS;
      const float dw = f16_at(blk);
      __m256i q;
      if constexpr (TYPE == Q8_0) {
        q = _mm256_loadu_si256((const __m256i*)(blk + 2));
      } else if constexpr (TYPE == Q4_0) {
        q = _mm256_sub_epi8(nibbles_32(blk + 2), _mm256_set1_epi8(8));
      } else {
        const __m256i hi = _mm256_andnot_si256(bytes_from_bits_32(blk + 2), _mm256_set1_epi8((char)0xF0));
        q = _mm256_or_si256(nibbles_32(blk + 6), hi);
      }
      const __m256i aq = _mm256_sign_epi8(q, q);
      for (int m = 0; m < M; m++) {
        for (int l = 0; l < LEVELS; l++) {
          const __m256i y = _mm256_loadu_si256((const __m256i*)(x.q + l * LQ + m * K + b * 32));
          const __m256i dot = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(y, q));
          const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)));
          a[l][m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[l * LD + m * nb32 + b]), p, a[l][m]);
        }
      }
    };
    int64_t b = 0;
    for (; b + U <= nb32; b += U)
      for (int u = 0; u < U; u++) block(b + u, acc[u]);
    for (; b < nb32; b++) block(b, acc[0]);
  } else if constexpr (TYPE == Q4_K) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
      const uint8_t* blk = w + sb * 144;
      const float d = f16_at(blk), dmin = f16_at(blk + 2);
      int sc[8], mn[8];
      for (int j = 0; j < 8; j++) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
      const uint8_t* qs = blk + 16;
      for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
        const int64_t b0 = sb * 8 + 2 * j;
        const float d0 = d * (float)sc[2 * j], d1 = d * (float)sc[2 * j + 1];
        for (int m = 0; m < M; m++) {
          for (int l = 0; l < LEVELS; l++) {
            const int8_t* xq = x.q + l * LQ + m * K + b0 * 32;
            const float* xd = x.d + l * LD + m * nb32 + b0;
            const __m256 p0 = sum_u8_i8_float(lo, _mm256_loadu_si256((const __m256i*)xq));
            const __m256 p1 = sum_u8_i8_float(hi, _mm256_loadu_si256((const __m256i*)(xq + 32)));
            __m256& a0 = acc[(2 * j) % U][l][m];
            __m256& a1 = acc[(2 * j + 1) % U][l][m];
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * xd[0]), p0, a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * xd[1]), p1, a1);
          }
          const float* xs = x.s + m * nb32 + b0;
          mins[m] += dmin * ((float)mn[2 * j] * xs[0] + (float)mn[2 * j + 1] * xs[1]);
        }
      }
    }
  } else if constexpr (TYPE == Q6_K) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
      const uint8_t* blk = w + sb * 210;
      const float d = f16_at(blk + 208);
      const int8_t* scales = (const int8_t*)(blk + 192);
      for (int h = 0; h < 2; h++) {
        const uint8_t* ql = blk + 64 * h;
        const uint8_t* qh = blk + 128 + 32 * h;
        const int8_t* sc = scales + 8 * h;
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)qh);
        const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
        __m256i q[4];
        q[0] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m3)), off);
        q[1] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m3)), off);
        q[2] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m3)), off);
        q[3] = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m3)), off);
        __m256i s16[4];  // the two 16-wide scales of each 32 sub-block, as int16 lanes (low half, high half)
        for (int g = 0; g < 4; g++)
          s16[g] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * g]), _mm_set1_epi16(sc[2 * g + 1]));
        const int64_t b0 = sb * 8 + 4 * h;
        __m256i aq[4];
        for (int g = 0; g < 4; g++) aq[g] = _mm256_sign_epi8(q[g], q[g]);
        for (int m = 0; m < M; m++) {
          for (int l = 0; l < LEVELS; l++) {
            const int8_t* xq = x.q + l * LQ + m * K + b0 * 32;
            const float* xd = x.d + l * LD + m * nb32 + b0;
            for (int g = 0; g < 4; g++) {
              const __m256i y = _mm256_loadu_si256((const __m256i*)(xq + 32 * g));
              const __m256i dot = _mm256_maddubs_epi16(aq[g], _mm256_sign_epi8(y, q[g]));
              const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, s16[g]));
              __m256& a = acc[g % U][l][m];
              a = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[g]), p, a);
            }
          }
        }
      }
    }
  }
  for (int m = 0; m < M; m++) {
    __m256 total = acc[0][0][m];
    for (int u = 0; u < U; u++)
      for (int l = 0; l < LEVELS; l++)
        if (u || l) total = _mm256_add_ps(total, acc[u][l][m]);
    out[m] = hsum8(total) - mins[m];
  }
}

template <int TYPE, int LEVELS, int MC>
void rows_q8_m(const MatmulArgs& a, const XQ& x, int64_t n0, int64_t n1) {
  float out[MMAX];
  const int M = (int)a.M;
  for (int64_t n = n0; n < n1; n++) {
    row_dot<TYPE, LEVELS, MC>(a.w + n * a.row_bytes, x, M, out);
    for (int m = 0; m < M; m++) a.y[m * a.N + n] = out[m];
  }
}

template <int TYPE, int LEVELS>
void rows_q8(const MatmulArgs& a, const XQ& x, int64_t n0, int64_t n1) {
  switch (a.M) {
    case 1: rows_q8_m<TYPE, LEVELS, 1>(a, x, n0, n1); break;
    case 2: rows_q8_m<TYPE, LEVELS, 2>(a, x, n0, n1); break;
    case 3: rows_q8_m<TYPE, LEVELS, 3>(a, x, n0, n1); break;
    case 4: rows_q8_m<TYPE, LEVELS, 4>(a, x, n0, n1); break;
    case 8: rows_q8_m<TYPE, LEVELS, 8>(a, x, n0, n1); break;
    default: rows_q8_m<TYPE, LEVELS, 0>(a, x, n0, n1); break;
  }
}

bool int8_supported(int type, int64_t M) {
  return M >= 1 && M <= MMAX && (type == Q8_0 || type == Q4_0 || type == Q5_0 || type == Q4_K || type == Q6_K);
}

void quantize_x(const MatmulArgs& a, int levels, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = a.K / 32, LQ = a.M * a.K, LD = a.M * nb;
  for (int64_t m = 0; m < a.M; m++) {
    if (levels == 2)
      quantize_row_q8<2>(a.x + m * a.K, a.K, xq + m * a.K, LQ, xd + m * nb, LD, xs + m * nb);
    else
      quantize_row_q8<1>(a.x + m * a.K, a.K, xq + m * a.K, LQ, xd + m * nb, LD, xs + m * nb);
  }
}

template <int LEVELS>
void dispatch_q8(const MatmulArgs& a, const XQ& x, int64_t n0, int64_t n1) {
  switch (a.type) {
    case Q8_0: rows_q8<Q8_0, LEVELS>(a, x, n0, n1); break;
    case Q4_0: rows_q8<Q4_0, LEVELS>(a, x, n0, n1); break;
    case Q5_0: rows_q8<Q5_0, LEVELS>(a, x, n0, n1); break;
    case Q4_K: rows_q8<Q4_K, LEVELS>(a, x, n0, n1); break;
    case Q6_K: rows_q8<Q6_K, LEVELS>(a, x, n0, n1); break;
    default: break;
  }
}

void matmul_rows_int8(const MatmulArgs& a, int levels, const int8_t* xq, const float* xd, const float* xs,
                      int64_t n0, int64_t n1) {
  const XQ x{xq, xd, xs, a.K, a.M};
  if (levels == 2) dispatch_q8<2>(a, x, n0, n1);
  else dispatch_q8<1>(a, x, n0, n1);
}
#else
bool int8_supported(int, int64_t) { return false; }
void quantize_x(const MatmulArgs&, int, int8_t*, float*, float*) {}
void matmul_rows_int8(const MatmulArgs&, int, const int8_t*, const float*, const float*, int64_t, int64_t) {}
#endif

void dequant_rows(int type, const uint8_t* rows, int64_t n_rows, int64_t K, int64_t row_bytes, float* out) {
  for (int64_t r = 0; r < n_rows; r++) dequant_row(type, rows + r * row_bytes, K, out + r * K);
}

}  // namespace

// layers_impl.cpp, the same ISA
void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps);
void logsumexp_rows(const float* x, float* y, int64_t rows, int64_t N);
void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1, float* cs);
void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, float* scores);

#define GMLX_STR2(x) #x
#define GMLX_STR(x) GMLX_STR2(x)
const Impl impl = {GMLX_STR(GMLX_ISA), matmul_rows,   dequant_rows, int8_supported, quantize_x,
                   matmul_rows_int8,  rms_norm_rows, logsumexp_rows, rope_rows, attend};

}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
