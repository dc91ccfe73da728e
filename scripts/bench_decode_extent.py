"""Decode-step time vs. cache capacity at a fixed used extent.

Exports the toy attention model of tests/toy_attention.py (hidden 256,
4 layers, GQA 8/4 heads, mixed windows) twice, with n_cells=256 and
n_cells=4096, fills ~128 cells of one sequence in each, then times one decode
step (declare_step + execute) with the same used extent. Each repeat removes
the decoded token again (seq_rm), so every timed step sees the same extent.
Prints the medians and their ratio; work should follow the used extent, not
the capacity, so the ratio should be about 1 (SPEC section 5: <= 1.2x).

    python scripts/bench_decode_extent.py [--repeats 30] [--used 128]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from executorch_cellcache.cache import CellCache, _core  # noqa: E402
from executorch_cellcache.exporting.lowering import lower  # noqa: E402
from toy_attention import ToyAttention, dynamic_shapes, example_inputs  # noqa: E402

WINDOWS = [None, 64, None, 16]
SHAPE = dict(vocab=256, hidden=256, n_heads=8, n_kv=4, head_dim=32)
MAX_TOKENS = 64


def export(n_cells: int, folder: Path) -> Path:
    model = ToyAttention(n_cells, WINDOWS, seed=0, **SHAPE).eval()
    t0 = time.perf_counter()
    program = lower(model, example_inputs(), dynamic_shapes(n_cells, MAX_TOKENS))
    path = folder / f"toy_{n_cells}.pte"
    path.write_bytes(program.buffer)
    print(f"exported n_cells={n_cells} in {time.perf_counter() - t0:.1f} s "
          f"({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    return path


def time_decode(path: Path, n_cells: int, used: int, warmup: int, repeats: int):
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(path)).load_method("forward")
    cache = CellCache(n_cells, len(WINDOWS), WINDOWS)
    handle = torch.tensor([cache.handle], dtype=torch.int64)
    s = cache.seq_new()

    def run(tokens, positions):
        _core.clear_last_op_error()
        try:
            return method.execute([
                torch.tensor(tokens, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64), handle,
                torch.empty(cache.planned_used_end, dtype=torch.uint8)])[0]
        except RuntimeError:
            _core.raise_last_op_error()
            raise

    prompt = used - 1  # the decoded token makes `used`
    for start in range(0, prompt, MAX_TOKENS):
        n = min(MAX_TOKENS, prompt - start)
        assert cache.declare_step([s] * n)
        run([(start + i) % SHAPE["vocab"] for i in range(n)], list(range(start, start + n)))

    times = []
    for i in range(warmup + repeats):
        assert cache.declare_step([s])
        extent = cache.planned_used_end
        t0 = time.perf_counter()
        run([7], [prompt])
        dt = time.perf_counter() - t0
        assert extent == used, (extent, used)
        cache.seq_rm(s, prompt)  # back to the same used extent for the next repeat
        if i >= warmup:
            times.append(dt)
    return statistics.median(times), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--used", type=int, default=128)
    ap.add_argument("--cells", type=int, nargs=2, default=[256, 4096])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {n: export(n, Path(tmp)) for n in args.cells}
        results = {}
        # Alternate the two programs twice so drift in this machine's CPU
        # capacity hits both alike; report the median over both rounds.
        for _round in range(2):
            for n in args.cells:
                _, times = time_decode(paths[n], n, args.used, args.warmup, args.repeats)
                results.setdefault(n, []).extend(times)
    small, large = args.cells
    m_small = statistics.median(results[small])
    m_large = statistics.median(results[large])
    print(f"decode step, {args.used} cells used, median of {len(results[small])} repeats:")
    print(f"  n_cells={small:5d}: {m_small * 1e3:8.3f} ms")
    print(f"  n_cells={large:5d}: {m_large * 1e3:8.3f} ms")
    print(f"  ratio {large}/{small}: {m_large / m_small:.3f}")


if __name__ == "__main__":
    main()
