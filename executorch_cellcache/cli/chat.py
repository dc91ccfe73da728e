"""``cellcache chat``: an interactive chat in the terminal, with the program's
chat template; each turn reuses the previous turns' cells (the prefix cache)."""

import os
import sys
from typing import List, Optional

from executorch_cellcache.cli.options import (add_prefix_cache_options, add_sampling_options,
                                              add_threads_option, positive_int)
from executorch_cellcache.cli.prompts import program_chat_template


def add_parser(sub) -> None:
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
    chat.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                      help="most tokens a reply generates (default 256; fewer when the "
                           "conversation leaves less room in the KV cache)")
    add_sampling_options(chat, " (every reply draws from it)")
    add_prefix_cache_options(chat)
    add_threads_option(chat)
    chat.set_defaults(run=run)


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


def run(args) -> int:
    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.sampling import SamplingParams

    runner = Runner(args.model, prefix_cache=args.prefix_cache,
                    prefix_cache_cells=args.prefix_cache_cells)
    template = program_chat_template(runner, "`cellcache generate`")
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
