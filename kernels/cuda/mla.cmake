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

# The Hopper kernels (split-K and wide-tile; wgmma, setmaxnreg: sm_90a only) are their own object
# library compiled with that one -gencode, when 90 is among the architectures built; the launcher uses it on compute
# capability 9.0 (ATTND_MLA_HOPPER): the split-K kernel for caches of q's 16-bit type, the wide-tile one
# for those and fp8 e4m3 caches.
if(ATTND_CUDA_ARCHITECTURES MATCHES "(^|;)90")
  add_library(attnd_mla_hopper OBJECT
    ${CMAKE_CURRENT_LIST_DIR}/mla_decode_hopper.cu
    ${CMAKE_CURRENT_LIST_DIR}/mla_decode_hopper_wide.cu
    ${CMAKE_CURRENT_LIST_DIR}/mla_decode_hopper_wide_fp8.cu)
  target_include_directories(attnd_mla_hopper PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(attnd_mla_hopper PRIVATE attnd_kernel_types attnd_plan CUDA::cudart attnd_warnings)
  target_compile_options(attnd_mla_hopper
    PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a -lineinfo>)
  set_target_properties(attnd_mla_hopper PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON)
  target_sources(attnd_mla_kernels PRIVATE $<TARGET_OBJECTS:attnd_mla_hopper>)
  target_compile_definitions(attnd_mla_kernels PRIVATE ATTND_MLA_HOPPER=1)
endif()
