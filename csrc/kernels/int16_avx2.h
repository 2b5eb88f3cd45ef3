// The int16 path's dot product of one weight row with AVX2 (row_dot: see int16_rows.h): each
// 32-block's codes widened to two registers of int16 meet a row's codes in two madds.
#pragma once

#include "kernels/int_codes.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

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

// The packed layouts (gguf_kernels.h) whose kernel here beats the file's layout: Q6_K's high bits
// cost more to decode in 8 lanes than its codes' products at batch 1 (0.069 ms against 0.058 at
// 640 x 2,048, 0.98-1.02x at 4 and 8 rows), and so do Q5_K's fifth bits (0.091 against 0.080 at
// 1,024 x 2,048, 1.04-1.11x at 4 to 64 rows), so they keep the file's.
constexpr bool packs_type(int type) { return packable(type) && type != Q6_K && type != Q5_K; }

// Code pair p of rows 8 h .. 8 h + 7 of sub-block j of a packed group's block (gguf_kernels.h), a
// lane each: TYPE is the file's. As on AVX-512 (int16_avx512.h: packed_pair), the 4 low bits of a
// row's two codes meet in one word each; Q4_0's lose 8; Q5_0's fifth bits, spread to words, take
// 16 off.
template <int TYPE>
inline __m256i packed_half(const uint8_t* blk, int j, int p, int h) {
  if constexpr (TYPE == Q8_0) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + packed_pairs_at(p) + 16 * h)));
  } else {
    static_assert(TYPE == Q4_0 || TYPE == Q5_0 || TYPE == Q4_K);
    const uint8_t* nibbles = blk + packed_nibbles_at(TYPE, j, p) + 8 * h;
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)nibbles));
    const __m256i v = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)), _mm256_set1_epi32(0x000F000F));
    if constexpr (TYPE == Q4_K) return v;
    if constexpr (TYPE == Q4_0) return _mm256_sub_epi16(v, _mm256_set1_epi16(8));
    uint16_t low;  // bit w: word w's code lost its fifth bit
    memcpy(&low, blk + q5_signs_at(p) + 2 * h, 2);
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
    const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)low), bit), bit);
    return _mm256_sub_epi16(v, _mm256_and_si256(set, _mm256_set1_epi16(16)));
  }
}

// Q4_K_R16's 6-bit scales (what = 0) or minima (1) of sub-block j for rows 8 h .. 8 h + 7, as floats.
inline __m256 q4k_six(const uint8_t* blk, int j, int what, int h) {
  int64_t low;
  int32_t high;
  memcpy(&low, blk + q4k_low_at(j, what), 8);
  memcpy(&high, blk + q4k_high_at(j, what), 4);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i l = _mm256_srlv_epi32(_mm256_set1_epi64x(low), _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12));
  const __m256i hb = _mm256_srlv_epi32(_mm256_set1_epi32(high), _mm256_slli_epi32(lane, 1));
  const __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(l, 16 * h), _mm256_set1_epi32(15)),
                                    _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(hb, 16 * h), 4),
                                                     _mm256_set1_epi32(48)));
  return _mm256_cvtepi32_ps(v);
}

// Activation rows MC (<= 6: their sums stay in 12 of the 16 registers through a block; two
// chains each spilled and were slower) from m0 against sub-block j (32-block b of the tensor) of
// a packed group's block, out[m * PACK_ROWS + i] += its products: int16_avx512.h's packed_dot in
// two halves of 8 lanes, madd and add for its dpwssd, the same scales in the same order, so the
// same floats. dj[h]: the scales of rows 8 h ..; mj[h] their minima's (Q4_K). The codes come from
// decoded (the sub-block's 32 halves, decoded once for several passes of rows) or, if null, blk.
template <int TYPE, int MC>
inline void block_rows(const uint8_t* blk, int j, const __m256i* decoded, const __m256* dj, const __m256* mj,
                       const XQ& x, int64_t m0, int64_t b, float* out) {
  const int64_t K = x.K, nb32 = K / 32;
  __m256i s[MC][2] = {};  // row m, lanes 0-7 / 8-15 (an add's latency is short: one chain each)
  for (int p = 0; p < 16; p++) {
    const __m256i lo = decoded ? decoded[2 * p] : packed_half<TYPE>(blk, j, p, 0);
    const __m256i hi = decoded ? decoded[2 * p + 1] : packed_half<TYPE>(blk, j, p, 1);
    for (int m = 0; m < MC; m++) {
      const __m256i xv = _mm256_set1_epi32(((const int32_t*)(x.q + (m0 + m) * K + b * 32))[p]);
      s[m][0] = _mm256_add_epi32(s[m][0], _mm256_madd_epi16(lo, xv));
      s[m][1] = _mm256_add_epi32(s[m][1], _mm256_madd_epi16(hi, xv));
    }
  }
  for (int m = 0; m < MC; m++) {
    const __m256 xd = _mm256_set1_ps(x.d[(m0 + m) * nb32 + b]);
    for (int h = 0; h < 2; h++) {
      float* o = out + (m0 + m) * PACK_ROWS + 8 * h;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][h]), _mm256_mul_ps(dj[h], xd), _mm256_loadu_ps(o)));
    }
  }
  if constexpr (TYPE == Q4_K)
    for (int m = 0; m < MC; m++) {
      const __m256 xs = _mm256_set1_ps(x.s[(m0 + m) * nb32 + b]);
      for (int h = 0; h < 2; h++) {
        float* o = out + (m0 + m) * PACK_ROWS + 8 * h;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(mj[h], xs, _mm256_loadu_ps(o)));
      }
    }
}

// A packed group against M coded activation rows: out[m * PACK_ROWS + i], sub-block by sub-block,
// 6 rows a pass. Q5_0's and Q4_K's codes cost more to decode than a row's products, so past one
// pass each sub-block is decoded once, into L1, for all of them (Q5_0 at 8 rows, decoded for each
// pass, was 6 % slower than the file's layout row by row).
template <int TYPE>
inline void packed_dot(const uint8_t* w, const XQ& x, int M, float* out) {
  constexpr int BLOCK = packed_block(TYPE), SUBS = format_of(TYPE).block / 32;
  for (int m = 0; m < M; m++) memset(out + m * PACK_ROWS, 0, PACK_ROWS * sizeof(float));
  const bool once = TYPE != Q8_0 && M > 6;
  __m256i decoded[32];
  for (int64_t c = 0; c < x.K / 32 / SUBS; c++) {
    const uint8_t* blk = w + c * BLOCK;
    for (int l = 0; l < BLOCK; l += 64) _mm_prefetch((const char*)blk + prefetch_packed(TYPE) + l, _MM_HINT_T0);
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk)),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)))};
    __m256 minus_dmin[2] = {};
    if constexpr (TYPE == Q4_K)
      for (int h = 0; h < 2; h++)
        minus_dmin[h] = _mm256_sub_ps(_mm256_setzero_ps(),
                                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + q4k_dmin_at(8 * h)))));
    for (int j = 0; j < SUBS; j++) {
      __m256 dj[2] = {d[0], d[1]}, mj[2] = {};  // as group_dot: d times a scale, -dmin times a minimum
      if constexpr (TYPE == Q4_K)
        for (int h = 0; h < 2; h++) {
          dj[h] = _mm256_mul_ps(d[h], q4k_six(blk, j, 0, h));
          mj[h] = _mm256_mul_ps(minus_dmin[h], q4k_six(blk, j, 1, h));
        }
      if (once)
        for (int p = 0; p < 16; p++)
          for (int h = 0; h < 2; h++) decoded[2 * p + h] = packed_half<TYPE>(blk, j, p, h);
      row_blocks<6>(M, [&](auto R, int64_t m0) {
        block_rows<TYPE, decltype(R)::value>(blk, j, once ? decoded : nullptr, dj, mj, x, m0, c * SUBS + j, out);
      });
    }
  }
}

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
