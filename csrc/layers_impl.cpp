// CPU kernels for the transformer ops MLX's CPU backend composes from many small graph
// nodes (RMSNorm, RoPE, attention for a few query rows): each here is one node. Compiled
// once per ISA like kernels_impl.cpp; the loops are written in 8-lane blocks so the
// compiler vectorizes them for the ISA's flags. Plain C maths only (see kernels_impl.cpp).

#include "gguf_kernels.h"

#include <math.h>

#ifndef GMLX_ISA
#error "GMLX_ISA must name the namespace (generic, avx2, avx512)"
#endif

namespace gmlx_kernels {
namespace GMLX_ISA {

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

}  // namespace

void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float inv = 1.f / sqrtf(dot(xr, xr, D) / (float)D + eps);
    if (w)
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv * w[d];
    else
      for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * inv;
  }
}

void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1, float* cs) {
  const int64_t half = a.dims / 2;
  float* c = cs;
  float* s = cs + half;
  int64_t last_pos_row = -1;
  for (int64_t r = r0; r < r1; r++) {
    // row r of (N, L, D): position offset(n) + l, the same for every head of a batch row
    const int64_t n = r / a.L, l = r % a.L;
    const int64_t b = n / a.heads;
    const int64_t pos_row = b * a.L + l;
    if (pos_row != last_pos_row) {
      const float pos = ((float)l + (float)(a.offsets ? a.offsets[a.offsets_per_batch ? b : 0] : a.offset)) * a.scale;
      for (int64_t i = 0; i < half; i++) {
        const float theta = pos * a.inv_freq[i];
        c[i] = cosf(theta);
        s[i] = sinf(theta);
      }
      last_pos_row = pos_row;
    }
    const float* xr = a.x + r * a.D;
    float* yr = a.y + r * a.D;
    if (a.traditional) {
      for (int64_t i = 0; i < half; i++) {
        const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
        yr[2 * i] = x0 * c[i] - x1 * s[i];
        yr[2 * i + 1] = x0 * s[i] + x1 * c[i];
      }
    } else {
      for (int64_t i = 0; i < half; i++) {
        const float x0 = xr[i], x1 = xr[i + half];
        yr[i] = x0 * c[i] - x1 * s[i];
        yr[i + half] = x0 * s[i] + x1 * c[i];
      }
    }
    for (int64_t d = a.dims; d < a.D; d++) yr[d] = xr[d];
  }
}

void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, float* scores) {
  // Query heads h0..h1 share one KV head: each key and value row is read once for all of them.
  const int64_t L = a.L, T = a.T, D = a.D, rows = (h1 - h0) * L;
  const int64_t kvh = h0 / (a.Hq / a.Hkv);
  const float* kb = a.k + b * a.ks[0] + kvh * a.ks[1];
  const float* vb = a.v + b * a.vs[0] + kvh * a.vs[1];
  const float* q = a.q + (b * a.Hq + h0) * L * D;
  float* out = a.out + (b * a.Hq + h0) * L * D;
  const float neg_inf = -INFINITY;
  for (int64_t t = 0; t < T; t++) {
    const float* kt = kb + t * a.ks[2];
    for (int64_t r = 0; r < rows; r++) scores[r * T + t] = dot(q + r * D, kt, D) * a.scale;
  }
  for (int64_t r = 0; r < rows; r++) {
    const int64_t h = h0 + r / L, l = r % L;
    float* sr = scores + r * T;
    if (a.mask) {
      const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2];
      if (a.mask_bool) {
        const uint8_t* m = (const uint8_t*)a.mask + base;
        for (int64_t t = 0; t < T; t++)
          if (!m[t * a.ms[3]]) sr[t] = neg_inf;
      } else {
        const float* m = (const float*)a.mask + base;
        for (int64_t t = 0; t < T; t++) sr[t] += m[t * a.ms[3]];
      }
    }
    if (a.causal)  // the last query row sees every key; row l sees the first T - L + 1 + l
      for (int64_t t = T - L + 1 + l; t < T; t++) sr[t] = neg_inf;
    float mx = neg_inf;
    for (int64_t t = 0; t < T; t++) mx = sr[t] > mx ? sr[t] : mx;
    float sum = 0.f;
    if (mx == neg_inf) {  // nothing to attend to (a padding row): zeros, not NaN
      for (int64_t t = 0; t < T; t++) sr[t] = 0.f;
    } else {
      for (int64_t t = 0; t < T; t++) {
        sr[t] = expf(sr[t] - mx);
        sum += sr[t];
      }
      const float inv = 1.f / sum;
      for (int64_t t = 0; t < T; t++) sr[t] *= inv;
    }
    float* o = out + r * D;
    for (int64_t d = 0; d < D; d++) o[d] = 0.f;
  }
  for (int64_t t = 0; t < T; t++) {
    const float* vt = vb + t * a.vs[2];
    for (int64_t r = 0; r < rows; r++) {
      const float p = scores[r * T + t];
      if (p != 0.f) axpy(out + r * D, p, vt, D);
    }
  }
}

}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
