// The CPU kernels (attention, linear layers) for AVX-512 (F, BW, DQ, VL) with FMA and F16C: 16
// floats per register, 32 registers.
// CMakeLists.txt gives this file its target flags; the dispatchers run it only where the CPU
// has them.
#define ATTN_CPU_PATH avx512
#define ATTN_CPU_WIDTH 16
#define ATTN_CPU_SCORE_POSITIONS 4
#define ATTN_CPU_REGISTERS 32
#include "cpu_kernel_body.h"
#include "cpu_linear_body.h"
