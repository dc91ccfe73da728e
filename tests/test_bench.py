"""`cellcache bench --quick` keeps working: every key of the JSON, finite
figures, a plot, a second run that reuses the cached programs, and the
quantized table (`--quantize`), which exports only our quantized program.
--quick skips ExecuTorch's export_llm (its export takes minutes) and says so."""

import json
import math

import pytest
import torch

from executorch_cellcache import bench, cli
from executorch_cellcache.bench import prefix

KEYS = ["b1_vs_stock", "b8_over_b1", "prefill_vs_stock", "fork_cells_ratio",
        "prefix_ttft_ratio", "chat_cells_ratio", "cache_ops_share", "used_extent_ratio",
        "b1_bandwidth_fraction", "export_time_vs_stock", "long_b8_cells_vs_reference",
        "long_b1_cells_vs_reference", "long_one_among_7_vs_alone",
        "long_b8_fp16_cells_vs_reference", "long_b8_fp16_vs_fp32_cells",
        "long_b8_int8_vs_fp16_cells", "long_b1_int8_vs_fp16_cells", "kv_bytes_int8_vs_fp16"]
LONG_KEYS = [k for k in KEYS if k.startswith(("long_", "kv_"))]

pytestmark = pytest.mark.slow


def test_quick_bench_writes_every_figure_and_reuses_cached_programs(tmp_path, monkeypatch,
                                                                   capsys):
    out, png, cache = tmp_path / "b.json", tmp_path / "b.png", tmp_path / "cache"
    args = ["bench", "--quick", "--json", str(out), "--plot", str(png), "--cache-dir", str(cache)]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    data = json.loads(out.read_text())
    for key in KEYS:
        assert key in table
        assert math.isfinite(data[key]) and data[key] > 0, key
    # Sharing the prompt's cells: 4 samples of a 32-token prompt with 8 new tokens
    # hold the prompt once (32 + 4 * 7 cells), not four times.
    q = bench.QUICK
    assert data["figures"]["ours_fork_peak_cells"] == \
        q.prefill_len + q.fork_n * (q.fork_new_tokens - 1)
    # Eight two-turn chats sharing one system prompt hold it once: each session adds
    # its two user turns and replies (the last reply token is never fed back).
    own = 2 * prefix.USER_TOKENS + 2 * prefix.REPLY_TOKENS - 1
    assert data["figures"]["chat_sessions_cells"] == q.prefix_len + prefix.SESSIONS * own
    assert data["figures"]["chat_sessions_private_cells"] == prefix.SESSIONS * (q.prefix_len + own)
    assert png.stat().st_size > 0
    # ours, its small-cache twin, stock, the long-context cells/reference x fp32/fp16
    # and cells x int8
    assert len(list((cache / "bench").glob("*.pte"))) == 8
    # A cell's K and V over all layers (docs/sizing-and-limits.md): values x bytes, int8 one
    # fp32 scale per KV head.
    m = q.model
    heads, head_dim = m["num_key_value_heads"], m["hidden_size"] // m["num_attention_heads"]
    per_layer = 2 * heads * m["num_hidden_layers"]
    assert data["figures"]["kv_bytes_per_cell_fp32"] == per_layer * head_dim * 4
    assert data["figures"]["kv_bytes_per_cell_fp16"] == per_layer * head_dim * 2
    assert data["figures"]["kv_bytes_per_cell_int8"] == per_layer * (head_dim + 4)

    def no_export(*_args, **_kwargs):
        raise AssertionError("a warm cache must not export again")

    assert "note: export_llm rows skipped in --quick" in table
    assert data["figures"]["bandwidth_bytes_s"] > 1e8

    # The quantized table: ours 8da4w vs ours fp32 (cached) on the same machine.
    qout = tmp_path / "q.json"
    assert cli.main(["bench", "--quick", "--quantize", "8da4w", "--embedding-quantize", "8",
                     "--json", str(qout), "--cache-dir", str(cache)]) == 0
    qtable = capsys.readouterr().out
    qdata = json.loads(qout.read_text())
    for key in ("b1_vs_ours_fp32", "pte_vs_ours_fp32", "b8_over_b1", "fork_cells_ratio"):
        assert key in qtable and math.isfinite(qdata[key]) and qdata[key] > 0, key
    assert "b1_vs_stock" not in qdata  # the static-cache recipe is fp32 only
    assert qdata["pte_vs_ours_fp32"] < 1.0
    # the eight above plus ours 8da4w; the fp32 programs are reused
    assert len(list((cache / "bench").glob("*.pte"))) == 9

    # --long-context: only the long-context rows, from the programs cached above (a warm
    # cache exports nothing; the quantized run above already reused ours fp32).
    monkeypatch.setattr("executorch_cellcache.exporting.exporter.export", no_export)
    monkeypatch.setattr("executorch_cellcache.exporting.lowering.lower_exported", no_export)
    lout = tmp_path / "long.json"
    assert cli.main(["bench", "--quick", "--long-context", "--json", str(lout),
                     "--cache-dir", str(cache)]) == 0
    ltable, lerr = capsys.readouterr()
    assert "using cached" in lerr
    ldata = json.loads(lout.read_text())
    for key in LONG_KEYS:
        assert key in ltable and math.isfinite(ldata[key]) and ldata[key] > 0, key
    assert "b8_over_b1" not in ldata


@pytest.mark.parametrize("flags, message", [
    (["--speculative"], "--long-context and --speculative"),
    (["--quantize", "8da4w"], "--long-context measures fp32-weight programs"),
    (["--embedding-quantize", "8"], "--long-context measures fp32-weight programs"),
    (["--plot", "x.png"], "--long-context has no plot"),
])
def test_long_context_refuses_options_it_does_not_measure(flags, message, tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--long-context", *flags,
                     "--cache-dir", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "bench").exists()  # refused before any export


@pytest.mark.parametrize("flags, message", [
    (["--verify-program", "v.pte"], "--verify-program is the program of --speculative's verify "
                                    "cost; give --speculative"),
    (["--speculative", "--verify-program", "missing.pte"],
     "--verify-program missing.pte does not exist"),
])
def test_verify_program_is_checked_before_any_work(flags, message, tmp_path, capsys):
    assert cli.main(["bench", "--quick", *flags, "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "bench").exists()


def test_program_cache_reexports_ours_when_the_exporter_changes(tmp_path, monkeypatch):
    """A cached program of ours is stale once the code that exports it
    changes (graph/, exporting/, the op schemas); export_llm's is not."""
    from executorch_cellcache.bench import common

    built = []

    def build(path):
        built.append(path.name)
        path.write_bytes(b"pte")
        return 1.0

    cache = common.ProgramCache(tmp_path, lambda msg: None)
    setup = common.QUICK
    for digest in ("a", "a", "b"):
        monkeypatch.setattr(common, "_exporter_digest", lambda: digest)
        cache.get("ours", setup, {"n_cells": 8}, build)
        cache.get("export_llm", setup, {"n_cells": 8}, build)
    assert [name.split("-")[0] for name in built] == ["ours", "export_llm", "ours"]
    assert built[0] != built[2]
    # The digest reads the real sources: editing one changes it.
    monkeypatch.undo()
    before = common._exporter_digest()
    source = tmp_path / "graph"
    source.mkdir()
    (source / "x.py").write_text("x = 1\n")
    monkeypatch.setattr(common, "_PACKAGE_DIR", tmp_path)
    one = common._exporter_digest()
    (source / "x.py").write_text("x = 2\n")
    assert common._exporter_digest() not in (one, before)


@pytest.mark.parametrize("spec", ["8", "4,32", None])
def test_bytes_read_per_token_leaves_out_the_embedding_table_stored_apart(spec):
    """The oracle: the table's bytes as torchao stores the quantized (or fp32)
    embedding of the bench model, its values packed to their bits."""
    import copy

    from executorch_cellcache.bench.common import QUICK, bench_model, bytes_read_per_token
    from executorch_cellcache.exporting import quantize as quantization

    model = copy.deepcopy(bench_model(QUICK))
    table = model.get_input_embeddings().weight.numel() * 4
    if spec is not None:
        options = quantization.check_options(None, embedding_quantize=spec)
        with torch.no_grad():
            quantization.apply(model, quantization.plan(model, options))
        w = model.get_input_embeddings().weight
        table = w.qdata.numel() * options.embedding.bits // 8 + w.scale.numel() * 4
    row = table // QUICK.model["vocab_size"]
    pte = 10_000_000
    assert bytes_read_per_token(pte, QUICK, "8da4w", spec) == pte - table + row
    # fp32, tied: lm_head reads the table every token
    assert bytes_read_per_token(pte, QUICK, None, None) == pte
