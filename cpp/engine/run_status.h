// RunError and Outcome: how the runner reports failure.
//
// The runner never throws and never aborts on input. Every fallible call
// returns an Outcome: a value, or a RunError of one of two kinds:
//  - kUser: the input is wrong (a missing or non-cell-cache .pte, a bad
//    prompt, a bad option value, a request that can never fit). The CLI
//    exits with status 2.
//  - kRuntime: the program failed in a way its input does not explain. The
//    CLI exits with status 1.
// Messages are one line and name the offending value.
#pragma once

#include <string>
#include <utility>
#include <variant>

#include "cellcache/status.h"

namespace cellcache::runner {

enum class ErrorKind { kUser, kRuntime };

struct RunError {
  ErrorKind kind = ErrorKind::kRuntime;
  std::string message;
};

inline RunError user_error(std::string message) {
  return {ErrorKind::kUser, std::move(message)};
}
// A cache call that failed where the engine's own bookkeeping says it cannot:
// a runtime error naming the call and the core's status.
inline RunError cache_failure(const char* verb, const Status& status) {
  return {ErrorKind::kRuntime, std::string(verb) + " failed: [" +
                                   status_code_name(status.code()) + "] " + status.message()};
}
inline RunError runtime_error(std::string message) {
  return {ErrorKind::kRuntime, std::move(message)};
}

// A value or the RunError that explains its absence. Outcome<> is the
// value-less form (success or an error).
template <typename T = std::monostate>
class [[nodiscard]] Outcome {
 public:
  Outcome() = default;                                   // success, T{}
  Outcome(T value) : state_(std::move(value)) {}         // NOLINT: implicit by design
  Outcome(RunError error) : state_(std::move(error)) {}  // NOLINT

  bool ok() const { return std::holds_alternative<T>(state_); }
  // Only meaningful when ok() / !ok(); callers check first.
  T& value() { return std::get<T>(state_); }
  const T& value() const { return std::get<T>(state_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const RunError& error() const { return std::get<RunError>(state_); }

 private:
  std::variant<T, RunError> state_;
};

}  // namespace cellcache::runner
