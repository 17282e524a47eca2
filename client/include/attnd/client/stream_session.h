// One ForwardStream: tagged Plan/Forward/EndStep messages with several in flight.
//
// The session assigns each message a tag and matches the response by it. Up to
// `StreamOptions::window` messages may wait for their responses; Send blocks while the window
// is full. A per-message error (StreamResponse.error) fails only that message; the stream
// lives on. When the stream itself ends (server gone, Cancel, Close), every waiting message
// fails with the stream's status, and later sends fail at once.
//
// Thread-safe. One reader thread per session delivers responses; callbacks run on it and must
// not block on other messages of the same session.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/step.h"
#include "attnd/v1/attnd.pb.h"

namespace attnd::client {

struct StreamOptions {
  // Messages sent and not yet answered, at most (>= 1).
  int32_t window = 16;
};

using StreamResult = absl::StatusOr<attnd::v1::StreamResponse>;

class StreamSession {
 public:
  class Impl;  // shared with the steps planned on this session
  explicit StreamSession(std::shared_ptr<Impl> impl);
  StreamSession(const StreamSession&) = delete;
  StreamSession& operator=(const StreamSession&) = delete;
  // Closes the stream (see Close). Steps still open on it are aborted by the server.
  ~StreamSession();

  // Sends `request` with a fresh tag (any tag set is replaced). `done` gets the response, the
  // message's own error, or the stream's failure. Blocks while the window is full.
  void SendAsync(attnd::v1::StreamRequest request, std::function<void(StreamResult)> done);
  std::future<StreamResult> Send(attnd::v1::StreamRequest request);

  // Typed round trips of one message each.
  absl::StatusOr<attnd::v1::PlanResponse> Plan(const attnd::v1::PlanRequest& request);
  absl::StatusOr<attnd::v1::ForwardResponse> Forward(const attnd::v1::ForwardRequest& request);
  absl::StatusOr<attnd::v1::EndStepResponse> EndStep(uint64_t step_id, bool abort);

  // Plans `request` on this stream and returns the open step; its Forward/End/Abort travel on
  // this stream too.
  absl::StatusOr<std::unique_ptr<Step>> BeginStep(const attnd::v1::PlanRequest& request);

  // Half-closes, waits up to `grace` for the answers still due, then ends the call (cancelling
  // it if the server has not finished by then). Returns the stream's final status. Idempotent.
  absl::Status Close(absl::Duration grace = absl::Seconds(10));
  // Cancels the call at once, as a client that disappears would.
  void Cancel();

  // Messages sent and not yet answered.
  int in_flight() const;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace attnd::client
