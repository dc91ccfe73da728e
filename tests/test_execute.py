"""runtime.execute: the forward runs with PyTorch at one intra-op thread and
the caller's thread count comes back, also when the forward raises."""

import pytest
import torch

from executorch_cellcache.runtime.execute import execute


class _Method:
    def __init__(self, fail=False):
        self.seen, self.fail = None, fail

    def execute(self, inputs):
        self.seen = torch.get_num_threads()
        if self.fail:
            raise RuntimeError("forward failed")
        return [inputs[0] * 2]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_forward_runs_on_one_torch_thread_and_restores(two_threads):
    m = _Method()
    out = execute(m, [torch.ones(3)])
    assert m.seen == 1
    assert torch.get_num_threads() == 2
    torch.testing.assert_close(out[0], torch.full((3,), 2.0))


def test_thread_count_restored_when_the_forward_raises(two_threads):
    with pytest.raises(RuntimeError, match="forward failed"):
        execute(_Method(fail=True), [torch.ones(1)])
    assert torch.get_num_threads() == 2
