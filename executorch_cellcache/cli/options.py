"""Option types and option groups that several commands share (each
command's own options sit in its module), and the text of a file an option
names."""

import argparse
from pathlib import Path
from typing import Optional


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one `--help` away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int, high: Optional[int] = None):
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


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

# --threads' ceiling: _core.MAX_RUNTIME_THREADS (cpp/kernels/kernel_threads.h), written
# here so that parsing arguments loads no extension (tests/test_threads.py compares them).
MAX_THREADS = 1024
_thread_count = int_at_least(1, MAX_THREADS)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _draft_max(text: str):
    """--draft-max: "auto" or an integer >= 1."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got "
                                         f"{text!r}") from None


def add_quantize_options(parser) -> None:
    """--quantize, --group-size, --embedding-quantize (export, bench)."""
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


def add_sampling_options(parser, seed_note: str = "") -> None:
    """--temperature, --top-k, --top-p, --seed (generate, chat); ``seed_note``
    ends --seed's help."""
    parser.add_argument("--temperature", type=_non_negative_float, default=0.0, metavar="T",
                        help="0 = greedy (default), > 0 samples")
    parser.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                        help="sample only among the K most likely tokens (with --temperature)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="sample only among the most likely tokens whose probabilities sum "
                             "to P, in (0, 1] (with --temperature)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed for reproducible sampling" + seed_note)


def add_threads_option(parser, note: str = "") -> None:
    """--threads (every command that runs a program); ``note`` ends its help."""
    parser.add_argument("--threads", type=_thread_count, default=None, metavar="N",
                        help="threads of the ExecuTorch runtime's pool, on which XNNPACK, the "
                             "optimized kernels and the cell-cache attention run (default: "
                             "ExecuTorch's choice, one per core)" + note)


def add_prefix_cache_options(parser) -> None:
    """--prefix-cache-cells | --no-prefix-cache (generate, chat, serve)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--prefix-cache-cells", type=non_negative_int, default=None,
                       metavar="N",
                       help="keep at most N cells of finished requests as cached prefixes "
                            "(default: as many as admission leaves; at most the program's "
                            "--cells)")
    group.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                       help="do not reuse finished requests' cells for later prompts that "
                            "start with the same tokens")


def add_speculative_options(parser) -> None:
    """The speculative decoding group (generate, serve); ``speculative(args)``
    reads it."""
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
    group.add_argument("--lookup-min-ngram", type=positive_int, default=None, metavar="M",
                       help=f"lookup: the shortest run of last tokens matched (default "
                            f"{sp.DEFAULT_MIN_NGRAM})")
    group.add_argument("--lookup-max-ngram", type=positive_int, default=None, metavar="M",
                       help=f"lookup: the longest, tried first (default {sp.DEFAULT_MAX_NGRAM})")


def speculative(args):
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


def read_text_file(name: str, what: str) -> str:
    """The UTF-8 text of a file a user named (``what``: "prompts file", ...)."""
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if path.is_dir():  # a pipe (<(...), /dev/stdin) is read like a file
        raise ValueError(f"{what} {path} is a folder, not a file")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text ({e})") from None
