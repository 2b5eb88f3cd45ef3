// What the integer paths (AVX2, AVX-512, AMX) share: activations coded as integers per 32 (as
// llama.cpp's Q8_0), and each weight type's blocks unpacked to int8 codes with their scales.
//
// For few activation rows the float path is bound by unpacking weights to float; the integer
// paths unpack each weight block to integers once, meet every row's codes in integer products,
// then apply both scales with one float multiply-add per block and row. Codes span 16 bits by
// default (rounding error 1/65534 of each 32-block's max: float-like output) or 8 bits
// (llama.cpp's Q8_0 activations, for comparison); the cost is the same.
#pragma once

#include "kernels/dequant.h"
#include "kernels/row_blocks.h"
#include "kernels/vec.h"

#include <immintrin.h>
#include <string.h>

namespace gmlx_kernels::GMLX_ISA {
namespace {

inline __m256i nibbles_32(const uint8_t* qs) {  // 16 bytes -> 32 codes: low nibbles, then high
  const __m128i t = _mm_loadu_si128((const __m128i*)qs);
  const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// Q5_0's and Q5_1's codes: 32 nibbles at qs, topped by the fifth bits (32 bits at qh). Clear
// means code - 16 (Q5_0), set means code + 16 (Q5_1).
#if defined(__AVX512BW__) && defined(__AVX512VL__)  // ---- AVX-512: the bits as a byte mask ----
inline __m256i q5_0_codes(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  memcpy(&h, qh, 4);
  const __m256i nib = nibbles_32(qs);
  return _mm256_mask_sub_epi8(nib, (__mmask32)~h, nib, _mm256_set1_epi8(16));
}
inline __m256i q5_1_codes(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  memcpy(&h, qh, 4);
  const __m256i nib = nibbles_32(qs);
  return _mm256_mask_add_epi8(nib, (__mmask32)h, nib, _mm256_set1_epi8(16));
}
#else  // ---- AVX2: the bits spread to bytes ----
inline __m256i bytes_from_bits_32(const uint8_t* x) {  // bit i of x -> byte i: 0xFF or 0
  uint32_t x32;
  memcpy(&x32, x, 4);
  const __m256i shuf =
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}
inline __m256i q5_0_codes(const uint8_t* qh, const uint8_t* qs) {  // as int8, the nibble with 0xF0 set
  const __m256i hi = _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8((char)0xF0));
  return _mm256_or_si256(nibbles_32(qs), hi);
}
inline __m256i q5_1_codes(const uint8_t* qh, const uint8_t* qs) {
  const __m256i hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
  return _mm256_or_si256(nibbles_32(qs), hi);
}
#endif

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

// Bytes ahead that a packed kernel prefetches its group's stream (four of its blocks).
consteval int64_t prefetch_packed(int type) { return 4 * packed_block(type); }

struct XQ {  // the int16 path's view of one pass of coded activation rows
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

consteval bool has_min(int type) { return format_of(type).has_min; }

// Weight types as chunks of NB 32-blocks, a chunk being one GGUF block of TS bytes:
// decode(row, c, out) fills out[0..NB) for chunk c.
template <int TYPE>
struct BlockShape {
  static constexpr int NB = format_of(TYPE).block / 32, TS = format_of(TYPE).bytes;
};
template <int TYPE> struct Blocks;

template <> struct Blocks<Q8_0> : BlockShape<Q8_0> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 2));
    *o = {q, f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q4_0> : BlockShape<Q4_0> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = _mm256_sub_epi8(nibbles_32(b + 2), _mm256_set1_epi8(8));
    *o = {q, f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q4_1> : BlockShape<Q4_1> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    const __m256i q = nibbles_32(b + 4);
    *o = {q, f16_at(b), f16_at(b + 2), 1, 1};
  }
};

template <> struct Blocks<Q5_0> : BlockShape<Q5_0> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    *o = {q5_0_codes(b + 2, b + 6), f16_at(b), 0.f, 1, 1};
  }
};

template <> struct Blocks<Q5_1> : BlockShape<Q5_1> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * TS;
    *o = {q5_1_codes(b + 4, b + 8), f16_at(b), f16_at(b + 2), 1, 1};
  }
};

// Q4_K and Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and minimum; sub-blocks 2j and
// 2j+1 are the low and high nibbles of the same 32 bytes.
template <int TYPE> struct BlocksK : BlockShape<TYPE> {
  static void decode(const uint8_t* row, int64_t c, W32* o) {
    const uint8_t* b = row + c * BlockShape<TYPE>::TS;
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
template <> struct Blocks<Q6_K> : BlockShape<Q6_K> {
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

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
