// The CPU kernels (attention, linear layers) for the architecture's baseline (x86-64: SSE2): 4
// floats per register, 16 registers.
// CMakeLists.txt gives this file its target flags; the dispatchers run it only where the CPU
// has them.
#define ATTN_CPU_PATH portable
#define ATTN_CPU_WIDTH 4
#define ATTN_CPU_SCORE_POSITIONS 2
#define ATTN_CPU_REGISTERS 16
#include "cpu_kernel_body.h"
#include "cpu_linear_body.h"
