#include "callback_queue_pin.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

namespace attnd::client {

void PinCallbackQueue() {
  // A callback server that is started once and never stopped holds a reference to the queue
  // for good. It has no port: it never serves anything.
  static grpc::Server* const pinned = [] {
    static grpc::CallbackGenericService service;
    grpc::ServerBuilder builder;
    builder.RegisterCallbackGenericService(&service);
    return builder.BuildAndStart().release();
  }();
  (void)pinned;
}

}  // namespace attnd::client
