// Structure-aware mutation of serialized FuzzCases (libprotobuf-mutator is not in Debian):
// parse, change one thing a request validator must cope with, reserialize.
//
// Mutations: any scalar field of any request (found by reflection) set to an edge value
// (0, -1, 2^31 - 1, 2^36, UINT64_MAX, NaN, inf, out-of-range enum values, empty or
// overlong names, data a byte short or long); plan entries added, dropped or duplicated, page
// ids and kv_len pushed past the pool; tensors with a wrong shape, dtype or byte count, or
// with `values` instead of `data`; forwards made valid for a planned step again (so the
// fuzzer keeps reaching the kernels); actions inserted, dropped, duplicated, reordered; and
// libFuzzer's own byte mutations, on one request or on the whole input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace attnd::fuzz {

// libFuzzer's LLVMFuzzerMutate (bytes in place; returns the new size), passed in so the
// mutator builds without libFuzzer.
using ByteMutator = std::function<size_t(uint8_t* data, size_t size, size_t max_size)>;

// LLVMFuzzerCustomMutator's contract: mutates data[0, size) in place, returns the new size
// (<= max_size).
size_t MutateCase(uint8_t* data, size_t size, size_t max_size, unsigned seed,
                  const ByteMutator& byte_mutator);

// LLVMFuzzerCustomCrossOver's contract: a child of two cases (one's cache, a splice of both
// action lists) in out[0, max_out_size); returns its size.
size_t CrossOverCases(const uint8_t* data1, size_t size1, const uint8_t* data2, size_t size2,
                      uint8_t* out, size_t max_out_size, unsigned seed);

}  // namespace attnd::fuzz
