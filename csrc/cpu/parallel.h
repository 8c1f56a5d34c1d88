// Work sharing for the attention kernels. A thread that waits at a barrier spins
// (GOMP_SPINCOUNT=4000 under `pagedserve serve`, engine/platform/openmp.py), holding a core
// the caller or another process could use, then sleeps; under OMP_WAIT_POLICY=PASSIVE
// (a crowded machine's choice) it sleeps at once, and waking it costs tens of
// microseconds (measured ~30 us on a 2-vCPU VM), as much as a decode step's
// attention for a small batch. So a parallel region has no
// barrier but its closing one, and the calling thread arrives there last:
// helper threads stop taking items while a few remain, the caller takes them.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>

namespace pagedserve {
namespace cpu {

// Items a helper thread leaves to the calling thread (about one item each for
// the caller's own, the helper's last and the slack between them).
constexpr int64_t kCallerTail = 2;

inline void spin_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Runs body(i) for i in [0, n), items handed out one at a time from `next`
// (shared, starting at 0). Call it from every thread of a parallel region.
template <typename Body>
void share_items(std::atomic<int64_t>& next, int64_t n, Body&& body) {
  const bool caller = omp_get_thread_num() == 0;
  for (;;) {
    if (!caller && n - next.load(std::memory_order_relaxed) <= kCallerTail) return;
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    body(i);
  }
}

// share_items, with each thread taking its next item as it starts one: body(item, index, following) gets the
// thread's index-th item and the one it does next (-1: none), so it can prefetch that one's data meanwhile.
template <typename Body>
void share_items_ahead(std::atomic<int64_t>& next, int64_t n, Body&& body) {
  const bool caller = omp_get_thread_num() == 0;
  auto take = [&]() -> int64_t {
    if (!caller && n - next.load(std::memory_order_relaxed) <= kCallerTail) return -1;
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  int64_t item = take();
  for (int64_t index = 0; item >= 0; ++index) {
    const int64_t following = take();
    body(item, index, following);
    item = following;
  }
}

}  // namespace cpu
}  // namespace pagedserve
