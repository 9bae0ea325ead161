// Runs kernels-metal/attention_step.metal and decode_attention.metal (the fused step as the Metal
// launcher sequences them) on the CPU under the SIMT emulation.
//
//   run_attention_step DIR
//
// DIR holds params.bin (AttentionStepParams), config.txt ("dtype groups scale"), q.bin, k.bin,
// v.bin, q_norm.bin and k_norm.bin (only with params.qk_norm), k_cache.bin, v_cache.bin (raw
// storage: float32, float16 or bfloat16 bits; caches as the params' strides describe, contiguous
// here) and receives out.bin (B, L, Hq·D) and the updated k_cache.bin, v_cache.bin.
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

template <typename T, int G>
void run(const std::string& dir, const AttentionStepParams& p, float scale) {
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
                                                q_out.data(), kc, vc, p, group, thread);
                 });

  const DecodeAttentionParams a = step_attention_params(p, scale);
  T* attended = p.length == 1 ? out.data() : heads_first.data();
  const uchar unused_mask = 0;
  std::vector<float> shared(G * (p.head_dim + 2) + G + 1);
  simt::dispatch(a.rows * a.query_len, G * simt::kSimdWidth, [&](int group, int thread) {
    decode_attention<T, G>(q_out.data(), kc, vc, &unused_mask, attended, a, shared.data(), group,
                           thread, thread / simt::kSimdWidth, thread % simt::kSimdWidth);
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
  const auto raw = read_file(dir + "/params.bin");
  if (raw.size() != sizeof(AttentionStepParams)) {
    std::fprintf(stderr, "params.bin: %zu bytes, expected %zu\n", raw.size(), sizeof(AttentionStepParams));
    return 2;
  }
  AttentionStepParams p;
  std::memcpy(&p, raw.data(), sizeof(p));
  std::ifstream config(dir + "/config.txt");
  std::string dtype;
  int groups = 0;
  float scale = 0.0f;
  config >> dtype >> groups >> scale;
  if (dtype == "float32") run_groups<float>(dir, p, groups, scale);
  else if (dtype == "float16") run_groups<half>(dir, p, groups, scale);
  else if (dtype == "bfloat16") run_groups<ushort>(dir, p, groups, scale);
  else throw std::runtime_error("unknown dtype " + dtype);
  return 0;
}
