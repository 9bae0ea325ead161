// A small persistent pool for the CPU kernel. MLX's CPU encoder runs each dispatched task on one
// worker thread per stream, so an op that wants every core brings its own threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#endif

namespace attn_kernels {

// Sleeps while `word` holds `value`; wakes every sleeper on `word`. Linux: the futex system calls
// themselves. libstdc++ 12's std::atomic::wait/notify_all (tried first) let a sleeping worker
// wait 0.8-10 ms for its wake-up on this project's VM, against 6-14 µs for a condition variable.
inline void sleep_while(const std::atomic<uint32_t>& word, uint32_t value) {
#if defined(__linux__)
  while (word.load(std::memory_order_acquire) == value) {
    syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
  }
#else
  word.wait(value, std::memory_order_acquire);
#endif
}
inline void wake_all(std::atomic<uint32_t>& word) {
#if defined(__linux__)
  syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  word.notify_all();
#endif
}

class ThreadPool {
 public:
  // `threads` counts the calling thread, which works too.
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    wake_all(generation_);
    for (auto& w : workers_) {
      w.join();
    }
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) and returns once all calls have finished.
  void parallel_for(int n, const std::function<void(int)>& fn) {
    if (n <= 0) {
      return;
    }
    if (n == 1 || workers_.empty()) {
      for (int i = 0; i < n; ++i) {
        fn(i);
      }
      return;
    }
    std::lock_guard call(call_mutex_);  // several MLX CPU streams may call at once
    job_ = &fn;
    job_size_ = n;
    next_.store(0, std::memory_order_relaxed);
    busy_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_relaxed);
    // One futex wake for every sleeping worker: with a condition variable each woken worker took
    // the mutex in turn before it could start.
    generation_.fetch_add(1, std::memory_order_release);
    wake_all(generation_);
    run_tasks();
    // The workers finish at most one task after this thread: spin for them rather than sleep.
    // A sleeping caller took 50-90 µs to be woken on this project's VM, a third of a call at
    // S = 1024 (Qwen3-4B shapes); the spin is bounded in case a worker was descheduled.
    for (int spin = 0; spin < kMaxSpins; ++spin) {
      if (busy_.load(std::memory_order_acquire) == 0) {
        job_ = nullptr;
        return;
      }
      pause();
    }
    for (uint32_t left; (left = busy_.load(std::memory_order_acquire)) != 0;) {
      sleep_while(busy_, left);
    }
    job_ = nullptr;
  }

 private:
  // Pause instructions before the caller falls back to sleeping: 0.1-2 ms, by the CPU's pause
  // latency (~10 to ~140 cycles).
  static constexpr int kMaxSpins = 1 << 15;

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void run_tasks() {
    for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < job_size_;) {
      (*job_)(i);
    }
  }

  void worker_loop() {
    uint32_t seen = 0;
    for (;;) {
      sleep_while(generation_, seen);
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) {
        return;
      }
      run_tasks();
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        wake_all(busy_);
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  // Written by the caller before it bumps generation_ (release), read by workers after (acquire).
  const std::function<void(int)>* job_ = nullptr;
  int job_size_ = 0;
  std::atomic<int> next_{0};
  std::atomic<uint32_t> busy_{0};  // workers still running the current job
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace attn_kernels
