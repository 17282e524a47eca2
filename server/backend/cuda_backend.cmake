# The CUDA backend (issue 3): included from server/CMakeLists.txt when CUDA is on and
# backend/cuda_backend.cc exists. Host C++ only (no .cu here): it calls the kernel launchers of
# kernels/cuda and the planners of kernels/plan.
target_sources(attnd_server_lib PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_cache.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_completion_queue.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_ipc_channel.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_memory.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_output_pool.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_plan_cache.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_pod_step.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_range_allocator.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_step.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_step_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_step_resources.cc
  ${CMAKE_CURRENT_LIST_DIR}/decode_choice.cc
  ${CMAKE_CURRENT_LIST_DIR}/pod_choice.cc)
target_link_libraries(attnd_server_lib
  PUBLIC attnd_cuda_kernels attnd_prefill_kernels attnd_pod_kernels attnd_mla_kernels attnd_plan CUDA::cudart)
# backend_factory.cc picks the CUDA backend when a device is present.
target_compile_definitions(attnd_server_lib PRIVATE ATTND_HAVE_CUDA_BACKEND)
