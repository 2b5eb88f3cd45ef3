// Work split across the kernels' threads: the calling thread and a pool of workers that lives as
// long as the process (docs/ARCHITECTURE.md, decision 28).
#pragma once

#include <cstdint>
#include <type_traits>

namespace gmlx_kernels {

// Threads the kernels use: GMLX_KERNELS_THREADS, else one for each CPU the process may run on.
int n_threads();

// fn(ctx, c) for every chunk c < n_chunks, on the calling thread and up to nt - 1 of the pool's
// workers, each taking chunks as it finishes one: on a shared machine a descheduled thread then
// costs its current chunk, not a fixed share of the rows. Returns when every chunk is done. Regions
// run one at a time; fn must not start one of its own.
void run_chunks(int nt, int64_t n_chunks, void (*fn)(void*, int64_t), void* ctx);

// Memory a thread keeps from one call of the kernels to the next (ops.h's Scratch). Each registers
// with its own thread, so that a thread running no kernel can free those a release let go.
class ThreadBuffer {
 public:
  ThreadBuffer(const ThreadBuffer&) = delete;
  ThreadBuffer& operator=(const ThreadBuffer&) = delete;
  // Frees what it holds if it was released since its thread last used it.
  virtual void drop_if_released() = 0;

 protected:
  ThreadBuffer();
  ~ThreadBuffer();
};

// Every ThreadBuffer of the calling thread drops what was released; the thread must be running no
// kernel (a kernel's buffers are valid until its thread's next use of them).
void drop_released_buffers();
// The same on each of the pool's workers, each on its own thread once it is outside a region.
void drop_released_in_workers();

template <class F>
void parallel_chunks(int nt, int64_t n_chunks, F&& fn) {
  if (nt <= 1 || n_chunks <= 1) {
    for (int64_t c = 0; c < n_chunks; c++) fn(c);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  run_chunks(nt, n_chunks, [](void* f, int64_t c) { (*static_cast<Fn*>(f))(c); }, (void*)&fn);
}

}  // namespace gmlx_kernels
