// The integer path with AMX (Intel Sapphire Rapids on): any number of activation rows, as int8
// tile products.
//
// One tile product takes 16 weight rows' codes of one scale block (A: 16 x S int8; S = 32, or
// 16 for Q6_K's sub-blocks) against up to 8 activation rows (B), each 16-bit code given as two
// int8 halves, code = 256 hi + lo: C (16 x 2Mp int32) holds each weight row's Mp high and Mp
// low sums, so the activations keep the int16 path's precision at int8 speed. Scales differ
// per block, so each block's C is stored and scaled in float: a few vector instructions per 16
// outputs, where the int16 path spends three per output and block. Q8_0's A tiles are the
// file's bytes read in place (stride: the row); other types are unpacked to int8 first. The
// packed layouts (gguf_kernels.h) take the roles the other way round (rows_amx_packed): their
// code pairs, a lane per weight row, are B tiles after a narrowing and a permute.
#pragma once

#include "kernels/int_codes.h"
#include "kernels/packed_avx512.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

// |code| <= 32639 keeps hi = (code + 128) >> 8 within int8 (and lo = code - 256 hi in [-128, 127])
constexpr float AMX_QMAX16 = 32639.f;
static_assert(INT_ROWS <= 8, "a C tile holds 8 rows' hi and lo sums (64 bytes a row)");

// The integer path's contract with kernels_impl.cpp (as int16_rows.h): every row count; the
// largest code for `bits`; each activation row's codes in the tiles' layout.
constexpr int64_t INT_MAX_ROWS = INT64_MAX;

inline float code_max(int bits) { return bits == 8 ? 127.f : AMX_QMAX16; }

// A 32-block of x coded (quantize_row: its scale to d, its codes' sum to s), each code as two
// int8 halves: code = 256 hi + lo.
[[gnu::always_inline]] inline void code_halves(const float* x, float qmax, float* d, float* s, __m256i& hi,
                                               __m256i& lo) {
  alignas(64) int16_t c[32];
  quantize_row(x, 32, qmax, c, d, s);
  const __m512i v = _mm512_load_si512(c);
  const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(v, _mm512_set1_epi16(128)), 8);
  hi = _mm512_cvtepi16_epi8(h);
  lo = _mm512_cvtepi16_epi8(_mm512_sub_epi16(v, _mm512_slli_epi16(h, 8)));
}

// Row i of one pass of mp = a.M <= INT_ROWS activation rows (mp * K int16 worth of bytes at xq):
// per 32-block b, the 8 rows of its B tile, row r holding the mp rows' hi bytes of codes
// 4r..4r+3, then their lo bytes (the tile's dword columns: mp hi sums, then mp lo). xd and xs: [b][m].
inline void code_row(const MatmulArgs& a, int64_t i, int bits, int16_t* xq, float* xd, float* xs) {
  const int64_t K = a.K, nb = K / 32, mp = a.M;
  uint8_t* dst = (uint8_t*)xq;
  for (int64_t b = 0; b < nb; b++) {
    __m256i hi, lo;
    code_halves(a.x + i * K + b * 32, code_max(bits), xd + b * mp + i, xs + b * mp + i, hi, lo);
    alignas(32) uint8_t h[32], l[32];
    _mm256_store_si256((__m256i*)h, hi);
    _mm256_store_si256((__m256i*)l, lo);
    uint8_t* blk = dst + b * 64 * mp;
    for (int r = 0; r < 8; r++) {
      memcpy(blk + r * 8 * mp + 4 * i, h + 4 * r, 4);
      memcpy(blk + r * 8 * mp + 4 * (mp + i), l + 4 * r, 4);
    }
  }
}

// The same codes for the packed path's A tiles (rows_amx_packed): per 32-block b, the mp rows'
// hi bytes of their 32 codes, 32 bytes a row, then their lo bytes.
inline void code_row_packed(const MatmulArgs& a, int64_t i, int bits, int16_t* xq, float* xd, float* xs) {
  const int64_t K = a.K, nb = K / 32, mp = a.M;
  uint8_t* dst = (uint8_t*)xq;
  for (int64_t b = 0; b < nb; b++) {
    __m256i hi, lo;
    code_halves(a.x + i * K + b * 32, code_max(bits), xd + b * mp + i, xs + b * mp + i, hi, lo);
    uint8_t* blk = dst + b * 64 * mp;
    _mm256_storeu_si256((__m256i*)(blk + 32 * i), hi);
    _mm256_storeu_si256((__m256i*)(blk + 32 * (mp + i)), lo);
  }
}

// The ns sub-blocks' tile products of one pass, software-pipelined: sub-block t + 1's tiles are
// in flight while t's C is scaled by post(t, C). GMLX_TILE_STEP(A, B, C, t, out), which each path
// defines for its own operands, runs sub-block t's product in tiles A, B, C (even sub-blocks 0-2,
// odd 3-5) and stores C to out, one of the two buffers of cbuf. A macro, as the tile numbers must
// be literals (GCC's tile intrinsics paste them into the assembly); a function taking the steps
// as lambdas made the tiles 3-5 % slower at 512 rows.
#define GMLX_TILE_PIPELINE(ns, cbuf, post)                         \
  do {                                                             \
    GMLX_TILE_STEP(0, 1, 2, 0, cbuf[0]);                           \
    for (int64_t t = 0; t < (ns); t += 2) {                        \
      if (t + 1 < (ns)) GMLX_TILE_STEP(3, 4, 5, t + 1, cbuf[1]);   \
      post(t, cbuf[0]);                                            \
      if (t + 1 < (ns)) {                                          \
        if (t + 2 < (ns)) GMLX_TILE_STEP(0, 1, 2, t + 2, cbuf[0]); \
        post(t + 1, cbuf[1]);                                      \
      }                                                            \
    }                                                              \
  } while (0)

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-2 as the A, B and C of one product and 3-5 the same (the odd sub-blocks'), each given
// as rows and bytes a row.
inline void configure_tiles(int a_rows, int a_bytes, int b_rows, int b_bytes, int c_rows, int c_bytes) {
  TileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 6; t += 3) {
    cfg.rows[t] = (uint8_t)a_rows, cfg.colsb[t] = (uint16_t)a_bytes;
    cfg.rows[t + 1] = (uint8_t)b_rows, cfg.colsb[t + 1] = (uint16_t)b_bytes;
    cfg.rows[t + 2] = (uint8_t)c_rows, cfg.colsb[t + 2] = (uint16_t)c_bytes;
  }
  // GCC's ldtilecfg does not tell the compiler it reads cfg: without this its stores may go
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

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
        const __m512i sc[4] = {_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24),
                               _mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24),
                               _mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24), _mm512_srai_epi32(v, 24)};
        for (int j = 0; j < 4; j++)
          _mm512_store_ps(wd + 16 * (16 * c + 4 * q + j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc[j])));
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
  auto configure = [&](int rows) {
    mp = rows;
    configure_tiles(16, S, S / 4, 8 * mp, 16, 8 * mp);
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
      auto asrc = [&](int64_t t) -> const void* {
        return in_place ? (const void*)(w + t * Blocks<Q8_0>::TS + 2) : codes + t * S;
      };
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
          const __m512 wdj = _mm512_permutexvar_ps(pair[j], wdv);
          acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), xdv), wdj, acc[j]);
          if constexpr (MIN)
            acc[j] = _mm512_fmadd_ps(xsv, _mm512_permutexvar_ps(pair[j], _mm512_load_ps(wm + 16 * b)), acc[j]);
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
      GMLX_TILE_PIPELINE(ns, cbuf, post);
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

// A packed group's codes (gguf_kernels.h; TYPE the file's) as B tiles: per 32-block b, 8 rows of
// 64 bytes, row q holding each weight row's codes 4q .. 4q + 3 (the tiles' dword columns: a
// weight row each), so two of the layout's code pairs make a row in a narrowing and a permute;
// and the scales, wd[t][i] per sub-block t of S codes and wm[b][i] (types with a minimum).
template <int TYPE>
void packed_tiles(const uint8_t* w, int64_t K, int8_t* codes, float* wd, float* wm) {
  constexpr int BLOCK = packed_block(TYPE), SUBS = format_of(TYPE).block / 32, HALVES = TYPE == Q6_K ? 2 : 1;
  alignas(64) int16_t order[32];  // word 2i: row i's first pair, 2i + 1: its second
  for (int i = 0; i < 16; i++) order[2 * i] = (int16_t)i, order[2 * i + 1] = (int16_t)(16 + i);
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t c = 0; c < K / 32 / SUBS; c++) {
    const uint8_t* blk = w + c * BLOCK;
    const PackedScales<TYPE> scales(blk);
    for (int j = 0; j < SUBS; j++) {
      const int64_t b = c * SUBS + j;
      __m512 dj[HALVES], mj;
      scales.of(blk, j, dj, mj);
      for (int h = 0; h < HALVES; h++) _mm512_store_ps(wd + 16 * (HALVES * b + h), dj[h]);
      if constexpr (has_min(TYPE)) _mm512_store_ps(wm + 16 * b, mj);
      for (int q = 0; q < 8; q++) {
        const __m256i p0 = _mm512_cvtepi16_epi8(packed_pair<TYPE>(blk, j, 2 * q));
        const __m256i p1 = _mm512_cvtepi16_epi8(packed_pair<TYPE>(blk, j, 2 * q + 1));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(p0), p1, 1);
        _mm512_store_si512(codes + b * 512 + 64 * q, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
}

// y[:, n0:n1] for every row of x (xq as code_row_packed laid it out) of a packed weight: as
// rows_amx with the roles swapped, so the layout's code pairs need no transpose: each group's
// codes are B tiles (packed_tiles) and each pass's activations A tiles of 2 mp rows (hi, then lo),
// so a C row holds one activation row's sums, a lane per weight row, scaled without a permute.
template <int TYPE>
void rows_amx_packed(const MatmulArgs& a, const uint8_t* xq, const float* xd, const float* xs, int64_t n0,
                     int64_t n1, void* scratch) {
  constexpr int S = TYPE == Q6_K ? 16 : 32;  // codes per scale
  constexpr bool MIN = has_min(TYPE);
  const int64_t K = a.K, ns = K / S;
  int8_t* codes = (int8_t*)scratch;      // 16 x K
  float* wd = (float*)(codes + 16 * K);  // 16 x ns
  float* wm = wd + 16 * ns;              // 16 x K / 32, types with a minimum
  alignas(64) int32_t cbuf[2][16 * 16];  // C of the even and odd sub-block
  int mp = 0;
  for (int64_t n = n0; n < n1; n += PACK_ROWS) {
    packed_tiles<TYPE>(a.w + n * a.row_bytes, K, codes, wd, wm);
    asm volatile("" : : : "memory");  // the codes written before the tile loads (which GCC does not see read)
    for (int64_t m0 = 0; m0 < a.M; m0 += INT_ROWS) {
      if (const int rows = a.M - m0 < INT_ROWS ? (int)(a.M - m0) : INT_ROWS; rows != mp) {
        mp = rows;
        configure_tiles(2 * mp, S, S / 4, 64, 2 * mp, 64);
      }
      const uint8_t* xb = xq + 2 * m0 * K;  // this pass's A tiles
      const float* pd = xd + m0 * (K / 32);
      const float* ps = xs + m0 * (K / 32);
      __m512 acc[INT_ROWS];
      for (int m = 0; m < INT_ROWS; m++) acc[m] = _mm512_setzero_ps();
      auto post = [&](int64_t t, const int32_t* c) {
        const int64_t b = t * S / 32;  // the activations' 32-block
        const __m512 wdv = _mm512_load_ps(wd + 16 * t);
        for (int m = 0; m < mp; m++) {
          const __m512i hi = _mm512_load_si512(c + 16 * m), lo = _mm512_load_si512(c + 16 * (mp + m));
          const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
          acc[m] = _mm512_fmadd_ps(v, _mm512_mul_ps(wdv, _mm512_set1_ps(pd[b * mp + m])), acc[m]);
          if constexpr (MIN)
            acc[m] = _mm512_fmadd_ps(_mm512_load_ps(wm + 16 * b), _mm512_set1_ps(ps[b * mp + m]), acc[m]);
        }
      };
#define GMLX_TILE_STEP(A, B, C, t, out)                                   \
  do {                                                                    \
    _tile_loadd(A, xb + (t) * S / 32 * 64 * mp + (t) * S % 32, 32);       \
    _tile_loadd(B, codes + (t) * S * 16, 64);                             \
    _tile_zero(C);                                                        \
    _tile_dpbssd(C, A, B);                                                \
    _tile_stored(C, out, 64);                                             \
  } while (0)
      GMLX_TILE_PIPELINE(ns, cbuf, post);
#undef GMLX_TILE_STEP
      for (int m = 0; m < mp; m++) _mm512_storeu_ps(a.y + (m0 + m) * a.N + n, acc[m]);
    }
  }
  _tile_release();
}

// The contract's weight rows n0..n1 against every row of x (xq as code_row laid it out).
template <int TYPE>
void int_rows(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
              void* scratch, int) {
  rows_amx<TYPE>(a, (const uint8_t*)xq, xd, xs, n0, n1, scratch);
}

#define GMLX_PACKED_PATH 1
#define GMLX_PACKED_CODES 1  // code_row_packed: the packed path's activations in a layout of their own
// The packed layouts: every one, read as B tiles (ops.cpp gives few rows VNNI's packed kernels).
bool packs(int type) { return packable(type); }

void packed_rows_int(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0,
                     int64_t n1, void* scratch, int) {
  with_type(file_type(a.type), [&]<int TYPE>() {
    if constexpr (packable(TYPE)) rows_amx_packed<TYPE>(a, (const uint8_t*)xq, xd, xs, n0, n1, scratch);
  });
}

#undef GMLX_TILE_PIPELINE

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
