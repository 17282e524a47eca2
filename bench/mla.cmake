# mla_bench (issue 6): PERFORMANCE.md's mla case (oversubscription vs one-wave vs no split, % of
# the copy bandwidth). Included from bench/CMakeLists.txt.
add_executable(mla_bench ${CMAKE_CURRENT_LIST_DIR}/mla_bench.cc ${CMAKE_CURRENT_LIST_DIR}/device_fill.cu)
target_link_libraries(mla_bench PRIVATE attnd_mla_kernels attnd_reference CUDA::cudart attnd_warnings)
set_target_properties(mla_bench PROPERTIES CUDA_ARCHITECTURES "${ATTND_CUDA_ARCHITECTURES}")
