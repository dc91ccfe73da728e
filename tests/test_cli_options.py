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
