// Runs kernels-metal/decode_attention.metal on the CPU under the SIMT emulation.
//
//   run_decode_attention DIR
//
// DIR holds config.txt ("dtype groups B Hq Hkv L S D capacity causal mask_kind scale
// row_ranges"), q.bin (B, Hq, L, D), k.bin and v.bin (B, Hkv, capacity, D), mask.bin ((B, Hq, L,
// S) or one unread byte), starts.bin and ends.bin (int32 (B,), as row_ranges names them); raw
// storage: float32, float16 or bfloat16 bits, the mask as its own type. It receives out.bin,
// contiguous (B, Hq, L, D) in the input dtype. The parameters come from the builder every
// backend uses (attention_geometry.h's make_geometry).
#include <cstdio>
#include <cstdlib>
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

std::vector<int> read_ints(const std::string& path) {
  const auto raw = read_file(path);
  std::vector<int> out(raw.size() / sizeof(int));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(int));
  return out;
}

template <typename T, int G>
void run(const std::string& dir, const DecodeAttentionParams& p) {
  const auto q = read_file(dir + "/q.bin"), k = read_file(dir + "/k.bin"), v = read_file(dir + "/v.bin");
  const auto mask = read_file(dir + "/mask.bin");
  // Unread stand-ins where row_ranges lacks their bit.
  const auto starts =
      p.row_ranges & kRowStarts ? read_ints(dir + "/starts.bin") : std::vector<int>(1);
  const auto ends = p.row_ranges & kRowEnds ? read_ints(dir + "/ends.bin") : std::vector<int>(1);
  std::vector<T> out(static_cast<size_t>(p.rows) * p.query_len * p.head_dim);
  const int vectors = p.rows * p.query_len;
  std::vector<float> shared((G * (p.head_dim + 2) + G + 1));
  simt::dispatch(vectors, G * simt::kSimdWidth, [&](int group, int thread) {
    decode_attention<T, G>(
        reinterpret_cast<const T*>(q.data()), reinterpret_cast<const T*>(k.data()),
        reinterpret_cast<const T*>(v.data()), reinterpret_cast<const uchar*>(mask.data()),
        out.data(), p, starts.data(), ends.data(), shared.data(), group, thread,
        thread / simt::kSimdWidth, thread % simt::kSimdWidth);
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
  std::ifstream config(dir + "/config.txt");
  std::string dtype;
  int groups, b, hq, hkv, L, S, D, capacity, causal, mask_kind, row_ranges;
  std::string scale_text;  // strtof's forms: the tests pass nan and inf too
  if (!(config >> dtype >> groups >> b >> hq >> hkv >> L >> S >> D >> capacity >> causal >>
        mask_kind >> scale_text >> row_ranges)) {
    std::fprintf(stderr, "bad %s/config.txt\n", dir.c_str());
    return 2;
  }
  DecodeAttentionParams p{};
  const float scale = std::strtof(scale_text.c_str(), nullptr);
  static_cast<AttentionGeometry&>(p) = make_geometry(b, hq, hkv, L, S, D, scale, causal, nullptr);
  p.mask_kind = mask_kind;
  p.row_ranges = row_ranges;
  const attn_i64 kv[4] = {attn_i64(hkv) * capacity * D, attn_i64(capacity) * D, D, 1};
  const attn_i64 m[4] = {attn_i64(hq) * L * S, attn_i64(L) * S, S, 1};
  for (int a = 0; a < 4; ++a) {
    p.k_strides[a] = p.v_strides[a] = kv[a];
    p.m_strides[a] = mask_kind ? m[a] : 0;
  }
  if (dtype == "float32") run_groups<float>(dir, p, groups);
  else if (dtype == "float16") run_groups<half>(dir, p, groups);
  else if (dtype == "bfloat16") run_groups<ushort>(dir, p, groups);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
