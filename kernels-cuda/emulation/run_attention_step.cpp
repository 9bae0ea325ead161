// Runs AttentionStep's CUDA kernels on the CPU under cuda_emu.h: the two-kernel path
// (attention_step_kernel.cuh's step_preprocess, then decode_attention_mma.cuh's attend_mma over
// the updated caches) and the folded kernel (attend_mma_step), each on its own copy of the caches.
//
//   run_attention_step DIR
//   run_attention_step --rotations DIR
//   run_attention_step --quantized DIR
//
// DIR holds config.txt ("B Hq Hkv L offset D dtype splits capacity qk_norm [position]", dtype
// 0 = f16, 1 = bf16, position a full ring's sequence position as attention_step takes it) and
// float32 inputs, each exactly representable in the dtype: q.bin (B, L, Hq·D), k.bin
// and v.bin (B, L, Hkv·D), qw.bin and kw.bin (D; read only with qk_norm), kc.bin and vc.bin
// (B, Hkv, capacity, D); with per-row ranges, starts.bin and offsets.bin (int32 (B,): the rows'
// first positions and write positions; offset is then the largest write position). It writes
// float32 out_chain.bin and out_fold.bin (B, Hq, L, D: the attention's heads-first output) and
// kc_chain.bin, vc_chain.bin, kc_fold.bin, vc_fold.bin, and where a KV head has more than 8 query
// vectors and D <= 128, out_wide.bin: split-mma-16's attend_mma (tiles of 16 vectors) over the
// chain's caches. The launches follow plan_mma() with the split count given (chunks of whole
// 64-position block steps, no empty chunk).
// With --rotations, DIR holds rotations.txt ("D base") and positions.bin (int32) instead, and it
// writes rotations.bin: float32 (positions, D/2, 3), the angle of each pair as the kernels form
// it (the position times StepProblem's inverse frequency) and rope_cos_sin's cosine and sine.
// With --quantized, config.txt is "B Hq Hkv L offset D dtype capacity qk_norm bits group_size"
// and it runs step_preprocess into zeroed caches of the dtype (kc_plain.bin, vc_plain.bin,
// q_plain.bin) and into zeroed quantized caches (kcodes.bin, vcodes.bin as uint32; kscales.bin,
// kbiases.bin, vscales.bin, vbiases.bin; q_quant.bin).
#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"

// The kernels' source itself, unchanged.
#include "../decode_attention_mma.cuh"

namespace {

using emu::read_file;
using namespace attn_kernels;
using namespace attn_kernels::cuda;

template <typename T>
std::vector<T> to_t(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) store(&out[i], x[i]);
  return out;
}

template <typename T>
void write(const std::string& path, const std::vector<T>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = to_float(x[i]);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
}

// int32 values of DIR/name, or none when the file is absent.
std::vector<int32_t> read_ints(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  std::vector<char> raw{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  std::vector<int32_t> out(raw.size() / sizeof(int32_t));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(int32_t));
  return out;
}

// The step's inputs from DIR (float32 files, each value exact in T; per-row ranges where
// starts.bin and offsets.bin, int32 (B,), are there) and the StepProblem that reads them
// (contiguous projections; caches and outputs left for the caller).
template <typename T>
struct StepInputs {
  std::vector<T> q, k, v, qw, kw;
  std::vector<int32_t> starts, offsets;
  StepInputs(const std::string& dir, bool qk_norm)
      : q(to_t<T>(read_file<float>(dir + "/q.bin"))),
        k(to_t<T>(read_file<float>(dir + "/k.bin"))),
        v(to_t<T>(read_file<float>(dir + "/v.bin"))),
        qw(qk_norm ? to_t<T>(read_file<float>(dir + "/qw.bin")) : std::vector<T>{}),
        kw(qk_norm ? to_t<T>(read_file<float>(dir + "/kw.bin")) : std::vector<T>{}),
        starts(read_ints(dir + "/starts.bin")),
        offsets(read_ints(dir + "/offsets.bin")) {}

  StepProblem problem(int b, int hq, int hkv, int L, int offset, int D, bool qk_norm,
                      int capacity) const {
    StepProblem s{};
    s.q = q.data(), s.k = k.data(), s.v = v.data();
    s.q_weight = qk_norm ? qw.data() : nullptr, s.k_weight = qk_norm ? kw.data() : nullptr;
    s.qk_norm = qk_norm;
    s.dtype = std::is_same_v<T, __half> ? ElementType::float16 : ElementType::bfloat16;
    s.batch = b, s.length = L, s.q_heads = hq, s.kv_heads = hkv, s.head_dim = D;
    s.offset = offset, s.capacity = capacity;
    s.row_ranges = (starts.empty() ? 0 : kRowStarts) | (offsets.empty() ? 0 : kRowEnds);
    s.row_starts = starts.data(), s.row_offsets = offsets.data();
    s.eps = 1e-6f, s.log2_base = std::log2(1e6f);
    for (int j = 0; j < D / 2; ++j) s.inv_freq[j] = rope_inverse_frequency(j, D / 2, s.log2_base);
    const int64_t q_strides[3] = {int64_t(L) * hq * D, int64_t(hq) * D, 1};
    const int64_t kv_strides[3] = {int64_t(L) * hkv * D, int64_t(hkv) * D, 1};
    for (int a = 0; a < 3; ++a) {
      s.q_strides[a] = q_strides[a];
      s.k_strides[a] = s.v_strides[a] = kv_strides[a];
    }
    return s;
  }
};

template <typename T, int D>
int run(const std::string& dir, int b, int hq, int hkv, int L, int offset, int splits,
        int capacity, bool qk_norm, int position) {
  const StepInputs<T> in(dir, qk_norm);
  const auto kc0 = to_t<T>(read_file<float>(dir + "/kc.bin"));
  const auto vc0 = to_t<T>(read_file<float>(dir + "/vc.bin"));
  StepProblem s = in.problem(b, hq, hkv, L, offset, D, qk_norm, capacity);
  if (position >= 0) s.ring = 1, s.rope_shift = position - offset;
  const int64_t cache[4] = {int64_t(hkv) * capacity * D, int64_t(capacity) * D, D, 1};
  for (int a = 0; a < 4; ++a) s.kc_strides[a] = s.vc_strides[a] = cache[a];

  // The attention over the updated caches, as every backend builds it.
  DecodeProblem p = make_step_attention(s, nullptr, nullptr, 1.0f / std::sqrt(float(D)));

  // plan_mma()'s launch with the split count given.
  const int S = p.context, step = kMmaWarps * kMmaStep;
  const int vectors = p.group * L, tiles = (vectors + kMmaVectors - 1) / kMmaVectors;
  int chunk = (S + splits - 1) / splits;
  chunk = (chunk + step - 1) / step * step;
  splits = (S + chunk - 1) / chunk;
  const size_t partial_floats = size_t(p.kv_rows) * vectors * splits * partial_stride(D);
  const size_t shared_floats = mma_step_smem_bytes<T>(D) / sizeof(float);
  const unsigned gx = p.kv_rows * tiles, gy = splits;

  // The two-kernel path.
  auto kc = kc0, vc = vc0;
  std::vector<T> scratch(size_t(b) * hq * L * D), out(scratch.size());
  std::vector<float> partials(partial_floats);
  s.q_out = scratch.data(), s.k_cache = kc.data(), s.v_cache = vc.data();
  const int warps = 4;
  emu::launch(b * L, (hq + hkv + warps - 1) / warps, warps * 32, 1,
         [&] { step::step_preprocess<T>(s); });
  p.queries = scratch.data(), p.keys = kc.data(), p.values = vc.data(), p.out = out.data();
  emu::launch(gx, gy, kMmaWarps * 32, shared_floats, [&] {
    attend_mma<T, D>(p, splits > 1 ? partials.data() : nullptr, chunk, 0u);
  });
  write(dir + "/out_chain.bin", out);
  write(dir + "/kc_chain.bin", kc);
  write(dir + "/vc_chain.bin", vc);

  // split-mma-16's kernel over the same updated caches, where a KV head has more than 8 vectors
  // (tiles of 16; the same splits).
  if constexpr (D <= 128) {
    constexpr int kWide = 2 * kMmaVectors;
    if (vectors > kMmaVectors) {
      std::vector<T> out_wide(out.size());
      std::fill(partials.begin(), partials.end(), NAN);
      p.out = out_wide.data();
      emu::launch(p.kv_rows * ((vectors + kWide - 1) / kWide), gy, kMmaWarps * 32,
                  finish_smem_floats(kMmaWarps, kWide, D), [&] {
                    attend_mma<T, D, kWide>(p, splits > 1 ? partials.data() : nullptr, chunk, 0u);
                  });
      write(dir + "/out_wide.bin", out_wide);
    }
  }

  // The folded kernel on fresh caches; no scratch.
  auto kf = kc0, vf = vc0;
  std::vector<T> out_fold(out.size());
  std::fill(partials.begin(), partials.end(), NAN);
  s.q_out = nullptr, s.k_cache = kf.data(), s.v_cache = vf.data();
  p.queries = nullptr, p.keys = kf.data(), p.values = vf.data(), p.out = out_fold.data();
  emu::launch(gx, gy, kMmaWarps * 32, shared_floats, [&] {
    attend_mma_step<T, D>(p, splits > 1 ? partials.data() : nullptr, chunk, gx, s);
  });
  write(dir + "/out_fold.bin", out_fold);
  write(dir + "/kc_fold.bin", kf);
  write(dir + "/vc_fold.bin", vf);
  std::printf("splits %d chunk %d tiles %d\n", splits, chunk, tiles);
  return 0;
}

// --quantized: step_preprocess on caches of the dtype, then on quantized caches
// (StepProblem::bits), from the same inputs (zeroed caches of `capacity` positions).
template <typename T>
int run_quantized(const std::string& dir, int b, int hq, int hkv, int L, int offset, int D,
                  int capacity, bool qk_norm, int bits, int group_size) {
  const StepInputs<T> in(dir, qk_norm);
  StepProblem s = in.problem(b, hq, hkv, L, offset, D, qk_norm, capacity);
  const int warps = 4;
  auto strides = [&](int64_t last) {
    return std::array<int64_t, 4>{
        int64_t(hkv) * capacity * last, int64_t(capacity) * last, last, 1};
  };
  // Caches of the dtype.
  std::vector<T> kc(size_t(b) * hkv * capacity * D), vc(kc.size()), q_plain(size_t(b) * hq * L * D);
  auto plain = strides(D);
  for (int a = 0; a < 4; ++a) s.kc_strides[a] = s.vc_strides[a] = plain[a];
  s.q_out = q_plain.data(), s.k_cache = kc.data(), s.v_cache = vc.data();
  const unsigned head_blocks = (hq + hkv + warps - 1) / warps;
  emu::launch(b * L, head_blocks, warps * 32, 1, [&] { step::step_preprocess<T>(s); });
  // Quantized caches.
  const int words = D * bits / 32, groups = D / group_size;
  std::vector<uint32_t> kcodes(size_t(b) * hkv * capacity * words), vcodes(kcodes.size());
  std::vector<T> sb[4];  // k scales, k biases, v scales, v biases
  for (auto& a : sb) a.assign(size_t(b) * hkv * capacity * groups, T{});
  std::vector<T> q_quant(q_plain.size());
  auto coded = strides(words), grouped = strides(groups);
  for (int a = 0; a < 4; ++a) {
    s.kc_strides[a] = s.vc_strides[a] = coded[a];
    s.sb_strides[a] = grouped[a];
  }
  s.bits = bits, s.group_size = group_size;
  s.q_out = q_quant.data(), s.k_cache = kcodes.data(), s.v_cache = vcodes.data();
  s.k_scales = sb[0].data(), s.k_biases = sb[1].data(), s.v_scales = sb[2].data();
  s.v_biases = sb[3].data();
  emu::launch(b * L, head_blocks, warps * 32, 1, [&] { step::step_preprocess<T>(s); });
  write(dir + "/kc_plain.bin", kc);
  write(dir + "/vc_plain.bin", vc);
  write(dir + "/q_plain.bin", q_plain);
  write(dir + "/q_quant.bin", q_quant);
  for (auto [name, codes] : {std::pair{"kcodes", &kcodes}, {"vcodes", &vcodes}}) {
    std::ofstream(dir + "/" + name + ".bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(codes->data()), codes->size() * sizeof(uint32_t));
  }
  const char* names[] = {"kscales", "kbiases", "vscales", "vbiases"};
  for (int i = 0; i < 4; ++i) write(dir + "/" + names[i] + ".bin", sb[i]);
  return 0;
}

int rotations(const std::string& dir) {
  std::ifstream config(dir + "/rotations.txt");
  int D;
  float base;
  if (!(config >> D >> base) || D < 2 || D > 256 || D % 2 != 0) {
    std::fprintf(stderr, "bad %s/rotations.txt\n", dir.c_str());
    return 2;
  }
  std::ifstream f(dir + "/positions.bin", std::ios::binary);
  std::vector<char> raw{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  std::vector<int32_t> positions(raw.size() / sizeof(int32_t));
  std::memcpy(positions.data(), raw.data(), positions.size() * sizeof(int32_t));
  const int half = D / 2;
  const float log2_base = std::log2(base);
  std::vector<float> out;
  for (const int32_t position : positions) {
    for (int j = 0; j < half; ++j) {
      const float inv_freq = rope_inverse_frequency(j, half, log2_base);
      const float2 cs = step::rope_cos_sin(position, inv_freq);
      out.insert(out.end(), {static_cast<float>(position) * inv_freq, cs.x, cs.y});
    }
  }
  std::ofstream(dir + "/rotations.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(float));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--rotations") return rotations(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "--quantized") {
    const std::string dir = argv[2];
    std::ifstream config(dir + "/config.txt");
    int b, hq, hkv, L, offset, D, dtype, capacity, qk_norm, bits, group_size;
    if (!(config >> b >> hq >> hkv >> L >> offset >> D >> dtype >> capacity >> qk_norm >> bits >>
          group_size) ||
        D % 64 != 0 || D > 256 || D % group_size != 0) {
      std::fprintf(stderr, "bad %s/config.txt\n", dir.c_str());
      return 2;
    }
    return dtype == 0 ? run_quantized<__half>(dir, b, hq, hkv, L, offset, D, capacity, qk_norm,
                                              bits, group_size)
                      : run_quantized<__nv_bfloat16>(dir, b, hq, hkv, L, offset, D, capacity,
                                                     qk_norm, bits, group_size);
  }
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR | --rotations DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::ifstream config(dir + "/config.txt");
  int b, hq, hkv, L, offset, D, dtype, splits, capacity, qk_norm;
  if (!(config >> b >> hq >> hkv >> L >> offset >> D >> dtype >> splits >> capacity >> qk_norm)) {
    std::fprintf(stderr, "bad %s/config.txt\n", dir.c_str());
    return 2;
  }
  int position = -1;
  config >> position;  // optional
  const bool norm = qk_norm != 0;
  // The head dims decode_attention.cu compiles (mma_head_dim).
  auto dispatch = [&]<typename T>() {
    switch (D) {
      case 64: return run<T, 64>(dir, b, hq, hkv, L, offset, splits, capacity, norm, position);
      case 80: return run<T, 80>(dir, b, hq, hkv, L, offset, splits, capacity, norm, position);
      case 96: return run<T, 96>(dir, b, hq, hkv, L, offset, splits, capacity, norm, position);
      case 128: return run<T, 128>(dir, b, hq, hkv, L, offset, splits, capacity, norm, position);
      case 256: return run<T, 256>(dir, b, hq, hkv, L, offset, splits, capacity, norm, position);
    }
    std::fprintf(stderr, "the mma kernel takes head_dim 64, 80, 96, 128 or 256\n");
    return 2;
  };
  return dtype == 0 ? dispatch.template operator()<__half>()
                    : dispatch.template operator()<__nv_bfloat16>();
}
