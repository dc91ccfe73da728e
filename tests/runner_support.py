"""What the Runner test files (tests/test_runner_*.py) share: the prompts, the
transformers oracle and helpers that drive a Runner step by step. The two
tiny-Llama programs they run are exported once per session by the
``oracle_and_paths`` fixture in conftest.py (``export_programs`` here).

Both programs come from a seeded tiny Llama (tests/model_configs.py): a roomy
one (256 cells) and a tight one (48 cells) that holds only two of the waiting
test's requests at a time. Both use max_tokens_per_step=16, so longer prompts
are prefilled in chunks.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))

from model_configs import make_model

import executorch_cellcache as ecc
from spec.sampling import SamplingParams, TokenLogprobs

STEP = 16          # max_tokens_per_step of both programs
CELLS = 256        # the roomy program
TIGHT_CELLS = 48   # the tight program: two waiting-test requests fit, never three
TIE = 1e-3         # top-2 logits closer than this are a tie for the greedy check

# Lengths 5, 13, 23, 40: two are longer than STEP, one spans three chunks.
PROMPTS = [
    [(7 * i + 3) % 300 + 10 for i in range(5)],
    [(11 * i + 5) % 300 + 10 for i in range(13)],
    [(13 * i + 1) % 300 + 10 for i in range(23)],
    [(17 * i + 9) % 300 + 10 for i in range(40)],
]
# The EOS test's prompt; the program's EOS id is a token greedy decoding of it
# reaches after a few tokens (chosen by the oracle before export).
EOS_PROMPT = [40, 41, 42, 43, 44, 45]

# Six requests; worst-case cells each = prompt + max_new - 1 = 21, 18, 23, 19, 22, 20.
# Any two fit in TIGHT_CELLS (23 + 22 = 45 <= 48), no three do (18 + 19 + 20 = 57).
WAIT_LENS = [12, 9, 14, 10, 13, 11]
WAIT_PROMPTS = [[(5 * i + 31 * r) % 300 + 10 for i in range(n)] for r, n in enumerate(WAIT_LENS)]
WAIT_NEW = 10

SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


def oracle_greedy(model, prompt, k):
    """transformers' greedy continuation: k token ids."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(k):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def export_programs(program):
    """(eager transformers oracle, roomy .pte, tight .pte, eos id).
    program(name, make): the path of the .pte ``make(path)`` writes
    (conftest.made_once: once per test run)."""
    model = make_model("llama")
    model.set_attn_implementation("eager")
    greedy = oracle_greedy(model, EOS_PROMPT, 8)
    # EOS := the first token, from the 3rd on, that greedy decoding has not produced before.
    idx = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    eos = greedy[idx]
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    roomy = program("roomy.pte", lambda path: ecc.export(model, path, n_cells=CELLS,
                                                          max_tokens_per_step=STEP))
    tight = program("tight.pte", lambda path: ecc.export(model, path, n_cells=TIGHT_CELLS,
                                                         max_tokens_per_step=STEP))
    return model, roomy, tight, eos


def teacher_forced_check(oracle, prompt, generated):
    """Each generated token is transformers' argmax given the tokens before it
    (or one of the tokens tied with the maximum within TIE)."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = oracle(ids).logits[0].float()
    for j, tok in enumerate(generated):
        row = logits[len(prompt) + j - 1]
        best = float(row.max())
        tied = set(torch.nonzero(row >= best - TIE).flatten().tolist())
        assert tok in tied, (
            f"generated token {j} is {tok} (logit {float(row[tok]):.5f}) but transformers' "
            f"argmax is {int(row.argmax())} (logit {best:.5f}); prompt len {len(prompt)}, "
            f"generated {generated}")


def prefill(runner, seq, tokens, start=0):
    """Feeds tokens at positions start.. in chunks; returns the last token's logits."""
    logits = None
    for i in range(0, len(tokens), STEP):
        chunk = tokens[i:i + STEP]
        pos = list(range(start + i, start + i + len(chunk)))
        logits = runner.step([seq] * len(chunk), chunk, pos, [len(chunk) - 1])
    return logits[0]


def greedy_steps(runner, seq, token, k):
    """Feeds ``token`` at next_pos, then k-1 greedy tokens; returns the k greedy tokens."""
    out = []
    for _ in range(k):
        logits = runner.step([seq], [token], [runner.cache.next_pos(seq)], [0])
        token = int(torch.argmax(logits[0]))
        out.append(token)
    return out


def still_works(runner, baseline):
    """The runner's cache is consistent and generates the baseline's tokens
    (the ``baseline`` fixture) with the cells it had."""
    kw, expected = baseline
    runner.cache.check_invariants()
    free = runner.cache.free_cells
    assert runner.generate(PROMPTS[:2], **kw) == expected
    assert runner.cache.free_cells == free


@dataclass
class Sample:
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class Event:
    """One token as a request's on_token saw it (TokenEvent's fields)."""
    request: "Req"
    sample_index: int
    token: int
    logprobs: Optional[TokenLogprobs]
    finish_reason: Optional[str]
    stop_token: bool


class Req:
    """A request driven through ``runner.engine`` (the C++ engine): its
    samples' tokens and finish reasons and its usage fill in as it runs.
    ``ends(sample, token, stop_token) -> bool`` (optional) is its text watch
    (Runner.submit ``text``): True ends the sample on that token."""

    def __init__(self, prompt, ends=None, **params):
        self.prompt = list(prompt)
        self.params = SamplingParams(**params)
        self.ends = ends
        self.samples = [Sample() for _ in range(self.params.n if isinstance(self.params.n, int)
                                                and self.params.n > 0 else 1)]
        self.id = None
        self.speculate = True
        self.usage = {}
        self.on_event = None   # Event -> None, on the stepping thread

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def submit(self, runner, events: Optional[list] = None) -> int:
        def on_token(_id, sample, token, lp, top, stop_token, finish):
            s = self.samples[sample]
            s.tokens.append(token)
            event = Event(self, sample, token, None if lp is None else TokenLogprobs(lp, top),
                          finish, stop_token)
            if events is not None:
                events.append(event)
            if self.on_event is not None:
                self.on_event(event)

        def on_finish(_id, sample, reason, usage):
            self.samples[sample].finish_reason = reason
            self.usage[sample] = usage
        self.id = runner.submit(self.prompt, self.params, on_token, on_finish, text=self.ends,
                                speculate=self.speculate)
        return self.id


def make_request(prompt, **params):
    return Req(prompt, **params)


def drive(runner, arrivals):
    """Steps ``runner.engine`` until idle; arrivals: {step number: [Req]}
    submitted just before that step. Returns the token events."""
    events = []
    step = 0
    while True:
        for req in arrivals.get(step, []):
            req.submit(runner, events)
        worked = runner.engine.step()
        step += 1
        if not worked and not any(k >= step for k in arrivals):
            return events
