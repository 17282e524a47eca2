#include "progress_bar.h"

#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_format.h"

namespace attnd::attnctl {

ProgressBar::ProgressBar(std::string label, int64_t total)
    : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(int64_t done, const std::string& note) {
  last_done_ = done;
  last_note_ = note;
  const absl::Time now = absl::Now();
  if (done < total_ && now - last_draw_ < absl::Milliseconds(100)) return;
  last_draw_ = now;
  Draw(done, note);
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  if (!enabled_) return;
  Draw(last_done_, last_note_);
  std::fputc('\n', stderr);
}

void ProgressBar::Draw(int64_t done, const std::string& note) {
  if (!enabled_ || total_ <= 0) return;
  constexpr int kWidth = 30;
  const double fraction = static_cast<double>(done) / static_cast<double>(total_);
  const int filled = static_cast<int>(fraction * kWidth);
  std::string bar(kWidth, ' ');
  for (int i = 0; i < filled && i < kWidth; ++i) bar[i] = '=';
  if (filled < kWidth) bar[filled] = '>';
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start_);
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total_ - done) / rate : 0.0;
  absl::FPrintF(stderr, "\r%s [%s] %d/%d  %.1f/s  eta %.0fs %s\x1b[K", label_, bar, done, total_,
                rate, eta, note);
  std::fflush(stderr);
}

}  // namespace attnd::attnctl
