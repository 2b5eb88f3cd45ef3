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
#error "GMLX_ISA must name the namespace (generic, avx2, avx512, amx)"
#endif
#ifndef GMLX_LAYERS
#define GMLX_LAYERS GMLX_ISA
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

// ---- decode: activations coded as integers per 32 (as llama.cpp's Q8_0), integer dot products ----
//
// For few activation rows the float path is bound by unpacking weights to float; here each
// weight block is unpacked to int16 once and meets every row's int16 codes in madd (16
// products a instruction), then one float multiply-add per block and row applies both scales.
// Codes span 16 bits by default (rounding error 1/65534 of each 32-block's max: float-like
// output) or 8 bits (llama.cpp's Q8_0 activations, for comparison); the cost is the same.

#if defined(__AVX2__) && defined(__FMA__)
#define GMLX_INT_PATH 1

inline __m256i bytes_from_bits_32(const uint8_t* x) {  // bit i of x -> byte i: 0xFF or 0
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

// One row of K floats -> int16 codes q (|q| <= qmax), a scale per 32 (d) and the sum of the
// values the codes stand for per 32 (s: what a block's minimum multiplies).
void quantize_row(const float* x, int64_t K, float qmax, int16_t* q, float* d, float* s) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; b++) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i);
    __m256 m = _mm256_andnot_ps(sign_bit, v[0]);
    for (int i = 1; i < 4; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, v[i]));
    const float amax = hmax8(m), db = amax / qmax;
    const __m256 mul = _mm256_set1_ps(amax > 0.f ? qmax / amax : 0.f);
    __m256i c[4];
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(r);
      sum = _mm256_add_ps(sum, r);
    }
    // packs interleave the 128-bit lanes: restore element order
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
    _mm256_storeu_si256((__m256i*)(q + b * 32), lo);
    _mm256_storeu_si256((__m256i*)(q + b * 32 + 16), hi);
    d[b] = db;
    s[b] = hsum8(sum) * db;
  }
}

struct XQ {
  const int16_t* q;  // M rows of K codes
  const float* d;    // M rows of K/32 scales
  const float* s;    // M rows of K/32 sums of the coded values
  int64_t K;
};

// Weights of 32 consecutive inputs as int8 codes q, with the float scale of their products
// and, for types with a minimum, what multiplies the block's activation sum (0 otherwise).
// Q6_K's codes are also multiplied by an int8 scale per 16 (s0: the first 16, s1: the last;
// the AVX-512 path reads a super-block's 16 at once), once widened to int16 (at most 32 * 128,
// so products with 16-bit codes stay inside int32).
struct W32 {
  __m256i q;
  float d, m;
  int s0, s1;
};

inline __m256i i16_lo(__m256i b) { return _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)); }
inline __m256i i16_hi(__m256i b) { return _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1)); }

// Weight types as chunks of NB 32-blocks: decode(row, c, out) fills out[0..NB) for chunk c.
template <int TYPE> struct Blocks;

template <> struct Blocks<Q8_0> {
  static constexpr int NB = 1, TS = 34;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 2));
    *o = {q, f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q4_0> {
  static constexpr int NB = 1, TS = 18;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = _mm256_sub_epi8(nibbles_32(b + 2), _mm256_set1_epi8(8));
    *o = {q, f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q4_1> {
  static constexpr int NB = 1, TS = 20;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = nibbles_32(b + 4);
    *o = {q, f16_at(b), f16_at(b + 2), 1, 1};
  }
};

template <> struct Blocks<Q5_0> {
  static constexpr int NB = 1, TS = 22;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    // the fifth bit clear means code - 16
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m256i nib = nibbles_32(b + 6);
    const __m256i q = _mm256_mask_sub_epi8(nib, (__mmask32)~qh, nib, _mm256_set1_epi8(16));
#else  // as int8, the nibble with 0xF0 set
    const __m256i hi = _mm256_andnot_si256(bytes_from_bits_32(b + 2), _mm256_set1_epi8((char)0xF0));
    const __m256i q = _mm256_or_si256(nibbles_32(b + 6), hi);
#endif
    *o = {q, f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q5_1> {
  static constexpr int NB = 1, TS = 24;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const __m256i nib = nibbles_32(b + 8);
    const __m256i q = _mm256_mask_add_epi8(nib, (__mmask32)qh, nib, _mm256_set1_epi8(16));
#else
    const __m256i hi = _mm256_and_si256(bytes_from_bits_32(b + 4), _mm256_set1_epi8(0x10));
    const __m256i q = _mm256_or_si256(nibbles_32(b + 8), hi);
#endif
    *o = {q, f16_at(b), f16_at(b + 2), 1, 1};
  }
};

// Q4_K and Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and minimum; sub-blocks 2j and
// 2j+1 are the low and high nibbles of the same 32 bytes.
template <int TYPE> struct BlocksK {
  static constexpr int NB = 8, TS = TYPE == Q4_K ? 144 : 176;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i qh = TYPE == Q5_K ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
      __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if constexpr (TYPE == Q5_K) {  // bit 2j of qh[l] tops sub-block 2j's code l, bit 2j+1 sub-block 2j+1's
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
      }
      int sc, mn;
      scale_min_k4(2 * j, b + 4, &sc, &mn);
      o[2 * j] = {lo, d * (float)sc, -dmin * (float)mn, 1, 1};
      scale_min_k4(2 * j + 1, b + 4, &sc, &mn);
      o[2 * j + 1] = {hi, d * (float)sc, -dmin * (float)mn, 1, 1};
    }
  }
};
template <> struct Blocks<Q4_K> : BlocksK<Q4_K> {};
template <> struct Blocks<Q5_K> : BlocksK<Q5_K> {};

// Q6_K: codes of 6 bits less 32, an int8 scale per 16 (folded in when widened).
template <> struct Blocks<Q6_K> {
  static constexpr int NB = 8, TS = 210;
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const float d = f16_at(b + 208);
    const int8_t* scales = (const int8_t*)(b + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql = b + 64 * h;
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql);
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m3));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m3));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m3));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(hb, 2), m3));
      const int8_t* sc = scales + 8 * h;
      for (int g = 0; g < 4; g++) o[4 * h + g] = {_mm256_sub_epi8(q[g], off), d, 0.f, sc[2 * g], sc[2 * g + 1]};
    }
  }
};

constexpr bool has_min(int type) { return type == Q4_1 || type == Q5_1 || type == Q4_K || type == Q5_K; }

// One weight row against M (<= INT_ROWS) coded activation rows; writes out[m] for each m.
// MC > 0: the row count is the compile-time MC (accumulators stay in registers); else M.
// Blocks are spread over U accumulators per row: a single chain would wait out the FMA's
// latency at every block, and for one or two rows (decode) that latency bounds the LM head.
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512: a 32-block's int16 weights fill one register and meet a row's codes in one madd.
// Scales differ per block and row, so each block's int32 sums become float there (no integer
// accumulation across blocks); the scales of G blocks are multiplied for each row at once, so
// per block and row it is madd, convert and an FMA whose scale is a broadcast from memory.
inline uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return h;
}

template <int C>  // the C (4 or 8) halves at p, p + stride, ...; lanes past C are 0
inline __m256 f16x(const uint8_t* p, int64_t stride) {
  __m128i h = _mm_cvtsi32_si128(u16_at(p));
  h = _mm_insert_epi16(h, u16_at(p + stride), 1);
  h = _mm_insert_epi16(h, u16_at(p + 2 * stride), 2);
  h = _mm_insert_epi16(h, u16_at(p + 3 * stride), 3);
  if constexpr (C == 4) return _mm256_cvtph_ps(h);
  h = _mm_insert_epi16(h, u16_at(p + 4 * stride), 4);
  h = _mm_insert_epi16(h, u16_at(p + 5 * stride), 5);
  h = _mm_insert_epi16(h, u16_at(p + 6 * stride), 6);
  h = _mm_insert_epi16(h, u16_at(p + 7 * stride), 7);
  return _mm256_cvtph_ps(h);
}

// The float scales (d) and minimum multipliers (m) of the C 32-blocks from block b0 (C = 8: a
// super-block of the K types), in the lanes: built from the raw bytes, not block by block.
template <int TYPE, int C>
inline void scales(const uint8_t* w, int64_t b0, __m256* d, __m256* m) {
  using B = Blocks<TYPE>;
  if constexpr (B::NB == 1) {  // d, then m for the _1 types, are the block's first halves
    const uint8_t* b = w + b0 * B::TS;
    *d = f16x<C>(b, B::TS);
    if constexpr (has_min(TYPE)) *m = f16x<C>(b + 2, B::TS);
  } else if constexpr (TYPE == Q6_K) {
    *d = _mm256_set1_ps(f16_at(w + b0 / 8 * B::TS + 208));
  } else {  // the 12 bytes of 6-bit scales and minima (scale_min_k4), 4 lanes per 32-bit word
    const uint8_t* b = w + b0 / 8 * B::TS;
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    const uint64_t sc = (u[0] & lo6) | (uint64_t)((u[2] & lo4) | ((u[0] >> 6) & lo2) << 4) << 32;
    const uint64_t mn = (u[1] & lo6) | (uint64_t)(((u[2] >> 4) & lo4) | ((u[1] >> 6) & lo2) << 4) << 32;
    const auto f8 = [](uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)v))); };
    *d = _mm256_mul_ps(_mm256_set1_ps(f16_at(b)), f8(sc));
    *m = _mm256_mul_ps(_mm256_set1_ps(-f16_at(b + 2)), f8(mn));
  }
}

template <int TYPE, int MC>
inline void row_dot(const uint8_t* w, const XQ& x, int M_, float* out) {
  using B = Blocks<TYPE>;
  constexpr int G = 8;  // blocks per chunk: one vector of G scales per row
  static_assert(B::NB == 1 || B::NB == G);
  constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
  constexpr int MR = MC > 0 ? MC : INT_ROWS;
  const int M = MC > 0 ? MC : M_;
  const int64_t K = x.K, nb32 = K / 32;
  __m512 acc[U][MR];
  __m256 mins[MR];
#pragma GCC unroll 8
  for (int m = 0; m < M; m++) {  // unrolled: a loop here becomes a memset through memory
    mins[m] = _mm256_setzero_ps();
    for (int u = 0; u < U; u++) acc[u][m] = _mm512_setzero_ps();
  }
  W32 wb[G];
  alignas(32) float sc[MR][G];
  // blocks b0 .. b0 + C - 1 (C = G, or G / 2 at a ragged end of one-block types)
  auto chunk = [&]<int C>(int64_t b0) {
    constexpr __mmask8 lanes = (1 << C) - 1;
    if constexpr (B::NB == 1) {
      for (int i = 0; i < C; i++) B::decode(w, b0 + i, wb + i);
    } else {
      B::decode(w, b0 / G, wb);
    }
    __m256 wd, wm;
    scales<TYPE, C>(w, b0, &wd, &wm);
    for (int m = 0; m < M; m++)
      _mm256_store_ps(sc[m], _mm256_mul_ps(wd, _mm256_maskz_loadu_ps(lanes, x.d + m * nb32 + b0)));
    asm("" : "+m"(sc));  // keep sc in memory: each use below is then a broadcast load, not a shuffle
    if constexpr (has_min(TYPE)) {  // the C minima against the C activation sums, in the lanes
      for (int m = 0; m < M; m++)
        mins[m] = _mm256_fmadd_ps(wm, _mm256_maskz_loadu_ps(lanes, x.s + m * nb32 + b0), mins[m]);
    }
    __m512i s16;  // Q6_K: the super-block's 16 int8 scales as int16, lane j scales codes 16j..16j+15
    if constexpr (TYPE == Q6_K)
      s16 = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(w + b0 / 8 * B::TS + 192))));
#pragma GCC unroll 8
    for (int i = 0; i < C; i++) {
      __m512i wv = _mm512_cvtepi8_epi16(wb[i].q);
      if constexpr (TYPE == Q6_K)
        wv = _mm512_mullo_epi16(wv, _mm512_permutexvar_epi16(
                                        _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * i)), _mm256_set1_epi16((short)(2 * i + 1)), 1), s16));
      for (int m = 0; m < M; m++) {
        const __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(x.q + m * K + (b0 + i) * 32));
        acc[i % U][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sc[m][i]), acc[i % U][m]);
      }
    }
  };
  int64_t b = 0;
  for (; b + G <= nb32; b += G) chunk.template operator()<G>(b);
  if constexpr (B::NB == 1) {
    if (b + G / 2 <= nb32) {
      chunk.template operator()<G / 2>(b);
      b += G / 2;
    }
  }
  float tail[MR] = {};
  if constexpr (B::NB == 1) {
    for (; b < nb32; b++) {  // the last nb32 % 4 blocks (super-block types have none: K % 256 == 0)
      B::decode(w, b, wb);
      const __m512i wv = _mm512_cvtepi8_epi16(wb[0].q);
      for (int m = 0; m < M; m++) {
        const __m512i p = _mm512_madd_epi16(wv, _mm512_loadu_si512(x.q + m * K + b * 32));
        acc[0][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(wb[0].d * x.d[m * nb32 + b]), acc[0][m]);
        if constexpr (has_min(TYPE)) tail[m] += wb[0].m * x.s[m * nb32 + b];
      }
    }
  }
  for (int m = 0; m < M; m++) {
    __m512 total = acc[0][m];
    for (int u = 1; u < U; u++) total = _mm512_add_ps(total, acc[u][m]);
    out[m] = _mm512_reduce_add_ps(total) + (has_min(TYPE) ? hsum8(mins[m]) + tail[m] : 0.f);
  }
}
#else
inline void widen(const W32& v, bool scaled, __m256i* lo, __m256i* hi) {
  *lo = i16_lo(v.q);
  *hi = i16_hi(v.q);
  if (scaled) {
    *lo = _mm256_mullo_epi16(*lo, _mm256_set1_epi16((short)v.s0));
    *hi = _mm256_mullo_epi16(*hi, _mm256_set1_epi16((short)v.s1));
  }
}

template <int TYPE, int MC>
inline void row_dot(const uint8_t* w, const XQ& x, int M_, float* out) {
  using B = Blocks<TYPE>;
  constexpr int U = MC == 1 ? 4 : MC == 2 ? 2 : 1;
  constexpr int MR = MC > 0 ? MC : INT_ROWS;
  const int M = MC > 0 ? MC : M_;
  const int64_t K = x.K, nb32 = K / 32;
  __m256 acc[U][MR];
  float mins[MR];
#pragma GCC unroll 8
  for (int m = 0; m < M; m++) {  // unrolled: a loop here becomes a memset through memory
    mins[m] = 0.f;
    for (int u = 0; u < U; u++) acc[u][m] = _mm256_setzero_ps();
  }
  // block<u>(b): 32-block b (decoded in wb[b % NW]) into accumulator set u, a compile-time index
  // so the sets stay in registers
  constexpr int NW = B::NB > U ? B::NB : U;
  W32 wb[NW];
  auto block = [&]<int u>(int64_t b) {
    const W32& wv = wb[b % NW];
    __m256i lo, hi;
    widen(wv, TYPE == Q6_K, &lo, &hi);
    for (int m = 0; m < M; m++) {
      const int16_t* xq = x.q + m * K + b * 32;
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)xq)),
                                         _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq + 16))));
      acc[u][m] = _mm256_fmadd_ps(_mm256_set1_ps(wv.d * x.d[m * nb32 + b]), _mm256_cvtepi32_ps(p), acc[u][m]);
      if constexpr (TYPE == Q4_1 || TYPE == Q5_1) mins[m] += wv.m * x.s[m * nb32 + b];
    }
  };
  auto blocks_u = [&](int64_t b) {  // blocks b .. b + U - 1, one per accumulator set
    block.template operator()<0>(b);
    if constexpr (U > 1) block.template operator()<1>(b + 1);
    if constexpr (U > 2) {
      block.template operator()<2>(b + 2);
      block.template operator()<3>(b + 3);
    }
  };
  if constexpr (B::NB == 1) {
    int64_t b = 0;
    for (; b + U <= nb32; b += U) {
      for (int u = 0; u < U; u++) B::decode(w, b + u, wb + u);
      blocks_u(b);
    }
    for (; b < nb32; b++) {
      B::decode(w, b, wb + b % NW);
      block.template operator()<0>(b);
    }
  } else {
    static_assert(B::NB % U == 0);
    for (int64_t c = 0; c < nb32 / B::NB; c++) {
      B::decode(w, c, wb);
      for (int i = 0; i < B::NB; i += U) blocks_u(c * B::NB + i);
      if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // the 8 minima against the 8 activation sums, in the lanes
        const __m256 mv = _mm256_setr_ps(wb[0].m, wb[1].m, wb[2].m, wb[3].m, wb[4].m, wb[5].m, wb[6].m, wb[7].m);
        for (int m = 0; m < M; m++) acc[0][m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(x.s + m * nb32 + c * 8), acc[0][m]);
      }
    }
  }
  for (int m = 0; m < M; m++) {
    __m256 total = acc[0][m];
    for (int u = 1; u < U; u++) total = _mm256_add_ps(total, acc[u][m]);
    out[m] = hsum8(total) + mins[m];
  }
}
#endif

// Bytes ahead of the row in work that its weights are prefetched: the hardware prefetcher alone
// leaves a single thread's stream (the LM head at batch 1) well below the core's bandwidth.
// Past the tensor's end a prefetch is dropped, never a fault.
constexpr int64_t PREFETCH_AHEAD = 8192;

template <int TYPE, int MC>
void rows_int_m(const MatmulArgs& a, const XQ& x, int64_t n0, int64_t n1) {
  float out[INT_ROWS];
  const int M = (int)a.M;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* ahead = a.w + n * a.row_bytes + PREFETCH_AHEAD;
    for (int64_t off = 0; off < a.row_bytes; off += 64) _mm_prefetch((const char*)ahead + off, _MM_HINT_T0);
    row_dot<TYPE, MC>(a.w + n * a.row_bytes, x, M, out);
    for (int m = 0; m < M; m++) a.y[m * a.N + n] = out[m];
  }
}

template <int TYPE>
void rows_int(const MatmulArgs& a, const XQ& x, int64_t n0, int64_t n1) {
  switch (a.M) {
    case 1: rows_int_m<TYPE, 1>(a, x, n0, n1); break;
    case 2: rows_int_m<TYPE, 2>(a, x, n0, n1); break;
    case 3: rows_int_m<TYPE, 3>(a, x, n0, n1); break;
    case 4: rows_int_m<TYPE, 4>(a, x, n0, n1); break;
    case 8: rows_int_m<TYPE, 8>(a, x, n0, n1); break;
    default: rows_int_m<TYPE, 0>(a, x, n0, n1); break;
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// ---- AMX (Intel Sapphire Rapids on): the decode path as int8 tile products ----
//
// One tile product takes 16 weight rows' codes of one scale block (A: 16 x S int8; S = 32, or
// 16 for Q6_K's sub-blocks) against up to 8 activation rows (B), each 16-bit code given as two
// int8 halves, code = 256 hi + lo: C (16 x 2Mp int32) holds each weight row's Mp high and Mp
// low sums, so the activations keep the int16 path's precision at int8 speed. Scales differ
// per block, so each block's C is stored and scaled in float: a few vector instructions per 16
// outputs, where the int16 path spends three per output and block. Q8_0's A tiles are the
// file's bytes read in place (stride: the row); other types are unpacked to int8 first.

// |code| <= 32639 keeps hi = (code + 128) >> 8 within int8 (and lo = code - 256 hi in [-128, 127])
constexpr float AMX_QMAX16 = 32639.f;
static_assert(INT_ROWS <= 8, "a C tile holds 8 rows' hi and lo sums (64 bytes a row)");

// One pass of mp = a.M <= INT_ROWS activation rows (mp * K int16 worth of bytes at xq): per
// 32-block b, the 8 rows of its B tile, row r holding the mp rows' hi bytes of codes 4r..4r+3,
// then their lo bytes (the tile's dword columns: mp hi sums, then mp lo). xd and xs: [b][m].
void quantize_x(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs) {
  const int64_t K = a.K, nb = K / 32, mp = a.M;
  const float qmax = bits == 8 ? 127.f : AMX_QMAX16;
  uint8_t* dst = (uint8_t*)xq;
  for (int64_t i = 0; i < mp; i++) {
    const float* x = a.x + i * K;
    for (int64_t b = 0; b < nb; b++) {
      alignas(64) int16_t c[32];
      quantize_row(x + b * 32, 32, qmax, c, xd + b * mp + i, xs + b * mp + i);
      const __m512i v = _mm512_load_si512(c);
      const __m512i hi = _mm512_srai_epi16(_mm512_add_epi16(v, _mm512_set1_epi16(128)), 8);
      const __m512i lo = _mm512_sub_epi16(v, _mm512_slli_epi16(hi, 8));
      alignas(32) uint8_t h[32], l[32];
      _mm256_store_si256((__m256i*)h, _mm512_cvtepi16_epi8(hi));
      _mm256_store_si256((__m256i*)l, _mm512_cvtepi16_epi8(lo));
      uint8_t* blk = dst + b * 64 * mp;
      for (int r = 0; r < 8; r++) {
        memcpy(blk + r * 8 * mp + 4 * i, h + 4 * r, 4);
        memcpy(blk + r * 8 * mp + 4 * (mp + i), l + 4 * r, 4);
      }
    }
  }
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The float scales wd (and minimum multipliers wm) of every sub-block of 16 weight rows from
// row pointer w (rows rb bytes apart; lanes past `valid` are 0): [t][i] for sub-block t and row
// i, gathered from the rows' bytes 16 lanes at once.
template <int TYPE>
void amx_scales(const uint8_t* w, int64_t rb, __mmask16 valid, int64_t K, float* wd, float* wm) {
  using B = Blocks<TYPE>;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)rb));
  const __m512i zero = _mm512_setzero_si512();
  auto gather = [&](const uint8_t* p) { return _mm512_mask_i32gather_epi32(zero, valid, rows, p, 1); };
  auto half = [](__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); };  // the low 16 bits as fp16
  if constexpr (B::NB == 1) {
    for (int64_t b = 0; b < K / 32; b++) {
      const __m512i g = gather(w + b * B::TS);
      _mm512_store_ps(wd + 16 * b, half(g));
      if constexpr (has_min(TYPE)) _mm512_store_ps(wm + 16 * b, half(_mm512_srli_epi32(g, 16)));
    }
  } else if constexpr (TYPE == Q6_K) {
    for (int64_t c = 0; c < K / 256; c++) {
      const uint8_t* p = w + c * B::TS;
      const __m512 d = half(_mm512_srli_epi32(gather(p + 206), 16));  // d: the last 2 bytes
      for (int q = 0; q < 4; q++) {
        const __m512i v = gather(p + 192 + 4 * q);  // int8 scales 4q .. 4q + 3
        const __m512i sc[4] = {_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24), _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24),
                               _mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24), _mm512_srai_epi32(v, 24)};
        for (int j = 0; j < 4; j++) _mm512_store_ps(wd + 16 * (16 * c + 4 * q + j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc[j])));
      }
    }
  } else {  // Q4_K, Q5_K: d, dmin, then 12 bytes of 6-bit scales and minima (scale_min_k4)
    const __m512i lo6 = _mm512_set1_epi32(63), lo4 = _mm512_set1_epi32(15), lo2 = _mm512_set1_epi32(3);
    for (int64_t c = 0; c < K / 256; c++) {
      const uint8_t* p = w + c * B::TS;
      const __m512i g = gather(p), u0 = gather(p + 4), u1 = gather(p + 8), u2 = gather(p + 12);
      const __m512 d = half(g), dmin = _mm512_sub_ps(_mm512_setzero_ps(), half(_mm512_srli_epi32(g, 16)));
      for (int j = 0; j < 8; j++) {
        __m512i sc, mn;
        if (j < 4) {
          sc = _mm512_and_si512(_mm512_srli_epi32(u0, 8 * j), lo6);
          mn = _mm512_and_si512(_mm512_srli_epi32(u1, 8 * j), lo6);
        } else {
          const int sh = 8 * (j - 4);
          sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, sh), lo4),
                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, sh + 6), lo2), 4));
          mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, sh + 4), lo4),
                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, sh + 6), lo2), 4));
        }
        _mm512_store_ps(wd + 16 * (8 * c + j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(wm + 16 * (8 * c + j), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
      }
    }
  }
}

// The int8 codes of `valid` weight rows, row i at out + i * K (the other rows left as they are).
template <int TYPE>
void amx_codes(const uint8_t* w, int64_t rb, int valid, int64_t K, int8_t* out) {
  using B = Blocks<TYPE>;
  W32 wb[B::NB];
  for (int i = 0; i < valid; i++) {
    int8_t* o = out + i * K;
    for (int64_t c = 0; c < K / (32 * B::NB); c++) {
      B::decode(w + i * rb, c, wb);
      for (int j = 0; j < B::NB; j++, o += 32) _mm256_storeu_si256((__m256i*)o, wb[j].q);
    }
  }
}

// y[:, n0:n1] for every row of x, INT_ROWS at a time as quantize_x laid them out: each group of
// 16 weight rows is unpacked once (codes and scales into scratch) and meets every pass.
template <int TYPE>
void rows_amx(const MatmulArgs& a, const uint8_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
              void* scratch) {
  constexpr int S = TYPE == Q6_K ? 16 : 32;  // codes per scale
  constexpr bool MIN = has_min(TYPE);
  const int64_t K = a.K, rb = a.row_bytes, ns = K / S, nb = K / 32;
  int8_t* codes = (int8_t*)scratch;      // 16 x K
  float* wd = (float*)(codes + 16 * K);  // 16 x ns
  float* wm = wd + 16 * ns;              // 16 x nb, types with a minimum
  alignas(64) int32_t cbuf[2][16 * 16 + 32];  // C of the even and odd sub-block; +32: reads past a pair
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i pair[8];  // lanes 0-7: weight row 2j, 8-15: row 2j + 1
  for (int j = 0; j < 8; j++)
    pair[j] = _mm512_inserti64x4(_mm512_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1), 1);
  int mp = 0;  // rows of the pass the tiles are configured for
  __m512i ihi = even, ilo = odd;
  __mmask8 mlanes = 0;
  auto configure = [&](int rows) {  // A, B, C; tiles 3-5 the same for odd sub-blocks
    mp = rows;
    TileConfig cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 6; t += 3) {
      cfg.rows[t] = 16, cfg.colsb[t] = S;
      cfg.rows[t + 1] = S / 4, cfg.colsb[t + 1] = (uint16_t)(8 * mp);
      cfg.rows[t + 2] = 16, cfg.colsb[t + 2] = (uint16_t)(8 * mp);
    }
    _tile_loadconfig(&cfg);
    // mp >= 2: a vector holds 2 weight rows' 8 lanes of activation rows; lanes past mp repeat the last
    alignas(64) int32_t h[16];
    for (int l = 0; l < 16; l++) h[l] = (l / 8) * 2 * mp + (l % 8 < mp ? l % 8 : mp - 1);
    ihi = _mm512_load_si512(h);
    ilo = _mm512_add_epi32(ihi, _mm512_set1_epi32(mp));
    mlanes = (__mmask8)((1u << mp) - 1);
  };
  for (int64_t n = n0; n < n1; n += 16) {
    const int valid = n1 - n < 16 ? (int)(n1 - n) : 16;
    const uint8_t* w = a.w + n * rb;
    const bool in_place = TYPE == Q8_0 && valid == 16;  // Q8_0: 2-byte scale, then the 32 codes
    amx_scales<TYPE>(w, rb, (__mmask16)((1u << valid) - 1), K, wd, wm);
    if (!in_place) {
      if (valid < 16) memset(codes, 0, 16 * K);
      amx_codes<TYPE>(w, rb, valid, K, codes);
    }
    const int64_t astride = in_place ? rb : K;
    for (int64_t m0 = 0; m0 < a.M; m0 += INT_ROWS) {
      if (const int rows = a.M - m0 < INT_ROWS ? (int)(a.M - m0) : INT_ROWS; rows != mp) configure(rows);
      const uint8_t* xb = xq + 2 * m0 * K;  // this pass's B tiles
      const float* pd = xd + m0 * nb;
      const float* ps = xs + m0 * nb;
      __m512 acc[8];
      for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
      __m512 acc1 = _mm512_setzero_ps();
      auto asrc = [&](int64_t t) -> const void* { return in_place ? (const void*)(w + t * 34 + 2) : codes + t * S; };
      auto bsrc = [&](int64_t t) -> const void* { return xb + (t * S / 32) * 64 * mp + (t * S % 32) / 4 * 8 * mp; };
      auto post = [&](int64_t t, const int32_t* c) {
        if (m0 == 0) {
          // the next 16 rows' bytes of this sub-block, prefetched along the first pass: all at once
          // they would fill the core's line buffers and stall it (past the tensor's end: dropped)
          const char* ahead = (const char*)w + 16 * rb + t * S * rb / K;
          for (int i = 0; i < 16; i++) _mm_prefetch(ahead + i * rb, _MM_HINT_T0);
        }
        const int64_t b = t * S / 32;  // the activations' 32-block
        const __m512 wdv = _mm512_load_ps(wd + 16 * t);
        if (mp == 1) {  // lanes: the 16 weight rows
          const __m512i c0 = _mm512_load_si512(c), c1 = _mm512_load_si512(c + 16);
          const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_permutex2var_epi32(c0, even, c1), 8),
                                             _mm512_permutex2var_epi32(c0, odd, c1));
          acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(wdv, _mm512_set1_ps(pd[b])), acc1);
          if constexpr (MIN) acc1 = _mm512_fmadd_ps(_mm512_load_ps(wm + 16 * b), _mm512_set1_ps(ps[b]), acc1);
          return;
        }
        auto twice = [&](const float* p) {  // p[0 .. mp) in lanes 0-7 and again in 8-15
          const __m512 v = _mm512_castps256_ps512(_mm256_maskz_loadu_ps(mlanes, p));
          return _mm512_shuffle_f32x4(v, v, 0x44);
        };
        const __m512 xdv = twice(pd + b * mp);
        __m512 xsv;
        if constexpr (MIN) xsv = twice(ps + b * mp);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {  // weight rows 2j, 2j + 1
          const __m512i c0 = _mm512_loadu_si512(c + 4 * mp * j), c1 = _mm512_loadu_si512(c + 4 * mp * j + 16);
          const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_permutex2var_epi32(c0, ihi, c1), 8),
                                             _mm512_permutex2var_epi32(c0, ilo, c1));
          acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), xdv), _mm512_permutexvar_ps(pair[j], wdv), acc[j]);
          if constexpr (MIN) acc[j] = _mm512_fmadd_ps(xsv, _mm512_permutexvar_ps(pair[j], _mm512_load_ps(wm + 16 * b)), acc[j]);
        }
      };
      // tiles A, B, C for sub-block t, its C stored to out (tile numbers must be literals). GCC's
      // tile loads do not tell the compiler they read memory; the store after each (which does)
      // is what keeps the codes written to scratch before them.
#define GMLX_TILE_STEP(A, B, C, t, out)            \
  do {                                             \
    _tile_loadd(A, asrc(t), astride);              \
    _tile_loadd(B, bsrc(t), 8 * mp);               \
    _tile_zero(C);                                 \
    _tile_dpbssd(C, A, B);                         \
    _tile_stored(C, out, 8 * mp);                  \
  } while (0)
      // software pipeline: sub-block t + 1's tiles are in flight while t's C is scaled
      GMLX_TILE_STEP(0, 1, 2, 0, cbuf[0]);
      for (int64_t t = 0; t < ns; t += 2) {
        if (t + 1 < ns) GMLX_TILE_STEP(3, 4, 5, t + 1, cbuf[1]);
        post(t, cbuf[0]);
        if (t + 1 < ns) {
          if (t + 2 < ns) GMLX_TILE_STEP(0, 1, 2, t + 2, cbuf[0]);
          post(t + 1, cbuf[1]);
        }
      }
#undef GMLX_TILE_STEP
      float* y = a.y + m0 * a.N + n;
      if (mp == 1) {
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1), acc1);
      } else {
        alignas(64) float out[8][16];
        for (int j = 0; j < 8; j++) _mm512_store_ps(out[j], acc[j]);
        for (int m = 0; m < mp; m++)
          for (int i = 0; i < valid; i++) y[m * a.N + i] = out[i / 2][(i % 2) * 8 + m];
      }
    }
  }
  _tile_release();
}

bool int_supported(int type, int64_t M) { return M >= 1 && block_size(type) > 0; }

void matmul_rows_int(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
                     void* scratch) {
  const uint8_t* xb = (const uint8_t*)xq;
  switch (a.type) {
    case Q8_0: rows_amx<Q8_0>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q4_0: rows_amx<Q4_0>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q4_1: rows_amx<Q4_1>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q5_0: rows_amx<Q5_0>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q5_1: rows_amx<Q5_1>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q4_K: rows_amx<Q4_K>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q5_K: rows_amx<Q5_K>(a, xb, xd, xs, n0, n1, scratch); break;
    case Q6_K: rows_amx<Q6_K>(a, xb, xd, xs, n0, n1, scratch); break;
    default: break;
  }
}
#else
bool int_supported(int type, int64_t M) { return M >= 1 && M < INT16_MAX_ROWS && block_size(type) > 0; }

void quantize_x(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs) {
  const int64_t nb = a.K / 32;
  const float qmax = (float)((1 << (bits - 1)) - 1);
  for (int64_t m = 0; m < a.M; m++) quantize_row(a.x + m * a.K, a.K, qmax, xq + m * a.K, xd + m * nb, xs + m * nb);
}

template <int TYPE>
void rows_int_passes(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32;
  for (int64_t m0 = 0; m0 < a.M; m0 += INT_ROWS) {  // each thread's slice of weights stays in cache for the next
    MatmulArgs g = a;
    g.M = a.M - m0 < INT_ROWS ? a.M - m0 : INT_ROWS;
    g.y += m0 * a.N;
    rows_int<TYPE>(g, XQ{xq + m0 * a.K, xd + m0 * nb, xs + m0 * nb, a.K}, n0, n1);
  }
}

void matmul_rows_int(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
                     void*) {
  switch (a.type) {
    case Q8_0: rows_int_passes<Q8_0>(a, xq, xd, xs, n0, n1); break;
    case Q4_0: rows_int_passes<Q4_0>(a, xq, xd, xs, n0, n1); break;
    case Q4_1: rows_int_passes<Q4_1>(a, xq, xd, xs, n0, n1); break;
    case Q5_0: rows_int_passes<Q5_0>(a, xq, xd, xs, n0, n1); break;
    case Q5_1: rows_int_passes<Q5_1>(a, xq, xd, xs, n0, n1); break;
    case Q4_K: rows_int_passes<Q4_K>(a, xq, xd, xs, n0, n1); break;
    case Q5_K: rows_int_passes<Q5_K>(a, xq, xd, xs, n0, n1); break;
    case Q6_K: rows_int_passes<Q6_K>(a, xq, xd, xs, n0, n1); break;
    default: break;
  }
}
#endif  // AMX
#else
bool int_supported(int, int64_t) { return false; }
void quantize_x(const MatmulArgs&, int, int16_t*, float*, float*) {}
void matmul_rows_int(const MatmulArgs&, const int16_t*, const float*, const float*, int64_t, int64_t, void*) {}
#endif

void dequant_rows(int type, const uint8_t* rows, int64_t n_rows, int64_t K, int64_t row_bytes, float* out) {
  for (int64_t r = 0; r < n_rows; r++) dequant_row(type, rows + r * row_bytes, K, out + r * K);
}

}  // namespace
}  // namespace GMLX_ISA

// layers_impl.cpp, compiled for GMLX_LAYERS: this ISA, or for amx avx512's (they use no tiles)
namespace GMLX_LAYERS {
void gated_act(const float* g, const float* u, float* h, int64_t n, int act);
void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps);
void logsumexp_rows(const float* x, float* y, int64_t rows, int64_t N);
void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1, float* cs);
void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, float* scores);
void attend_rows(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work);
int64_t argmax_row(const float* x, int64_t n);
float exp_sum(const float* x, int64_t n, float m, float k, float* w);
int64_t gather_ge(const float* x, int64_t n, float t, int32_t* idx);
}  // namespace GMLX_LAYERS

namespace GMLX_ISA {
#define GMLX_STR2(x) #x
#define GMLX_STR(x) GMLX_STR2(x)
namespace L = GMLX_LAYERS;
const Impl impl = {GMLX_STR(GMLX_ISA), matmul_rows,       dequant_rows,   int_supported,     quantize_x,
                   matmul_rows_int,   L::rms_norm_rows,  L::gated_act,   L::logsumexp_rows, L::rope_rows,
                   L::attend,         L::attend_rows,    L::argmax_row,  L::exp_sum,        L::gather_ge};
}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
