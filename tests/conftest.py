"""Fixtures shared by several test modules."""

import pytest

DEFAULT_CELLS = 512
DEFAULT_STEP = 32


@pytest.fixture(scope="session")
def default_pte(tmp_path_factory):
    """The embedded default model (trained, BPE tokenizer) exported once per session:
    512 cells, 32 tokens per step."""
    import executorch_cellcache as ecc

    path = tmp_path_factory.mktemp("default_program") / "default.pte"
    ecc.export(None, path, n_cells=DEFAULT_CELLS, max_tokens_per_step=DEFAULT_STEP)
    return path
