// MLX primitives and ops over GGUF block weights (CPU).
#pragma once

#include "gguf_kernels.h"
#include "parallel.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

namespace gmlx_kernels {

namespace mx = mlx::core;

// The ISA chosen at run time (generic, avx2, avx512).
const Impl* active_impl();
// Use the widest ISA at most `want` that this processor has ("" = the widest); returns its name.
std::string set_isa(const std::string& want);
// Integer path (< 64 activation rows, 8 at a time; AVX2, AVX-512): bits of each activation's integer code: 16 (default,
// near float), 8 (llama.cpp's Q8_0 activations), 0 (the float path always).
void set_act_bits(int bits);
int act_bits();
// Prefill (>= 64 rows) through the process's optimized BLAS (OpenBLAS preloaded by gmlx), if any.
// set_blas(false) forces the own float kernel; returns "" when no such BLAS is used.
std::string set_blas(bool on);
std::string blas_name();

// y = x @ dequant(w).T ; x (..., K) any float dtype (computed in float32, returned in x's dtype);
// w uint8 (N, K / block_size * type_size): the GGUF tensor's bytes, row n = output feature n.
mx::array gguf_matmul(const mx::array& x, const mx::array& w, int type, int64_t N, int64_t K,
                      mx::StreamOrDevice s = {});

// Several weights against one x (q, k and v; gate and up): one node, x coded once.
std::vector<mx::array> gguf_matmul_group(const mx::array& x, const std::vector<mx::array>& ws,
                                         const std::vector<int>& types, const std::vector<int64_t>& ns, int64_t K,
                                         mx::StreamOrDevice s = {});

// A gated MLP as one node: down(act(x @ gate.T) * (x @ up.T)); types[0..2] of gate, up and
// down; gate and up (N, K), down (K, N); act a GatedAct.
mx::array gguf_gated_mlp(const mx::array& x, const mx::array& gate, const mx::array& up, const mx::array& down,
                         const std::vector<int>& types, int64_t N, int64_t K, int act, mx::StreamOrDevice s = {});

// rows uint8 (..., row_bytes) -> float32 (..., K): dequantize whole rows (embedding lookup).
mx::array gguf_dequant_rows(const mx::array& rows, int type, int64_t K, mx::StreamOrDevice s = {});
// An embedding lookup: float32 (*ids.shape, K), row ids[i] of w (any type, packed included) dequantized.
mx::array gguf_embed(const mx::array& w, const mx::array& ids, int type, int64_t K, mx::StreamOrDevice s = {});
// Q4_0, Q8_0, Q5_0, Q4_K, Q5_K or Q6_K bytes (rows, K / block * type size), rows a multiple of PACK_ROWS, in
// their packed layout (PACKED + type); and whether the active ISA's kernels multiply it.
mx::array pack(const mx::array& w, int type);
bool packs(int type);
// The arrays copied into buffers advised for transparent huge pages (Linux; elsewhere, as given).
std::vector<mx::array> in_huge_pages(const std::vector<mx::array>& arrays);

// Bytes every thread's Scratch holds now, and of them the bytes of those used since the last
// release_scratch: what the calls since needed.
extern std::atomic<int64_t> g_scratch_bytes, g_scratch_used_bytes;
extern std::atomic<uint64_t> g_scratch_generation;
// Each Scratch frees what it holds at its thread's next use of it, keeping what that use needs, or
// sooner where its thread runs no kernel: the calling thread's now, the threads of `streams` (CPU
// streams; none: the calling thread's default) once the work queued on them is done, the pool's
// workers' outside their regions. The used bytes count from 0 (exactly so where no kernel runs
// meanwhile).
void release_scratch(const std::vector<mx::Stream>& streams = {});

// Working memory a thread keeps from one call of the kernels to the next, outside MLX's buffers
// (a prefill chunk's gate and up rows, its activations' integer codes). It grows to what the
// largest call since the last release_scratch needed, and is counted (scratch_bytes). Declared
// thread_local: only its own thread frees it, so a release never pulls a buffer from under a
// running kernel (docs/ARCHITECTURE.md, decision 39).
template <class T>
class Scratch final : public ThreadBuffer {
 public:
  Scratch() = default;
  ~Scratch() { add(-(int64_t)v_.capacity()); }
  // n elements, valid until this thread's next get() of the same Scratch or drop_released_buffers();
  // their values are undefined.
  T* get(size_t n) {
    drop_if_released();
    if (v_.size() < n) {
      const size_t before = v_.capacity();
      v_.resize(n);
      add((int64_t)(v_.capacity() - before));
    }
    return v_.data();
  }

  void drop_if_released() override {
    if (const uint64_t g = g_scratch_generation.load(std::memory_order_relaxed); g != generation_) {
      add(-(int64_t)v_.capacity());  // released: counted in the total only
      std::vector<T>().swap(v_);
      generation_ = g;
    }
  }

 private:
  // To the total, and to the used bytes where used since the last release.
  void add(int64_t elements) const {
    const int64_t bytes = elements * (int64_t)sizeof(T);
    g_scratch_bytes.fetch_add(bytes, std::memory_order_relaxed);
    if (generation_ == g_scratch_generation.load(std::memory_order_relaxed))
      g_scratch_used_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
  std::vector<T> v_;
  uint64_t generation_ = 0;
};

// a's elements (T float, or uint16_t for float16) in row-major order: its own buffer when already
// so, else a copy into buf.
template <class T>
const T* row_major(const mx::array& a, Scratch<T>& buf);
extern template const float* row_major(const mx::array&, Scratch<float>&);

// The transformer ops MLX composes from many nodes on the CPU, as one node each (float32).
// y = x / sqrt(mean(x^2, -1) + eps) * w, w (D,) or none.
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s = {});
// log(sum(exp(x), -1)) over the last axis; keepdims keeps it as size 1.
mx::array logsumexp(const mx::array& x, bool keepdims, mx::StreamOrDevice s = {});
// Index of each row's maximum over the last axis (the first where tied), uint32.
mx::array argmax(const mx::array& x, mx::StreamOrDevice s = {});
// Each row of x (R, V)'s log-softmax at tokens (R,), and its k largest entries: [chosen (R,),
// ids (R, k) uint32, values (R, k)], best first (ties: the lower id first), as one node.
std::vector<mx::array> logprob_top(const mx::array& x, const mx::array& tokens, int k, mx::StreamOrDevice s = {});
// x (..., V) where a row's bitmask allows the token (bit v % 32 of word v / 32 of bits (..., W),
// int32 or uint32 as llguidance fills them, W * 32 >= V), -inf elsewhere: a grammar's mask.
mx::array mask_tokens(const mx::array& x, const mx::array& bits, mx::StreamOrDevice s = {});
// One token per row of x (..., V), drawn with u (...) uniform in [0, 1) from softmax(x / temperature)
// restricted as mlx_lm's filters restrict it, in its order: top_p of the temperature-1 distribution
// (ties at its edge kept), min_p, top_k. temperature <= 0 or top_k == 1: the argmax.
mx::array sample(const mx::array& x, const mx::array& u, float temperature, float top_p, float min_p, int top_k,
                 mx::StreamOrDevice s = {});
// The same with each row's own settings: settings (..., 4) float32, a row's temperature, top_p,
// min_p and top_k (a whole number); a batch of requests drawn in one node, its rows in parallel.
mx::array sample_rows(const mx::array& x, const mx::array& u, const mx::array& settings, mx::StreamOrDevice s = {});
// mx.fast.rope's contract: x (B, ..., L, D), positions offset + l (offset an int, or an int array
// of one value or one per B), angular frequencies base^(-2i/dims) or 1 / freqs.
mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
               const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s = {});
// An attention input's heads in one node: x (B, L, n * D) -> (B, n, L, D), each row RMS-normalised
// (x / sqrt(mean(x^2) + eps) * w) where w is given, then rotated as rope() rotates it where dims > 0.
// The floats are those of rms_norm and rope composed (the same row functions, in the same order).
mx::array heads(const mx::array& x, int n, const std::optional<mx::array>& w, float eps, int dims, bool traditional,
                std::optional<float> base, float scale, const std::variant<int, mx::array>& offset,
                const std::optional<mx::array>& freqs, mx::StreamOrDevice s = {});
// A residual sum and the norms about it in one node: h = x + rms_norm(r, w, eps), and with next_w
// also rms_norm(h, next_w, next_eps) ({h} or {h, that}); the floats of the ops composed.
std::vector<mx::array> add_norm(const mx::array& x, const mx::array& r, const mx::array& w, float eps,
                                const std::optional<mx::array>& next_w, float next_eps, mx::StreamOrDevice s = {});
// softmax(scale q k^T + mask) v with q (B, Hq, L, D), k and v (B, Hkv, T, D), Hq a multiple of
// Hkv; mask bool (attend where true) or float (added), broadcastable to (B, Hq, L, T).
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, bool causal, mx::StreamOrDevice s = {});
// A new array of `shape` (R, H, T, D) and `dtype`: sources[i] (n, H, t, D) at rows rows[i]..
// and slots ats[i].., zeros elsewhere (see PlaceRows).
mx::array place_rows(const std::vector<mx::array>& sources, const std::vector<int>& rows, const std::vector<int>& ats,
                     const std::vector<int>& shape, mx::Dtype dtype, mx::StreamOrDevice s = {});

// CPU only; subclasses say how to compute and compare (output shape: the first input's by default).
class CPUPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " has no GPU implementation");
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 protected:
  // The stream's encoder, with every input and output registered and the outputs allocated:
  // eval_cpu then dispatches its work on it. Output i takes input donors[i]'s buffer instead where
  // nothing else holds that input (its size and layout the output's; the work must read each
  // element before writing it).
  mx::cpu::CommandEncoder& prepare(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                   const std::vector<int>& donors = {});
};

class GGUFMatmul : public CPUPrimitive {
 public:
  GGUFMatmul(mx::Stream stream, int type, int64_t N, int64_t K) : CPUPrimitive(stream), type_(type), N_(N), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GGUFMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int type_;
  int64_t N_, K_;
};

class GGUFMatmulGroup : public CPUPrimitive {
 public:
  GGUFMatmulGroup(mx::Stream stream, std::vector<int> types, std::vector<int64_t> ns, int64_t K)
      : CPUPrimitive(stream), types_(std::move(types)), ns_(std::move(ns)), K_(K) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GGUFMatmulGroup"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> types_;
  std::vector<int64_t> ns_;
  int64_t K_;
};

class GGUFGatedMLP : public CPUPrimitive {
 public:
  GGUFGatedMLP(mx::Stream stream, std::vector<int> types, int64_t N, int64_t K, int act)
      : CPUPrimitive(stream), types_(std::move(types)), N_(N), K_(K), act_(act) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GGUFGatedMLP"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> types_;
  int64_t N_, K_;
  int act_;
};

// Rows of a GGUF tensor of one type as K floats each: the two ops below differ in which rows.
class GGUFRows : public CPUPrimitive {
 public:
  GGUFRows(mx::Stream stream, int type, int64_t K) : CPUPrimitive(stream), type_(type), K_(K) {}
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const GGUFRows&>(other);
    return type_ == o.type_ && K_ == o.K_;
  }

 protected:
  int type_;
  int64_t K_;
};

// The block rows given, each dequantized.
class GGUFDequantRows : public GGUFRows {
 public:
  using GGUFRows::GGUFRows;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GGUFDequantRows"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

// The rows of a weight that ids name (an embedding lookup), in any layout, packed included.
class GGUFEmbed : public GGUFRows {
 public:
  using GGUFRows::GGUFRows;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GGUFEmbed"; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

class RMSNorm : public CPUPrimitive {
 public:
  RMSNorm(mx::Stream s, float eps) : CPUPrimitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class LogSumExp : public CPUPrimitive {
 public:
  using CPUPrimitive::CPUPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxLogSumExp"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = 1;
    return {shape};
  }
};

// Over the last axis of (..., V) logits: the first maximum's index (uint32, the last axis dropped).
class Argmax : public CPUPrimitive {
 public:
  using CPUPrimitive::CPUPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxArgmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.pop_back();
    return {shape};
  }
};

class LogprobTop : public CPUPrimitive {
 public:
  LogprobTop(mx::Stream s, int k) : CPUPrimitive(s), k_(k) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxLogprobTop"; }
  bool is_equivalent(const mx::Primitive& other) const override { return k_ == static_cast<const LogprobTop&>(other).k_; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const int R = inputs[0].shape(0);
    return {{R}, {R, k_}, {R, k_}};
  }

 private:
  int k_;
};

class MaskTokens : public CPUPrimitive {
 public:
  using CPUPrimitive::CPUPrimitive;
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxMaskTokens"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// Inputs x (R, V), u (R) and settings (R, 4): a token per row, drawn with u from the distribution
// its settings filter.
class Sample : public CPUPrimitive {
 public:
  explicit Sample(mx::Stream s) : CPUPrimitive(s) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxSample"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[1].shape()}; }
};

// A RoPE's settings, as RoPE and Heads take them: dims 0 rotates nothing. Inputs after x (and a
// norm weight): freqs if has_freqs (else base sets the frequencies), the offset array unless the
// offset is static.
struct Rotation {
  int dims = 0;
  bool traditional = false;
  float base = 0.f, scale = 1.f;
  int64_t offset = 0;
  bool has_freqs = false;
  bool operator==(const Rotation&) const = default;
};

class RoPE : public CPUPrimitive {
 public:
  // inputs: x, then the rotation's
  RoPE(mx::Stream s, Rotation rot) : CPUPrimitive(s), rot_(rot) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override { return rot_ == static_cast<const RoPE&>(other).rot_; }

 private:
  Rotation rot_;
};

class Heads : public CPUPrimitive {
 public:
  // inputs: x, then w if has_norm, then the rotation's
  Heads(mx::Stream s, int n, bool has_norm, float eps, Rotation rot)
      : CPUPrimitive(s), n_(n), has_norm_(has_norm), eps_(eps), rot_(rot) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Heads&>(other);
    return n_ == o.n_ && has_norm_ == o.has_norm_ && eps_ == o.eps_ && rot_ == o.rot_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0].shape();
    return {{x[0], n_, x[1], x[2] / n_}};
  }

 private:
  int n_;
  bool has_norm_;
  float eps_;
  Rotation rot_;
};

class AddNorm : public CPUPrimitive {
 public:
  // inputs: x, r, w, then next_w if there are two outputs
  AddNorm(mx::Stream s, float eps, float next_eps) : CPUPrimitive(s), eps_(eps), next_eps_(next_eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxAddNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AddNorm&>(other);
    return eps_ == o.eps_ && next_eps_ == o.next_eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return std::vector<mx::Shape>(inputs.size() - 2, inputs[0].shape());
  }

 private:
  float eps_, next_eps_;
};

class Attention : public CPUPrimitive {
 public:
  // inputs: q, k, v, then the mask if any
  Attention(mx::Stream s, float scale, bool causal) : CPUPrimitive(s), scale_(scale), causal_(causal) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

// A decode batch's KV buffer rebuilt around a joining row (upstream._extend_in_one_copy): the
// rows' slots copied into a new buffer, zeros between them, each page written once and by the
// kernel threads in parallel. The pages are fresh from the kernel, and their first touch (a fault
// each) is most of the cost: 0.7-0.9 ms a MiB on these VMs, from one thread in MLX's fill and
// again in its copies (docs/ARCHITECTURE.md, decision 30).
class PlaceRows : public CPUPrimitive {
 public:
  PlaceRows(mx::Stream s, mx::Shape shape, std::vector<int> rows, std::vector<int> ats)
      : CPUPrimitive(s), shape_(std::move(shape)), rows_(std::move(rows)), ats_(std::move(ats)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxPlaceRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const PlaceRows&>(other);
    return shape_ == o.shape_ && rows_ == o.rows_ && ats_ == o.ats_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {shape_}; }

 private:
  mx::Shape shape_;
  std::vector<int> rows_, ats_;
};

}  // namespace gmlx_kernels
