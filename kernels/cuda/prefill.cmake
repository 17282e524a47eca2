# Batch prefill (issue 4): the tensor-core kernels over the paged cache and their launcher (the
# host planner is kernels/plan's). Included from kernels/cuda/CMakeLists.txt. mma.sync instantiations are split by
# head_dim (prefill_d*.cu, 16 or 12 kernels each) so a 2-core build compiles them in parallel;
# the Hopper kernel (prefill_hopper.cu, 4 kernels) is built for sm_90a alone, below.
add_library(attnd_prefill_kernels STATIC
  ${CMAKE_CURRENT_LIST_DIR}/prefill.cc
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d64.cu
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d128.cu
  ${CMAKE_CURRENT_LIST_DIR}/prefill_d256.cu
)
target_include_directories(attnd_prefill_kernels PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(attnd_prefill_kernels
  PUBLIC attnd_kernel_types attnd_plan absl::status absl::statusor CUDA::cudart
  PRIVATE attnd_cuda_kernels absl::strings attnd_warnings)  # MergeStates (merge.h)
target_compile_options(attnd_prefill_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
set_target_properties(attnd_prefill_kernels PROPERTIES
  CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}"
  POSITION_INDEPENDENT_CODE ON)

# wgmma and setmaxnreg exist only in the arch-specific sm_90a target, so the Hopper kernel is its
# own object library compiled with that one -gencode (a plain sm_90 pass would reject them), and
# only when 90 is among the architectures built. The launcher dispatches to it when the plan
# asks for it (ATTND_PREFILL_HOPPER) and the device is compute capability 9.0.
if(ATTND_CUDA_ARCHITECTURES MATCHES "(^|;)90")
  add_library(attnd_prefill_hopper OBJECT ${CMAKE_CURRENT_LIST_DIR}/prefill_hopper.cu)
  target_include_directories(attnd_prefill_hopper PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(attnd_prefill_hopper PRIVATE attnd_kernel_types attnd_plan CUDA::cudart attnd_warnings)
  target_compile_options(attnd_prefill_hopper
    PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a -lineinfo>)
  set_target_properties(attnd_prefill_hopper PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_sources(attnd_prefill_kernels PRIVATE $<TARGET_OBJECTS:attnd_prefill_hopper>)
  target_compile_definitions(attnd_prefill_kernels PRIVATE ATTND_PREFILL_HOPPER=1)
endif()
