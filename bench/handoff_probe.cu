// handoff_probe: what a cross-process ready/done handoff costs on this GPU, and which way of
// waiting costs least, for the channels' CUDA_IPC path (DESIGN 3b, issue 12).
//
// Two processes on one GPU (run it under MPS, as the channels are): a "daemon" that owns the
// flag words (cudaMalloc, shared by a legacy IPC handle) and a "client" that opens them. Per
// layer the client runs a fill kernel, sets ready[l], waits for done[l]; the daemon waits for
// ready[l], runs two kernels (append-like and attention-like, fixed durations), sets done[l].
// The kernels are timed busy-waits on %globaltimer, so only the handoffs vary between modes.
// A mode names how each side waits:
//   memop   cuStreamWaitValue32 on the stream (what attnd and its client do today)
//   spin    a one-thread kernel that polls the word, then the stream goes on (the next kernel
//           was queued behind it, so its launch is an ordinary back-to-back one)
// and the daemon's wait can also be folded into its first kernel (daemon=fused: every CTA of the
// append-like kernel polls the word before its work). The second table varies how the words are
// written (cuStreamWriteValue32 with its system-scope fence, without it, or a one-thread kernel
// after a device-scope fence) and whether the daemon records attnd's four events per layer,
// with kernels that write --write_kb of data each, as the real ones do.
// Layer time = the client's events after consecutive done waits; the baseline is the same three
// kernels back to back in one process, no flags.
//   handoff_probe [--layers=32] [--steps=40] [--fill_us=10] [--append_us=5] [--attend_us=40]
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attnd/kernels/cuda/stream_flags.h"

namespace {

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t error_ = (call);                                                     \
    if (error_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                   \
                   cudaGetErrorString(error_));                                            \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    const absl::Status status_ = (expr);                                                   \
    if (!status_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, status_.ToString().c_str()); \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

__device__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void PollWord(const volatile uint32_t* word, uint32_t value) {
  while (static_cast<int32_t>(*word - value) < 0) {
    __nanosleep(32);
  }
}

// Every CTA busy-waits `ns` from its own start (a kernel of known duration on a full grid).
__global__ void BusyKernel(uint64_t ns) {
  const uint64_t end = GlobalTimer() + ns;
  while (GlobalTimer() < end) {
  }
}

// As BusyKernel, each CTA first waiting for the word (thread 0 polls, the CTA follows).
__global__ void PollThenBusyKernel(const uint32_t* word, uint32_t value, uint64_t ns) {
  if (threadIdx.x == 0) PollWord(word, value);
  __syncthreads();
  __threadfence();
  const uint64_t end = GlobalTimer() + ns;
  while (GlobalTimer() < end) {
  }
}

__global__ void PollKernel(const uint32_t* word, uint32_t value) {
  PollWord(word, value);
  __threadfence();
}

// As BusyKernel, then every thread stores its share of `bytes` at `out` (16-byte stores).
__global__ void BusyWriteKernel(uint64_t ns, uint4* out, int64_t vectors) {
  const uint64_t end = GlobalTimer() + ns;
  while (GlobalTimer() < end) {
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vectors;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = make_uint4(static_cast<uint32_t>(i), 1, 2, 3);
  }
}

// The word written by a kernel after a device-scope fence (earlier kernels of the stream are
// complete and their writes visible on this device).
__global__ void SignalKernel(uint32_t* word, uint32_t value) {
  __threadfence();
  *reinterpret_cast<volatile uint32_t*>(word) = value;
}

struct Options {
  int layers = 32;
  int steps = 40;
  double fill_us = 10;
  double append_us = 5;
  double attend_us = 40;
  int grid = 132;
  int64_t write_kb = 1536;
};

enum class Wait { kMemop, kSpin, kFused };

const char* Name(Wait wait) {
  switch (wait) {
    case Wait::kMemop: return "memop";
    case Wait::kSpin: return "spin";
    case Wait::kFused: return "fused";
  }
  return "?";
}

struct Mode {
  Wait daemon;
  Wait client;  // kMemop or kSpin
};

constexpr Mode kModes[] = {
    {Wait::kMemop, Wait::kMemop}, {Wait::kSpin, Wait::kMemop}, {Wait::kFused, Wait::kMemop},
    {Wait::kMemop, Wait::kSpin},  {Wait::kSpin, Wait::kSpin},  {Wait::kFused, Wait::kSpin},
};

uint64_t Ns(double us) { return static_cast<uint64_t>(us * 1000.0); }

enum class Signal { kMemop, kMemopNoBarrier, kKernel };

// Events the daemon records per layer: before the first kernel, between the kernels, after
// the second, and after the done word.
enum class Events {
  kNone,
  kTiming4,        // four timing events
  kAttnd,          // three timing events and a blocking-sync one without timing (attnd today)
  kBlocking1,      // only the last: blocking-sync, no timing
  kPlain1,         // only the last: no timing, no blocking sync
  kTiming3Plain1,  // three timing events and a plain one
};

struct SignalConfig {
  const char* name;
  Signal signal;
  Events events;
};

constexpr SignalConfig kSignals[] = {
    {"memop, no events", Signal::kMemop, Events::kNone},
    {"memop, 4 timing events", Signal::kMemop, Events::kTiming4},
    {"memop, 3 timing + 1 block", Signal::kMemop, Events::kAttnd},
    {"memop, 1 blocking event", Signal::kMemop, Events::kBlocking1},
    {"memop, 1 plain event", Signal::kMemop, Events::kPlain1},
    {"memop, 3 timing + 1 plain", Signal::kMemop, Events::kTiming3Plain1},
    {"kernel write, no events", Signal::kKernel, Events::kNone},
};

void SignalWord(cudaStream_t stream, Signal signal, uint32_t* word, uint32_t value) {
  using namespace attnd::cuda::stream_flags_internal;
  static const WaitOrWrite write = Lookup("cuStreamWriteValue32");
  switch (signal) {
    case Signal::kMemop:
      CHECK_OK(attnd::cuda::StreamWriteFlag(stream, word, value));
      break;
    case Signal::kMemopNoBarrier:
      CHECK_OK(Call("cuStreamWriteValue32", write, stream, word, value,
                    /*CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER*/ 0x1));
      break;
    case Signal::kKernel:
      SignalKernel<<<1, 1, 0, stream>>>(word, value);
      CHECK_CUDA(cudaGetLastError());
      break;
  }
}

void Wait_(cudaStream_t stream, Wait wait, uint32_t* word, uint32_t value) {
  if (wait == Wait::kMemop) {
    CHECK_OK(attnd::cuda::StreamWaitFlag(stream, word, value));
  } else if (wait == Wait::kSpin) {
    PollKernel<<<1, 32, 0, stream>>>(word, value);
    CHECK_CUDA(cudaGetLastError());
  }
}

void WriteAll(int fd, const void* data, size_t size) {
  if (write(fd, data, size) != static_cast<ssize_t>(size)) std::exit(3);
}
void ReadAll(int fd, void* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t got = read(fd, static_cast<char*>(data) + done, size - done);
    if (got <= 0) std::exit(3);
    done += static_cast<size_t>(got);
  }
}

// Word layout: ready[0..layers), done[0..layers).
int RunDaemon(const Options& options, int to_client, int from_client) {
  CHECK_CUDA(cudaSetDevice(0));
  uint32_t* words = nullptr;
  const size_t bytes = 2 * options.layers * sizeof(uint32_t);
  CHECK_CUDA(cudaMalloc(&words, bytes));
  CHECK_CUDA(cudaMemset(words, 0, bytes));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  CHECK_CUDA(cudaIpcGetMemHandle(&handle, words));
  WriteAll(to_client, &handle, sizeof(handle));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint32_t sequence = 0;
  for (const Mode& mode : kModes) {
    for (int step = 0; step < options.steps; ++step) {
      ++sequence;
      for (int l = 0; l < options.layers; ++l) {
        uint32_t* ready = words + l;
        uint32_t* done = words + options.layers + l;
        if (mode.daemon == Wait::kFused) {
          PollThenBusyKernel<<<options.grid, 128, 0, stream>>>(ready, sequence,
                                                               Ns(options.append_us));
        } else {
          Wait_(stream, mode.daemon, ready, sequence);
          BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.append_us));
        }
        BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.attend_us));
        CHECK_CUDA(cudaGetLastError());
        CHECK_OK(attnd::cuda::StreamWriteFlag(stream, done, sequence));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    char ack = 0;
    ReadAll(from_client, &ack, 1);  // the client has its numbers for this mode
  }
  const int64_t vectors = options.write_kb * 1024 / 16;
  uint4* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, 2 * vectors * sizeof(uint4)));
  cudaEvent_t timing[3], blocking, plain;
  for (cudaEvent_t& event : timing) CHECK_CUDA(cudaEventCreate(&event));
  CHECK_CUDA(cudaEventCreateWithFlags(&blocking, cudaEventBlockingSync | cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming));
  for (const SignalConfig& config : kSignals) {
    const bool timed = config.events == Events::kTiming4 || config.events == Events::kAttnd ||
                       config.events == Events::kTiming3Plain1;
    cudaEvent_t last = nullptr;
    switch (config.events) {
      case Events::kTiming4: last = timing[0]; break;
      case Events::kAttnd: case Events::kBlocking1: last = blocking; break;
      case Events::kPlain1: case Events::kTiming3Plain1: last = plain; break;
      case Events::kNone: break;
    }
    for (int step = 0; step < options.steps; ++step) {
      ++sequence;
      for (int l = 0; l < options.layers; ++l) {
        uint32_t* ready = words + l;
        uint32_t* done = words + options.layers + l;
        CHECK_OK(attnd::cuda::StreamWaitFlag(stream, ready, sequence));
        if (timed) CHECK_CUDA(cudaEventRecord(timing[0], stream));
        BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.append_us), out, vectors);
        if (timed) CHECK_CUDA(cudaEventRecord(timing[1], stream));
        BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.attend_us), out + vectors,
                                                          vectors);
        if (timed) CHECK_CUDA(cudaEventRecord(timing[2], stream));
        CHECK_CUDA(cudaGetLastError());
        SignalWord(stream, config.signal, done, sequence);
        if (last != nullptr) CHECK_CUDA(cudaEventRecord(last, stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    char ack = 0;
    ReadAll(from_client, &ack, 1);
  }
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaFree(words));
  return 0;
}

double Median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}
double Percentile(std::vector<float> values, double p) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[static_cast<size_t>(p * (values.size() - 1))];
}

int RunClient(const Options& options, int from_daemon, int to_daemon) {
  CHECK_CUDA(cudaSetDevice(0));
  cudaIpcMemHandle_t handle;
  ReadAll(from_daemon, &handle, sizeof(handle));
  void* mapped = nullptr;
  CHECK_CUDA(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess));
  uint32_t* words = static_cast<uint32_t*>(mapped);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> events(options.layers + 1);
  for (cudaEvent_t& event : events) CHECK_CUDA(cudaEventCreate(&event));

  // Baseline: the same kernels back to back in this process, no flags.
  std::vector<float> baseline;
  for (int step = 0; step < options.steps; ++step) {
    CHECK_CUDA(cudaEventRecord(events[0], stream));
    for (int l = 0; l < options.layers; ++l) {
      BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.fill_us));
      BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.append_us));
      BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.attend_us));
      CHECK_CUDA(cudaEventRecord(events[l + 1], stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (int l = 1; l < options.layers; ++l) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, events[l], events[l + 1]));
      baseline.push_back(ms * 1000.f);
    }
  }
  const double base = Median(baseline);
  std::printf("kernels (fill %.1f + append %.1f + attend %.1f us, grid %d): back to back in one "
              "process %.2f us per layer (p50)\n",
              options.fill_us, options.append_us, options.attend_us, options.grid, base);
  std::printf("%-8s %-8s %12s %12s %14s\n", "daemon", "client", "layer p50", "layer p99",
              "overhead p50");
  uint32_t sequence = 0;
  for (const Mode& mode : kModes) {
    std::vector<float> layer_us;
    for (int step = 0; step < options.steps; ++step) {
      ++sequence;
      for (int l = 0; l < options.layers; ++l) {
        uint32_t* ready = words + l;
        uint32_t* done = words + options.layers + l;
        BusyKernel<<<options.grid, 128, 0, stream>>>(Ns(options.fill_us));
        CHECK_CUDA(cudaGetLastError());
        CHECK_OK(attnd::cuda::StreamWriteFlag(stream, ready, sequence));
        Wait_(stream, mode.client, done, sequence);
        CHECK_CUDA(cudaEventRecord(events[l + 1], stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (step < 2) continue;  // warm-up
      for (int l = 1; l < options.layers; ++l) {
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, events[l], events[l + 1]));
        layer_us.push_back(ms * 1000.f);
      }
    }
    const double p50 = Median(layer_us);
    std::printf("%-8s %-8s %9.2f us %9.2f us %11.2f us\n", Name(mode.daemon), Name(mode.client),
                p50, Percentile(layer_us, 0.99), p50 - base);
    std::fflush(stdout);
    const char ack = 1;
    WriteAll(to_daemon, &ack, 1);
  }
  // Kernels that write their data, ways of writing the words.
  const int64_t vectors = options.write_kb * 1024 / 16;
  uint4* out = nullptr;
  CHECK_CUDA(cudaMalloc(&out, 3 * vectors * sizeof(uint4)));
  std::vector<float> written_baseline;
  for (int step = 0; step < options.steps; ++step) {
    CHECK_CUDA(cudaEventRecord(events[0], stream));
    for (int l = 0; l < options.layers; ++l) {
      BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.fill_us), out, vectors);
      BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.append_us), out + vectors,
                                                        vectors);
      BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.attend_us),
                                                        out + 2 * vectors, vectors);
      CHECK_CUDA(cudaEventRecord(events[l + 1], stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (int l = 1; l < options.layers; ++l) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, events[l], events[l + 1]));
      written_baseline.push_back(ms * 1000.f);
    }
  }
  const double written_base = Median(written_baseline);
  std::printf("\nkernels writing %lld KiB each: back to back in one process %.2f us per layer "
              "(p50); daemon and client wait with cuStreamWaitValue32\n",
              static_cast<long long>(options.write_kb), written_base);
  std::printf("%-26s %12s %12s %14s\n", "words written by", "layer p50", "layer p99",
              "overhead p50");
  for (const SignalConfig& config : kSignals) {
    std::vector<float> layer_us;
    for (int step = 0; step < options.steps; ++step) {
      ++sequence;
      for (int l = 0; l < options.layers; ++l) {
        uint32_t* ready = words + l;
        uint32_t* done = words + options.layers + l;
        BusyWriteKernel<<<options.grid, 128, 0, stream>>>(Ns(options.fill_us), out, vectors);
        CHECK_CUDA(cudaGetLastError());
        SignalWord(stream, config.signal, ready, sequence);
        CHECK_OK(attnd::cuda::StreamWaitFlag(stream, done, sequence));
        CHECK_CUDA(cudaEventRecord(events[l + 1], stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (step < 2) continue;
      for (int l = 1; l < options.layers; ++l) {
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, events[l], events[l + 1]));
        layer_us.push_back(ms * 1000.f);
      }
    }
    const double p50 = Median(layer_us);
    std::printf("%-26s %9.2f us %9.2f us %11.2f us\n", config.name, p50,
                Percentile(layer_us, 0.99), p50 - written_base);
    std::fflush(stdout);
    const char ack = 1;
    WriteAll(to_daemon, &ack, 1);
  }
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaIpcCloseMemHandle(mapped));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const std::string prefix = std::string("--") + name + "=";
      return arg.rfind(prefix, 0) == 0 ? arg.c_str() + prefix.size() : nullptr;
    };
    if (const char* v = value("layers")) options.layers = std::atoi(v);
    else if (const char* v = value("steps")) options.steps = std::atoi(v);
    else if (const char* v = value("fill_us")) options.fill_us = std::atof(v);
    else if (const char* v = value("append_us")) options.append_us = std::atof(v);
    else if (const char* v = value("attend_us")) options.attend_us = std::atof(v);
    else if (const char* v = value("grid")) options.grid = std::atoi(v);
    else if (const char* v = value("write_kb")) options.write_kb = std::atoll(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 1;
    }
  }
  int down[2], up[2];  // daemon -> client, client -> daemon
  if (pipe(down) != 0 || pipe(up) != 0) return 3;
  // Fork before any CUDA call: each process makes its own context.
  const pid_t child = fork();
  if (child < 0) return 3;
  if (child == 0) return RunClient(options, down[0], up[1]);
  const int rc = RunDaemon(options, down[1], up[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 4);
}
