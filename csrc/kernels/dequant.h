// Dequantizing GGUF blocks to float: plain loops (the compiler vectorizes them for the ISA the
// file is compiled for), used by the float path, the BLAS panels and embedding lookups.
#pragma once

#include "kernels/dispatch.h"

#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace gmlx_kernels::GMLX_ISA {
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

// The 6-bit scale and minimum of sub-block j of a Q4_K or Q5_K block (12 packed bytes at q).
inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block b of TYPE into y[0 .. format_of(TYPE).block).
template <int TYPE>
inline void deq_block(const uint8_t* b, float* __restrict y);

template <>
inline void deq_block<Q8_0>(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b);
  const int8_t* q = (const int8_t*)(b + 2);
  for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
}

template <>
inline void deq_block<Q4_0>(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
    y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}

template <>
inline void deq_block<Q4_1>(const uint8_t* b, float* __restrict y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; j++) {
    y[j] = d * (float)(qs[j] & 0x0F) + m;
    y[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}

template <>
inline void deq_block<Q5_0>(const uint8_t* b, float* __restrict y) {
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

template <>
inline void deq_block<Q5_1>(const uint8_t* b, float* __restrict y) {
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

template <>
inline void deq_block<Q4_K>(const uint8_t* b, float* __restrict y) {
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

template <>
inline void deq_block<Q5_K>(const uint8_t* b, float* __restrict y) {
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

template <>
inline void deq_block<Q6_K>(const uint8_t* b, float* __restrict y) {
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

template <int TYPE>
inline void deq_row(const uint8_t* row, int64_t K, float* __restrict y) {
  constexpr BlockFormat f = format_of(TYPE);
  const int64_t nb = K / f.block;
  for (int64_t i = 0; i < nb; i++) deq_block<TYPE>(row + i * f.bytes, y + i * f.block);
}

void dequant_row(int type, const uint8_t* row, int64_t K, float* y) {
  with_type(type, [&]<int TYPE>() { deq_row<TYPE>(row, K, y); });
}

void dequant_rows(int type, const uint8_t* rows, int64_t n_rows, int64_t K, int64_t row_bytes, float* out) {
  for (int64_t r = 0; r < n_rows; r++) dequant_row(type, rows + r * row_bytes, K, out + r * K);
}

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
