"""``cellcache generate``: text for one or many prompts, with continuous
batching."""

import json
import sys
from typing import List

from executorch_cellcache.cli.options import (add_prefix_cache_options, add_sampling_options,
                                              add_speculative_options, add_threads_option,
                                              non_negative_int, positive_int, read_text_file,
                                              speculative)
from executorch_cellcache.cli.prompts import (chat_messages, program_chat_template,
                                              prompt_texts, read_prompts)


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="generate text for one or many prompts",
        description="Generate from a cell-cache .pte with continuous batching: prompts share "
                    "forwards, the n samples of a prompt share its cached prefix. Prints "
                    "each sample's text, under [prompt i] and [sample j] lines where there "
                    "are several (--json: JSON lines); the figures go to stderr.")
    gen.add_argument("model", metavar="MODEL.pte", help="a .pte written by `cellcache export`")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", metavar="F",
                     help="a file with one prompt per line (empty lines skipped); - reads "
                          "them from standard input")
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
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="K",
                     help="new tokens per sample (default 32)")
    gen.add_argument("--n", type=positive_int, default=1, metavar="N",
                     help="samples per prompt, sharing the prompt's cache cells (default 1)")
    add_sampling_options(gen)
    gen.add_argument("--no-stop-on-eos", dest="stop_on_eos", action="store_false",
                     help="keep generating past EOS")
    gen.add_argument("--stop-token-ids", type=non_negative_int, nargs="+", default=[],
                     metavar="ID", help="token ids that end a sample besides EOS (left out of "
                                        "its text, as EOS is)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object a line for each sample instead of its text: "
                          "prompt_index, sample_index, prompt (its text), prompt_token_ids, "
                          "messages (with --chat or --messages), text (the stop token left "
                          "out), token_ids (the stop token kept), finish_reason (stop or "
                          "length), usage (prompt_tokens, cached_tokens, completion_tokens)")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="structured output: every sample is JSON valid against the "
                                 "schema in FILE (XGrammar token masks, as cellcache_runner)")
    structured.add_argument("--grammar", metavar="FILE",
                            help="structured output: every sample follows the Lark (or GBNF) "
                                 "grammar in FILE")
    add_prefix_cache_options(gen)
    add_speculative_options(gen)
    add_threads_option(gen)
    gen.set_defaults(run=run)


def run(args) -> int:
    from tqdm import tqdm

    from executorch_cellcache.runtime.runner import Runner
    from executorch_cellcache.runtime.tokenizer import StreamDecoder

    spec = speculative(args)
    chat = args.chat or args.messages is not None
    if chat and args.token_ids:
        raise ValueError("--token-ids prompts are token ids; --chat and --messages render "
                         "text with the chat template: pass one or the other")
    if args.system is not None and not chat:
        raise ValueError("--system is a chat message: it needs --chat (or --messages)")
    runner = Runner(args.model, prefix_cache=args.prefix_cache,
                    prefix_cache_cells=args.prefix_cache_cells)
    template = program_chat_template(runner, "`cellcache generate` without --chat") \
        if chat else None
    runner.use_speculative(spec)  # a bad speculative config or draft model fails before any work
    grammar = _grammar(args)
    runner.constraint(grammar)  # a schema or grammar that cannot compile fails here too
    tok = runner.tokenizer
    texts = prompt_texts(args)  # read once: --prompts-file - is standard input
    prompts = read_prompts(args, texts, tok, template)
    stream = len(prompts) == 1 and args.n == 1 and not args.json
    total = len(prompts) * args.n * args.max_new_tokens
    bar = None if stream else tqdm(total=total, unit="tok", desc="generating", file=sys.stderr)

    streamer = StreamDecoder(tok) if tok else None
    stops = (set(runner.info.eos_ids) if args.stop_on_eos else set()) | set(args.stop_token_ids)

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
    else:
        conversations = chat_messages(args, texts) if chat else None
        samples = _samples(runner, prompts, results, conversations, stops)
        if args.json:
            for sample in samples:
                print(json.dumps(sample, ensure_ascii=False))
        else:
            print(_as_text(samples, len(prompts), args.n))
    print(_stats_line(runner, spec), file=sys.stderr)
    return 0


def _grammar(args):
    """The constraints.Grammar of --json-schema or --grammar, or None."""
    from executorch_cellcache.runtime.constraints import Grammar

    if args.json_schema is not None:
        return Grammar("json_schema", read_text_file(args.json_schema, "JSON schema file"))
    if args.grammar is not None:
        return Grammar("lark", read_text_file(args.grammar, "grammar file"))
    return None


def _samples(runner, prompts, results, conversations, stops) -> List[dict]:
    """One object a sample, prompt by prompt (what --json prints a line each):
    the prompt's text and token ids (and conversation, with --chat), the
    sample's text (without the stop token that ended it) and token ids (with
    it), why it ended and its token counts."""
    tok, s = runner.tokenizer, runner.last_stats
    decode = tok.decode if tok else (lambda ids: " ".join(map(str, ids)))
    samples = []
    for i, (prompt, outputs) in enumerate(zip(prompts, results)):
        for j, ids in enumerate(outputs):
            text_ids = ids[:-1] if ids and ids[-1] in stops else ids
            sample = {"prompt_index": i, "sample_index": j, "prompt": decode(prompt),
                      "prompt_token_ids": list(prompt)}
            if conversations is not None:
                sample["messages"] = conversations[i]
            sample.update(text=decode(text_ids), token_ids=list(ids),
                          finish_reason=s.finish_reasons[i][j],
                          usage={"prompt_tokens": len(prompt),
                                 "cached_tokens": s.cached_tokens[i],
                                 "completion_tokens": len(ids)})
            samples.append(sample)
    return samples


def _as_text(samples: List[dict], n_prompts: int, n: int) -> str:
    """The samples' texts as they are, each under a "[prompt i] PROMPT" line
    (where there are several prompts; a chat prompt shows its last message)
    and a "[sample j]" line (where there are several samples a prompt), a
    blank line between samples."""
    blocks = []
    for sample in samples:
        lines = []
        if n_prompts > 1 and sample["sample_index"] == 0:
            last = sample.get("messages", [None])[-1]
            prompt = sample["prompt"] if last is None else \
                f"[{last['role']}] {last.get('content') or ''}"
            lines.append(f"[prompt {sample['prompt_index']}] {prompt}")
        if n > 1:
            lines.append(f"[sample {sample['sample_index']}]")
        blocks.append("\n".join(lines + [sample["text"]]))
    return "\n\n".join(blocks)


def _stats_line(runner, spec) -> str:
    s = runner.last_stats
    return (f"prefill {s.prefill_tokens} tokens at {s.prefill_tokens_per_s:.0f} tok/s, decode "
            f"{s.decode_tokens} tokens at {s.decode_tokens_per_s:.0f} tok/s, {s.steps} steps, "
            f"peak cells {s.peak_cells} of {s.capacity}{_pool_summary(runner, s)}"
            f"{_prefix_cache_summary(runner)}"
            f"{_speculative_summary(s, spec)}")


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
