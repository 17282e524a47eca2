// The machinery behind StreamSession, shared by the session and the steps planned on it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/client/stream_session.h"
#include "attnd/v1/attnd.grpc.pb.h"

namespace attnd::client {

class StreamSession::Impl {
 public:
  using Done = std::function<void(StreamResult)>;

  // Starts the call and its reader thread. `stub` is used only here.
  Impl(attnd::v1::AttentionService::Stub& stub, std::unique_ptr<grpc::ClientContext> context,
       StreamOptions options);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  void SendAsync(attnd::v1::StreamRequest request, Done done);
  absl::Status Close(absl::Duration grace);
  void Cancel();
  int in_flight() const;

 private:
  void ReadLoop();
  void JoinReader();

  const StreamOptions options_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<attnd::v1::StreamRequest, attnd::v1::StreamResponse>>
      stream_;

  mutable std::mutex mu_;  // guards the fields below up to write_mu_
  std::condition_variable cv_;
  std::map<uint64_t, Done> pending_;  // tag -> waiting message
  uint64_t next_tag_ = 1;
  bool closing_ = false;      // Close started: no new messages
  bool cancelled_ = false;    // Cancel called
  bool reader_done_ = false;  // the call has ended; final_status_ is set
  absl::Status final_status_;

  // Serialises Write/WritesDone/Finish: the sync stream allows one writer at a time.
  std::mutex write_mu_;
  bool writes_done_ = false;

  std::mutex join_mu_;
  std::thread reader_;
};

// The payload of a stream result, or why there is none.
absl::StatusOr<attnd::v1::PlanResponse> TakePlan(StreamResult result);
absl::StatusOr<attnd::v1::ForwardResponse> TakeForward(StreamResult result);
absl::StatusOr<attnd::v1::EndStepResponse> TakeEndStep(StreamResult result);

}  // namespace attnd::client
