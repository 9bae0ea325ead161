// A small persistent pool for the CPU kernel. MLX's CPU encoder runs each dispatched task on one
// worker thread per stream, so an op that wants every core brings its own threads.
//
// Workers spin for a short while after each job before they sleep: on this project's VM a
// sleeping worker took ~110 µs to wake (a no-op parallel_for, median), about the cost of a whole
// call at S = 1024, while decode calls arrive back to back. ATTN_KERNELS_SPIN_US sets the spin
// (default 300 µs; 0: sleep at once).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace attn_kernels {

class ThreadPool {
 public:
  // `threads` counts the calling thread, which works too.
  explicit ThreadPool(int threads) {
    if (const char* env = std::getenv("ATTN_KERNELS_SPIN_US")) {
      spin_ = std::chrono::microseconds(std::max(0, std::atoi(env)));
    }
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
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_tasks();
    if (!spin_until([this] { return busy_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(mutex_);
      finished_.wait(lock, [this] { return busy_.load(std::memory_order_acquire) == 0; });
    }
    job_ = nullptr;
  }

 private:
  // Polls `done` for up to spin_; false if it never held.
  template <typename Done>
  bool spin_until(Done done) const {
    if (spin_.count() == 0) return done();
    const auto until = std::chrono::steady_clock::now() + spin_;
    for (int i = 0;; ++i) {
      if (done()) return true;
      if (i % 64 == 63 && std::chrono::steady_clock::now() > until) return false;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  void run_tasks() {
    for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < job_size_;) {
      (*job_)(i);
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || fresh(); });
        if (stop_) {
          return;
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      run_tasks();
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);
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
  std::atomic<int> busy_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  std::chrono::microseconds spin_{300};
};

}  // namespace attn_kernels
