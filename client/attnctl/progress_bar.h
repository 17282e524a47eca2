// A one-line progress bar on stderr, drawn only when stderr is a terminal (so logs and pipes
// stay clean).
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnd::attnctl {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total);
  ~ProgressBar();  // finishes the line

  // Redraws at most ~10 times a second; `note` is appended (e.g. "3 errors").
  void Update(int64_t done, const std::string& note = "");
  void Finish();

 private:
  void Draw(int64_t done, const std::string& note);

  const std::string label_;
  const int64_t total_;
  const bool enabled_;
  const absl::Time start_ = absl::Now();
  absl::Time last_draw_ = absl::InfinitePast();
  bool finished_ = false;
  int64_t last_done_ = 0;
  std::string last_note_;
};

}  // namespace attnd::attnctl
