// The CPU kernel for AVX-512 (F, BW, DQ, VL) with FMA and F16C: 16 floats per register.
// CMakeLists.txt gives this file its target flags; the dispatcher runs it only where the CPU
// has them.
#define ATTN_CPU_PATH avx512
#define ATTN_CPU_WIDTH 16
#define ATTN_CPU_SCORE_POSITIONS 4
#include "cpu_kernel_body.h"
