// Work split across the kernels' threads (OpenMP where built with it, else std::thread).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace gmlx_kernels {

// Threads the kernels use: GMLX_KERNELS_THREADS, else one for each CPU the process may run on.
int n_threads();

// Keeps member i of an OpenMP team on the i-th CPU this process may run on, where the kernels use
// them all (Linux; GMLX_KERNELS_PIN=0 turns it off, as does GMLX_KERNELS_THREADS set to another
// count; without OpenMP the workers live one call and are left unpinned). Unpinned, the engine
// thread's graph building moved the team's threads about: the worker was switched out ~18 times a
// batch-1 step and every short parallel region waited for it (docs/ARCHITECTURE.md, decision 24).
void pin_member(int i);

// fn(c) for every chunk c < n_chunks, on nt threads taking chunks as they finish: on a shared
// machine a descheduled thread then costs its current chunk, not a fixed share of the rows.
template <class F>
void parallel_chunks(int nt, int64_t n_chunks, F&& fn) {
  if (nt <= 1 || n_chunks <= 1) {
    for (int64_t c = 0; c < n_chunks; c++) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) fn(c);
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
  {
    pin_member(omp_get_thread_num());
    work();
  }
#else
  std::vector<std::thread> ts;
  for (int i = 1; i < nt; i++) ts.emplace_back(work);
  work();
  for (auto& t : ts) t.join();
#endif
}

}  // namespace gmlx_kernels
