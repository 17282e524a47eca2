// attnctl seq bench: ExportSequence and ImportSequence of one long sequence through gRPC bytes
// against through a channel (issue 17), on the daemon at --server.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "attnd/client/client.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::attnctl {

// "shm" (or "host_shm") and "cuda_ipc": the channel kinds a transfer can take.
absl::StatusOr<attnd::v1::ChannelKind> TransferChannelKind(const std::string& name);

// Creates two caches from the cache flags (default: 32 layers, 32/8 heads of 128, bf16, pages
// of 16), imports a random sequence of --tokens into the first, and times, for gRPC bytes and
// for each --channel kind (default shm; "all": shm and cuda_ipc): the export alone, the import
// alone, and a copy (export into import) between the two caches. Prints MB/s. With
// --keep_cache the caches stay (sequence 1 in seqbench-src), e.g. to try seq export on them.
int RunSeqBench(client::Client& client);

}  // namespace attnd::attnctl
