// The kernels' threads: how many, where they run, and the pool that runs a parallel region.
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

namespace gmlx_kernels {

namespace {

// The CPUs this process may run on, in order (a container's cpuset, taskset's mask); empty where
// that is not known.
const std::vector<int>& allowed_cpus() {
  static const std::vector<int> cpus = [] {
    std::vector<int> out;
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
      for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) out.push_back(c);
#endif
    return out;
  }();
  return cpus;
}

// Keeps the thread that is member i of a region (0: the caller, MLX's stream thread; i > 0: the
// pool's worker i) on the i-th CPU this process may run on, where the kernels use them all
// (Linux; GMLX_KERNELS_PIN=0 turns it off, as does GMLX_KERNELS_THREADS set to another count).
// Unpinned, the engine thread's graph building moved the members about: the worker was switched
// out ~18 times a batch-1 step and every short parallel region waited for it (decision 24).
void pin_member(int i) {
#ifdef __linux__
  // Fewer threads than CPUs leave the rest to other work, which could be on any of them, and more
  // would share CPUs anyway.
  static const std::vector<int> cpus = [] {
    const char* env = std::getenv("GMLX_KERNELS_PIN");
    if ((env && std::string(env) == "0") || (int)allowed_cpus().size() != n_threads()) return std::vector<int>{};
    return allowed_cpus();
  }();
  thread_local int pinned = -1;
  if (i >= (int)cpus.size() || pinned == cpus[i]) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[i], &one);
  if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0) pinned = cpus[i];
#else
  (void)i;
#endif
}

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle worker waits for the next region before it sleeps. Most gaps between a batch-1
// decode step's regions are 2-16 microseconds; about a third are 32-128, the stream thread's own
// serial nodes. The kernels have a thread for every CPU, so a worker spinning through those takes
// the core from the Python threads building the next step (the engine's graph, ~4 ms of CPU a
// batch-1 step), which then preempt the kernels' threads mid-region. 20 covers the short gaps and
// sleeps through the rest: batch-1 decode 5-9 % faster than with 200 (docs/ARCHITECTURE.md,
// decision 28).
std::chrono::microseconds spin_budget() {
  static const auto us = [] {
    const char* s = std::getenv("GMLX_KERNELS_SPIN_US");
    return std::chrono::microseconds(s ? std::atoi(s) : 20);
  }();
  return us;
}

// One region at a time: callers on several MLX streams (several models, a drafter) queue on `run`.
// A worker joins a region by raising `inside` and then finding it `open`; the caller closes it once
// every chunk is taken and returns when `inside` is back to 0, so no worker touches fn or ctx after.
// Both checks are sequentially consistent: a worker either counts as inside before the close or
// sees the region closed. Workers that find no region after their spin sleep on `wake`; the caller
// wakes them only where one does (`sleepers`).
struct Pool {
  std::mutex run;
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> open{false};
  std::atomic<int> inside{0};
  std::atomic<int64_t> next{0};
  int64_t n_chunks = 0;
  int members = 0;  // the caller and workers 1 .. members - 1
  void (*fn)(void*, int64_t) = nullptr;
  void* ctx = nullptr;

  std::mutex sleep_mutex;
  std::condition_variable wake;
  std::atomic<int> sleepers{0};
  std::atomic<uint64_t> drops{0};  // drop_released_in_workers calls so far
  std::vector<std::thread> workers;

  void take_chunks() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) fn(ctx, c);
  }

  void work(int index) {
    pin_member(index);
    uint64_t seen = 0, dropped = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; generation.load(std::memory_order_acquire) == seen; spins++) {
        relax();
        // the clock every 32 pauses: a pause is 40-140 cycles, so ~0.5-1.5 microseconds apart
        if ((spins & 31) == 31 && std::chrono::steady_clock::now() - start > spin_budget()) {
          std::unique_lock lock(sleep_mutex);
          sleepers.fetch_add(1);
          wake.wait(lock, [&] { return generation.load() != seen || drops.load() != dropped; });
          sleepers.fetch_sub(1);
          if (const uint64_t d = drops.load(); d != dropped) {
            lock.unlock();
            dropped = d;
            drop_released_buffers();  // between regions: none of this thread's buffers is in use
          }
        }
      }
      seen = generation.load(std::memory_order_acquire);
      inside.fetch_add(1);
      if (open.load() && index < members) take_chunks();
      inside.fetch_sub(1);
    }
  }

  void region(int nt, int64_t chunks, void (*f)(void*, int64_t), void* c) {
    std::lock_guard lock(run);
    pin_member(0);
    if (workers.empty())
      for (int i = 1; i < n_threads(); i++) workers.emplace_back([this, i] { work(i); });
    members = std::min<int>(nt, (int)workers.size() + 1);
    n_chunks = chunks, fn = f, ctx = c;
    next.store(0, std::memory_order_relaxed);
    open.store(true);
    generation.fetch_add(1);
    if (sleepers.load() > 0) {
      { std::lock_guard sleeping(sleep_mutex); }  // a worker between its check and its wait sees the new region
      wake.notify_all();
    }
    take_chunks();
    open.store(false);
    for (int spins = 1; inside.load() != 0; spins++) {
      relax();
      if ((spins & 1023) == 0) std::this_thread::yield();  // a member descheduled mid-chunk
    }
  }
};

// Never destroyed: its workers run until the process ends (joining them at static destruction
// would wait forever).
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

std::vector<ThreadBuffer*>& this_thread_buffers() {
  thread_local std::vector<ThreadBuffer*> buffers;
  return buffers;
}

}  // namespace

// The list is constructed before the first buffer registers, so it outlives them all.
ThreadBuffer::ThreadBuffer() { this_thread_buffers().push_back(this); }

ThreadBuffer::~ThreadBuffer() { std::erase(this_thread_buffers(), this); }

void drop_released_buffers() {
  for (ThreadBuffer* b : this_thread_buffers()) b->drop_if_released();
}

void drop_released_in_workers() {
  Pool& p = pool();
  {
    std::lock_guard lock(p.sleep_mutex);  // a worker between its check and its wait sees it
    p.drops.fetch_add(1);
  }
  p.wake.notify_all();  // a worker that is not asleep drops when it next sleeps
}

int n_threads() {
  static int n = [] {
    if (const char* s = std::getenv("GMLX_KERNELS_THREADS")) {
      int v = std::atoi(s);
      if (v > 0) return v;
    }
    if (!allowed_cpus().empty()) return (int)allowed_cpus().size();
    unsigned hw = std::thread::hardware_concurrency();
    return hw ? (int)hw : 1;
  }();
  return n;
}

void run_chunks(int nt, int64_t n_chunks, void (*fn)(void*, int64_t), void* ctx) {
  pool().region(nt, n_chunks, fn, ctx);
}

}  // namespace gmlx_kernels
