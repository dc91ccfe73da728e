"""The prefix-cache row of `cellcache bench` alone (SPEC section 9): time to
first token of a request sharing a system prompt with an earlier one, cached
vs cold, and the cells 8 two-turn chat sessions sharing it hold vs 8 private
copies. Uses the bench's own program (exported once and cached under
~/.cache/executorch-cellcache/bench, the same file `cellcache bench` uses).

    python scripts/bench_prefix_cache.py [--quick] [--cache-dir DIR]
"""

import argparse
import os
import sys
from pathlib import Path

from executorch_cellcache.bench.common import FULL, QUICK, ProgramCache
from executorch_cellcache.bench.ours import main_program
from executorch_cellcache.bench.prefix import chat_session_cells, prefix_ttft
from executorch_cellcache.runtime.runner import Runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny bench model")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where exported programs are cached (as cellcache bench)")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    cache_dir = args.cache_dir or Path(os.environ.get(
        "CELLCACHE_BENCH_CACHE", Path.home() / ".cache" / "executorch-cellcache"))

    def say(line):
        print(line, file=sys.stderr)
    programs = ProgramCache(cache_dir / "bench", say)
    path, _ = main_program(setup, programs, say)  # the bench's main program
    runner = Runner(path)
    f = prefix_ttft(runner, setup)
    f.update(chat_session_cells(runner, setup))
    print(f"system prompt {setup.prefix_len} tokens, {setup.n_cells} cells, "
          f"{setup.prefill_len} tokens per step")
    print(f"time to first token: cold {f['prefix_ttft_cold_seconds'] * 1e3:.1f} ms, cached "
          f"{f['prefix_ttft_cached_seconds'] * 1e3:.1f} ms, ratio "
          f"{f['prefix_ttft_cached_seconds'] / f['prefix_ttft_cold_seconds']:.3f} "
          f"(target <= 0.1)")
    print(f"8 chat sessions: {f['chat_sessions_cells']:.0f} cells held vs "
          f"{f['chat_sessions_private_cells']:.0f} for private copies, ratio "
          f"{f['chat_sessions_cells'] / f['chat_sessions_private_cells']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
