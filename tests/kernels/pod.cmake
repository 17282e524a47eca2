# POD attention GPU tests (issue 5); GPU cases skip without a device, planner cases run
# everywhere. Smoke: pod_tests --gtest_filter='PodSmoke*:PodPlan*:PodSchedule*'.
attnd_add_test(pod_tests
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/pod_test.cc
  LIBS attnd_pod_kernels attnd_reference CUDA::cudart
  LABELS gpu)
attnd_add_test(cuda_backend_pod_test SOURCES cuda_backend_pod_test.cc LIBS attnd_server_lib LABELS kernels)
