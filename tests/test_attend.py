"""cellcache::attend (SPEC section 8) as a torch.library op and as an
ExecuTorch kernel, against a brute-force dense reference written from SPEC
section 1's rule: a token of sequence s at position p attends every cell s
owns whose position k has k <= p and (full causal, or p - k < W). The
reference keeps its own ownership record (position -> cell per sequence, from
the cells placement returns) and scores every cell of the pool.

The kernel core's exhaustive randomized comparison (holes, forks, interleaved
sequences, windows 1..17 and full, GQA 1/2/4, softcap, fp16, int8, split pieces)
runs in C++ under ASan + UBSan (cpp/tests/attend_test.cpp); here the same
rule is checked through the Python op and the runtime kernel.
"""

import random

import pytest
import torch

from executorch_cellcache import (
    CellCache,
    InvalidConfigError,
    LayerOutOfRangeError,
    PositionConflictError,
    StepNotDeclaredError,
)
from executorch_cellcache.cache import _core
from executorch_cellcache.graph import ops
from executorch_cellcache.graph.attention import kv_cache_buffer

import int8_kv

attend = torch.ops.cellcache.attend.default
place = torch.ops.cellcache.place.default

OPCHECK_UTILS = ["test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic"]
HD = 8


class Pool:
    """A CellCache plus the reference's own record of who holds what."""

    def __init__(self, n_cells, windows, seed=0):
        self.cache = CellCache(n_cells, len(windows), windows)
        self.windows = windows
        self.held = {}  # seq -> {pos: cell}
        self.rng = random.Random(seed)

    def handle(self):
        return torch.tensor([self.cache.handle], dtype=torch.int64)

    def step(self, seqs, positions, layers=None):
        """Declares and places a step on the given layers (all by default)."""
        assert self.cache.declare_step(seqs)
        cells = None
        for layer in range(len(self.windows)) if layers is None else layers:
            cells = self.cache.place_step(positions, layer).cells
        for s, p, c in zip(seqs, positions, cells):
            self.held.setdefault(s, {})[p] = int(c)
        return torch.tensor(cells, dtype=torch.int64)

    def next_positions(self, seqs):
        nxt, out = {}, []
        for s in seqs:
            p = nxt.get(s, self.cache.next_pos(s))
            out.append(p)
            nxt[s] = p + 1
        return out

    def clone(self, src, upto):
        d = self.cache.seq_clone(src, upto)
        self.held[d] = {p: c for p, c in self.held.get(src, {}).items() if p < upto}
        return d

    def rm(self, seq, p0, p1):
        self.cache.seq_rm(seq, p0, p1)
        self.held[seq] = {p: c for p, c in self.held.get(seq, {}).items()
                          if not p0 <= p < p1}


def reference(pool, seqs, positions, window, q, k, v, scaling, softcap):
    """Dense attention over every cell of the pool with SPEC's mask, float64.
    q: [n_tok, n_heads, hd]; k, v: [n_cells, n_kv, hd]."""
    n_tok, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    out = torch.zeros(n_tok, n_heads, hd, dtype=torch.float64)
    k, v, q = k.double(), v.double(), q.double()
    for i, (s, p) in enumerate(zip(seqs, positions)):
        by_cell = {c: kp for kp, c in pool.held[s].items()}
        cells = [c for c in range(k.shape[0])
                 if c in by_cell and by_cell[c] <= p and (window is None or p - by_cell[c] < window)]
        for h in range(n_heads):
            scores = k[cells, h // group] @ q[i, h] * scaling
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[i, h] = torch.softmax(scores, 0) @ v[cells, h // group]
    return out


def fragmented_pool(n_cells, windows, seed):
    """Two prompts interleaved, a fork sharing a prefix, a hole refilled by
    later tokens, decode steps of several sequences in one forward."""
    pool = Pool(n_cells, windows, seed)
    rng = pool.rng
    a, b = pool.cache.seq_new(), pool.cache.seq_new()
    seqs = [a, b] * 12 + [a] * 5
    pool.step(seqs, pool.next_positions(seqs))
    f = pool.clone(a, 9)
    pool.rm(b, 3, 7)  # a hole; its cells go to the next tokens
    for _ in range(6):
        seqs = rng.sample([a, b, f, f], 3)
        pool.step(seqs, pool.next_positions(seqs))
    return pool, [a, b, f]


CASES = [  # (n_heads, n_kv, softcap, kv dtype)
    (2, 2, None, torch.float32), (4, 2, None, torch.float32), (8, 2, 5.0, torch.float32),
    (4, 2, None, torch.float16), (8, 2, 5.0, torch.float16), (2, 2, None, torch.float16),
    (4, 2, None, torch.int8), (8, 2, 5.0, torch.int8), (2, 2, None, torch.int8),
]


def stored(x32, dtype):
    """x32 float32 [n_cells, n_kv, hd] as a K/V buffer of dtype (int8: written
    by cellcache::write) and the values attention must read back from it."""
    if dtype != torch.int8:
        return x32.to(dtype), x32.to(dtype).float()
    buf = kv_cache_buffer(*x32.shape, torch.int8)
    ops.write(buf, torch.arange(x32.shape[0]), x32)
    return buf, int8_kv.round_trip(x32)


@pytest.mark.parametrize("n_heads,n_kv,softcap,dtype", CASES)
def test_attend_matches_dense_reference(n_heads, n_kv, softcap, dtype):
    windows = [None, 1, 3, 16]
    pool, (a, b, f) = fragmented_pool(128, windows, seed=n_heads)
    g = torch.Generator().manual_seed(n_heads * 7 + (dtype == torch.float16) +
                                      2 * (dtype == torch.int8))
    # A mixed step: a prefill chunk of a new sequence between decode tokens.
    c = pool.cache.seq_new()
    seqs = [a, c, c, c, b, c, f]
    positions = pool.next_positions(seqs)
    cells = pool.step(seqs, positions)
    q = torch.randn(len(seqs), n_heads, HD, generator=g)
    scaling = HD ** -0.5
    for layer, window in enumerate(windows):
        k32 = torch.randn(128, n_kv, HD, generator=g)
        v32 = torch.randn(128, n_kv, HD, generator=g)
        (k, k_read), (v, v_read) = stored(k32, dtype), stored(v32, dtype)
        got = attend(pool.handle(), q, k, v, cells, layer, scaling, softcap or 0.0)
        assert got.dtype == torch.float32 and got.shape == q.shape
        want = reference(pool, seqs, positions, window, q, k_read, v_read, scaling, softcap)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
        if dtype != torch.float32:  # against the unrounded values: storage error only
            # fp16: 2^-11 relative a value; int8: half a step, amax / 254 of its
            # head (<= ~1e-2 for 8 normal values), through V directly and
            # through K's scores (measured up to 2.3e-2 here).
            want32 = reference(pool, seqs, positions, window, q, k32, v32, scaling, softcap)
            torch.testing.assert_close(got.double(), want32,
                                       atol=2e-3 if dtype == torch.float16 else 5e-2, rtol=0)


def test_attend_reads_only_own_cells():
    """Changing another sequence's K/V, or cells outside the window, leaves
    a token's output unchanged; changing one of its own visible cells does not."""
    pool, (a, b, f) = fragmented_pool(128, [4], seed=3)
    cells = pool.step([a], pool.next_positions([a]))
    q = torch.randn(1, 2, HD)
    k, v = torch.randn(128, 1, HD), torch.randn(128, 1, HD)
    base = attend(pool.handle(), q, k, v, cells, 0, 1.0, 0.0)
    p = pool.cache.next_pos(a) - 1
    others = [c for s, held in pool.held.items() if s != a for c in held.values()
              if c not in pool.held[a].values()]
    hidden = [c for kp, c in pool.held[a].items() if p - kp >= 4]
    assert others and hidden
    k2, v2 = k.clone(), v.clone()
    k2[others + hidden] += 10.0
    v2[others + hidden] -= 10.0
    torch.testing.assert_close(attend(pool.handle(), q, k2, v2, cells, 0, 1.0, 0.0), base,
                               atol=0, rtol=0)
    v2[pool.held[a][p - 1]] += 1.0
    assert not torch.allclose(attend(pool.handle(), q, k2, v2, cells, 0, 1.0, 0.0), base)


# ------------------------------------------------------------------ opcheck and errors

@pytest.mark.parametrize("util", OPCHECK_UTILS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_opcheck_attend(util, dtype):
    pool, (a, b, f) = fragmented_pool(64, [None, 2], seed=5)
    cells = pool.step([a, b], pool.next_positions([a, b]))
    args = (pool.handle(), torch.randn(2, 4, HD), stored(torch.randn(64, 2, HD), dtype)[0],
            stored(torch.randn(64, 2, HD), dtype)[0], cells, 1, 0.25, 0.0)
    assert torch.library.opcheck(attend, args, test_utils=util) == {util: "SUCCESS"}


def test_attend_out_variant():
    pool, (a, b, f) = fragmented_pool(64, [None], seed=6)
    cells = pool.step([a], pool.next_positions([a]))
    q, k, v = torch.randn(1, 2, HD), torch.randn(64, 1, HD), torch.randn(64, 1, HD)
    out = torch.empty(0)
    r = torch.ops.cellcache.attend.out(pool.handle(), q, k, v, cells, 0, 1.0, 0.0, out=out)
    assert r is out
    torch.testing.assert_close(out, attend(pool.handle(), q, k, v, cells, 0, 1.0, 0.0))


@pytest.fixture
def placed():
    pool = Pool(16, [None, 2])
    s = pool.cache.seq_new()
    cells = pool.step([s, s], [0, 1])
    return pool, cells, torch.randn(2, 2, HD), torch.randn(16, 1, HD), torch.randn(16, 1, HD)


@pytest.mark.parametrize("layer", [-1, 2, 2**40])
def test_attend_layer_out_of_range(placed, layer):
    pool, cells, q, k, v = placed
    with pytest.raises(LayerOutOfRangeError, match=str(layer)):
        attend(pool.handle(), q, k, v, cells, layer, 1.0, 0.0)


def test_attend_refuses_a_description_not_matching_the_step(placed):
    pool, cells, q, k, v = placed
    with pytest.raises(PositionConflictError, match="placement"):
        attend(pool.handle(), q, k, v, cells.flip(0), 0, 1.0, 0.0)
    with pytest.raises(PositionConflictError, match="query tokens"):
        attend(pool.handle(), q[:1], k, v, cells, 0, 1.0, 0.0)


def test_attend_refuses_bad_kv(placed):
    pool, cells, q, k, v = placed
    with pytest.raises(InvalidConfigError,
                       match="bfloat16.*supported: torch.float32, torch.float16, torch.int8"):
        attend(pool.handle(), q, k.bfloat16(), v.bfloat16(), cells, 0, 1.0, 0.0)
    with pytest.raises(InvalidConfigError, match="15 cells but the layer's pool has 16"):
        attend(pool.handle(), q, k[:15], v[:15], cells, 0, 1.0, 0.0)
    with pytest.raises(InvalidConfigError, match="multiple"):
        attend(pool.handle(), q, torch.randn(16, 3, HD), torch.randn(16, 3, HD), cells, 0,
               1.0, 0.0)
    with pytest.raises(InvalidConfigError, match="one dtype"):
        attend(pool.handle(), q, k, v.half(), cells, 0, 1.0, 0.0)
    no_scales = torch.zeros(16, 1, HD, dtype=torch.int8)  # int8 without room for the scales
    with pytest.raises(InvalidConfigError, match=f"K/V head_dim {HD - 4} differs from the "
                                                 f"query's {HD}"):
        attend(pool.handle(), q, no_scales, no_scales, cells, 0, 1.0, 0.0)
    with pytest.raises(TypeError, match="float32"):
        attend(pool.handle(), q.double(), k, v, cells, 0, 1.0, 0.0)


def test_attend_before_place_and_after_a_verb():
    pool = Pool(16, [None])
    s = pool.cache.seq_new()
    q, k, v = torch.randn(1, 1, HD), torch.randn(16, 1, HD), torch.randn(16, 1, HD)
    assert pool.cache.declare_step([s])
    with pytest.raises(StepNotDeclaredError, match="layer 0 has not been placed in the current step"):
        attend(pool.handle(), q, k, v, torch.zeros(1, dtype=torch.int64), 0, 1.0, 0.0)
    cells = place(pool.handle(), torch.tensor([0]), 0)
    attend(pool.handle(), q, k, v, cells, 0, 1.0, 0.0)
    pool.cache.seq_new()  # any verb: the step's cells are stale
    with pytest.raises(StepNotDeclaredError, match="layer 0 has not been placed in the current step"):
        attend(pool.handle(), q, k, v, cells, 0, 1.0, 0.0)


# ------------------------------------------------------------------ ExecuTorch kernel

def test_attend_kernel_registered():
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    assert "cellcache::attend.out" in set(_get_operator_names())


@pytest.fixture(scope="module")
def attend_pte(tmp_path_factory):
    """place then attend, K/V as inputs (no XNNPACK needed); returns the
    attention output and the cells place chose."""
    from executorch.exir import ExecutorchBackendConfig, to_edge

    class Tiny(torch.nn.Module):
        def forward(self, positions, handle, query, k_cache, v_cache):
            cells = place(handle, positions, 0)
            return attend(handle, query, k_cache, v_cache, cells, 0, HD ** -0.5, 0.0), cells

    n = torch.export.Dim("n", min=1, max=64)
    dims = ({0: n}, None, {0: n}, None, None)
    args = (torch.arange(2), torch.zeros(1, dtype=torch.int64), torch.randn(2, 4, HD),
            torch.randn(4096, 2, HD), torch.randn(4096, 2, HD))
    with torch.no_grad():
        ep = torch.export.export(Tiny(), args, dynamic_shapes=dims, strict=False)
        prog = to_edge(ep).to_executorch(ExecutorchBackendConfig())
    path = tmp_path_factory.mktemp("attend") / "attend.pte"
    path.write_bytes(prog.buffer)
    return path


def test_attend_plan_lists_own_cells_by_position():
    """The plan the kernel reads, from the binding: each token's range holds
    exactly its sequence's cells within the window, ordered by position."""
    windows = [None, 3]
    pool, (a, b, f) = fragmented_pool(128, windows, seed=9)
    seqs = [b, a, b]
    positions = pool.next_positions(seqs)
    pool.step(seqs, positions)
    for layer, window in enumerate(windows):
        plan = pool.cache.attend_plan(layer)
        for i, (s, p) in enumerate(zip(seqs, positions)):
            listed = plan["cells"][plan["tok_begin"][i]:plan["tok_end"][i]].tolist()
            want = [c for kp, c in sorted(pool.held[s].items())
                    if kp <= p and (window is None or p - kp < window)]
            assert listed == want


def test_runtime_kernel_matches_reference_on_the_thread_pool(attend_pte):
    """One long sequence (3000 cells, split into pieces) next to a short one,
    through the runtime kernel: equal to the reference, and the work really
    ran on more than one of the runtime pool's threads."""
    from executorch.runtime import Runtime

    pool = Pool(4096, [None])
    long, short = pool.cache.seq_new(), pool.cache.seq_new()
    for _ in range(6):
        seqs = [long] * 500 + [short] * 2
        pool.step(seqs, pool.next_positions(seqs))
    seqs = [long, short, long]
    positions = pool.next_positions(seqs)
    assert pool.cache.declare_step(seqs)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, HD, generator=g)
    k, v = torch.randn(4096, 2, HD, generator=g), torch.randn(4096, 2, HD, generator=g)
    method = Runtime.get().load_program(str(attend_pte)).load_method("forward")
    _core.reset_attend_threads_used()
    out, cells = method.execute([torch.tensor(positions), pool.handle(), q, k, v])
    used = _core.attend_threads_used()
    for s, p, c in zip(seqs, positions, cells.tolist()):
        pool.held[s][p] = c
    want = reference(pool, seqs, positions, None, q, k, v, HD ** -0.5, None)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    threads = _core.runtime_thread_count()
    assert threads >= 1
    if threads >= 2:
        assert used >= 2, f"attend ran on {used} of {threads} pool threads"
    else:
        assert used == 1


# ------------------------------------------------------------------ K/V dtype in the metadata

def _info(**overrides):
    from executorch_cellcache.cache import metadata

    fields = dict(n_cells=16, n_layers=1, windows=[None], vocab_size=8, bos_id=None,
                  eos_ids=[], max_tokens_per_step=4, model_type="toy", model_name="toy",
                  tokenizer_kind=metadata.TOKENIZER_NONE, tokenizer_json=None)
    fields.update(overrides)
    return metadata.ProgramInfo(**fields)


def write_metadata_program(path, methods):
    """A valid .pte of a trivial module carrying the given constant methods."""
    from executorch.exir import to_edge

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    exported = torch.export.export(AddOne(), (torch.ones(2),))
    path.write_bytes(to_edge(exported, constant_methods=methods).to_executorch().buffer)
    return path


def test_program_without_kv_dtype_reads_as_fp32(tmp_path):
    """Programs written before kv_dtype existed load (no format bump)."""
    from executorch_cellcache import Runner
    from executorch_cellcache.cache import metadata

    methods = metadata.constant_methods(_info(kv_dtype="fp16"))
    assert methods["kv_dtype"].tolist() == list(b"fp16")
    del methods["kv_dtype"], methods["attention"]
    r = Runner(write_metadata_program(tmp_path / "old.pte", methods))
    assert r.info.kv_dtype == "fp32"
    assert r.info.attention == "reference"  # what programs before the cells path did
    r16 = Runner(write_metadata_program(tmp_path / "fp16.pte",
                                        metadata.constant_methods(_info(kv_dtype="fp16"))))
    assert r16.info.kv_dtype == "fp16" and r16.info.attention == "cells"


def test_runner_refuses_an_unsupported_kv_dtype(tmp_path):
    from executorch_cellcache import Runner
    from executorch_cellcache.cache import metadata

    path = write_metadata_program(tmp_path / "bf16.pte",
                                  metadata.constant_methods(_info(kv_dtype="bf16")))
    with pytest.raises(InvalidConfigError, match=r"K/V dtype 'bf16' is not supported by this "
                                                 r"runner \(supported: fp32, fp16, int8\)"):
        Runner(path)


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_dtype": "int4"}, "kv_dtype must be one of fp32, fp16, int8, got 'int4'"),
    ({"attention": "dense"}, "attention must be one of cells, reference, got 'dense'"),
    ({"kv_dtype": "int8", "attention": "reference"},
     "int8 K/V needs the 'cells' attention path, not 'reference'"),
])
def test_export_refuses_bad_choices_before_tracing(tmp_path, kwargs, match):
    from executorch_cellcache import export

    with pytest.raises(InvalidConfigError, match=match):
        export(None, tmp_path / "m.pte", n_cells=16, max_tokens_per_step=4, **kwargs)
