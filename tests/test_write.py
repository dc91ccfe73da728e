"""cellcache::write, the in-place K/V write: as a torch.library op (opcheck,
eager values against torch's own ``index_copy_`` + ``Tensor.to``, errors) and
as the ExecuTorch kernel a program runs (the same values, in place, a bad cell
refused). fp16 rounding is checked bit for bit against torch's conversion, int8
quantization against the rule written again in numpy (tests/int8_kv.py)."""

import numpy as np
import pytest
import torch

from executorch_cellcache import InvalidConfigError
from executorch_cellcache.cache import _core
from executorch_cellcache.graph import ops
from executorch_cellcache.graph.attention import kv_cache_buffer

import int8_kv

write = ops.write
OPCHECK_UTILS = ["test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic"]
N_CELLS, N_KV, HEAD_DIM = 12, 3, 20  # rows of 60: the 8-wide path and its tail


def _values(n_tok, seed=0):
    """fp32 rows with the conversion's edge cases mixed into normal values."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n_tok, N_KV, HEAD_DIM, generator=g) * 4
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.996, 65520.0, 1e30, -1e30,
                            float("inf"), float("-inf"), 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -24,
                            1e-10, 6.1035156e-05, 1.0009765625 + 2.0 ** -11])
    flat = v.view(-1)
    flat[: special.numel()] = special
    return v


def _oracle(cache, cells, value):
    expected = cache.clone()
    expected.index_copy_(0, cells, value.to(cache.dtype))
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_write(dtype, util):
    cache = torch.randn(N_CELLS, N_KV, HEAD_DIM).to(dtype)
    args = (cache, torch.tensor([3, 0, 11]), torch.randn(3, N_KV, HEAD_DIM))
    torch.library.opcheck(write, args, test_utils=util)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_equals_index_copy_of_the_converted_rows(dtype):
    cache = torch.randn(N_CELLS, N_KV, HEAD_DIM).to(dtype)
    cells = torch.tensor([7, 2, 11, 0])
    value = _values(4)
    expected = _oracle(cache, cells, value)
    out = write(cache, cells, value)
    assert out.numel() == 0
    # Bit for bit (rounding, inf, signed zero), and untouched cells unchanged.
    assert torch.equal(cache.view(torch.int16 if dtype == torch.float16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.float16 else torch.int32))


@pytest.mark.parametrize("util", OPCHECK_UTILS)
def test_opcheck_write_int8(util):
    cache = int8_kv.pack(torch.randn(N_CELLS, N_KV, HEAD_DIM))
    args = (cache, torch.tensor([3, 0, 11]), torch.randn(3, N_KV, HEAD_DIM))
    torch.library.opcheck(write, args, test_utils=util)


def test_write_int8_stores_each_head_by_the_rule():
    """Bit for bit against the numpy rule: ties, zeros, huge, tiny and
    non-finite heads (the shared _values rows put inf in some heads)."""
    cache = kv_cache_buffer(N_CELLS, N_KV, HEAD_DIM, torch.int8)
    assert cache.shape == (N_CELLS, N_KV, HEAD_DIM + _core.INT8_SCALE_BYTES)
    before = cache.clone()
    cells = torch.tensor([7, 2, 11, 0, 5])
    value = _values(5, seed=4)
    ties = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, 1.5, -126.5])  # amax 127: scale 1
    value[1, 0] = 0.0
    value[1, 0, :len(ties)] = ties
    value[1, 1] = 0.0
    value[1, 2] = torch.randn(HEAD_DIM) * 1e-41                # subnormal scale
    value[2, 0, 3] = float("nan")
    value[3] *= 1e36
    write(cache, cells, value)
    expected = before.clone()
    expected[cells] = int8_kv.pack(value)
    assert torch.equal(cache, expected)
    q, scale = int8_kv.quantize(value.numpy())
    assert np.isnan(scale[0, 0]) and np.isnan(scale[2, 0]) and not np.isnan(scale[2, 1])
    assert scale[1, 1] == 0 and (q[1, 1] == 0).all() and scale[1, 0] == 1.0
    assert q[1, 0, :len(ties)].tolist() == [127, 2, 4, -2, 0, 2, -126]  # ties to even


def test_float_to_half_matches_torch_on_random_bit_patterns():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    floats = bits.view(np.float32)
    floats = floats[~np.isnan(floats)]
    want = torch.from_numpy(floats.copy()).to(torch.float16).view(torch.int16).numpy()
    got = np.array([_core.float_to_half(float(x)) for x in floats], dtype=np.uint16)
    np.testing.assert_array_equal(got.view(np.int16), want)


def test_nan_stays_nan():
    cache = torch.zeros(N_CELLS, N_KV, HEAD_DIM, dtype=torch.float16)
    value = torch.full((1, N_KV, HEAD_DIM), float("nan"))
    write(cache, torch.tensor([5]), value)
    assert torch.isnan(cache[5]).all() and (cache[:5] == 0).all() and (cache[6:] == 0).all()


@pytest.mark.parametrize("cells", [[0, N_CELLS], [-1, 1], [0, 2 ** 40]])
def test_cell_outside_the_cache_is_refused_and_nothing_written(cells):
    cache = torch.zeros(N_CELLS, N_KV, HEAD_DIM, dtype=torch.float16)
    with pytest.raises(InvalidConfigError, match=r"cell -?\d+ lies outside the K/V buffer of "
                                                   rf"{N_CELLS} cells"):
        write(cache, torch.tensor(cells), torch.ones(2, N_KV, HEAD_DIM))
    assert (cache == 0).all()


def test_int8_cache_must_hold_the_scale_bytes():
    cache = torch.zeros(N_CELLS, N_KV, HEAD_DIM, dtype=torch.int8)  # no room for the scales
    with pytest.raises(InvalidConfigError, match=rf"value must be float32 \[n_tok, {N_KV}, "
                                                   rf"{HEAD_DIM - 4}\]"):
        write(cache, torch.tensor([0]), torch.ones(1, N_KV, HEAD_DIM))
    assert (cache == 0).all()


def test_bad_shapes_and_dtypes_are_refused():
    cache = torch.zeros(N_CELLS, N_KV, HEAD_DIM)
    with pytest.raises(InvalidConfigError, match="must agree"):
        write(cache, torch.tensor([0, 1]), torch.ones(3, N_KV, HEAD_DIM))  # 3 rows, 2 cells
    with pytest.raises(InvalidConfigError, match="must agree"):
        write(cache, torch.tensor([0]), torch.ones(1, N_KV, HEAD_DIM + 1))
    with pytest.raises(TypeError, match="value must be float32"):
        write(cache, torch.tensor([0]), torch.ones(1, N_KV, HEAD_DIM, dtype=torch.float64))
    with pytest.raises(TypeError, match="1-D int64"):
        write(cache, torch.tensor([0.0]), torch.ones(1, N_KV, HEAD_DIM))
    with pytest.raises(InvalidConfigError, match="unsupported K/V dtype torch.bfloat16"):
        write(cache.bfloat16(), torch.tensor([0]), torch.ones(1, N_KV, HEAD_DIM))
    with pytest.raises(TypeError, match="contiguous"):
        write(cache.transpose(1, 2), torch.tensor([0]), torch.ones(1, HEAD_DIM, N_KV))
    assert (cache == 0).all()


def test_rows_overlapping_the_cache_are_refused():
    cache = torch.arange(8.0).view(4, 1, 2)
    with pytest.raises(InvalidConfigError, match="overlap"):
        write(cache, torch.tensor([1, 2]), cache[0:2])
    assert torch.equal(cache, torch.arange(8.0).view(4, 1, 2))


def test_binding_refuses_byte_swapped_arrays():
    cache = np.zeros((2, 1, 4), np.float32)
    with pytest.raises(TypeError, match="float32"):
        _core.write_op(cache, np.array([0]), np.ones((1, 1, 4), dtype=">f4"))
    with pytest.raises(InvalidConfigError, match="unsupported K/V dtype"):
        _core.write_op(np.zeros((2, 1, 4), ">f2"), np.array([1]), np.ones((1, 1, 4), np.float32))
    assert (cache == 0).all()


def test_out_variant_refuses_the_cache_as_out():
    cache = torch.zeros(N_CELLS, N_KV, HEAD_DIM)
    with pytest.raises(ValueError, match="must not share memory"):
        torch.ops.cellcache.write.out(cache, torch.tensor([0]), torch.ones(1, N_KV, HEAD_DIM),
                                      out=cache)
    assert cache.shape == (N_CELLS, N_KV, HEAD_DIM) and (cache == 0).all()


def test_export_refuses_a_write_the_runtime_would_refuse():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(N_CELLS, N_KV, 4), persistent=False)

        def forward(self, cells, value):
            return write(self.cache, cells, value)

    with pytest.raises(InvalidConfigError, match=r"value must be float32 \[n_tok, 3, 4\]"):
        torch.export.export(Bad(), (torch.tensor([0]), torch.ones(1, N_KV, 5)), strict=False)
    with pytest.raises(TypeError, match="cells must be a 1-D int64"):
        torch.export.export(Bad(), (torch.tensor([0], dtype=torch.int32),
                                    torch.ones(1, N_KV, 4)), strict=False)


class _Writer(torch.nn.Module):
    """Writes value at cells into its fp16 buffer and returns the whole buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(N_CELLS, N_KV, HEAD_DIM, dtype=torch.float16),
                             persistent=False)

    def forward(self, cells, value):
        write(self.cache, cells, value)
        return self.cache.float() + 0


@pytest.fixture(scope="module")
def writer_method(tmp_path_factory):
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime

    n = torch.export.Dim("n", min=1, max=N_CELLS)
    with torch.no_grad():
        ep = torch.export.export(_Writer(), (torch.tensor([0, 1]), torch.ones(2, N_KV, HEAD_DIM)),
                                 dynamic_shapes=({0: n}, {0: n}), strict=False)
        prog = to_edge(ep).to_executorch(ExecutorchBackendConfig())
    ops_called = {op.name for op in prog.executorch_program.execution_plan[0].operators}
    assert "cellcache::write" in ops_called and not any("index_put" in o for o in ops_called)
    path = tmp_path_factory.mktemp("write") / "write.pte"
    path.write_bytes(prog.buffer)
    return Runtime.get().load_program(str(path)).load_method("forward")


def test_executorch_kernel_writes_in_place_like_torch(writer_method):
    expected = torch.zeros(N_CELLS, N_KV, HEAD_DIM, dtype=torch.float16)
    for step, cells in enumerate([[4, 9], [0, 1, 2], [9]]):
        cells = torch.tensor(cells)
        value = _values(len(cells), seed=step)
        expected.index_copy_(0, cells, value.to(torch.float16))
        out = writer_method.execute([cells, value])[0]
        # The buffer persists across executes: each step adds its rows.
        assert torch.equal(out, expected.float())


def test_executorch_kernel_refuses_a_cell_outside_the_cache(writer_method):
    before = writer_method.execute([torch.tensor([3]), torch.zeros(1, N_KV, HEAD_DIM)])[0]
    # The runtime reports a failed kernel as its error code (0x12: InvalidArgument).
    with pytest.raises(RuntimeError, match=r"method->execute\(\) failed with error 0x12"):
        writer_method.execute([torch.tensor([N_CELLS]), torch.ones(1, N_KV, HEAD_DIM)])
    after = writer_method.execute([torch.tensor([3]), torch.zeros(1, N_KV, HEAD_DIM)])[0]
    assert torch.equal(before, after)  # the refused step wrote nothing
