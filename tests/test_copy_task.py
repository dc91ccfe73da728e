"""The copy task (exporting/copy_task.py) and the copy examples of
scripts/train_default_model.py: held-out prompts are deterministic and come
from the held-out split only, training examples from the training split only,
batches depend only on the seed, and the prompt-lookup simulation counts
forwards as transformers' prompt lookup would draft them. No training, no
export."""

import sys
from pathlib import Path

import pytest
import torch

from executorch_cellcache.exporting import copy_task, default_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_default_model as training  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model.CHECKPOINT / "tokenizer.json"))


def test_heldout_prompts_are_fixed_held_out_paragraphs():
    prompts = copy_task.heldout_copy_prompts()
    assert prompts == copy_task.heldout_copy_prompts()
    assert len(prompts) == copy_task.HELDOUT_PROMPTS == 16
    train, heldout = default_model.split_documents()
    lo, hi = copy_task.PASSAGE_CHARS
    for p in prompts:
        assert lo <= len(p.passage) <= hi
        assert any(p.passage in text for text in heldout)
        assert not any(p.passage in text for text in train)
        assert p.prompt.startswith(p.passage + copy_task.COPY_SEPARATOR)
        prefix = p.prompt[len(p.passage) + len(copy_task.COPY_SEPARATOR):]
        assert prefix + p.reference == p.passage
        assert 40 <= len(prefix) <= copy_task.PREFIX_CHARS
        assert p.reference[0].isspace() and not prefix[-1].isspace()
        # New text: no 47-character run of it is in a training document.
        assert not any(p.passage[i:i + 47] in text for text in train
                       for i in range(len(p.passage) - 46))
    # Round robin over the held-out documents with new text: one passage from each first.
    sources = [next(i for i, t in enumerate(heldout) if p.passage in t) for p in prompts]
    documents = sorted(set(sources))
    assert len(documents) >= 4 and sorted(sources[:len(documents)]) == documents
    assert len({p.passage for p in prompts}) == len(prompts)


def test_heldout_prompts_fit_the_training_context(tok):
    for p in copy_task.heldout_copy_prompts():
        prompt_ids = tok.encode(p.prompt).ids
        whole = tok.encode(p.prompt + p.reference).ids
        assert whole[:len(prompt_ids)] == prompt_ids   # the cut is a token boundary
        assert len(whole) + 1 <= default_model.TRAINING_CONTEXT


def test_too_many_heldout_prompts_is_an_error():
    with pytest.raises(ValueError, match="fewer than"):
        copy_task.heldout_passages(10_000)


def test_prefix_length_cuts_before_whitespace():
    assert copy_task.prefix_length("abc def ghi", 9) == 7
    assert copy_task.prefix_length("abc def ghi", 7) == 7
    assert copy_task.prefix_length("abc  def", 5) == 3
    assert copy_task.prefix_length("abcdefgh", 4) == 4   # no whitespace: the count


def test_the_task_draft_is_the_runtime_lookup_at_two_tokens_and_eight_proposed():
    lookup = training.task_lookup
    assert lookup([1, 2, 3, 1, 2, 4, 1, 2]) == [3, 1, 2, 4, 1, 2]   # earliest, cut at the end
    assert lookup([5, 1, 2]) == []                                   # only itself
    assert lookup([1, 2, 1, 2]) == [1, 2]
    assert lookup(list(range(20)) + [0, 1]) == list(range(2, 10))   # up to 8
    assert lookup([7, 1, 2, 7]) == []                                # 2-gram [2, 7]: none
    assert lookup([1]) == []


def test_prompt_lookup_forwards_counts_accepted_drafts():
    def forwards(prompt, output):
        return copy_task.prompt_lookup_forwards(prompt, output, training.task_lookup)

    # Draft [3, 4, 5, 6, 1, 2]: 3 accepted, the model's own 9 emitted with them; then no match.
    assert forwards([1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 9, 9]) == (2, [3, 0])
    # A perfect copy of 6 tokens with drafts of up to 8: one forward verifies 5, emits 6.
    assert forwards([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], [3, 4, 5, 6, 7, 8]) == (1, [5])
    # Nothing to look up: one token a forward.
    assert forwards([1, 2], [3, 4, 5]) == (3, [0, 0, 0])
    assert forwards([1, 2], []) == (0, [])


def test_copy_task_figures_of_a_perfect_and_a_useless_model(tok):
    eos = tok.token_to_id("</s>")
    prompts = copy_task.heldout_copy_prompts()
    references = {tuple(tok.encode(p.prompt).ids): p for p in prompts}

    def perfect(ids):
        p = references[tuple(ids)]
        return tok.encode(p.prompt + p.reference).ids[len(ids):] + [eos]

    def useless(ids):
        return [tok.token_to_id("Ċ")] * 10

    encode, decode = (lambda text: tok.encode(text).ids), tok.decode
    best = copy_task.copy_task_figures(perfect, encode, decode, training.task_lookup, eos)
    assert best.exact == best.prompts == 16
    assert best.copied_chars == best.reference_chars == sum(len(p.reference) for p in prompts)
    assert best.tokens_per_forward > 6
    worst = copy_task.copy_task_figures(useless, encode, decode, training.task_lookup, eos)
    assert worst.exact == 0 and worst.tokens_per_forward < 2
    assert "tokens per forward" in best.summary()


def test_copy_examples_come_from_the_training_split_and_are_reproducible(tok):
    train, _ = default_model.split_documents()
    prompts = copy_task.heldout_copy_prompts()
    stream, starts, scored = training.copy_examples(tok, train, 64, seed=2, max_tokens=256)
    again = training.copy_examples(tok, train, 64, seed=2, max_tokens=256)
    assert all(torch.equal(x, y) for x, y in zip((stream, starts, scored), again))
    assert not torch.equal(stream[:500], training.copy_examples(tok, train, 64, 3, 256)[0][:500])
    assert scored.shape == stream.shape and scored.dtype == torch.bool
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    separator = tok.encode(copy_task.COPY_SEPARATOR, add_special_tokens=False).ids
    bounds = [i + 1 for i in torch.nonzero(stream == eos).flatten().tolist()]
    assert len(bounds) == 64 and bounds[-1] == len(stream)
    assert starts.tolist() == [s for s in [0] + bounds[:-1] if s + 256 <= len(stream)]
    kinds = {"random": 0, "text": 0, "edited": 0}
    for begin, end in zip([0] + bounds[:-1], bounds):
        ids, mask = stream[begin:end].tolist(), scored[begin:end].tolist()
        assert ids[0] == bos and len(ids) <= 256
        first, n = mask.index(True, 1), (len(ids) - 2 - len(separator)) // 2
        if ids[first - len(separator):first] == separator:
            # random tokens: the passage and the separator unscored, the copy scored
            assert ids[1 + n:1 + n + len(separator)] == separator
            assert ids[1:1 + n] == ids[1 + n + len(separator):-1]
            assert mask == [False] * (1 + n + len(separator)) + [True] * (n + 1)
            kinds["random"] += 1
            continue
        text = tok.decode(ids[1:-1])
        passage, copy = text.split(copy_task.COPY_SEPARATOR)
        assert copy == passage   # the copy repeats the passage above it, edited or not
        lo, hi = training.COPY_PASSAGE_CHARS
        assert len(passage) <= hi + 60 and passage == passage.rstrip()
        # (Held-out topics repeat training ones, but the copy task's passages are new text.)
        assert not any(passage[:47] in p.passage for p in prompts)
        if all(mask):   # a passage of the training split as it is: every token scored
            assert any(passage in t for t in train) and len(passage) >= lo // 2
            kinds["text"] += 1
        else:           # an edited passage: only the separator, the copy and EOS scored
            first = mask.index(True)
            assert not any(mask[:first]) and all(mask[first:])
            assert 0 < len(ids) - first <= len(tok.encode(copy_task.COPY_SEPARATOR + copy).ids) + 2
            assert not any(passage in t for t in train)
            kinds["edited"] += 1
    assert 16 <= kinds["random"] <= 48 and kinds["edited"] > kinds["text"] > 0


def test_batches_depend_only_on_the_seed_and_mix_copy_rows(tok):
    train, _ = default_model.split_documents()
    stream = training.token_stream(tok, train)
    copies = training.copy_examples(tok, train, 32, seed=2, max_tokens=256)

    def batches(seed, fraction):
        args = training.parse_args(["--copy-fraction", str(fraction), "--tool-fraction", "0"])
        g = torch.Generator().manual_seed(seed)
        pools = [(fraction, copies)] if fraction else []
        return [training.draw_batch(stream, pools, args, g) for _ in range(4)]

    a, b, c = batches(0, 0.25), batches(0, 0.25), batches(1, 0.25)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))
    assert all(x.shape == y.shape == (8, 256) for x, y in a)
    examples = {tuple(copies[0][s:s + 256].tolist()): s for s in copies[1].tolist()}
    copy_rows = 0
    for inputs, labels in a:
        for row, label in zip(inputs, labels):
            s = examples.get(tuple(row.tolist()))
            if s is None:   # a block of the training stream: every token scored
                assert torch.equal(row, label)
            else:           # a copy row: its unscored tokens labelled -100
                copy_rows += 1
                assert torch.equal(label, row.masked_fill(~copies[2][s:s + 256], -100))
    assert 1 <= copy_rows <= 20   # 0.25 of 32 rows
    # Fraction 1: every row a copy example from its start; fraction 0: the offsets alone,
    # as the recipe drew them before copy examples.
    assert all(tuple(row.tolist()) in examples for x, _ in batches(0, 1.0) for row in x)
    g = torch.Generator().manual_seed(0)
    plain = [torch.stack([stream[s:s + 256] for s in torch.randint(
        0, len(stream) - 255, (8,), generator=g).tolist()]) for _ in range(4)]
    assert all(torch.equal(x, y) and torch.equal(x, labels)
               for (x, labels), y in zip(batches(0, 0.0), plain))
    # Two pools (the fine-tune's copy examples and tool-use chats) filling every row.
    tools = training.tool_examples(tok, train, 32, seed=4, max_tokens=256)
    chats = {tuple(tools[0][s:s + 256].tolist()) for s in tools[1].tolist()}
    g = torch.Generator().manual_seed(0)
    args = training.parse_args(["--copy-fraction", "0.5", "--tool-fraction", "0.5"])
    rows = [tuple(row.tolist()) for _ in range(4) for row in training.draw_batch(
        stream, [(0.5, copies), (0.5, tools)], args, g)[0]]
    assert all(r in examples or r in chats for r in rows)
    assert any(r in examples for r in rows) and any(r in chats for r in rows)


def test_the_default_out_is_not_the_shipped_checkpoint():
    args = training.parse_args([])
    assert args.out.resolve() != default_model.CHECKPOINT
    assert (ROOT / training.SHIPPED).resolve() == default_model.CHECKPOINT
    assert training.parse_args(["--out", training.SHIPPED]).out == Path(training.SHIPPED)
    with pytest.raises(SystemExit):
        training.parse_args(["--copy-fraction", "1.5"])
