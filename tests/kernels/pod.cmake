# POD attention GPU tests (issue 5); they skip without a device (the planner's tests are
# tests/unit/plan's). Smoke: pod_tests --gtest_filter='PodSmoke*'.
attnd_add_test(pod_tests
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/pod_test.cc
  LIBS attnd_pod_kernels attnd_reference CUDA::cudart
  LABELS gpu)
attnd_add_test(cuda_backend_pod_test SOURCES cuda_backend_pod_test.cc LIBS attnd_server_lib LABELS kernels)
target_include_directories(cuda_backend_pod_test PRIVATE ${PROJECT_SOURCE_DIR}/tests/unit/plan)
