"""``cellcache eval``: the perplexity of a text through a .pte, in sliding
windows."""

import sys

from executorch_cellcache.cli.options import add_threads_option, positive_int, read_text_file


def add_parser(sub) -> None:
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
    ev.add_argument("--window", type=positive_int, default=None, metavar="N",
                    help="tokens per window, at most the program's cells (default: the "
                         "cells, or the whole text when shorter; for the default model its "
                         "training context, 256)")
    ev.add_argument("--stride", type=positive_int, default=None, metavar="N",
                    help="tokens between window starts, at most the window (default: half "
                         "the window)")
    add_threads_option(ev)
    ev.set_defaults(run=run)


def _eval_text(args, runner, is_default: bool) -> str:
    if args.text is not None:
        text = read_text_file(args.text, "text file")
        if not text:
            raise ValueError(f"text file {args.text} is empty")
        return text
    from executorch_cellcache.exporting import default_model

    if not is_default:
        raise ValueError(f"no text: pass --text FILE (only the embedded default model has a "
                         f"built-in held-out text; this program is {runner.info.model_name!r})")
    print("scoring the default model's held-out slice of pydoc_data.topics", file=sys.stderr)
    return default_model.heldout_text()


def run(args) -> int:
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
