"""The ExecuTorch kernels a program's metadata says it needs, registered
before its forward is loaded.

The runtime's Python module carries the portable, optimized and XNNPACK
kernels but not the quantized ones: a quantized embedding runs on
``quantized_decomposed::embedding_{byte,4bit}.out``, which
``executorch.kernels.quantized`` registers when imported. Quantized linears
run inside the XNNPACK delegate.
"""

from typing import List

from executorch_cellcache.cache import metadata
from executorch_cellcache.cache.errors import InvalidConfigError


def needed_operators(info: metadata.ProgramInfo) -> List[str]:
    """Runtime operators beyond the standard set that ``info``'s program uses."""
    if info.embedding_quantize is None:
        return []
    return [metadata.EMBEDDING_KERNELS[metadata.embedding_bits(info.embedding_quantize)]]


def require_kernels(info: metadata.ProgramInfo) -> None:
    """Registers what the program needs; raises InvalidConfigError naming an
    operator or backend this installation cannot provide."""
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    if info.quantize is not None and not runtime.backend_registry.is_available("XnnpackBackend"):
        raise InvalidConfigError(f"this program's {info.quantize} linears run in the XNNPACK "
                                 f"backend, which this ExecuTorch runtime does not have")
    missing = [op for op in needed_operators(info)
               if op not in runtime.operator_registry.operator_names]
    if missing:
        import executorch.kernels.quantized  # noqa: F401  registers the quantized kernels

        missing = [op for op in missing if op not in runtime.operator_registry.operator_names]
    if missing:
        raise InvalidConfigError(
            f"this program's embedding is quantized ({info.embedding_quantize}) but the "
            f"runtime has no kernel {', '.join(missing)}; install an executorch wheel that "
            f"ships executorch.kernels.quantized")
