# prefill_bench (issue 4): PERFORMANCE.md's prefill cases against a measured cuBLAS peak.
# Included from bench/CMakeLists.txt.
add_executable(prefill_bench ${CMAKE_CURRENT_LIST_DIR}/prefill_bench.cc)
target_link_libraries(prefill_bench PRIVATE attnd_prefill_kernels attnd_reference CUDA::cudart CUDA::cublas
                      attnd_warnings)
