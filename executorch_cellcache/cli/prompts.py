"""What ``generate`` and ``chat`` send: prompts from --prompt, --prompts-file
and --messages, and conversations rendered by the program's chat template."""

import sys
from typing import List

from executorch_cellcache.cli.options import read_text_file


def program_chat_template(runner, instead: str):
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
        value = json.loads(read_text_file(name, "messages file"))
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


def chat_messages(args, texts: List[str]) -> List[List[dict]]:
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
    """The ``chat_messages`` conversations rendered by ``template``."""
    prompts = []
    for i, chat in enumerate(chat_messages(args, texts)):
        prompt = template.encode(chat)
        if not prompt:
            raise ValueError(f"conversation {i} renders to an empty prompt")
        prompts.append(prompt)
    return prompts


def prompt_texts(args) -> List[str]:
    """--prompt values, then the --prompts-file lines that are not blank (``-``:
    standard input's, read here, so once)."""
    texts = list(args.prompt)
    if args.prompts_file:
        stdin = args.prompts_file == "-"
        text = _standard_input_text() if stdin else read_text_file(args.prompts_file, "prompts file")
        # Lines end at \n (\r\n too) only: str.splitlines() would also split a prompt at a
        # form feed or U+2028, which are text.
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        found = [line for line in lines if line.strip()]
        if not found:
            raise ValueError("standard input (--prompts-file -) holds no prompt" if stdin
                             else f"prompts file {args.prompts_file} holds no prompt")
        texts += found
    return texts


def _standard_input_text() -> str:
    """Standard input, read to its end, as UTF-8 text (--prompts-file -); a
    byte-order mark at its start is not text."""
    if sys.stdin is None:  # file descriptor 0 closed
        raise ValueError("--prompts-file -: standard input is closed")
    try:
        return sys.stdin.buffer.read().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input (--prompts-file -) is not UTF-8 text ({e})") from None


def read_prompts(args, texts: List[str], tokenizer, template=None) -> List[List[int]]:
    """The token ids of ``texts`` (``prompt_texts``); with ``template``
    (generate --chat), each text is a user message rendered by it
    (_chat_prompts), then the --messages conversation."""
    if not texts and args.messages is None:
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
