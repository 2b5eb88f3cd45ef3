// The kernels of one ISA (compiled once per ISA, see CMakeLists.txt): GMLX_ISA names the
// namespace, the compiler flags decide which of the kernel headers below make it up.
//
//   kernels/dispatch.h     GGML type id -> the kernels' compile-time TYPE (from FORMATS)
//   kernels/dequant.h      blocks -> float (float path, BLAS panels, embeddings)
//   kernels/vec.h          the float vector of each ISA
//   kernels/row_blocks.h   rows in blocks of a compile-time count (register-blocked kernels)
//   kernels/float_path.h   any rows: dequantized tiles and a register-blocked micro-kernel
//   kernels/int_codes.h    integer paths: activation codes, weight blocks as int8 codes
//   kernels/int16_rows.h   AVX2 / AVX-512 (int16_avx2.h, int16_avx512.h): few rows, int16 madd
//   kernels/int_amx.h      AMX: any rows, int8 tiles
//
// Only plain C and intrinsics here: no std:: templates (they are inline and a linker could
// pick this ISA's copy for generic callers); every helper has internal linkage.

#ifndef GMLX_ISA
#error "GMLX_ISA must name the namespace (generic, avx2, avx512, avx512vnni, amx)"
#endif
#ifndef GMLX_LAYERS
#define GMLX_LAYERS GMLX_ISA
#endif

#include "gguf_kernels.h"
#include "kernels/dequant.h"
#include "kernels/float_path.h"

// The integer path of this ISA, if any: each keeps one contract (INT_MAX_ROWS, code_row,
// int_rows<TYPE>) that the three entry points below are written against.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define GMLX_INT_PATH 1
#include "kernels/int_amx.h"
#elif defined(__AVX2__) && defined(__FMA__)
#define GMLX_INT_PATH 1
#include "kernels/int16_rows.h"
#endif

namespace gmlx_kernels {
namespace GMLX_ISA {
namespace {

#ifdef GMLX_INT_PATH
bool int_supported(int type, int64_t M) { return M >= 1 && M < INT_MAX_ROWS && block_size(type) > 0; }

void quantize_x(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs) {
  for (int64_t m = 0; m < a.M; m++) code_row(a, m, bits, xq, xd, xs);
}

void matmul_rows_int(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0, int64_t n1,
                     void* scratch, int bits) {
  with_type(a.type, [&]<int TYPE>() { int_rows<TYPE>(a, xq, xd, xs, n0, n1, scratch, bits); });
}
#endif
#ifdef GMLX_PACKED_PATH
constexpr auto packs_fn = packs;
constexpr auto packed_rows_fn = packed_rows_int;
#ifdef GMLX_PACKED_CODES
void quantize_packed(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs) {
  for (int64_t m = 0; m < a.M; m++) code_row_packed(a, m, bits, xq, xd, xs);
}
constexpr auto quantize_packed_fn = quantize_packed;
#else
constexpr auto quantize_packed_fn = quantize_x;  // the packed kernels read the integer path's codes
#endif
#else
constexpr decltype(Impl::packs) packs_fn = nullptr;
constexpr decltype(Impl::quantize_packed) quantize_packed_fn = nullptr;
constexpr decltype(Impl::packed_rows_int) packed_rows_fn = nullptr;
#endif

}  // namespace
}  // namespace GMLX_ISA

// layers_impl.cpp, compiled for GMLX_LAYERS: this ISA, or for amx avx512's (they use no tiles)
namespace GMLX_LAYERS {
void gated_act(const float* g, const float* u, float* h, int64_t n, int act);
void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps);
void logsumexp_rows(const float* x, float* y, int64_t rows, int64_t N);
void rope_rows(const RopeArgs& a, int64_t r0, int64_t r1, float* cs);
void attend(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1, float* scores,
            float* ml, float* o);
void attend_rows(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work);
int64_t argmax_row(const float* x, int64_t n);
float exp_sum(const float* x, int64_t n, float m, float k, float* w);
int64_t gather_ge(const float* x, int64_t n, float t, int32_t* idx);
}  // namespace GMLX_LAYERS

namespace GMLX_ISA {
#define GMLX_STR2(x) #x
#define GMLX_STR(x) GMLX_STR2(x)
namespace L = GMLX_LAYERS;
const Impl impl = {
    .name = GMLX_STR(GMLX_ISA),
    .matmul_rows = matmul_rows,
    .dequant_rows = dequant_rows,
#ifdef GMLX_INT_PATH
    .int_supported = int_supported,
    .quantize_x = quantize_x,
    .matmul_rows_int = matmul_rows_int,
#else  // no integer path: ops.cpp takes the float path
    .int_supported = nullptr,
    .quantize_x = nullptr,
    .matmul_rows_int = nullptr,
#endif
    .packs = packs_fn,
    .quantize_packed = quantize_packed_fn,
    .packed_rows_int = packed_rows_fn,
    .rms_norm_rows = L::rms_norm_rows,
    .gated_act = L::gated_act,
    .logsumexp_rows = L::logsumexp_rows,
    .rope_rows = L::rope_rows,
    .attend = L::attend,
    .attend_rows = L::attend_rows,
    .argmax_row = L::argmax_row,
    .exp_sum = L::exp_sum,
    .gather_ge = L::gather_ge,
};
}  // namespace GMLX_ISA
}  // namespace gmlx_kernels
