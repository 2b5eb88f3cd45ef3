// RMSNorm, RoPE, attention and sampling as single MLX nodes on the CPU (layers_impl.cpp computes).
//
// MLX's CPU backend has no kernels for mx.fast.rms_norm, rope and scaled_dot_product_attention:
// it composes each from 8 to 25 graph nodes, and on a small model the per-node cost of those
// (thousands a decode step) outweighs the arithmetic. gmlx.kernels.fast routes the fast ops here.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "parallel.h"

namespace gmlx_kernels {

namespace {

// Below this many multiply-adds a call runs on one thread: waking others costs more.
constexpr int64_t PARALLEL_MIN_WORK = 1 << 16;

// Attention for more query rows than this goes by blocks of ATTN_BLOCK rows over tiles of keys.
constexpr int64_t ATTN_FEW_ROWS = 32;
constexpr int64_t ATTN_BLOCK = 64;
// Split decode attention: parts a thread takes (so a descheduled thread holds up one small part),
// and the fewest keys a part has.
constexpr int64_t ATTN_PARTS_PER_THREAD = 2;
constexpr int64_t ATTN_PART_KEYS = 64;

thread_local Scratch<float> tl_a, tl_b, tl_c, tl_d, tl_work, tl_parts;
thread_local Scratch<uint16_t> tl_hb, tl_hc;  // float16 keys and values copied row-major

float* work_buffer(size_t n) { return tl_work.get(n); }

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

mx::Stream cpu_stream(mx::StreamOrDevice s, const char* op) {
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) throw std::invalid_argument(std::string(op) + " runs on the CPU only");
  return stream;
}

mx::array f32(const mx::array& a, mx::Stream s) { return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32, s); }

// Strides (in elements) of a over the last `n` dims of a broadcast to `shape`: 0 where a has size 1
// or lacks the dim.
std::vector<int64_t> broadcast_strides(const mx::array& a, const mx::Shape& shape) {
  const size_t n = shape.size(), off = n - a.ndim();
  std::vector<int64_t> st(n, 0);
  for (size_t i = off; i < n; i++) st[i] = a.shape(i - off) == 1 ? 0 : a.strides()[i - off];
  return st;
}

// fn(r0, n) for chunks of `per` rows out of `rows`, on every thread when there is more than one.
template <class F>
void row_chunks(int64_t rows, int64_t per, F&& fn) {
  parallel_chunks(rows > per ? n_threads() : 1, (rows + per - 1) / per, [&](int64_t c) {
    const int64_t r0 = c * per;
    fn(r0, std::min(per, rows - r0));
  });
}

}  // namespace

template <class T>
const T* row_major(const mx::array& a, Scratch<T>& scratch) {
  T* buf = scratch.get(a.flags().row_contiguous ? 0 : a.size());  // a use, needing none, frees a released one
  if (a.flags().row_contiguous) return a.data<T>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = a.ndim();
  std::vector<int> idx(nd, 0);
  const T* src = a.data<T>();
  const int64_t inner = nd ? shape[nd - 1] : 1, inner_stride = nd ? strides[nd - 1] : 1;
  for (size_t o = 0; o < a.size(); o += inner) {
    int64_t base = 0;
    for (int d = 0; d < nd - 1; d++) base += idx[d] * strides[d];
    for (int64_t i = 0; i < inner; i++) buf[o + i] = src[base + i * inner_stride];
    for (int d = nd - 2; d >= 0 && ++idx[d] == shape[d]; d--) idx[d] = 0;
  }
  return buf;
}

template const float* row_major(const mx::array&, Scratch<float>&);

void RMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  auto x = mx::array::unsafe_weak_copy(inputs[0]);
  std::optional<mx::array> w;
  if (inputs.size() > 1) w = mx::array::unsafe_weak_copy(inputs[1]);
  enc.dispatch([x, w, out, eps = eps_]() mutable {
    const int64_t D = x.shape().back(), rows = D ? x.size() / D : 0;
    const float* xp = row_major(x, tl_a);
    const float* wp = w ? row_major(*w, tl_b) : nullptr;
    const Impl* impl = active_impl();
    const int64_t per = std::max<int64_t>(1, PARALLEL_MIN_WORK / std::max<int64_t>(D, 1));
    row_chunks(rows, per, [&](int64_t r0, int64_t n) {
      impl->rms_norm_rows(xp + r0 * D, wp, out.data<float>() + r0 * D, n, D, eps);
    });
  });
}

void LogSumExp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), out]() mutable {
    const int64_t N = x.shape().back(), rows = N ? x.size() / N : 0;
    const float* xp = row_major(x, tl_a);
    const Impl* impl = active_impl();
    const int64_t per = std::max<int64_t>(1, PARALLEL_MIN_WORK / std::max<int64_t>(N, 1));
    row_chunks(rows, per, [&](int64_t r0, int64_t n) {
      impl->logsumexp_rows(xp + r0 * N, out.data<float>() + r0, n, N);
    });
  });
}

void Argmax::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), out]() mutable {
    const int64_t V = x.shape().back(), rows = V ? x.size() / V : 0;
    const float* xp = row_major(x, tl_a);
    const Impl* impl = active_impl();
    row_chunks(rows, 1, [&](int64_t r0, int64_t) { out.data<uint32_t>()[r0] = (uint32_t)impl->argmax_row(xp + r0 * V, V); });
  });
}

void MaskTokens::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs, {0});  // in x's buffer where nothing else holds it
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), bits = mx::array::unsafe_weak_copy(inputs[1]),
                out]() mutable {
    const int64_t V = x.shape().back(), rows = V ? x.size() / V : 0, W = bits.shape().back();
    const float* xp = row_major(x, tl_a);
    const uint32_t* bp = bits.data<uint32_t>();  // int32 or uint32, contiguous (mask_tokens)
    float* yp = out.data<float>();
    row_chunks(rows, 1, [&](int64_t r, int64_t) {
      const float* xr = xp + r * V;
      float* yr = yp + r * V;
      for (int64_t w = 0; w * 32 < V; w++) {
        const uint32_t b = bp[r * W + w];
        const int64_t v0 = w * 32, n = std::min<int64_t>(32, V - v0);
        for (int64_t j = 0; j < n; j++) yr[v0 + j] = (b >> j) & 1u ? xr[v0 + j] : -INFINITY;
      }
    });
  });
}

namespace {

thread_local Scratch<float> tl_weights;
thread_local Scratch<int32_t> tl_index;

// The first of n weights whose running sum passes target (the last with weight where rounding
// leaves target out of reach).
int64_t pick(const float* w, int64_t n, double target) {
  double sum = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; i++) {
    if (w[i] <= 0.f) continue;
    sum += w[i];
    last = i;
    if (sum > target) return i;
  }
  return last;
}

// top_p's kept set among n candidates idx that hold it (every token outside ranks below them all):
// the tokens with less than `target` of the mass e (e^(x - m)) above them, and any tied with the last
// of those. A quickselect on the mass, O(n) expected where sorting a flat distribution's
// candidates (most of the vocabulary) would cost far more; moves them to idx[0 .. returned).
double mass(const float* e, const int32_t* a, const int32_t* b) {  // of the tokens a .. b, e their e^(x - m)
  double s = 0.0;
  for (; a < b; a++) s += e[*a];
  return s;
}

int64_t nucleus(const float* x, const float* e, int32_t* idx, int64_t n, double target) {
  int32_t *lo = idx, *hi = idx + n;  // the edge of the kept set lies in [lo, hi); [idx, lo) is kept
  double above = 0.0;                // the mass of [idx, lo)
  while (hi - lo > 32) {
    const float pivot = x[lo[(hi - lo) / 2]];
    int32_t* gt = std::partition(lo, hi, [&](int32_t i) { return x[i] > pivot; });
    int32_t* eq = std::partition(gt, hi, [&](int32_t i) { return x[i] == pivot; });
    const double m_gt = mass(e, lo, gt);
    if (above + m_gt >= target) {
      hi = gt;
      continue;
    }
    const double m_eq = mass(e, gt, eq);
    if (above + m_gt + m_eq >= target) return eq - idx;  // the edge is the pivot's ties: all kept
    above += m_gt + m_eq;
    lo = eq;
  }
  std::sort(lo, hi, [x](int32_t a, int32_t b) { return x[a] > x[b]; });
  int32_t* j = lo;
  for (; j < hi && above < target; j++) above += e[*j];
  while (j < hi && j > idx && x[*j] == x[j[-1]]) j++;
  return j - idx;
}

// The tokens at or above a threshold, into idx (ascending), lowered from m - 2 until enough(n) holds
// for the n gathered, or it reaches floor. A pass over the vocabulary each, cheap next to a sort.
// The threshold doubles to 8 nats below m, steps 2 at a time to 16, then doubles again: past 8 a
// flat row's count nearly triples every 2 nats (one row: 1,371 tokens at 8, 5,106 at 10, 93,383
// at 16), and ordering top_p's nucleus among 93,000 candidates took 1 ms where the extra passes
// take 0.1. Past 256 nats the threshold is floor.
template <class Enough>
int64_t gather_top(const Impl* impl, const float* x, int64_t V, float m, float floor, int32_t* idx, Enough enough) {
  for (float drop = 2.f;; drop = drop < 8.f || drop >= 16.f ? 2.f * drop : drop + 2.f) {
    const float t = std::max(drop > 256.f ? floor : m - drop, floor);
    const int64_t n = impl->gather_ge(x, V, t, idx);
    if (t == floor || enough(n)) return n;
  }
}

uint32_t sample_row(const Impl* impl, const float* x, int64_t V, float temperature, float top_p, float min_p,
                    int top_k, float u) {
  const int64_t top = impl->argmax_row(x, V);
  const float m = x[top];
  if (temperature <= 0.f || top_k == 1 || !std::isfinite(m)) return (uint32_t)top;
  const float k = 1.f / temperature;
  const bool by_p = top_p > 0.f && top_p < 1.f, by_min = min_p > 0.f, by_k = top_k > 0;
  float* w = tl_weights.get(V);
  if (!by_p && !by_min && !by_k) return (uint32_t)pick(w, V, u * (double)impl->exp_sum(x, V, m, k, w));
  // What the filters keep is a prefix of x in descending order: gather the tokens that may be in
  // it, and order only as many of them as top_k and top_p look at.
  int32_t* idx = tl_index.get(V);
  const float floor = by_min ? m + std::log(min_p) : -FLT_MAX;  // min_p's bound
  // the mass top_p measures, w[i] = e^(x[i] - m) at temperature 1 (overwritten only below)
  const double z = by_p ? impl->exp_sum(x, V, m, 1.f, w) : 0.0;
  const auto enough = [&](int64_t got) {
    return (by_k && got >= top_k) || (by_p && mass(w, idx, idx + got) >= top_p * z);
  };
  // min_p alone: its bound at once
  int64_t n = by_p || by_k ? gather_top(impl, x, V, m, floor, idx, enough) : impl->gather_ge(x, V, floor, idx);
  if (by_p) n = nucleus(x, w, idx, n, top_p * z);
  int64_t keep = n;
  if (by_k && n > top_k) {
    std::partial_sort(idx, idx + top_k, idx + n,
                      [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
    keep = top_k;
  }
  double total = 0.0;
  for (int64_t j = 0; j < keep; j++) total += w[j] = std::exp((x[idx[j]] - m) * k);
  return (uint32_t)idx[pick(w, keep, u * total)];
}

}  // namespace

void LogprobTop::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), tokens = mx::array::unsafe_weak_copy(inputs[1]),
                chosen = mx::array::unsafe_weak_copy(outputs[0]), ids = mx::array::unsafe_weak_copy(outputs[1]),
                values = mx::array::unsafe_weak_copy(outputs[2]), k = k_]() mutable {
    const int64_t R = x.shape(0), V = x.shape(1);
    const float* xp = row_major(x, tl_a);
    const uint32_t* tp = tokens.data<uint32_t>();  // contiguous (logprob_top)
    const Impl* impl = active_impl();
    row_chunks(R, 1, [&](int64_t r, int64_t) {
      const float* xr = xp + r * V;
      const float m = xr[impl->argmax_row(xr, V)];
      const float lse = std::isfinite(m) ? m + std::log(impl->exp_sum(xr, V, m, 1.f, nullptr)) : m;
      chosen.data<float>()[r] = tp[r] < V ? xr[tp[r]] - lse : NAN;
      if (k == 0) return;
      // the k largest among the tokens gathered from the top until they number k (-inf ones only
      // where fewer are finite)
      int32_t* idx = tl_index.get(V);
      const int64_t n = gather_top(impl, xr, V, m, -INFINITY, idx, [k](int64_t got) { return got >= k; });
      const int64_t kept = std::min<int64_t>(k, n);
      std::partial_sort(idx, idx + kept, idx + n,
                        [xr](int32_t a, int32_t b) { return xr[a] > xr[b] || (xr[a] == xr[b] && a < b); });
      for (int64_t j = 0; j < k; j++) {  // past the row's width (k > V is refused): none
        ids.data<uint32_t>()[r * k + j] = j < kept ? (uint32_t)idx[j] : 0;
        values.data<float>()[r * k + j] = j < kept ? xr[idx[j]] - lse : -INFINITY;
      }
    });
  });
}

void Sample::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), u = mx::array::unsafe_weak_copy(inputs[1]),
                settings = mx::array::unsafe_weak_copy(inputs[2]), out]() mutable {
    const int64_t V = x.shape().back(), rows = V ? x.size() / V : 0;
    const float* xp = row_major(x, tl_a);
    const float* up = row_major(u, tl_b);
    const float* sp = row_major(settings, tl_c);
    const Impl* impl = active_impl();
    row_chunks(rows, 1, [&](int64_t r, int64_t) {
      const float* set = sp + 4 * r;  // temperature, top_p, min_p, top_k
      out.data<uint32_t>()[r] = sample_row(impl, xp + r * V, V, set[0], set[1], std::clamp(set[2], 0.f, 1.f),
                                           (int)std::clamp(set[3], 0.f, 1e9f), up[r]);
    });
  });
}

namespace {

// The rotation's inputs from inputs[next] on: its frequencies, if given, and its offset array, if any.
void rotation_inputs(const Rotation& rot, const std::vector<mx::array>& inputs, size_t next,
                     std::optional<mx::array>& freqs, std::optional<mx::array>& offsets) {
  if (rot.has_freqs) freqs = mx::array::unsafe_weak_copy(inputs[next++]);
  if (next < inputs.size()) offsets = mx::array::unsafe_weak_copy(inputs[next]);
}

// A RoPE's work over rows of x (N, L, D), N = batch rows x heads, into y; inv_freq gets the
// frequencies as mx.fast.rope computes them: exp(-i * log(base) / half), or 1 / freqs, in float32.
RopeArgs rope_args(const Rotation& rot, const float* x, float* y, int64_t L, int64_t D, int64_t heads,
                   const std::optional<mx::array>& freqs, const std::optional<mx::array>& offsets,
                   std::vector<float>& inv_freq) {
  const int64_t half = rot.dims / 2;
  inv_freq.resize(half);
  const float* fp = freqs ? row_major(*freqs, tl_c) : nullptr;
  const float step = (float)(std::log((double)rot.base) / (double)half);
  for (int64_t i = 0; i < half; i++) inv_freq[i] = fp ? 1.f / fp[i] : std::exp((float)(-i) * step);
  RopeArgs a{x, y, L, D, heads, rot.dims, rot.traditional, inv_freq.data(), rot.scale, rot.offset, nullptr, false};
  if (offsets) {
    a.offsets = offsets->data<int32_t>();
    a.offsets_per_batch = offsets->size() > 1;
  }
  return a;
}

// Rows per chunk of a RoPE over rows of D: a whole sequence at least, so its positions' angles are
// computed once.
int64_t rope_rows_per_chunk(int64_t L, int64_t D) {
  return std::max<int64_t>(L, PARALLEL_MIN_WORK / (8 * std::max<int64_t>(D, 1)));
}

thread_local Scratch<float> tl_heads;

}  // namespace

void RoPE::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  auto x = mx::array::unsafe_weak_copy(inputs[0]);
  std::optional<mx::array> freqs, offsets;
  rotation_inputs(rot_, inputs, 1, freqs, offsets);
  enc.dispatch([x, freqs, offsets, out, rot = rot_]() mutable {
    const auto& shape = x.shape();
    const int64_t D = shape.back(), L = shape[shape.size() - 2], B = shape[0];
    const int64_t rows = x.size() / D;
    std::vector<float> inv_freq;
    const RopeArgs a = rope_args(rot, row_major(x, tl_a), out.data<float>(), L, D, rows / (B * L), freqs, offsets, inv_freq);
    const Impl* impl = active_impl();
    row_chunks(rows, rope_rows_per_chunk(L, D), [&](int64_t r0, int64_t n) {
      impl->rope_rows(a, r0, r0 + n, work_buffer(rot.dims));
    });
  });
}

void Heads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  auto x = mx::array::unsafe_weak_copy(inputs[0]);
  std::optional<mx::array> w, freqs, offsets;
  if (has_norm_) w = mx::array::unsafe_weak_copy(inputs[1]);
  rotation_inputs(rot_, inputs, has_norm_ ? 2 : 1, freqs, offsets);
  enc.dispatch([x, w, freqs, offsets, out, n = n_, eps = eps_, rot = rot_]() mutable {
    const int64_t B = x.shape(0), L = x.shape(1), D = x.shape(2) / n, rows = B * n * L;
    const float* xp = row_major(x, tl_a);
    const float* wp = w ? row_major(*w, tl_b) : nullptr;
    float* yp = out.data<float>();
    // rotated heads are normalised (or copied) in head order into a buffer first, so RoPE reads
    // its input as rope() does, apart from its output
    float* normed = yp;
    std::vector<float> inv_freq;
    RopeArgs a{};
    if (rot.dims > 0) {
      normed = tl_heads.get(out.size());
      a = rope_args(rot, normed, yp, L, D, n, freqs, offsets, inv_freq);
    }
    const Impl* impl = active_impl();
    row_chunks(rows, rope_rows_per_chunk(L, D), [&](int64_t r0, int64_t count) {
      for (int64_t r = r0; r < r0 + count; r++) {  // row r of (B, n, L, D) is head r / L % n of x's row (b, l)
        const int64_t b = r / (n * L), h = r / L % n, l = r % L;
        const float* src = xp + ((b * L + l) * n + h) * D;
        if (wp)
          impl->rms_norm_rows(src, wp, normed + r * D, 1, D, eps);
        else
          std::copy(src, src + D, normed + r * D);
      }
      if (rot.dims > 0) impl->rope_rows(a, r0, r0 + count, work_buffer(rot.dims));
    });
  });
}

void AddNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  // h takes r's buffer and the normalised h x's, where the graph holds them alone, as MLX's own add
  // takes its operand's: the composed ops' peak memory (a long prefill's) and no more.
  auto& enc = prepare(inputs, outputs, {1, 0});
  auto h = mx::array::unsafe_weak_copy(outputs[0]);
  std::optional<mx::array> y, next_w;
  if (outputs.size() > 1) {
    y = mx::array::unsafe_weak_copy(outputs[1]);
    next_w = mx::array::unsafe_weak_copy(inputs[3]);
  }
  enc.dispatch([x = mx::array::unsafe_weak_copy(inputs[0]), r = mx::array::unsafe_weak_copy(inputs[1]),
                w = mx::array::unsafe_weak_copy(inputs[2]), next_w, h, y, eps = eps_,
                next_eps = next_eps_]() mutable {
    const int64_t D = x.shape().back(), rows = D ? x.size() / D : 0;
    const float* xp = row_major(x, tl_a);
    const float* rp = row_major(r, tl_b);
    const float* wp = row_major(w, tl_c);
    const float* nwp = next_w ? row_major(*next_w, tl_d) : nullptr;
    const Impl* impl = active_impl();
    row_chunks(rows, std::max<int64_t>(1, PARALLEL_MIN_WORK / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t n) {
      float* t = work_buffer(D);
      for (int64_t row = r0; row < r0 + n; row++) {  // a row's x and r are read before h and y overwrite them
        float* hr = h.data<float>() + row * D;
        const float* xr = xp + row * D;
        impl->rms_norm_rows(rp + row * D, wp, t, 1, D, eps);
        for (int64_t i = 0; i < D; i++) hr[i] = xr[i] + t[i];
        if (y) impl->rms_norm_rows(hr, nwp, y->data<float>() + row * D, 1, D, next_eps);
      }
    });
  });
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  auto out = mx::array::unsafe_weak_copy(outputs[0]);
  auto q = mx::array::unsafe_weak_copy(inputs[0]);
  auto k = mx::array::unsafe_weak_copy(inputs[1]);
  auto v = mx::array::unsafe_weak_copy(inputs[2]);
  std::optional<mx::array> mask;
  if (inputs.size() > 3) mask = mx::array::unsafe_weak_copy(inputs[3]);
  enc.dispatch([q, k, v, mask, out, scale = scale_, causal = causal_]() mutable {
    // keys and values are usually a view of a KV cache's buffer: read through their strides
    // when each row is contiguous, else copy
    const bool half = k.dtype() == mx::float16;
    auto kv_rows = [half](const mx::array& a, Scratch<float>& f, Scratch<uint16_t>& h) -> const void* {
      if (half) return a.strides()[3] == 1 ? a.data<uint16_t>() : row_major(a, h);
      return a.strides()[3] == 1 ? a.data<float>() : row_major(a, f);
    };
    const void* kp = kv_rows(k, tl_b, tl_hb);
    const void* vp = kv_rows(v, tl_c, tl_hc);
    auto strides3 = [](const mx::array& a, bool copied) {
      const int64_t T = a.shape(2), D = a.shape(3), H = a.shape(1);
      return copied ? std::vector<int64_t>{H * T * D, T * D, D}
                    : std::vector<int64_t>{a.strides()[0], a.strides()[1], a.strides()[2]};
    };
    const auto ks = strides3(k, k.strides()[3] != 1), vs = strides3(v, v.strides()[3] != 1);
    AttentionArgs a{row_major(q, tl_a), kp, vp, half, out.data<float>(),
                    q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3),
                    {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]}, nullptr, false, {0, 0, 0, 0},
                    causal, scale};
    if (mask) {
      a.mask = mask->data<uint8_t>();
      a.mask_bool = mask->dtype() == mx::bool_;
      const auto ms = broadcast_strides(*mask, {(int)a.B, (int)a.Hq, (int)a.L, (int)a.T});
      for (int i = 0; i < 4; i++) a.ms[i] = ms[i];
    }
    const int nt = a.B * a.Hq * a.L * a.T * a.D < PARALLEL_MIN_WORK ? 1 : n_threads();
    const Impl* impl = active_impl();
    if (a.L > ATTN_FEW_ROWS) {
      // work items: blocks of ATTN_BLOCK query rows of one head, the (causal) last blocks, which
      // see the most keys, first
      const int64_t blocks = (a.L + ATTN_BLOCK - 1) / ATTN_BLOCK, heads = a.B * a.Hq;
      parallel_chunks(nt, heads * blocks, [&](int64_t c) {
        const int64_t l0 = (blocks - 1 - c / heads) * ATTN_BLOCK, l1 = std::min(l0 + ATTN_BLOCK, a.L);
        impl->attend_rows(a, c % heads / a.Hq, c % a.Hq, l0, l1, work_buffer((size_t)attend_rows_work(l1 - l0, a.D)));
      });
      return;
    }
    // few query rows (decode): items are (batch row, the query heads sharing a KV head) by a range
    // of keys, so each key is read once. Where there are fewer such groups than threads the keys
    // are split (each part's sums are merged below), not the heads: a decode step reads the whole
    // cache, and split by heads each thread read all of it (docs/ARCHITECTURE.md, decision 27).
    const int64_t G = a.Hq / a.Hkv, groups = a.B * a.Hkv, rows = G * a.L, D = a.D;
    const int64_t parts =
        groups >= nt ? 1
                    : std::clamp<int64_t>((ATTN_PARTS_PER_THREAD * nt + groups - 1) / groups, 1,
                                          std::max<int64_t>(1, a.T / ATTN_PART_KEYS));
    const int64_t stride = rows * (D + 2);  // a part's (m, l) pairs and its rows' outputs
    float* part = tl_parts.get(groups * parts * stride);
    parallel_chunks(nt, groups * parts, [&](int64_t c) {
      const int64_t g = c / parts, p = c % parts, h0 = g % a.Hkv * G;
      const int64_t t0 = a.T * p / parts, t1 = a.T * (p + 1) / parts;
      float* mine = part + c * stride;
      impl->attend(a, g / a.Hkv, h0, h0 + G, t0, t1, work_buffer((size_t)(rows * (t1 - t0))), mine, mine + 2 * rows);
    });
    for (int64_t g = 0; g < groups; g++) {
      const float* first = part + g * parts * stride;
      float* o = a.out + (g / a.Hkv * a.Hq + g % a.Hkv * G) * a.L * D;  // the group's rows lie together
      for (int64_t r = 0; r < rows; r++, o += D) {
        float m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < parts; p++) m = std::max(m, first[p * stride + 2 * r]);
        std::fill(o, o + D, 0.f);
        if (m == -INFINITY) continue;  // nothing to attend to (a padding row): zeros, not NaN
        for (int64_t p = 0; p < parts; p++) {
          const float* pp = first + p * stride;
          const float w = std::exp(pp[2 * r] - m);  // 0 for a part that saw no key
          sum += w * pp[2 * r + 1];
          const float* po = pp + 2 * rows + r * D;
          for (int64_t d = 0; d < D; d++) o[d] += w * po[d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
      }
    }
  });
}

mx::array rms_norm(const mx::array& x_in, const std::optional<mx::array>& w, float eps, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "rms_norm");
  check(x_in.ndim() >= 1, "rms_norm: x must have at least one dimension");
  const auto dtype = x_in.dtype();
  std::vector<mx::array> inputs{f32(x_in, stream)};
  if (w) {
    check(w->ndim() == 1 && w->shape(0) == x_in.shape().back(), "rms_norm: weight must be (D,)");
    inputs.push_back(f32(*w, stream));
  }
  mx::array y(x_in.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps), std::move(inputs));
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

mx::array logsumexp(const mx::array& x_in, bool keepdims, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "logsumexp");
  check(x_in.ndim() >= 1 && x_in.shape().back() > 0, "logsumexp: x must have a non-empty last axis");
  const auto dtype = x_in.dtype();
  auto shape = x_in.shape();
  shape.back() = 1;
  mx::array y(shape, mx::float32, std::make_shared<LogSumExp>(stream), {f32(x_in, stream)});
  if (!keepdims) y = mx::squeeze(y, -1, stream);
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

mx::array argmax(const mx::array& x_in, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "argmax");
  check(x_in.ndim() >= 1 && x_in.shape().back() > 0, "argmax: x must have a non-empty last axis");
  auto shape = x_in.shape();
  shape.pop_back();
  return mx::array(shape, mx::uint32, std::make_shared<Argmax>(stream), {f32(x_in, stream)});
}

std::vector<mx::array> logprob_top(const mx::array& x, const mx::array& tokens, int k, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "logprob_top");
  check(x.ndim() == 2 && x.shape(1) > 0, "logprob_top: x must be (R, V)");
  check(tokens.ndim() == 1 && tokens.shape(0) == x.shape(0), "logprob_top: tokens must be (R,)");
  check(k >= 0 && k <= x.shape(1), "logprob_top: k must be in [0, V]");
  return mx::array::make_arrays({{x.shape(0)}, {x.shape(0), k}, {x.shape(0), k}},
                                {mx::float32, mx::uint32, mx::float32}, std::make_shared<LogprobTop>(stream, k),
                                {f32(x, stream), mx::contiguous(mx::astype(tokens, mx::uint32, stream), false, stream)});
}

mx::array mask_tokens(const mx::array& x_in, const mx::array& bits, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "mask_tokens");
  check(x_in.ndim() >= 1 && x_in.shape().back() > 0, "mask_tokens: x must have a non-empty last axis");
  check(bits.dtype() == mx::int32 || bits.dtype() == mx::uint32, "mask_tokens: bits must be int32 or uint32");
  auto words = x_in.shape();
  words.back() = (int)((x_in.shape().back() + 31) / 32);
  check(bits.ndim() == x_in.ndim() && bits.shape().back() >= words.back(), "mask_tokens: bits must cover x's last axis");
  words.back() = bits.shape().back();
  check(bits.shape() == words, "mask_tokens: bits must have x's leading shape");
  return mx::array(x_in.shape(), mx::float32, std::make_shared<MaskTokens>(stream),
                   {f32(x_in, stream), mx::contiguous(bits, false, stream)});
}

mx::array sample_rows(const mx::array& x_in, const mx::array& u, const mx::array& settings, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "sample");
  check(x_in.ndim() >= 1 && x_in.shape().back() > 0, "sample: x must have a non-empty last axis");
  auto rows = x_in.shape();
  rows.pop_back();
  check(u.shape() == rows, "sample: u must have one value per row of x");
  auto per_row = rows;
  per_row.push_back(4);
  check(settings.shape() == per_row, "sample: settings must be 4 values per row of x");
  check(x_in.shape().back() <= INT32_MAX, "sample: the last axis is too long");
  return mx::array(rows, mx::uint32, std::make_shared<Sample>(stream),
                   {f32(x_in, stream), f32(u, stream), f32(settings, stream)});
}

mx::array sample(const mx::array& x_in, const mx::array& u, float temperature, float top_p, float min_p, int top_k,
                 mx::StreamOrDevice s) {
  check(top_k >= 0 && min_p >= 0.f && min_p <= 1.f, "sample: top_k must be >= 0 and min_p in [0, 1]");
  auto per_row = u.shape();
  per_row.push_back(4);
  const mx::array one({temperature, top_p, min_p, (float)top_k});
  return sample_rows(x_in, u, mx::broadcast_to(one, per_row, cpu_stream(s, "sample")), s);
}

namespace {

// A RoPE's settings, checked, with its inputs after x and its norm weight pushed: freqs if given,
// the offset unless static. B: x's batch rows, D: its features.
Rotation rotation(const char* op, int B, int D, int dims, bool traditional, const std::optional<float>& base,
                  float scale, const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
                  std::vector<mx::array>& inputs, mx::Stream stream) {
  const std::string name(op);
  check(dims > 0 && dims % 2 == 0 && dims <= D, (name + ": dims must be even and at most D").c_str());
  check(base.has_value() != freqs.has_value(), (name + ": give exactly one of base and freqs").c_str());
  Rotation rot{dims, traditional, base.value_or(0.f), scale, 0, freqs.has_value()};
  if (freqs) {
    check(freqs->ndim() == 1 && freqs->shape(0) == dims / 2, (name + ": freqs must be (dims / 2,)").c_str());
    inputs.push_back(f32(*freqs, stream));
  }
  if (auto* o = std::get_if<mx::array>(&offset)) {
    check(o->size() == 1 || (o->ndim() == 1 && o->shape(0) == B),
          (name + ": an offset array must hold one value or one per batch row").c_str());
    inputs.push_back(o->dtype() == mx::int32 ? *o : mx::astype(*o, mx::int32, stream));
  } else {
    rot.offset = std::get<int>(offset);
  }
  return rot;
}

}  // namespace

mx::array rope(const mx::array& x_in, int dims, bool traditional, std::optional<float> base, float scale,
               const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "rope");
  check(x_in.ndim() >= 3, "rope: x must be (B, ..., L, D)");
  const auto dtype = x_in.dtype();
  std::vector<mx::array> inputs{f32(x_in, stream)};
  const Rotation rot =
      rotation("rope", x_in.shape(0), x_in.shape().back(), dims, traditional, base, scale, offset, freqs, inputs, stream);
  mx::array y(x_in.shape(), mx::float32, std::make_shared<RoPE>(stream, rot), std::move(inputs));
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

mx::array heads(const mx::array& x_in, int n, const std::optional<mx::array>& w, float eps, int dims,
                bool traditional, std::optional<float> base, float scale, const std::variant<int, mx::array>& offset,
                const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "heads");
  check(x_in.ndim() == 3, "heads: x must be (B, L, n * D)");
  check(n > 0 && x_in.shape(2) % n == 0, "heads: x's last dimension must be a multiple of n");
  const int D = x_in.shape(2) / n;
  const auto dtype = x_in.dtype();
  std::vector<mx::array> inputs{f32(x_in, stream)};
  if (w) {
    check(w->ndim() == 1 && w->shape(0) == D, "heads: the norm weight must be (D,)");
    inputs.push_back(f32(*w, stream));
  }
  const Rotation rot =
      dims > 0 ? rotation("heads", x_in.shape(0), D, dims, traditional, base, scale, offset, freqs, inputs, stream)
               : Rotation{};
  mx::array y({x_in.shape(0), n, x_in.shape(1), D}, mx::float32,
              std::make_shared<Heads>(stream, n, w.has_value(), eps, rot), std::move(inputs));
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

std::vector<mx::array> add_norm(const mx::array& x, const mx::array& r, const mx::array& w, float eps,
                                const std::optional<mx::array>& next_w, float next_eps, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "add_norm");
  check(x.ndim() >= 1 && x.shape() == r.shape(), "add_norm: x and r must have one shape");
  const int D = x.shape().back();
  check(w.ndim() == 1 && w.shape(0) == D, "add_norm: the weight must be (D,)");
  const auto dtype = x.dtype();
  std::vector<mx::array> inputs{f32(x, stream), f32(r, stream), f32(w, stream)};
  if (next_w) {
    check(next_w->ndim() == 1 && next_w->shape(0) == D, "add_norm: the next weight must be (D,)");
    inputs.push_back(f32(*next_w, stream));
  }
  const size_t outs = next_w ? 2 : 1;
  auto ys = mx::array::make_arrays(std::vector<mx::Shape>(outs, x.shape()), std::vector<mx::Dtype>(outs, mx::float32),
                                   std::make_shared<AddNorm>(stream, eps, next_eps), std::move(inputs));
  if (dtype != mx::float32)
    for (auto& y : ys) y = mx::astype(y, dtype, stream);
  return ys;
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                    const std::optional<mx::array>& mask, bool causal, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "attention");
  check(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "attention: q, k and v must be 4-D");
  check(k.shape() == v.shape(), "attention: k and v must have one shape");
  check(q.shape(0) == k.shape(0) && q.shape(3) == k.shape(3), "attention: q and k differ in batch or head size");
  check(k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0, "attention: query heads must be a multiple of KV heads");
  check(!causal || q.shape(2) <= k.shape(2), "attention: a causal mask needs at least as many keys as queries");
  const auto dtype = q.dtype();
  // float16 keys and values (a float16 KV cache) are read as they are: widening them here would
  // write the whole cache out again as float32 on every call
  const bool half = k.dtype() == mx::float16 && v.dtype() == mx::float16;
  std::vector<mx::array> inputs{f32(q, stream), half ? k : f32(k, stream), half ? v : f32(v, stream)};
  if (mask) {
    check(mask->ndim() <= 4, "attention: the mask has more than 4 dimensions");
    const mx::Shape full{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    for (int i = 0; i < mask->ndim(); i++) {
      const int m = mask->shape(i), want = full[4 - mask->ndim() + i];
      check(m == 1 || m == want, "attention: the mask does not broadcast to (B, Hq, L, T)");
    }
    inputs.push_back(mask->dtype() == mx::bool_ ? *mask : f32(*mask, stream));
  }
  mx::array y(q.shape(), mx::float32, std::make_shared<Attention>(stream, scale, causal), std::move(inputs));
  return dtype == mx::float32 ? y : mx::astype(y, dtype, stream);
}

void PlaceRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& enc = prepare(inputs, outputs);
  std::vector<mx::array> sources;
  for (const auto& in : inputs) sources.push_back(mx::array::unsafe_weak_copy(in));
  enc.dispatch([sources, out = mx::array::unsafe_weak_copy(outputs[0]), rows = rows_, ats = ats_]() mutable {
    if (out.size() == 0) return;
    const int64_t R = out.shape(0), H = out.shape(1), T = out.shape(2), D = out.shape(3);
    const size_t esz = out.itemsize();
    // each output row's sources, in slot order
    std::vector<std::vector<int>> by_row(R);
    for (int i = 0; i < (int)sources.size(); i++)
      for (int64_t r = rows[i]; r < rows[i] + sources[i].shape(0); r++) by_row[r].push_back(i);
    for (auto& v : by_row) std::sort(v.begin(), v.end(), [&](int a, int b) { return ats[a] < ats[b]; });
    // work items: a (row, head)'s slots in pieces of about 256 KiB, so two threads share even one row
    const int64_t piece = std::max<int64_t>(1, (int64_t(256) << 10) / (D * (int64_t)esz));
    const int64_t pieces = (T + piece - 1) / piece;
    uint8_t* o = out.data<uint8_t>();
    parallel_chunks(n_threads(), R * H * pieces, [&](int64_t c) {
      const int64_t r = c / (H * pieces), h = c / pieces % H, t0 = c % pieces * piece;
      const int64_t t1 = std::min(t0 + piece, T), row = D * (int64_t)esz;
      uint8_t* dst = o + ((r * H + h) * T) * row;
      int64_t at = t0;  // slots before it are written
      for (int i : by_row[r]) {
        const mx::array& src = sources[i];
        const int64_t a = std::max<int64_t>(ats[i], at), b = std::min<int64_t>(ats[i] + src.shape(2), t1);
        if (a >= b) continue;
        std::memset(dst + at * row, 0, (a - at) * row);
        const auto& st = src.strides();
        const uint8_t* from = src.data<uint8_t>() + ((r - rows[i]) * st[0] + h * st[1]) * (int64_t)esz;
        if (st[2] == D)
          std::memcpy(dst + a * row, from + (a - ats[i]) * D * esz, (b - a) * row);
        else
          for (int64_t t = a; t < b; t++) std::memcpy(dst + t * row, from + (t - ats[i]) * st[2] * esz, row);
        at = b;
      }
      std::memset(dst + at * row, 0, (t1 - at) * row);
    });
  });
}

mx::array place_rows(const std::vector<mx::array>& sources, const std::vector<int>& rows, const std::vector<int>& ats,
                     const std::vector<int>& dims, mx::Dtype dtype, mx::StreamOrDevice s) {
  auto stream = cpu_stream(s, "place_rows");
  check(dims.size() == 4, "place_rows: the shape must be (rows, heads, slots, features)");
  for (int n : dims) check(n >= 0, "place_rows: a dimension is negative");
  check(rows.size() == sources.size() && ats.size() == sources.size(), "place_rows: a row and a slot for each source");
  std::vector<mx::array> inputs;
  for (size_t i = 0; i < sources.size(); i++) {
    const mx::array& src = sources[i];
    check(src.ndim() == 4 && src.dtype() == dtype, "place_rows: a source is not 4-D of the output's dtype");
    check(src.shape(1) == dims[1] && src.shape(3) == dims[3], "place_rows: a source's heads or features differ");
    check(rows[i] >= 0 && rows[i] + src.shape(0) <= dims[0] && ats[i] >= 0 && ats[i] + src.shape(2) <= dims[2],
          "place_rows: a source falls outside the output");
    inputs.push_back(src.strides().back() == 1 || src.size() == 0 ? src : mx::contiguous(src, false, stream));
  }
  for (int r = 0; r < dims[0]; r++) {  // the sources of a row may not overlap
    std::vector<std::pair<int, int>> spans;
    for (size_t i = 0; i < sources.size(); i++)
      if (rows[i] <= r && r < rows[i] + sources[i].shape(0)) spans.push_back({ats[i], ats[i] + sources[i].shape(2)});
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); i++) check(spans[i].first >= spans[i - 1].second, "place_rows: sources overlap");
  }
  const mx::Shape shape(dims.begin(), dims.end());
  return mx::array(shape, dtype, std::make_shared<PlaceRows>(stream, shape, rows, ats), std::move(inputs));
}

}  // namespace gmlx_kernels
