// The CPU linear kernel's dispatcher: prepares the rows of x once (cpu_linear_body.h), then splits
// the weight's rows over the attention kernels' thread pool (each task a run of whole rows, so
// every weight byte is read by one thread, once).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_linear.h"
#include "thread_pool.h"

namespace attn_kernels {
namespace {

using namespace cpu;

LinearKernel linear_kernel_for(CpuPath path) {
  switch (path) {
#if defined(ATTN_CPU_X86)
    case CpuPath::avx512: return linear_kernel_avx512();
    case CpuPath::avx2: return linear_kernel_avx2();
    case CpuPath::portable: return linear_kernel_portable();
#elif defined(ATTN_CPU_ARM64)
    case CpuPath::neon: return linear_kernel_neon();
#else
    case CpuPath::portable: return linear_kernel_portable();
#endif
    default: break;
  }
  throw std::logic_error(std::string("CPU linear path not built: ") + cpu_path_name(path));
}

// Tasks per thread: the pool hands tasks out first come, so late-waking threads take fewer.
constexpr int kTasksPerThread = 8;
// Weight rows per task at least (a multiple of every path's row tile, 4).
constexpr int kMinTaskRows = 16;
// Below this many weight bytes one thread. Lower than attention's threshold (cpu_threads_for):
// the caller starts on the first task at once and a late-waking worker only takes what is left,
// so a second thread costs the caller a wake-up call, not the worker's wake-up time. Qwen3-0.6B
// 4-bit's o and down (1 and 1.5 MB, under attention's 2^22 multiply-adds), 2-vCPU EPYC, cold
// weights (make bench-linear-kernel): 136 and 184 us on one thread, 100 and 138 on two.
constexpr int64_t kMinParallelBytes = int64_t{256} << 10;

size_t element_size(ElementType t) {
  return t == ElementType::float32 ? 4 : 2;
}

}  // namespace

void linear_cpu(const LinearProblem& problem, CpuPath path) {
  const LinearKernel kernel = linear_kernel_for(path);
  const size_t row_floats = kernel.prepared_floats(problem);
  // The calling thread's buffer, reused between calls (a fresh vector zeroed 8 rows of it on
  // every call); the tasks take its address, not the name, which is another buffer in a worker.
  // It starts on a cache line: a large vector's data sits 16 bytes past a page (malloc's mmap
  // header), where every vector load of x would straddle two lines.
  static thread_local std::vector<float> buffer;
  constexpr size_t kLine = 64;
  const size_t floats = row_floats * (kLinearRows + 1) + kLine / sizeof(float);
  if (buffer.size() < floats) buffer.resize(floats);
  const size_t misalignment = reinterpret_cast<uintptr_t>(buffer.data()) % kLine;
  float* const prepared = buffer.data() + (kLine - misalignment) % kLine / sizeof(float);
  const size_t elem = element_size(problem.dtype);
  for (int r0 = 0; r0 < problem.rows; r0 += kLinearRows) {
    LinearProblem p = problem;
    p.rows = std::min(kLinearRows, problem.rows - r0);
    p.x = static_cast<const char*>(problem.x) + r0 * problem.x_row_stride * elem;
    if (p.gate) {
      p.gate = static_cast<const char*>(problem.gate) + r0 * problem.gate_row_stride * elem;
    }
    p.out = static_cast<char*>(problem.out) + int64_t{r0} * problem.outputs * elem;
    kernel.prepare(p, prepared);
    const int64_t weight_bytes =
        int64_t{p.outputs} * p.inputs * (p.bits ? p.bits : 8 * int(elem)) / 8;
    const int threads = weight_bytes >= kMinParallelBytes ? cpu_threads_for(INT64_MAX) : 1;
    const int per_task = std::max(
        kMinTaskRows,
        (p.outputs + threads * kTasksPerThread - 1) / (threads * kTasksPerThread) / 4 * 4);
    const int tasks = (p.outputs + per_task - 1) / per_task;
    auto task = [&](int t) {
      kernel.columns(p, prepared, t * per_task, std::min(p.outputs, (t + 1) * per_task));
    };
    if (threads <= 1 || tasks <= 1) {
      for (int t = 0; t < tasks; ++t) task(t);
    } else {
      cpu_pool().parallel_for(tasks, threads, task);
    }
  }
}

}  // namespace attn_kernels
