# Batch prefill (issue 4): the tensor-core kernel over the paged cache, its launcher and its
# host planner. Included from kernels/cuda/CMakeLists.txt. Instantiations are split by head_dim
# (prefill_d*.cu, 16 or 12 kernels each) so a 2-core build compiles them in parallel.
add_library(attnd_prefill_kernels STATIC
  ${CMAKE_CURRENT_LIST_DIR}/prefill.cc
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d64.cu
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d128.cu
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d256.cu
  ${CMAKE_CURRENT_LIST_DIR}/../plan/prefill_plan.cc
)
target_include_directories(attnd_prefill_kernels
  PUBLIC ${CMAKE_CURRENT_LIST_DIR}/../include ${CMAKE_CURRENT_LIST_DIR}/..
  PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(attnd_prefill_kernels
  PUBLIC attnd_kernel_types absl::status absl::statusor CUDA::cudart
  PRIVATE attnd_cuda_kernels absl::strings attnd_warnings)  # MergeStates (merge.h)
target_compile_options(attnd_prefill_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
set_target_properties(attnd_prefill_kernels PROPERTIES
  CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}"
  POSITION_INDEPENDENT_CODE ON)
