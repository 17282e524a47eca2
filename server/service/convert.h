// Protobuf <-> engine structs, and the validation that needs no server state. Every error
// names the request field (proto path), what was expected and what came.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/v1/attnd.pb.h"
#include "attnd/wire/forward_wire.h"
#include "engine/specs.h"
#include "grpcpp/support/status.h"

namespace attnd {

// Resolves every default of a CacheConfig and checks every field.
absl::StatusOr<CacheSpec> CacheSpecFromProto(const v1::CreateCacheRequest& request);
void CacheStatusToProto(const CacheStatus& status, v1::CacheInfo* info);

absl::StatusOr<PlanSpec> PlanSpecFromProto(const v1::PlanRequest& request);
void PlanResultToProto(const PlanResult& result, v1::PlanResponse* response);
void ChannelStatusToProto(const ChannelStatus& status, v1::ChannelInfo* info);
v1::ChannelKind ChannelKindToProto(ChannelKind kind);
// The request's fields as the engine takes them (cache and tenant left for the caller); the
// kind must be a defined one, client_pci_bus_id empty or a PCI bus id (normalised here).
absl::StatusOr<ChannelOpenSpec> ChannelOpenSpecFromProto(const v1::OpenChannelRequest& request);

// A ForwardRequest in the codec's form (attnd/wire/forward_wire.h), from the codec's decoder or
// from here, checked into the engine's arguments: the tensors' bytes stay where they are (the
// received slices, or the parsed message) as TensorArg::pieces. `wire` must outlive `args`,
// which may be reused (its vectors keep their capacity). use_channel is the caller's.
absl::Status ForwardArgsFromWire(const wire::ForwardRequest& wire, ForwardArgs& args);
// The slow path into the same form: a ForwardRequest parsed by protobuf. `data` is referenced in
// place (`request` must outlive `wire`); tensors sent as `values` are converted into `scratch`
// (which must outlive `wire`). Checks every tensor's dtype and shape (the errors of
// ForwardArgsFromWire, in the same order) and the values.
absl::Status WireForwardFromProto(const v1::ForwardRequest& request, wire::ForwardRequest& wire,
                                  std::vector<std::string>& scratch);
// Moves the engine's outputs into the response.
void ForwardOutputsToProto(ForwardOutputs& outputs, std::string&& lse_bytes,
                           v1::ForwardResponse* response);

void EndStepResultToProto(const EndStepResult& result, v1::EndStepResponse* response);

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnd
