// The cp.async pipeline of the tensor-core kernel (decode_attention_quantized_mmat.cuh): each warp
// copies the rows of its next sub-steps (16 positions: K and V codes, the scales and biases of K
// and V) from global into shared memory with 16-byte cp.async.cg, STAGES - 1 sub-steps ahead of
// the one it computes, and reads its operands from there, so a warp has up to STAGES - 1
// sub-steps of rows in flight whatever it is doing (loading straight into registers, as the
// earlier "mma" kernel did, left nothing in flight while it computed). The pipeline is private to
// a warp (its own stage buffers, __syncwarp, no block barrier).
//
// A stage: K codes, 16 rows of `pitch` bytes (the row, then 16 bytes of padding that spread the
// rows that one shared load reads across banks), V codes likewise, then the 16 positions' K
// scales, K biases, V scales, V biases (NG values each, as stored: contiguous rows). Rows past the
// chunk's end repeat its last row; scales and biases past it are zeros (cp.async's zero fill);
// both are masked out by the kernel (their weight is zero).
//
// Needs code rows of whole aligned 16-byte pieces and contiguous scale/bias rows whose 16
// positions start 16-byte aligned (mmat_applies() in decode_attention_quantized.cu).
#pragma once

#include <cstdint>

#include "decode_attention_quantized_kernel.cuh"

namespace attn_kernels::cuda::quantized {

constexpr int kStagePositions = 16;  // one sub-step of the mma kernel: kMmaStep positions

// Byte layout of one warp's stage for BITS, D and group size GS.
template <int BITS, int D, int GS>
struct StageLayout {
  static constexpr int kRowBytes = D * BITS / 8;
  static constexpr int kPitch = kRowBytes + 16;
  static constexpr int kGroups = D / GS;
  static constexpr int kScaleBytes = kStagePositions * kGroups * 2;  // one of the 4 arrays
  static constexpr int kV = kStagePositions * kPitch;                // V codes' offset
  static constexpr int kScales = 2 * kStagePositions * kPitch;       // K scales' offset
  static constexpr int kBytes = kScales + 4 * kScaleBytes;
  // Stages per warp: about 20 KB of them (3 at least), so that 2 blocks of 4 warps fit an SM
  // where they can and each warp has ~15 KB in flight.
  static constexpr int kStages = 20480 / kBytes < 3 ? 3 : 20480 / kBytes > 8 ? 8 : 20480 / kBytes;
};

// N bytes (2, 4, 8, 16 or 32) of shared memory from an address aligned to min(N, 16), as words
// (a 2-byte piece in the low half of word 0).
template <int N>
__device__ __forceinline__ void shared_piece(uint32_t* w, const char* src) {
  if constexpr (N >= 16) {
#pragma unroll
    for (int x = 0; x < N / 16; ++x) {
      const uint4 u = reinterpret_cast<const uint4*>(src)[x];
      w[4 * x] = u.x, w[4 * x + 1] = u.y, w[4 * x + 2] = u.z, w[4 * x + 3] = u.w;
    }
  } else if constexpr (N == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    w[0] = u.x, w[1] = u.y;
  } else if constexpr (N == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  } else {
    w[0] = *reinterpret_cast<const uint16_t*>(src);
  }
}

// One lane's part of copying the 16 positions from p0 (p0 < end, p0 a multiple of 16 from a
// 16-byte aligned scale row start) into `stage`. codes: K then V rows of position 0 of the
// key/value row; row_bytes: their position strides; scales: K scales, K biases, V scales, V
// biases of position 0; begin: a position of the chunk (read, not used, for zero-filled pieces).
template <int BITS, int D, int GS>
__device__ __forceinline__ void stage_in(char* stage, const char* const (&codes)[2],
                                         const int64_t (&row_bytes)[2],
                                         const char* const (&scales)[4], int p0, int begin,
                                         int end, int lane) {
  using S = StageLayout<BITS, D, GS>;
  // Lane l copies piece l % kPieces of rows l / kPieces + k * kRowsPerPass, k < kPasses.
  constexpr int kPieces = S::kRowBytes / 16;  // per row
  static_assert(32 % kPieces == 0, "a pass of the warp covers whole rows");
  constexpr int kRowsPerPass = 32 / kPieces, kPasses = kStagePositions / kRowsPerPass;
  const int first_row = lane / kPieces, piece = lane % kPieces;
  char* const to = stage + first_row * S::kPitch + piece * 16;
  if (p0 + kStagePositions <= end) {  // every sub-step but a chunk's last: rows in a stride
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const char* from = codes[a] + (p0 + first_row) * row_bytes[a] + piece * 16;
      const int64_t pass = kRowsPerPass * row_bytes[a];
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {
        copy_async16(to + a * S::kV + k * kRowsPerPass * S::kPitch, from + k * pass, 16);
      }
    }
  } else {
#pragma unroll
    for (int a = 0; a < 2; ++a) {
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {
        const int at = min(p0 + first_row + k * kRowsPerPass, end - 1);
        copy_async16(to + a * S::kV + k * kRowsPerPass * S::kPitch,
                     codes[a] + at * row_bytes[a] + piece * 16, 16);
      }
    }
  }
  constexpr int kScalePieces = S::kScaleBytes / 16;  // per array
  const int valid = (end - p0) * S::kGroups * 2;     // bytes of positions before `end`
  for (int i = lane; i < 4 * kScalePieces; i += 32) {
    const int a = i / kScalePieces, piece = i % kScalePieces;
    const int bytes = min(max(valid - piece * 16, 0), 16);
    // (selected, not indexed: a runtime index would put the array in local memory)
    const char* row = a == 0 ? scales[0] : a == 1 ? scales[1] : a == 2 ? scales[2] : scales[3];
    const char* from = row + (bytes > 0 ? int64_t{p0} * S::kGroups * 2 + piece * 16
                                        : int64_t{begin} * S::kGroups * 2);
    copy_async16(stage + S::kScales + a * S::kScaleBytes + piece * 16, from, bytes);
  }
}

}  // namespace attn_kernels::cuda::quantized
