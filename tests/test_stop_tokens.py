"""Stop tokens and chat templates a checkpoint folder carries (issue 12).

A chat model lists its end-of-turn tokens in generation_config.json, often not
in config.json (ExecuTorch #10365: exporting only config.json's EOS makes such
a chat never stop). Export takes the union; both runners stop on any of them.
The folder's chat template travels in the .pte; a program exported before the
template field existed still loads (no template).

One tiny Llama checkpoint folder is exported once per module: config.json's
EOS is 2, generation_config.json lists [2, 7, 9]. The prompt is one whose
greedy continuation (transformers eager, the oracle) reaches 7 or 9 before 2.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from model_configs import make_model

import executorch_cellcache as ecc
from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.errors import InvalidConfigError
from executorch_cellcache.exporting import checkpoint_files

GENERATION_EOS = [2, 7, 9]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
    "{% if add_generation_prompt %}<assistant>{% endif %}"
MAX_NEW = 10


def _greedy(model, prompt, k):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prompt_stopping_on_a_generation_eos(model):
    """A prompt whose greedy continuation reaches 7 or 9 (from the 2nd token
    on) before any 2: only generation_config.json's ids can stop it."""
    rng = random.Random(0)
    for _ in range(500):
        prompt = [rng.randrange(10, 320) for _ in range(4)]
        gen = _greedy(model, prompt, MAX_NEW)
        hits = [i for i, t in enumerate(gen) if t in GENERATION_EOS]
        if hits and hits[0] >= 1 and gen[hits[0]] != 2:
            return prompt, gen
    raise AssertionError("no prompt reaches a generation-config EOS")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(.pte exported from the folder, prompt, oracle's greedy continuation)."""
    model = make_model("llama")
    folder = tmp_path_factory.mktemp("stop_tokens") / "checkpoint"
    model.save_pretrained(folder)
    gen_path = folder / "generation_config.json"
    gen_config = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen_config["eos_token_id"] = GENERATION_EOS
    gen_path.write_text(json.dumps(gen_config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    pte = folder.parent / "m.pte"
    ecc.export(folder, pte, n_cells=128, max_tokens_per_step=16)
    oracle = make_model("llama")
    oracle.set_attn_implementation("eager")
    prompt, greedy = _prompt_stopping_on_a_generation_eos(oracle)
    return pte, prompt, greedy


@pytest.mark.slow
def test_export_carries_the_union_of_eos_ids_and_the_chat_template(exported):
    pte, _, _ = exported
    info = ecc.Runner(pte).info
    assert info.eos_ids == GENERATION_EOS
    assert info.chat_template == TEMPLATE


@pytest.mark.slow
def test_both_runners_stop_on_a_generation_config_eos(exported):
    pte, prompt, greedy = exported
    cut = next(i for i, t in enumerate(greedy) if t in GENERATION_EOS)
    [[tokens]] = ecc.Runner(pte).generate([prompt], max_new_tokens=MAX_NEW)
    assert tokens == greedy[:cut + 1]

    exe = subprocess.run([sys.executable, "-m", "executorch_cellcache", "runner-path"],
                         capture_output=True, text=True, check=True).stdout.strip()
    prompts = pte.parent / "prompts.txt"
    prompts.write_text(" ".join(map(str, prompt)) + "\n")
    out = subprocess.run([exe, "--model", str(pte), "--prompts", str(prompts),
                          "--max-new-tokens", str(MAX_NEW)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(":")[1].split() == [str(t) for t in greedy[:cut + 1]]


def _first_fresh(tokens, start=1):
    """The first index from ``start`` on whose token has not appeared before."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.slow
def test_runner_stops_at_a_requested_stop_token_and_keeps_it(exported):
    """stop_token_ids stop a sample whatever stop_on_eos says; the program's EOS
    ids stop it only with stop_on_eos. Oracle: transformers' greedy tokens."""
    pte, prompt, greedy = exported
    runner = ecc.Runner(pte, prefix_cache=False)
    eos_at = next(i for i, t in enumerate(greedy) if t in GENERATION_EOS)
    k = _first_fresh(greedy)
    stop = greedy[k]
    [[a, b]] = runner.generate([prompt], max_new_tokens=MAX_NEW, n=2, stop_on_eos=False,
                               stop_token_ids=[stop])
    assert a == b == greedy[:k + 1]
    [[both]] = runner.generate([prompt], max_new_tokens=MAX_NEW, stop_token_ids=(stop,))
    assert both == greedy[:min(k, eos_at) + 1]
    [[neither]] = runner.generate([prompt], max_new_tokens=MAX_NEW, stop_on_eos=False)
    assert neither == greedy
    assert runner.cache.free_cells == runner.cache.capacity


@pytest.mark.slow
def test_stop_token_events_and_text_leave_the_stop_token_out(exported):
    """The engine streams the stop token as a token event with stop_token
    set (the server's text output leaves it out)."""
    from runner_support import drive, make_request

    pte, prompt, greedy = exported
    runner = ecc.Runner(pte, prefix_cache=False)
    k = _first_fresh(greedy)
    req = make_request(prompt, max_new_tokens=MAX_NEW, stop_on_eos=False,
                       stop_token_ids=(greedy[k],))
    events = drive(runner, {0: [req]})
    assert [e.token for e in events] == greedy[:k + 1]
    assert [e.stop_token for e in events] == [False] * k + [True]
    assert [e.finish_reason for e in events] == [None] * k + ["stop"]


@pytest.mark.slow
@pytest.mark.parametrize("ids, match", [
    ([320], r"stop_token_ids: token ids \[320\] are outside the vocabulary \[0, 320\)"),
    ([5, 1000, 7], r"stop_token_ids: token ids \[1000\] are outside the vocabulary"),
    ([2.0], r"stop_token_ids must be a sequence of token ids \(integers >= 0\), got \[2\.0\]"),
    ("2", r"stop_token_ids must be a sequence of token ids \(integers >= 0\), got '2'"),
    ([-1], r"stop_token_ids must be a sequence of token ids \(integers >= 0\), got \(-1,\)"),
])
def test_bad_stop_token_ids_are_refused_before_any_forward(exported, ids, match):
    import asyncio

    from spec.sampling import SamplingParams
    from executorch_cellcache.serving.engine import Engine, RequestError

    pte, prompt, _ = exported
    runner = ecc.Runner(pte)
    with pytest.raises(InvalidConfigError, match=match):
        runner.generate([prompt], max_new_tokens=2, stop_token_ids=ids)
    assert runner.cache.n_sequences == 0 and runner.cache.free_cells == runner.cache.capacity
    engine = Engine(runner)  # not started: submit refuses before queueing anything

    async def submit():
        engine.submit(list(prompt), SamplingParams(max_new_tokens=2, stop_token_ids=ids), [])

    with pytest.raises(RequestError, match=match) as info:
        asyncio.run(submit())
    if "vocabulary" in match:
        assert info.value.param == "stop_token_ids"


@pytest.mark.slow
def test_a_program_without_the_chat_template_method_still_loads(tmp_path):
    from executorch.exir import to_edge

    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    info = metadata.ProgramInfo(
        n_cells=8, n_layers=1, windows=[None], vocab_size=4, bos_id=None, eos_ids=[3],
        max_tokens_per_step=2, model_type="toy", model_name="toy", tokenizer_kind="none",
        tokenizer_json=None, chat_template="ignored")
    methods = metadata.constant_methods(info)
    del methods["chat_template"]  # what a program exported before the field carries
    program = to_edge(torch.export.export(AddOne(), (torch.ones(2),)),
                      constant_methods=methods).to_executorch()
    path = tmp_path / "old.pte"
    path.write_bytes(program.buffer)
    from executorch.runtime import Runtime

    read = metadata.read(Runtime.get().load_program(str(path)))
    assert read.chat_template is None and read.eos_ids == [3] and read.n_cells == 8


# ------------------------------------------------------------------ folder files, no export


def test_chat_template_sources(tmp_path):
    assert checkpoint_files.chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert checkpoint_files.chat_template(tmp_path) == TEMPLATE
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert checkpoint_files.chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers prefers the file
    assert checkpoint_files.chat_template(tmp_path) == "J"


def test_bad_folder_files_are_named(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(InvalidConfigError, match="tokenizer_config.json cannot be read"):
        checkpoint_files.chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(InvalidConfigError, match="chat_template is int"):
        checkpoint_files.chat_template(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(InvalidConfigError, match=r"eos_token_id.*\['x'\]"):
        checkpoint_files.generation_eos_ids(tmp_path)


def test_eos_union_keeps_first_occurrence_order():
    assert checkpoint_files.union([2], [2, 7, 9], []) == [2, 7, 9]
    assert checkpoint_files.union(checkpoint_files.eos_ids(128009),
                                  checkpoint_files.eos_ids([128001, 128009])) == [128009, 128001]
    assert checkpoint_files.eos_ids(None) == []


def test_too_many_stop_token_ids_are_refused():
    from spec.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
    SamplingParams(stop_token_ids=[1] * MAX_STOP_TOKEN_IDS).validate()
    with pytest.raises(InvalidConfigError, match=r"stop_token_ids holds 1025 ids; at most 1024"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)).validate()
