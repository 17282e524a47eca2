# The CUDA backend (issue 3), its own target: included from server/CMakeLists.txt when CUDA is
# on. Host C++ only (no .cu here): it calls the kernel launchers of kernels/cuda (through their
# public headers, attnd/kernels/cuda/) and the step plan of kernels/plan.
attnd_server_layer(attnd_backend_cuda
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_backend.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_cache.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_completion_queue.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_ipc_channel.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_memory.cc
          ${CMAKE_CURRENT_LIST_DIR}/nccl_channel.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_output_pool.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_plan_cache.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_step.cc
          ${CMAKE_CURRENT_LIST_DIR}/cuda_step_resources.cc
          ${CMAKE_CURRENT_LIST_DIR}/stream_step_window.cc
  PUBLIC attnd_backend_api attnd_plan attnd_nccl_loader CUDA::cudart
  PRIVATE attnd_channel attnd_util attnd_cuda_kernels attnd_prefill_kernels attnd_pod_kernels
          attnd_mla_kernels absl::strings absl::synchronization)
