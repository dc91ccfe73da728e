"""``cellcache bench``: the performance table (ours against ExecuTorch's
export_llm, the static-cache export, transformers and optionally llama.cpp),
or a user's model, long-context or speculative rows only."""

import sys
from pathlib import Path

from executorch_cellcache.cli.extras import require_module
from executorch_cellcache.cli.options import add_quantize_options, add_threads_option


def add_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", help="the performance table (ours vs ExecuTorch's export_llm, the "
                      "static-cache export and transformers)",
        description="Measure, side by side in one run, our cell-cache program, ExecuTorch's "
                    "own LLM flow (export_llm: KV cache + custom SDPA, XNNPACK) at the same "
                    "quantization, the static-cache ExecuTorch export and transformers eager "
                    "on a SmolLM-135M-shaped Llama (random weights): decode tokens/s at 1-8 "
                    "sequences, prefill, fork cell sharing, cache-op share, used-extent "
                    "scaling, bandwidth bound, .pte size, export time, and long-context decode "
                    "(8 x 2048 tokens) on the cells attention path against the dense-mask "
                    "path, fp32, fp16 and int8 K/V with their cache bytes per cell; with "
                    "--llama-cpp, llama.cpp on the same weights too. Exported "
                    "programs are cached on disk; a cold run exports about ten programs (over "
                    "an hour on 2 cores). With --model, your own model instead: decode "
                    "tokens/s at B=1 and B=8 after 128-token prompts and the prefill of a "
                    "512-token prompt only (with --llama-cpp, llama.cpp on the same weights "
                    "alongside).")
    bench.add_argument("--model", metavar="CHECKPOINT",
                       help="benchmark this model instead of the bench's random one: what "
                            "`cellcache export --model` takes (a Hugging Face checkpoint "
                            "folder, a .gguf file, or a packaged model: smollm2), exported "
                            "once at --quantize/--embedding-quantize (2048 cells, 512-token "
                            "steps) and cached by path, mtime and size; or a cell-cache .pte, "
                            "measured as it is. Only decode at B=1 and B=8 and prefill are "
                            "measured: the other rows need the bench's own model. With "
                            "--llama-cpp, llama.cpp runs a .gguf checkpoint's own file; a "
                            "plain Llama checkpoint folder's weights are written to GGUF as "
                            "for the bench model; other folders and a .pte are refused")
    bench.add_argument("--quick", action="store_true",
                       help="a tiny model and one repeat (checks the command works); with "
                            "--model: 16-token prompts, a 32-token prefill, one repeat")
    bench.add_argument("--speculative", action="store_true",
                       help="only speculative decoding's figures: the verify cost of k = 1..9 "
                            "tokens per sequence on the bench program (at --quantize), and "
                            "plain vs prompt lookup vs a draft model on the default model's "
                            "copy task (held-out passages it repeats), B=1 and B=8")
    bench.add_argument("--verify-program", metavar="P.pte",
                       help="with --speculative: measure the verify cost on this cell-cache "
                            "program instead of exporting the bench's 135M one (minutes to "
                            "an hour cold)")
    bench.add_argument("--long-context", action="store_true",
                       help="only the long-context rows (fp32 weights): decode with 8 x 2048 "
                            "tokens in the pool on the cells path vs the dense-mask path (fp32 "
                            "and fp16 K/V), one sequence among 7 vs alone, and fp32 / fp16 / "
                            "int8 K/V taking turns on the cells path at B=1 and B=8, with the "
                            "K/V bytes per cell")
    add_quantize_options(bench)
    bench.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    bench.add_argument("--plot", metavar="OUT.png",
                       help="plot tokens/s against batch size and the used-extent steps")
    bench.add_argument("--cache-dir", metavar="DIR",
                       help="where exported programs are cached (default "
                            "~/.cache/executorch-cellcache or $CELLCACHE_BENCH_CACHE)")
    bench.add_argument("--llama-cpp", metavar="PATH",
                       help="also measure llama.cpp: PATH is its llama-batched-bench (or the "
                            "build directory holding it in bin/). The bench model's weights "
                            "are written to GGUF (cached with the programs; Q4_0 for 8da4w, "
                            "Q8_0 for 8da8w, F32 for fp32; the embedding as "
                            "--embedding-quantize) and llama-batched-bench runs B=1 and B=8 "
                            "decode after the same prompts and the same prefill as ours, with "
                            "as many threads, taking turns with ours round by round; the "
                            "table gets its rows and ours/llama.cpp ratios. A missing or "
                            "wrong binary, or a run that fails, prints one line and the rest "
                            "of the bench runs with those rows marked missing. With --model: "
                            "llama.cpp runs that model's weights (see --model)")
    add_threads_option(bench, "; PyTorch's threads too (the transformers eager row)")
    bench.set_defaults(run=run)


def run(args) -> int:
    if args.model is not None and (args.long_context or args.speculative):  # before any work
        raise ValueError("--model measures decode and prefill of your model; --long-context "
                         "and --speculative measure the bench's own model: leave them out")
    if args.verify_program:  # before any work
        if not args.speculative:
            raise ValueError("--verify-program is the program of --speculative's verify cost; "
                             "give --speculative")
        if not Path(args.verify_program).is_file():
            raise FileNotFoundError(f"--verify-program {args.verify_program} does not exist")
    if args.long_context:  # before any work
        if args.speculative:
            raise ValueError("--long-context and --speculative each run only their own rows; "
                             "pass one of them")
        if args.quantize or args.embedding_quantize:
            raise ValueError("--long-context measures fp32-weight programs; leave out "
                             "--quantize and --embedding-quantize")
        if args.plot:
            raise ValueError("--plot draws the main table; --long-context has no plot")
    if args.llama_cpp and (args.long_context or args.speculative):
        raise ValueError("--llama-cpp adds rows to the main table; leave out --long-context "
                         "and --speculative")
    if args.plot:  # before any work (and before importing the bench)
        require_module("matplotlib")
    if args.llama_cpp:
        require_module("gguf")
    from executorch_cellcache import bench

    from executorch_cellcache.exporting.quantize import check_options

    check_options(args.quantize, args.group_size, args.embedding_quantize)  # before any work
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    quant = bench.Quantization(args.quantize, args.group_size, args.embedding_quantize)
    if args.speculative:
        return _bench_speculative(args, bench, quant)
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.long_context:
        result = bench.run_long_context(quick=args.quick, cache_dir=args.cache_dir, say=say)
    elif args.model is not None:
        result = bench.run_model(args.model, quick=args.quick, cache_dir=args.cache_dir,
                                 say=say, quant=quant, llama_cpp=args.llama_cpp)
    else:
        result = bench.run(quick=args.quick, cache_dir=args.cache_dir, say=say, quant=quant,
                           llama_cpp=args.llama_cpp)
    print(bench.table(result))
    if args.json:
        bench.write_json(result, Path(args.json))
    if args.plot:
        setup = bench.QUICK if args.quick else bench.FULL
        bench.plot(result, setup.batch_sizes, Path(args.plot))  # --model: its B=1, B=8
    return 0


def _bench_speculative(args, bench, quant) -> int:
    import json

    from executorch_cellcache.bench import speculative

    if args.plot:
        raise ValueError("--plot draws the main table; --speculative has no plot")
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    setup = bench.QUICK if args.quick else bench.FULL
    verify = Path(args.verify_program) if args.verify_program else None
    result = speculative.run(setup, bench.program_cache(args.cache_dir, say), quant,
                             args.quick, say, verify_program=verify)
    print(speculative.table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(speculative.as_json(result), indent=1))
    return 0
