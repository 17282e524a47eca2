// The machinery behind StreamSession, shared by the session and the steps planned on it: a
// gRPC callback reactor over raw messages (grpc::ByteBuffer), so that a zero-copy forward's
// tensors go out from the caller's memory and its o comes back straight into the caller's
// buffer. Typed messages are serialized and parsed with protobuf as before.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/client_callback.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/client/stream_session.h"
#include "attnd/v1/attnd.grpc.pb.h"

namespace attnd::client {

//
// Lifetime: the session keeps itself alive (self_) until gRPC's OnDone, so the last external
// reference may be dropped anywhere, a callback included; StreamSession's destructor closes the
// stream, which is what ends it.
class StreamSession::Impl final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
      public std::enable_shared_from_this<StreamSession::Impl> {
 public:
  using Done = std::function<void(StreamResult)>;

  // Starts the call.
  static std::shared_ptr<Impl> Start(const std::shared_ptr<grpc::Channel>& channel,
                                     std::unique_ptr<grpc::ClientContext> context,
                                     StreamOptions options);
  Impl(std::unique_ptr<grpc::ClientContext> context, StreamOptions options);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() override = default;

  void SendAsync(attnd::v1::StreamRequest request, Done done);
  // A zero-copy forward (Step::ForwardRaw).
  void SendForwardRaw(uint64_t step_id, int32_t layer, const TensorView& q, const TensorView& k,
                      const TensorView& v, const ForwardOutputBuffers& outputs,
                      RawForwardCallback done);
  absl::Status Close(absl::Duration grace);
  void Cancel();
  int in_flight() const;

  // grpc::ClientBidiReactor
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  struct Pending {
    Done typed;                    // a typed message's callback, or
    RawForwardCallback raw;        // a zero-copy forward's
    ForwardOutputBuffers outputs;  // where its outputs go
    bool written = false;          // raw: gRPC is done with the caller's input bytes
    bool answered = false;         // raw: the reply is in `result`
    absl::StatusOr<ForwardOutcome> result;
  };
  struct Write {
    grpc::ByteBuffer message;
    uint64_t raw_tag = 0;  // a zero-copy forward's tag (its input bytes are the caller's)
  };

  // Registers a message under a fresh tag (blocking while the window is full) and queues its
  // bytes from `encode(tag)`; false (and `refused` set) when the stream is over.
  template <typename Encode>
  bool Enqueue(Pending pending, Encode&& encode, absl::Status& refused);
  // What to do after a state change, decided under the lock and done after it (gRPC may run
  // reactions inline).
  struct Actions {
    grpc::ByteBuffer* write = nullptr;
    bool writes_done = false;   // StartWritesDone
    bool release_hold = false;  // let the call end
  };
  Actions NextActionsLocked();
  void Act(const Actions& actions);
  // A raw forward whose reply came and whose bytes were written: its callback, to run after
  // the lock.
  std::function<void()> TakeDeliveryLocked(uint64_t tag);

  const StreamOptions options_;
  std::unique_ptr<grpc::ClientContext> context_;
  grpc::ByteBuffer incoming_;  // only touched by the single outstanding read

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Pending> pending_;  // tag -> waiting message
  std::deque<Write> writes_;  // queued writes, front first; references stay valid on push
  bool broken_ = false;      // a write failed: the call is over
  bool read_done_ = false;   // the read side ended: the call is over
  bool writing_ = false;                 // writes_.front() is being written
  uint64_t next_tag_ = 1;
  bool closing_ = false;      // Close started: no new messages
  bool hold_released_ = false;  // no write starts any more; the call may end
  bool cancelled_ = false;    // Cancel called
  bool abandon_writes_ = false;  // Close timed out: drop queued writes
  bool done_ = false;  // OnDone ran; final_status_ is set
  absl::Status final_status_;
  std::shared_ptr<Impl> self_;  // until OnDone
};

// The payload of a stream result, or why there is none.
absl::StatusOr<attnd::v1::PlanResponse> TakePlan(StreamResult result);
absl::StatusOr<attnd::v1::ForwardResponse> TakeForward(StreamResult result);
absl::StatusOr<attnd::v1::EndStepResponse> TakeEndStep(StreamResult result);

}  // namespace attnd::client
