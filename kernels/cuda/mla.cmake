# MLA decode (issue 6): the latent-cache decode kernels and their launcher. Included from
# kernels/cuda/CMakeLists.txt. Instantiations are split by kv_lora_rank (4 kernels per file) so
# a 2-core build compiles them in parallel.
add_library(attnd_mla_kernels STATIC
  ${CMAKE_CURRENT_LIST_DIR}/mla_decode.cu
  ${CMAKE_CURRENT_LIST_DIR}/mla_decode_r512.cu
  ${CMAKE_CURRENT_LIST_DIR}/mla_decode_r256.cu
)
target_include_directories(attnd_mla_kernels PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(attnd_mla_kernels
  PUBLIC attnd_kernel_types attnd_plan absl::status absl::statusor CUDA::cudart
  PRIVATE attnd_cuda_kernels absl::strings attnd_warnings)  # MergeStates (merge.h)
target_compile_options(attnd_mla_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
set_target_properties(attnd_mla_kernels PROPERTIES
  CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}"
  POSITION_INDEPENDENT_CODE ON)
