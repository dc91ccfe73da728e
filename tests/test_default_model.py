"""The embedded default model's checkpoint and its corpus split (no export):
the split rule is fixed and shared, the tokenizer and the batches of
scripts/train_default_model.py are deterministic, the shipped folder is a
Hugging Face checkpoint transformers loads as a GQA Llama, and the eval
windows follow their stated rule."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executorch_cellcache.exporting import default_model
from executorch_cellcache.runtime.evaluate import scored_windows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_default_model as training  # noqa: E402


def test_split_holds_out_every_tenth_topic_and_covers_the_corpus():
    from pydoc_data.topics import topics

    names = sorted(topics)
    train, heldout = default_model.split_documents()
    expected_heldout = [topics[n] for i, n in enumerate(names) if i % 10 == 5]
    assert heldout == expected_heldout
    assert train == [topics[n] for i, n in enumerate(names) if i % 10 != 5]
    assert default_model.heldout_text() == "\n\n".join(expected_heldout)
    assert 20_000 < len(default_model.heldout_text()) < 0.15 * sum(map(len, topics.values()))


def _tokenizer_json_in_a_fresh_process():
    code = ("import sys; sys.path.insert(0, 'scripts'); import train_default_model as t; "
            "print(t.train_tokenizer(t.default_model.split_documents()[0], 1024).to_str())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def test_tokenizer_training_is_deterministic_and_gives_the_shipped_tokenizer():
    # Two processes (hash seeds differ between processes) and the shipped file.
    first, second = _tokenizer_json_in_a_fresh_process(), _tokenizer_json_in_a_fresh_process()
    shipped = json.loads((default_model.CHECKPOINT / "tokenizer.json").read_text())
    assert first == second
    assert first["model"]["vocab"] == shipped["model"]["vocab"]
    assert first["model"]["merges"] == shipped["model"]["merges"]


def test_training_batches_depend_only_on_the_seed():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(default_model.CHECKPOINT / "tokenizer.json"))
    train, _ = default_model.split_documents()
    stream = training.token_stream(tok, train)
    assert stream[0] == tok.token_to_id("<s>")
    assert int((stream == tok.token_to_id("</s>")).sum()) == len(train)

    def offsets(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 1000, (8,), generator=g).tolist() for _ in range(3)]

    assert offsets(0) == offsets(0) != offsets(1)


def test_tool_chats_score_the_assistant_replies_and_nothing_else():
    """Each tool-use chat of the training script is the chat template's text;
    the scored tokens spell exactly its assistant replies (what follows each
    "Assistant:" up to and with its EOS): calls and text replies both."""
    from tokenizers import Tokenizer

    from executorch_cellcache.exporting import tool_task

    tok = Tokenizer.from_file(str(default_model.CHECKPOINT / "tokenizer.json"))
    train, _ = default_model.split_documents()
    ids, starts, scored = training.tool_examples(tok, train, 40, 7, 256)
    bounds = starts.tolist() + [len(ids)]
    names, kinds = {t.name for t in tool_task.TOOLS}, set()
    for start, end in zip(bounds, bounds[1:]):
        if end - start > 256:    # the last one kept: the stream after it was dropped
            break
        chat = ids[start:end].tolist()
        text = tok.decode(chat, skip_special_tokens=False)
        got = tok.decode([t for t, s in zip(chat, scored[start:end].tolist()) if s],
                         skip_special_tokens=False)
        replies = re.findall(r"Assistant:(.*?</s>)", text, flags=re.S)
        assert text.startswith("<s>Tools:\n") and replies and got == "".join(replies), text
        kinds.add("<tool_call>" in got)
        assert set(re.findall(r'"name": "(\w+)"', got)) <= names
    assert kinds == {True, False}


def test_the_shipped_template_renders_a_tool_exchange_as_transformers_does():
    from transformers import AutoTokenizer

    from executorch_cellcache.serving.chat_template import ChatTemplate

    hf = AutoTokenizer.from_pretrained(default_model.CHECKPOINT, local_files_only=True)
    assert hf.chat_template == training.CHAT_TEMPLATE
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    chat = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "sunny"}]
    ours = ChatTemplate(hf.chat_template, None, "<s>", "</s>").render(chat, tools=[tool])
    assert ours == hf.apply_chat_template(chat, tools=[tool], tokenize=False,
                                          add_generation_prompt=True)
    assert ours.endswith('Assistant:<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Oslo"}}\n</tool_call></s>\nTool: sunny\nAssistant:')


@pytest.mark.parametrize("argv", [["--qat-steps", "-1"], ["--steps", "0"], ["--qat-lr", "nan"],
                                  ["--lr", "-0.001"], ["--qat-lr", "0"]])
def test_training_refuses_counts_and_rates_that_cannot_train(argv, capsys):
    with pytest.raises(SystemExit, match="^2$") as e:  # argparse's usage-error exit
        training.parse_args(argv)
    assert e.value.code == 2
    assert f"argument {argv[0]}: must be" in capsys.readouterr().err


def test_training_refuses_row_fractions_over_one(capsys):
    with pytest.raises(SystemExit, match="^2$"):
        training.parse_args(["--copy-fraction", "0.8", "--tool-fraction", "0.3"])
    assert "add up to more than all the rows" in capsys.readouterr().err


def test_the_shipped_checkpoint_records_its_quantization_aware_fine_tune():
    config = json.loads((default_model.CHECKPOINT / "config.json").read_text())
    assert config["quantization_aware_training"] == training.QAT_QUANTIZE
    assert training.QAT_QUANTIZE["weight_scales"] == "minmax"  # torchao QAT's fake quantizers


def test_the_shipped_checkpoint_is_a_gqa_llama_transformers_loads():
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = default_model.CHECKPOINT
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert (folder / "model.safetensors").stat().st_size < 8_000_000
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok.bos_token_id == config.bos_token_id and tok.eos_token_id == config.eos_token_id
    assert tok("for").input_ids[0] == config.bos_token_id
    assert GenerationConfig.from_pretrained(folder).eos_token_id == config.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "What is a tuple?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<s>User: What is a tuple?\nAssistant:"
    readme = (folder / "README.md").read_text()
    for fact in ("python scripts/train_default_model.py", "pydoc_data.topics", "Seed 0",
                 "Final training loss", "perplexity", "PSF License"):
        assert fact in readme


@pytest.mark.parametrize("n, window, stride", [
    (10, 6, 3), (2, 2, 1), (100, 16, 16), (100, 16, 1), (37, 64, 8), (50, 7, 5)])
def test_scored_windows_follow_the_stated_rule(n, window, stride):
    windows = scored_windows(n, window, stride)
    # Windows start at 0, stride, ...; each ends at begin + window or the text's end.
    assert [b for b, _, _ in windows] == list(range(0, stride * len(windows), stride))
    assert all(e == min(b + window, n) for b, e, _ in windows)
    assert windows[-1][1] == n
    scored = [t for _, e, first in windows for t in range(first, e)]
    assert len(scored) == len(set(scored))          # no token twice
    assert all(first > b for b, _, first in windows)  # a window's first token has no context
    if stride < window:
        assert sorted(scored) == list(range(1, n))  # every token but the first
    else:  # no overlap: each window's own first token is lost
        assert sorted(scored) == [t for t in range(1, n) if t % window != 0]


def test_scored_windows_docstring_example():
    assert scored_windows(10, 6, 3) == [(0, 6, 1), (3, 9, 6), (6, 10, 9)]


def test_a_non_editable_install_ships_the_checkpoint(tmp_path):
    # setup.py's package_data, as `pip install .` applies it (build_py copies the
    # package's Python files and data; the C++ extension is another step).
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    shipped = tmp_path / "executorch_cellcache" / "exporting" / default_model.CHECKPOINT.name
    expected = sorted(p.name for p in default_model.CHECKPOINT.iterdir())
    assert sorted(p.name for p in shipped.iterdir()) == expected
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert name in expected


def test_python_export_prints_no_third_party_warnings(tmp_path):
    """export() from Python is as quiet as `cellcache export`: torch.export's and
    executorch's internal deprecation and buffer-mutation warnings are not the
    caller's to act on (a new user took them for a broken example)."""
    import warnings

    from executorch_cellcache import export

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export(None, tmp_path / "m.pte", n_cells=64, max_tokens_per_step=8)
    noisy = [w for w in seen if any(m in str(w.filename) for m in ("torch", "executorch"))]
    assert not noisy, [str(w.message)[:120] for w in noisy]
    with pytest.warns(UserWarning, match="the caller's own"):  # filters restored afterwards
        warnings.warn("the caller's own", UserWarning)
