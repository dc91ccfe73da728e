"""What an export produced, for the user: how the weights are stored, what
the XNNPACK delegate took, and the .pte size (``ExportResult.summary``,
printed by ``cellcache export``)."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class ExportSummary:
    quantize: Optional[str]          # None = fp32 linears
    group_size: int                  # 8da4w weight group; 0 = per channel / n.a.
    linears: int                     # nn.Linear layers of the model (lm_head included)
    linears_quantized: int
    per_channel: List[str] = field(default_factory=list)  # 8da4w group fallback, by name
    delegated_quantized: int = 0     # linears in XNNPACK's dynamically quantized kernels
    delegated_fp32: int = 0          # fp32 linears in XNNPACK
    embedding: str = "fp32"
    weight_scales: str = ""          # how the quantized weights' scales were chosen
    untied_lm_head: bool = False     # a tied lm_head got a weight of its own
    fused_projections: int = 0       # q/k/v or gate/up groups computed by one linear each
    lm_head: str = ""                # the output layer's mode where it is not ``quantize``
    exact: List[str] = field(default_factory=list)  # kept as the GGUF stores them, by name
    block_offsets: int = 0           # of those: Q4_1 linears with per-block offsets
    # input channels computed in fp32, by quantized linear (exporting/outliers.py)
    outlier_channels: Dict[str, List[int]] = field(default_factory=dict)
    size_bytes: int = 0

    def lines(self) -> List[str]:
        if self.quantize is None:
            weights = "fp32"
        elif self.group_size:
            weights = f"{self.quantize} (int4 weights in groups of {self.group_size})"
        else:
            weights = f"{self.quantize} (int8 weights per channel)"
        out = [f"weights: {weights}",
               f"linear layers: {self.linears_quantized} of {self.linears} quantized, "
               f"{self.delegated_quantized} in XNNPACK's dynamically quantized kernels, "
               f"{self.delegated_fp32} fp32 in XNNPACK"
               + (" (the side paths of quantized linears with block offsets or outlier "
                  "channels: one each, two with outlier channels)"
                  if self.block_offsets or self.outlier_channels else "")]
        if self.fused_projections:
            out.append(f"  fused projections: {self.fused_projections} groups (q/k/v or "
                       f"gate/up), one linear each (counted as one above)")
        if self.per_channel:
            shown = ", ".join(self.per_channel[:4]) + (" ..." if len(self.per_channel) > 4
                                                        else "")
            out.append(f"  {len(self.per_channel)} quantized per channel: in_features not a "
                       f"multiple of {self.group_size} ({shown})")
        if self.lm_head:
            out.append(f"  lm_head: {self.lm_head} (set apart from the other linears)")
        if self.exact:
            offsets = f", {self.block_offsets} with Q4_1 block offsets (the block sums in " \
                f"the side path)" if self.block_offsets else ""
            out.append(f"  {len(self.exact)} weights kept exactly as the GGUF stores them, not "
                       f"requantized{offsets}")
        if self.outlier_channels:
            k = max(map(len, self.outlier_channels.values()))
            out.append(f"  outlier channels: {k} input channels of each of "
                       f"{len(self.outlier_channels)} quantized linears in fp32 (in the side "
                       f"path)")
        out.append(f"embedding: {self.embedding}")
        if self.weight_scales:
            out.append(f"weight scales: {self.weight_scales}")
        if self.untied_lm_head:
            out.append("lm_head was tied to the embedding: untied, each stored in its own "
                       "format")
        out.append(f".pte size: {self.size_bytes / 1e6:.1f} MB")
        return out
