// ExecuTorch runtime kernels of cellcache::place.out and cellcache::mask.out.
//
// Thin shims: check dtypes and shapes, resize the dynamic outputs, and call
// the op logic in cellcache/graph_ops.h (shared with the PyTorch kernels). A
// failed Status is logged with its message and fails the kernel with
// InvalidArgument, so Method::execute returns an error instead of running on.
// Op names come from ops/cellcache_ops.yaml (generated cellcache_op_names.h).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/platform/log.h>

#include <span>

#include "cellcache/graph_ops.h"
#include "cellcache_op_names.h"

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

}  // namespace
}  // namespace cellcache

EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_PLACE_OUT, cellcache::place_out);
EXECUTORCH_LIBRARY(cellcache, CELLCACHE_OP_MASK_OUT, cellcache::mask_out);
