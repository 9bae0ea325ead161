// Runs kernels-metal/decode_attention_quantized.metal on the CPU under the SIMT emulation.
//
//   run_decode_attention_quantized DIR
//
// DIR holds config.txt ("dtype groups B Hq Hkv L S D capacity causal mask_kind scale bits
// group_size row_ranges"), q.bin (B, Hq, L, D), kc.bin, ks.bin, kb.bin, vc.bin, vs.bin, vb.bin
// (mx.quantize's arrays, (B, Hkv, capacity, ·)), mask.bin ((B, Hq, L, S) or one unread byte),
// starts.bin and ends.bin (int32 (B,), as row_ranges names them); raw storage: codes uint32, the
// rest float32, float16 or bfloat16 bits, the mask as its own type. It receives out.bin,
// contiguous (B, Hq, L, D) in the queries' dtype. The parameters come from the builder every
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
#include "../decode_attention_quantized.metal"

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

template <typename T, int G, int BITS>
void run(const std::string& dir, const QuantizedAttentionParams& p) {
  const auto q = read_file(dir + "/q.bin"), mask = read_file(dir + "/mask.bin");
  // Unread stand-ins where row_ranges lacks their bit.
  const auto starts =
      p.row_ranges & kRowStarts ? read_ints(dir + "/starts.bin") : std::vector<int>(1);
  const auto ends = p.row_ranges & kRowEnds ? read_ints(dir + "/ends.bin") : std::vector<int>(1);
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
        reinterpret_cast<const uchar*>(mask.data()), out.data(), p, starts.data(), ends.data(),
        shared.data(), group, thread, thread / simt::kSimdWidth, thread % simt::kSimdWidth);
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
  std::ifstream config(dir + "/config.txt");
  std::string dtype;
  int groups, b, hq, hkv, L, S, D, capacity, causal, mask_kind, bits, group_size, row_ranges;
  std::string scale_text;  // strtof's forms: the tests pass nan and inf too
  if (!(config >> dtype >> groups >> b >> hq >> hkv >> L >> S >> D >> capacity >> causal >>
        mask_kind >> scale_text >> bits >> group_size >> row_ranges)) {
    std::fprintf(stderr, "bad %s/config.txt\n", dir.c_str());
    return 2;
  }
  QuantizedAttentionParams p{};
  const float scale = std::strtof(scale_text.c_str(), nullptr);
  static_cast<AttentionGeometry&>(p) = make_geometry(b, hq, hkv, L, S, D, scale, causal, nullptr);
  p.mask_kind = mask_kind;
  p.row_ranges = row_ranges;
  p.bits = bits;
  p.group_size = group_size;
  const int lasts[3] = {D * bits / 32, D / group_size, D / group_size};  // codes, scales, biases
  const attn_i64 m[4] = {attn_i64(hq) * L * S, attn_i64(L) * S, S, 1};
  for (int a = 0; a < 4; ++a) {
    p.m_strides[a] = mask_kind ? m[a] : 0;
    for (int t = 0; t < 3; ++t) {
      const attn_i64 strides[4] = {attn_i64(hkv) * capacity * lasts[t],
                                   attn_i64(capacity) * lasts[t], lasts[t], 1};
      p.k_strides[t * 4 + a] = p.v_strides[t * 4 + a] = strides[a];
    }
  }
  if (dtype == "float32") run_config<float>(dir, p, groups);
  else if (dtype == "float16") run_config<half>(dir, p, groups);
  else if (dtype == "bfloat16") run_config<ushort>(dir, p, groups);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
