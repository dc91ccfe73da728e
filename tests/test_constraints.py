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
    ({"json_schema": {"type": "nonsense"}}, "json_schema does not compile: .*nonsense"),
    ({"json_schema": "{not json"}, "json_schema is not JSON"),
    ({"json_schema": [1, 2]}, "json_schema must be a JSON object"),
    ({"grammar": Grammar("lark", "start: (")}, "lark does not compile"),
    ({"grammar": Grammar("regex", "")}, "must be non-empty text"),
    ({"grammar": Grammar("xml", "<a/>")},
     "grammar kind must be one of json_schema, lark, regex, structural_tag"),
    ({"grammar": "start: 'a'"}, "grammar must be a constraints.Grammar"),
    ({"json_schema": {"type": "object"}, "grammar": Grammar("regex", "a")}, "not both"),
], ids=["schema-type", "schema-not-json", "schema-not-object", "lark-syntax", "regex-empty",
        "unknown-kind", "not-a-grammar", "both"])
def test_bad_schemas_and_grammars_are_refused_before_any_cell(runner, kwargs, message):
    free, ids = runner.cache.free_cells, runner.cache.n_sequences
    with pytest.raises(InvalidConfigError, match=message):
        runner.generate([runner.tokenizer.encode(PROMPT)], 8, **kwargs)
    assert (runner.cache.free_cells, runner.cache.n_sequences) == (free, ids)


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, '"not"'),
    ({"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {}}}}, '"if"'),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, '"dependentRequired"'),
    ({"type": "array", "contains": {"type": "integer"}}, '"contains"'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '"uniqueItems"'),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "allOf with multiple options"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "falling back to anyOf"),
    ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "required": ["b"]}, 'requires "b", which it does not allow'),
    ({"required": ["b"]}, 'has "required" but no "type": "object"'),
], ids=["not", "if", "dependentRequired", "contains", "uniqueItems", "allOf", "oneOf-overlap",
        "remote-ref", "required-forbidden", "required-untyped"])
def test_what_the_grammar_engine_would_not_enforce_is_refused_every_time(runner, schema, named):
    """No schema is taken and then only partly followed: each keyword XGrammar
    would skip is named in the error, the second time too (XGrammar caches
    what it compiled)."""
    for _ in range(2):
        with pytest.raises(InvalidConfigError, match="would not enforce|does not enforce|requires|"
                                                      "has \"required\""):
            runner.constraint(Grammar("json_schema", schema))
        try:
            runner.constraint(Grammar("json_schema", schema))
        except InvalidConfigError as e:
            assert named in str(e), str(e)
    # What the engine does enforce still compiles.
    runner.constraint(Grammar("json_schema", {"allOf": [{"type": "string"}]}))
    runner.constraint(Grammar("json_schema", {"type": "array", "uniqueItems": False}))


def _accepts(runner, compiled, text):
    """Whether the compiled grammar takes ``text`` whole, then EOS."""
    matcher = compiled.matcher()
    for t in runner.tokenizer.encode(text, add_special_tokens=False) + [runner.info.eos_ids[0]]:
        if not matcher.mask()[t]:
            return False
        matcher.advance(t)
    return matcher.complete


def test_a_pydantic_tagged_union_compiles_and_holds_each_option(runner):
    """pydantic writes Union[Cat, Dog] with a discriminator as a oneOf of
    $refs, whose options XGrammar cannot prove disjoint; ours can (each
    requires "kind" held to its own const), so the schema compiles, as anyOf.
    Oracle: jsonschema on each text."""
    from typing import Literal, Optional, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        name: Optional[str] = None

    schema = Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema)
    compiled = runner.constraint(Grammar("json_schema", schema))
    for text in ['{"pet": {"kind": "cat", "lives": 9}}', '{"pet": {"kind": "dog", "good": true}}',
                 '{"pet": {"kind": "dog", "lives": 9}}', '{"pet": {"kind": "cow", "lives": 1}}',
                 '{"pet": {"kind": "cat", "lives": 9}, "name": "Tom"}', '{"pet": 5}']:
        assert _accepts(runner, compiled, text) == \
            jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), text


def test_required_names_that_properties_does_not_list_are_enforced(runner):
    """XGrammar enforces "required" only for listed properties; ours lists
    the others (held to additionalProperties). The oracle: jsonschema on
    every text, fed token by token."""
    schemas = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
               {"type": "object", "required": ["x"]},
               {"type": "object", "properties": {"a": {"type": "integer"}},
                "additionalProperties": {"type": "string"}, "required": ["b"]}]
    texts = ['{}', '{"a": 1}', '{"b": 2}', '{"a": 1, "b": 2}', '{"a": 1, "b": "s"}', '{"x": 1}',
             '{"x": null, "y": 2}', '{"b": "s"}']
    for schema in schemas:
        compiled = runner.constraint(Grammar("json_schema", schema))
        for text in texts:
            assert _accepts(runner, compiled, text) == \
                jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), (schema, text)


def test_cli_json_schema_and_grammar_files(default_pte, tmp_path, capsys):
    from executorch_cellcache.cli import main

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["bounds"]))
    assert main(["generate", str(default_pte), "--prompt", PROMPT, "--n", "3",
                 "--temperature", "1", "--max-new-tokens", "64",
                 "--json-schema", str(schema), "--json"]) == 0
    samples = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert len(samples) == 3
    for text in samples:
        jsonschema.validate(json.loads(text), SCHEMAS["bounds"])
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert main(["generate", str(default_pte), "--prompt", PROMPT, "--grammar",
                 str(grammar)]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    assert main(["generate", str(default_pte), "--prompt", "x", "--json-schema", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cellcache generate: error: the json_schema does not compile: Unsupported "
                   "type \"nope\""], err


def test_every_eos_id_ends_a_complete_grammar(runner):
    """A program with several EOS ids (Llama 3's <|eot_id|> and <|end_of_text|>):
    once the grammar is complete each of them is allowed (and nothing else:
    "yes" ends the sample on its last token), and choosing one that is not
    the first ends it as the first does."""
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


def test_masks_equal_a_brute_force_oracle_over_random_walks(runner):
    """Over seeded random walks of the regex "[a-z ]{1,12}" (a step's matchers
    filled together by ``fill_masks``, samples starting at different steps,
    some ending with the second EOS id), each mask is exactly the oracle's,
    written from the regex: a token whose bytes are all a-z or space and keep
    the text at 12 bytes or fewer, and the EOS ids once the text has a byte;
    and each equals the matcher's own ``mask()``. A sample ends on the 12th
    byte (nothing else may follow) or on an EOS id."""
    from executorch_cellcache.runtime.constraints import Vocabulary, fill_masks

    size, eos = runner.info.vocab_size, runner.info.eos_ids[0]
    other = next(t for t in range(size) if t != eos and runner.tokenizer.decode([t]) == "")
    vocab = Vocabulary(runner.info.tokenizer_json, size, [eos, other])
    constraint = vocab.compile(Grammar("regex", "[a-z ]{1,12}"))
    letters = set(b"abcdefghijklmnopqrstuvwxyz ")
    tok = runner.tokenizer
    piece = [b"" if tok.is_special(t) else tok.token_bytes(t) for t in range(size)]

    def oracle(length):
        allowed = np.array([len(b) > 0 and set(b) <= letters and length + len(b) <= 12
                            for b in piece])
        allowed[[eos, other]] = length > 0
        return allowed

    rng = np.random.default_rng(0)
    live, ended, other_ends, full = [], 0, 0, 0
    for step in range(400):
        if step % 3 == 0 and ended + len(live) < 24:
            live.append([constraint.matcher(), 0])
        if not live:
            if ended >= 24:
                break
            continue
        rows = np.zeros((len(live), size), dtype=bool)
        fill_masks([m for m, _ in live], rows)
        for (m, length), row in zip(live, rows):
            assert np.array_equal(row, oracle(length)), length
            assert np.array_equal(m.mask(), row)
        for entry, row in zip(live, rows):
            m, length = entry
            if row[eos] and rng.random() < 0.3:
                token = other if rng.random() < 0.5 else eos
                other_ends += token == other
            else:
                token = int(rng.choice(np.flatnonzero(row & ~np.isin(np.arange(size),
                                                                     [eos, other]))))
                entry[1] += len(piece[token])
            m.advance(token)
            assert m.complete == (token in (eos, other) or entry[1] == 12)
            full += entry[1] == 12 and token not in (eos, other)
        ended += sum(m.complete for m, _ in live)
        live = [e for e in live if not e[0].complete]
    assert ended == 24 and other_ends and full, (ended, other_ends, full)


def _choice_rows(seed):
    """A step's groups for choose_tokens: constrained greedy and sampled (n=2)
    groups with sparse, dense and empty masks, some asking for logprobs,
    between unconstrained groups (one with a draft)."""
    from spec.sampling import SamplingParams

    size = 4096
    rng = np.random.default_rng(seed)
    greedy, greedy_lp = SamplingParams(), SamplingParams(logprobs=3)
    hot, hot_lp = SamplingParams(temperature=0.8, seed=seed), \
        SamplingParams(temperature=1.0, top_k=50, seed=seed + 1, logprobs=2, n=2)

    def mask(p):
        return rng.random(size) < p

    logits = rng.standard_normal((14, size)).astype(np.float32)
    groups = []   # (params, generators, draft?, mask)
    groups.append(((greedy, [None]), None))
    for p in (0.001, 0.5, 0.99):   # sparse, dense (argmax often not allowed), nearly all
        groups.append(((greedy, [None]), mask(p)))
        groups.append(((greedy_lp, [None]), mask(p)))
    groups.append(((hot, [hot.generator(0)]), mask(0.01)))
    groups.append(((hot_lp, [hot_lp.generator(0), hot_lp.generator(1)]), mask(0.7)))
    groups.append(((greedy, [None], [5, 6], None), None))   # a draft: 3 rows
    groups.append(((greedy, [None]), np.zeros(size, bool)))   # nothing allowed
    groups.append(((hot, [hot.generator(3)]), None))
    rows = [g for g, _ in groups]
    masks = [m for _, m in groups]
    # a sparse row whose argmax is allowed, one whose allowed tokens are all -inf; a
    # dense row whose argmax is a NaN outside the mask, one with a NaN inside it
    logits[1, int(np.argmax(logits[1]))] = 50.0
    masks[1][int(np.argmax(logits[1]))] = True
    logits[2, masks[2]] = -np.inf
    logits[3, 7] = np.nan
    masks[3][7] = False
    logits[5, 9] = np.nan
    masks[5][9] = True
    return logits, rows, masks


@pytest.mark.parametrize("seed", range(4))
def test_masked_choice_is_the_choice_over_masked_logits(seed):
    """sampling.choose_tokens with masks (greedy rows without a masked copy,
    sparse masks applied by index) picks what it picks from the logits with
    every disallowed token set to -inf (the oracle: np.where), and reports
    logprobs of the unmasked rows; it refuses what it refuses."""
    from spec import sampling

    logits, rows, masks = _choice_rows(seed)
    masked, at = logits.copy(), 0
    for r, m in zip(rows, masks):
        if m is not None:
            masked[at] = np.where(m, logits[at], np.float32(-np.inf))
        at += 1 + len(r[2]) if len(r) > 2 else 1
    picks, logprobs = sampling.choose_tokens(logits, rows, masks)
    with np.errstate(invalid="ignore"):   # its logprobs of an all -inf row: not compared
        want, _ = sampling.choose_tokens(masked, _choice_rows(seed)[1])   # fresh generators
    assert picks == want and all(isinstance(t, int) for t in picks)
    for token, lp, (params, row) in zip(picks, logprobs, _flat(rows)):
        if params.logprobs is not None and row is not None:
            assert lp == sampling.token_logprobs(logits[row], token, params.logprobs)
    with pytest.raises(InvalidConfigError, match="one row per plan row"):
        sampling.choose_tokens(logits[1:], rows, masks)
    masks[next(g for g, r in enumerate(rows) if len(r) > 2)] = np.ones(logits.shape[1], bool)
    with pytest.raises(InvalidConfigError, match="cannot carry a draft"):
        sampling.choose_tokens(logits, rows, masks)


def _flat(rows):
    """(params, logits row) per pick, up to the first group with a draft (how
    many tokens it emits is known only after choosing)."""
    at = 0
    for r in rows:
        if len(r) > 2 and r[2]:
            return   # picks after a draft group's do not line up with this walk
        for _ in r[1]:
            yield r[0], at
        at += 1
