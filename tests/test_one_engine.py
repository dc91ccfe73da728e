"""One engine (issue #47): ``Runner.generate`` and the server step the C++
engine over the program's forward. What Python hands it may fail: a forward,
a mask hook, a text watch or a token callback that raises ends the request
(or the step) with that same exception, and the cache is left as it was
before those requests: what the prefix cache held stays, nothing of theirs
is kept. Programs: conftest.py (the roomy tiny Llama, 256 cells).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import PROMPTS, Req, drive

import executorch_cellcache as ecc
from executorch_cellcache.cache import _core
from executorch_cellcache.runtime.constraints import Constraint
from executorch_cellcache.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow


class Boom(Exception):
    """Raised by the test's callbacks: it must come out of the engine as is."""


@pytest.fixture
def warm(roomy_pte):
    """A Runner whose prefix cache holds one finished request, and what the
    cache looked like then: (runner, free cells, sequences, cached entries)."""
    r = ecc.Runner(roomy_pte)
    r.generate([PROMPTS[1]], 4, stop_on_eos=False)
    return r, r.cache.free_cells, r.cache.n_sequences, r.prefix_cache.seqs()


def _unchanged(warm):
    r, free, seqs, entries = warm
    r.cache.check_invariants()
    assert (r.cache.free_cells, r.cache.n_sequences, r.prefix_cache.seqs()) == \
        (free, seqs, entries)
    assert r.engine.idle and r.engine.live_requests == 0
    # ... and it still serves, from the same cached prefix.
    out = r.generate([PROMPTS[1] + [7]], 3, stop_on_eos=False)
    assert out == ecc.Runner(r.path, prefix_cache=False).generate([PROMPTS[1] + [7]], 3,
                                                                   stop_on_eos=False)


def test_a_token_callback_that_raises_leaves_the_cache_as_before(warm):
    r = warm[0]
    seen = []

    def on_token(prompt, sample, token):
        seen.append(token)
        if len(seen) == 5:
            raise Boom("callback")

    with pytest.raises(Boom, match="callback"):
        r.generate(PROMPTS[2:4], 8, n=2, stop_on_eos=False, on_token=on_token)
    _unchanged(warm)


def test_a_forward_that_raises_ends_the_step_with_its_exception(warm, monkeypatch):
    r = warm[0]
    real, calls = r.step, [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise Boom("forward")
        return real(*args)

    monkeypatch.setattr(r, "step", failing)
    with pytest.raises(Boom, match="forward"):
        r.generate(PROMPTS[2:4], 8, stop_on_eos=False)
    monkeypatch.setattr(r, "step", real)
    _unchanged(warm)


def test_a_text_watch_that_raises_ends_its_step_and_every_running_request(warm):
    """A watch raising inside the commit: every running request ends with
    "error" (its sequences freed, not cached) and step() raises the watch's
    exception; the waiting one stays queued and then runs."""
    r = warm[0]
    calls = [0]

    def ends(sample, token, stop_token):
        calls[0] += 1
        if calls[0] == 3:
            raise Boom("watch")
        return False

    watched = Req(PROMPTS[2], ends=ends, max_new_tokens=8, stop_on_eos=False)
    beside = Req(PROMPTS[3], max_new_tokens=8, stop_on_eos=False)
    watched.submit(r)
    beside.submit(r)
    with pytest.raises(Boom, match="watch"):
        drive(r, {})
    assert [s.finish_reason for s in watched.samples + beside.samples] == ["error", "error"]
    _unchanged(warm)


class _Refusing(Constraint):
    """A constraint whose matcher cannot make a mask (no grammar engine behind it)."""

    def __init__(self):
        pass

    def matcher(self):
        return self

    def initial_mask(self):
        raise Boom("mask")


def test_a_mask_hook_that_raises_ends_the_step_with_its_exception(warm):
    r = warm[0]
    req = Req(PROMPTS[2], max_new_tokens=4, stop_on_eos=False)
    req.id = r.submit(req.prompt, req.params, None,
                      lambda rid, j, reason, usage: req.samples[j].__setattr__(
                          "finish_reason", reason), constraint=_Refusing())
    with pytest.raises(Boom, match="mask"):
        drive(r, {})
    assert req.samples[0].finish_reason == "error"
    _unchanged(warm)


def test_a_mask_that_allows_nothing_is_an_error_not_a_token(warm):
    class Nothing(_Refusing):
        def initial_mask(self):
            return np.zeros(r.info.vocab_size, dtype=bool)

    r = warm[0]
    r.submit(PROMPTS[2], SamplingParams(max_new_tokens=4), None,
             lambda *a: None, constraint=Nothing())
    with pytest.raises(RuntimeError, match="allows no token"):
        drive(r, {})
    _unchanged(warm)


def test_speculation_changes_only_while_no_request_is_live(warm):
    r = warm[0]
    Req(PROMPTS[2], max_new_tokens=4, stop_on_eos=False).submit(r)
    with pytest.raises(ecc.InvalidConfigError, match="no request is live"):
        r.use_speculative("lookup")
    drive(r, {})
    assert r.use_speculative("lookup") >= 1 and r.engine.speculative
    assert r.use_speculative(None) == 0 and not r.engine.speculative


def test_the_typed_bindings_name_what_is_wrong():
    with pytest.raises(ecc.InvalidConfigError, match="speculative method"):
        _core.SpeculativeOptions("guess")
    with pytest.raises(TypeError):
        _core.SamplingParams(n=True)
    with pytest.raises(ecc.InvalidConfigError, match="top_p"):
        _core.SamplingParams(top_p=1.5).validate()


# ---------------------------------------------------------------------- what a fresh reviewer broke


def test_one_generate_at_a_time_per_runner(warm):
    """A second generate (another thread, or a callback of the running one)
    is refused with a clear error instead of stepping the same engine."""
    import threading

    r = warm[0]
    errors, started, release = [], threading.Event(), threading.Event()

    def on_token(prompt, sample, token):
        started.set()
        release.wait(30)

    t = threading.Thread(target=lambda: r.generate([PROMPTS[2]], 4, stop_on_eos=False,
                                                   on_token=on_token))
    t.start()
    assert started.wait(60)
    try:
        with pytest.raises(ecc.InvalidConfigError, match="already running on this Runner"):
            r.generate([PROMPTS[3]], 4)
    finally:
        release.set()
        t.join(60)
    # The thread's call finished and left its prefix; a nested call is refused too.
    after = (r, r.cache.free_cells, r.cache.n_sequences, r.prefix_cache.seqs())

    def nested(prompt, sample, token):
        r.generate([[7]], 2)

    with pytest.raises(ecc.InvalidConfigError, match="already running"):
        r.generate([PROMPTS[2]], 4, on_token=nested)
    _unchanged(after)


def test_abort_is_refused_while_a_step_runs(warm):
    r = warm[0]

    def on_token(prompt, sample, token):
        r.engine.abort()

    with pytest.raises(ecc.InvalidConfigError, match="while a step runs"):
        r.generate([PROMPTS[2]], 4, on_token=on_token)
    _unchanged(warm)


def test_a_grammar_that_fails_ends_only_its_own_request(warm):
    """A matcher refusing the token its own mask allowed (a grammar engine's fault,
    seen with {"$ref": "#"}) ends that request's sample and reports it; the
    request beside it runs to the end with its own tokens."""
    from executorch_cellcache.runtime.constraints import Constraint

    r = warm[0]

    class Refusing:
        complete = False

        def advance(self, token):
            raise RuntimeError(f"the grammar refused token {token}")

    class Broken(Constraint):
        def __init__(self):  # no grammar engine: every token allowed, none accepted
            pass

        def matcher(self):
            return Refusing()

        def initial_mask(self):
            return np.ones(r.info.vocab_size, dtype=bool)

    failed, plain = Req(PROMPTS[2], max_new_tokens=6, stop_on_eos=False), \
        Req(PROMPTS[3], max_new_tokens=6, stop_on_eos=False)
    errors = []
    failed.id = r.submit(failed.prompt, failed.params, None,
                         lambda rid, j, reason, u: setattr(failed.samples[j], "finish_reason",
                                                           reason),
                         constraint=Broken(), on_grammar_error=errors.append)
    plain.submit(r)
    drive(r, {})
    assert errors and "refused token" in errors[0]
    assert failed.samples[0].finish_reason == "stop"
    assert plain.samples[0].finish_reason == "length"
    assert plain.samples[0].tokens == ecc.Runner(r.path, prefix_cache=False).generate(
        [PROMPTS[3]], 6, stop_on_eos=False)[0][0]
    assert r.hooks.watches == {}
    with pytest.raises(ecc.InvalidConfigError, match="compiled grammar"):
        r.submit(PROMPTS[2], SamplingParams(), None, lambda *a: None, constraint="a+")


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=2**31, temperature=1.0), "top_k must be an integer in"),
    (dict(seed=2**64), "seed must be an integer in"),
    (dict(max_new_tokens=2**63), "max_new_tokens must be an integer in"),
])
def test_integers_beyond_the_engines_fields_are_refused_by_name(warm, kwargs, match):
    r = warm[0]
    max_new = kwargs.pop("max_new_tokens", 4)
    with pytest.raises(ecc.InvalidConfigError, match=match):
        r.generate([PROMPTS[2]], max_new, **kwargs)
    _unchanged(warm)


def test_ctrl_c_in_a_draft_models_forward_stops_generate(warm, monkeypatch):
    """KeyboardInterrupt is no draft failure to absorb: it leaves generate."""
    from executorch_cellcache.runtime.runner import Runner
    from spec.speculative import Speculative

    r = warm[0]
    real, calls = Runner._engine_forward, [0]

    def interrupted(self, *args):
        if self.prefix_cache is None:  # the draft's Runner
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(Runner, "_engine_forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        r.generate([PROMPTS[0] * 3], 12, stop_on_eos=False,
                   speculative=Speculative("draft", max_draft=3, draft_model=str(r.path)))
    monkeypatch.setattr(Runner, "_engine_forward", real)
    r.use_speculative(None)
    _unchanged(warm)


def test_the_engine_binding_refuses_what_it_cannot_use():
    """At construction: a forward that is not callable, hooks without the two
    methods, an EOS id outside the vocabulary; at the step: a forward's
    logits of the right size in the wrong shape."""
    from executorch_cellcache import CellCache

    cache = CellCache(32, 1, [None])

    def forward(seq_ids, tokens, positions, logits_for):
        cache.declare_step(list(seq_ids))
        cache.place_step(list(positions), 0)
        return np.zeros((8, len(logits_for)), dtype=np.float32)  # [vocab, rows]: transposed

    with pytest.raises(ecc.InvalidConfigError, match="forward must be callable"):
        _core.Engine(cache, None, 8, 4, [])
    with pytest.raises(ecc.InvalidConfigError, match="callable masks"):
        _core.Engine(cache, forward, 8, 4, [], hooks=object())
    with pytest.raises(ecc.InvalidConfigError, match="EOS id 8 is outside the vocabulary"):
        _core.Engine(cache, forward, 8, 4, [8])
    engine = _core.Engine(cache, forward, 8, 4, [])
    engine.submit([1, 2], _core.SamplingParams(max_new_tokens=2), None, lambda *a: None)
    with pytest.raises(RuntimeError, match=r"in 2 dimensions, expected \[1, 8\]"):
        for _ in range(3):
            engine.step()
    assert engine.idle and cache.n_sequences == 0


def test_mask_values_read_as_numpy_truth():
    """A mask of floats: any nonzero value allows the token (0.5 included)."""
    from executorch_cellcache import CellCache

    cache = CellCache(32, 1, [None])
    vocab = 8

    def forward(seq_ids, tokens, positions, logits_for):
        cache.declare_step(list(seq_ids))
        cache.place_step(list(positions), 0)
        row = np.arange(vocab, dtype=np.float32)  # greedy would take 7
        return np.tile(row, (len(logits_for), 1))

    class Hooks:
        def masks(self, rows):
            m = np.zeros((len(rows), vocab), dtype=np.float32)
            m[:, 3] = 0.5
            return m

        def ends_sample(self, request, sample, token, stop_token):
            return False

    engine = _core.Engine(cache, forward, vocab, 4, [], hooks=Hooks())
    got = []
    engine.submit([1, 2], _core.SamplingParams(max_new_tokens=3),
                  lambda r, s, t, *a: got.append(t), lambda *a: None, constrained=True)
    while engine.step():
        pass
    assert got == [3, 3, 3]


def test_the_stub_declares_every_engine_method_and_type():
    """_core.pyi (what an IDE and a type checker read) names every public
    member of the engine's bound classes, and nothing they lack."""
    import ast

    stub = ast.parse((Path(_core.__file__).with_name("_core.pyi")).read_text())
    declared = {c.name: {n.name for n in c.body if isinstance(n, ast.FunctionDef)} |
                {n.target.id for n in c.body if isinstance(n, ast.AnnAssign)}
                for c in stub.body if isinstance(c, ast.ClassDef)}
    for name in ("Engine", "SamplingParams", "SpeculativeOptions", "Usage", "EngineStats"):
        bound = {m for m in dir(getattr(_core, name)) if not m.startswith("_")}
        assert bound == declared[name] - {"__init__"}, name
    functions = {f.name for f in stub.body if isinstance(f, ast.FunctionDef)}
    assert {"prompt_lookup", "choose_max_draft"} <= functions
