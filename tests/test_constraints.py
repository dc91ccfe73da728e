"""Structured output (runtime/constraints.py) through the default model's .pte:
sampled outputs validate against their JSON schemas (jsonschema, an
independent validator), with forks and with the prefix cache hot; greedy
constrained decoding takes the argmax over exactly the tokens the grammar
allows (oracle: the program's own logits and a hand-enumerated allowed set);
Lark grammars and regexes hold; bad schemas and grammars are refused before
any cell is taken; constrained samples take no speculative proposals."""

import json

import jsonschema
import numpy as np
import pytest

from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.runtime.constraints import Grammar
from executorch_cellcache.runtime.runner import Runner

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "id": {"type": "integer", "minimum": 0,
                                                         "maximum": 9999}},
                 "required": ["name", "id"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
              "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "ok": {"type": "boolean"}},
             "required": ["color", "ok"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["age", "score"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12},
        "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["title"], "additionalProperties": False},
}
PROMPT = "User: answer in JSON\nAssistant:"


@pytest.fixture(scope="module")
def runner(default_pte):
    return Runner(default_pte)


def _texts(runner, out):
    return [runner.tokenizer.decode(s) for p in out for s in p]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_validate_with_forks_and_a_hot_prefix_cache(runner, name):
    schema = SCHEMAS[name]
    prompt = runner.tokenizer.encode(PROMPT)
    for attempt in range(2):   # the second run's prompts all come from the prefix cache
        # Unseeded: a seed would give the 25 copies of the prompt the same 4 samples.
        out = runner.generate([prompt] * 25, 96, n=4, temperature=1.0, json_schema=schema)
        texts = _texts(runner, out)
        assert len(texts) == 100
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
        assert len(set(texts)) > 2   # sampled, not one answer
        if attempt:
            assert runner.last_stats.cached_prompt_tokens == 25 * (len(prompt) - 1)
    assert runner.cache.free_cells + runner.prefix_cache.reclaimable_cells() == \
        runner.cache.capacity


def test_greedy_takes_the_argmax_over_what_the_grammar_allows(runner):
    """Regex "(yes|no) sir": the first token is the most likely of the tokens
    whose text starts "yes" or "no" (a prefix of either, or either then a
    prefix of " sir")."""
    tok = runner.tokenizer
    prompt = tok.encode("User: well?\nAssistant:")
    words = ("yes sir", "no sir")

    def allowed(t):
        text = tok.decode([t])
        return bool(text) and "\ufffd" not in text and any(w.startswith(text) for w in words)

    allowed_ids = [t for t in range(runner.info.vocab_size) if allowed(t)]
    assert len(allowed_ids) >= 2
    s = runner.cache.seq_new()
    try:
        logits = runner.step([s] * len(prompt), prompt, list(range(len(prompt))),
                             [len(prompt) - 1]).numpy()[0]
    finally:
        runner.cache.seq_free(s)
    expected = allowed_ids[int(np.argmax(logits[allowed_ids]))]
    out = runner.generate([prompt], 16, grammar=Grammar("regex", "(yes|no) sir"))[0][0]
    assert out[0] == expected
    assert tok.decode(out) in words and runner.last_stats.decode_tokens == len(out) - 1


def test_lark_grammar_holds_for_sampled_outputs(runner):
    grammar = Grammar("lark", 'start: "x = " NUMBER ";"\nNUMBER: /[0-9]{1,3}/')
    out = runner.generate([runner.tokenizer.encode(PROMPT)] * 8, 24, n=2, temperature=1.0,
                          grammar=grammar)
    for text in _texts(runner, out):
        assert text.startswith("x = ") and text.endswith(";") and text[4:-1].isdigit()


def test_constrained_samples_take_no_proposals(runner):
    prompt = runner.tokenizer.encode(PROMPT)
    out = runner.generate([prompt], 64, speculative="lookup", json_schema=SCHEMAS["enum"])
    jsonschema.validate(json.loads(_texts(runner, out)[0]), SCHEMAS["enum"])
    assert runner.last_stats.proposed_tokens == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"json_schema": {"type": "nonsense"}}, "json_schema cannot be used: .*nonsense"),
    ({"json_schema": "{not json"}, "json_schema is not JSON"),
    ({"json_schema": [1, 2]}, "json_schema must be a JSON object"),
    ({"grammar": Grammar("lark", "start: (")}, "lark cannot be used"),
    ({"grammar": Grammar("regex", "")}, "must be non-empty text"),
    ({"grammar": Grammar("xml", "<a/>")}, "grammar kind must be one of json_schema, lark, regex"),
    ({"grammar": "start: 'a'"}, "grammar must be a constraints.Grammar"),
    ({"json_schema": {"type": "object"}, "grammar": Grammar("regex", "a")}, "not both"),
], ids=["schema-type", "schema-not-json", "schema-not-object", "lark-syntax", "regex-empty",
        "unknown-kind", "not-a-grammar", "both"])
def test_bad_schemas_and_grammars_are_refused_before_any_cell(runner, kwargs, message):
    free, ids = runner.cache.free_cells, runner.cache.n_sequences
    with pytest.raises(InvalidConfigError, match=message):
        runner.generate([runner.tokenizer.encode(PROMPT)], 8, **kwargs)
    assert (runner.cache.free_cells, runner.cache.n_sequences) == (free, ids)


def test_cli_json_schema_and_grammar_files(default_pte, tmp_path, capsys):
    from executorch_cellcache.cli import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["bounds"]))
    assert main(["generate", str(default_pte), "--prompt", PROMPT, "--n", "3",
                 "--temperature", "1", "--max-new-tokens", "64",
                 "--json-schema", str(schema)]) == 0
    samples = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()
               if line.startswith("  [sample")]
    assert len(samples) == 3
    for text in samples:
        jsonschema.validate(json.loads(eval(text)), SCHEMAS["bounds"])  # a repr'd str
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert main(["generate", str(default_pte), "--prompt", PROMPT, "--grammar",
                 str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    assert main(["generate", str(default_pte), "--prompt", "x", "--json-schema", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cellcache generate: error: the json_schema cannot be used: Invalid type: "
                   "nope"], err


def test_every_eos_id_ends_a_complete_grammar(runner):
    """A program with several EOS ids (Llama 3's <|eot_id|> and <|end_of_text|>):
    once the grammar is complete each of them is allowed, and choosing one that
    is not llguidance's (the first) completes the grammar as the first does."""
    from executorch_cellcache.runtime.constraints import Vocabulary

    eos = runner.info.eos_ids[0]
    other = next(t for t in range(runner.info.vocab_size) if t != eos)
    vocab = Vocabulary(runner.info.tokenizer_json, runner.info.vocab_size, [eos, other])
    constraint = vocab.compile(Grammar("regex", "yes"))
    matcher = constraint.matcher()
    assert not matcher.mask()[other]   # not before the grammar may end
    for token in runner.tokenizer.encode("yes", add_special_tokens=False):
        matcher.advance(token)
    allowed = matcher.mask()
    assert allowed[eos] and allowed[other] and allowed.sum() == 2
    matcher.advance(other)
    assert matcher.complete
