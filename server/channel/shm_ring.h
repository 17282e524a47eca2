// A POSIX shared-memory object that attnd creates for a HOST_SHM channel: created exclusively
// under a fresh name, sized, mapped and zeroed; unlinked and unmapped on destruction. The
// client opens it by name while the channel lives (the object is unlinked when the channel
// closes; a client's existing mapping stays valid until it unmaps it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace attnd {

class ShmRing {
 public:
  // `tag` goes into the name ("/attnd-<pid>-<tag>-<random>").
  static absl::StatusOr<std::unique_ptr<ShmRing>> Create(const std::string& tag, int64_t bytes);
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  const std::string& name() const { return name_; }
  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  ShmRing(std::string name, uint8_t* data, int64_t size)
      : name_(std::move(name)), data_(data), size_(size) {}

  std::string name_;
  uint8_t* data_;
  int64_t size_;
};

}  // namespace attnd
