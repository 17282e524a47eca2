// The attention service on loopback with its engine in reach, for the fault tests: they read
// the pools' raw bytes (Engine::ReadPages) before and after a failed operation, which the
// daemon's Server does not expose.
//
// Built from the same pieces Server::Start wires together (CPU backend, Authenticator,
// Metrics, Engine, AttentionService, a gRPC server on 127.0.0.1 with plaintext credentials), so
// the requests run through the real handlers, ForwardStream reactor and engine. Not covered
// here: server.cc's drain on shutdown, TLS and keepalive settings (the SIGTERM fault test runs
// the attnd binary for the drain).
//
// Also: helpers that snapshot a cache's pools and compare snapshots slot by slot.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnd/client/client.h"
#include "backend/backend.h"
#include "engine/engine.h"

namespace attnd::integration {

struct FaultServerOptions {
  int64_t kv_budget_bytes = int64_t{64} << 20;
  absl::Duration step_ttl = absl::Seconds(60);
  std::string token_file;  // "" = no authentication
  int32_t max_open_steps_per_tenant = 256;
};

class FaultServer {
 public:
  static absl::StatusOr<std::unique_ptr<FaultServer>> Start(const FaultServerOptions& options);
  // Stops the gRPC server (cancelling what is in flight), then the engine.
  ~FaultServer();

  int port() const { return port_; }
  std::string address() const;
  Engine& engine() { return *engine_; }
  Backend& backend() { return *backend_; }

  // attnd_kv_pages{cache=`cache`} as Prometheus would scrape it: (used, free), or (-1, -1)
  // when there is no such series.
  std::pair<double, double> PageGauges(const std::string& cache) const;

  // A client of this server (token: bearer token, "" for none).
  std::unique_ptr<client::Client> NewClient(const std::string& token = "") const;

 private:
  struct Parts;
  FaultServer();
  std::unique_ptr<Parts> parts_;
  Engine* engine_ = nullptr;
  Backend* backend_ = nullptr;
  int port_ = 0;
};

// The raw bytes of every pool of one cache: pools[layer * 2 + (V pool ? 1 : 0)].
struct PoolBytes {
  CacheGeometry geometry;
  std::vector<std::string> pools;
};
absl::StatusOr<PoolBytes> ReadPools(const Engine& engine, const std::string& cache);

// A token slot of one pool: (pool index, page, offset in page).
using Slot = std::tuple<size_t, int64_t, int32_t>;

// Slots whose bytes differ between two snapshots of one cache.
std::set<Slot> ChangedSlots(const PoolBytes& before, const PoolBytes& after);
// Slots holding any non-zero byte. In a cache that has only ever committed steps (pools start
// zeroed) these are exactly the committed tokens' slots.
std::set<Slot> NonZeroSlots(const PoolBytes& pools);

}  // namespace attnd::integration
