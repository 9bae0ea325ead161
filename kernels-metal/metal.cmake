# Included by packages/attn-kernels/CMakeLists.txt when the installed MLX is the Metal build
# (macOS): builds attn_kernels.metallib with MLX's mlx_build_metallib and installs it beside the
# extension, where eval_gpu_metal.cpp loads it. The kernels read csrc/attention_geometry.h too.
mlx_build_metallib(
  TARGET attn_kernels_metallib
  TITLE attn_kernels
  SOURCES ${METAL_KERNEL_DIR}/decode_attention.metal ${METAL_KERNEL_DIR}/decode_attention_quantized.metal
    ${METAL_KERNEL_DIR}/attention_step.metal
  INCLUDE_DIRS ${METAL_KERNEL_DIR} ${CMAKE_CURRENT_SOURCE_DIR}/csrc ${MLX_INCLUDE_DIRS}
  OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
add_dependencies(_ext attn_kernels_metallib)
target_sources(_ext PRIVATE
  ${METAL_KERNEL_DIR}/eval_gpu_metal.cpp
  ${METAL_KERNEL_DIR}/eval_gpu_metal_quantized.cpp
  ${METAL_KERNEL_DIR}/eval_gpu_attention_step_metal.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/csrc/linear_no_gpu.cpp)  # no Metal linear kernel: MLX's matmuls
target_include_directories(_ext PRIVATE ${METAL_KERNEL_DIR})
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/attn_kernels.metallib DESTINATION attn_kernels)
