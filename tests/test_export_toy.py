"""The toy attention model through torch.export -> ExecuTorch (.pte) ->
executorch.runtime, checked step by step against eager PyTorch and against
the cache-free oracle of toy_attention.py."""

import copy
import gc

import pytest
import torch

from executorch_cellcache import (
    CellCache,
    InvalidConfigError,
    PositionConflictError,
    StepNotDeclaredError,
    UnknownCacheError,
)
from executorch_cellcache.cache import _core
from executorch_cellcache.exporting.lowering import cache_reads, full_cache_copies, lower

from toy_attention import (
    WINDOWS,
    Histories,
    ToyAttention,
    cache_shapes,
    dynamic_shapes,
    example_inputs,
)

pytestmark = pytest.mark.slow

N_CELLS = 32
MAX_TOKENS = 16
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m = ToyAttention(N_CELLS, WINDOWS, seed=0).eval()
    assert len(set(WINDOWS)) == 3 and m.n_heads != m.n_kv  # mixed windows, GQA
    return m


def _lower(model):
    with torch.no_grad():
        return lower(copy.deepcopy(model), example_inputs(),
                     dynamic_shapes(N_CELLS, MAX_TOKENS))


def _write(program, tmp_path_factory, name):
    path = tmp_path_factory.mktemp("toy") / name
    path.write_bytes(program.buffer)
    return path


@pytest.fixture(scope="module")
def program(model):
    return _lower(model)


@pytest.fixture(scope="module")
def pte(program, tmp_path_factory):
    return _write(program, tmp_path_factory, "toy.pte")


@pytest.fixture(scope="module")
def reference_model(model):
    """The same weights on the dense-mask reference attention path."""
    m = copy.deepcopy(model)
    m.attention = "reference"
    return m


@pytest.fixture(scope="module")
def reference_program(reference_model):
    return _lower(reference_model)


@pytest.fixture(scope="module")
def reference_pte(reference_program, tmp_path_factory):
    return _write(reference_program, tmp_path_factory, "toy_reference.pte")


def load_forward(pte):
    """A freshly loaded program's forward (its own K/V buffers)."""
    from executorch.runtime import Runtime

    return Runtime.get().load_program(str(pte)).load_method("forward")


def run_et(method, inputs):
    """execute() with the cache's error mapping of runner.Runner.step."""
    _core.clear_last_op_error()
    try:
        return method.execute(inputs)[0]
    except RuntimeError:
        _core.raise_last_op_error()
        raise


def et_forward(pte):
    method = load_forward(pte)
    return lambda inputs: run_et(method, inputs)


def eager_forward(model):
    m = copy.deepcopy(model)  # its own K/V buffers

    def forward(inputs):
        with torch.no_grad():
            return m(*inputs)

    return forward


class Driver:
    """A CellCache driving one forward (ExecuTorch or eager), with the token
    histories the oracle needs."""

    def __init__(self, forward, model):
        self.cache = CellCache(N_CELLS, model.n_layers, model.windows)
        self.handle = torch.tensor([self.cache.handle], dtype=torch.int64)
        self.forward = forward
        self.hist = Histories()
        self.steps = []  # (seq_ids, positions, output)
        self.log = []  # steps and verbs in order, for the oracle replay

    def positions_for(self, seq_ids):
        nxt = {}
        out = []
        for s in seq_ids:
            p = nxt.get(s, self.cache.next_pos(s))
            out.append(p)
            nxt[s] = p + 1
        return out

    def inputs(self, tokens, positions, extent):
        return [torch.tensor(tokens, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64), self.handle,
                torch.empty(extent, dtype=torch.uint8)]

    def step(self, seq_ids, tokens, extent="used"):
        positions = self.positions_for(seq_ids)
        assert self.cache.declare_step(seq_ids)
        # "used": the extent placement needs; "written": as far as K/V were
        # ever written (exercises masked cells past used_end, e.g. after seq_rm).
        e = self.cache.planned_used_end
        if extent == "written":
            e = max(e, self.cache.written_end)
        out = self.forward(self.inputs(tokens, positions, e))
        assert out.shape == (len(tokens), 32) and out.dtype == torch.float32
        self.hist.extend(seq_ids, tokens, positions)
        self.steps.append((list(seq_ids), positions, out.clone()))
        self.log.append(("step", list(seq_ids), positions, list(tokens), out.clone()))
        self.cache.check_invariants()
        return out

    def clone(self, src):
        dst = self.cache.seq_clone(src)
        self.hist.clone(src, dst)
        self.log.append(("clone", src, dst))
        return dst

    def rm_tail(self, seq, p0):
        self.cache.seq_rm(seq, p0)
        self.hist.rm_tail(seq, p0)
        self.log.append(("rm", seq, p0))


def script(d, base=0):
    """Prefill two sequences in one step, fork one, decode all three, remove a
    tail, decode again (one step with two tokens of one sequence). A
    generator: yields after every step, so scripts can be interleaved."""
    t = lambda *xs: [(base + x) % 64 for x in xs]  # noqa: E731
    a, b = d.cache.seq_new(), d.cache.seq_new()
    yield d.step([a] * 5 + [b] * 3, t(1, 2, 3, 4, 5, 6, 7, 8))
    f = d.clone(a)
    yield d.step([a, b, f], t(9, 10, 11))
    d.rm_tail(a, 3)  # a keeps positions 0..2; its cells 3..5 stay owned by f
    yield d.step([a, b, f], t(12, 13, 14), extent="written")
    yield d.step([f, a, b, a], t(15, 16, 17, 18))
    yield d.step([b], t(19))


def run_alone(d, base=0):
    for _ in script(d, base):
        pass
    return d.steps


def assert_matches_oracle(model, d):
    """Replays the driver's log on fresh histories and checks every step's
    output rows against the oracle as the histories stood at that step."""
    replay = Histories()
    for op in d.log:
        if op[0] == "step":
            _, seq_ids, positions, tokens, out = op
            replay.extend(seq_ids, tokens, positions)
            expected = replay.expected(model, seq_ids, positions)
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
        elif op[0] == "clone":
            replay.clone(op[1], op[2])
        else:
            replay.rm_tail(op[1], op[2])
    assert replay.seqs == d.hist.seqs


# ------------------------------------------------------------------ correctness

def test_runtime_matches_eager_and_oracle(model, pte):
    et = Driver(et_forward(pte), model)
    eager = Driver(eager_forward(model), model)
    n = 0
    for _ in zip(script(et), script(eager)):
        (s1, p1, out_et), (s2, p2, out_eager) = et.steps[-1], eager.steps[-1]
        assert (s1, p1) == (s2, p2)
        torch.testing.assert_close(out_et, out_eager, atol=ATOL, rtol=0)
        n += 1
    assert n == 5
    # identical cache decisions on both sides
    assert list(et.cache.cell_positions()) == list(eager.cache.cell_positions())
    assert_matches_oracle(model, et)
    assert_matches_oracle(model, eager)


def test_reference_path_matches_cells_path_and_oracle(model, reference_model, pte,
                                                     reference_pte):
    """The two attention paths, exported from the same weights, agree step by
    step (and with the oracle) on a fragmented cache."""
    cells = Driver(et_forward(pte), model)
    ref = Driver(et_forward(reference_pte), reference_model)
    for _ in zip(script(cells), script(ref)):
        torch.testing.assert_close(cells.steps[-1][2], ref.steps[-1][2], atol=ATOL, rtol=0)
    assert_matches_oracle(model, ref)


def test_eager_matches_oracle_with_second_seed():
    """The oracle against the eager cell-cache path on other weights/windows."""
    m = ToyAttention(N_CELLS, [4, None, 1], seed=1).eval()
    d = Driver(eager_forward(m), m)
    run_alone(d, base=5)
    assert_matches_oracle(m, d)


# ------------------------------------------------------------------ emitted program

def emitted_cache_problems(program, model):
    """Everything in the emitted program that is not an in-place K/V write:
    whole-cache copies (``full_cache_copies``), any ``copy_`` or ``index_put``
    (K/V writes are ``cellcache::write``), a cache-shaped tensor made by
    anything, in the edge graph and in the serialized execution plan. []
    when clean."""
    shapes = cache_shapes(model)
    problems = [f"full_cache_copies: {c}" for c in full_cache_copies(program, shapes)]

    gm = program.exported_program().graph_module
    in_place_writes = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if "copy_" in name or "index_put" in name:
            problems.append(f"graph: {node.name} is {name}")
        if "cellcache.write" in name:
            in_place_writes += 1
        val = node.meta.get("val")
        if (isinstance(val, torch.Tensor) and all(isinstance(x, int) for x in val.shape)
                and tuple(val.shape) in shapes):
            problems.append(f"graph: {node.name} ({name}) makes a cache-shaped tensor")
    if in_place_writes != 2 * model.n_layers:
        problems.append(f"graph: {in_place_writes} cellcache::write nodes, expected "
                        f"{2 * model.n_layers}")

    # The serialized program itself: operators and instructions.
    plan = program.executorch_program.execution_plan[0]
    names = [f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators]
    for n in names:
        if n.startswith(("aten::copy", "aten::index_put")):
            problems.append(f"plan: operator {n}")
    cache_values = set()
    calls = {}

    def is_static_cache(value_index):
        val = plan.values[value_index].val
        return (type(val).__name__ == "Tensor" and tuple(val.sizes) in shapes
                and val.shape_dynamism.name == "STATIC")

    for chain in plan.chains:
        for ins in chain.instructions:
            args = ins.instr_args
            if type(args).__name__ != "KernelCall":
                continue
            op = plan.operators[args.op_index].name
            calls[op] = calls.get(op, 0) + 1
            if op == "cellcache::write":
                # in place: its first argument is a static cache buffer
                if not is_static_cache(args.args[0]):
                    problems.append("plan: a cellcache::write that does not write a cache")
                cache_values.add(args.args[0])
            elif is_static_cache(args.args[-1]):
                # (Dynamic-bound outputs of cache shape are the [:extent]
                # slices attention reads; their size follows the extent.)
                problems.append(f"plan: {op} writes a whole-cache-shaped tensor")
    if calls.get("cellcache::write") != 2 * model.n_layers or \
            len(cache_values) != 2 * model.n_layers:
        problems.append(f"plan: cellcache::write calls {calls.get('cellcache::write')} on "
                        f"{len(cache_values)} buffers, expected {2 * model.n_layers} on as many")
    if calls.get("cellcache::place") != model.n_layers:
        problems.append(f"plan: {calls.get('cellcache::place')} place calls")
    if model.attention == "cells":
        # cellcache::attend reads the caches in place: no mask, no extent slice.
        if calls.get("cellcache::mask") or calls.get("cellcache::attend") != model.n_layers:
            problems.append(f"plan: {calls.get('cellcache::mask')} mask calls, "
                            f"{calls.get('cellcache::attend')} attend calls")
        problems += [f"cache_reads: {r}" for r in cache_reads(program, _is_toy_cache)]
    elif calls.get("cellcache::mask") != len(set(model.windows)):  # one mask per policy
        problems.append(f"plan: {calls.get('cellcache::mask')} mask calls")
    return problems


def _is_toy_cache(name):
    return "_cache_" in name


def test_no_full_cache_copy(model, program):
    assert cache_shapes(model) == {(N_CELLS, model.n_kv, model.head_dim)}
    assert emitted_cache_problems(program, model) == []


def test_reference_path_reads_an_extent_copy(reference_model, reference_program):
    """The reference path is clean of whole-cache copies, but slices each
    layer's cache: the check the cells path must pass can fail."""
    assert emitted_cache_problems(reference_program, reference_model) == []
    reads = cache_reads(reference_program, _is_toy_cache)
    assert len(reads) == 2 * reference_model.n_layers, reads
    assert all("slice" in r for r in reads), reads


# ------------------------------------------------------------------ two caches

def test_two_caches_interleaved(model, pte):
    alone_a = run_alone(Driver(et_forward(pte), model), base=0)
    alone_b = run_alone(Driver(et_forward(pte), model), base=31)
    a = Driver(et_forward(pte), model)
    b = Driver(et_forward(pte), model)
    assert a.cache.handle != b.cache.handle
    for _ in zip(script(a, base=0), script(b, base=31)):
        pass
    for together, alone in ((a.steps, alone_a), (b.steps, alone_b)):
        assert len(together) == len(alone) == 5
        for (s1, p1, o1), (s2, p2, o2) in zip(together, alone):
            assert (s1, p1) == (s2, p2)
            torch.testing.assert_close(o1, o2, atol=1e-6, rtol=0)
    # different tokens, so the two programs really computed different things
    assert not torch.allclose(a.steps[0][2], b.steps[0][2])


# ------------------------------------------------------------------ bad input through the runtime

@pytest.fixture
def et_driver(model, pte):
    d = Driver(et_forward(pte), model)
    s = d.cache.seq_new()
    d.step([s, s], [1, 2])
    return d, s


def test_runtime_undeclared_forward(et_driver):
    d, s = et_driver
    with pytest.raises(StepNotDeclaredError, match=r"layer 0 ran a forward with no declared step \(declare_step before each forward") as info:
        d.forward(d.inputs([3], [2], d.cache.used_end))
    assert isinstance(info.value.__context__, RuntimeError)
    assert d.cache.seq_len(s) == 2  # nothing placed
    d.cache.check_invariants()
    d.step([s], [3])  # still usable


def test_runtime_positions_wrong_dtype(et_driver):
    d, s = et_driver
    assert d.cache.declare_step([s])
    inputs = d.inputs([3], [2], d.cache.planned_used_end)
    inputs[1] = inputs[1].to(torch.int32)
    with pytest.raises(RuntimeError,  # rejected by set_inputs (scalar type mismatch)
                       match=r"set_inputs\(\) for method 'forward' failed with error 0x12"):
        d.forward(inputs)
    assert d.cache.seq_len(s) == 2
    # the declaration still stands: the corrected forward runs
    out = d.forward(d.inputs([3], [2], d.cache.planned_used_end))
    assert out.shape == (1, 32)
    assert d.cache.seq_len(s) == 3


def test_runtime_position_conflict_then_retry(model, et_driver):
    d, s = et_driver
    assert d.cache.declare_step([s])
    with pytest.raises(PositionConflictError, match=r"token 0 \(sequence 0\) at position 1: "
                                                    r"not after position 1 that the sequence "
                                                    r"already holds"):
        d.forward(d.inputs([3], [1], d.cache.planned_used_end))
    d.cache.check_invariants()
    assert d.cache.seq_len(s) == 2
    out = d.forward(d.inputs([3], [2], d.cache.planned_used_end))
    d.hist.extend([s], [3], [2])  # (the fixture's step is in the history already)
    torch.testing.assert_close(out, d.hist.expected(model, [s], [2]), atol=ATOL, rtol=0)


def test_runtime_extent_too_small(reference_model, reference_pte):
    """Only the reference path reads the extent (the cells path reads each
    token's own cells); there, an extent below used_end is refused."""
    d = Driver(et_forward(reference_pte), reference_model)
    s = d.cache.seq_new()
    d.step([s, s], [1, 2])
    assert d.cache.declare_step([s])
    with pytest.raises(InvalidConfigError,
                       match=r"attention extent 2 must lie in \[used_end 3, written_end 3\]"):
        d.forward(d.inputs([3], [2], d.cache.planned_used_end - 1))


def test_runtime_stale_handle(model, pte):
    forward = et_forward(pte)
    c = CellCache(N_CELLS, model.n_layers, model.windows)
    s = c.seq_new()
    assert c.declare_step([s])
    handle = torch.tensor([c.handle], dtype=torch.int64)
    del c
    gc.collect()
    inputs = [torch.tensor([1]), torch.tensor([0]), handle, torch.empty(1, dtype=torch.uint8)]
    with pytest.raises(UnknownCacheError,
                       match=rf"cache handle {int(handle)} names no live CellCache"):
        forward(inputs)
    # the process and other caches are fine
    d = Driver(forward, model)
    d.step([d.cache.seq_new()], [1])
