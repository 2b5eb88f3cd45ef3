// The int16 path's dot product of one weight row with AVX-512 (row_dot: see int16_rows.h).
//
// A 32-block's int16 weights fill one register and meet a row's codes in one madd.
// Scales differ per block and row, so each block's int32 sums become float there (no integer
// accumulation across blocks); the scales of G blocks are multiplied for each row at once, so
// per block and row it is madd, convert and an FMA whose scale is a broadcast from memory.
#pragma once

#include "kernels/int_codes.h"
#include "kernels/packed_avx512.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

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
      if constexpr (TYPE == Q6_K) {
        const __m512i lanes =
            _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * i)), _mm256_set1_epi16((short)(2 * i + 1)), 1);
        wv = _mm512_mullo_epi16(wv, _mm512_permutexvar_epi16(lanes, s16));
      }
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

// acc + the products of w's and x's int16 pairs, each pair summed into its 32-bit lane
inline __m512i pair_dot(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The int32 sums, a lane each, of weight pairs r[p0 .. p1) against activation pairs xp[p] (each
// broadcast): in two chains, not one, since each instruction waits on the last's result.
inline __m512i pair_sums(const __m512i* r, const int32_t* xp, int p0, int p1) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int p = p0; p < p1; p += 2) {
    s0 = pair_dot(s0, r[p], _mm512_set1_epi32(xp[p]));
    s1 = pair_dot(s1, r[p + 1], _mm512_set1_epi32(xp[p + 1]));
  }
  return _mm512_add_epi32(s0, s1);
}

// 32-block b's products with 16 weight rows, a lane each (r: their code pairs, transposed or
// packed), for every activation row: out[m * 16 + i] += the integer sums of each half of the
// block (Q6_K's two scales; one half else) times d[h] times the row's scale, then the minima
// times the row's sum where the type has them. group_dot and packed_dot both end here, so with
// the same codes and scales they give the same floats.
template <int HALVES, bool MINS>
inline void meet_block(const __m512i* r, const __m512* d, __m512 mins, const XQ& x, int64_t b, int M, float* out) {
  const int64_t K = x.K, nb32 = K / 32;
  for (int m = 0; m < M; m++) {
    const int32_t* xp = (const int32_t*)(x.q + m * K + b * 32);
    const __m512 xd = _mm512_set1_ps(x.d[m * nb32 + b]);
    __m512 acc = _mm512_loadu_ps(out + m * 16);
    for (int h = 0; h < HALVES; h++) {
      const __m512i s = pair_sums(r, xp, h * 16 / HALVES, (h + 1) * 16 / HALVES);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[h], xd), acc);
    }
    if constexpr (MINS) acc = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.s[m * nb32 + b]), acc);
    _mm512_storeu_ps(out + m * 16, acc);
  }
}

// The packed layouts (gguf_kernels.h) whose kernel here beats the file's layout: all of them.
constexpr bool packs_type(int type) { return packable(type); }

// A packed group (gguf_kernels.h: 16 weight rows, a lane each; TYPE the file's) against M coded
// activation rows: out[m * PACK_ROWS + i]. Each block's codes are read in place, in order, as the
// lanes take them; with VNNI these are group_dot's sums in its order, scaled as it scales them,
// so its floats, without group_dot's decoding, widening and transposing (about 80 shuffles a
// 32-block of 16 rows) and row-by-row scales.
template <int TYPE>
inline void packed_dot(const uint8_t* w, const XQ& x, int M, float* out) {
  constexpr int BLOCK = packed_block(TYPE), SUBS = format_of(TYPE).block / 32, HALVES = TYPE == Q6_K ? 2 : 1;
  for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * PACK_ROWS, _mm512_setzero_ps());
  for (int64_t c = 0; c < x.K / 32 / SUBS; c++) {
    const uint8_t* blk = w + c * BLOCK;
    for (int l = 0; l < BLOCK; l += 64) _mm_prefetch((const char*)blk + prefetch_packed(TYPE) + l, _MM_HINT_T0);
    const PackedScales<TYPE> scales(blk);
    for (int j = 0; j < SUBS; j++) {
      const int64_t b = c * SUBS + j;
      __m512 dj[HALVES], mj;
      scales.of(blk, j, dj, mj);
      __m512i r[16];
      for (int p = 0; p < 16; p++) r[p] = packed_pair<TYPE>(blk, j, p);
      meet_block<HALVES, has_min(TYPE)>(r, dj, mj, x, b, M, out);
    }
  }
}

#ifdef __AVX512VNNI__  // the avx512vnni ISA: group_dot
// Rows of W at a time for group_dot: one lane each.
constexpr int GROUP = 16;
// Activation rows from which a pass takes group_dot (fewer: row_dot, where the transposes cost
// more than they save; default model, Q8_0 LM head: 4 rows 1.15x, 8 rows 1.41x).
constexpr int GROUP_MIN_ROWS = 4;
// Activation rows group_dot takes at once: each block's transpose serves them all.
constexpr int GROUP_ROWS = 64;

// r[i] (16 dwords of weight row i) -> r[p]: dword p of every row, lane i from row i.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; k++) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; k++) {  // u[4k + j], 128-bit lane L: rows 4k..4k+3 of dword 4L + j
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int j = 0; j < 4; j++) {  // the 4 x 4 128-bit lanes of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// GROUP weight rows (from w, rb bytes apart) against M <= GROUP_ROWS coded activation rows:
// out[m * GROUP + i]. row_dot spends a madd, a convert and an FMA per weight row, activation row
// and block (the scales differ per block); here a lane is a weight row, so each block's 16 int16
// pairs are transposed once and met by every activation row in 16 dpwssd, then one convert and
// one FMA scale 16 outputs. Q6_K's halves keep their int8 scales apart (in float): times the
// codes and summed over a block in one lane, they could pass int32.
template <int TYPE>
void group_dot(const uint8_t* w, int64_t rb, const XQ& x, int M, float* out) {
  using B = Blocks<TYPE>;
  constexpr int HALVES = TYPE == Q6_K ? 2 : 1;
  const int64_t nb32 = x.K / 32;
  for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * GROUP, _mm512_setzero_ps());
  W32 wb[GROUP][B::NB];
  // The next group's bytes (contiguous) are prefetched a share per chunk: a lane per row walks 16
  // streams at once, which the hardware prefetcher leaves far below the bandwidth (the LM head
  // ran at half speed), and all at once they overrun the core's outstanding misses.
  const int64_t chunks = nb32 / B::NB, lines = (GROUP * rb + 63) / 64, per = (lines + chunks - 1) / chunks;
  const char* next = (const char*)w + GROUP * rb;
  for (int64_t c = 0; c < chunks; c++) {
    for (int64_t l = c * per; l < (c + 1) * per && l < lines; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    for (int i = 0; i < GROUP; i++) B::decode(w + i * rb, c, wb[i]);
    for (int j = 0; j < B::NB; j++) {
      const int64_t b = c * B::NB + j;
      __m512i r[GROUP];
      alignas(64) float d[HALVES][GROUP], mn[GROUP];
      for (int i = 0; i < GROUP; i++) {
        const W32& wi = wb[i][j];
        r[i] = _mm512_cvtepi8_epi16(wi.q);
        d[0][i] = wi.d * (float)wi.s0;  // s0 = 1 but for Q6_K
        if constexpr (HALVES == 2) d[1][i] = wi.d * (float)wi.s1;
        mn[i] = wi.m;
      }
      transpose16(r);
      __m512 dv[HALVES];
      for (int h = 0; h < HALVES; h++) dv[h] = _mm512_load_ps(d[h]);
      meet_block<HALVES, has_min(TYPE)>(r, dv, _mm512_load_ps(mn), x, b, M, out);
    }
  }
}

// 8-bit activation codes for group_dot8, narrowed in place (code_row): a row's int8 codes in its
// first K bytes, then per 32-block two int32, -128 times the sum of its codes and of its first 16.
inline void narrow_row(int16_t* q, int64_t K) {
  int8_t* c = (int8_t*)q;
  for (int64_t b = 0; b < K / 32; b++)  // block b lands below its own int16 codes: nothing unread is overwritten
    _mm256_storeu_si256((__m256i*)(c + 32 * b), _mm512_cvtepi16_epi8(_mm512_loadu_si512(q + 32 * b)));
  int32_t* neg = (int32_t*)(c + K);
  for (int64_t b = 0; b < K / 32; b++) {
    const __m256i codes = _mm256_loadu_si256((const __m256i*)(c + 32 * b));
    const __m512i pairs = _mm512_madd_epi16(_mm512_cvtepi8_epi16(codes), _mm512_set1_epi16(1));
    neg[2 * b] = -128 * _mm512_reduce_add_epi32(pairs);
    neg[2 * b + 1] = -128 * _mm512_mask_reduce_add_epi32(0x00FF, pairs);
  }
}

// r[i] holds weight row i's 8 dwords in its low half and row i + 8's in its high half -> r[q]:
// lane i the q-th dword (4 codes) of row i.
inline void transpose8_halves(__m512i* r) {
  __m512i t[8], u[8];
  for (int k = 0; k < 4; k++) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; k++) {  // u[4k + j], 128-bit lane L of each half: rows 4k..4k+3 of dword 4L + j
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int j = 0; j < 4; j++) {
    r[j] = _mm512_permutex2var_epi64(u[j], lo, u[4 + j]);
    r[4 + j] = _mm512_permutex2var_epi64(u[j], hi, u[4 + j]);
  }
}

// group_dot with 8-bit activation codes (narrow_row): n <= GROUP weight rows against M <=
// GROUP_ROWS activation rows, out[m * GROUP + i]. A block's weight codes, transposed once as
// int8, meet each activation row in 8 dpbusd of 4 products a lane, where group_dot spends 16
// dpwssd of 2. dpbusd takes its first side unsigned: signed weight codes get +128 (their sign
// bit flipped), and each block's sum starts at -128 times the activation codes' sum, so the
// integer sums are exactly group_dot's on the same codes.
template <int TYPE>
void group_dot8(const uint8_t* w, int64_t rb, int n, const XQ& x, int M, float* out) {
  using B = Blocks<TYPE>;
  constexpr bool SIGNED = !has_min(TYPE);  // Q8_0, Q4_0, Q5_0, Q6_K; the others' codes are nibbles
  constexpr int HALVES = TYPE == Q6_K ? 2 : 1;
  const int64_t K = x.K, nb32 = K / 32;
  for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * GROUP, _mm512_setzero_ps());
  // block b's codes of the 16 rows (r[q]: lane i, dword q of row i), their scales (per half of
  // the block for Q6_K) and minima, against every activation row
  auto meet = [&](__m512i* r, const __m512* d, __m512 mv, int64_t b) {
    transpose8_halves(r);
    if constexpr (SIGNED)
      for (int q = 0; q < 8; q++) r[q] = _mm512_xor_si512(r[q], _mm512_set1_epi8((char)0x80));
    for (int m = 0; m < M; m++) {
      const int8_t* row = (const int8_t*)(x.q + m * K);
      const int32_t* xp = (const int32_t*)(row + b * 32);
      const int32_t* neg = (const int32_t*)(row + K) + 2 * b;
      const __m512 xd = _mm512_set1_ps(x.d[m * nb32 + b]);
      __m512 acc = _mm512_loadu_ps(out + m * GROUP);
      for (int h = 0; h < HALVES; h++) {
        const int32_t start = !SIGNED ? 0 : HALVES == 1 ? neg[0] : h == 0 ? neg[1] : neg[0] - neg[1];
        __m512i s = _mm512_set1_epi32(start);
        for (int q = h * 8 / HALVES; q < (h + 1) * 8 / HALVES; q++)
          s = _mm512_dpbusd_epi32(s, r[q], _mm512_set1_epi32(xp[q]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[h], xd), acc);
      }
      if constexpr (has_min(TYPE)) acc = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.s[m * nb32 + b]), acc);
      _mm512_storeu_ps(out + m * GROUP, acc);
    }
  };
  const int64_t chunks = nb32 / B::NB, lines = (GROUP * rb + 63) / 64, per = (lines + chunks - 1) / chunks;
  const char* next = (const char*)w + GROUP * rb;
  W32 wb[GROUP][B::NB] = {};  // rows past n stay zero
  for (int64_t c = 0; c < chunks; c++) {
    for (int64_t l = c * per; l < (c + 1) * per && l < lines; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    for (int i = 0; i < n; i++) B::decode(w + i * rb, c, wb[i]);
    for (int j = 0; j < B::NB; j++) {
      __m512i r[8];
      for (int i = 0; i < 8; i++) r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(wb[i][j].q), wb[i + 8][j].q, 1);
      alignas(64) float dh[HALVES][GROUP], mn[GROUP];
      for (int i = 0; i < GROUP; i++) {
        const W32& wi = wb[i][j];
        dh[0][i] = wi.d * (float)wi.s0;  // s0 = 1 but for Q6_K
        if constexpr (HALVES == 2) dh[1][i] = wi.d * (float)wi.s1;
        mn[i] = wi.m;
      }
      __m512 d[HALVES];
      for (int h = 0; h < HALVES; h++) d[h] = _mm512_load_ps(dh[h]);
      meet(r, d, _mm512_load_ps(mn), c * B::NB + j);
    }
  }
}

// packed_dot with 8-bit activation codes (narrow_row), for MR activation rows from m0, whose sums
// stay in registers across the blocks: a block's 16 pairs of codes, read as 8 registers of 4
// codes a lane (one permute each: a row's pairs 2q and 2q + 1 lie 32 bytes apart), meet each
// activation row in 8 dpbusd where packed_dot spends 16 dpwssd, signed as group_dot8 does, so the
// integer sums are packed_dot's on the same codes, and so are the floats.
template <int MR>
inline void packed_dot8_rows(const uint8_t* w, const XQ& x, int m0, float* out) {
  const int64_t K = x.K, nb32 = K / 32;
  alignas(64) static constexpr int16_t ORDER[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(ORDER);  // word 2i: pair 2q of row i; word 2i + 1: pair 2q + 1
  __m512 acc[MR];
  for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
  constexpr int BLOCK = packed_block(Q8_0);
  for (int64_t b = 0; b < nb32; b++) {
    const uint8_t* blk = w + b * BLOCK;
    for (int l = 0; l < BLOCK; l += 64) _mm_prefetch((const char*)blk + prefetch_packed(Q8_0) + l, _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    __m512i r[8];
    for (int q = 0; q < 8; q++)
      r[q] = _mm512_xor_si512(_mm512_permutexvar_epi16(order, _mm512_loadu_si512(blk + packed_pairs_at(2 * q))),
                              _mm512_set1_epi8((char)0x80));
    for (int i = 0; i < MR; i++) {
      const int8_t* row = (const int8_t*)(x.q + (m0 + i) * K);
      const int32_t* xp = (const int32_t*)(row + b * 32);
      __m512i s0 = _mm512_set1_epi32(((const int32_t*)(row + K))[2 * b]), s1 = _mm512_setzero_si512();
      for (int q = 0; q < 8; q += 2) {
        s0 = _mm512_dpbusd_epi32(s0, r[q], _mm512_set1_epi32(xp[q]));
        s1 = _mm512_dpbusd_epi32(s1, r[q + 1], _mm512_set1_epi32(xp[q + 1]));
      }
      const __m512 xd = _mm512_set1_ps(x.d[(m0 + i) * nb32 + b]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d, xd), acc[i]);
    }
  }
  for (int i = 0; i < MR; i++) _mm512_storeu_ps(out + (m0 + i) * PACK_ROWS, acc[i]);
}

// A Q8_0_R16 group against M rows of 8-bit codes: out[m * PACK_ROWS + i], 8 rows at a time.
inline void packed_dot8(const uint8_t* w, const XQ& x, int M, float* out) {
  row_blocks<8>(M, [&](auto R, int64_t m0) { packed_dot8_rows<decltype(R)::value>(w, x, (int)m0, out); });
}

#endif  // __AVX512VNNI__

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
