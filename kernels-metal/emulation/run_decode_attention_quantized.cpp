// Runs kernels-metal/decode_attention_quantized.metal on the CPU under the SIMT emulation.
//
//   run_decode_attention_quantized DIR
//
// DIR holds params.bin (QuantizedAttentionParams), config.txt ("dtype groups"), q.bin, kc.bin,
// ks.bin, kb.bin, vc.bin, vs.bin, vb.bin, mask.bin (raw storage: codes uint32; the rest float32,
// float16 or bfloat16 bits; the mask as its own type) and receives out.bin, contiguous
// (B, Hq, L, D) in the queries' dtype.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "simt.h"
// The kernel source itself, unchanged.
#include "../decode_attention_quantized.metal"

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

template <typename T, int G, int BITS>
void run(const std::string& dir, const QuantizedAttentionParams& p) {
  const auto q = read_file(dir + "/q.bin"), mask = read_file(dir + "/mask.bin");
  const auto kc = read_file(dir + "/kc.bin"), ks = read_file(dir + "/ks.bin"),
             kb = read_file(dir + "/kb.bin");
  const auto vc = read_file(dir + "/vc.bin"), vs = read_file(dir + "/vs.bin"),
             vb = read_file(dir + "/vb.bin");
  std::vector<T> out(static_cast<size_t>(p.rows) * p.query_len * p.head_dim);
  const int vectors = p.group * p.query_len;
  const int tiles = (vectors + quantized::kVectors - 1) / quantized::kVectors;
  const int blocks = p.rows / p.group * tiles;
  std::vector<float> shared(G * quantized::kVectors * (p.head_dim + 2));
  auto as = [](const std::vector<char>& b) { return reinterpret_cast<const T*>(b.data()); };
  auto codes = [](const std::vector<char>& b) { return reinterpret_cast<const uint*>(b.data()); };
  simt::dispatch(blocks, G * simt::kSimdWidth, [&](int group, int thread) {
    decode_attention_quantized<T, G, BITS>(
        as(q), codes(kc), as(ks), as(kb), codes(vc), as(vs), as(vb),
        reinterpret_cast<const uchar*>(mask.data()), out.data(), p, shared.data(), group, thread,
        thread / simt::kSimdWidth, thread % simt::kSimdWidth);
  });
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(T));
}

template <typename T>
void run_config(const std::string& dir, const QuantizedAttentionParams& p, int groups) {
  if (groups == 4 && p.bits == 4) return run<T, 4, 4>(dir, p);
  if (groups == 4 && p.bits == 8) return run<T, 4, 8>(dir, p);
  if (groups == 8 && p.bits == 4) return run<T, 8, 4>(dir, p);
  if (groups == 8 && p.bits == 8) return run<T, 8, 8>(dir, p);
  throw std::runtime_error("groups must be 4 or 8 and bits 4 or 8");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const auto raw = read_file(dir + "/params.bin");
  if (raw.size() != sizeof(QuantizedAttentionParams)) {
    std::fprintf(stderr, "params.bin: %zu bytes, expected %zu\n", raw.size(),
                 sizeof(QuantizedAttentionParams));
    return 2;
  }
  QuantizedAttentionParams p;
  std::memcpy(&p, raw.data(), sizeof(p));
  std::ifstream config(dir + "/config.txt");
  std::string dtype;
  int groups = 0;
  config >> dtype >> groups;
  if (dtype == "float32") run_config<float>(dir, p, groups);
  else if (dtype == "float16") run_config<half>(dir, p, groups);
  else if (dtype == "bfloat16") run_config<ushort>(dir, p, groups);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
