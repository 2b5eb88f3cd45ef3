// Quantized matrix multiply over GGUF (GGML) block formats, CPU.
//
// The same source (kernels_impl.cpp and the headers of kernels/ it includes) is compiled once per
// instruction set (generic, AVX2+FMA+F16C, AVX-512, AVX-512 with VNNI, AVX-512 with AMX's int8 tiles) into its own
// namespace; ops.cpp picks one at run time with __builtin_cpu_supports (and cpuid, for AMX).
// Nothing from the C++ standard library crosses this interface, so no inline function compiled
// for a wider ISA can leak into code that runs on a narrower one.
#pragma once

#include <cstdint>

namespace gmlx_kernels {

// GGML type ids (ggml.h / gguf.constants.GGMLQuantizationType)
enum GGMLType : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

// The block formats this library handles, the one table of their sizes: weights and bytes per
// block, and whether a block has a minimum (y = d * q + m) as well as a scale.
struct BlockFormat {
  int type, block, bytes;
  bool has_min;
};
inline constexpr BlockFormat FORMATS[] = {
    {Q4_0, 32, 18, false},
    {Q4_1, 32, 20, true},
    {Q5_0, 32, 22, false},
    {Q5_1, 32, 24, true},
    {Q8_0, 32, 34, false},
    {Q4_K, 256, 144, true},
    {Q5_K, 256, 176, true},
    {Q6_K, 256, 210, false},
};

// A format at compile time, for the kernels' templates (consteval: no code of it lands in an ISA's
// object); block 0 for a type not in the table.
consteval BlockFormat format_of(int type) {
  for (const BlockFormat& f : FORMATS)
    if (f.type == type) return f;
  return {type, 0, 0, false};
}

// The same at run time (ops.cpp): weights per block and bytes per block; 0 for a type not handled
// (a packed layout has its file type's).
int block_size(int type);
int type_size(int type);

// gmlx's own layouts of Q4_0, Q8_0, Q5_0, Q4_K, Q5_K and Q6_K tensors (no GGML type; ops take each as PACKED + the
// file's type): each PACK_ROWS rows' blocks interleaved, so that a kernel with a lane per weight
// row reads them in order with no transposes. Group g holds the bytes of rows 16 g .. 16 g + 15,
// so row counts and a group's offset are the file type's. Per block of the 16 rows (a 32-block;
// a K-quant's super-block of 256), the same bytes as the file's 16 blocks:
//   Q8_0_R16: 16 f16 scales, then 512 codes in pairs, byte 32 p + 2 i + j holding code 2 p + j
//             of row i;
//   Q5_0_R16: 16 f16 scales, then 16 bytes a pair, byte i holding the low 4 bits of row i's
//             codes 2 p (low nibble) and 2 p + 1 (high), then 4 bytes a pair, bit 2 i + j set
//             where row i's code 2 p + j has its fifth bit clear (its value is the nibble less 16);
//   Q4_0_R16: as Q5_0_R16 without the fifth bits (a code is its nibble less 8);
//   Q4_K_R16: 16 f16 scales d, 16 f16 minimum scales dmin, then per sub-block j (of 32) the 16
//             rows' 6-bit scales and minima (q4k_low_at, q4k_high_at), then per sub-block its 16
//             code pairs as Q5_0_R16's low bits (4-bit codes: no fifth);
//   Q5_K_R16: as Q4_K_R16, but each sub-block's code pairs followed by their fifth bits, 4 bytes
//             a pair, bit 2 i + j set where row i's code 2 p + j has it (the code is the nibble
//             plus 16);
//   Q6_K_R16: 16 f16 scales d, then per sub-block and half of it the 16 rows' int8 scales, then
//             per sub-block its 16 code pairs' low 4 bits as Q5_0_R16's, then their high 2 bits
//             (q6k_high_at); a code is those 6 bits less 32.
inline constexpr int PACKED = 1000;
inline constexpr int Q4_0_R16 = PACKED + Q4_0, Q8_0_R16 = PACKED + Q8_0, Q5_0_R16 = PACKED + Q5_0,
                     Q4_K_R16 = PACKED + Q4_K, Q5_K_R16 = PACKED + Q5_K, Q6_K_R16 = PACKED + Q6_K;
inline constexpr int PACK_ROWS = 16;
constexpr bool packable(int type) {
  return type == Q4_0 || type == Q8_0 || type == Q5_0 || type == Q4_K || type == Q5_K || type == Q6_K;
}
constexpr bool is_packed(int type) { return type > PACKED; }
constexpr int file_type(int type) { return is_packed(type) ? type - PACKED : type; }
// Within a group's 32-block (static: each ISA's object keeps its own copy, see above): row i's
// scale; Q8_0_R16's code pair p of every row (32 bytes, 2 a row) and row i's code c; Q5_0_R16's
// low bits of pair p (16 bytes, 1 a row; Q4_0_R16's codes) and its cleared fifth bits (32, 2 a row).
static constexpr int packed_scale_at(int i) { return 2 * i; }
static constexpr int packed_pairs_at(int p) { return 32 + 32 * p; }
static constexpr int packed_code_at(int i, int c) { return packed_pairs_at(c / 2) + 2 * i + c % 2; }
static constexpr int q5_nibbles_at(int p) { return 32 + 16 * p; }
static constexpr int q5_signs_at(int p) { return 32 + 16 * 16 + 4 * p; }
// Q4_K_R16's 16 rows' 6-bit values of sub-block j (what = 0: scales, 1: minima) as one 64-bit word
// of low 4 bits, row i's at bit 4 (i / 2) + 32 (i % 2), and one 32-bit word of high 2 bits, row
// i's at bit 2 i (a lane per row reads its own with one variable shift); then the codes of
// sub-block j's pair p.
static constexpr int q4k_dmin_at(int i) { return 32 + 2 * i; }
static constexpr int q4k_low_at(int j, int what) { return 64 + 16 * j + 8 * what; }
static constexpr int q4k_high_at(int j, int what) { return 192 + 8 * j + 4 * what; }
static constexpr int q4k_pairs_at(int j, int p) { return 256 + 256 * j + 16 * p; }
// Q5_K_R16's (its scales and minima as Q4_K_R16's): the low 4 bits of sub-block j's code pair p,
// then the pair's fifth bits (32, 2 a row).
static constexpr int q5k_pairs_at(int j, int p) { return 256 + 320 * j + 16 * p; }
static constexpr int q5k_fifth_at(int j, int p) { return 256 + 320 * j + 256 + 4 * p; }
// Q6_K_R16's 16 rows' int8 scales of half h of sub-block j; the low 4 bits of sub-block j's code
// pair p (as Q5_0_R16's); their high 2 bits, one 64-bit word in which the two bits of word w =
// 2 i + c (row i's code 2 p + c) lie at bit 16 (w % 4) + 2 (w / 4): in the 16-bit word w % 4 of
// the word broadcast to every lane, so each word reaches its own with one variable shift.
static constexpr int q6k_scales_at(int j, int h) { return 32 + 32 * j + 16 * h; }
static constexpr int q6k_low_at(int j, int p) { return 288 + 256 * j + 16 * p; }
static constexpr int q6k_high_at(int j, int p) { return 2336 + 128 * j + 8 * p; }
// The low 4 bits of sub-block j's code pair p in a packed block of a file type with 4-bit ones.
static constexpr int packed_nibbles_at(int type, int j, int p) {
  return type == Q4_K ? q4k_pairs_at(j, p) : type == Q5_K ? q5k_pairs_at(j, p) : type == Q6_K ? q6k_low_at(j, p)
                                                                                                  : q5_nibbles_at(p);
}
// Bytes of a group's block in the packed layout of file type TYPE: the file's 16 blocks.
consteval int packed_block(int type) { return PACK_ROWS * format_of(type).bytes; }

// Rows of W dequantized together: the unit of work handed to a thread.
constexpr int ROW_TILE = 16;
// Activation rows the integer path takes in one pass over a slice of weights.
constexpr int INT_ROWS = 8;
// The int16 (AVX2/AVX-512) integer path takes fewer rows than this; more go to the float path
// (OpenBLAS's sgemm, faster from here). AMX's, and AVX-512's with VNNI, take any number.
constexpr int64_t INT16_MAX_ROWS = 64;
// Bytes of scratch per input feature matmul_rows_int needs (AMX: 16 rows' int8 codes and scales).
constexpr int64_t INT_SCRATCH_PER_K = 20;

struct MatmulArgs {
  int type;              // GGML type of W
  const uint8_t* w;      // N rows of row_bytes each (the GGUF tensor's bytes)
  int64_t row_bytes;     // K / block_size * type_size
  const float* x;        // M rows of K floats, row-major, contiguous
  float* y;              // M rows of N floats, row-major
  int64_t M, N, K;
};

struct RopeArgs {
  const float* x;        // (N, L, D) rows, contiguous; N = batch * heads
  float* y;
  int64_t L, D, heads;   // heads: rows of N per batch row (positions are per batch row)
  int dims;              // features rotated (the first dims); the rest pass through
  bool traditional;      // pairs (2i, 2i+1) rather than (i, i + dims/2)
  const float* inv_freq; // dims/2 angular frequencies
  float scale;           // position multiplier
  int64_t offset;        // the position of l = 0, unless offsets is set:
  const int32_t* offsets;
  bool offsets_per_batch;  // offsets[b] for batch row b, else offsets[0] for all
};

struct AttentionArgs {
  const float* q;        // (B, Hq, L, D), contiguous
  const void* k;         // (B, Hkv, T, D) with strides ks over (b, h, t); features contiguous
  const void* v;         // likewise with strides vs
  bool kv_half;          // k and v hold float16 (a KV cache's store), else float32
  float* out;            // (B, Hq, L, D), contiguous
  int64_t B, Hq, Hkv, L, T, D;
  int64_t ks[3], vs[3];
  const void* mask;      // null, bool (attend where true) or float (added to the scores)
  bool mask_bool;
  int64_t ms[4];         // mask strides over (b, h, l, t); 0 where broadcast
  bool causal;           // query l sees keys t <= T - L + l
  float scale;
};

// Activations of a gated MLP: silu(g) * u (llama, qwen, mistral), gelu_approx(g) * u (gemma).
enum GatedAct : int { GATED_SILU = 0, GATED_GELU_APPROX = 1 };

// One ISA's entry points. scratch holds ROW_TILE * K floats.
struct Impl {
  const char* name;
  // y[:, n0:n1] = x @ dequant(W[n0:n1]).T   (n0 a multiple of ROW_TILE)
  void (*matmul_rows)(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch);
  // out[r, :] = dequant(rows[r]) for r < n_rows
  void (*dequant_rows)(int type, const uint8_t* rows, int64_t n_rows, int64_t K, int64_t row_bytes, float* out);
  // Integer path: x coded as int16 per element with one scale per 32 (|code| <= 2^(bits-1) - 1),
  // then integer dot products. Buffers: xq M*K, xd and xs M*K/32, in a layout of the ISA's own,
  // each pass of INT_ROWS rows at (xq, xd, xs) + its first row's offset (row m0 at xq + m0 * K,
  // xd + m0 * K/32); quantize_x codes one pass (a.M <= INT_ROWS rows) at a time.
  // int_supported: this ISA has the path for (type, M). matmul_rows_int takes every row of x,
  // INT_ROWS at a time, with the bits quantize_x was given (the layout may follow them); scratch
  // holds INT_SCRATCH_PER_K * K bytes, 64-byte aligned. The three are null where the ISA has no
  // integer path (generic).
  bool (*int_supported)(int type, int64_t M);
  void (*quantize_x)(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs);
  void (*matmul_rows_int)(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs,
                          int64_t n0, int64_t n1, void* scratch, int bits);
  // The same for a packed weight (a.type PACKED + a packed type; n0, n1 multiples of PACK_ROWS),
  // where packs(its file type), with activations coded by quantize_packed (quantize_x itself
  // where the ISA's packed kernels read its codes; AMX's lay them out for A tiles); all three null
  // where the ISA has no packed kernels (generic).
  bool (*packs)(int type);
  void (*quantize_packed)(const MatmulArgs& a, int bits, int16_t* xq, float* xd, float* xs);
  void (*packed_rows_int)(const MatmulArgs& a, const int16_t* xq, const float* xd, const float* xs, int64_t n0,
                          int64_t n1, void* scratch, int bits);
  // y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w may be null), rows of D floats
  void (*rms_norm_rows)(const float* x, const float* w, float* y, int64_t rows, int64_t D, float eps);
  // h[i] = act(g[i]) * u[i] for i < n; act GATED_SILU or GATED_GELU_APPROX (h may be g)
  void (*gated_act)(const float* g, const float* u, float* h, int64_t n, int act);
  // y[r] = log(sum(exp(x[r]))) over rows of N floats
  void (*logsumexp_rows)(const float* x, float* y, int64_t rows, int64_t N);
  // rows r0..r1 of RoPE; cs holds dims floats
  void (*rope_rows)(const RopeArgs& a, int64_t r0, int64_t r1, float* cs);
  // Query heads h0..h1 of batch row b (one KV head's group) against keys t0..t1 only (decode: a
  // part of split attention): for each of their R = (h1 - h0) * L rows, in order, the maximum m of
  // its scores (scale q k^T + mask) and the sum of e^(score - m) (ml: R pairs), and the values
  // weighted by those e^(score - m) (o: R x D); scores holds R * (t1 - t0) floats
  void (*attend)(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1, float* scores,
                 float* ml, float* o);
  // the same for query rows l0..l1 of head h of batch row b, by tiles of keys (prefill: many
  // rows); work holds attend_rows_work(l1 - l0, D) floats
  void (*attend_rows)(const AttentionArgs& a, int64_t b, int64_t h, int64_t l0, int64_t l1, float* work);
  // Sampling over a row of n logits: the index of the first maximum; w[i] = e^((x[i] - m) k) for
  // every i (w may be null) and their sum; the indices i with x[i] >= t, ascending, and their count
  // (idx must hold n: entries past the count may be written).
  int64_t (*argmax_row)(const float* x, int64_t n);
  float (*exp_sum)(const float* x, int64_t n, float m, float k, float* w);
  int64_t (*gather_ge)(const float* x, int64_t n, float t, int32_t* idx);
};

// Keys per tile and query rows per register block of attend_rows, and the work it needs
// (static: each ISA's object keeps its own copy, see above).
constexpr int64_t ATTN_KEYS = 128;
constexpr int64_t ATTN_MR = 6;
static inline int64_t attend_rows_work(int64_t rows, int64_t D) {
  const int64_t rp = (rows + ATTN_MR - 1) / ATTN_MR * ATTN_MR;
  return rp * (2 * D + ATTN_KEYS + 2) + D * ATTN_KEYS;
}

namespace generic { extern const Impl impl; }
namespace avx2 { extern const Impl impl; }
namespace avx512 { extern const Impl impl; }
namespace avx512vnni { extern const Impl impl; }
namespace amx { extern const Impl impl; }

}  // namespace gmlx_kernels
