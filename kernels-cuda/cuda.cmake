# Included by packages/attn-kernels/CMakeLists.txt when the installed MLX is the CUDA build.
# Before enable_language: it would set the compiler's default (sm_75 for nvcc 13, no bf16 mma).
if((NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
   AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES native)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)  # the runtime MLX's graph shares (see gpu-kit notes)
find_package(CUDAToolkit REQUIRED)

target_sources(_ext PRIVATE
  ${CUDA_KERNEL_DIR}/decode_attention.cu
  ${CUDA_KERNEL_DIR}/eval_gpu_cuda.cpp
  ${CUDA_KERNEL_DIR}/decode_attention_quantized.cu
  ${CUDA_KERNEL_DIR}/eval_gpu_quantized_cuda.cpp

  ${CUDA_KERNEL_DIR}/attention_step.cu
  ${CUDA_KERNEL_DIR}/eval_gpu_attention_step.cpp

  ${CUDA_KERNEL_DIR}/linear_quantized.cu
  ${CUDA_KERNEL_DIR}/eval_gpu_linear_cuda.cpp

  ${CUDA_KERNEL_DIR}/graph_limits_cuda.cpp
  ${CUDA_KERNEL_DIR}/output_memory_cuda.cpp)
target_include_directories(_ext PRIVATE ${CUDA_KERNEL_DIR})
# MLX's CUDA headers include <fmt/format.h>; the CUDA wheel does not ship it.
if(DEFINED ENV{FMT_INCLUDE})
  target_include_directories(_ext PRIVATE $ENV{FMT_INCLUDE})
endif()
target_link_libraries(_ext PRIVATE CUDA::cudart CUDA::cuda_driver)
set_target_properties(_ext PROPERTIES CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
# --split-compile=0: nvcc optimises a file's kernels on every core (the quantized file's 88
# kernels were the build's critical path: 106 of its 117 s on the H200's host); the machine
# code is the same (each kernel's .text compared, nvcc 13.0, sm_90).
target_compile_options(_ext PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--use_fast_math -lineinfo --split-compile=0>)
