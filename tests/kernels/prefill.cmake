# Batch prefill GPU tests (issue 4); skip without a device. Included from
# tests/kernels/CMakeLists.txt.
attnd_add_test(prefill_tests
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/prefill_test.cc
  LIBS attnd_prefill_kernels attnd_reference CUDA::cudart
  LABELS gpu)
target_include_directories(prefill_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests/unit/plan)
