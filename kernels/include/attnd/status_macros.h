// Early-return helpers for absl::Status / absl::StatusOr. Our Abseil (20220623) predates its
// own macros; these keep the upstream names so a later rename is mechanical.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTND_STATUS_CONCAT_INNER(a, b) a##b
#define ATTND_STATUS_CONCAT(a, b) ATTND_STATUS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                         \
  do {                                                \
    ::absl::Status attnd_status_ = (expr);            \
    if (!attnd_status_.ok()) return attnd_status_;    \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates the StatusOr `expr`; on error returns its status,
// otherwise assigns (or declares, e.g. `auto x`) lhs from the value.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ATTND_ASSIGN_OR_RETURN_IMPL(ATTND_STATUS_CONCAT(attnd_statusor_, __LINE__), lhs, expr)
#define ATTND_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
