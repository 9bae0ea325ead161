// A small persistent pool for the CPU kernel. MLX's CPU encoder runs each dispatched task on one
// worker thread per stream, so an op that wants every core brings its own threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attn_kernels {

// Sleeps while `word` holds `value`; wakes up to `count` sleepers on `word`. Linux: the futex
// system calls themselves. libstdc++ 12's std::atomic::wait/notify_all (tried first) let a
// sleeping worker wait 0.8-10 ms for its wake-up on this project's VM, against 6-14 µs for a
// condition variable.
inline void sleep_while(const std::atomic<uint32_t>& word, uint32_t value) {
#if defined(__linux__)
  while (word.load(std::memory_order_seq_cst) == value) {
    syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
  }
#else
  word.wait(value, std::memory_order_seq_cst);
#endif
}
inline void wake(std::atomic<uint32_t>& word, int count) {
#if defined(__linux__)
  syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
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
    generation_.fetch_add(1, std::memory_order_seq_cst);
    wake(generation_, INT_MAX);
    for (auto& w : workers_) {
      w.join();
    }
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // How long a worker keeps polling for the next job after its last task before it sleeps (0:
  // sleep at once). A call that finds workers still polling starts them without a system call
  // or a wake-up; the price is that much CPU time per worker after every call.
  void set_worker_spin(std::chrono::nanoseconds spin) {
    spin_ns_.store(spin.count(), std::memory_order_relaxed);
  }

  // Wakes the sleeping workers ahead of a call that another thread is about to make, so that
  // their wake-up overlaps that thread's own (MLX: the main thread evaluates the op, the CPU
  // stream's thread runs it); they poll until `window` from now, then sleep again.
  void prewake(std::chrono::nanoseconds window) {
    const int64_t until = now_ns() + window.count();
    for (int64_t seen = poll_until_.load(std::memory_order_relaxed); seen < until &&
         !poll_until_.compare_exchange_weak(seen, until, std::memory_order_relaxed);) {
    }
    // A generation with no new tasks: woken workers find nothing to claim and poll.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      generation_.fetch_add(1, std::memory_order_seq_cst);
      wake(generation_, INT_MAX);
    }
  }

  // fn(i) for every i in [0, n) on at most `threads` threads (the caller included): that many
  // tasks, each taking indices from a shared counter until none are left, so a sweep can run a
  // call on part of the pool (ATTN_KERNELS_CALL_THREADS) with the same first-come hand-out.
  void parallel_for(int n, int threads, const std::function<void(int)>& fn) {
    if (threads >= size() || threads >= n) {
      parallel_for(n, fn);
      return;
    }
    std::atomic<int> next{0};
    parallel_for(std::max(threads, 1), [&](int) {
      for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
    });
  }

  // Runs fn(i) for every i in [0, n) and returns once all calls have finished: when the tasks
  // are done, not when every worker has woken up. A worker that wakes late (descheduled, or one
  // of many woken at once) finds nothing left and goes back to waiting; the caller does not wait
  // for it.
  void parallel_for(int n, const std::function<void(int)>& fn) {
    if (n <= 0) {
      return;
    }
    if (n == 1 || workers_.empty() || n >= kMaxTasks) {
      for (int i = 0; i < n; ++i) {
        fn(i);
      }
      return;
    }
    std::lock_guard call(call_mutex_);  // several MLX CPU streams may call at once
    job_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    tasks_.store(static_cast<uint64_t>(n) << kIndexBits, std::memory_order_release);
    // Polling workers see the new generation by themselves; sleeping ones need the futex call,
    // one for all of them (with a condition variable each woken worker took the mutex in turn),
    // and no more of them than there are tasks beside the caller's. The seq_cst pair
    // (generation_ here, sleepers_ in wait_for_job) means a worker about to sleep either is
    // counted here or sees the new generation in its futex call.
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (const int sleeping = sleepers_.load(std::memory_order_seq_cst); sleeping > 0) {
      wake(generation_, std::min(sleeping, n - 1));
    }
    run_tasks();
    // Spin for the tasks still running rather than sleep: a sleeping caller took 50-90 µs to be
    // woken on this project's VM, a third of a call at S = 1024 (Qwen3-4B shapes); the spin is
    // bounded in case a worker was descheduled mid-task.
    const uint32_t all = static_cast<uint32_t>(n);
    for (int spin = 0; spin < kMaxSpins && done_.load(std::memory_order_acquire) != all; ++spin) {
      pause();
    }
    if (done_.load(std::memory_order_acquire) != all) {
      caller_sleeps_.store(true, std::memory_order_seq_cst);
      for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != all;) {
        sleep_while(done_, d);
      }
      caller_sleeps_.store(false, std::memory_order_relaxed);
    }
  }

 private:
  // Pause instructions before the caller falls back to sleeping: 0.1-2 ms, by the CPU's pause
  // latency (~10 to ~140 cycles).
  static constexpr int kMaxSpins = 1 << 15;
  // tasks_ packs the task count (high bits) and the next index (low bits), so a claim reads both
  // in one atomic step: an index below the count is a task of the job now published (which
  // cannot end before that task is done), anything else is nothing to do. Late claims push the
  // index past the count by at most one per worker.
  static constexpr int kIndexBits = 32;
  static constexpr int kMaxTasks = 1 << 30;

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  void run_tasks() {
    for (;;) {
      const uint64_t claim = tasks_.fetch_add(1, std::memory_order_acq_rel);
      const uint32_t index = static_cast<uint32_t>(claim);
      const uint32_t count = static_cast<uint32_t>(claim >> kIndexBits);
      if (index >= count) {
        return;
      }
      (*job_)(static_cast<int>(index));
      // The futex call only when the caller has stopped spinning (seq_cst pair with
      // caller_sleeps_ in parallel_for).
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == count &&
          caller_sleeps_.load(std::memory_order_seq_cst)) {
        wake(done_, INT_MAX);
      }
    }
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  // Returns once generation_ differs from `seen`: polls for the worker spin (or until a
  // prewake's deadline, whichever is later), then sleeps.
  void wait_for_job(uint32_t seen) {
    const int64_t start = now_ns();
    const int64_t spin_end = start + spin_ns_.load(std::memory_order_relaxed);
    auto polling = [&](int64_t now) {  // a prewake may extend the polling of a polling worker
      return now < std::max(spin_end, poll_until_.load(std::memory_order_relaxed));
    };
    if (polling(start)) {
      for (int i = 1; generation_.load(std::memory_order_acquire) == seen; ++i) {
        pause();
        if (i % 64 == 0 && !polling(now_ns())) {
          break;
        }
      }
    }
    while (generation_.load(std::memory_order_acquire) == seen) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      sleep_while(generation_, seen);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  void worker_loop() {
    uint32_t seen = 0;
    for (;;) {
      wait_for_job(seen);
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed)) {
        return;
      }
      run_tasks();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;
  // Written by the caller before it publishes tasks_ (release), read after a claim (acquire).
  const std::function<void(int)>* job_ = nullptr;
  // One cache line each for the words many threads write or poll at once: every task is a claim
  // (tasks_) and a completion (done_), which the caller polls at the end, and polling workers
  // read generation_; sharing a line, each write would take it from all the readers (16 cores).
  alignas(64) std::atomic<uint64_t> tasks_{0};
  alignas(64) std::atomic<uint32_t> done_{0};  // tasks of the current job finished
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};  // workers in (or about to enter) the futex wait
  alignas(64) std::atomic<bool> caller_sleeps_{false};
  std::atomic<int64_t> spin_ns_{0};
  std::atomic<int64_t> poll_until_{0};  // steady_clock ns: a prewake's deadline
  std::atomic<bool> stop_{false};
};

}  // namespace attn_kernels
