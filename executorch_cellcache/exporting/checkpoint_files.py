"""What a Hugging Face checkpoint folder carries besides config and weights,
read the way transformers reads it: the tokenizer, the chat template and the
stop tokens of its generation config.
"""

import json
from pathlib import Path
from typing import List, Optional

from executorch_cellcache.cache.errors import InvalidConfigError


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidConfigError(f"{path} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise InvalidConfigError(f"{path} holds {type(data).__name__}, expected a JSON object")
    return data


def tokenizer_json(folder: Path) -> Optional[str]:
    path = folder / "tokenizer.json"
    return path.read_text(encoding="utf-8") if path.exists() else None


def chat_template(folder: Path) -> Optional[str]:
    """The jinja2 chat template: ``chat_template.jinja`` when present (newer
    transformers save it there), else ``chat_template`` of
    tokenizer_config.json (a string, or a list of {name, template} of which
    the one named "default" is used, as transformers does)."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.exists():
        return None
    template = _json(config).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise InvalidConfigError(f"{config}: chat_template is {type(template).__name__}, "
                                 f"expected a string or a list of named templates")
    return template or None


def eos_ids(value) -> List[int]:
    """An ``eos_token_id`` field (None, an int or a list of ints) as a list."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in items):
        raise InvalidConfigError(f"eos_token_id must be an id or a list of ids, got {value!r}")
    return list(items)


def generation_eos_ids(folder: Path) -> List[int]:
    """``eos_token_id`` of generation_config.json ([] without the file). Chat
    models list their end-of-turn tokens there (Llama-3-Instruct's
    <|eot_id|>, Qwen3's <|im_end|>), not in config.json."""
    path = folder / "generation_config.json"
    return eos_ids(_json(path).get("eos_token_id")) if path.exists() else []


def union(*id_lists: List[int]) -> List[int]:
    """Ids of every list, first occurrence order."""
    out: List[int] = []
    for ids in id_lists:
        out += [i for i in ids if i not in out]
    return out
