// Runs every input of the given corpus directories (or files) through the fuzz harness once,
// without libFuzzer: keeps the seed corpus and the crash regressions committed beside it
// passing in every build (and under ASan/UBSan in the asan preset).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "request_harness.h"

int main(int argc, char** argv) {
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    if (std::filesystem::is_directory(path)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file()) inputs.push_back(entry.path());
      }
    } else {
      inputs.push_back(path);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "corpus_replay: no inputs given\n");
    return 1;
  }
  attnd::fuzz::RequestHarness harness;
  for (const std::filesystem::path& input : inputs) {
    std::ifstream file(input, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "corpus_replay: %s (%zu bytes)\n", input.filename().c_str(), bytes.size());
    attnd::fuzz::RunInput(harness, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("corpus_replay: %zu inputs passed\n", inputs.size());
  return 0;
}
