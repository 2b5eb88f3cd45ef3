// MLX primitives and ops over GGUF block weights (CPU).
#pragma once

#include "gguf_kernels.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// The ISA chosen at run time (generic, avx2, avx512).
const Impl* active_impl();
// Use the widest ISA at most `want` that this processor has ("" = the widest); returns its name.
std::string set_isa(const std::string& want);
// Decode path (<= 8 activation rows, AVX2): int8 codes per activation: 2 (default, near float),
// 1 (llama.cpp's Q8_0 activations, fastest), 0 (the float path always).
void set_int8_levels(int levels);
// Prefill (>= 64 rows) through the process's optimized BLAS (OpenBLAS preloaded by gmlx), if any.
// set_blas(false) forces the own float kernel; returns "" when no such BLAS is used.
std::string set_blas(bool on);
std::string blas_name();

// y = x @ dequant(w).T ; x (..., K) any float dtype (computed in float32, returned in x's dtype);
// w uint8 (N, K / block_size * type_size): the GGUF tensor's bytes, row n = output feature n.
mx::array gguf_matmul(const mx::array& x, const mx::array& w, int type, int64_t N, int64_t K,
                      mx::StreamOrDevice s = {});

// rows uint8 (..., row_bytes) -> float32 (..., K): dequantize whole rows (embedding lookup).
mx::array gguf_dequant_rows(const mx::array& rows, int type, int64_t K, mx::StreamOrDevice s = {});

class GGUFMatmul : public mx::Primitive {
 public:
  GGUFMatmul(mx::Stream stream, int type, int64_t N, int64_t K) : mx::Primitive(stream), type_(type), N_(N), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("GGUFMatmul has no GPU implementation");
  }
  const char* name() const override { return "GGUFMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int type_;
  int64_t N_, K_;
};

class GGUFDequantRows : public mx::Primitive {
 public:
  GGUFDequantRows(mx::Stream stream, int type, int64_t K) : mx::Primitive(stream), type_(type), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("GGUFDequantRows has no GPU implementation");
  }
  const char* name() const override { return "GGUFDequantRows"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int type_;
  int64_t K_;
};

}  // namespace gmlx_kernels
