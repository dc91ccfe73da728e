"""Runs the shared core cases (tests/cases/core/*.json) against CellCache.

Case format (copied from /work/shared/cases/core):

- ``config``: ``n_cells``, ``windows`` (``null`` = full causal), optional ``n_layers``.
- ``expect_config_error``: the config itself must be refused (InvalidConfigError).
- ``steps``: run in order. ``op`` names a verb or query of CellCache; its arguments
  are the other keys (``seq``/``src``/``seqs`` hold a name bound by an earlier ``as``
  or a literal id). ``as`` binds the returned sequence id to a name, ``expect`` is
  the return value, ``expect_error`` the exception class name, and
  ``expect_attends`` lists, per token of a placed step, the positions of the cells
  its mask lets it attend (compared as sorted lists; cell indices are free).

check_invariants() runs after every step, failed ones included.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from missing import missing

sys.path.insert(0, str(Path(__file__).parent))

from core_errors import MESSAGES

import executorch_cellcache as ecc
from executorch_cellcache import CellCache, InvalidConfigError

CASES_DIR = Path(__file__).parent / "cases" / "core"
# The shared case suite this copy must equal: ../shared next to the project root.
SHARED_CASES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "cases" / "core"
CASE_FILES = sorted(p.name for p in CASES_DIR.glob("*.json"))

# Keys of a step that are not arguments of the verb.
_META = {"op", "as", "expect", "expect_error", "expect_attends"}


def _load(name):
    with open(CASES_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def _make(config):
    return CellCache(config["n_cells"], n_layers=config.get("n_layers"),
                     windows=config.get("windows", [None]))


def _id(names, ref):
    """A sequence reference of a case: a name bound by `as`, or a literal id."""
    if isinstance(ref, str):
        assert ref in names, f"case refers to unbound sequence name {ref!r}"
        return names[ref]
    return ref


def _attended(cache, placed):
    """Per token: sorted positions of the cells its mask row lets it attend."""
    pos = cache.cell_positions()
    mask = np.asarray(placed.mask)
    return [sorted(int(pos[j]) for j in np.flatnonzero(row)) for row in mask]


def _call(cache, names, step):
    op = step["op"]
    args = {k: v for k, v in step.items() if k not in _META}
    if op == "seq_new":
        return cache.seq_new()
    if op == "seq_clone":
        return cache.seq_clone(_id(names, args["src"]), upto=args.get("upto"))
    if op == "seq_rm":
        return cache.seq_rm(_id(names, args["seq"]), p0=args.get("p0", 0), p1=args.get("p1"))
    if op == "seq_free":
        return cache.seq_free(_id(names, args["seq"]))
    if op == "clear":
        return cache.clear()
    if op in ("next_pos", "seq_len"):
        return getattr(cache, op)(_id(names, args["seq"]))
    if op == "can_extend":
        return cache.can_extend(args["n"])
    if op in ("free_cells", "used_end", "capacity", "n_layers"):
        return getattr(cache, op)
    if op == "declare_step":
        return cache.declare_step([_id(names, s) for s in args["seqs"]])
    if op == "place_step":
        return cache.place_step(args["positions"], layer=args["layer"])
    raise AssertionError(f"unknown op {op!r} in case step {step}")


def test_every_case_file_is_collected():
    assert CASE_FILES, f"no case files in {CASES_DIR}"
    on_disk = sorted(p.name for p in CASES_DIR.iterdir() if p.is_file())
    assert CASE_FILES == on_disk, "a non-JSON file in the cases directory would be skipped"


def test_the_case_files_equal_the_shared_suite():
    """The tests' copy must not drift from the shared cases (byte for byte).
    Without ../shared this is skipped on a developer's machine and fails in CI
    (``CI`` set, as .ci/run does)."""
    if not SHARED_CASES_DIR.is_dir():
        message = f"the shared case suite {SHARED_CASES_DIR} is missing"
        missing(message)
    shared = sorted(p.name for p in SHARED_CASES_DIR.glob("*.json"))
    assert CASE_FILES == shared
    for name in CASE_FILES:
        assert (CASES_DIR / name).read_bytes() == (SHARED_CASES_DIR / name).read_bytes(), name


@pytest.mark.parametrize("name", CASE_FILES)
def test_core_case(name):
    case = _load(name)
    config = case["config"]
    if case.get("expect_config_error"):
        with pytest.raises(InvalidConfigError, match=MESSAGES["InvalidConfigError"]):
            _make(config)
        assert not case.get("steps"), "a case with a refused config has no steps to run"
        return
    cache = _make(config)
    cache.check_invariants()
    names = {}
    for i, step in enumerate(case["steps"]):
        where = f"{name} step {i} ({step['op']})"
        if "expect_error" in step:
            cls = getattr(ecc, step["expect_error"])
            with pytest.raises(cls, match=MESSAGES[step["expect_error"]]):
                _call(cache, names, step)
        else:
            result = _call(cache, names, step)
            if "as" in step:
                names[step["as"]] = result
            if "expect" in step:
                assert result == step["expect"], f"{where}: got {result!r}"
            if "expect_attends" in step:
                assert _attended(cache, result) == [sorted(r) for r in step["expect_attends"]], \
                    where
        cache.check_invariants()
