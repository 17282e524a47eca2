// Protobuf <-> engine structs, and the validation that needs no server state. Every error
// names the request field (proto path), what was expected and what came.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/v1/attnd.pb.h"
#include "engine/specs.h"
#include "grpcpp/support/status.h"
#include "service/forward_wire.h"

namespace attnd {

// Resolves every default of a CacheConfig and checks every field.
absl::StatusOr<CacheSpec> CacheSpecFromProto(const v1::CreateCacheRequest& request);
void CacheStatusToProto(const CacheStatus& status, v1::CacheInfo* info);

absl::StatusOr<PlanSpec> PlanSpecFromProto(const v1::PlanRequest& request);
void PlanResultToProto(const PlanResult& result, v1::PlanResponse* response);
void ChannelStatusToProto(const ChannelStatus& status, v1::ChannelInfo* info);
// The request's fields as the engine takes them (cache and tenant left for the caller); the
// kind must be a defined one.
absl::StatusOr<ChannelOpenSpec> ChannelOpenSpecFromProto(const v1::OpenChannelRequest& request);

// Decodes ForwardRequest tensors. Tensors sent as `values` are converted into `scratch`
// (which must outlive `args`); `data` tensors are referenced in place.
absl::Status ForwardArgsFromProto(const v1::ForwardRequest& request, ForwardArgs& args,
                                  std::vector<std::string>& scratch);
// A ForwardRequest from the fast wire parser (forward_wire.h): same checks and errors as
// ForwardArgsFromProto; the tensors' bytes stay in the received slices (TensorArg::pieces).
// `args` may be reused: its vectors keep their capacity.
absl::Status ForwardArgsFromWire(const WireForward& wire, ForwardArgs& args);
// Moves the engine's outputs into the response.
void ForwardOutputsToProto(ForwardOutputs& outputs, std::string&& lse_bytes,
                           v1::ForwardResponse* response);

void EndStepResultToProto(const EndStepResult& result, v1::EndStepResponse* response);

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attnd
