// The packed layouts' codes and scales with AVX-512 (gguf_kernels.h: 16 weight rows, a lane
// each): read by the int16 path's packed_dot (int16_avx512.h) and by AMX's tiles (int_amx.h).
#pragma once

#include "kernels/int_codes.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

// Code pair p of every row of sub-block j of a packed group's block (gguf_kernels.h), a lane
// each: TYPE is the file's. The 4 low bits of a row's two codes meet in one word each (the byte,
// shifted 12 into the high word, masked); then Q4_0's lose 8, Q5_0's whose fifth bit is clear
// lose 16, Q5_K's whose fifth bit is set gain 16, and Q6_K's take their 2 high bits (one variable
// shift a word) and lose 32.
template <int TYPE>
inline __m512i packed_pair(const uint8_t* blk, int j, int p) {
  if constexpr (TYPE == Q8_0) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(blk + packed_pairs_at(p))));
  } else {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + packed_nibbles_at(TYPE, j, p))));
    const __m512i v = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    if constexpr (TYPE == Q4_K) {
      return v;  // (b | b << 12) & mask above
    } else if constexpr (TYPE == Q4_0) {
      return _mm512_sub_epi16(v, _mm512_set1_epi16(8));
    } else if constexpr (TYPE == Q5_0 || TYPE == Q5_K) {
      __mmask32 fifth;  // these bits: code 2 i + j of the pair
      memcpy(&fifth, blk + (TYPE == Q5_0 ? q5_signs_at(p) : q5k_fifth_at(j, p)), 4);
      return TYPE == Q5_0 ? _mm512_mask_sub_epi16(v, fifth, v, _mm512_set1_epi16(16))
                          : _mm512_mask_add_epi16(v, fifth, v, _mm512_set1_epi16(16));
    } else {
      static_assert(TYPE == Q6_K);
      uint64_t high;
      memcpy(&high, blk + q6k_high_at(j, p), 8);
      const __m512i shift = _mm512_set_epi64(0x000e000e000e000e, 0x000c000c000c000c, 0x000a000a000a000a,
                                             0x0008000800080008, 0x0006000600060006, 0x0004000400040004,
                                             0x0002000200020002, 0);  // word w: 2 (w / 4)
      const __m512i h = _mm512_slli_epi16(_mm512_srlv_epi16(_mm512_set1_epi64((long long)high), shift), 4);
      return _mm512_sub_epi16(_mm512_ternarylogic_epi32(v, h, _mm512_set1_epi16(0x30), 0xF8), _mm512_set1_epi16(32));
    }
  }
}

// Q4_K_R16's 16 rows' 6-bit scales (what = 0) or minima (1) of sub-block j, a lane each, as floats.
inline __m512 q4k_six(const uint8_t* blk, int j, int what) {
  const __m512i low_shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i high_shift = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  uint64_t low;
  uint32_t high;
  memcpy(&low, blk + q4k_low_at(j, what), 8);
  memcpy(&high, blk + q4k_high_at(j, what), 4);
  const __m512i l = _mm512_srlv_epi32(_mm512_set1_epi64((long long)low), low_shift);
  const __m512i h = _mm512_srlv_epi32(_mm512_set1_epi32((int)high), high_shift);
  const __m512i v = _mm512_or_si512(_mm512_and_si512(l, _mm512_set1_epi32(15)),
                                    _mm512_and_si512(_mm512_slli_epi32(h, 4), _mm512_set1_epi32(48)));
  return _mm512_cvtepi32_ps(v);
}

// A packed group's block's scales, a lane per weight row, as group_dot computes them: d (and
// -dmin) once a block, then for sub-block j d times its scale (Q6_K: one for each half) and, for
// Q4_K and Q5_K, -dmin times its minimum.
template <int TYPE>
struct PackedScales {
  static constexpr int HALVES = TYPE == Q6_K ? 2 : 1;
  __m512 d, minus_dmin = _mm512_setzero_ps();
  explicit PackedScales(const uint8_t* blk) : d(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk))) {
    if constexpr (has_min(TYPE))
      minus_dmin = _mm512_sub_ps(minus_dmin,
                                 _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + q4k_dmin_at(0)))));
  }
  void of(const uint8_t* blk, int j, __m512* dj, __m512& mj) const {
    dj[0] = d, mj = minus_dmin;
    if constexpr (has_min(TYPE)) {
      dj[0] = _mm512_mul_ps(d, q4k_six(blk, j, 0));
      mj = _mm512_mul_ps(minus_dmin, q4k_six(blk, j, 1));
    }
    if constexpr (TYPE == Q6_K)
      for (int h = 0; h < 2; h++) {
        const __m128i scale = _mm_loadu_si128((const __m128i*)(blk + q6k_scales_at(j, h)));
        dj[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scale)));
      }
  }
};

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
