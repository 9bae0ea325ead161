// The CPU kernels (attention, linear layers) for arm64 NEON (AdvSIMD): 4 floats per register;
// 32 registers, so 4 query vectors x 4 positions are scored at once.
// CMakeLists.txt gives this file its target flags; the dispatchers run it only where the CPU
// has them.
#define ATTN_CPU_PATH neon
#define ATTN_CPU_WIDTH 4
#define ATTN_CPU_SCORE_POSITIONS 4
#define ATTN_CPU_REGISTERS 32
#include "cpu_kernel_body.h"
#include "cpu_linear_body.h"
