// The CPU kernels (attention, linear layers) for AVX2 with FMA and F16C: 8 floats per register;
// 16 registers, so 4 query vectors x 2 positions are scored at once.
// CMakeLists.txt gives this file its target flags; the dispatchers run it only where the CPU
// has them.
#define ATTN_CPU_PATH avx2
#define ATTN_CPU_WIDTH 8
#define ATTN_CPU_SCORE_POSITIONS 2
#define ATTN_CPU_REGISTERS 16
#include "cpu_kernel_body.h"
#include "cpu_linear_body.h"
