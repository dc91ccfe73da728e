"""A small multi-layer attention model on the cell cache, and an independent oracle.

``ToyAttention`` is a stack of grouped-query attention layers (with different
sliding windows) whose K/V live in per-layer ``[n_cells, n_kv, head_dim]``
buffers and go through ``cell_cache_layer`` (place, in-place write, mask,
attend). Its forward takes the graph inputs of a cell-cache program:

    forward(tokens int64 [n_tok], positions int64 [n_tok], handle int64 [1],
            extent uint8 [E]) -> float32 [n_tok, hidden]

``reference_outputs`` is the oracle: it never touches a cell cache. From the
full token history of one sequence it computes every layer's attention
directly from SPEC section 1's mask rule (a token at position p attends the
sequence's tokens at positions q with q <= p and, for a window W, p - q < W),
expanding K/V over the query heads with ``repeat_interleave`` (not the
folding ``attention.dense_attend`` uses).
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.export import Dim

from executorch_cellcache.graph.attention import StepInputs, cell_cache_layer

WINDOWS = [None, 3, 2]


class ToyAttention(nn.Module):
    def __init__(self, n_cells: int, windows: Sequence[Optional[int]] = tuple(WINDOWS),
                 vocab: int = 64, hidden: int = 32, n_heads: int = 4, n_kv: int = 2,
                 head_dim: int = 8, seed: int = 0, attention: str = "cells",
                 kv_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.attention = attention
        assert n_heads % n_kv == 0
        self.n_cells = n_cells
        self.windows = list(windows)
        self.n_layers = len(self.windows)
        self.hidden, self.n_heads, self.n_kv, self.head_dim = hidden, n_heads, n_kv, head_dim
        self.scaling = head_dim ** -0.5
        gen = torch.Generator().manual_seed(seed)

        def weight(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=gen) * scale,
                                requires_grad=False)

        self.embed = weight(vocab, hidden)
        # Frequencies of a sinusoidal position code added to the embedding, so
        # the outputs depend on the positions, not only on which tokens attend.
        self.register_buffer("freqs", 1.0 / (10.0 ** (torch.arange(hidden) / hidden)),
                             persistent=False)
        s = hidden ** -0.5
        self.wq = nn.ParameterList([weight(n_heads * head_dim, hidden, scale=s)
                                    for _ in self.windows])
        self.wk = nn.ParameterList([weight(n_kv * head_dim, hidden, scale=s)
                                    for _ in self.windows])
        self.wv = nn.ParameterList([weight(n_kv * head_dim, hidden, scale=s)
                                    for _ in self.windows])
        self.wo = nn.ParameterList([weight(hidden, n_heads * head_dim,
                                           scale=(n_heads * head_dim) ** -0.5)
                                    for _ in self.windows])
        for i in range(self.n_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(n_cells, n_kv, head_dim, dtype=kv_dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(n_cells, n_kv, head_dim, dtype=kv_dtype))

    @property
    def cache_shape(self) -> Tuple[int, int, int]:
        return (self.n_cells, self.n_kv, self.head_dim)

    def embed_inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pe = torch.sin(positions.to(torch.float32)[:, None] * self.freqs[None, :])
        return self.embed[tokens] + pe

    def forward(self, tokens, positions, handle, extent):
        step = StepInputs(handle, positions, extent, self.attention)
        x = self.embed_inputs(tokens, positions)
        n_tok = tokens.shape[0]
        for i, window in enumerate(self.windows):
            q = nn.functional.linear(x, self.wq[i]).reshape(n_tok, self.n_heads, self.head_dim)
            k = nn.functional.linear(x, self.wk[i]).reshape(n_tok, self.n_kv, self.head_dim)
            v = nn.functional.linear(x, self.wv[i]).reshape(n_tok, self.n_kv, self.head_dim)
            a = cell_cache_layer(step, i, window, q, k, v, getattr(self, f"k_cache_{i}"),
                                 getattr(self, f"v_cache_{i}"), self.scaling)
            x = x + torch.tanh(nn.functional.linear(a.reshape(n_tok, -1), self.wo[i]))
        return x


def example_inputs():
    return (torch.zeros(2, dtype=torch.int64), torch.arange(2, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), torch.empty(2, dtype=torch.uint8))


def dynamic_shapes(n_cells: int, max_tokens: int = 16):
    n_tok = Dim("n_tok", min=1, max=max_tokens)
    extent = Dim("extent", min=1, max=n_cells)
    return ({0: n_tok}, {0: n_tok}, None, {0: extent})


def cache_shapes(model: ToyAttention):
    return {tuple(b.shape) for name, b in model.named_buffers() if "_cache_" in name}


# ------------------------------------------------------------------ the oracle

def sees(window: Optional[int], p: int, q: int) -> bool:
    """SPEC section 1: a token at position p attends position q."""
    return q <= p and (window is None or p - q < window)


@torch.no_grad()
def reference_outputs(model: ToyAttention, history: Sequence[Tuple[int, int]]
                      ) -> Dict[int, torch.Tensor]:
    """The model's output for every token of one sequence, computed without a
    cache. history: (position, token) pairs of the sequence (any order, each
    position once). Returns {position: float32 [hidden]}."""
    history = sorted(history)
    positions = [p for p, _ in history]
    assert len(set(positions)) == len(positions), "a position held twice"
    tokens = torch.tensor([t for _, t in history], dtype=torch.int64)
    x = model.embed_inputs(tokens, torch.tensor(positions, dtype=torch.int64))
    n, hd = len(history), model.head_dim
    group = model.n_heads // model.n_kv
    for i, window in enumerate(model.windows):
        q = (x @ model.wq[i].T).reshape(n, model.n_heads, hd)
        k = (x @ model.wk[i].T).reshape(n, model.n_kv, hd).repeat_interleave(group, dim=1)
        v = (x @ model.wv[i].T).reshape(n, model.n_kv, hd).repeat_interleave(group, dim=1)
        out = torch.empty(n, model.n_heads, hd)
        for a in range(n):
            seen = [b for b in range(n) if sees(window, positions[a], positions[b])]
            for h in range(model.n_heads):
                scores = torch.stack([q[a, h] @ k[b, h] for b in seen]) / math.sqrt(hd)
                probs = torch.softmax(scores, dim=0)
                out[a, h] = sum(probs[j] * v[b, h] for j, b in enumerate(seen))
        x = x + torch.tanh(out.reshape(n, -1) @ model.wo[i].T)
    return {p: x[j] for j, p in enumerate(positions)}


class Histories:
    """Per-sequence token histories that mirror the cache's verbs, for the
    oracle: what each sequence holds, as (position, token) pairs."""

    def __init__(self):
        self.seqs: Dict[int, List[Tuple[int, int]]] = {}

    def extend(self, seq_ids, tokens, positions):
        for s, t, p in zip(seq_ids, tokens, positions):
            self.seqs.setdefault(s, []).append((p, t))

    def clone(self, src, dst, upto=None):
        self.seqs[dst] = [(p, t) for p, t in self.seqs[src] if upto is None or p < upto]

    def rm_tail(self, seq, p0):
        self.seqs[seq] = [(p, t) for p, t in self.seqs[seq] if p < p0]

    def expected(self, model, seq_ids, positions) -> torch.Tensor:
        """Oracle rows [n_tok, hidden] for a step already added with extend()."""
        cache = {}
        rows = []
        for s, p in zip(seq_ids, positions):
            if s not in cache:
                cache[s] = reference_outputs(model, self.seqs[s])
            rows.append(cache[s][p])
        return torch.stack(rows)
