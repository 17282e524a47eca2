// Channel flag words (DESIGN 3b) waited on and written by one-thread kernels instead of the
// driver's stream memory operations (stream_flags.h). Same conditions: a wait goes on once
// (int32_t)(*word - value) >= 0.
//
// Why: on an H100 under MPS, a kernel boundary on a stream costs ~5 us, and a memory-operation
// handoff between two processes ~10 us from the writer's last kernel to the waiter's next one
// (a GPU time line of both processes, docs/benchmarks.md, issue 12). A polling kernel that lets
// the next kernel start as its programmatic dependent, and a writing kernel launched as one,
// hide most of it.
//
// Costs and hazards of the polling wait: it is running work. It holds a thread and a CTA slot
// of one SM while it waits (a persistent kernel of the other process that wants every SM loses
// that SM's share: attnd's prefill, up to 1.3x slower when a client polls through a prompt
// step), and any implicitly synchronizing CUDA call of its own process (cudaFree, ...) waits
// for it: a process must not poll for a word that only its own host thread's later action can
// set. attnd therefore never polls; clients may, for done words. Not for words in host memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace attnd::cuda {

// Enqueues on `stream` a kernel that returns once the 32-bit word at `word` (device memory of
// this or a peer GPU) reaches `value` as a serial number. Once it has seen the word it lets a
// kernel launched after it as a programmatic dependent (launch.cuh; one that executes
// griddepcontrol.wait before it reads what the word guards) start: that kernel's launch then
// overlaps the gate's exit (~5 us of a stream under MPS on an H100). With `seen_ns` (a
// benchmark aid, see timer_stamp.h) it also writes the global timer there when it saw the word.
absl::Status LaunchFlagGate(cudaStream_t stream, const void* word, uint32_t value,
                            uint64_t* seen_ns = nullptr);

// Enqueues on `stream` a one-thread kernel that writes `value` to the word once the kernel
// before it has completed and its writes are visible (a system-scope fence, then a release
// store): cuStreamWriteValue32's effect, launched as a programmatic dependent of that kernel so
// that its launch overlaps the kernel's tail when the kernel lets dependents start early.
absl::Status LaunchFlagSignal(cudaStream_t stream, void* word, uint32_t value);

}  // namespace attnd::cuda
