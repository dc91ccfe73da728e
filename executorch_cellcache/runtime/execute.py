"""Running an ExecuTorch method from Python without PyTorch's OpenMP pool
getting in the way.

``Method.execute`` returns its outputs as torch tensors; copying logits
[n, vocab] is large enough for PyTorch to split the copy over its OpenMP
threads, whose workers then spin-wait for the next parallel region on the
cores the runtime's own thread pool (XNNPACK, our kernels) needs for the next
forward. Measured on the 135M bench model, 8da4w, 2 cores, B=8 decode: 23.5
ms a step with the spinning workers, 17 ms without (``scripts/profile_decode.py``
and ``perf``: a libgomp worker held 11% of the samples). So the forward runs
with PyTorch at one thread, and the caller's setting is restored after it.
"""

from typing import Any, List, Sequence

import torch


def execute(method, inputs: Sequence[Any]) -> List[Any]:
    """``method.execute(inputs)`` with PyTorch's intra-op threads set to 1
    for the call (process-wide: another Python thread's torch ops run on one
    thread meanwhile)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return method.execute(inputs)
    torch.set_num_threads(1)
    try:
        return method.execute(inputs)
    finally:
        torch.set_num_threads(threads)
