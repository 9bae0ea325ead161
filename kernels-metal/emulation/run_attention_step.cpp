// Runs kernels-metal/attention_step.metal and decode_attention.metal (the fused step as the Metal
// launcher sequences them) on the CPU under the SIMT emulation.
//
//   run_attention_step DIR
//
// DIR holds config.txt ("dtype groups scale B L Hq Hkv D offset capacity qk_norm eps base
// [position]": position, a full ring's sequence position as attention_step takes it), q.bin,
// k.bin, v.bin (B, L, heads·D), q_norm.bin and k_norm.bin (only with qk_norm), k_cache.bin,
// v_cache.bin (B, Hkv, capacity, D) (raw storage: float32, float16 or bfloat16 bits, contiguous),
// and with per-row ranges starts.bin and offsets.bin (int32 (B,): the rows' first positions and
// write positions; offset is then the largest write position). It receives out.bin (B, L, Hq·D)
// and the updated k_cache.bin, v_cache.bin. The attention's parameters come from the builder
// every backend uses (make_step_geometry).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "simt.h"
// The kernel sources themselves, unchanged.
#include "../attention_step.metal"
#include "../decode_attention.metal"

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(data), bytes);
}

template <typename T>
const T* as(const std::vector<char>& bytes) {
  return reinterpret_cast<const T*>(bytes.data());
}

// int32 values of a file, or one unread stand-in when it is absent.
std::vector<int> read_ints(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::vector<int>(1);
  std::vector<char> raw{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  std::vector<int> out(raw.size() / sizeof(int));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(int));
  return out;
}

template <typename T, int G>
void run(const std::string& dir, const AttentionStepParams& p, float scale) {
  const auto starts = read_ints(dir + "/starts.bin"), offsets = read_ints(dir + "/offsets.bin");
  const auto q = read_file(dir + "/q.bin"), k = read_file(dir + "/k.bin"), v = read_file(dir + "/v.bin");
  std::vector<char> qw, kw;  // without qk_norm: null pointers, which the kernel must not read
  if (p.qk_norm) {
    qw = read_file(dir + "/q_norm.bin");
    kw = read_file(dir + "/k_norm.bin");
  }
  auto k_cache = read_file(dir + "/k_cache.bin"), v_cache = read_file(dir + "/v_cache.bin");
  const size_t q_elems = size_t(p.batch) * p.q_heads * p.length * p.head_dim;
  std::vector<T> q_out(q_elems), heads_first(q_elems), out(q_elems);
  T* kc = reinterpret_cast<T*>(k_cache.data());
  T* vc = reinterpret_cast<T*>(v_cache.data());

  // One 32-thread threadgroup per (token, head).
  simt::dispatch(p.batch * p.length * (p.q_heads + p.kv_heads), simt::kSimdWidth,
                 [&](int group, int thread) {
                   attention_step_preprocess<T>(as<T>(q), as<T>(k), as<T>(v),
                                                p.qk_norm ? as<T>(qw) : nullptr,
                                                p.qk_norm ? as<T>(kw) : nullptr,
                                                q_out.data(), kc, vc, p, starts.data(),
                                                offsets.data(), group, thread);
                 });

  const DecodeAttentionParams a = step_attention_params(p, scale);
  T* attended = p.length == 1 ? out.data() : heads_first.data();
  const uchar unused_mask = 0;
  std::vector<float> shared(G * (p.head_dim + 2) + G + 1);
  simt::dispatch(a.rows * a.query_len, G * simt::kSimdWidth, [&](int group, int thread) {
    decode_attention<T, G>(q_out.data(), kc, vc, &unused_mask, attended, a, starts.data(),
                           offsets.data(), shared.data(), group, thread,
                           thread / simt::kSimdWidth, thread % simt::kSimdWidth);
  });

  if (p.length > 1) {
    const StridedCopyParams c = step_reorder_params(p);
    for (attn_i64 n = 0; n < c.size; ++n) {
      attention_step_copy<T>(heads_first.data(), out.data(), c, uint(n));
    }
  }
  write_file(dir + "/out.bin", out.data(), out.size() * sizeof(T));
  write_file(dir + "/k_cache.bin", k_cache.data(), k_cache.size());
  write_file(dir + "/v_cache.bin", v_cache.data(), v_cache.size());
}

template <typename T>
void run_groups(const std::string& dir, const AttentionStepParams& p, int groups, float scale) {
  switch (groups) {
    case 8: return run<T, 8>(dir, p, scale);
    case 16: return run<T, 16>(dir, p, scale);
    case 32: return run<T, 32>(dir, p, scale);
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
  int groups, b, L, hq, hkv, D, offset, capacity, qk_norm;
  float scale, eps, base;
  if (!(config >> dtype >> groups >> scale >> b >> L >> hq >> hkv >> D >> offset >> capacity >>
        qk_norm >> eps >> base)) {
    std::fprintf(stderr, "bad %s/config.txt\n", dir.c_str());
    return 2;
  }
  AttentionStepParams p{};
  p.batch = b, p.length = L, p.q_heads = hq, p.kv_heads = hkv, p.head_dim = D;
  p.offset = offset, p.capacity = capacity, p.qk_norm = qk_norm;
  p.eps = eps, p.log2_base = std::log2(base);
  p.row_ranges = (std::ifstream(dir + "/starts.bin") ? kRowStarts : 0) |
                 (std::ifstream(dir + "/offsets.bin") ? kRowEnds : 0);
  int position = -1;
  if (config >> position && position >= 0) p.ring = 1, p.rope_shift = position - offset;
  const attn_i64 q[3] = {attn_i64(L) * hq * D, attn_i64(hq) * D, 1};
  const attn_i64 kv[3] = {attn_i64(L) * hkv * D, attn_i64(hkv) * D, 1};
  const attn_i64 cache[4] = {attn_i64(hkv) * capacity * D, attn_i64(capacity) * D, D, 1};
  for (int a = 0; a < 4; ++a) {
    if (a < 3) p.q_strides[a] = q[a], p.k_strides[a] = p.v_strides[a] = kv[a];
    p.kc_strides[a] = p.vc_strides[a] = cache[a];
  }
  if (dtype == "float32") run_groups<float>(dir, p, groups, scale);
  else if (dtype == "float16") run_groups<half>(dir, p, groups, scale);
  else if (dtype == "bfloat16") run_groups<ushort>(dir, p, groups, scale);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
