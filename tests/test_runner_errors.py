"""Runner construction and generate's argument checks: missing and foreign
files, bad prefix-cache settings, bad prompts and sampling parameters, and
requests the cache can never hold; each error leaves the runner working.

Programs, prompts and helpers: conftest.py and tests/runner_support.py.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from runner_support import CELLS, PROMPTS, still_works

import executorch_cellcache as ecc
from executorch_cellcache import CapacityError, InvalidConfigError

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- construction


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.pte does not exist"):
        ecc.Runner(tmp_path / "missing.pte")
    text = tmp_path / "notes.pte"
    text.write_text("not an ExecuTorch program\n" * 10)
    with pytest.raises(InvalidConfigError, match="not a loadable ExecuTorch program"):
        ecc.Runner(text)
    with pytest.raises(InvalidConfigError, match="folder"):
        ecc.Runner(tmp_path)
    # Non-UTF-8 bytes where the program identifier goes once aborted the process
    # (the runtime logs the identifier raw).
    garbage = tmp_path / "garbage.pte"
    garbage.write_bytes(b"\0" * 4 + b"\xff" * 4 + b"\0" * 56)
    with pytest.raises(InvalidConfigError, match="not a loadable ExecuTorch program"):
        ecc.Runner(garbage)

    from executorch.exir import to_edge

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    program = to_edge(torch.export.export(Plain(), (torch.ones(3),))).to_executorch()
    plain = tmp_path / "plain.pte"
    plain.write_bytes(program.buffer)
    with pytest.raises(InvalidConfigError, match="no cell-cache metadata"):
        ecc.Runner(plain)


def test_prefix_cache_bound_out_of_range_is_refused(roomy_pte):
    for bad in (CELLS + 1, -1, 2.5):
        with pytest.raises(InvalidConfigError, match=rf"prefix_cache_cells must be an integer "
                                                     rf"in \[0, {CELLS}\].*got {bad}"):
            ecc.Runner(roomy_pte, prefix_cache_cells=bad)
    with pytest.raises(InvalidConfigError, match="prefix_cache=False turns off"):
        ecc.Runner(roomy_pte, prefix_cache=False, prefix_cache_cells=8)
    with pytest.raises(InvalidConfigError, match="prefix_cache must be True or False"):
        ecc.Runner(roomy_pte, prefix_cache="no")


# --------------------------------------------------------------------------- generate's arguments


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([[]], {}, "prompt 0 is empty"),
    ([[5, 6], []], {}, "prompt 1 is empty"),
    ([[5, 6]], {"n": 0}, "n must be"),
    ([[5, 6]], {"n": -1}, "n must be"),
    ([[5, 6]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[5, 320]], {}, r"outside the vocabulary \[0, 320\)"),
    ([[-1, 6]], {}, "outside the vocabulary"),
    ([[5, 6]], {"temperature": -0.5}, "temperature"),
    ([[5, 6]], {"temperature": 0.8, "top_p": 0.0}, "top_p"),
    ([[5, 6]], {"temperature": 0.8, "top_k": 0}, "top_k"),
], ids=["empty", "empty-second", "n0", "n-neg", "max-new-0", "vocab-high", "vocab-neg",
        "temperature", "top-p", "top-k"])
def test_generate_bad_arguments(runner, baseline, prompts, kwargs, match):
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(InvalidConfigError, match=match):
        runner.generate(prompts, **args)
    still_works(runner, baseline)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=1.0, seed=-1), "seed"), (dict(temperature=1.0, seed=1.5), "seed"),
    (dict(temperature=1.0, seed="a"), "seed"), (dict(temperature=1.0, top_k=2.5), "top_k"),
    (dict(temperature="1"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(temperature=1.0, top_p="0.5"), "top_p"),
])
def test_bad_sampling_parameters_are_refused_before_any_forward(runner, kwargs, name):
    free = runner.cache.free_cells
    with pytest.raises(InvalidConfigError, match=name):
        runner.generate(PROMPTS[:1], max_new_tokens=4, **kwargs)
    assert runner.cache.free_cells == free and runner.cache.n_sequences == 0


def test_request_that_can_never_fit(runner, baseline):
    # 5 prompt tokens + 1 x 252 generated = 257 > 256 cells.
    with pytest.raises(CapacityError, match=r"257 cells.*256"):
        runner.generate([PROMPTS[0]], max_new_tokens=253)
    # n multiplies the generated part; prompt 0 fits (5 + 3 x 82 = 251), prompt 1
    # (13 + 3 x 82 = 259) never can: nothing runs.
    with pytest.raises(CapacityError, match=r"prompt 1 needs up to 259 cells.*256"):
        runner.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=83, n=3)
    still_works(runner, baseline)
    # The largest request that fits runs.
    [[out]] = runner.generate([PROMPTS[0]], max_new_tokens=252, stop_on_eos=False)
    assert len(out) == 252
    assert runner.last_stats.peak_cells == 256
    still_works(runner, baseline)
