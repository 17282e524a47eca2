# POD attention (issue 5): the fused prefill + decode kernel and its launcher (the planner is
# kernels/plan's). Included from kernels/cuda/CMakeLists.txt after prefill.cmake (it runs the
# prefill tile code and the prefill launcher's steps). One .cu per head_dim, as for prefill, so 2-core builds overlap them.
add_library(attnd_pod_kernels STATIC
  ${CMAKE_CURRENT_LIST_DIR}/pod.cc
  ${CMAKE_CURRENT_LIST_DIR}/pod_d64.cu
  ${CMAKE_CURRENT_LIST_DIR}/pod_d128.cu
  ${CMAKE_CURRENT_LIST_DIR}/pod_d256.cu
)
target_include_directories(attnd_pod_kernels PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(attnd_pod_kernels
  PUBLIC attnd_prefill_kernels attnd_kernel_types attnd_plan absl::status absl::statusor CUDA::cudart
  PRIVATE absl::strings attnd_warnings)
target_compile_options(attnd_pod_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
set_target_properties(attnd_pod_kernels PROPERTIES
  CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}"
  POSITION_INDEPENDENT_CODE ON)
