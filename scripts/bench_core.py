#!/usr/bin/env python
"""Builds and runs the C++ core micro-benchmark (cpp/bench/core_bench.cpp).

    python scripts/bench_core.py [--repeats N] [--build-dir build/bench]

Configures a core-only Release build with Ninja (cmake and ninja from this
interpreter's environment when present, else PATH), builds the
cellcache_core_bench target, runs it and prints its medians as a table.
These are measurements, not tests: nothing here asserts a speed.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        sys.exit(f"bench_core: {name} not found (install it in the venv: pip install {name})")
    return found


def build(build_dir):
    cmake = _tool("cmake")
    env = dict(os.environ)
    env["PATH"] = str(Path(_tool("ninja")).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build_dir), "-DCELLCACHE_CORE_ONLY=ON",
                    "-DCMAKE_BUILD_TYPE=Release", "-G", "Ninja"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(build_dir), "--target", "cellcache_core_bench"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    exe = build_dir / "cpp" / "bench" / "cellcache_core_bench"
    if not exe.exists():
        sys.exit(f"bench_core: built, but {exe} is missing")
    return exe


def run(exe, repeats):
    out = subprocess.run([str(exe), "--repeats", str(repeats)], check=True,
                         capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        name, median, p10, p90, reps, what = line.split("\t")
        rows.append(dict(name=name, median=float(median), p10=float(p10), p90=float(p90),
                         repeats=int(reps), what=what))
    return rows


def print_table(rows):
    w = max(len(r["name"]) for r in rows)
    print(f"{'measurement':<{w}}  {'median us':>11}  {'p10 us':>10}  {'p90 us':>10}  {'n':>4}")
    for r in rows:
        print(f"{r['name']:<{w}}  {r['median']:>11.2f}  {r['p10']:>10.2f}  {r['p90']:>10.2f}"
              f"  {r['repeats']:>4}")
    print()
    for r in rows:
        print(f"  {r['name']}: {r['what']}")
    by = {r["name"]: r["median"] for r in rows}
    pairs = [(k, k.replace("_4096", "_65536")) for k in by if k.endswith("_4096")]
    if pairs:
        print("\ncapacity scaling (median at 65536 cells / at 4096 cells, same cells used):")
        for small, large in pairs:
            if large in by and by[small] > 0:
                print(f"  {small[:-5]}: {by[large] / by[small]:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=101)
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "bench")
    args = ap.parse_args()
    exe = build(args.build_dir.resolve())
    print_table(run(exe, args.repeats))


if __name__ == "__main__":
    main()
