// absl::Status assertions for tests (our Abseil predates its own status matchers).
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnd::integration {

inline const absl::Status& StatusOf(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace attnd::integration

#define ATTND_TEST_CONCAT_INNER(a, b) a##b
#define ATTND_TEST_CONCAT(a, b) ATTND_TEST_CONCAT_INNER(a, b)

#define ASSERT_OK(expr)                                                     \
  do {                                                                      \
    const auto& attnd_assert_value_ = (expr);                               \
    const absl::Status& attnd_assert_status_ =                              \
        ::attnd::integration::StatusOf(attnd_assert_value_);                \
    ASSERT_TRUE(attnd_assert_status_.ok()) << attnd_assert_status_;         \
  } while (false)

#define EXPECT_OK(expr)                                                     \
  do {                                                                      \
    const auto& attnd_expect_value_ = (expr);                               \
    const absl::Status& attnd_expect_status_ =                              \
        ::attnd::integration::StatusOf(attnd_expect_value_);                \
    EXPECT_TRUE(attnd_expect_status_.ok()) << attnd_expect_status_;         \
  } while (false)

// ASSERT_OK_AND_ASSIGN(auto x, expr) or (x, expr).
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ATTND_ASSERT_OK_AND_ASSIGN_IMPL(ATTND_TEST_CONCAT(attnd_status_or_, __LINE__), lhs, expr)
#define ATTND_ASSERT_OK_AND_ASSIGN_IMPL(status_or, lhs, expr) \
  auto status_or = (expr);                                    \
  ASSERT_TRUE(status_or.ok()) << status_or.status();          \
  lhs = std::move(status_or).value()

// The status has `expected_code` and its message names `field`.
#define EXPECT_ERROR(expr, expected_code, field)                                              \
  do {                                                                               \
    const auto& attnd_error_value_ = (expr);                                         \
    const absl::Status& attnd_error_status_ =                                        \
        ::attnd::integration::StatusOf(attnd_error_value_);                          \
    EXPECT_EQ(attnd_error_status_.code(), (expected_code)) << attnd_error_status_;            \
    EXPECT_THAT(std::string(attnd_error_status_.message()), ::testing::HasSubstr(field)) \
        << "the message should name the field";                                      \
  } while (false)
