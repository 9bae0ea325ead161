// A 4-D array with any strides copied into a row-contiguous one: a cache that could not be
// donated, heads-first attention output into o_proj's token-first layout, a linear layer's
// strided input. Plain data, shared by the kernels (strided_copy.cuh), their launchers and the
// emulation.
#pragma once

#include <cstdint>

namespace attn_kernels::cuda {

struct StridedCopy {
  const void* src;
  void* dst;
  int shape[4];
  int64_t strides[4];  // the source's, in elements
  int64_t size;
};

constexpr unsigned kCopyThreads = 256;

// Whether the 16-byte kernel can take it: the last axis contiguous and whole vectors long, every
// row starting 16-byte aligned at both ends, fewer than 2^31 vectors (its index math is 32-bit,
// the grid stride added past the last vector included).
inline bool copy_by_vectors(const StridedCopy& c, int64_t itemsize) {
  const int64_t per_vector = 16 / itemsize;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return c.strides[3] == 1 && c.shape[3] % per_vector == 0 && c.strides[0] % per_vector == 0 &&
         c.strides[1] % per_vector == 0 && c.strides[2] % per_vector == 0 && aligned(c.src) &&
         aligned(c.dst) && c.size / per_vector < (int64_t{1} << 31);
}

// Blocks for `items` threads' work (elements or vectors), a grid-stride loop past 16 a SM.
inline unsigned copy_blocks(int64_t items) {
  const int64_t blocks = (items + kCopyThreads - 1) / kCopyThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks > 132 * 16 ? 132 * 16 : blocks);
}

}  // namespace attn_kernels::cuda
