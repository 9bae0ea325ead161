// How the CUDA kernels declare their shared memory: the block's dynamic floats and a flag. The
// emulation (emulation/cuda_emu.h) defines both first, as views of its block's storage.
#pragma once

#if defined(__CUDACC__) && !defined(ATTN_SHARED_FLOATS)
#define ATTN_SHARED_FLOATS(name) extern __shared__ __align__(16) float name[]
#define ATTN_SHARED_FLAG(name) __shared__ bool name
#endif
