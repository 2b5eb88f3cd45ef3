// The float path: any number of activation rows against dequantized weights.
//
// A thread owns a range of output rows (columns of y). It dequantizes ROW_TILE weight rows at a
// time into a small float buffer (L1/L2 resident), then runs an MR x NR register-blocked
// dot-product micro-kernel over every activation row. Each weight byte is read from memory once
// per call whatever the batch, so decode streams the weights once per step, and prefill does
// MR*NR multiply-adds per load pair (compute-bound).
#pragma once

#include "kernels/dequant.h"
#include "kernels/vec.h"

namespace gmlx_kernels::GMLX_ISA {
namespace {

// y[m, n] = dot(x[m], w[n]) for an MR x NR tile; K is a multiple of 32, so of VW.
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

}  // namespace
}  // namespace gmlx_kernels::GMLX_ISA
