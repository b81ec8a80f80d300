// ForEach: run fn(0) .. fn(items - 1) on the calling thread and tasks scheduled on XLA's intra-op thread pool
// (the FFI handler's ffi::ThreadPool), one thread per item at most. Items are claimed from a counter; the caller
// waits only for items already claimed (running), so a pool whose threads are all busy cannot deadlock it. Each
// thread runs its items with flush-to-zero and denormals-are-zero set, as XLA:CPU's own kernels do. Shared by the
// handlers of kernels/cpu/csrc (ffi.py compiles them with this folder on the include path).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace remixer {

struct ForEachState {
  std::function<void(int64_t)> fn;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

inline void ForEachWork(ForEachState& s) {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // flush-to-zero and denormals-are-zero
#endif
  for (int64_t i; (i = s.next.fetch_add(1)) < s.items;) {
    s.fn(i);
    if (s.done.fetch_add(1) + 1 == s.items) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_all();
    }
  }
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(csr);
#endif
}

inline void ForEach(xla::ffi::ThreadPool& pool, int64_t items, std::function<void(int64_t)> fn) {
  if (items <= 0) return;
  const int64_t helpers = std::max<int64_t>(1, pool.num_threads()) - 1;
  auto state = std::make_shared<ForEachState>();
  state->fn = std::move(fn);
  state->items = items;
  for (int64_t i = 0; i < std::min(helpers, items - 1); ++i) pool.Schedule([state] { ForEachWork(*state); });
  ForEachWork(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == state->items; });
}

}  // namespace remixer
