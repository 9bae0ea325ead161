// AttentionStep on the CPU: the preprocessing (norms, RoPE, cache write) in the dispatched task,
// then the CPU attention kernel (decode_attention_cpu) over the caches.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_step.h"
#include "decode_attention_quantized.h"
#include "mlx/backend/cpu/encoder.h"

namespace attn_kernels {

namespace {

// An evaluated array's memory on the CPU (the caches are written through it).
void* host_pointer(const mx::array& a) {
  return const_cast<void*>(a.data<void>());
}

// The step's elementwise part on the CPU, in MLX's order of roundings: RMSNorm rounds x·r to
// the dtype and multiplies by the weight in the dtype (as mx.fast.rms_norm), RoPE rotates that
// in float32 and rounds once. Without a weight (no q/k norm) the row is rotated as given.
template <typename T>
void norm_rope_row(
    const T* x, int64_t stride, const T* w, float eps, const float* cos_t, const float* sin_t,
    int D, T* dst, int64_t dst_stride) {
  float y[kMaxHeadDim];
  float sum = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float xd = static_cast<float>(x[d * stride]);
    y[d] = xd;
    sum += xd * xd;
  }
  if (w != nullptr) {
    const float r = 1.0f / std::sqrt(sum / D + eps);
    for (int d = 0; d < D; ++d) {
      y[d] = static_cast<float>(w[d] * static_cast<T>(y[d] * r));
    }
  }
  const int half = D / 2;
  for (int j = 0; j < half; ++j) {
    const float a = y[j], b = y[j + half];
    dst[j * dst_stride] = static_cast<T>(a * cos_t[j] - b * sin_t[j]);
    dst[(j + half) * dst_stride] = static_cast<T>(a * sin_t[j] + b * cos_t[j]);
  }
}

// One row of D values quantized into a quantized cache's row at `position` as MLX's CPU
// quantize does (affine_group; rint, codes clamped to [0, 2^bits - 1]); c: 0 keys, 1 values.
template <typename T>
void quantize_row_cpu(const T* x, const StepProblem& p, int b, int h, int position, int c) {
  const int G = p.group_size, bits = p.bits, per_word = 32 / bits;
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const int64_t* cs = c == 0 ? p.kc_strides : p.vc_strides;
  uint32_t* codes = static_cast<uint32_t*>(c == 0 ? p.k_cache : p.v_cache) + b * cs[0] +
                    h * cs[1] + position * cs[2];
  const int64_t at = b * p.sb_strides[0] + h * p.sb_strides[1] + position * p.sb_strides[2];
  T* scales = static_cast<T*>(c == 0 ? p.k_scales : p.v_scales) + at;
  T* biases = static_cast<T*>(c == 0 ? p.k_biases : p.v_biases) + at;
  for (int g = 0; g < p.head_dim / G; ++g) {
    const T* w = x + g * G;
    float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
    for (int j = 0; j < G; ++j) {
      w_max = std::max(w_max, static_cast<float>(w[j]));
      w_min = std::min(w_min, static_cast<float>(w[j]));
    }
    const AffineGroup a = affine_group(
        w_min, w_max, bits, [](float n, float d) { return n / d; },
        [](float v) { return std::rint(v); });
    for (int word = 0; word < G / per_word; ++word) {
      uint32_t packed = 0;
      for (int e = 0; e < per_word; ++e) {
        const float value = static_cast<float>(w[word * per_word + e]);
        const float code = std::rint((value - a.bias) / a.scale);
        packed |= static_cast<uint32_t>(std::min(std::max(code, 0.0f), n_bins)) << (bits * e);
      }
      codes[(int64_t{g} * G / per_word + word) * cs[3]] = packed;
    }
    scales[g * p.sb_strides[3]] = static_cast<T>(a.scale);
    biases[g * p.sb_strides[3]] = static_cast<T>(a.bias);
  }
}

template <typename T>
void preprocess_cpu(const StepProblem& p) {
  const int D = p.head_dim, half = D / 2, L = p.length;
  auto q = static_cast<const T*>(p.q);
  auto k = static_cast<const T*>(p.k);
  auto v = static_cast<const T*>(p.v);
  // Null without qk_norm: norm_rope_row then only rotates.
  auto qw = p.qk_norm ? static_cast<const T*>(p.q_weight) : nullptr;
  auto kw = p.qk_norm ? static_cast<const T*>(p.k_weight) : nullptr;
  auto q_out = static_cast<T*>(p.q_out);
  auto k_cache = static_cast<T*>(p.k_cache);
  auto v_cache = static_cast<T*>(p.v_cache);
  std::vector<float> cos_t(half), sin_t(half);
  for (int b = 0; b < p.batch; ++b) {
    for (int i = 0; i < L; ++i) {
      // Each row at its own place and position (the same for every row without per-row ranges).
      const int pos = p.write_position(b) + i, rope_pos = p.rope_position(b) + i;
      for (int j = 0; j < half; ++j) {
        const float theta = static_cast<float>(rope_pos) * p.inv_freq[j];
        cos_t[j] = std::cos(theta);
        sin_t[j] = std::sin(theta);
      }
      const float* c = cos_t.data();
      const float* s = sin_t.data();
      for (int h = 0; h < p.q_heads; ++h) {
        const T* x = q + b * p.q_strides[0] + i * p.q_strides[1] + int64_t{h} * D * p.q_strides[2];
        T* dst = q_out + ((int64_t{b} * p.q_heads + h) * L + i) * D;
        norm_rope_row(x, p.q_strides[2], qw, p.eps, c, s, D, dst, 1);
      }
      if (pos < 0 || pos >= p.capacity) {
        continue;  // a row's bad offset (clamped by the attention too) writes nothing
      }
      for (int h = 0; h < p.kv_heads; ++h) {
        const T* x = k + b * p.k_strides[0] + i * p.k_strides[1] + int64_t{h} * D * p.k_strides[2];
        const T* vx = v + b * p.v_strides[0] + i * p.v_strides[1] + int64_t{h} * D * p.v_strides[2];
        if (p.bits) {  // the rows as the dtype holds them, then quantized
          T row[kMaxHeadDim];
          norm_rope_row(x, p.k_strides[2], kw, p.eps, c, s, D, row, 1);
          quantize_row_cpu(row, p, b, h, pos, 0);
          for (int d = 0; d < D; ++d) {
            row[d] = vx[d * p.v_strides[2]];
          }
          quantize_row_cpu(row, p, b, h, pos, 1);
          continue;
        }
        T* dst = k_cache + b * p.kc_strides[0] + h * p.kc_strides[1] + pos * p.kc_strides[2];
        norm_rope_row(x, p.k_strides[2], kw, p.eps, c, s, D, dst, p.kc_strides[3]);
        T* vdst = v_cache + b * p.vc_strides[0] + h * p.vc_strides[1] + pos * p.vc_strides[2];
        for (int d = 0; d < D; ++d) {
          vdst[d * p.vc_strides[3]] = vx[d * p.v_strides[2]];
        }
      }
    }
  }
}

// A cache that could not be donated: copied element by element (any strides) into the
// row-contiguous output.
struct CacheCopy {
  const void* src;
  void* dst;
  mx::Strides strides;  // the source's
  mx::Shape shape;
  size_t itemsize;  // 2 or 4: a copy moves bits, whatever the type
};

template <typename Item>
void copy_items(const CacheCopy& c) {
  const Item* src = static_cast<const Item*>(c.src);
  Item* dst = static_cast<Item*>(c.dst);
  const auto& strides = c.strides;
  const auto& shape = c.shape;
  size_t n = 0;
  for (int a = 0; a < shape[0]; ++a) {
    for (int b = 0; b < shape[1]; ++b) {
      for (int c = 0; c < shape[2]; ++c) {
        const Item* row = src + a * strides[0] + b * strides[1] + c * strides[2];
        for (int d = 0; d < shape[3]; ++d) {
          dst[n++] = row[d * strides[3]];
        }
      }
    }
  }
}

void copy_cache(const CacheCopy& c) {
  if (c.itemsize == 4) {
    copy_items<uint32_t>(c);
  } else {
    copy_items<uint16_t>(c);
  }
}

template <typename T>
void run_step_cpu(
    const StepProblem& step,
    float scale,
    void* out,
    const std::vector<CacheCopy>& copies,
    CpuPath path) {
  for (const auto& c : copies) {
    copy_cache(c);
  }
  const size_t q_elems = size_t(step.batch) * step.q_heads * step.length * step.head_dim;
  std::vector<T> queries(q_elems);
  StepProblem p = step;
  p.q_out = queries.data();
  preprocess_cpu<T>(p);
  auto attend = [&](void* dst) {
    if (p.bits) {
      decode_attention_quantized_cpu(make_step_quantized_attention(p, queries.data(), dst, scale),
                                     path);
    } else {
      decode_attention_cpu(make_step_attention(p, queries.data(), dst, scale), path);
    }
  };
  if (step.length == 1) {
    attend(out);
    return;
  }
  // (B, Hq, L, D) from the kernel, (B, L, Hq, D) for o_proj.
  std::vector<T> heads_first(q_elems);
  attend(heads_first.data());
  const int L = step.length, H = step.q_heads, D = step.head_dim;
  T* o = static_cast<T*>(out);
  for (int b = 0; b < step.batch; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < L; ++i) {
        std::copy_n(
            heads_first.data() + ((int64_t{b} * H + h) * L + i) * D, D,
            o + ((int64_t{b} * L + i) * H + h) * D);
      }
    }
  }
}

}  // namespace

void AttentionStep::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  // The caches that must be copied before the step writes them.
  std::vector<CacheCopy> copies;
  const auto donated = donate_caches(inputs, outputs, owned_caches_);
  for (int c = 0; c < 2; ++c) {
    if (!donated[c]) {
      const auto& in = inputs[kKCacheInput + c];
      auto& out = outputs[1 + c];
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copies.push_back(
          {in.data<void>(), out.data<void>(), in.strides(), in.shape(), in.itemsize()});
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  const StepProblem step =
      make_step_problem(inputs, outputs, offset_, qk_norm_, kQNormInput, eps_, rope_base_,
                        rope_freqs_, 0, 0, row_ranges_, position_, host_pointer);
  // The CPU path is resolved here: a bad ATTN_KERNELS_CPU_PATH raises to the caller.
  encoder.dispatch([step,
                    scale = scale_,
                    o = out.data<void>(),
                    copies = std::move(copies),
                    path = cpu_path_from_env()]() {
    switch (step.dtype) {
      case ElementType::float32:
        run_step_cpu<float>(step, scale, o, copies, path);
        break;
      case ElementType::float16:
        run_step_cpu<mx::float16_t>(step, scale, o, copies, path);
        break;
      default:
        run_step_cpu<mx::bfloat16_t>(step, scale, o, copies, path);
        break;
    }
  });
}

void AttentionStepQuantized::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::vector<CacheCopy> copies;
  const auto donated = donate_caches(inputs, outputs, owned_caches_, kQuantizedCacheInput);
  for (int c = 0; c < 6; ++c) {
    if (!donated[c]) {
      const auto& in = inputs[kQuantizedCacheInput + c];
      auto& cache = outputs[1 + c];
      cache.set_data(mx::allocator::malloc(cache.nbytes()));
      copies.push_back(
          {in.data<void>(), cache.data<void>(), in.strides(), in.shape(), in.itemsize()});
    }
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& o : outputs) {
    encoder.set_output_array(o);
  }
  const StepProblem step = make_step_problem(
      inputs, outputs, offset_, qk_norm_, kQuantizedQNormInput, eps_, rope_base_, rope_freqs_,
      bits_, group_size_, row_ranges_, -1, host_pointer);
  // (The quantized kernel picks its instruction set itself: the path argument goes unused.)
  encoder.dispatch(
      [step, scale = scale_, o = out.data<void>(), copies = std::move(copies)]() {
        switch (step.dtype) {
          case ElementType::float32:
            run_step_cpu<float>(step, scale, o, copies, CpuPath::portable);
            break;
          case ElementType::float16:
            run_step_cpu<mx::float16_t>(step, scale, o, copies, CpuPath::portable);
            break;
          default:
            run_step_cpu<mx::bfloat16_t>(step, scale, o, copies, CpuPath::portable);
            break;
        }
      });
}

}  // namespace attn_kernels
