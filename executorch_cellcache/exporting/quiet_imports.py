"""Imports of torch's compiler stack without third-party import noise.

Importing executorch's compiler and transformers' model code pulls in torchao
and registers enums with torch's pytree; both log warnings about their own
optional pieces (CUDA kernels absent on a CPU build, a deprecated
registration) that a user of this package can do nothing about.
"""

import contextlib
import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


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
