#include "case_mutator.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnd/kernels/dtype.h"
#include "case_builder.h"

namespace attnd::fuzz {
namespace {

using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using Rng = std::mt19937_64;

template <typename T>
T Pick(Rng& rng, const std::vector<T>& values) {
  return values[rng() % values.size()];
}

bool Chance(Rng& rng, int percent) { return static_cast<int>(rng() % 100) < percent; }

// Values at which size, index and overflow checks tend to break.
int64_t EdgeInt64(Rng& rng) {
  static const std::vector<int64_t> kEdges = {
      0, 1, -1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 129, 255, 256, 257,
      511, 512, 1023, 1024, 1025, 4095, 4096, 65535, 65536, int64_t{1} << 31,
      (int64_t{1} << 31) - 1, int64_t{1} << 32, int64_t{1} << 36, (int64_t{1} << 36) - 1,
      int64_t{1} << 62, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
      -2, std::numeric_limits<int32_t>::min()};
  if (Chance(rng, 10)) return static_cast<int64_t>(rng() % 64);
  return Pick(rng, kEdges);
}

int32_t EdgeInt32(Rng& rng) {
  static const std::vector<int32_t> kEdges = {
      0, 1, -1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255,
      256, 257, 511, 512, 513, 1023, 1024, 1025, 4096, 65536, std::numeric_limits<int32_t>::max(),
      std::numeric_limits<int32_t>::max() - 1, std::numeric_limits<int32_t>::min(), -2};
  if (Chance(rng, 10)) return static_cast<int32_t>(rng() % 64);
  return Pick(rng, kEdges);
}

uint64_t EdgeUint64(Rng& rng) {
  static const std::vector<uint64_t> kEdges = {
      0, 1, 2, 3, 7, 16, 17, uint64_t{1} << 32, uint64_t{1} << 63,
      std::numeric_limits<uint64_t>::max(), std::numeric_limits<uint64_t>::max() - 1};
  if (Chance(rng, 30)) return rng() % 18;  // case-relative step ids and small sequence ids
  return Pick(rng, kEdges);
}

double EdgeDouble(Rng& rng) {
  static const std::vector<double> kEdges = {
      0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 4.0, 448.0, 449.0, 1e-300, 1e300,
      std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
      -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::denorm_min(),
      std::numeric_limits<float>::max(), 10000.0, 500000.0, 1.0000001};
  return Pick(rng, kEdges);
}

int EdgeEnum(Rng& rng, const EnumDescriptor* type) {
  if (Chance(rng, 60)) return type->value(static_cast<int>(rng() % type->value_count()))->number();
  return Pick<int>(rng, {-1, type->value_count(), type->value_count() + 1, 99,
                         std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()});
}

std::string EdgeString(Rng& rng, const std::string& current) {
  switch (rng() % 9) {
    case 0: return "";
    case 1: return "fuzz";
    case 2: return std::string(128, 'a');
    case 3: return std::string(129, 'b');
    case 4: return "a/b";
    case 5: return "bad name";
    case 6: return std::string("\xff\x00z", 3);
    case 7: return current + "2";
    default: return current.empty() ? std::string("x") : current.substr(0, current.size() - 1);
  }
}

// Byte strings (tensor data): off by a byte or an element, truncated, doubled, emptied.
std::string EdgeBytes(Rng& rng, std::string bytes) {
  switch (rng() % 8) {
    case 0: if (!bytes.empty()) bytes.pop_back(); break;
    case 1: bytes.push_back(static_cast<char>(rng())); break;
    case 2: bytes.resize(bytes.size() / 2); break;
    case 3: bytes += bytes; break;
    case 4: bytes.clear(); break;
    case 5: bytes.resize(bytes.size() + 2, '\x7f'); break;
    case 6: if (bytes.size() >= 2) bytes.resize(bytes.size() - 2); break;
    default:
      // A NaN/inf pattern (bf16 0x7fc0, fp16 0x7c00) somewhere.
      if (bytes.size() >= 2) {
        const size_t at = (rng() % (bytes.size() / 2)) * 2;
        bytes[at] = Chance(rng, 50) ? '\xc0' : '\x00';
        bytes[at + 1] = Chance(rng, 50) ? '\x7f' : '\x7c';
      }
  }
  return bytes;
}

void MutateSingularScalar(Message& message, const FieldDescriptor& field, Rng& rng) {
  const Reflection& r = *message.GetReflection();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: r.SetInt32(&message, &field, EdgeInt32(rng)); break;
    case FieldDescriptor::CPPTYPE_INT64: r.SetInt64(&message, &field, EdgeInt64(rng)); break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r.SetUInt32(&message, &field, static_cast<uint32_t>(EdgeUint64(rng)));
      break;
    case FieldDescriptor::CPPTYPE_UINT64: r.SetUInt64(&message, &field, EdgeUint64(rng)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: r.SetDouble(&message, &field, EdgeDouble(rng)); break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r.SetFloat(&message, &field, static_cast<float>(EdgeDouble(rng)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      r.SetBool(&message, &field, !r.GetBool(message, &field));
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r.SetEnumValue(&message, &field, EdgeEnum(rng, field.enum_type()));
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      if (field.type() == FieldDescriptor::TYPE_BYTES) {
        r.SetString(&message, &field, EdgeBytes(rng, r.GetString(message, &field)));
      } else {
        r.SetString(&message, &field, EdgeString(rng, r.GetString(message, &field)));
      }
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
}

void AddRepeatedScalar(Message& message, const FieldDescriptor& field, Rng& rng) {
  const Reflection& r = *message.GetReflection();
  switch (field.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: r.AddInt32(&message, &field, EdgeInt32(rng)); break;
    case FieldDescriptor::CPPTYPE_INT64: r.AddInt64(&message, &field, EdgeInt64(rng)); break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r.AddUInt32(&message, &field, static_cast<uint32_t>(EdgeUint64(rng)));
      break;
    case FieldDescriptor::CPPTYPE_UINT64: r.AddUInt64(&message, &field, EdgeUint64(rng)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: r.AddDouble(&message, &field, EdgeDouble(rng)); break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r.AddFloat(&message, &field, static_cast<float>(EdgeDouble(rng)));
      break;
    case FieldDescriptor::CPPTYPE_BOOL: r.AddBool(&message, &field, Chance(rng, 50)); break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r.AddEnumValue(&message, &field, EdgeEnum(rng, field.enum_type()));
      break;
    case FieldDescriptor::CPPTYPE_STRING: r.AddString(&message, &field, EdgeString(rng, "")); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
}

// Sets element `index` of a repeated scalar to an edge value (by swapping in a fresh one).
void SetRepeatedScalar(Message& message, const FieldDescriptor& field, int index, Rng& rng) {
  const Reflection& r = *message.GetReflection();
  AddRepeatedScalar(message, field, rng);
  const int last = r.FieldSize(message, &field) - 1;
  r.SwapElements(&message, &field, index, last);
  r.RemoveLast(&message, &field);
}

// Changes one field somewhere inside `message`, any type, at any depth.
void MutateAnyField(Message& message, Rng& rng, int depth = 0) {
  const google::protobuf::Descriptor& type = *message.GetDescriptor();
  if (type.field_count() == 0) return;
  const FieldDescriptor& field = *type.field(static_cast<int>(rng() % type.field_count()));
  const Reflection& r = *message.GetReflection();
  if (field.cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    if (field.is_repeated()) {
      const int size = r.FieldSize(message, &field);
      if (size == 0 || Chance(rng, 20)) {
        Message* added = r.AddMessage(&message, &field);
        if (depth < 6 && Chance(rng, 70)) MutateAnyField(*added, rng, depth + 1);
      } else if (Chance(rng, 20)) {
        r.RemoveLast(&message, &field);
      } else if (Chance(rng, 15)) {
        const Message& original = r.GetRepeatedMessage(message, &field, static_cast<int>(rng() % size));
        std::unique_ptr<Message> copy(original.New());
        copy->CopyFrom(original);
        r.AddMessage(&message, &field)->CopyFrom(*copy);
      } else if (Chance(rng, 10) && size >= 2) {
        r.SwapElements(&message, &field, static_cast<int>(rng() % size),
                       static_cast<int>(rng() % size));
      } else {
        MutateAnyField(*r.MutableRepeatedMessage(&message, &field, static_cast<int>(rng() % size)),
                       rng, depth + 1);
      }
    } else if (depth >= 6 || Chance(rng, 8)) {
      r.ClearField(&message, &field);
    } else {
      MutateAnyField(*r.MutableMessage(&message, &field), rng, depth + 1);
    }
    return;
  }
  if (!field.is_repeated()) {
    if (Chance(rng, 8)) {
      r.ClearField(&message, &field);
    } else {
      MutateSingularScalar(message, field, rng);
    }
    return;
  }
  const int size = r.FieldSize(message, &field);
  if (size == 0 || Chance(rng, 25)) {
    AddRepeatedScalar(message, field, rng);
  } else if (Chance(rng, 25)) {
    r.RemoveLast(&message, &field);
  } else if (Chance(rng, 5)) {
    r.ClearField(&message, &field);
  } else {
    SetRepeatedScalar(message, field, static_cast<int>(rng() % size), rng);
  }
}

// The forward carried by an action (plain or on a stream), or null.
attnd::v1::ForwardRequest* MutableForwardOf(Action& action) {
  if (action.has_forward()) return action.mutable_forward();
  if (action.has_stream_request() && action.stream_request().has_forward()) {
    return action.mutable_stream_request()->mutable_forward();
  }
  return nullptr;
}

attnd::v1::PlanRequest* MutablePlanOf(Action& action) {
  if (action.has_plan()) return action.mutable_plan();
  if (action.has_stream_request() && action.stream_request().has_plan()) {
    return action.mutable_stream_request()->mutable_plan();
  }
  return nullptr;
}

template <typename Getter>
std::vector<int> IndicesWith(FuzzCase& fuzz_case, Getter getter) {
  std::vector<int> indices;
  for (int i = 0; i < fuzz_case.actions_size(); ++i) {
    if (getter(*fuzz_case.mutable_actions(i)) != nullptr) indices.push_back(i);
  }
  return indices;
}

std::string CacheName(const FuzzCase& fuzz_case) {
  return fuzz_case.cache().name().empty() ? std::string("fuzz") : fuzz_case.cache().name();
}

// Gives a forward tensors that fit its step again (or a freshly chosen step), so that
// mutated cases keep reaching the append and attention kernels.
void RepairForward(FuzzCase& fuzz_case, int index, Rng& rng) {
  Action& action = *fuzz_case.mutable_actions(index);
  attnd::v1::ForwardRequest* forward = MutableForwardOf(action);
  const uint64_t plans = CountPlans(fuzz_case, fuzz_case.actions_size());
  if (forward == nullptr || plans == 0) return;
  uint64_t ordinal = forward->step_id();
  if (ordinal < 1 || ordinal > plans || Chance(rng, 20)) ordinal = 1 + rng() % plans;
  const CacheGeometry g = ResolvedGeometry(fuzz_case.cache());
  int32_t layer = forward->layer();
  if (layer < 0 || layer >= g.num_layers || Chance(rng, 30)) {
    layer = static_cast<int32_t>(rng() % g.num_layers);
  }
  *forward = ValidForward(g, PlannedTokens(fuzz_case, ordinal), layer, ordinal, rng);
}

// Makes one tensor of a forward wrong in one way.
void BreakTensor(attnd::v1::ForwardRequest& forward, Rng& rng) {
  attnd::v1::Tensor* tensors[] = {forward.mutable_q(), forward.mutable_k(), forward.mutable_v(),
                                  forward.mutable_q_pe(), forward.mutable_ckv(),
                                  forward.mutable_kpe()};
  attnd::v1::Tensor& tensor = *tensors[Chance(rng, 80) ? rng() % 3 : rng() % 6];
  switch (rng() % 8) {
    case 0:
      if (tensor.shape_size() > 0) {
        const int dim = static_cast<int>(rng() % tensor.shape_size());
        // One off, without overflowing a dimension an earlier mutation set to an edge value.
        const int64_t current = tensor.shape(dim);
        const bool up = Chance(rng, 50);
        if (up && current < std::numeric_limits<int64_t>::max()) {
          tensor.set_shape(dim, current + 1);
        } else if (!up && current > std::numeric_limits<int64_t>::min()) {
          tensor.set_shape(dim, current - 1);
        }
      }
      break;
    case 1:
      if (tensor.shape_size() > 0) {
        tensor.set_shape(static_cast<int>(rng() % tensor.shape_size()), EdgeInt64(rng));
      }
      break;
    case 2:
      if (Chance(rng, 50)) {
        tensor.add_shape(1);
      } else if (tensor.shape_size() > 0) {
        tensor.mutable_shape()->RemoveLast();
      }
      break;
    case 3:
      tensor.set_dtype(static_cast<attnd::v1::DType>(
          EdgeEnum(rng, attnd::v1::DType_descriptor())));
      break;
    case 4: {
      // The same elements as `values` (floats) instead of raw data: the grpcurl path.
      const int bytes = Chance(rng, 50) ? 2 : 1;
      const int64_t elements = static_cast<int64_t>(tensor.data().size()) / bytes;
      tensor.clear_values();
      const DType dtype = bytes == 2 ? DType::kBFloat16 : DType::kFloat8E4M3;
      for (int64_t i = 0; i < elements; ++i) {
        tensor.add_values(LoadAsFloat(dtype, tensor.data().data(), i));
      }
      if (Chance(rng, 30)) tensor.add_values(std::numeric_limits<float>::quiet_NaN());
      if (Chance(rng, 80)) tensor.clear_data();
      break;
    }
    default:
      tensor.set_data(EdgeBytes(rng, tensor.data()));
  }
}

// Plans whose sizes straddle the pool: just fitting, one page over, far over.
void AddCapacityPlan(FuzzCase& fuzz_case, Rng& rng) {
  const CacheGeometry g = ResolvedGeometry(fuzz_case.cache());
  const int64_t capacity = g.num_pages * g.page_size;
  const int64_t tokens = std::clamp<int64_t>(
      capacity + Pick<int64_t>(rng, {-1, 0, 1, g.page_size, -g.page_size}), 0,
      std::numeric_limits<int32_t>::max());
  Entries entries = {{1 + rng() % 3, static_cast<int32_t>(Chance(rng, 50) ? tokens : tokens / 2)}};
  if (Chance(rng, 50)) entries.push_back({4, static_cast<int32_t>(tokens - tokens / 2)});
  const int at = static_cast<int>(rng() % (fuzz_case.actions_size() + 1));
  *fuzz_case.add_actions() = PlanAction(ManagedPlan(CacheName(fuzz_case), entries),
                                        static_cast<uint32_t>(rng() % 3));
  for (int i = fuzz_case.actions_size() - 1; i > at; --i) {
    fuzz_case.mutable_actions()->SwapElements(i, i - 1);
  }
}

// A new action of any kind at a random position.
void InsertAction(FuzzCase& fuzz_case, Rng& rng) {
  const int at = static_cast<int>(rng() % (fuzz_case.actions_size() + 1));
  const std::string cache = CacheName(fuzz_case);
  const CacheGeometry g = ResolvedGeometry(fuzz_case.cache());
  const uint32_t stream = Chance(rng, 60) ? 0 : 1 + static_cast<uint32_t>(rng() % 2);
  const uint64_t plans = CountPlans(fuzz_case, at);
  Action action;
  switch (rng() % 14) {
    case 12: {  // fork a small sequence id, inside or at the end of its tokens
      attnd::v1::ForkSequenceRequest* fork = action.mutable_fork_sequence();
      fork->set_cache(cache);
      fork->set_source_id(Pick<uint64_t>(rng, {1, 2, 3, 7}));
      fork->set_new_id(Pick<uint64_t>(rng, {2, 3, 4, 5, 7, 1}));
      fork->set_num_tokens(Chance(rng, 50) ? 0 : static_cast<int64_t>(rng() % 9));
      break;
    }
    case 13: {  // export and import, into this cache or "fuzz2", damaged or not
      ExportImport* copy = action.mutable_export_import();
      copy->mutable_export_()->set_cache(cache);
      copy->mutable_export_()->set_sequence_id(Pick<uint64_t>(rng, {1, 2, 3}));
      copy->mutable_export_()->set_max_chunk_bytes(Pick<int64_t>(rng, {0, 1, 300, 4096}));
      // Through the case's first channels at times (ordinals, which the harness maps), either
      // side or both.
      if (Chance(rng, 30)) copy->mutable_export_()->set_channel_id(Pick<uint64_t>(rng, {1, 2}));
      if (Chance(rng, 30)) copy->set_import_channel_id(Pick<uint64_t>(rng, {1, 2}));
      copy->set_target_cache(Chance(rng, 50) ? cache : "fuzz2");
      copy->set_new_id(Pick<uint64_t>(rng, {0, 5, 6, 1}));
      if (Chance(rng, 50)) {
        switch (rng() % 4) {
          case 0: copy->set_drop_message(1 + static_cast<uint32_t>(rng() % 6)); break;
          case 1:
            copy->set_corrupt_message(1 + static_cast<uint32_t>(rng() % 6));
            copy->set_corrupt_byte(static_cast<uint32_t>(rng()));
            break;
          case 2: copy->set_repeat_message(2 + static_cast<uint32_t>(rng() % 5)); break;
          default: copy->set_abandon_after(1 + static_cast<uint32_t>(rng() % 4));
        }
      }
      break;
    }
    case 0:
    case 1:
    case 2: {
      attnd::v1::PlanRequest plan;
      if (fuzz_case.cache().config().page_table_mode() == attnd::v1::PAGE_TABLE_MODE_EXTERNAL) {
        std::vector<ExternalEntry> entries;
        for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) {
          const int32_t tokens = Pick<int32_t>(rng, {0, 1, 1, 2, 3, 5});
          entries.push_back({tokens + static_cast<int64_t>(rng() % 9), tokens});
        }
        plan = ExternalPlan(cache, g, entries,
                            fuzz_case.cache().config().page_table_form() ==
                                attnd::v1::PAGE_TABLE_FORM_SEPARATE_KV,
                            static_cast<int32_t>(rng() % g.num_pages),
                            static_cast<int32_t>(rng() % g.num_pages));
      } else {
        Entries entries;
        for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n; ++i) {
          entries.push_back({Pick<uint64_t>(rng, {1, 2, 3, 7, 1, 2}),
                             Pick<int32_t>(rng, {0, 1, 1, 1, 2, 3, 5, 8})});
        }
        plan = ManagedPlan(cache, entries);
      }
      if (Chance(rng, 30)) plan.mutable_options()->set_return_lse(true);
      if (Chance(rng, 15)) MutateAnyField(*plan.mutable_options(), rng);
      action = PlanAction(std::move(plan), stream);
      break;
    }
    case 3:
    case 4:
    case 5: {
      const uint64_t ordinal = plans == 0 ? 1 : 1 + rng() % plans;
      action = ForwardAction(ValidForward(g, PlannedTokens(fuzz_case, ordinal),
                                          static_cast<int32_t>(rng() % g.num_layers), ordinal, rng),
                             stream, Chance(rng, 25));
      break;
    }
    case 6:
      action = EndStepAction(plans == 0 ? 1 : 1 + rng() % plans, Chance(rng, 50), stream);
      break;
    case 7:
      action = FreeAction(cache, {Pick<uint64_t>(rng, {1, 2, 3, 7, 99})});
      break;
    case 8:
      action = DeleteAction(cache, Chance(rng, 50));
      break;
    case 9:
      action.set_stream(1 + static_cast<uint32_t>(rng() % 2));
      action.mutable_close_stream();
      break;
    case 10:
      action.mutable_expire_steps();
      break;
    default:
      switch (rng() % 3) {
        case 0: action.mutable_get_cache()->set_name(cache); break;
        case 1: action.mutable_list_caches(); break;
        default:
          *action.mutable_create_cache() = SmallCache(
              static_cast<CacheVariant>(rng() % static_cast<int>(CacheVariant::kCount)),
              Chance(rng, 50) ? "fuzz2" : cache);
      }
  }
  *fuzz_case.add_actions() = std::move(action);
  for (int i = fuzz_case.actions_size() - 1; i > at; --i) {
    fuzz_case.mutable_actions()->SwapElements(i, i - 1);
  }
}

void ShuffleActions(FuzzCase& fuzz_case, Rng& rng) {
  const int size = fuzz_case.actions_size();
  if (size == 0) return;
  const int a = static_cast<int>(rng() % size);
  const int b = static_cast<int>(rng() % size);
  switch (rng() % 3) {
    case 0:  // drop
      fuzz_case.mutable_actions()->SwapElements(a, size - 1);
      fuzz_case.mutable_actions()->RemoveLast();
      break;
    case 1: {  // duplicate
      const Action copy = fuzz_case.actions(a);
      *fuzz_case.add_actions() = copy;
      fuzz_case.mutable_actions()->SwapElements(size, b);
      break;
    }
    default:
      fuzz_case.mutable_actions()->SwapElements(a, b);
  }
}

// libFuzzer's byte mutations on one action's serialized form.
void ByteMutateAction(FuzzCase& fuzz_case, Rng& rng, const ByteMutator& byte_mutator) {
  if (fuzz_case.actions_size() == 0) return;
  Action& action = *fuzz_case.mutable_actions(static_cast<int>(rng() % fuzz_case.actions_size()));
  std::string bytes = action.SerializeAsString();
  const size_t size = bytes.size();
  bytes.resize(size * 2 + 64);
  bytes.resize(byte_mutator(reinterpret_cast<uint8_t*>(bytes.data()), size, bytes.size()));
  Action mutated;
  if (mutated.ParseFromString(bytes)) action = std::move(mutated);
}

size_t Serialize(const FuzzCase& fuzz_case, uint8_t* data, size_t max_size) {
  const size_t size = fuzz_case.ByteSizeLong();
  if (size > max_size) return 0;
  fuzz_case.SerializeToArray(data, static_cast<int>(size));
  return size;
}

}  // namespace

size_t MutateCase(uint8_t* data, size_t size, size_t max_size, unsigned seed,
                  const ByteMutator& byte_mutator) {
  Rng rng(seed);
  FuzzCase fuzz_case;
  if (!fuzz_case.ParseFromArray(data, static_cast<int>(size))) {
    // Not a case: keep fuzzing it as raw request bytes, or start over from a valid case.
    if (Chance(rng, 70)) return byte_mutator(data, size, max_size);
    fuzz_case = ValidCase(static_cast<CacheVariant>(rng() % static_cast<int>(CacheVariant::kCount)), rng);
  } else {
    const int choice = static_cast<int>(rng() % 100);
    if (choice < 5) return byte_mutator(data, size, max_size);  // raw bytes of the whole input
    const int mutations = 1 + static_cast<int>(rng() % 3);
    for (int m = 0; m < mutations; ++m) {
      const int kind = m == 0 ? choice : static_cast<int>(rng() % 100);
      if (kind < 25) {
        MutateAnyField(fuzz_case, rng);
      } else if (kind < 32) {
        MutateAnyField(*fuzz_case.mutable_cache(), rng);
      } else if (kind < 45) {
        std::vector<int> forwards = IndicesWith(fuzz_case, MutableForwardOf);
        if (forwards.empty()) {
          InsertAction(fuzz_case, rng);
        } else {
          RepairForward(fuzz_case, Pick(rng, forwards), rng);
        }
      } else if (kind < 53) {
        std::vector<int> forwards = IndicesWith(fuzz_case, MutableForwardOf);
        if (!forwards.empty()) {
          BreakTensor(*MutableForwardOf(*fuzz_case.mutable_actions(Pick(rng, forwards))), rng);
        }
      } else if (kind < 68) {
        InsertAction(fuzz_case, rng);
      } else if (kind < 76) {
        std::vector<int> plans = IndicesWith(fuzz_case, MutablePlanOf);
        if (!plans.empty()) {
          MutateAnyField(*MutablePlanOf(*fuzz_case.mutable_actions(Pick(rng, plans))), rng);
        }
      } else if (kind < 84) {
        ShuffleActions(fuzz_case, rng);
      } else if (kind < 94) {
        ByteMutateAction(fuzz_case, rng, byte_mutator);
      } else if (kind < 97) {
        AddCapacityPlan(fuzz_case, rng);
      } else {
        fuzz_case = ValidCase(
            static_cast<CacheVariant>(rng() % static_cast<int>(CacheVariant::kCount)), rng);
      }
    }
  }
  // Too big for libFuzzer's limit: shed actions from the end, then give up on this mutation.
  while (fuzz_case.ByteSizeLong() > max_size && fuzz_case.actions_size() > 0) {
    fuzz_case.mutable_actions()->RemoveLast();
  }
  const size_t written = Serialize(fuzz_case, data, max_size);
  return written > 0 ? written : byte_mutator(data, size, max_size);
}

size_t CrossOverCases(const uint8_t* data1, size_t size1, const uint8_t* data2, size_t size2,
                      uint8_t* out, size_t max_out_size, unsigned seed) {
  Rng rng(seed);
  FuzzCase first, second;
  if (!first.ParseFromArray(data1, static_cast<int>(size1)) ||
      !second.ParseFromArray(data2, static_cast<int>(size2))) {
    const size_t size = std::min(size1, max_out_size);
    std::memcpy(out, data1, size);
    return size;
  }
  FuzzCase child;
  *child.mutable_cache() = Chance(rng, 80) ? first.cache() : second.cache();
  const int keep = first.actions_size() == 0 ? 0 : static_cast<int>(rng() % (first.actions_size() + 1));
  for (int i = 0; i < keep; ++i) *child.add_actions() = first.actions(i);
  const int from = second.actions_size() == 0 ? 0 : static_cast<int>(rng() % second.actions_size());
  for (int i = from; i < second.actions_size(); ++i) *child.add_actions() = second.actions(i);
  while (child.ByteSizeLong() > max_out_size && child.actions_size() > 0) {
    child.mutable_actions()->RemoveLast();
  }
  return Serialize(child, out, max_out_size);
}

}  // namespace attnd::fuzz
