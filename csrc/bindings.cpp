// nanobind module gmlx.kernels._ext. Built in nanobind's "mlx" domain so that
// mx.array crosses between this module and mlx.core.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/compile_impl.h"
#include "mlx/version.h"
#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace gk = gmlx_kernels;

NB_MODULE(_ext, m) {
  m.doc() = "Quantized matmul over GGUF block formats for MLX on the CPU";
  m.def("gguf_matmul", &gk::gguf_matmul, "x"_a, "w"_a, "type"_a, "n"_a, "k"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "y = x @ dequant(w).T for GGUF block weights w (uint8, (n, row_bytes)); x (..., k).");
  m.def("gguf_matmul_group", &gk::gguf_matmul_group, "x"_a, "ws"_a, "types"_a, "ns"_a, "k"_a, nb::kw_only(),
        "stream"_a = nb::none(), "[x @ dequant(w).T for w in ws] as one node: x is coded once for them all.");
  m.def("gguf_gated_mlp", &gk::gguf_gated_mlp, "x"_a, "gate"_a, "up"_a, "down"_a, "types"_a, "n"_a, "k"_a,
        "act"_a, nb::kw_only(), "stream"_a = nb::none(),
        "dequant(down) @ (act(x @ dequant(gate).T) * (x @ dequant(up).T)) as one node; act 0 silu, 1 gelu_approx.");
  m.def("gguf_dequant_rows", &gk::gguf_dequant_rows, "rows"_a, "type"_a, "k"_a, nb::kw_only(),
        "stream"_a = nb::none(), "Dequantize GGUF block rows (uint8 (..., row_bytes)) to float32 (..., k).");
  m.def("gguf_embed", &gk::gguf_embed, "w"_a, "ids"_a, "type"_a, "k"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Rows ids of GGUF block weights w (uint8 (rows, row_bytes)) as float32 (*ids.shape, k).");
  m.def("pack", &gk::pack, "w"_a, "type"_a,
        "Q4_0, Q8_0, Q5_0, Q4_K, Q5_K or Q6_K bytes (rows, row_bytes) in gmlx's packed layout of that type "
        "(PACKED + type).");
  // Without the GIL: it reads a group of weights (page faults on the file) and copies it, seconds on
  // a large model, while the event loop must go on answering /health.
  m.def("in_huge_pages", &gk::in_huge_pages, "arrays"_a, nb::call_guard<nb::gil_scoped_release>(),
        "The arrays as views of buffers advised for transparent huge pages (Linux; elsewhere as given).");
  m.def("place_rows", &gk::place_rows, "sources"_a, "rows"_a, "ats"_a, "shape"_a, "dtype"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "A new (R, H, T, D) array: sources[i] (n, H, t, D) at rows rows[i].. and slots ats[i].., zeros elsewhere.");
  m.def("packs", &gk::packs, "type"_a, "Whether the active ISA's kernels multiply the packed layout of a GGML type.");
  m.def("rms_norm", &gk::rms_norm, "x"_a, "weight"_a.none(), "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rms_norm as one CPU node (float32).");
  m.def("logsumexp", &gk::logsumexp, "x"_a, nb::kw_only(), "keepdims"_a = false, "stream"_a = nb::none(),
        "log(sum(exp(x))) over the last axis as one CPU node (float32), exp vectorized.");
  m.def("rope", &gk::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a.none(), "scale"_a, "offset"_a,
        "freqs"_a = nb::none(), "stream"_a = nb::none(), "mx.fast.rope as one CPU node (float32).");
  m.def("heads", &gk::heads, "x"_a, "n"_a, nb::kw_only(), "weight"_a = nb::none(), "eps"_a = 0.f, "dims"_a = 0,
        "traditional"_a = false, "base"_a = nb::none(), "scale"_a = 1.f, "offset"_a = 0, "freqs"_a = nb::none(),
        "stream"_a = nb::none(),
        "x (B, L, n * D) as (B, n, L, D), each row rms_norm'd by weight (if given), then roped (if dims > 0), "
        "as one CPU node (float32).");
  m.def("add_norm", &gk::add_norm, "x"_a, "r"_a, "weight"_a, "eps"_a, nb::kw_only(), "next_weight"_a = nb::none(),
        "next_eps"_a = 0.f, "stream"_a = nb::none(),
        "[h = x + rms_norm(r, weight, eps)], and rms_norm(h, next_weight, next_eps) with next_weight, as one CPU "
        "node (float32).");
  m.def("attention", &gk::attention, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a, "mask"_a = nb::none(),
        "causal"_a = false, "stream"_a = nb::none(),
        "softmax(scale q k^T + mask) v as one CPU node (float32), q (B, Hq, L, D), k and v (B, Hkv, T, D).");
  m.def("argmax", &gk::argmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Index of each row's maximum over the last axis (the first where tied), uint32, as one CPU node.");
  m.def("logprob_top", &gk::logprob_top, "x"_a, "tokens"_a, "k"_a, nb::kw_only(), "stream"_a = nb::none(),
        "[log-softmax of x (R, V) at tokens (R,), the ids (R, k) and log-softmax (R, k) of each row's k largest, "
        "best first], as one CPU node.");
  m.def("mask_tokens", &gk::mask_tokens, "x"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x where each row's bitmask (bit v % 32 of word v / 32, llguidance's layout) allows token v, -inf "
        "elsewhere, as one CPU node.");
  m.def("sample", &gk::sample, "x"_a, "u"_a, nb::kw_only(), "temperature"_a, "top_p"_a = 1.f, "min_p"_a = 0.f,
        "top_k"_a = 0, "stream"_a = nb::none(),
        "A token per row of x drawn with u (uniform in [0, 1)) from softmax(x / temperature) after mlx_lm's "
        "top_p, min_p and top_k filters, as one CPU node.");
  m.def("sample_rows", &gk::sample_rows, "x"_a, "u"_a, "settings"_a, nb::kw_only(), "stream"_a = nb::none(),
        "sample() with each row's own settings (..., 4): temperature, top_p, min_p, top_k; rows drawn in parallel.");
  m.def(
      "clear_compile_cache", [] { mlx::core::detail::compile_clear_cache(mlx::core::detail::compile_cache()); },
      "Empty the calling thread's mx.compile cache (call it holding the GIL, before the thread ends).");
  m.def("isa", [] { return std::string(gk::active_impl()->name); }, "Instruction set the kernels use.");
  m.def("set_isa", &gk::set_isa, "want"_a, "Pick the ISA (generic, avx2, avx512, avx512vnni, amx; '' = best); returns the one chosen.");
  m.def("set_act_bits", &gk::set_act_bits, "bits"_a,
        "Decode path activations: 16-bit integer codes (default), 8 (as llama.cpp), 0 (float path only).");
  m.def("act_bits", &gk::act_bits, "The decode path's activation bits now: 16, 8 or 0 (float path only).");
  m.def("set_blas", &gk::set_blas, "on"_a, "Prefill through the process's optimized cblas_sgemm (default on).");
  m.def(
      "integer_rows",
      [](int64_t rows) {
        const gk::Impl* impl = gk::active_impl();
        return impl->int_supported != nullptr && impl->int_supported(gk::Q8_0, rows);
      },
      "rows"_a, "Whether a matmul of this many activation rows takes the active ISA's integer path "
      "(with activation bits other than 0).");
  m.def(
      "scratch_bytes",
      [](bool used) { return (used ? gk::g_scratch_used_bytes : gk::g_scratch_bytes).load(std::memory_order_relaxed); },
      "used"_a = false,
      "Bytes the kernels' threads keep as scratch from one call to the next, outside MLX's buffers; used: of "
      "the scratch used since release_scratch only.");
  m.def("release_scratch", &gk::release_scratch, "streams"_a = std::vector<mlx::core::Stream>{},
        "Have each thread free its scratch at its next use of it, keeping only what that use needs, or "
        "sooner where it runs no kernel: the calling thread's now, the threads of these CPU streams (none: the "
        "calling thread's default) once their queued work is done, the pool's workers' between regions.");
  m.def("blas", &gk::blas_name, "The library whose cblas_sgemm prefill uses ('' = own kernel).");
  m.def("block_size", &gk::block_size, "type"_a);
  m.def("type_size", &gk::type_size, "type"_a);
  m.attr("mlx_version") = std::to_string(MLX_VERSION_MAJOR) + "." + std::to_string(MLX_VERSION_MINOR) + "." +
                          std::to_string(MLX_VERSION_PATCH);
}
