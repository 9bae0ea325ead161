// The CPU kernel for The architecture's baseline (x86-64: SSE2): 4 floats per register.
// CMakeLists.txt gives this file its target flags; the dispatcher runs it only where the CPU
// has them.
#define ATTN_CPU_PATH portable
#define ATTN_CPU_WIDTH 4
#define ATTN_CPU_SCORE_POSITIONS 2
#include "cpu_kernel_body.h"
