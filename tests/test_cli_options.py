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
