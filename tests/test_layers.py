"""The package is layered the way data flows (cache face -> graph -> export ->
runtime -> serving -> CLI and bench): every import inside the package points
at a layer it may use, and nothing imports the package ``__init__``'s names.
Checked by parsing every module's imports, lazy ones inside functions included."""

import ast
from pathlib import Path

import pytest

PACKAGE = "executorch_cellcache"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# layer -> the layers its modules may import (itself included). runtime and
# exporting are siblings: a program is run from its file, never from export code.
ALLOWED = {
    "cache": {"cache"},
    "graph": {"cache", "graph"},
    "exporting": {"cache", "graph", "exporting"},
    "runtime": {"cache", "runtime"},
    "serving": {"cache", "runtime", "serving"},
    "bench": {"cache", "graph", "exporting", "runtime", "serving", "bench"},
    "cli": {"cache", "graph", "exporting", "runtime", "serving", "bench", "cli"},
    "__main__": {"cli"},
    "__init__": {"cache", "graph", "exporting", "runtime"},
}


def _layer(module_path: Path) -> str:
    parts = module_path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def _imports(tree: ast.AST):
    """(line, imported module, names) for every import of the package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE or node.module.startswith(PACKAGE + "."):
                yield node.lineno, node.module, [a.name for a in node.names]


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def _violations(path: Path):
    layer = _layer(path)
    found = []
    for line, module, names in _imports(ast.parse(path.read_text(), str(path))):
        parts = module.split(".")
        if len(parts) == 1:
            # `from executorch_cellcache import X`: only subpackages/modules, never
            # a name defined by the package __init__.
            targets = []
            for name in names:
                if not ((ROOT / name).is_dir() or (ROOT / f"{name}.py").exists()):
                    found.append(f"{path.name}:{line} imports {name!r} from the package "
                                 f"__init__")
                else:
                    targets.append(name)
        else:
            targets = [parts[1]]
        for target in targets:
            if target not in ALLOWED.get(layer, set()):
                found.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {module} "
                             f"({target})")
    return found


def test_every_module_belongs_to_a_known_layer():
    unknown = sorted({_layer(p) for p in _modules()} - set(ALLOWED))
    assert not unknown, f"modules outside every layer: {unknown}"


def test_every_subpackage_says_what_it_may_import():
    for sub in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text())) or ""
        assert "import" in doc, f"{sub.name}/__init__.py's docstring does not say what it may import"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    assert _violations(path) == []


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # The rule itself, on a module written to break it: runtime importing export.
    fake_root = tmp_path / PACKAGE
    (fake_root / "runtime").mkdir(parents=True)
    bad = fake_root / "runtime" / "bad.py"
    bad.write_text("def f():\n    from executorch_cellcache.exporting.exporter import export\n"
                   "from executorch_cellcache import Runner\n")
    monkeypatch.setattr(f"{__name__}.ROOT", fake_root)
    found = _violations(bad)
    assert any("(runtime) imports executorch_cellcache.exporting.exporter" in v for v in found)
    assert any("imports 'Runner' from the package __init__" in v for v in found)
