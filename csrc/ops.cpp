// MLX primitives over GGUF block weights: GGUFMatmul (x @ W.T) and GGUFDequantRows.
#include "ops.h"
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(GMLX_HAVE_AMX) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "mlx/backend/cpu/encoder.h"
#include "mlx/allocator.h"
#include "mlx/scheduler.h"
#include "mlx/transforms.h"

namespace gmlx_kernels {

// The file's format of a type or packed layout; null for one not handled.
static const BlockFormat* format(int type) {
  if (is_packed(type) && !packable(file_type(type))) return nullptr;
  for (const BlockFormat& f : FORMATS)
    if (f.type == file_type(type)) return &f;
  return nullptr;
}

int block_size(int type) { return format(type) ? format(type)->block : 0; }

int type_size(int type) { return format(type) ? format(type)->bytes : 0; }

namespace {

// AMX's int8 tiles: the CPU has them (cpuid) and Linux lets this process use them (a kernel
// before 5.16, or a hypervisor that hides them, refuses the request). Granted, every signal
// frame of the process grows by the tiles' 8 KB state, whichever ISA runs after.
bool amx_usable() {
#if defined(GMLX_HAVE_AMX) && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

const Impl* choose_impl(std::string want) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  // the widest ISA up to the one wanted ('' the best; an unknown name: generic)
  [[maybe_unused]] const int up_to = want.empty() || want == "amx" ? 4
                                     : want == "avx512vnni"         ? 3
                                     : want == "avx512"             ? 2
                                     : want == "avx2"               ? 1
                                                                    : 0;
#ifdef GMLX_HAVE_AMX
  if (up_to >= 4 && has512 && amx_usable()) return &amx::impl;
#endif
#ifdef GMLX_HAVE_AVX512VNNI
  if (up_to >= 3 && has512 && __builtin_cpu_supports("avx512vnni")) return &avx512vnni::impl;
#endif
#ifdef GMLX_HAVE_AVX512
  if (up_to >= 2 && has512) return &avx512::impl;
#endif
#ifdef GMLX_HAVE_AVX2
  if (up_to >= 1 && has2) return &avx2::impl;
#endif
#endif
  return &generic::impl;
}

// Activation rows from which AMX's tiles multiply a packed weight of a file type faster than
// AVX-512 VNNI's packed kernels (Q6_K's tiles take 16 codes, not 32; docs/ARCHITECTURE.md,
// decision 36).
constexpr int64_t amx_packed_rows(int type) { return type == Q6_K ? 128 : 16; }

// The kernels that multiply a call's packed weights: `impl`'s, but where AMX runs, AVX-512 VNNI's
// (every CPU with AMX has it) for fewer rows than any of the weights takes to the tiles.
const Impl* packing_impl(const Impl* impl, const MatmulArgs* parts, int n_parts) {
#if defined(GMLX_HAVE_AMX) && defined(GMLX_HAVE_AVX512VNNI)
  if (impl == &amx::impl && __builtin_cpu_supports("avx512vnni")) {
    int64_t tiles_from = INT64_MAX;
    for (int i = 0; i < n_parts; i++)
      if (is_packed(parts[i].type)) tiles_from = std::min(tiles_from, amx_packed_rows(file_type(parts[i].type)));
    if (parts[0].M < tiles_from) return &avx512vnni::impl;
  }
#endif
  return impl;
}

thread_local Scratch<float> tl_scratch;

float* scratch(size_t n) { return tl_scratch.get(n); }

thread_local Scratch<int16_t> tl_xq;
thread_local Scratch<float> tl_xd;
thread_local Scratch<float> tl_xs;

// Prefill through an optimized BLAS already in the process (gmlx preloads OpenBLAS with
// RTLD_GLOBAL on Linux): dequantize a panel of weight rows to float, then one sgemm. Only a
// BLAS known to be fast is used; MLX's bundled reference BLAS is not.
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
// Fewer rows go the int16 way (run_matmuls): up to 64 it was as fast or faster (default model,
// AVX-512, prefill: 48 rows 1.15x, 64 the same, 80 0.95x); AMX's integer path, and AVX-512's
// with VNNI, beat it at every prompt length (512 tokens: 1.3x both).
constexpr int64_t BLAS_MIN_ROWS = INT16_MAX_ROWS;
constexpr int64_t BLAS_PANEL = 256;

sgemm_fn find_sgemm() {
#if defined(__unix__) || defined(__APPLE__)
  if (const char* s = std::getenv("GMLX_KERNELS_BLAS"); s && std::string(s) == "0") return nullptr;
  void* f = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  Dl_info info;
  if (!f || !dladdr(f, &info) || !info.dli_fname) return nullptr;
  const std::string lib = info.dli_fname;
  for (const char* fast : {"openblas", "mkl", "blis", "Accelerate"})
    if (lib.find(fast) != std::string::npos) return (sgemm_fn)f;
#endif
  return nullptr;
}

std::atomic<int> g_blas{-1};  // -1: not looked up yet

sgemm_fn blas_sgemm() {
  static sgemm_fn f = find_sgemm();
  return g_blas.load(std::memory_order_relaxed) == 0 ? nullptr : f;
}

thread_local Scratch<float> tl_panel;

bool run_blas(const MatmulArgs& a) {
  sgemm_fn sgemm = blas_sgemm();
  if (!sgemm || a.M < BLAS_MIN_ROWS || a.K > (1 << 30) / BLAS_PANEL) return false;
  const Impl* impl = active_impl();
  float* panel = tl_panel.get((size_t)(BLAS_PANEL * a.K));
  for (int64_t n0 = 0; n0 < a.N; n0 += BLAS_PANEL) {
    const int64_t rows = std::min<int64_t>(BLAS_PANEL, a.N - n0);
    impl->dequant_rows(a.type, a.w + n0 * a.row_bytes, rows, a.K, a.row_bytes, panel);
    // y[:, n0:n0+rows] = x (M x K) @ panel.T (K x rows); CblasRowMajor=101, NoTrans=111, Trans=112
    sgemm(101, 111, 112, (int)a.M, (int)rows, (int)a.K, 1.f, a.x, (int)a.K, panel, (int)a.K, 0.f, a.y + n0, (int)a.N);
  }
  return true;
}

void run_float(const MatmulArgs& a) {
  const Impl* impl = active_impl();
  if (run_blas(a)) return;
  const int64_t tiles = (a.N + ROW_TILE - 1) / ROW_TILE;
  // Work per call below a few hundred thousand multiply-adds is not worth waking threads for.
  int nt = (int)std::min<int64_t>(n_threads(), tiles);
  if (a.M * a.N * a.K < (int64_t)1 << 18) nt = 1;
  const int64_t chunk = std::max<int64_t>(1, tiles / (8 * nt));  // tiles per chunk
  parallel_chunks(nt, (tiles + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t n0 = c * chunk * ROW_TILE, n1 = std::min<int64_t>((c + 1) * chunk * ROW_TILE, a.N);
    impl->matmul_rows(a, n0, n1, scratch((size_t)ROW_TILE * a.K));
  });
}

// Weights that multiply one x (q, k and v; gate and up): on the integer path x is coded once
// and one parallel region covers every weight's rows, each thread taking all of x's rows
// INT_ROWS at a time against its slice of weights, which stays in cache across the passes.
// AVX2/AVX-512 take fewer than INT16_MAX_ROWS rows this way (prompts of 9 to 63 tokens went
// 1.4x to 1.7x slower through the float kernel's dequantized tiles); AMX and AVX-512 with VNNI
// take every prompt.
void run_matmuls_on(const Impl* impl, const MatmulArgs* parts, int n_parts) {
  const MatmulArgs& a = parts[0];
  // A packed weight has the integer path only (check_weight saw to it that this ISA has its
  // kernel), at 16 bits where the float path was asked for, and where 8 were but the layout has
  // no kernel for them (all but Q8_0_R16).
  bool packed = false, wide = false;
  for (int i = 0; i < n_parts; i++) {
    packed = packed || is_packed(parts[i].type);
    wide = wide || (is_packed(parts[i].type) && parts[i].type != Q8_0_R16);
  }
  const int bits = packed && (act_bits() == 0 || wide) ? 16 : act_bits();
  bool integer = packed || (bits > 0 && impl->int_supported);  // null: this ISA has no integer path
  for (int i = 0; i < n_parts && !packed; i++) integer = integer && impl->int_supported(parts[i].type, a.M);
  if (!integer) {
    for (int i = 0; i < n_parts; i++) run_float(parts[i]);
    return;
  }
  const size_t nq = (size_t)(a.M * a.K), nb = nq / 32;
  int16_t* xq = tl_xq.get(nq);
  float* xd = tl_xd.get(nb);
  float* xs = tl_xs.get(nb);
  const int64_t nb_row = a.K / 32, passes = (a.M + INT_ROWS - 1) / INT_ROWS;
  const int coders = a.M * a.K < (int64_t)1 << 16 ? 1 : n_threads();  // a prompt's rows coded in parallel
  // a call of packed and file weights has one coding for both (run_matmuls splits it otherwise)
  const auto quantize = packed ? impl->quantize_packed : impl->quantize_x;
  parallel_chunks(coders, passes, [&](int64_t p) {
    MatmulArgs rows = a;
    rows.x += p * INT_ROWS * a.K;
    rows.M = std::min<int64_t>(INT_ROWS, a.M - p * INT_ROWS);
    quantize(rows, bits, xq + p * INT_ROWS * a.K, xd + p * INT_ROWS * nb_row, xs + p * INT_ROWS * nb_row);
  });
  int64_t rows = 0;
  for (int i = 0; i < n_parts; i++) rows += parts[i].N;
  int nt = (int)std::min<int64_t>(n_threads(), rows / 64 + 1);
  if (a.M * rows * a.K < (int64_t)1 << 18) nt = 1;
  const int64_t chunk = (std::max<int64_t>(16, rows / (8 * nt)) + 15) / 16 * 16;  // whole 16-row groups (AMX)
  struct Chunk { int part; int64_t n0, n1; };
  std::vector<Chunk> chunks;
  for (int i = 0; i < n_parts; i++)
    for (int64_t n0 = 0; n0 < parts[i].N; n0 += chunk) chunks.push_back({i, n0, std::min(n0 + chunk, parts[i].N)});
  const size_t scratch_floats = (size_t)(INT_SCRATCH_PER_K * a.K + 64) / sizeof(float);
  parallel_chunks(nt, (int64_t)chunks.size(), [&](int64_t c) {
    void* aligned = (void*)(((uintptr_t)scratch(scratch_floats) + 63) & ~(uintptr_t)63);
    const Chunk& ch = chunks[c];
    if (is_packed(parts[ch.part].type))
      impl->packed_rows_int(parts[ch.part], xq, xd, xs, ch.n0, ch.n1, aligned, bits);
    else
      impl->matmul_rows_int(parts[ch.part], xq, xd, xs, ch.n0, ch.n1, aligned, bits);
  });
}

// The weights' own kernels: the active ISA's, packed ones packing_impl's. A call of both kinds is
// split where they code the activations apart (AMX's two layouts, or AMX's and VNNI's).
void run_matmuls(const MatmulArgs* parts, int n_parts) {
  const Impl* impl = active_impl();
  const Impl* packer = packing_impl(impl, parts, n_parts);
  int n_packed = 0;
  for (int i = 0; i < n_parts; i++) n_packed += is_packed(parts[i].type);
  if (n_packed == 0) return run_matmuls_on(impl, parts, n_parts);
  if (n_packed == n_parts || (packer == impl && impl->quantize_packed == impl->quantize_x))
    return run_matmuls_on(packer, parts, n_parts);
  std::vector<MatmulArgs> packed, file;
  for (int i = 0; i < n_parts; i++) (is_packed(parts[i].type) ? packed : file).push_back(parts[i]);
  run_matmuls_on(packer, packed.data(), (int)packed.size());
  run_matmuls_on(impl, file.data(), (int)file.size());
}

void check_type(int type) {
  if (block_size(type) == 0) {
    std::ostringstream msg;
    msg << "gguf kernels: GGML type " << type << " is not supported";
    throw std::invalid_argument(msg.str());
  }
}

}  // namespace

std::atomic<int64_t> g_scratch_bytes{0}, g_scratch_used_bytes{0};
std::atomic<uint64_t> g_scratch_generation{0};

void release_scratch(const std::vector<mx::Stream>& streams) {
  auto on = streams;
  if (on.empty())
    if (const auto s = mx::peek_default_stream(mx::Device::cpu)) on.push_back(*s);
  for (const mx::Stream& s : on)
    if (s.device != mx::Device::cpu) throw std::invalid_argument("release_scratch: the streams must be CPU streams");
  g_scratch_generation.fetch_add(1, std::memory_order_relaxed);
  g_scratch_used_bytes.store(0, std::memory_order_relaxed);
  // Where the threads go idle next (a prompt answered in its prefill, an embedding batch), no
  // kernel's next call would free them until the next prompt.
  drop_released_buffers();
  for (const mx::Stream& s : on) mx::scheduler::enqueue(s, [] { drop_released_buffers(); });  // behind its kernels
  drop_released_in_workers();
}

std::atomic<const Impl*> g_impl{nullptr};

const Impl* active_impl() {
  const Impl* impl = g_impl.load(std::memory_order_acquire);
  if (!impl) {
    const char* force = std::getenv("GMLX_KERNELS_ISA");  // generic, avx2, avx512, avx512vnni, amx
    impl = choose_impl(force ? force : "");
    g_impl.store(impl, std::memory_order_release);
  }
  return impl;
}

std::string set_blas(bool on) {
  g_blas.store(on ? 1 : 0);
  return blas_sgemm() ? "cblas_sgemm" : "";
}

std::string blas_name() {
#if defined(__unix__) || defined(__APPLE__)
  Dl_info info;
  if (sgemm_fn f = blas_sgemm(); f && dladdr((void*)f, &info) && info.dli_fname) return info.dli_fname;
#endif
  return "";
}

// Bits of the decode path's integer activation codes: 16 (default, rounding ~1/65534 of each
// 32-block's max), 8 (llama.cpp's Q8_0 activations: ~1/254), 0 (float path only).
std::atomic<int> g_bits{-1};
int act_bits() {
  int v = g_bits.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* s = std::getenv("GMLX_KERNELS_ACT_BITS");
    v = s ? std::atoi(s) : 16;
    if (v != 0 && v != 8) v = 16;
    g_bits.store(v);
  }
  return v;
}

void set_act_bits(int bits) {
  if (bits != 0 && bits != 8 && bits != 16) throw std::invalid_argument("activation bits must be 16, 8 or 0");
  g_bits.store(bits);
}

std::string set_isa(const std::string& want) {
  const Impl* impl = choose_impl(want);
  g_impl.store(impl, std::memory_order_release);
  return impl->name;
}

namespace mx = mlx::core;

thread_local Scratch<float> tl_x;

mx::cpu::CommandEncoder& CPUPrimitive::prepare(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                               const std::vector<int>& donors) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) encoder.set_input_array(in);
  for (size_t i = 0; i < outputs.size(); i++) {
    auto& out = outputs[i];
    const mx::array* in = i < donors.size() ? &inputs[donors[i]] : nullptr;
    if (in && in->is_donatable() && in->flags().row_contiguous && in->dtype() == out.dtype() &&
        in->nbytes() == out.nbytes())
      out.copy_shared_buffer(*in);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  return encoder;
}

void GGUFMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  mx::array& out = outputs[0];
  auto& encoder = prepare(inputs, outputs);
  const int64_t M = x.size() / K_;
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                    out = mx::array::unsafe_weak_copy(out), type = type_, N = N_, K = K_, M]() mutable {
    // x is often a transposed view (attention's output): copied here rather than by a graph node
    MatmulArgs a{type, w.data<uint8_t>(), (int64_t)(w.size() / N), row_major(x, tl_x), out.data<float>(), M, N, K};
    if (M > 0) run_matmuls(&a, 1);
  });
}

void GGUFMatmulGroup::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  std::vector<mx::array> ws, outs;
  for (size_t i = 0; i < outputs.size(); i++) {
    outs.push_back(mx::array::unsafe_weak_copy(outputs[i]));
    ws.push_back(mx::array::unsafe_weak_copy(inputs[i + 1]));
  }
  const int64_t M = inputs[0].size() / K_;
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), ws, outs, types = types_, ns = ns_, K = K_,
                    M]() mutable {
    if (M == 0) return;
    const float* xp = row_major(x, tl_x);
    std::vector<MatmulArgs> parts;
    for (size_t i = 0; i < ws.size(); i++)
      parts.push_back({types[i], ws[i].data<uint8_t>(), (int64_t)(ws[i].size() / ns[i]), xp,
                       outs[i].data<float>(), M, ns[i], K});
    run_matmuls(parts.data(), (int)parts.size());
  });
}

bool GGUFMatmulGroup::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const GGUFMatmulGroup&>(other);
  return types_ == o.types_ && ns_ == o.ns_ && K_ == o.K_;
}

std::vector<mx::Shape> GGUFMatmulGroup::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (int64_t n : ns_) {
    auto shape = inputs[0].shape();
    shape.back() = (int)n;
    shapes.push_back(shape);
  }
  return shapes;
}

bool GGUFMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const GGUFMatmul&>(other);
  return type_ == o.type_ && N_ == o.N_ && K_ == o.K_;
}

std::vector<mx::Shape> GGUFMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = (int)N_;
  return {shape};
}

thread_local Scratch<float> tl_gu;

void GGUFGatedMLP::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  const int64_t M = inputs[0].size() / K_;
  encoder.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), g = mx::array::unsafe_weak_copy(inputs[1]),
                    u = mx::array::unsafe_weak_copy(inputs[2]), d = mx::array::unsafe_weak_copy(inputs[3]),
                    out = mx::array::unsafe_weak_copy(outputs[0]), types = types_, N = N_, K = K_, act = act_,
                    M]() mutable {
    if (M == 0) return;
    float* gp = tl_gu.get((size_t)(2 * M * N));
    float* up = gp + M * N;
    const float* xp = row_major(x, tl_x);
    const MatmulArgs gate_up[2] = {{types[0], g.data<uint8_t>(), (int64_t)(g.size() / N), xp, gp, M, N, K},
                                   {types[1], u.data<uint8_t>(), (int64_t)(u.size() / N), xp, up, M, N, K}};
    run_matmuls(gate_up, 2);
    active_impl()->gated_act(gp, up, gp, M * N, act);
    const MatmulArgs down{types[2], d.data<uint8_t>(), (int64_t)(d.size() / K), gp, out.data<float>(), M, K, N};
    run_matmuls(&down, 1);
  });
}

bool GGUFGatedMLP::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const GGUFGatedMLP&>(other);
  return types_ == o.types_ && N_ == o.N_ && K_ == o.K_ && act_ == o.act_;
}

std::vector<mx::Shape> GGUFGatedMLP::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

void GGUFDequantRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& rows = inputs[0];
  mx::array& out = outputs[0];
  auto& encoder = prepare(inputs, outputs);
  const int64_t row_bytes = rows.shape().back();
  const int64_t n_rows = row_bytes ? rows.size() / row_bytes : 0;
  encoder.dispatch([rows = mx::array::unsafe_weak_copy(rows), out = mx::array::unsafe_weak_copy(out),
                    type = type_, K = K_, row_bytes, n_rows]() mutable {
    active_impl()->dequant_rows(type, rows.data<uint8_t>(), n_rows, K, row_bytes, out.data<float>());
  });
}

std::vector<mx::Shape> GGUFDequantRows::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  shape.back() = (int)K_;
  return {shape};
}

// Row `row` of a packed tensor (gguf_kernels.h) as K floats, computed as the file type's
// dequantization computes them.
static void packed_row(int type, const uint8_t* w, int64_t row_bytes, int64_t row, int64_t K, float* y) {
  const int64_t block = PACK_ROWS * type_size(type), weights = block_size(type);
  const uint8_t* group = w + row / PACK_ROWS * PACK_ROWS * row_bytes;
  const int i = (int)(row % PACK_ROWS);
  auto f16 = [](const uint8_t* p) {
    mx::float16_t h;
    memcpy(&h, p, 2);
    return static_cast<float>(h);
  };
  auto bits = [](const uint8_t* p, int at) { return p[at / 8] >> at % 8; };  // from bit `at` of p's bytes
  for (int64_t b = 0; b < K / weights; b++, y += weights) {
    const uint8_t* blk = group + b * block;
    const float d = f16(blk + packed_scale_at(i));
    if (type == Q4_K_R16 || type == Q5_K_R16) {
      const float dmin = f16(blk + q4k_dmin_at(i));
      for (int j = 0; j < 8; j++) {
        int six[2];
        for (int what = 0; what < 2; what++)
          six[what] = (bits(blk + q4k_low_at(j, what), 4 * (i / 2) + 32 * (i % 2)) & 15) |
                      (bits(blk + q4k_high_at(j, what), 2 * i) & 3) << 4;
        const float dj = d * (float)six[0], mj = dmin * (float)six[1];
        for (int c = 0; c < 32; c++) {
          const int p = c / 2, w = 2 * i + c % 2;
          const int code = type == Q4_K_R16 ? bits(blk + q4k_pairs_at(j, p) + i, 4 * (c % 2)) & 15
                                            : (bits(blk + q5k_pairs_at(j, p) + i, 4 * (c % 2)) & 15) |
                                                  (bits(blk + q5k_fifth_at(j, p), w) & 1) << 4;
          y[32 * j + c] = dj * (float)code - mj;
        }
      }
      continue;
    }
    if (type == Q6_K_R16) {
      for (int j = 0; j < 8; j++)
        for (int c = 0; c < 32; c++) {
          const int w = 2 * i + c % 2, high = bits(blk + q6k_high_at(j, c / 2), 16 * (w % 4) + 2 * (w / 4)) & 3;
          const int code = ((bits(blk + q6k_low_at(j, c / 2) + i, 4 * (c % 2)) & 15) | high << 4) - 32;
          y[32 * j + c] = d * (float)(int8_t)blk[q6k_scales_at(j, c / 16) + i] * (float)code;
        }
      continue;
    }
    for (int c = 0; c < 32; c++) {
      const int p = c / 2, j = c % 2;
      const int nibble = bits(blk + q5_nibbles_at(p) + i, 4 * j) & 15;
      const int code = type == Q8_0_R16   ? (int8_t)blk[packed_code_at(i, c)]
                       : type == Q4_0_R16 ? nibble - 8
                                          : nibble - 16 * (bits(blk + q5_signs_at(p), 2 * i + j) & 1);
      y[c] = d * (float)code;
    }
  }
}

void GGUFEmbed::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = prepare(inputs, outputs);
  encoder.dispatch([w = mx::array::unsafe_weak_copy(inputs[0]), ids = mx::array::unsafe_weak_copy(inputs[1]),
                    out = mx::array::unsafe_weak_copy(outputs[0]), type = type_, K = K_]() mutable {
    const int64_t rows = w.shape(0), rb = w.shape(1);
    const uint8_t* wp = w.data<uint8_t>();
    const int32_t* ip = ids.data<int32_t>();
    float* y = out.data<float>();
    for (int64_t n = 0; n < (int64_t)ids.size(); n++) {
      const int64_t row = std::clamp<int64_t>(ip[n], 0, rows - 1);  // ids are checked before; memory stays safe
      if (is_packed(type))
        packed_row(type, wp, rb, row, K, y + n * K);
      else
        active_impl()->dequant_rows(type, wp + row * rb, 1, K, rb, y + n * K);
    }
  });
}

std::vector<mx::Shape> GGUFEmbed::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[1].shape();
  shape.push_back((int)K_);
  return {shape};
}

// a itself where it is already evaluated and row-contiguous (weights always are): one graph node
// less per matmul; otherwise MLX's contiguous op.
static mx::array row_contiguous(const mx::array& a, mx::Stream stream) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, stream);
}

static int64_t row_bytes_for(int type, int64_t K) {
  check_type(type);
  if (K <= 0 || K % block_size(type) != 0) {
    std::ostringstream msg;
    msg << "gguf kernels: K=" << K << " is not a multiple of the block size " << block_size(type);
    throw std::invalid_argument(msg.str());
  }
  return K / block_size(type) * type_size(type);
}

// w must be a GGUF tensor's bytes: uint8 (rows, K / block_size * type_size). A packed one must
// also have rows in whole groups and, for a product (`multiplied`), this ISA's kernel for it.
static void check_weight(const char* op, const mx::array& w, int type, int64_t rows, int64_t K,
                         bool multiplied = true) {
  const int64_t rb = row_bytes_for(type, K);
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || w.shape(0) != rows || w.shape(1) != rb) {
    std::ostringstream msg;
    msg << op << ": weight must be uint8 of shape (" << rows << ", " << rb << ")";
    throw std::invalid_argument(msg.str());
  }
  if (!is_packed(type)) return;
  const Impl* impl = active_impl();
  std::ostringstream msg;
  if (rows % PACK_ROWS != 0)
    msg << op << ": a packed weight needs a multiple of " << PACK_ROWS << " rows";
  else if (multiplied && !(impl->packs && impl->packs(file_type(type))))
    msg << op << ": the active ISA's kernels (" << impl->name << ") do not take this packed layout";
  else
    return;
  throw std::invalid_argument(msg.str());
}

// The CPU stream an op over x (..., K) runs on; throws unless x's last dimension is K and s is the CPU.
static mx::Stream cpu_op_stream(const char* op, const mx::array& x, int64_t K, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.shape().back() != K) {
    std::ostringstream msg;
    msg << op << ": last dimension of x must be " << K;
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument(std::string(op) + " runs on the CPU only");
  return stream;
}

mx::array gguf_matmul(const mx::array& x_in, const mx::array& w, int type, int64_t N, int64_t K, mx::StreamOrDevice s) {
  check_weight("gguf_matmul", w, type, N, K);
  const auto stream = cpu_op_stream("gguf_matmul", x_in, K, s);
  const auto dtype = x_in.dtype();
  mx::array x = x_in.dtype() == mx::float32 ? x_in : mx::astype(x_in, mx::float32, stream);
  auto shape = x.shape();
  shape.back() = (int)N;
  mx::array y(shape, mx::float32, std::make_shared<GGUFMatmul>(stream, type, N, K), {x, row_contiguous(w, stream)});
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

std::vector<mx::array> gguf_matmul_group(const mx::array& x_in, const std::vector<mx::array>& ws,
                                         const std::vector<int>& types, const std::vector<int64_t>& ns, int64_t K,
                                         mx::StreamOrDevice s) {
  if (ws.empty() || ws.size() != types.size() || ws.size() != ns.size())
    throw std::invalid_argument("gguf_matmul_group: one type and one row count per weight");
  const auto stream = cpu_op_stream("gguf_matmul_group", x_in, K, s);
  for (size_t i = 0; i < ws.size(); i++) check_weight("gguf_matmul_group", ws[i], types[i], ns[i], K);
  const auto dtype = x_in.dtype();
  std::vector<mx::array> inputs{x_in.dtype() == mx::float32 ? x_in : mx::astype(x_in, mx::float32, stream)};
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < ws.size(); i++) {
    inputs.push_back(row_contiguous(ws[i], stream));
    auto shape = x_in.shape();
    shape.back() = (int)ns[i];
    shapes.push_back(shape);
  }
  auto ys = mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(ws.size(), mx::float32),
                                   std::make_shared<GGUFMatmulGroup>(stream, types, ns, K), std::move(inputs));
  if (dtype != mx::float32)
    for (auto& y : ys) y = mx::astype(y, dtype, stream);
  return ys;
}

mx::array gguf_gated_mlp(const mx::array& x_in, const mx::array& gate, const mx::array& up, const mx::array& down,
                         const std::vector<int>& types, int64_t N, int64_t K, int act, mx::StreamOrDevice s) {
  if (types.size() != 3) throw std::invalid_argument("gguf_gated_mlp: three types (gate, up, down)");
  if (act != GATED_SILU && act != GATED_GELU_APPROX) throw std::invalid_argument("gguf_gated_mlp: unknown activation");
  check_weight("gguf_gated_mlp", gate, types[0], N, K);
  check_weight("gguf_gated_mlp", up, types[1], N, K);
  check_weight("gguf_gated_mlp", down, types[2], K, N);
  const auto stream = cpu_op_stream("gguf_gated_mlp", x_in, K, s);
  const auto dtype = x_in.dtype();
  mx::array x = dtype == mx::float32 ? x_in : mx::astype(x_in, mx::float32, stream);
  mx::array y(x.shape(), mx::float32, std::make_shared<GGUFGatedMLP>(stream, types, N, K, act),
              {x, row_contiguous(gate, stream), row_contiguous(up, stream), row_contiguous(down, stream)});
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

mx::array gguf_dequant_rows(const mx::array& rows, int type, int64_t K, mx::StreamOrDevice s) {
  if (is_packed(type))  // a packed row's bytes are spread over its group: gguf_embed reads those
    throw std::invalid_argument("gguf_dequant_rows: rows in the file's layout only (a packed weight: gguf_embed)");
  const int64_t rb = row_bytes_for(type, K);
  if (rows.dtype() != mx::uint8 || rows.ndim() < 1 || rows.shape().back() != rb) {
    std::ostringstream msg;
    msg << "gguf_dequant_rows: rows must be uint8 with last dimension " << rb;
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("gguf_dequant_rows runs on the CPU only");
  auto shape = rows.shape();
  shape.back() = (int)K;
  return mx::array(shape, mx::float32, std::make_shared<GGUFDequantRows>(stream, type, K),
                   {row_contiguous(rows, stream)});
}

mx::array gguf_embed(const mx::array& w, const mx::array& ids, int type, int64_t K, mx::StreamOrDevice s) {
  check_weight("gguf_embed", w, type, w.ndim() == 2 ? w.shape(0) : -1, K, false);  // a lookup is plain code
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument("gguf_embed runs on the CPU only");
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("gguf_embed: ids must be integers");
  auto shape = ids.shape();
  shape.push_back((int)K);
  mx::array ids32 = ids.dtype() == mx::int32 ? ids : mx::astype(ids, mx::int32, stream);
  return mx::array(shape, mx::float32, std::make_shared<GGUFEmbed>(stream, type, K),
                   {row_contiguous(w, stream), row_contiguous(ids32, stream)});
}

// Code c of sub-block j of a file block of a packable type, unsigned as the packed layouts keep
// it (Q8_0: the int8 code's byte; Q4_0, Q4_K: its 4 bits; Q5_0, Q5_K: 5; Q6_K: 6).
template <int TYPE>
static uint8_t file_code(const uint8_t* blk, int j, int c) {
  if constexpr (TYPE == Q8_0) {
    return blk[2 + c];
  } else if constexpr (TYPE == Q4_0) {  // f16 d, 16 bytes of codes c and c + 16
    return c < 16 ? blk[2 + c] & 15 : blk[2 + c - 16] >> 4;
  } else if constexpr (TYPE == Q5_K) {  // f16 d, f16 dmin, 12 bytes of scales, 32 of fifth bits, 128 of low 4
    return (uint8_t)((blk[48 + 32 * (j / 2) + c] >> 4 * (j % 2) & 15) | (blk[16 + c] >> j & 1) << 4);
  } else if constexpr (TYPE == Q5_0) {  // f16 d, 32 fifth bits, 16 bytes of codes c and c + 16
    return (uint8_t)((c < 16 ? blk[6 + c] & 15 : blk[6 + c - 16] >> 4) | (blk[2 + c / 8] >> c % 8 & 1) << 4);
  } else if constexpr (TYPE == Q4_K) {  // f16 d, f16 dmin, 12 bytes of scales, 128 of codes (2 sub-blocks a 32)
    return blk[16 + 32 * (j / 2) + c] >> 4 * (j % 2) & 15;
  } else {  // Q6_K: 128 bytes of low 4 bits, 64 of high 2, 16 int8 scales, f16 d; sub-block 4 h + g
    const int h = j / 4, g = j % 4;
    const int low = blk[64 * h + c + 32 * (g % 2)] >> 4 * (g / 2) & 15, high = blk[128 + 32 * h + c] >> 2 * g & 3;
    return (uint8_t)(low | high << 4);
  }
}

// One block of a group in the packed layout of its file type (gguf_kernels.h): rows are the
// group's 16 file blocks, each `stride` bytes after the last. Written in order, a sub-block's
// codes gathered first (scattered writes took a third more time).
template <int TYPE>
static void pack_block(const uint8_t* rows, int64_t stride, uint8_t* out) {
  auto row = [&](int i) { return rows + i * stride; };
  for (int i = 0; i < PACK_ROWS; i++) memcpy(out + packed_scale_at(i), row(i) + (TYPE == Q6_K ? 208 : 0), 2);
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    for (int i = 0; i < PACK_ROWS; i++) memcpy(out + q4k_dmin_at(i), row(i) + 2, 2);
    for (int j = 0; j < 8; j++)
      for (int what = 0; what < 2; what++) {
        uint64_t low = 0;
        uint32_t high = 0;
        for (int i = 0; i < PACK_ROWS; i++) {
          const uint8_t* q = row(i) + 4;  // the 12 bytes of 6-bit scales and minima
          const int six = what == 0 ? (j < 4 ? q[j] & 63 : (q[j + 4] & 15) | (q[j - 4] >> 6) << 4)
                                    : (j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | (q[j] >> 6) << 4);
          low |= (uint64_t)(six & 15) << (4 * (i / 2) + 32 * (i % 2));
          high |= (uint32_t)(six >> 4) << 2 * i;
        }
        memcpy(out + q4k_low_at(j, what), &low, 8);
        memcpy(out + q4k_high_at(j, what), &high, 4);
      }
  }
  if constexpr (TYPE == Q6_K)
    for (int j = 0; j < 8; j++)
      for (int h = 0; h < 2; h++)
        for (int i = 0; i < PACK_ROWS; i++) out[q6k_scales_at(j, h) + i] = row(i)[192 + 2 * j + h];
  uint8_t code[PACK_ROWS][32];
  for (int j = 0; j < format_of(TYPE).block / 32; j++) {
    for (int i = 0; i < PACK_ROWS; i++)
      for (int c = 0; c < 32; c++) code[i][c] = file_code<TYPE>(row(i), j, c);
    for (int p = 0; p < 16; p++) {
      if constexpr (TYPE == Q8_0) {
        for (int i = 0; i < PACK_ROWS; i++) memcpy(out + packed_code_at(i, 2 * p), &code[i][2 * p], 2);
      } else {
        const int at = packed_nibbles_at(TYPE, j, p);
        for (int i = 0; i < PACK_ROWS; i++)
          out[at + i] = (uint8_t)((code[i][2 * p] & 15) | (code[i][2 * p + 1] & 15) << 4);
      }
      if constexpr (TYPE == Q5_0 || TYPE == Q5_K || TYPE == Q6_K) {
        uint64_t high = 0;  // Q5_0: the cleared fifth bits; Q5_K: the set ones; Q6_K: the top two
        for (int i = 0; i < PACK_ROWS; i++)
          for (int k = 0; k < 2; k++) {
            const int w = 2 * i + k, top = code[i][2 * p + k] >> 4;
            high |= TYPE == Q5_0   ? (uint64_t)!top << w
                    : TYPE == Q5_K ? (uint64_t)top << w
                                   : (uint64_t)top << (16 * (w % 4) + 2 * (w / 4));
          }
        const int at = TYPE == Q5_0 ? q5_signs_at(p) : TYPE == Q5_K ? q5k_fifth_at(j, p) : q6k_high_at(j, p);
        memcpy(out + at, &high, TYPE == Q6_K ? 8 : 4);
      }
    }
  }
}

mx::array pack(const mx::array& w_in, int type) {
  mx::array w = mx::contiguous(w_in);
  mx::eval(w);
  const int size = packable(type) ? type_size(type) : 0;
  if (size == 0 || w.dtype() != mx::uint8 || w.ndim() != 2 || w.shape(1) % size != 0 || w.shape(0) % PACK_ROWS != 0)
    throw std::invalid_argument(
        "pack: Q4_0, Q8_0, Q5_0, Q4_K, Q5_K or Q6_K bytes (rows, K / block * type size), rows a multiple of 16");
  const int64_t rows = w.shape(0), rb = w.shape(1), nb = rb / size;
  mx::array packed(mx::allocator::malloc((size_t)(rows * rb)), w.shape(), mx::uint8);
  const uint8_t* src = w.data<uint8_t>();
  uint8_t* dst = packed.data<uint8_t>();
  // One thread: a parallel region would pin the loading thread to a CPU for good (pin_member), and
  // this runs once.
  auto each = [&]<int TYPE>() {
    for (int64_t g = 0; g < rows / PACK_ROWS; g++)
      for (int64_t b = 0; b < nb; b++)
        pack_block<TYPE>(src + g * PACK_ROWS * rb + b * size, rb, dst + g * PACK_ROWS * rb + b * PACK_ROWS * size);
  };
  switch (type) {
    case Q4_0: each.operator()<Q4_0>(); break;
    case Q8_0: each.operator()<Q8_0>(); break;
    case Q5_0: each.operator()<Q5_0>(); break;
    case Q4_K: each.operator()<Q4_K>(); break;
    case Q5_K: each.operator()<Q5_K>(); break;
    default: each.operator()<Q6_K>(); break;
  }
  return packed;
}

bool packs(int type) {
  const Impl* impl = active_impl();
  return impl->packs && impl->packs(type);
}

std::vector<mx::array> in_huge_pages(const std::vector<mx::array>& arrays) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // One uint64 buffer (MLX shapes are int32: up to 16 GiB), each array at a 64-byte boundary.
  constexpr size_t HUGE_PAGE = size_t(2) << 20, ALIGN = 64, WORD = 8;
  std::vector<mx::array> src;
  for (const mx::array& a : arrays) src.push_back(mx::contiguous(a));
  mx::eval(src);
  std::vector<size_t> at;
  size_t bytes = 0;
  for (const mx::array& a : src) {
    at.push_back(bytes);
    bytes += (a.nbytes() + ALIGN - 1) / ALIGN * ALIGN;
  }
  const size_t words = (bytes + HUGE_PAGE) / WORD;  // room to start at a huge page
  if (words > size_t(INT32_MAX)) throw std::invalid_argument("in_huge_pages: more than 16 GiB at once");
  // MLX's own allocation, so its memory counts stay whole. Its 2 MiB pages are collapsed into huge
  // pages once the copy is in (Linux 6.1 on; 0.08 s for 256 MiB here), which changes nothing about
  // the range after: the buffer may be the C heap's (glibc serves a request from free heap space
  // whatever its size), and advice would outlive it there, giving whatever the heap put in the
  // range later 2 MiB pages. Where the kernel cannot collapse (older, or no huge page free), the
  // range is advised instead, so that khugepaged collapses it later.
  mx::array buffer(mx::allocator::malloc(words * WORD), {(int)words}, mx::uint64);
  const uintptr_t start = reinterpret_cast<uintptr_t>(buffer.data<uint8_t>());
  const uintptr_t base = (start + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  const size_t span = bytes / HUGE_PAGE * HUGE_PAGE;
  for (size_t i = 0; i < src.size(); i++)
    std::memcpy(reinterpret_cast<uint8_t*>(base) + at[i], src[i].data<uint8_t>(), src[i].nbytes());
  constexpr int COLLAPSE = 25;  // MADV_COLLAPSE, which older C headers lack
  if (span && madvise(reinterpret_cast<void*>(base), span, COLLAPSE) != 0)
    madvise(reinterpret_cast<void*>(base), span, MADV_HUGEPAGE);
  std::vector<mx::array> out;
  const size_t skip = (base - start) / WORD;
  for (size_t i = 0; i < src.size(); i++) {
    const mx::array& a = src[i];
    const int w0 = (int)(skip + at[i] / WORD), w1 = w0 + (int)((a.nbytes() + WORD - 1) / WORD);
    mx::array flat = mx::view(mx::slice(buffer, {w0}, {w1}), a.dtype());
    out.push_back(mx::reshape(mx::slice(flat, {0}, {(int)a.size()}), a.shape()));
  }
  mx::eval(out);  // views of the buffer: slicing, viewing and reshaping a contiguous array copy nothing
  return out;
#else
  return arrays;
#endif
}

}  // namespace gmlx_kernels
