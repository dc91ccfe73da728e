"""Imports of torch's compiler stack without third-party import noise.

Importing executorch's compiler and transformers' model code pulls in torchao
and registers enums with torch's pytree; both log warnings about their own
optional pieces (CUDA kernels absent on a CPU build, a deprecated
registration) that a user of this package can do nothing about.
"""

import contextlib
import functools
import logging
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
# Modules whose warnings during export are about their own internals (deprecations inside
# torch.export, executorch's buffer-mutation notes), nothing a caller can act on.
NOISY_WARNING_MODULES = ("copyreg", "torch", "executorch", "transformers")


def third_party_warnings_silenced(fn):
    """Runs ``fn`` with NOISY_WARNING_MODULES' warnings ignored (the caller's
    warning filters are restored afterwards)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with warnings.catch_warnings():
            for module in NOISY_WARNING_MODULES:
                warnings.filterwarnings("ignore", module=module)
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def quiet_third_party_imports():
    """Raises the noisy loggers to ERROR for the duration of an import."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, saved, strict=True):
            logger.setLevel(level)
