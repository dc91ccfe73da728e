// ExecuTorch runtime kernels of cellcache::place.out, cellcache::mask.out,
// cellcache::attend.out, cellcache::write.out and cellcache::rope.out.
//
// Thin shims: check dtypes and shapes, resize the dynamic outputs, and call
// the op logic in graph/graph_ops.h (shared with the PyTorch kernels). A
// failed Status is logged with its message and fails the kernel with
// InvalidArgument, so Method::execute returns an error instead of running on.
// Op names come from ops/cellcache_ops.yaml (generated cellcache_op_names.h).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_dimension_limit.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/platform/log.h>

#include <array>
#include <span>

#include "graph/graph_ops.h"
#include "cellcache_op_names.h"
#include "kernel_threads.h"

namespace cellcache {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool fail(KernelRuntimeContext& ctx, const char* op, const char* message) {
  ET_LOG(Error, "cellcache::%s: %s", op, message);
  ctx.fail(Error::InvalidArgument);
  return false;
}

bool check_ok(KernelRuntimeContext& ctx, const char* op, const Status& status) {
  if (status.is_ok()) return true;
  ET_LOG(Error, "cellcache::%s: [%s] %s", op, status_code_name(status.code()),
         status.message().c_str());
  ctx.fail(Error::InvalidArgument);
  return false;
}

bool check_int64_vector(KernelRuntimeContext& ctx, const char* op, const Tensor& t,
                        const char* what) {
  if (t.scalar_type() != ScalarType::Long || t.dim() != 1) {
    ET_LOG(Error, "cellcache::%s: %s must be a 1-D int64 tensor", op, what);
    ctx.fail(Error::InvalidArgument);
    return false;
  }
  return true;
}

bool read_handle(KernelRuntimeContext& ctx, const char* op, const Tensor& handle,
                 int64_t* out) {
  if (handle.scalar_type() != ScalarType::Long || handle.numel() != 1) {
    return fail(ctx, op, "handle must be an int64 tensor with one element (CellCache.handle)");
  }
  *out = handle.const_data_ptr<int64_t>()[0];
  return true;
}

// place.out(Tensor handle, Tensor positions, int layer, *, Tensor(a!) out)
Tensor& place_out(KernelRuntimeContext& ctx, const Tensor& handle, const Tensor& positions,
                  int64_t layer, Tensor& out) {
  int64_t h = 0;
  if (!read_handle(ctx, "place", handle, &h) ||
      !check_int64_vector(ctx, "place", positions, "positions") ||
      !check_int64_vector(ctx, "place", out, "out")) {
    return out;
  }
  const SizesType n_tok = static_cast<SizesType>(positions.size(0));
  if (executorch::runtime::resize_tensor(out, {&n_tok, 1}) != Error::Ok) {
    fail(ctx, "place", "cannot resize the cells output to n_tok");
    return out;
  }
  const auto n = static_cast<size_t>(n_tok);
  check_ok(ctx, "place",
           place_op(h, {positions.const_data_ptr<int64_t>(), n}, layer,
                    {out.mutable_data_ptr<int64_t>(), n}));
  return out;
}

// mask.out(Tensor handle, Tensor cells, int layer, Tensor extent, *, Tensor(a!) out)
Tensor& mask_out(KernelRuntimeContext& ctx, const Tensor& handle, const Tensor& cells,
                 int64_t layer, const Tensor& extent, Tensor& out) {
  int64_t h = 0;
  if (!read_handle(ctx, "mask", handle, &h) ||
      !check_int64_vector(ctx, "mask", cells, "cells")) {
    return out;
  }
  if (out.scalar_type() != ScalarType::Float || out.dim() != 2) {
    fail(ctx, "mask", "out must be a 2-D float32 tensor");
    return out;
  }
  const SizesType sizes[2] = {static_cast<SizesType>(cells.size(0)),
                              static_cast<SizesType>(extent.size(0))};
  if (executorch::runtime::resize_tensor(out, {sizes, 2}) != Error::Ok) {
    fail(ctx, "mask", "cannot resize the mask output to [n_tok, extent]");
    return out;
  }
  const auto n_tok = static_cast<size_t>(sizes[0]);
  check_ok(ctx, "mask",
           mask_op(h, {cells.const_data_ptr<int64_t>(), n_tok}, layer, sizes[1],
                   {out.mutable_data_ptr<float>(), n_tok * static_cast<size_t>(sizes[1])}));
  return out;
}

// The K/V element type of a cache tensor (fp32, fp16 or int8), or a failed kernel.
bool kv_dtype(KernelRuntimeContext& ctx, const char* op, const Tensor& cache,
              attention::KvDtype* dtype) {
  if (cache.scalar_type() == ScalarType::Float) {
    *dtype = attention::KvDtype::kFloat32;
  } else if (cache.scalar_type() == ScalarType::Half) {
    *dtype = attention::KvDtype::kFloat16;
  } else if (cache.scalar_type() == ScalarType::Char) {
    *dtype = attention::KvDtype::kInt8;
  } else {
    return fail(ctx, op, "unsupported K/V dtype (supported: float32, float16, int8)");
  }
  return true;
}

bool check_kv(KernelRuntimeContext& ctx, const Tensor& k, const Tensor& v,
              attention::KvBuffers* kv) {
  if (k.dim() != 3 || v.dim() != 3 || k.size(0) != v.size(0) || k.size(1) != v.size(1) ||
      k.size(2) != v.size(2)) {
    return fail(ctx, "attend", "k_cache and v_cache must both be [n_cells, n_kv_heads, head_dim]");
  }
  if (k.scalar_type() != v.scalar_type()) {
    return fail(ctx, "attend", "k_cache and v_cache must have one dtype");
  }
  if (!kv_dtype(ctx, "attend", k, &kv->dtype)) return false;
  if (!executorch::runtime::tensor_is_contiguous(k) ||
      !executorch::runtime::tensor_is_contiguous(v)) {
    return fail(ctx, "attend", "k_cache and v_cache must be contiguous");
  }
  kv->k = k.const_data_ptr();
  kv->v = v.const_data_ptr();
  kv->n_cells = k.size(0);
  kv->n_kv_heads = k.size(1);
  kv->head_dim = attention::kv_head_dim(kv->dtype, k.size(2));
  return true;
}

// attend.out(Tensor handle, Tensor query, Tensor k_cache, Tensor v_cache,
//            Tensor cells, int layer, float scaling, float softcap, *, Tensor(a!) out)
Tensor& attend_out(KernelRuntimeContext& ctx, const Tensor& handle, const Tensor& query,
                   const Tensor& k_cache, const Tensor& v_cache, const Tensor& cells,
                   int64_t layer, double scaling, double softcap, Tensor& out) {
  int64_t h = 0;
  attention::KvBuffers kv;
  if (!read_handle(ctx, "attend", handle, &h) ||
      !check_int64_vector(ctx, "attend", cells, "cells") || !check_kv(ctx, k_cache, v_cache, &kv)) {
    return out;
  }
  if (query.scalar_type() != ScalarType::Float || query.dim() != 3 ||
      !executorch::runtime::tensor_is_contiguous(query)) {
    fail(ctx, "attend", "query must be a contiguous [n_tok, n_heads, head_dim] float32 tensor");
    return out;
  }
  if (out.scalar_type() != ScalarType::Float) {
    fail(ctx, "attend", "out must be float32");
    return out;
  }
  if (executorch::runtime::resize_tensor(out, query.sizes()) != Error::Ok) {
    fail(ctx, "attend", "cannot resize the output to the query's shape");
    return out;
  }
  const attention::Query q{query.const_data_ptr<float>(), query.size(0), query.size(1),
                           query.size(2)};
  const auto n_out = static_cast<size_t>(query.numel());
  check_ok(ctx, "attend",
           attend_op(h, {cells.const_data_ptr<int64_t>(), static_cast<size_t>(cells.size(0))},
                     layer, q, kv,
                     {static_cast<float>(scaling), static_cast<float>(softcap)},
                     {out.mutable_data_ptr<float>(), n_out}, kernels::runtime_threads()));
  return out;
}

// write.out(Tensor(a!) cache, Tensor cells, Tensor value, *, Tensor(b!) out)
// cache: [n_cells, n_kv_heads, head_dim] fp32/fp16 (int8: head_dim + 4,
// attention/kv_int8.h), written in place;
// value: [n_tok, n_kv_heads, head_dim] fp32; out: the empty result, untouched.
Tensor& write_out(KernelRuntimeContext& ctx, Tensor& cache, const Tensor& cells,
                  const Tensor& value, Tensor& out) {
  attention::KvCache kv;
  if (!check_int64_vector(ctx, "write", cells, "cells") ||
      !kv_dtype(ctx, "write", cache, &kv.dtype)) {
    return out;
  }
  if (cache.dim() != 3 || !executorch::runtime::tensor_is_contiguous(cache)) {
    fail(ctx, "write", "cache must be a contiguous [n_cells, n_kv_heads, head_dim] tensor");
    return out;
  }
  if (value.scalar_type() != ScalarType::Float || value.dim() != 3 ||
      value.size(0) != cells.size(0) || value.size(1) != cache.size(1) ||
      value.size(2) != attention::kv_head_dim(kv.dtype, cache.size(2)) ||
      !executorch::runtime::tensor_is_contiguous(value)) {
    fail(ctx, "write", "value must be a contiguous float32 [n_tok, n_kv_heads, head_dim] tensor "
         "matching cells and the cache");
    return out;
  }
  kv.data = cache.mutable_data_ptr();
  kv.n_cells = cache.size(0);
  kv.n_kv_heads = cache.size(1);
  kv.head_dim = value.size(2);
  check_ok(ctx, "write",
           write_op({cells.const_data_ptr<int64_t>(), static_cast<size_t>(cells.size(0))},
                    {value.const_data_ptr<float>(), static_cast<size_t>(value.numel())}, kv));
  return out;
}

// A tensor's sizes as int64, outermost first (the core's shape checks take them so).
struct Sizes64 {
  std::array<int64_t, executorch::runtime::kTensorDimensionLimit> v{};
  size_t n = 0;
  explicit Sizes64(const Tensor& t) : n(static_cast<size_t>(t.dim())) {
    for (size_t d = 0; d < n; ++d) v[d] = t.size(static_cast<ssize_t>(d));
  }
  std::span<const int64_t> span() const { return {v.data(), n}; }
};

// rope.out(Tensor x, Tensor cos, Tensor sin, *, Tensor(a!) out)
// x: float32 [*tokens, n_heads, head_dim], the token dims' product n_tok;
// cos, sin: float32 [*tokens, head_dim] or [*tokens, 1, head_dim] (e.g. [1,
// n_tok, 1, head_dim]); out: resized to x's shape.
Tensor& rope_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
                 Tensor& out) {
  const bool floats = x.scalar_type() == ScalarType::Float &&
                      cos.scalar_type() == ScalarType::Float &&
                      sin.scalar_type() == ScalarType::Float &&
                      out.scalar_type() == ScalarType::Float;
  if (!floats || x.dim() < 2 || cos.dim() < 1 || sin.dim() < 1 ||
      !executorch::runtime::tensor_is_contiguous(x) ||
      !executorch::runtime::tensor_is_contiguous(cos) ||
      !executorch::runtime::tensor_is_contiguous(sin)) {
    fail(ctx, "rope", "x, cos, sin and out must be contiguous float32 tensors, x [*tokens, "
         "n_heads, head_dim] and cos, sin [*tokens, (1,) head_dim]");
    return out;
  }
  const Result<attention::RopeShape> shape =
      attention::rope_shape(Sizes64(x).span(), Sizes64(cos).span(), Sizes64(sin).span());
  if (!check_ok(ctx, "rope", shape.status())) return out;
  if (executorch::runtime::resize_tensor(out, x.sizes()) != Error::Ok) {
    fail(ctx, "rope", "cannot resize the output to x's shape");
    return out;
  }
  check_ok(ctx, "rope",
           rope_op(shape.value(), {x.const_data_ptr<float>(), static_cast<size_t>(x.numel())},
                   {cos.const_data_ptr<float>(), static_cast<size_t>(cos.numel())},
                   {sin.const_data_ptr<float>(), static_cast<size_t>(sin.numel())},
                   {out.mutable_data_ptr<float>(), static_cast<size_t>(out.numel())}));
  return out;
}

}  // namespace
}  // namespace cellcache

EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_PLACE_OUT, cellcache::place_out);
EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_MASK_OUT, cellcache::mask_out);
EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_ATTEND_OUT, cellcache::attend_out);
EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_WRITE_OUT, cellcache::write_out);
EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_ROPE_OUT, cellcache::rope_out);
