"""Command-line options that need no exported program, in this process."""

import importlib.metadata

import pytest

from executorch_cellcache.cli import main


def test_version_prints_the_installed_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    version = importlib.metadata.version("executorch-cellcache")
    assert capsys.readouterr().out == f"cellcache {version}\n"


def test_export_of_a_hub_id_says_how_to_download_it_and_writes_nothing(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(tmp_path)
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert main(["export", "--model", model]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"cellcache export: error: {model} is not a folder or a file here, and export does not "
        f"reach the Hugging Face Hub: download it with `hf download {model} --local-dir DIR` "
        f"(where the hub can be reached), then pass --model DIR"]
    assert list(tmp_path.iterdir()) == []


def _serve_until_the_app(monkeypatch, tmp_path, *flags) -> dict:
    """The keywords `cellcache serve` gives create_app (which stops it there)."""
    from executorch_cellcache.serving import app

    given = {}

    def stop(path, **kwargs):
        given.update(kwargs)
        raise ValueError("stopped before serving")

    monkeypatch.setattr(app, "create_app", stop)
    pte = tmp_path / "m.pte"
    pte.write_bytes(b"")
    assert main(["serve", str(pte), *flags]) == 2
    return given


def test_serve_gives_the_app_every_served_model_name(monkeypatch, tmp_path):
    names = _serve_until_the_app(monkeypatch, tmp_path, "--served-model-name", "smol",
                                 "--served-model-name", "chat")["served_model_names"]
    assert names == ["smol", "chat"]
    assert _serve_until_the_app(monkeypatch, tmp_path)["served_model_names"] is None


@pytest.mark.parametrize("names, message", [(["m", "m"], "'m' given more than once"),
                                            ([""], "'' is not a name")])
def test_serve_refuses_a_repeated_or_empty_served_model_name_in_one_line(tmp_path, capsys,
                                                                         names, message):
    pte = tmp_path / "m.pte"
    pte.write_bytes(b"")
    argv = ["serve", str(pte)]
    for name in names:
        argv += ["--served-model-name", name]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("cellcache serve: error: served model names") and message in err, err


def _prompt_texts(prompts_file, prompt=()):
    import argparse

    from executorch_cellcache.cli.prompts import prompt_texts

    return prompt_texts(argparse.Namespace(prompt=list(prompt), prompts_file=prompts_file))


def test_prompts_from_standard_input_are_its_lines_as_written(monkeypatch):
    import io
    import sys

    # A byte-order mark is not text; \r\n ends a line; a form feed, U+2028 and a NUL
    # inside a line are text (str.splitlines() would end the prompt there).
    data = "\ufeffhi\x0cthere\u2028x\x00y\r\n\n  \nsecond\n".encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert _prompt_texts("-") == ["hi\x0cthere\u2028x\x00y", "second"]


@pytest.mark.parametrize("stdin, message", [
    (None, "--prompts-file -: standard input is closed"),
    (b"\n \n", "standard input (--prompts-file -) holds no prompt")])
def test_standard_input_without_prompts_is_one_clear_error(monkeypatch, stdin, message):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", None if stdin is None
                        else io.TextIOWrapper(io.BytesIO(stdin)))
    with pytest.raises(ValueError) as e:
        _prompt_texts("-")
    assert str(e.value) == message


def test_a_pipe_is_read_as_a_prompts_file():
    import os

    read, write = os.pipe()  # as `--prompts-file <(...)` gives one: /dev/fd/N
    os.write(write, b"one\ntwo\n")
    os.close(write)
    try:
        assert _prompt_texts(f"/dev/fd/{read}", ["zero"]) == ["zero", "one", "two"]
    finally:
        os.close(read)


def test_export_of_a_missing_file_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--model", "some/missing.txt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cellcache export: error: checkpoint some/missing.txt does not exist"), err
    assert "hf download" not in err
