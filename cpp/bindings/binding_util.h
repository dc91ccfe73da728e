// Shared by the _core binding's files: Status -> the Python exception of
// executorch_cellcache.cache.errors, and int conversions that refuse (never
// truncate) values the core would misread.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cellcache/status.h"
#include "run_status.h"

namespace cellcache {
class CellCache;
}

namespace cellcache::bindings {

namespace py = pybind11;

[[noreturn]] inline void raise(const Status& status) {
  py::object errors = py::module_::import("executorch_cellcache.cache.errors");
  py::object cls = errors.attr("BY_STATUS")[py::str(status_code_name(status.code()))];
  PyErr_SetString(cls.ptr(), status.message().c_str());
  throw py::error_already_set();
}

inline void check(const Status& status) {
  if (!status.is_ok()) raise(status);
}

template <typename T>
inline T unwrap(Result<T> result) {
  if (!result.is_ok()) raise(result.status());
  return std::move(result.value());
}

// Python ints beyond int32 are still wrong ids/positions, not overflow errors:
// saturate so the core reports them with a value in range of its checks.
inline int32_t to_i32(int64_t v) {
  return static_cast<int32_t>(std::clamp<int64_t>(v, std::numeric_limits<int32_t>::min(),
                                                  std::numeric_limits<int32_t>::max()));
}

// Config values beyond int32 are invalid; name them as passed.
inline int32_t config_int(const char* name, int64_t v) {
  if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
    raise(Status(StatusCode::kInvalidConfig,
                 std::string(name) + " is out of range, got " + std::to_string(v)));
  }
  return static_cast<int32_t>(v);
}

inline std::optional<int32_t> to_i32(std::optional<int64_t> v) {
  if (!v.has_value()) return std::nullopt;
  return to_i32(*v);
}

// An integer argument of the binding: a Python int or anything with
// __index__ (numpy integers), never a bool (True would be read as 1:
// seq_free(True) would free sequence 1) nor a float of any kind; either is
// refused with pybind11's TypeError naming the signature and the value passed,
// as is a value T cannot hold. Converts to T where the code reads it.
template <typename T>
struct Integer {
  T value = 0;
  operator T() const { return value; }  // NOLINT: read as the int it holds
};
using Int = Integer<int64_t>;
// Where the core's field is narrower, beyond its range stays a TypeError (as
// pybind11's own int32_t/uint64_t arguments were).
using Int32 = Integer<int32_t>;
using UInt64 = Integer<uint64_t>;

inline int32_t to_i32(Int v) { return to_i32(v.value); }

inline std::optional<int32_t> to_i32(std::optional<Int> v) {
  if (!v.has_value()) return std::nullopt;
  return to_i32(v->value);
}

// A yes/no argument: True, False or a numpy bool_, nothing else (converting,
// pybind11 read None, 0, 2 and 1.5 as bools: Engine(prefix_cache=None) ran
// without the prefix cache).
struct Bool {
  bool value = false;
  operator bool() const { return value; }  // NOLINT: read as the bool it holds
};

// A real-number argument: an int, a float or anything with __float__ (numpy
// floats), never a bool nor a numpy bool_ (float_to_half(True) gave 1.0's
// half, submit(temperature=True) sampled at 1.0).
struct Real {
  double value = 0.0;
  operator double() const { return value; }  // NOLINT: read as the double it holds
};

inline bool is_numpy_bool(py::handle src) {
  const std::string_view type = Py_TYPE(src.ptr())->tp_name;
  return type == "numpy.bool_" || type == "numpy.bool";
}

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Integer sequences only: floats, bools and strings are refused, not truncated.
inline Int64Array int64_array(const py::handle& values, const char* what) {
  py::array arr = py::array::ensure(values);
  if (!arr) throw py::type_error(std::string(what) + " must be a sequence of integers");
  const char kind = arr.dtype().kind();
  if (arr.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::type_error(std::string(what) + " must hold integers, got dtype " +
                         std::string(py::str(arr.dtype())));
  }
  return Int64Array::ensure(arr);
}

inline std::span<const int64_t> as_span(const Int64Array& a) {
  if (a.ndim() != 1) {
    raise(Status(StatusCode::kPositionConflict,
                 "expected a 1-D sequence, got " + std::to_string(a.ndim()) + " dimensions"));
  }
  return {a.data(), static_cast<size_t>(a.shape(0))};
}

// Registers the graph ops' functions (place_op, mask_op, attend_op, ...)
// on the module (op_bindings.cpp).
void bind_graph_ops(py::module_& m);

// The engine's errors (cpp/engine/run_status.h) as Python exceptions: a user
// error is InvalidConfigError, a runtime error RuntimeError.
[[noreturn]] inline void raise_run_error(const runner::RunError& e) {
  if (e.kind == runner::ErrorKind::kUser) {
    py::object errors = py::module_::import("executorch_cellcache.cache.errors");
    PyErr_SetString(errors.attr("InvalidConfigError").ptr(), e.message.c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(e.message);
}

template <typename T>
T unwrap_run(runner::Outcome<T> o) {
  if (!o.ok()) raise_run_error(o.error());
  return std::move(o.value());
}

// Registers the engine's value types and free functions (SamplingParams,
// SpeculativeOptions, Usage, EngineStats, prompt_lookup, choose_max_draft;
// engine_types_bindings.cpp); bind_engine calls it.
void bind_engine_types(py::module_& m);

// Registers _core.Engine, the C++ engine over a Python forward
// (engine_bindings.cpp); core_of gives the CellCache of a _core.CellCache.
void bind_engine(py::module_& m, CellCache& (*core_of)(py::handle));

// Registers the text and grammar layers (text_bindings.cpp): CppTokenizer,
// CppStreamDecoder, CppUtf8Stream, CppChatTemplate, CppGrammarCompiler.
void bind_text(py::module_& m);

}  // namespace cellcache::bindings

namespace pybind11::detail {
template <typename T>
struct type_caster<cellcache::bindings::Integer<T>> {
  PYBIND11_TYPE_CASTER(cellcache::bindings::Integer<T>, const_name("int"));

  bool load(handle src, bool /*convert*/) {
    // Ints and objects with __index__ (numpy integers, 0-d integer arrays,
    // integer tensors), no float of any kind (converting, pybind11 truncated
    // np.float32(1.5), Decimal and Fraction through __int__); numpy's bool_
    // has no __index__; Python's bool is an int. The int is taken first: for
    // an unsigned T pybind11's own caster reads only a Python int without
    // conversion (it refused seed=np.uint64(7)).
    if (!src || PyBool_Check(src.ptr())) return false;
    object index = reinterpret_steal<object>(PyNumber_Index(src.ptr()));
    if (!index) {
      PyErr_Clear();
      return false;
    }
    make_caster<T> inner;
    if (!inner.load(index, /*convert=*/false)) return false;
    value.value = cast_op<T>(inner);
    return true;
  }

  static handle cast(cellcache::bindings::Integer<T> v, return_value_policy policy,
                     handle parent) {
    return make_caster<T>::cast(v.value, policy, parent);
  }
};

template <>
struct type_caster<cellcache::bindings::Bool> {
  PYBIND11_TYPE_CASTER(cellcache::bindings::Bool, const_name("bool"));
  bool load(handle src, bool /*convert*/) {
    if (!src) return false;
    if (src.ptr() == Py_True || src.ptr() == Py_False) {
      value.value = src.ptr() == Py_True;
      return true;
    }
    if (!cellcache::bindings::is_numpy_bool(src)) return false;
    const int truth = PyObject_IsTrue(src.ptr());
    if (truth < 0) {
      PyErr_Clear();
      return false;
    }
    value.value = truth != 0;
    return true;
  }
  static handle cast(cellcache::bindings::Bool v, return_value_policy, handle) {
    return handle(v.value ? Py_True : Py_False).inc_ref();
  }
};

template <>
struct type_caster<cellcache::bindings::Real> {
  PYBIND11_TYPE_CASTER(cellcache::bindings::Real, const_name("float"));
  bool load(handle src, bool convert) {
    if (!src || PyBool_Check(src.ptr()) || cellcache::bindings::is_numpy_bool(src)) return false;
    make_caster<double> inner;
    if (!inner.load(src, convert)) return false;
    value.value = cast_op<double>(inner);
    return true;
  }
  static handle cast(cellcache::bindings::Real v, return_value_policy policy, handle parent) {
    return make_caster<double>::cast(v.value, policy, parent);
  }
};
}  // namespace pybind11::detail
