// How a Client reaches the daemon. Mirrors attnctl's global flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace attnd::client {

struct KeepaliveOptions {
  // Ping the connection this often, and drop it when a ping is not answered in `timeout`, so
  // a dead peer (or a NAT that forgot the flow) fails calls instead of hanging them. attnd
  // accepts pings every 10 s (--keepalive_min_ping_interval), with or without calls in flight
  // (--keepalive_permit_without_calls); a server that allows fewer closes the connection
  // (GOAWAY too_many_pings), so raise `time` for such servers.
  absl::Duration time = absl::Seconds(30);
  absl::Duration timeout = absl::Seconds(10);
  bool permit_without_calls = true;
};

struct TlsOptions {
  bool enabled = false;
  std::string root_certs_pem;    // empty: the system roots
  std::string cert_chain_pem;    // mutual TLS: the client's certificate
  std::string private_key_pem;   // mutual TLS: its key
  // The name the server's certificate must carry, when it is not the address's host (e.g. a
  // certificate for "attnd.internal" reached through an IP address or a tunnel).
  std::string server_name_override;
};

struct ClientOptions {
  // host:port, or any gRPC target ("dns:///attnd:50051", "unix:///run/attnd.sock").
  std::string address = "localhost:50051";
  // Deadline of each unary RPC (and of each unary EndStep a Step sends). Infinite = none.
  absl::Duration timeout = absl::Seconds(30);
  // Largest message sent or received; attnd's default limit is 512 MiB each way.
  int64_t max_message_bytes = int64_t{512} << 20;
  KeepaliveOptions keepalive;
  TlsOptions tls;
  // Sent as "authorization: Bearer <token>" on every call when not empty (attnd --token_file).
  // gRPC sends it over plaintext too: use TLS where the network is not trusted.
  std::string bearer_token;
};

}  // namespace attnd::client
