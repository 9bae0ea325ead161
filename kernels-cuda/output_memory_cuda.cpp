// Our ops' outputs in device memory (output_memory.h says why not allocator::malloc's): blocks
// from the device's default memory pool, allocated on the encoder's stream as MLX's own ops
// allocate (cudaMallocAsync), and kept per size for reuse when their arrays are freed. MLX frees
// a buffer only after every graph that reads or writes it has run (a committed graph holds its
// arrays until it completes), so a freed block is idle and the next call on any stream may take
// it, as MLX's own buffer cache does. MLX's memory counters do not include these blocks.
// A block past the cache goes back to the pool on a stream of ours, never the encoder's: MLX
// frees arrays on its completion thread, and a free queued on the encoder's stream while the
// main thread captures a library call there (cuBLASLt, in its CaptureContext) lands in that
// capture as a free node, which MLX's cudaGraphAddChildGraphNode refuses ("operation not
// supported"). MLX frees on streams of its own too.
#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "mlx/backend/cuda/allocator.h"
#include "output_memory.h"
#include "output_memory_cuda.h"

namespace attn_kernels {

namespace {

// Freed blocks past this go back to the memory pool: a decode step's outputs are a few MB, a
// cache the fused step copies (one it cannot donate) can be far larger.
constexpr int64_t kMaxCachedBytes = int64_t{256} << 20;

struct Pool {
  std::mutex mutex;
  std::map<std::pair<int, size_t>, std::vector<void*>> free_blocks;  // by (device, size)
  std::map<int, cudaStream_t> free_streams;                          // by device
  std::atomic<bool> device{true};
  std::atomic<int64_t> live_bytes{0}, cached_bytes{0}, allocations{0};
};

// Never destroyed: arrays freed during exit still hand their blocks back.
Pool& pool() {
  static auto* p = new Pool;
  return *p;
}

// MLX's size classes (powers of two below its 16 KiB page, whole pages above), so that the
// buffers of one shape at different row counts fall into few sizes.
size_t block_size(size_t bytes) {
  constexpr size_t page = 16384;
  if (bytes >= page) return (bytes + page - 1) / page * page;
  size_t size = 256;
  while (size < bytes) size *= 2;
  return size;
}

// The device's stream for frees, made on the thread that allocates (the device current there);
// p.mutex held.
cudaStream_t free_stream(Pool& p, int device) {
  auto [at, made] = p.free_streams.try_emplace(device, nullptr);
  if (made && cudaStreamCreateWithFlags(&at->second, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    at->second = nullptr;  // none: release() then keeps every block
  }
  return at->second;
}

void release(mx::allocator::Buffer buffer, cudaStream_t frees) {
  auto* block = static_cast<mx::cu::CudaBuffer*>(buffer.ptr());
  auto& p = pool();
  p.live_bytes -= static_cast<int64_t>(block->size);
  if (block->device < 0) {
    // array::data() moved it into MLX's unified memory (freeing our block): that memory is
    // managed, or pinned host memory where the device has no concurrent managed access.
    cudaPointerAttributes where{};
    const bool host = cudaPointerGetAttributes(&where, block->data) == cudaSuccess &&
                      where.type == cudaMemoryTypeHost;
    host ? cudaFreeHost(block->data) : cudaFree(block->data);
  } else if (frees && p.cached_bytes + static_cast<int64_t>(block->size) > kMaxCachedBytes) {
    cudaFreeAsync(block->data, frees);
  } else {
    std::lock_guard lock(p.mutex);
    p.free_blocks[{block->device, block->size}].push_back(block->data);
    p.cached_bytes += static_cast<int64_t>(block->size);
  }
  cudaGetLastError();  // a failure here (the runtime gone at exit) must not surface in MLX's checks
  delete block;
}

}  // namespace

void allocate_output(mx::array& out, size_t bytes, mx::cu::CommandEncoder& encoder) {
  auto& p = pool();
  if (!p.device) {
    out.set_data(mx::allocator::malloc(bytes));
    return;
  }
  const int device = encoder.device().cuda_device();
  const size_t size = block_size(bytes);
  cudaStream_t frees = nullptr;
  void* data = nullptr;
  {
    std::lock_guard lock(p.mutex);
    frees = free_stream(p, device);
    auto& blocks = p.free_blocks[{device, size}];
    if (!blocks.empty()) {
      data = blocks.back();
      blocks.pop_back();
      p.cached_bytes -= static_cast<int64_t>(size);
    }
  }
  cudaStream_t stream = encoder.stream();
  if (data == nullptr) {
    if (cudaMallocAsync(&data, size, stream) != cudaSuccess) {
      cudaGetLastError();  // no memory pools on this device, or none left: MLX's allocator
      out.set_data(mx::allocator::malloc(bytes));
      return;
    }
    ++p.allocations;
  }
  p.live_bytes += static_cast<int64_t>(size);
  auto* block = new mx::cu::CudaBuffer{data, size, device};
  out.set_data(mx::allocator::Data(
      mx::allocator::Buffer(block), [frees](mx::allocator::Buffer b) { release(b, frees); }));
}

std::optional<OutputMemory> output_memory(std::optional<bool> device) {
  auto& p = pool();
  if (device) p.device = *device;
  return OutputMemory{p.device, p.live_bytes, p.cached_bytes, p.allocations};
}

}  // namespace attn_kernels
