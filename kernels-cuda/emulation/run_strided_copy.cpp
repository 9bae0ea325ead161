// Runs kernels-cuda/strided_copy.cuh on the CPU under cuda_emu.h.
//
//   run_strided_copy DIR
//
// DIR holds config.txt ("itemsize shape0..3 stride0..3 offset blocks": the source's shape and
// element strides, its first element `offset` elements into src.bin, blocks 0 for
// copy_blocks'), and src.bin (the source buffer, raw bytes); it receives dst.bin (the
// row-contiguous copy) and prints the kernel copy_by_vectors picked: "vectors" or "elements".
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cuda_emu.h"
// The kernel source itself, unchanged.
#include "../strided_copy.cuh"

using namespace attn_kernels::cuda;

namespace {

// 16-byte aligned storage of `bytes` bytes (so that offsets in config.txt set the alignment).
std::vector<uint4> aligned_bytes(size_t bytes) {
  return std::vector<uint4>((bytes + 15) / 16 + 1);
}

template <typename T>
void run(StridedCopy c, unsigned blocks, bool vectors) {
  const unsigned grid = blocks ? blocks : copy_blocks(vectors ? c.size / (16 / sizeof(T)) : c.size);
  emu::launch(grid, 1, kCopyThreads, 0, [&] {
    if (vectors) {
      copy::copy_vectors<T>(c);
    } else {
      copy::copy_elements<T>(c);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = emu::runner_folder(argc, argv);
  std::ifstream config(dir + "/config.txt");
  StridedCopy c{};
  int itemsize = 0;
  int64_t offset = 0;
  unsigned blocks = 0;
  config >> itemsize;
  for (int a = 0; a < 4; ++a) config >> c.shape[a];
  for (int a = 0; a < 4; ++a) config >> c.strides[a];
  config >> offset >> blocks;
  if (!config || (itemsize != 2 && itemsize != 4)) {
    std::fprintf(stderr, "bad config.txt\n");
    return 2;
  }
  const auto raw = emu::read_file<char>(dir + "/src.bin");
  auto src = aligned_bytes(raw.size());
  std::memcpy(src.data(), raw.data(), raw.size());
  c.size = int64_t{c.shape[0]} * c.shape[1] * c.shape[2] * c.shape[3];
  auto dst = aligned_bytes(size_t(c.size) * itemsize);
  c.src = reinterpret_cast<const char*>(src.data()) + offset * itemsize;
  c.dst = dst.data();
  const bool vectors = copy_by_vectors(c, itemsize);
  if (itemsize == 2) {
    run<uint16_t>(c, blocks, vectors);
  } else {
    run<uint32_t>(c, blocks, vectors);
  }
  std::ofstream(dir + "/dst.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(dst.data()), c.size * itemsize);
  std::printf("%s\n", vectors ? "vectors" : "elements");
  return 0;
}
