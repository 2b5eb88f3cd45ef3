// The int16 integer path (AVX2, AVX-512): fewer than INT16_MAX_ROWS activation rows (any number
// with VNNI: the avx512vnni ISA), coded as int16 per element with a scale per 32, against each weight row's blocks
// unpacked to int16.
//
// row_dot<TYPE, MC>(w, x, M, out), one per ISA: one weight row against M (<= INT_ROWS) coded
// activation rows; writes out[m] for each m. MC > 0: the row count is the compile-time MC
// (accumulators stay in registers); else M. Blocks are spread over U accumulators per row: a
// single chain would wait out the FMA's latency at every block, and for one or two rows
// (decode) that latency bounds the LM head.
#pragma once

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#include "kernels/int16_avx512.h"
#else
#include "kernels/int16_avx2.h"
#endif

namespace gmlx_kernels::GMLX_ISA {
namespace {

// The integer path's contract with kernels_impl.cpp (int_amx.h keeps it too): the rows it takes,
// each activation row's codes in its layout, and the weight rows n0..n1 against every row of x.
// With VNNI group_dot takes any number: the default model prefilled 128 tokens 1.75x and 512 1.3x
// faster than through OpenBLAS on dequantized panels.
#ifdef __AVX512VNNI__
constexpr int64_t INT_MAX_ROWS = INT64_MAX;
#else
constexpr int64_t INT_MAX_ROWS = INT16_MAX_ROWS;
#endif

inline float code_max(int bits) { return (float)((1 << (bits - 1)) - 1); }

// Row-major: row m's codes at xq + m * K, its scales and sums at xd, xs + m * K/32. With VNNI,
// 8-bit codes are narrowed in place for group_dot8 (int16_avx512.h: narrow_row).
inline void code_row(const MatmulArgs& a, int64_t m, int bits, int16_t* xq, float* xd, float* xs) {
  const int64_t nb = a.K / 32;
  quantize_row(a.x + m * a.K, a.K, code_max(bits), xq + m * a.K, xd + m * nb, xs + m * nb);
#ifdef __AVX512VNNI__
  if (bits == 8) narrow_row(xq + m * a.K, a.K);
#endif
}

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

// Weight rows n0 .. n1 against every activation row: with VNNI, 8-bit codes all through group_dot8
// and 16-bit ones GROUP at a time through group_dot (any number of activation rows, GROUP_ROWS at a
// time), the rest row by row
// (INT_ROWS activation rows a pass: each thread's slice of weights stays in cache for the next).
template <int TYPE>
void int_rows(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
              void*, int bits) {
  const int64_t nb = a.K / 32;
  auto rows = [&](int64_t m0) { return XQ{xq + m0 * a.K, xd + m0 * nb, xs + m0 * nb, a.K}; };
#ifdef __AVX512VNNI__
  if (bits == 8 || a.M >= GROUP_MIN_ROWS) {  // 8-bit codes: every row here, a last group ragged
    float out[GROUP_ROWS * GROUP];
    for (; bits == 8 ? n0 < n1 : n0 + GROUP <= n1; n0 += GROUP) {
      const int n = (int)(n1 - n0 < GROUP ? n1 - n0 : GROUP);
      for (int64_t m0 = 0; m0 < a.M; m0 += GROUP_ROWS) {
        const int mc = (int)(a.M - m0 < GROUP_ROWS ? a.M - m0 : GROUP_ROWS);
        if (bits == 8)
          group_dot8<TYPE>(a.w + n0 * a.row_bytes, a.row_bytes, n, rows(m0), mc, out);
        else
          group_dot<TYPE>(a.w + n0 * a.row_bytes, a.row_bytes, rows(m0), mc, out);
        for (int m = 0; m < mc; m++) memcpy(a.y + (m0 + m) * a.N + n0, out + m * GROUP, n * sizeof(float));
      }
    }
    if (bits == 8) return;
  }
#endif
  for (int64_t m0 = 0; m0 < a.M; m0 += INT_ROWS) {
    MatmulArgs g = a;
    g.M = a.M - m0 < INT_ROWS ? a.M - m0 : INT_ROWS;
    g.y += m0 * a.N;
    rows_int<TYPE>(g, rows(m0), n0, n1);
  }
}

#define GMLX_PACKED_PATH 1
// Activation rows a packed_dot call takes (its out holds PACKED_ROWS * PACK_ROWS floats).
constexpr int PACKED_ROWS = 64;

// Weight rows n0 .. n1 of a packed tensor against every activation row, a group at a time.
// With VNNI, 8-bit codes (narrowed in place, code_row) take packed_dot8 (Q8_0_R16; ops.cpp gives
// the others 16-bit codes).
template <int TYPE>
void packed_rows(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
                 [[maybe_unused]] int bits) {
  const int64_t nb = a.K / 32;
  float out[PACKED_ROWS * PACK_ROWS];
  for (int64_t m0 = 0; m0 < a.M; m0 += PACKED_ROWS) {
    const int mc = (int)(a.M - m0 < PACKED_ROWS ? a.M - m0 : PACKED_ROWS);
    const XQ x{xq + m0 * a.K, xd + m0 * nb, xs + m0 * nb, a.K};
    for (int64_t n = n0; n < n1; n += PACK_ROWS) {
#ifdef __AVX512VNNI__
      if (TYPE == Q8_0 && bits == 8)
        packed_dot8(a.w + n * a.row_bytes, x, mc, out);
      else
#endif
        packed_dot<TYPE>(a.w + n * a.row_bytes, x, mc, out);
      for (int m = 0; m < mc; m++) memcpy(a.y + (m0 + m) * a.N + n, out + m * PACK_ROWS, PACK_ROWS * sizeof(float));
    }
  }
}

bool packs(int type) { return packs_type(type); }

void packed_rows_int(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0,
                     int64_t n1, void*, int bits) {
  with_type(file_type(a.type), [&]<int TYPE>() {
    if constexpr (packs_type(TYPE)) packed_rows<TYPE>(a, xq, xd, xs, n0, n1, bits);
  });
}

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
