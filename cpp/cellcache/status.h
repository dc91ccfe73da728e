// Status and Result: how every fallible call of the cell cache reports failure.
//
// The core never throws and never relies on assert. Each failure kind of SPEC
// section 6 has one StatusCode; the Python binding maps each code to one
// exception class (executorch_cellcache.cache.errors) and the ExecuTorch kernels map
// them to runtime errors with a log line carrying `message()`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace cellcache {

enum class StatusCode {
  kOk = 0,
  kUnknownSequence,   // an id the cache did not hand out, or one already freed
  kPositionConflict,  // rewrite, repeat, backwards, bad range, count mismatch
  kStepNotDeclared,   // a forward (layer serve) with no declared step
  kStepInvalidated,   // a sequence verb ran between declare and forward end
  kLayerOutOfRange,   // layer < 0 or >= n_layers
  kInvalidConfig,     // zero cells, window < 1, bad window list, ...
  kCapacity,          // every sequence id in use, or a request that never fits
  kUnknownCache,      // a cache handle that names no live cache
  kBelowReclaimed,    // a rollback or prefix clone needing positions a windowed
                      // pool already reclaimed (cell_pool.h)
};

// Stable name of a code, e.g. "PositionConflict"; used in logs and bindings.
const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message)
      : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status that explains its absence.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT

  bool is_ok() const { return status_.is_ok(); }
  const Status& status() const { return status_; }
  // Only meaningful when is_ok(); callers check first.
  const T& value() const { return value_; }
  T& value() { return value_; }

 private:
  Status status_;
  T value_{};
};

// Shorthands for the core's own sources.
namespace detail {
inline std::string str(int64_t v) { return std::to_string(v); }
inline Status error(StatusCode code, std::string message) {
  return Status(code, std::move(message));
}
}  // namespace detail

}  // namespace cellcache
