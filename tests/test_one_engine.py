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


class _Refusing:
    """A constraint whose matcher cannot make a mask (runtime/constraints.py's
    shape: matcher(), initial_mask())."""

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
