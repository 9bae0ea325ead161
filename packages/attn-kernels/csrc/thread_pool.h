// A small persistent pool for the CPU kernel. MLX's CPU encoder runs each dispatched task on one
// worker thread per stream, so an op that wants every core brings its own threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attn_kernels {

class ThreadPool {
 public:
  // `threads` counts the calling thread, which works too.
  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }

  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
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
    {
      std::lock_guard lock(mutex_);
      job_ = &fn;
      job_size_ = n;
      next_.store(0, std::memory_order_relaxed);
      busy_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    run_tasks();
    // The workers finish at most one task after this thread: spin for them rather than sleep.
    // A sleeping caller took 50-90 µs to be woken on this project's VM, a third of a call at
    // S = 1024 (Qwen3-4B shapes); the spin is bounded in case a worker was descheduled.
    for (int spin = 0; busy_.load(std::memory_order_acquire) != 0 && spin < kMaxSpins; ++spin) {
      pause();
    }
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [this] { return busy_.load(std::memory_order_acquire) == 0; });
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
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) {
          return;
        }
        seen = generation_;
      }
      run_tasks();
      std::lock_guard lock(mutex_);
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        finished_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  const std::function<void(int)>* job_ = nullptr;
  int job_size_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> busy_{0};  // workers still running the current job
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace attn_kernels
