// Runs kernels-metal/decode_attention.metal on the CPU under the SIMT emulation.
//
//   run_decode_attention DIR
//
// DIR holds params.bin (DecodeAttentionParams), config.txt ("dtype groups"), q.bin, k.bin,
// v.bin, mask.bin (raw storage: float32, float16 or bfloat16 bits; mask as its own type) and
// receives out.bin, contiguous (B, Hq, L, D) in the input dtype.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "simt.h"
// The kernel source itself, unchanged.
#include "../decode_attention.metal"

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

template <typename T, int G>
void run(const std::string& dir, const DecodeAttentionParams& p) {
  const auto q = read_file(dir + "/q.bin"), k = read_file(dir + "/k.bin"), v = read_file(dir + "/v.bin");
  const auto mask = read_file(dir + "/mask.bin");
  std::vector<T> out(static_cast<size_t>(p.rows) * p.query_len * p.head_dim);
  const int vectors = p.rows * p.query_len;
  std::vector<float> shared((G * (p.head_dim + 2) + G + 1));
  simt::dispatch(vectors, G * simt::kSimdWidth, [&](int group, int thread) {
    decode_attention<T, G>(
        reinterpret_cast<const T*>(q.data()), reinterpret_cast<const T*>(k.data()),
        reinterpret_cast<const T*>(v.data()), reinterpret_cast<const uchar*>(mask.data()),
        out.data(), p, shared.data(), group, thread, thread / simt::kSimdWidth,
        thread % simt::kSimdWidth);
  });
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(T));
}

template <typename T>
void run_groups(const std::string& dir, const DecodeAttentionParams& p, int groups) {
  switch (groups) {
    case 8: return run<T, 8>(dir, p);
    case 16: return run<T, 16>(dir, p);
    case 32: return run<T, 32>(dir, p);
  }
  throw std::runtime_error("groups must be 8, 16 or 32");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const auto raw = read_file(dir + "/params.bin");
  if (raw.size() != sizeof(DecodeAttentionParams)) {
    std::fprintf(stderr, "params.bin: %zu bytes, expected %zu\n", raw.size(), sizeof(DecodeAttentionParams));
    return 2;
  }
  DecodeAttentionParams p;
  std::memcpy(&p, raw.data(), sizeof(p));
  std::ifstream config(dir + "/config.txt");
  std::string dtype;
  int groups = 0;
  config >> dtype >> groups;
  if (dtype == "float32") run_groups<float>(dir, p, groups);
  else if (dtype == "float16") run_groups<half>(dir, p, groups);
  else if (dtype == "bfloat16") run_groups<ushort>(dir, p, groups);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
