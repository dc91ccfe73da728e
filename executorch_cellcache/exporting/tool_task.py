"""The tool-use demo of the default model: chats where the user asks for
something one of the offered tools does, and the assistant calls it.

The default model (``default_model``) is a 0.9M-parameter model of Python's
documentation; it is taught one habit so that `cellcache serve` can show tool
calls end to end (a demo, not a capability): when the chat template lists
tools and the user asks for what one of them does, the reply is a call in the
template's format (``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
serving/tool_calls.py's hermes format); after a tool result (a ``tool``
message) it answers in a sentence that quotes the result; when no offered tool
fits, it answers in text. Under tool_choice "auto" the server's lazy grammar
holds the call to the tool's schema once ``<tool_call>`` appears, so the model
only has to choose to call.

This module holds the tools, the conversations (``conversation``: messages
and tools as the server would pass them to the chat template, the training
script renders them with the checkpoint's template) and the held-out requests
(``heldout_tool_requests``: values the training conversations never use, for
the training script's figures and the tests).
"""

import json
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: Tuple[Tuple[str, str], ...]   # (name, value kind: a key of the value lists)
    requests: Tuple[str, ...]             # user requests, {param} filled in

    def function(self) -> Dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        props = {p: ({"type": "integer"} if kind == "number" else {"type": "string"})
                 for p, kind in self.params}
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": props,
                           "required": [p for p, _ in self.params]}}}


TOOLS = (
    ToolSpec("get_weather", "Get the current weather for a city.", (("city", "city"),),
             ("What is the weather in {city}?", "Is it raining in {city}?",
              "How warm is it in {city} today?", "Tell me the weather for {city}.")),
    ToolSpec("get_time", "Get the local time in a city.", (("city", "city"),),
             ("What time is it in {city}?", "Tell me the time in {city}.")),
    ToolSpec("add", "Add two integers.", (("a", "number"), ("b", "number")),
             ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.")),
    ToolSpec("multiply", "Multiply two integers.", (("a", "number"), ("b", "number")),
             ("What is {a} times {b}?", "Multiply {a} by {b}.")),
    ToolSpec("search", "Search the documentation.", (("query", "word"),),
             ("Search the docs for {query}.", "Look up {query}.", "Find pages about {query}.")),
    ToolSpec("define", "Give the meaning of a word.", (("word", "word"),),
             ("What does {word} mean?", "Define {word}.")),
    ToolSpec("send_email", "Send an email.", (("to", "name"), ("subject", "word")),
             ("Send an email to {to} about {subject}.", "Email {to} about {subject}.")),
    ToolSpec("translate", "Translate a word into a language.",
             (("text", "word"), ("language", "language")),
             ("Translate {text} into {language}.", "How do you say {text} in {language}?")),
    ToolSpec("set_timer", "Start a timer.", (("minutes", "number"),),
             ("Set a timer for {minutes} minutes.", "Start a {minutes} minute timer.")),
    ToolSpec("stock_price", "Get the price of a stock.", (("symbol", "symbol"),),
             ("What is the price of {symbol}?", "How is {symbol} trading?")),
)
USE_THE_TOOL = " Use the tool."
# Values: (training, held out). Held-out values never appear in a training conversation.
VALUES = {
    "city": (("London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Dublin",
              "Vienna", "Prague", "Warsaw", "Lisbon", "Athens", "Seoul", "Delhi", "Sydney",
              "Toronto", "Chicago", "Boston", "Denver", "Nairobi", "Havana", "Quito",
              "Helsinki", "Zurich", "Munich", "Milan", "Naples", "Kyoto", "Osaka", "Manila"),
             ("Paris", "Moscow", "Beijing", "Dallas", "Geneva", "Bogota", "Riga", "Hanoi")),
    "name": (("Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan",
              "Judy", "Mallory", "Oscar", "Peggy", "Trent", "Victor", "Walter"),
             ("Sybil", "Rupert", "Wendy", "Yusuf")),
    "language": (("French", "German", "Spanish", "Italian", "Dutch", "Polish", "Greek",
                  "Turkish", "Hindi"), ("Swedish", "Czech", "Korean")),
    "symbol": (("ACME", "GLOBO", "INITECH", "UMBRELLA", "HOOLI", "STARK", "WAYNE", "CYBER"),
               ("TYRELL", "WONKA", "OSCORP")),
}
NUMBERS = (range(0, 1000), range(1000, 10000))   # held out: four digits
NEGATIVE = 0.2        # conversations where no offered tool fits: the reply is text
FOLLOW_UP = 0.3       # of the calls: a tool result and the answer that quotes it follow
WITH_HINT = 0.5       # requests that end in USE_THE_TOOL


def _value(rng: random.Random, kind: str, heldout: bool, words: Sequence[str]):
    if kind == "number":
        return rng.choice(NUMBERS[heldout])
    if kind == "word":
        return rng.choice(words)
    return rng.choice(VALUES[kind][heldout])


def _call(rng, tool: ToolSpec, heldout: bool, words) -> Tuple[str, Dict[str, Any]]:
    """(user request, arguments) for one call of ``tool``."""
    args = {p: _value(rng, kind, heldout, words) for p, kind in tool.params}
    request = rng.choice(tool.requests).format(**args)
    if rng.random() < WITH_HINT:
        request += USE_THE_TOOL
    return request, args


def _offered(rng, target: ToolSpec) -> List[ToolSpec]:
    others = [t for t in TOOLS if t is not target]
    tools = rng.sample(others, rng.randint(0, 2)) + [target]
    rng.shuffle(tools)
    return tools


def _result(rng, tool: ToolSpec, args: Dict[str, Any]) -> str:
    if tool.name in ("add", "multiply"):
        value = args["a"] + args["b"] if tool.name == "add" else args["a"] * args["b"]
        return json.dumps({"result": value})
    return json.dumps({"result": f"{tool.name} done", "code": rng.randint(1, 99)})


def conversation(rng: random.Random, words: Sequence[str], replies: Sequence[str]
                 ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(messages, tools) of one training conversation, ending with the
    assistant's reply (or replies): a call of the tool the request is for,
    sometimes followed by its result and an answer quoting it; or, NEGATIVE of
    the time, a request no offered tool fits, answered with a passage of
    ``replies`` (text of the training split). ``words``: free-text argument
    values (words of the training split)."""
    target = rng.choice(TOOLS)
    if rng.random() < NEGATIVE:
        tools = [t for t in _offered(rng, target) if t is not target] or \
            [rng.choice([t for t in TOOLS if t is not target])]
        subject = rng.choice(words)
        request = rng.choice(("Tell me about {w}.", "Explain {w}.", "What is {w}?",
                              "Write about {w}.")).format(w=subject)
        return ([{"role": "user", "content": request},
                 {"role": "assistant", "content": rng.choice(replies)}],
                [t.function() for t in tools])
    request, args = _call(rng, target, False, words)
    messages = [{"role": "user", "content": request},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{rng.randrange(16 ** 8):08x}", "type": "function",
                     "function": {"name": target.name, "arguments": json.dumps(args)}}]}]
    if rng.random() < FOLLOW_UP:
        result = _result(rng, target, args)
        messages += [{"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"],
                      "content": result},
                     {"role": "assistant", "content": f"The {target.name} tool says {result}."}]
    return messages, [t.function() for t in _offered(rng, target)]


@dataclass(frozen=True)
class ToolRequest:
    messages: List[Dict[str, Any]]   # the user's request
    tools: List[Dict[str, Any]]      # what is offered (the right tool among them)
    name: str                        # the tool the request is for
    arguments: Dict[str, Any]        # the arguments it needs


def heldout_tool_requests(count: int = 32, seed: int = 1234) -> List[ToolRequest]:
    """Requests built from held-out values (cities, names, four-digit numbers,
    ... that no training conversation uses; free words from a fixed list),
    deterministic."""
    rng = random.Random(seed)
    words = ("iterators", "decorators", "generators", "slicing", "closures", "coroutines")
    out = []
    for i in range(count):
        target = TOOLS[i % len(TOOLS)]
        request, args = _call(rng, target, True, words)
        out.append(ToolRequest([{"role": "user", "content": request}],
                               [t.function() for t in _offered(rng, target)],
                               target.name, args))
    return out
