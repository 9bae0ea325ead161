// Runs kernels-cuda/decode_attention_quantized_kernel.cuh on the CPU under cuda_emu.h.
//
//   run_decode_attention_quantized DIR
//
// DIR holds config.txt ("B Hq Hkv L S D bits group_size causal mask_kind splits capacity kind")
// where mask_kind is 0 (none) or 1 (float32, (B, Hq, L, S) contiguous), q.bin (float32, (B, Hq,
// L, D) contiguous), kc.bin, ks.bin, kb.bin, vc.bin, vs.bin, vb.bin (mx.quantize's arrays, float32
// scales and biases, each (B, Hkv, capacity, ·) contiguous, capacity in config line 2) and
// mask.bin, and after kind an optional RowRanges value (1 starts, 2 ends, 3 both: starts.bin,
// ends.bin int32 (B,)); it receives out.bin, float32 (B, Hq, L, D). The launch follows
// plan_quantized() with the split count given. kind 0 runs the SIMT kernel (8x2) on float32
// storage; kinds 2 and 4 the tensor-core kernel (decode_attention_quantized_mmat.cuh) sized for
// that many blocks per SM (mmat, mmat4: their stage counts; launch bounds do not apply here) on
// half storage: queries, scales and biases rounded to f16, the output f16 (written back as
// float32).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_emu.h"
// The kernel source itself, unchanged.
#include "../decode_attention_quantized_kernel.cuh"
#include "../decode_attention_quantized_mmat.cuh"

namespace {

using emu::read_file;
using namespace attn_kernels;
using namespace attn_kernels::cuda;
using namespace attn_kernels::cuda::quantized;

using Kernel = void (*)(QuantizedProblem, float*, int, unsigned);

template <int BITS>
Kernel kernel_for(int lpr) {
  switch (lpr) {
    case 4: return &attend_quantized<float, BITS, 4>;
    case 8: return &attend_quantized<float, BITS, 8>;
    case 16: return &attend_quantized<float, BITS, 16>;
    default: return &attend_quantized<float, BITS, 32>;
  }
}

// The mmat kernel sized for BLOCKS (2 or 4) blocks per SM, as plan_quantized() takes it, with the
// shared memory it takes (bytes).
template <int BITS, int D, int GS, int BLOCKS>
std::pair<Kernel, size_t> mmat_kernel_for() {
  constexpr int kStages = mmat_stages<BITS, D, GS, BLOCKS>();
  return {&attend_quantized_mmat<__half, BITS, D, GS, kStages, BLOCKS>,
          mmat_smem_bytes<BITS, D, GS, kStages>()};
}

template <int BITS, int D>
std::pair<Kernel, size_t> mmat_kernel_for(int group_size, int blocks) {
  auto pick = [&]<int GS>() {
    return blocks == 4 ? mmat_kernel_for<BITS, D, GS, 4>() : mmat_kernel_for<BITS, D, GS, 2>();
  };
  if (group_size == 32) return pick.template operator()<32>();
  if (group_size == 64) return pick.template operator()<64>();
  if constexpr (D >= 128) return pick.template operator()<128>();
  throw std::invalid_argument("group size");
}

template <int BITS>
std::pair<Kernel, size_t> mmat_kernel_for(int d, int group_size, int blocks) {
  if (d == 64) return mmat_kernel_for<BITS, 64>(group_size, blocks);
  if (d == 128) return mmat_kernel_for<BITS, 128>(group_size, blocks);
  if (d == 256) return mmat_kernel_for<BITS, 256>(group_size, blocks);
  throw std::invalid_argument("the mmat kernel takes head_dim 64, 128 or 256");
}

std::vector<__half> to_half(const std::vector<float>& x) {
  std::vector<__half> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = __float2half_rn(x[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = emu::runner_folder(argc, argv);
  std::ifstream config(dir + "/config.txt");
  int b, hq, hkv, L, S, D, bits, group_size, causal, mask_kind, splits, capacity, kind;
  config >> b >> hq >> hkv >> L >> S >> D >> bits >> group_size >> causal >> mask_kind >> splits >>
      capacity >> kind;
  int row_ranges = 0;  // optional: RowRanges bits (starts.bin, ends.bin: int32 (B,))
  config >> row_ranges;
  if (kind != 0 && kind != 2 && kind != 4) {
    std::fprintf(stderr, "kind must be 0 (8x2), 2 (mmat) or 4 (mmat4), got %d\n", kind);
    return 2;
  }
  const bool mma = kind != 0;
  const auto q = read_file<float>(dir + "/q.bin"), mask = read_file<float>(dir + "/mask.bin");
  const auto kc = read_file<uint32_t>(dir + "/kc.bin"), vc = read_file<uint32_t>(dir + "/vc.bin");
  const auto ks = read_file<float>(dir + "/ks.bin"), kb = read_file<float>(dir + "/kb.bin");
  const auto vs = read_file<float>(dir + "/vs.bin"), vb = read_file<float>(dir + "/vb.bin");
  std::vector<float> out(q.size(), NAN);
  const auto q16 = to_half(q), ks16 = to_half(ks), kb16 = to_half(kb);
  const auto vs16 = to_half(vs), vb16 = to_half(vb);
  std::vector<__half> out16(q.size(), __float2half_rn(NAN));

  const auto starts = row_ranges & kRowStarts ? read_file<int32_t>(dir + "/starts.bin")
                                              : std::vector<int32_t>{};
  const auto ends =
      row_ranges & kRowEnds ? read_file<int32_t>(dir + "/ends.bin") : std::vector<int32_t>{};

  QuantizedProblem p{};
  static_cast<AttentionGeometry&>(p) =
      make_geometry(b, hq, hkv, L, S, D, 1.0f / std::sqrt(float(D)), causal != 0, nullptr);
  if (mask_kind) {
    p.mask_kind = kMaskFloat32;
    const int64_t m_strides[4] = {int64_t(hq) * L * S, int64_t(L) * S, S, 1};
    for (int a = 0; a < 4; ++a) p.m_strides[a] = m_strides[a];
  }
  p.row_ranges = row_ranges;
  p.row_starts = starts.data();
  p.row_ends = ends.data();
  p.queries = q.data();
  p.k_codes = kc.data(), p.k_scales = ks.data(), p.k_biases = kb.data();
  p.v_codes = vc.data(), p.v_scales = vs.data(), p.v_biases = vb.data();
  p.mask = mask_kind ? mask.data() : nullptr;
  p.out = out.data();
  p.dtype = ElementType::float32;
  if (mma) {
    p.queries = q16.data();
    p.k_scales = ks16.data(), p.k_biases = kb16.data();
    p.v_scales = vs16.data(), p.v_biases = vb16.data();
    p.out = out16.data();
    p.dtype = ElementType::float16;
  }
  p.bits = bits, p.group_size = group_size;
  const int words = D * bits / 32, groups = D / group_size;
  for (auto* strides : {&p.k_strides, &p.v_strides}) {
    const int64_t code[4] = {int64_t(hkv) * capacity * words, int64_t(capacity) * words, words, 1};
    const int64_t group[4] = {int64_t(hkv) * capacity * groups, int64_t(capacity) * groups, groups, 1};
    for (int a = 0; a < 4; ++a) {
      (*strides)[0][a] = code[a];
      (*strides)[1][a] = group[a];
      (*strides)[2][a] = group[a];
    }
  }

  // plan_quantized()'s shape of the launch, with the split count from the config.
  int lpr = 4;
  while (lpr * 8 < D) lpr *= 2;
  const int vpb = mma ? kMmaVectors : kVectors;
  const int vectors = p.group * L, tiles = (vectors + vpb - 1) / vpb;
  const int step = mma ? kWarps * kMmaStep : 2 * (kThreads / lpr);
  Kernel kernel;
  size_t smem_bytes = states_smem_bytes(vpb, D);
  if (mma) {
    std::tie(kernel, smem_bytes) = bits == 8 ? mmat_kernel_for<8>(D, group_size, kind)
                                             : mmat_kernel_for<4>(D, group_size, kind);
  } else {
    kernel = bits == 8 ? kernel_for<8>(lpr) : kernel_for<4>(lpr);
  }
  // split_context()'s limit: the merge's chunks in shared memory.
  splits = std::clamp(splits, 1, max_merged_splits(int(smem_bytes / sizeof(float)), vpb));
  int chunk = (S + splits - 1) / splits;
  chunk = (chunk + step - 1) / step * step;
  splits = (S + chunk - 1) / chunk;
  std::vector<float> partials(size_t(p.kv_rows) * vectors * splits * partial_stride(D));
  emu::launch(p.kv_rows * tiles, splits, kThreads, smem_bytes / sizeof(float),
              [&] { kernel(p, splits > 1 ? partials.data() : nullptr, chunk, 7u); });
  if (mma) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = __half2float(out16[i]);
  }
  std::ofstream(dir + "/out.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(float));
  std::printf("splits %d chunk %d %s\n", splits, chunk, mma ? "mmat" : "simt");
  return 0;
}
