// The graph ops' logic for the torch CPU kernels (graph/ops.py): place, mask
// and attend on the cache a handle names, and write and rope, on numpy views
// of the tensors.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <bit>
#include <span>
#include <string>
#include <vector>

#include "binding_util.h"
#include "graph/graph_ops.h"
#include "graph/registry.h"
#include "kernel_threads.h"

namespace cellcache::bindings {

namespace {

// A C-contiguous numpy array of `what`, viewed without a copy.
py::array contiguous(const py::object& obj, const char* what, bool writable = false) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(what) + " must be a numpy array");
  }
  py::array arr = py::reinterpret_borrow<py::array>(obj);
  if (!(arr.flags() & py::array::c_style)) {
    throw py::type_error(std::string(what) + " must be C-contiguous");
  }
  if (writable && !arr.writeable()) throw py::type_error(std::string(what) + " is read-only");
  return arr;
}

// A float array of `itemsize` bytes in this machine's byte order (a
// byte-swapped '>f4' would be read as garbage).
bool is_float(const py::array& a, int itemsize) {
  const char order = a.dtype().byteorder();
  const bool native = order == '=' || order == '|' ||
                      order == (std::endian::native == std::endian::little ? '<' : '>');
  return a.dtype().kind() == 'f' && a.itemsize() == itemsize && native;
}

// The K/V element type of a cache array (float32, float16 or int8), else
// InvalidConfigError naming it.
attention::KvDtype kv_dtype(const py::array& cache, const char* op) {
  if (is_float(cache, 2)) return attention::KvDtype::kFloat16;
  if (cache.dtype().kind() == 'i' && cache.itemsize() == 1) return attention::KvDtype::kInt8;
  if (!is_float(cache, 4)) {
    raise(Status(StatusCode::kInvalidConfig, std::string(op) + ": unsupported K/V dtype " +
                                                 std::string(py::str(cache.dtype())) +
                                                 " (supported: float32, float16, int8)"));
  }
  return attention::KvDtype::kFloat32;
}

// cellcache::attend on numpy views of the tensors (no copies); writes `out`.
void attend_binding(Int handle, const py::object& query_obj, const py::object& k_obj,
                    const py::object& v_obj, const py::object& cells_obj, Int layer,
                    Real scaling, Real softcap, const py::object& out_obj) {
  py::array query = contiguous(query_obj, "query");
  py::array k = contiguous(k_obj, "k_cache");
  py::array v = contiguous(v_obj, "v_cache");
  py::array out = contiguous(out_obj, "out", true);
  Int64Array cells_arr = int64_array(cells_obj, "cells");
  auto cells = as_span(cells_arr);
  if (query.ndim() != 3 || !is_float(query, 4)) {
    throw py::type_error("query must be a float32 [n_tok, n_heads, head_dim] array");
  }
  if (!is_float(out, 4) || out.size() != query.size()) {
    throw py::type_error("out must be a float32 array shaped like query");
  }
  if (k.ndim() != 3 || v.ndim() != 3 || k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) ||
      k.shape(2) != v.shape(2) || !k.dtype().is(v.dtype())) {
    raise(Status(StatusCode::kInvalidConfig,
                 "k_cache and v_cache must both be [n_cells, n_kv_heads, head_dim] of one dtype"));
  }
  const attention::KvDtype dtype = kv_dtype(k, "attend");
  const attention::KvBuffers kv{k.data(), v.data(), dtype, k.shape(0), k.shape(1),
                                attention::kv_head_dim(dtype, k.shape(2))};
  const attention::Query q{static_cast<const float*>(query.data()), query.shape(0),
                           query.shape(1), query.shape(2)};
  std::span<float> out_span(static_cast<float*>(out.mutable_data()),
                            static_cast<size_t>(out.size()));
  Status status;
  {
    py::gil_scoped_release release;
    status = attend_op(handle, cells, layer, q, kv,
                       {static_cast<float>(scaling), static_cast<float>(softcap)}, out_span,
                       kernels::runtime_threads());
  }
  check(status);
}

// cellcache::write on numpy views: value's rows into cache at cells, in place.
void write_binding(const py::object& cache_obj, const py::object& cells_obj,
                   const py::object& value_obj) {
  py::array cache = contiguous(cache_obj, "cache", true);
  py::array value = contiguous(value_obj, "value");
  Int64Array cells_arr = int64_array(cells_obj, "cells");
  auto cells = as_span(cells_arr);
  if (!is_float(value, 4) || value.ndim() != 3) {
    throw py::type_error("value must be a float32 [n_tok, n_kv_heads, head_dim] array");
  }
  const attention::KvDtype dtype = kv_dtype(cache, "write");
  if (cache.ndim() != 3 || cache.shape(1) != value.shape(1) ||
      cache.shape(2) != attention::kv_stored_dim(dtype, value.shape(2)) ||
      value.shape(0) != static_cast<py::ssize_t>(cells.size())) {
    raise(Status(StatusCode::kInvalidConfig,
                 "write: cache [n_cells, n_kv_heads, head_dim (+ 4 for int8)] and value "
                 "[n_tok, n_kv_heads, head_dim] must agree, with one cell per value row"));
  }
  const attention::KvCache kv{cache.mutable_data(), dtype, cache.shape(0), cache.shape(1),
                              value.shape(2)};
  check(write_op(cells, {static_cast<const float*>(value.data()), static_cast<size_t>(value.size())},
                 kv));
}

// cellcache::rope on numpy views: x [*tokens, n_heads, head_dim] rotated into
// out (x's size) by cos, sin [*tokens, head_dim] or [*tokens, 1, head_dim]
// (attention::rope_shape).
void rope_binding(const py::object& x_obj, const py::object& cos_obj, const py::object& sin_obj,
                  const py::object& out_obj) {
  py::array x = contiguous(x_obj, "x");
  py::array cos = contiguous(cos_obj, "cos");
  py::array sin = contiguous(sin_obj, "sin");
  py::array out = contiguous(out_obj, "out", true);
  if (!is_float(x, 4) || !is_float(cos, 4) || !is_float(sin, 4) || !is_float(out, 4) ||
      out.size() != x.size()) {
    throw py::type_error("rope: x, cos, sin and out (x's size) must be float32 arrays");
  }
  auto sizes = [](const py::array& a) {
    return std::vector<int64_t>(a.shape(), a.shape() + a.ndim());
  };
  const attention::RopeShape shape = unwrap(attention::rope_shape(sizes(x), sizes(cos), sizes(sin)));
  auto floats = [](const py::array& a) {
    return std::span<const float>(static_cast<const float*>(a.data()),
                                  static_cast<size_t>(a.size()));
  };
  check(rope_op(shape, floats(x), floats(cos), floats(sin),
                {static_cast<float*>(out.mutable_data()), static_cast<size_t>(out.size())}));
}

}  // namespace

void bind_graph_ops(py::module_& m) {
  m.def("raise_last_op_error",
        []() {
          Status s = last_op_error();
          clear_last_op_error();
          if (!s.is_ok()) raise(s);
        },
        "Raises the error of the last failed cellcache op on this thread, if any, and "
        "clears it.");
  m.def("clear_last_op_error", []() { clear_last_op_error(); });
  m.def("place_op",
        [](Int handle, const py::object& positions, Int layer) {
          Int64Array arr = int64_array(positions, "positions");
          auto pos = as_span(arr);
          py::array_t<int64_t> cells(static_cast<py::ssize_t>(pos.size()));
          check(place_op(handle, pos, layer, {cells.mutable_data(), pos.size()}));
          return cells;
        },
        py::arg("handle"), py::arg("positions"), py::arg("layer"),
        "cellcache::place on the cache named by handle; int64 cells [n_tok].");
  m.def("attend_op", &attend_binding, py::arg("handle"), py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cells"), py::arg("layer"), py::arg("scaling"),
        py::arg("softcap"), py::arg("out"),
        "cellcache::attend on the cache named by handle, on numpy views (no copies):\n"
        "query float32 [n_tok, n_heads, head_dim]; k_cache, v_cache float32, float16 or int8\n"
        "[n_cells, n_kv_heads, head_dim (+ INT8_SCALE_BYTES for int8)]; cells int64 [n_tok]\n"
        "(place's output); softcap <= 0 = none. Writes out (float32, query's shape).");
  m.def("write_op", &write_binding, py::arg("cache"), py::arg("cells"), py::arg("value"),
        "cellcache::write on numpy views: value float32 [n_tok, n_kv_heads, head_dim] into\n"
        "cache (float32, float16 or int8 [n_cells, n_kv_heads, head_dim (+ INT8_SCALE_BYTES\n"
        "for int8)], written in place) at cells int64 [n_tok], converted to the cache's dtype\n"
        "(int8: quantized per (cell, KV head), attention/kv_int8.h).");
  m.def("rope_op", &rope_binding, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("out"),
        "cellcache::rope on numpy views: x float32 [..., n_heads, head_dim] rotated by cos and\n"
        "sin float32 [..., head_dim] (one row per token) into out (float32, x's size; may be x).");
  m.attr("INT8_SCALE_BYTES") = attention::kInt8ScaleBytes;
  m.def("float_to_half",
        [](Real x) { return attention::float_to_half(static_cast<float>(x.value)); },
        py::arg("x"),
        "IEEE binary32 -> binary16 bits, round to nearest even (the write kernel's scalar path).");
  m.def("runtime_thread_count", &kernels::runtime_thread_count,
        "Threads of the ExecuTorch runtime's pool, which the attend kernel uses.");
  m.attr("MAX_RUNTIME_THREADS") = kernels::kMaxRuntimeThreads;
  m.def("set_runtime_thread_count",
        [](Int threads) { return kernels::set_runtime_thread_count(threads); },
        py::arg("threads"),
        "Resizes the ExecuTorch runtime's pool to threads (1..MAX_RUNTIME_THREADS); True when it has that many\n"
        "afterwards. Replaces the pool: call it before any program loads (runtime/threads.py).");
  m.def("attend_threads_used", &kernels::threads_used,
        "Distinct pool threads that ran attend work since reset_attend_threads_used().");
  m.def("reset_attend_threads_used", &kernels::reset_threads_used);
  m.def("mask_op",
        [](Int handle, const py::object& cells, Int layer, Int extent) {
          Int64Array arr = int64_array(cells, "cells");
          auto c = as_span(arr);
          if (extent < 0) {
            raise(Status(StatusCode::kInvalidConfig,
                         "attention extent must be >= 0, got " + std::to_string(extent)));
          }
          // Validate before allocating n_tok x extent floats: with no output,
          // mask_op reports a bad handle, layer, cells or extent by itself.
          Result<CellCache*> cache = lookup_cache(handle);
          if (!cache.is_ok() || extent > cache.value()->written_end()) {
            check(mask_op(handle, c, layer, extent, {}));
          }
          py::array_t<float> mask({static_cast<py::ssize_t>(c.size()),
                                   static_cast<py::ssize_t>(extent)});
          check(mask_op(handle, c, layer, extent,
                        {mask.mutable_data(), c.size() * static_cast<size_t>(extent)}));
          return mask;
        },
        py::arg("handle"), py::arg("cells"), py::arg("layer"), py::arg("extent"),
        "cellcache::mask on the cache named by handle; float32 [n_tok, extent] additive.");
}

}  // namespace cellcache::bindings
