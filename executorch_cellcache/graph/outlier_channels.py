"""A quantized linear's outlier input channels, computed in fp32 beside it.

XNNPACK's dynamically quantized linears quantize each token's input to int8
with one scale for the whole row (per token, asymmetric). A transformer's
activations carry a few channels far larger than the rest, the same channels
token after token (Dettmers et al. 2022, LLM.int8(): "outlier features"), so
one scale per row spends the int8 range on them and rounds the others
coarsely. llama.cpp quantizes activations per block of 32 (Q8_1), which
confines an outlier to its block. Measured on SmolLM2-135M-Instruct's own
Q4_1 weights (KL divergence from fp32 over held-out text): per-token int8
0.021, per-block (llama.cpp) 0.0036, per-token with the 8 largest channels of
each linear's input kept in fp32 0.0044.

With channels C (k of them) of a linear y = x Wᵀ:

    y = (x ⊙ keep) Wᵀ + (x Sᵀ) W_Cᵀ

``keep`` [in_features] is 0 on C and 1 elsewhere, so the quantized GEMM sees
no outlier; S [k, in_features] selects C (one 1 per row: an fp32 GEMM, the
form XNNPACK runs inside the layer's partition, where a gather would split
it) and W_C [out_features, k] holds the weight's columns C as the quantized
weight stores them (its int values times their scales), so the sum is the
quantized weight applied with fp32 activations on C: the linear's fp32 side
path (graph/side_path.py, shared with its block offsets). exporting/outliers.py
picks C from the inputs' mean magnitudes on calibration tokens.
"""

import torch
from torch import nn

from executorch_cellcache.graph import side_path

KEEP = "outlier_keep"


def add_outlier_channels(module: nn.Module, channels: torch.Tensor, columns: torch.Tensor,
                         in_features: int) -> None:
    """Gives ``module`` (in place) outlier channels: the KEEP mask and a side
    path (graph/side_path.py) of the selection and the columns; channels
    int64 [k] (distinct, in 0..in_features-1), columns fp32 [out_features, k]
    (the weight's columns at ``channels``). Raises ValueError for channels
    out of range or repeated, columns of another count, or a module that has
    outlier channels already."""
    if hasattr(module, KEEP):
        raise ValueError("the module has outlier channels already")
    channels = channels.to(torch.int64).flatten()
    k = channels.numel()
    if k == 0 or int(channels.min()) < 0 or int(channels.max()) >= in_features or \
            channels.unique().numel() != k:
        raise ValueError(f"outlier channels {channels.tolist()} are not distinct channels "
                         f"of {in_features} input features")
    if columns.dim() != 2 or columns.shape[1] != k:
        raise ValueError(f"outlier columns of shape {tuple(columns.shape)} do not match "
                         f"{k} channels")
    keep = torch.ones(in_features)
    keep[channels] = 0
    select = torch.zeros(k, in_features)
    select[torch.arange(k), channels] = 1
    side_path.append(module, select, columns)   # first: it refuses a side path that does not fit
    module.register_buffer(KEEP, keep)


def inliers(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [..., in_features] with ``module``'s outlier channels zeroed (x as
    it is when it has none): what its quantized GEMM takes."""
    keep = getattr(module, KEEP, None)
    return x if keep is None else x * keep
