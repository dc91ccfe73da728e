"""The rules written once in the core and bound for Python: the admission
arithmetic (cpp/cellcache/admission.h) and the step-batch checks
(cpp/cellcache/step_batch.h), which Runner.step and the C++ program both
apply. Expected values are worked out by hand from the rules; messages are
compared whole."""

import numpy as np
import pytest

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import CapacityError, InvalidConfigError


# ------------------------------------------------------------------ admission


@pytest.mark.parametrize("prompt_len, cached, n, max_new_tokens, cells", [
    (5, 0, 1, 252, 256),    # 5 + 1 x 251
    (13, 0, 3, 83, 259),    # 13 + 3 x 82
    (13, 8, 3, 83, 251),    # 8 prompt tokens cloned from a cached prefix
    (7, 0, 4, 1, 7),        # one new token per sample: nothing fed back
    (1, 1, 2, 3, 4),        # the whole prompt cached: only the fed-back tokens
])
def test_worst_case_cells(prompt_len, cached, n, max_new_tokens, cells):
    assert _core.request_worst_case_cells(prompt_len, cached, n, max_new_tokens) == cells
    assert _core.request_worst_case_cells(prompt_len=prompt_len, cached=cached, n=n,
                                          max_new_tokens=max_new_tokens) == cells


def test_a_request_that_fits_passes():
    assert _core.check_request_fits("prompt 0", 5, 1, 252, 256) is None
    assert _core.check_request_fits("r", 1, _core.MAX_SEQUENCES, 1, 1) is None


def test_a_request_beyond_the_cells_is_a_capacity_error():
    with pytest.raises(CapacityError) as e:
        _core.check_request_fits("prompt 1", 13, 3, 83, 256)
    assert str(e.value) == (
        "prompt 1 needs up to 259 cells (13 prompt tokens + n=3 samples x 82 generated tokens "
        "fed back) but the cache has 256; lower max_new_tokens (--max-new-tokens) or n (--n), "
        "or export with more cells (--cells)")


def test_a_prompt_longer_than_the_cache_says_so_not_to_lower_the_new_tokens():
    with pytest.raises(CapacityError) as e:
        _core.check_request_fits("prompt 2", 1201, 1, 1, 512)
    assert str(e.value) == ("prompt 2's prompt alone is 1201 tokens but the cache has 512 "
                            "cells; shorten it, or export with more cells (--cells)")


def test_more_samples_than_sequence_ids_is_a_capacity_error():
    n = _core.MAX_SEQUENCES + 1
    with pytest.raises(CapacityError) as e:
        _core.check_request_fits("the request", 1, n, 1, 10**6)
    assert str(e.value) == f"n={n} samples exceed the {_core.MAX_SEQUENCES} sequence ids"


# ------------------------------------------------------------------ step batch


def _refusal(n_seq_ids, tokens, n_positions, logits_for, max_tokens=4, vocab=10):
    with pytest.raises(InvalidConfigError) as e:
        _core.check_step_batch(n_seq_ids, tokens, n_positions, logits_for, max_tokens, vocab)
    return str(e.value)


def test_a_well_formed_step_passes():
    assert _core.check_step_batch(3, [0, 5, 9], 3, [2], 4, 10) is None
    assert _core.check_step_batch(4, np.array([1, 2, 3, 4]), 4, np.arange(4), 4, 10) is None


def test_step_lengths_must_agree():
    assert _refusal(2, [5, 6, 7], 3, [2]) == \
        "seq_ids (2), tokens (3) and positions (3) must have one entry per token"
    assert _refusal(3, [5, 6, 7], 2, [2]) == \
        "seq_ids (3), tokens (3) and positions (2) must have one entry per token"


def test_step_size_within_the_budget():
    assert _refusal(0, [], 0, [0]) == "a step carries 1 to 4 tokens, got 0"
    assert _refusal(5, [1] * 5, 5, [0]) == "a step carries 1 to 4 tokens, got 5"


@pytest.mark.parametrize("logits_for", [[], [2], [-1], [0, 1, 1]])
def test_logits_rows_index_the_step(logits_for):
    assert _refusal(2, [5, 6], 2, logits_for) == \
        f"logits_for must hold 1 to 2 token indices in [0, 2), got {logits_for}"


def test_tokens_outside_the_vocabulary_are_named_first_five():
    assert _refusal(2, [5, 10], 2, [1]) == \
        "tokens: token ids [10] are outside the vocabulary [0, 10)"
    assert _refusal(7, [10, -1, 12, 13, 14, 15, 16], 7, [0], max_tokens=8) == \
        "tokens: token ids [10, -1, 12, 13, 14] are outside the vocabulary [0, 10)"


def test_the_rules_are_checked_in_order():
    assert _refusal(1, [99] * 5, 2, [7]).startswith("seq_ids (1)")
    assert _refusal(5, [99] * 5, 5, [7]).startswith("a step carries")
    assert _refusal(3, [99] * 3, 3, [7]).startswith("logits_for")


def test_non_integer_tokens_are_a_type_error():
    with pytest.raises(TypeError, match="tokens must hold integers"):
        _core.check_step_batch(1, [1.5], 1, [0], 4, 10)
