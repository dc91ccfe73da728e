"""Structured output across architectures (issue #26's "must show"): under each
of five bounded JSON schemas, 100 of 100 samples at temperature 1 parse as
JSON and validate with ``jsonschema`` (an independent validator, not the
grammar layer), for

- tiny random-weight Llama, Qwen3, Mistral and Gemma3 programs (fp32, 2
  layers, hidden 64, tests/model_configs.py with vocab_size 1024): each saved
  as a checkpoint folder with the default model's tokenizer files beside it
  (export reads tokenizer.json from the folder into the program's metadata,
  which is where the Runner builds its grammar vocabulary from), exported
  once per module;
- the embedded default model (its shipped checkpoint, exported once per module
  with a larger cache than conftest's ``default_pte``: see below),

in three ways per (program, schema), one generate call each, seeded: 100
prompts with one sample each; 25 prompts with n=4 forks each; and those 25
prompts again (another seed), which must all come from the prefix cache in
full (``last_stats.cached_tokens``, ``prefix_hit_rate`` and the prefix cache's
hit count). Every sample must finish before max_new_tokens: a sample cut at
the length limit fails the test. (A sample ends with finish reason "stop" on
the token that completes its grammar: the matcher stops there when nothing
but the end of text could follow, so no EOS token is appended; a
sample of max_new_tokens tokens is counted as cut.)

Teeth: the same sampling without a schema validates against none of the
schemas (so a mask that was not applied would fail the tests above).

Cache geometry: admission reserves each request's worst case (prompt + n *
(max_new_tokens - 1) cells), so 512 cells (``default_pte``) would run a
few samples at a time and evict the first pass's prefixes before the second
pass reads them; every program here has N_CELLS cells and STEP tokens a step,
enough that a pass of 100 samples runs at once and the third pass's prompts
are all still cached (a bigger cache costs neither export time nor step time:
a step reads only its sequences' cells).
"""

import json
import shutil

import jsonschema
import pytest

from model_configs import make_model

from executorch_cellcache import Runner, export
from executorch_cellcache.exporting import default_model

pytestmark = pytest.mark.slow   # exports five programs (~15-30 s each)

N_CELLS = 32768
STEP = 256
WINDOW = 16
# Far above the longest sample seen (68 tokens: "nested", whose two 8-character strings
# can take 4 byte tokens a character, more with \u escapes: no schema with strings has
# a small hard bound in tokens).
MAX_NEW = 128
SAMPLES = 100
FORKS = 4
ARCHS = ("llama", "qwen3", "mistral", "gemma3")
PROGRAMS = ARCHS + ("default",)
LONGEST = {}          # what -> (tokens, text) of the longest sample, printed with -s
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Bounded: strings have maxLength, arrays maxItems, numbers a multipleOf (a number's
# fraction is otherwise unbounded: a random model under the mask writes digits for
# as long as it likes). multipleOf 0.25: exact in binary, so jsonschema's float
# division check is exact too (0.01 is not: 0.29 / 0.01 = 28.999999999999996).
SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {
            "user": {
                "type": "object", "additionalProperties": False,
                "required": ["name", "address"],
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "address": {
                        "type": "object", "additionalProperties": False,
                        "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 8},
                                       "zip": {"type": "integer", "minimum": 0,
                                               "maximum": 99999}}}}},
            "active": {"type": "boolean"}}},
    "arrays": {
        "type": "object", "additionalProperties": False, "required": ["ids", "words"],
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                               "maximum": 999},
                    "minItems": 2, "maxItems": 5},
            "words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                      "minItems": 1, "maxItems": 3}}},
    "enums": {
        "type": "object", "additionalProperties": False,
        "required": ["color", "size", "level"],
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "level": {"enum": [1, 2, 3, None, True]}}},
    "bounds": {
        "type": "object", "additionalProperties": False,
        "required": ["age", "delta", "count", "ratio"],
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "delta": {"type": "integer", "minimum": -50, "maximum": -10},
            "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "ratio": {"type": "number", "minimum": -2.5, "maximum": 2.5,
                      "multipleOf": 0.25}}},
    "optional": {
        "type": "object", "additionalProperties": False, "required": ["title"],
        "properties": {
            "title": {"type": "string", "maxLength": 12},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
            "draft": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
}


def _tiny_folder(arch, folder):
    """``arch`` at test size with the default model's 1024-token vocabulary and
    special ids (<s> 0, </s> 1), 2 layers, saved with its tokenizer files.
    Sliding windows of WINDOW positions, not model_configs' 6: with 6, Mistral
    (both layers sliding) no longer sees the prompt once the schema's forced
    opening ('{"user": {"name": "') has filled its window, so every prompt's
    sample j draws the same text from the same seed. WINDOW is still shorter
    than prompt + sample, so the windows hide positions."""
    overrides = {"vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 1,
                 "pad_token_id": None, "num_hidden_layers": 2, "sliding_window": WINDOW}
    if arch == "qwen3":
        overrides.update(max_window_layers=1, layer_types=["full_attention",
                                                           "sliding_attention"])
    if arch == "gemma3":
        overrides.update(layer_types=["sliding_attention", "full_attention"])
    make_model(arch, **overrides).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model.CHECKPOINT / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """get(name) -> Runner of that program, exported on first use."""
    out = tmp_path_factory.mktemp("structured")
    cache = {}

    def get(name):
        if name not in cache:
            source = None if name == "default" else _tiny_folder(name, out / name)
            result = export(source, out / f"{name}.pte", n_cells=N_CELLS,
                            max_tokens_per_step=STEP)
            assert result.info.vocab_size == 1024 and result.info.eos_ids == [1]
            if name in ("qwen3", "mistral", "gemma3"):
                assert WINDOW in result.info.windows, result.info.windows
            assert result.info.tokenizer_json == \
                (default_model.CHECKPOINT / "tokenizer.json").read_text(encoding="utf-8")
            cache[name] = Runner(result.path)
        return cache[name]

    return get


def _prompts(runner, label, count):
    """Distinct prompts whose last tokens differ (a sliding layer sees only the
    last WINDOW positions; the same seed gives every prompt's sample j the same
    draws, so prompts must differ where the model looks)."""
    return [runner.tokenizer.encode(f"{label}: answer in JSON, record {i}:")
            for i in range(count)]


def _check_samples(runner, out, schema, what):
    """Every sample stopped before max_new_tokens and its text validates;
    returns the texts. LONGEST[what] records the longest sample."""
    texts = []
    for p, samples in enumerate(out):
        for j, tokens in enumerate(samples):
            text = runner.tokenizer.decode(tokens)
            assert 0 < len(tokens) < MAX_NEW, \
                f"{what}: prompt {p} sample {j} did not finish ({len(tokens)} tokens): {text!r}"
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                pytest.fail(f"{what}: prompt {p} sample {j} {text!r}: {e}")
            texts.append(text)
            if len(tokens) > LONGEST.get(what, (0, ""))[0]:
                LONGEST[what] = (len(tokens), text)
    assert len(texts) == SAMPLES
    return texts


@pytest.mark.parametrize("schema_name", list(SCHEMAS))
@pytest.mark.parametrize("program", PROGRAMS)
def test_100_of_100_samples_validate_alone_forked_and_from_the_prefix_cache(
        runners, program, schema_name):
    runner = runners(program)
    schema = SCHEMAS[schema_name]
    label = f"{program} {schema_name}"

    # 100 prompts, one sample each: one call.
    out = runner.generate(_prompts(runner, f"{label} alone", SAMPLES), MAX_NEW,
                          temperature=1.0, seed=1, json_schema=schema)
    LONGEST.clear()
    texts = _check_samples(runner, out, schema, "n=1")
    distinct, seen = {"n=1": len(set(texts))}, set(texts)

    # 25 prompts x 4 forks, then the same 25 prompts again: all from the prefix cache.
    forked = _prompts(runner, f"{label} forked", SAMPLES // FORKS)
    full = [len(p) - 1 for p in forked]   # the most a prompt can reuse: all but its last
    for attempt, seed in enumerate((2, 3)):
        hits = runner.prefix_cache.stats.hits
        out = runner.generate(forked, MAX_NEW, n=FORKS, temperature=1.0, seed=seed,
                              json_schema=schema)
        what = f"n={FORKS}, " + ("prefix cache hot" if attempt else "first pass")
        texts = _check_samples(runner, out, schema, what)
        distinct[what] = len(set(texts))
        seen.update(texts)
        # The forks of a prompt share its cells and still differ.
        assert sum(len(set(map(tuple, s))) > 1 for s in out) > 0, what
        cached = runner.last_stats.cached_tokens
        if attempt:   # every prompt from the prefix cache, in full
            assert cached == full, cached
            assert runner.last_stats.prefix_hit_rate == 1.0
            assert runner.prefix_cache.stats.hits - hits == len(forked)
        else:         # new prompts: at most their shared opening was cached
            assert all(c < f for c, f in zip(cached, full)), cached
    print(f"\n[structured] {label}: distinct samples of {SAMPLES}: {distinct}; longest "
          f"(tokens of max_new_tokens {MAX_NEW}, text): {LONGEST}")
    # Sampled, not one answer: over the 300 samples (a model's enum choice can be so peaky
    # that 100 samples of one pass agree).
    assert len(seen) > 1, distinct
    assert runner.cache.free_cells + runner.prefix_cache.reclaimable_cells() == N_CELLS


@pytest.mark.parametrize("program", PROGRAMS)
def test_without_the_schema_no_sample_validates(runners, program):
    """The same sampling (prompts, seed, temperature, length) without a mask
    gives text that validates against none of the schemas."""
    runner = runners(program)
    out = runner.generate(_prompts(runner, f"{program} nested alone", SAMPLES), MAX_NEW,
                          temperature=1.0, seed=1)
    valid = []
    for samples in out:
        text = runner.tokenizer.decode(samples[0])
        try:
            value = json.loads(text)
        except ValueError:
            continue
        valid += [name for name, schema in SCHEMAS.items()
                  if jsonschema.Draft202012Validator(schema).is_valid(value)]
    assert valid == []


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "unit": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                            "b": {"type": "integer", "minimum": -99, "maximum": 99}}}}}]


@pytest.mark.parametrize("program", PROGRAMS)
def test_forced_tool_calls_parse_and_validate(runners, program):
    """tool_choice "required" (the grammar the server forces, Hermes format;
    one call: with parallel calls allowed a random model may chain calls to the
    length limit) and a named function: every sampled reply parses into a call
    whose arguments validate against its tool's parameters."""
    from executorch_cellcache.runtime.constraints import Grammar
    from executorch_cellcache.serving.tool_calls import HERMES, tools_from_request

    runner = runners(program)
    tools = tools_from_request(TOOLS)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for grammar, names in ((HERMES.grammar(tools, parallel=False), set(schemas)),
                           (HERMES.grammar(tools[1:], parallel=False), {"add"})):
        out = runner.generate(_prompts(runner, f"{program} tools", 10), MAX_NEW,
                              temperature=1.0, seed=4, grammar=Grammar("structural_tag", grammar))
        for samples in out:
            tokens = samples[0]
            assert len(tokens) < MAX_NEW, "cut at the length limit"
            calls = HERMES.parse(runner.tokenizer.decode(tokens)).calls
            assert len(calls) == 1 and calls[0].name in names
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), schemas[c.name])
