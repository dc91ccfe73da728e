"""The package is layered the way data flows (cache face -> graph -> export ->
runtime -> serving -> CLI and bench): every import inside the package points
at a layer it may use, and nothing imports the package ``__init__``'s names.
Checked by parsing every module's imports, lazy ones inside functions included.

The C++ core (cpp/cellcache/) is the bottom layer of the C++ side: its files
include only each other and the standard library (the graph ops, the attention
kernel, the bindings and the runtime sit above it). The runtime is three
folders: the engine (cpp/engine/) includes only the core, itself and the
standard library, and nothing it reaches includes ExecuTorch; the program
(cpp/program/) may include ExecuTorch; the apps (cpp/apps/) both."""

import ast
import re
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


# ------------------------------------------------------------------ the C++ core

CPP = Path(__file__).resolve().parents[1] / "cpp"
CORE = CPP / "cellcache"

# The C++20 standard library's headers (the C ones in their <cname> form).
STD_HEADERS = frozenset("""
    algorithm any array atomic barrier bit bitset cassert cctype cerrno cfenv cfloat charconv
    chrono cinttypes climits clocale cmath codecvt compare complex concepts condition_variable
    coroutine csetjmp csignal cstdarg cstddef cstdint cstdio cstdlib cstring ctime cuchar cwchar
    cwctype deque exception execution filesystem format forward_list fstream functional future
    initializer_list iomanip ios iosfwd iostream istream iterator latch limits list locale map
    memory memory_resource mutex new numbers numeric optional ostream queue random ranges ratio
    regex scoped_allocator semaphore set shared_mutex source_location span sstream stack
    stdexcept stop_token streambuf string string_view syncstream system_error thread tuple
    type_traits typeindex typeinfo unordered_map unordered_set utility valarray variant vector
    version
""".split())

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]*)[>"]', re.MULTILINE)


def _include_violations(folder: Path):
    """Each #include in folder/*.h and folder/*.cpp of anything but a header of
    folder itself (named "<folder>/x.h", as the build's include path has it)
    or the standard library."""
    found = []
    for path in sorted([*folder.glob("*.h"), *folder.glob("*.cpp")]):
        for match in _INCLUDE.finditer(path.read_text()):
            bracket, name = match.groups()
            own = name.startswith(folder.name + "/") and "/" not in name[len(folder.name) + 1:] \
                and (folder / name[len(folder.name) + 1:]).is_file()
            if (bracket == "<" and name not in STD_HEADERS) or (bracket == '"' and not own):
                line = path.read_text()[:match.start()].count("\n") + 1
                close = ">" if bracket == "<" else '"'
                found.append(f"{path.name}:{line} includes {bracket}{name}{close}")
    return found


def test_the_cpp_core_includes_only_itself_and_the_standard_library():
    assert sorted(p.name for p in CORE.glob("*.cpp")), "no core sources found"
    assert _include_violations(CORE) == []


def test_the_include_checker_catches_a_header_from_above(tmp_path):
    core = tmp_path / "cellcache"
    core.mkdir()
    (core / "status.h").write_text("#pragma once\n")
    (core / "bad.cpp").write_text(
        '#include "cellcache/status.h"\n#include <vector>\n'
        '#include "graph/registry.h"\n#include <immintrin.h>\n'
        '  #  include <executorch/runtime/core/error.h>\n#include "cellcache/missing.h"\n'
        '#include "status.h"\n')
    assert _include_violations(core) == [
        'bad.cpp:3 includes "graph/registry.h"', "bad.cpp:4 includes <immintrin.h>",
        "bad.cpp:5 includes <executorch/runtime/core/error.h>",
        'bad.cpp:6 includes "cellcache/missing.h"', 'bad.cpp:7 includes "status.h"']


# ------------------------------------------------------------ the C++ runtime

# The runtime above the core, one folder a library (cpp/CMakeLists.txt):
#   cpp/engine/   cellcache_engine: the core and the standard library only, no
#                 ExecuTorch (built and tested in a core-only build too)
#   cpp/program/  cellcache_program: a .pte run by ExecuTorch behind the
#                 engine's Forward
#   cpp/text/     cellcache_text: tokenizer, stream decoder, chat template over
#                 the engine's run_status.h and the text libraries
#                 (pytorch-tokenizers, llama.cpp's Jinja engine)
#   cpp/grammar/  cellcache_grammar: grammars (XGrammar) and the engine's hooks
#                 that apply them
#   cpp/apps/     the batch runner and the tools, over all of them
# folder (under cpp/) -> (the folders whose headers it may include, where a
# flat name "x.h" is looked up, after the including file's own folder, as its
# target's include path has them; what it may include in <...> besides the
# standard library; generated headers it may include).
CPP_LAYERS = {
    "engine": (("engine", "cellcache"), (), ()),
    "engine/tests": (("engine/tests", "engine", "tests", "cellcache"), (), ()),
    "program": (("program", "engine", "cellcache", "graph"), ("executorch/",),
                ("cellcache_program_metadata.h",)),
    "text": (("text", "engine", "cellcache"),
             ("pytorch/", "llama_common/", "nlohmann/", "pthread.h"), ()),
    "grammar": (("grammar", "text", "engine", "cellcache"),
                ("xgrammar/", "dlpack/", "nlohmann/", "cellcache_xgrammar_warnings.h"), ()),
    "apps": (("apps", "program", "engine", "kernels", "cellcache", "text", "grammar"),
             ("executorch/", "nlohmann/"), ()),
}
# Where the engine's files, and everything they include, stop: nothing reached
# from them includes a header outside the standard library in <...>.
ENGINE_LAYERS = ("engine", "engine/tests")


def _cpp_files(folder: Path):
    return sorted([*folder.glob("*.h"), *folder.glob("*.cpp")])


def _includes(path: Path):
    """(line, bracket, name) for each #include of path."""
    text = path.read_text()
    for match in _INCLUDE.finditer(text):
        yield text[:match.start()].count("\n") + 1, *match.groups()


def _resolve(cpp: Path, path: Path, name: str, homes) -> Path | None:
    """The file a quoted include names, as the compiler finds it: beside the
    including file, then in each home (flat names), then under cpp/
    ("cellcache/x.h", the core's include path); None if nowhere."""
    for base in (path.parent, *(cpp / h for h in homes), cpp):
        if (base / name).is_file():
            return (base / name).resolve()
    return None


def _layer_violations(cpp: Path, layer: str):
    """Each #include in cpp/<layer>/*.{h,cpp} of a header outside the layer's
    homes (or found nowhere), or in <...> of one neither standard nor allowed."""
    homes, angled, generated = CPP_LAYERS[layer]
    allowed = {(cpp / h).resolve() for h in homes}
    found = []
    for path in _cpp_files(cpp / layer):
        for line, bracket, name in _includes(path):
            if bracket == "<":
                if name not in STD_HEADERS and not name.startswith(angled or ("\0",)):
                    found.append(f"{layer}/{path.name}:{line} includes <{name}>")
            elif name not in generated:
                target = _resolve(cpp, path, name, homes)
                if target is None or target.parent not in allowed:
                    where = "found nowhere" if target is None else \
                        f"{target.relative_to(cpp.resolve())}"
                    found.append(f'{layer}/{path.name}:{line} includes "{name}" ({where})')
    return found


def _reached_violations(cpp: Path, layer: str):
    """Each <...> include outside the standard library in a file the layer's
    files reach through quoted includes (themselves included)."""
    homes = CPP_LAYERS[layer][0]
    seen, todo, found = set(), [p.resolve() for p in _cpp_files(cpp / layer)], []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, bracket, name in _includes(path):
            if bracket == "<" and name not in STD_HEADERS:
                found.append(f"{path.relative_to(cpp.resolve())}:{line} includes <{name}>")
            elif bracket == '"' and (target := _resolve(cpp, path, name, homes)):
                todo.append(target)
    return sorted(found)


def test_every_runtime_cpp_file_is_in_a_layer():
    for top in ("engine", "program", "apps"):
        for path in (CPP / top).rglob("*"):
            if path.suffix in (".h", ".cpp"):
                assert str(path.parent.relative_to(CPP)) in CPP_LAYERS, \
                    f"{path.relative_to(CPP)} is in no C++ layer (tests/test_layers.py)"
    assert (CPP / "engine" / "engine.h").is_file() and (CPP / "program" / "program.h").is_file()


@pytest.mark.parametrize("layer", sorted(CPP_LAYERS))
def test_each_runtime_folder_includes_only_what_its_layer_may(layer):
    assert _cpp_files(CPP / layer), f"no C++ files in cpp/{layer}"
    assert _layer_violations(CPP, layer) == []


@pytest.mark.parametrize("layer", ENGINE_LAYERS)
def test_the_engine_reaches_no_header_outside_the_standard_library(layer):
    # ExecuTorch's headers included anywhere below the engine's files would
    # show here (the core-only build in scripts/test.sh has none to find).
    assert _reached_violations(CPP, layer) == []


def test_the_engine_target_links_the_core_alone():
    # No ExecuTorch include path reaches cellcache_engine: it links only
    # cellcache_core (which includes nothing outside cpp/cellcache/).
    code = "\n".join(line.split("#", 1)[0]
                     for line in (CPP / "engine" / "CMakeLists.txt").read_text().splitlines())
    assert "executorch" not in code.lower()
    links = re.findall(r"target_link_libraries\(\s*cellcache_engine\s+([^)]*)\)", code)
    assert [link.split() for link in links] == [["PUBLIC", "cellcache_core"]]


def test_the_layer_checker_catches_an_engine_that_includes_executorch(tmp_path):
    cpp = tmp_path / "cpp"
    for folder, files in {
        "cellcache": {"cell_cache.h": "#pragma once\n#include <vector>\n"},
        "graph": {"registry.h": '#include "cellcache/cell_cache.h"\n'},
        "program": {"program.h": "#pragma once\n#include <executorch/runtime/core/error.h>\n"},
        "tests": {"util.h": "#include <executorch/extension/module/module.h>\n"},
        "engine": {"forward.h": '#pragma once\n#include "cellcache/cell_cache.h"\n',
                   "engine.cpp": '#include "forward.h"\n#include <map>\n'
                                 '#include <executorch/runtime/core/error.h>\n'
                                 '#include "program.h"\n#include "graph/registry.h"\n'
                                 '#include "../program/program.h"\n#include "missing.h"\n'},
        "engine/tests": {"engine_test.cpp": '#include "forward.h"\n#include "util.h"\n'},
    }.items():
        (cpp / folder).mkdir(parents=True)
        for name, text in files.items():
            (cpp / folder / name).write_text(text)
    assert _layer_violations(cpp, "engine") == [
        "engine/engine.cpp:3 includes <executorch/runtime/core/error.h>",
        'engine/engine.cpp:4 includes "program.h" (found nowhere)',
        'engine/engine.cpp:5 includes "graph/registry.h" (graph/registry.h)',
        'engine/engine.cpp:6 includes "../program/program.h" (program/program.h)',
        'engine/engine.cpp:7 includes "missing.h" (found nowhere)']
    # The tests' helper is theirs to include; what it includes is not.
    assert _layer_violations(cpp, "engine/tests") == []
    assert _reached_violations(cpp, "engine/tests") == [
        "tests/util.h:1 includes <executorch/extension/module/module.h>"]
    assert _reached_violations(cpp, "engine") == [
        "engine/engine.cpp:3 includes <executorch/runtime/core/error.h>",
        "program/program.h:2 includes <executorch/runtime/core/error.h>"]
    # The program may include ExecuTorch; the same line passes there.
    assert _layer_violations(cpp, "program") == []
