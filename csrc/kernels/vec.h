// The float vector the float path's micro-kernel is written in, one section per ISA: VW lanes
// with zero, load, fused multiply-add and a horizontal sum. hsum8 and hmax8 (8 lanes) serve the
// integer paths of AVX2 and AVX-512 too.
#pragma once

#ifndef GMLX_ISA
#error "included from kernels_impl.cpp only, with GMLX_ISA naming the namespace"
#endif

#include <stdint.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

namespace gmlx_kernels::GMLX_ISA {
namespace {

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

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
#endif

namespace gmlx_kernels::GMLX_ISA {
namespace {

#if defined(__AVX512F__)  // ---- AVX-512: 16 lanes ----
constexpr int VW = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }

#elif defined(__AVX2__) && defined(__FMA__)  // ---- AVX2 + FMA: 8 lanes ----
constexpr int VW = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return hsum8(v); }

#else  // ---- generic (SSE2, NEON, ...): 8 floats the compiler vectorizes as it can ----
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

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
