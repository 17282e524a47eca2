// libFuzzer target over attnd's request decoding, validation and engine (see
// request_harness.h for what is checked, case_mutator.h for how inputs change).
#include <cstddef>
#include <cstdint>

#include <google/protobuf/stubs/logging.h>

#include "case_mutator.h"
#include "request_harness.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Names with invalid UTF-8 are refused by the parser, which also logs each one: too loud.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One engine for the whole run, as in the daemon; every input cleans up after itself and the
  // harness checks that it did.
  static attnd::fuzz::RequestHarness* harness = new attnd::fuzz::RequestHarness();
  attnd::fuzz::RunInput(*harness, data, size);
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  return attnd::fuzz::MutateCase(data, size, max_size, seed, LLVMFuzzerMutate);
}

extern "C" size_t LLVMFuzzerCustomCrossOver(const uint8_t* data1, size_t size1,
                                            const uint8_t* data2, size_t size2, uint8_t* out,
                                            size_t max_out_size, unsigned int seed) {
  return attnd::fuzz::CrossOverCases(data1, size1, data2, size2, out, max_out_size, seed);
}
