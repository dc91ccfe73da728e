"""Optional dependencies (setup.py's extras) and the one line that says how to
get a missing one."""

from typing import Optional

# Modules only an extra of setup.py installs (extras_require), by top-level name.
EXTRA_MODULES = {"matplotlib": "bench"}


def missing_module_message(name: Optional[str]) -> str:
    """What to install for the missing module ``name`` (a ModuleNotFoundError's)."""
    top = (name or "a module").split(".")[0]
    extra = EXTRA_MODULES.get(top)
    if extra:
        return (f"{top} is not installed: it comes with the [{extra}] extra, pip install -e "
                f"'.[{extra}]' in the clone the package was installed from")
    return (f"{top} is not installed, and executorch-cellcache needs it: reinstall the "
            f"package with pip (its requirements include it), or run scripts/install.sh "
            f"in a clone")


def require_module(name: str) -> None:
    """Raises ModuleNotFoundError (reported as one line naming the extra) when
    ``name`` cannot be imported: for a check before a long run."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
