"""``"strict": true`` in ``response_format.json_schema``
(serving/strict_schema.py): the schema rewrite, and what it does to the token
masks of the compiled grammar (the C++ grammar layer, XGrammar, over the default model's
tokenizer; no program needed): a strict object admits no key it does not
name and requires every key it names; without strict the same schema is
compiled as given (extra keys allowed, nothing required)."""

import copy

import pytest

from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.constraints import Grammar, Vocabulary
from executorch_cellcache.runtime.tokenizer import HFTokenizer
from executorch_cellcache.serving.strict_schema import strict_schema

LOOSE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
EOS = 1


def test_every_object_is_closed_and_requires_every_property_at_any_depth():
    schema = {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string"}}},
            "tags": {"type": "array", "items": {"type": "object", "required": [],
                                                "properties": {"k": {"type": "string"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                                 {"type": "null"}]},
            "maybe": {"type": ["object", "null"], "properties": {"y": {"type": "number"}}},
            "point": {"$ref": "#/$defs/point"},
        },
        "required": ["user"],
        "$defs": {"point": {"properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x"]}},
    }
    given = copy.deepcopy(schema)
    closed = {"additionalProperties": False}
    assert strict_schema(schema) == {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"name": {"type": "string"}},
                     "required": ["name"], **closed},
            "tags": {"type": "array", "items": {"type": "object", "required": ["k"],
                                                "properties": {"k": {"type": "string"}},
                                                **closed}},
            "either": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}},
                                  "required": ["x"], **closed},
                                 {"type": "null"}]},
            "maybe": {"type": ["object", "null"], "properties": {"y": {"type": "number"}},
                      "required": ["y"], **closed},
            "point": {"$ref": "#/$defs/point"},
        },
        "required": ["user", "tags", "either", "maybe", "point"],
        "$defs": {"point": {"properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x", "y"], **closed}},
        **closed,
    }
    assert schema == given   # the argument is left as it was


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 4},
    {"type": "array", "items": {"type": "integer"}},
    {"enum": ["a", "b"]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "additionalProperties": False},
], ids=["string", "array", "enum", "already-strict"])
def test_what_is_strict_already_or_no_object_is_left_as_it_is(schema):
    assert strict_schema(schema) == schema


def test_required_names_beyond_the_properties_are_kept():
    out = strict_schema({"type": "object", "properties": {"a": {}}, "required": ["z"]})
    assert out["required"] == ["a", "z"]


@pytest.mark.parametrize("schema, where, value", [
    ({"type": "object", "additionalProperties": True}, "#", "True"),
    ({"type": "object", "properties": {"m": {"type": "object",
                                             "additionalProperties": {"type": "string"}}}},
     "#/properties/m", "{'type': 'string'}"),
    ({"type": "array", "items": {"properties": {}, "additionalProperties": {}}},
     "#/items", "{}"),
], ids=["true", "a-schema", "empty-schema"])
def test_an_object_open_to_other_keys_is_refused(schema, where, value):
    with pytest.raises(ValueError, match=f"^strict json_schema: {where} sets additionalProperties "
                                         f"to {value}; strict mode allows only the keys"):
        strict_schema(schema)


# ------------------------------------------------------------------ what the grammar allows


@pytest.fixture(scope="module")
def vocab():
    text = (CHECKPOINT / "tokenizer.json").read_text()
    return HFTokenizer(text), Vocabulary(text, vocab_size=1024, eos_ids=[EOS])


def _matcher_after(vocab, schema, prefix):
    tok, v = vocab
    m = v.compile(Grammar("json_schema", schema)).matcher()
    for t in tok.encode(prefix, add_special_tokens=False):
        m.advance(t)
    return m


def _next_texts(vocab, schema, prefix):
    """The texts of the tokens the grammar allows after ``prefix``."""
    tok, _ = vocab
    allowed = _matcher_after(vocab, schema, prefix).mask().nonzero()[0]
    return {tok.decode([int(t)]) for t in allowed if t != EOS}


def _accepts(vocab, schema, text):
    try:
        m = _matcher_after(vocab, schema, text)
    except RuntimeError:   # a token the grammar refused
        return False
    return m.complete or bool(m.mask()[EOS])


def test_a_strict_object_takes_no_key_it_does_not_name(vocab):
    both = '{"a": 1, "b": "x"'
    assert "," in _next_texts(vocab, LOOSE, both)        # as given: another key may follow
    assert _next_texts(vocab, strict_schema(LOOSE), both) == {"}"}
    extra = '{"a": 1, "b": "x", "c": 2}'
    assert _accepts(vocab, LOOSE, extra)
    assert not _accepts(vocab, strict_schema(LOOSE), extra)
    assert _accepts(vocab, strict_schema(LOOSE), '{"a": 1, "b": "x"}')


def test_a_strict_object_requires_every_key_it_names(vocab):
    only_a = '{"a": 1'
    assert "}" in _next_texts(vocab, LOOSE, only_a)      # as given: nothing is required
    assert not any(t.startswith("}") for t in _next_texts(vocab, strict_schema(LOOSE), only_a))
    for text in ("{}", '{"a": 1}', '{"b": "x"}'):
        assert _accepts(vocab, LOOSE, text), text
        assert not _accepts(vocab, strict_schema(LOOSE), text), text
    # JSON is written with the properties in the schema's order: the first key is "a".
    assert _next_texts(vocab, strict_schema(LOOSE), '{"') == {"a"}
