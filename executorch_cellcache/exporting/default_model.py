"""The embedded default model: a small Llama (GQA, RoPE) trained by
``scripts/train_default_model.py`` on Python's own documentation, shipped as a
Hugging Face checkpoint folder (``CHECKPOINT``) inside the package.

``export(None, ...)`` loads that folder exactly as it loads a user's
``--model path/to/checkpoint``. The corpus split lives here, once, for both the
training script and ``cellcache eval``:

- documents: the topics of the standard library's ``pydoc_data.topics`` (the
  text ``help()`` shows; Python Software Foundation documentation, PSF License
  Version 2), sorted by topic name;
- held out: every ``HELDOUT_EVERY``-th document starting at ``HELDOUT_FIRST``
  (sorted order); the rest is the training split.
"""

from pathlib import Path
from typing import List, Tuple

CHECKPOINT = Path(__file__).resolve().parent / "default_checkpoint"
NAME = "cellcache-default-llama"   # the checkpoint's name_or_path, recorded in the .pte
TRAINING_CONTEXT = 256            # tokens per training sequence: RoPE positions it has seen
HELDOUT_EVERY = 10
HELDOUT_FIRST = 5
DOCUMENT_SEPARATOR = "\n\n"        # between documents of a split joined into one text


def corpus_documents() -> List[Tuple[str, str]]:
    """(topic name, text) of every ``pydoc_data.topics`` topic, sorted by name."""
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics)]


def split_documents() -> Tuple[List[str], List[str]]:
    """(training texts, held-out texts), each in sorted topic order."""
    train, heldout = [], []
    for i, (_, text) in enumerate(corpus_documents()):
        is_heldout = i >= HELDOUT_FIRST and (i - HELDOUT_FIRST) % HELDOUT_EVERY == 0
        (heldout if is_heldout else train).append(text)
    return train, heldout


def heldout_text() -> str:
    """The held-out documents joined by ``DOCUMENT_SEPARATOR``: the text
    ``cellcache eval`` scores on the default model when given no ``--text``."""
    return DOCUMENT_SEPARATOR.join(split_documents()[1])


def is_default_model(model_name: str) -> bool:
    """Whether a program's ``model_name`` metadata names this model."""
    return model_name == NAME
