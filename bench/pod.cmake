# pod_bench (issue 5): PERFORMANCE.md's POD cases, fused vs back to back vs merged prefill.
# Included from bench/CMakeLists.txt.
add_executable(pod_bench ${CMAKE_CURRENT_LIST_DIR}/pod_bench.cc ${CMAKE_CURRENT_LIST_DIR}/device_fill.cu)
target_include_directories(pod_bench PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(pod_bench PRIVATE attnd_pod_kernels attnd_prefill_kernels attnd_cuda_kernels
                      attnd_kernel_types CUDA::cudart attnd_warnings)
set_target_properties(pod_bench PROPERTIES CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}")
