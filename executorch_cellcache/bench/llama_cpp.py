"""llama.cpp as a measured peer (``cellcache bench --llama-cpp PATH``).

The bench model's weights go to a GGUF file (``gguf``'s GGUFWriter, llama.cpp's
"llama" architecture), quantized like our program: 8da4w -> Q4_0 (blocks of 32
4-bit weights and an fp16 scale, dotted with Q8_0 activations: int8 dynamic
activations and 4-bit weights in groups of 32, as 8da4w g32), 8da8w -> Q8_0,
fp32 -> F32; norms stay F32. As in our export, a quantized lm_head gets its own
weight (``output``) and the input embedding follows ``--embedding-quantize``
(int8 -> Q8_0, int4 -> Q4_0, none -> F32). The vocabulary is a minimal
SentencePiece one (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then
placeholders): llama-batched-bench draws random token ids and never decodes
text.

``llama-batched-bench`` then runs the same prompt lengths and batch sizes as
our rows (each sequence its own prompt, ``-npl`` sequences decoding one token
each per step) with the same thread count, its JSONL output parsed. Anything
wrong with the binary or its run raises ``LlamaCppError``: one line naming the
binary and the problem.
"""

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

BINARY = "llama-batched-bench"
# Where a build directory keeps it: CMake's bin/ (the default), or the top.
_BINARY_DIRS = ("bin", ".", "build/bin")


class LlamaCppError(Exception):
    """llama.cpp cannot give its rows: a missing or wrong binary, or a failed run
    (one line naming the binary and the problem)."""


# ----------------------------------------------------------------------------- GGUF

def gguf_types(quantize: Optional[str], embedding_quantize: Optional[str] = None):
    """(linear layers' type, input embedding's type) of GGMLQuantizationType for
    our export's quantization options."""
    from gguf import GGMLQuantizationType as T

    linear = {None: T.F32, "8da4w": T.Q4_0, "8da8w": T.Q8_0}
    if quantize not in linear:
        raise LlamaCppError(f"llama.cpp has no counterpart here for quantize={quantize!r}")
    bits = None if embedding_quantize is None else str(embedding_quantize).split(",")[0]
    embedding = {None: T.F32, "8": T.Q8_0, "4": T.Q4_0}
    if bits not in embedding:
        raise LlamaCppError(f"llama.cpp has no counterpart here for embedding_quantize="
                            f"{embedding_quantize!r}")
    return linear[quantize], embedding[bits]


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """A q or k projection's rows in llama.cpp's order: llama.cpp's RoPE rotates
    adjacent pairs (x[2i], x[2i+1]), transformers' rotate_half the halves (x[i],
    x[i + head_dim/2]); per head, row i of the first half and row i of the
    second become rows 2i and 2i+1. ``n_head``: the heads of this projection
    (the KV heads for k)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """``permute_qk``'s inverse."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _vocab(n: int):
    """A loadable SentencePiece vocabulary of ``n`` tokens: <unk> <s> </s>, the
    byte tokens llama.cpp looks up (<0x0A> for the newline) when they fit, then
    placeholders."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    if n >= 3 + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), n)]
    types += [TokenType.NORMAL] * (n - len(types))
    return tokens[:n], [int(t) for t in types[:n]]


def _quantized(array: np.ndarray, qtype):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    array = np.ascontiguousarray(array, dtype=np.float32)
    return array if qtype == T.F32 else quantize(array, qtype)


def write_gguf(model, path: Path, quantize: Optional[str] = None,
               embedding_quantize: Optional[str] = None, linear_type=None) -> Path:
    """Writes ``model`` (a transformers LlamaForCausalLM) to ``path`` as a GGUF
    file llama.cpp loads as a "llama" model, quantized as ``gguf_types`` says
    (``linear_type``: a GGMLQuantizationType for the linear layers instead)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    linear_t, embedding_t = gguf_types(quantize, embedding_quantize)
    linear_t = linear_type if linear_type is not None else linear_t
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise LlamaCppError("the GGUF writer handles plain RoPE only (no rope scaling)")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise LlamaCppError("the GGUF writer handles Llama without biases only")
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("cellcache-bench")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({T.F32: gguf.LlamaFileType.ALL_F32, T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                     T.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
                     T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[linear_t])
    tokens, types = _vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(min(1, len(tokens) - 1))
    w.add_eos_token_id(min(2, len(tokens) - 1))
    w.add_add_bos_token(False)

    def add(name: str, array: np.ndarray, qtype) -> None:
        data = _quantized(array, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)

    embedding = sd["model.embed_tokens.weight"]
    add("token_embd.weight", embedding, embedding_t)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], T.F32)
        add(f"blk.{i}.attn_q.weight", permute_qk(sd[p + "self_attn.q_proj.weight"], n_head),
            linear_t)
        add(f"blk.{i}.attn_k.weight", permute_qk(sd[p + "self_attn.k_proj.weight"], n_kv),
            linear_t)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], linear_t)
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], linear_t)
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], T.F32)
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], linear_t)
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], linear_t)
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], linear_t)
    add("output_norm.weight", sd["model.norm.weight"], T.F32)
    lm_head = sd.get("lm_head.weight", embedding)
    tied = np.shares_memory(lm_head, embedding)
    # Tied and stored alike: llama.cpp reuses token_embd. A quantized lm_head
    # (our export breaks the tie to quantize it) gets its own weight.
    if not (tied and embedding_t == linear_t):
        add("output.weight", lm_head, linear_t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_options(quantize: Optional[str], embedding_quantize: Optional[str]) -> dict:
    """The ProgramCache options of a bench GGUF (its key; Q4_0's blocks are 32
    weights whatever ``group_size``)."""
    from importlib.metadata import version

    return {"format": "gguf", "quantize": quantize, "embedding_quantize": embedding_quantize,
            "gguf": version("gguf")}


# ----------------------------------------------------------------------------- binary

def resolve_binary(path) -> Path:
    """``path`` itself when it is a file, else ``llama-batched-bench`` in the build
    directory ``path`` (its bin/ or top). Raises LlamaCppError when missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        for sub in _BINARY_DIRS:
            if (p / sub / BINARY).is_file():
                return (p / sub / BINARY).resolve()
        raise LlamaCppError(f"{p}: no {BINARY} in this directory or its bin/ (build it: "
                            f"cmake --build BUILD --target {BINARY})")
    if not p.exists():
        raise LlamaCppError(f"{p}: no such file or directory")
    return p.resolve()


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = " (an instruction this CPU lacks: build llama.cpp for it, e.g. " \
              "-DGGML_NATIVE=ON)" if -rc == signal.SIGILL else ""
        return f"was killed by {name}{why}"
    return f"exited with status {rc}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def check_binary(path, timeout: float = 60) -> Path:
    """The resolved llama-batched-bench binary for ``path`` (see resolve_binary),
    after checking that it is executable and that its --help is
    llama-batched-bench's. Raises LlamaCppError."""
    binary = resolve_binary(path)
    if not binary.is_file():
        raise LlamaCppError(f"{binary}: not a file")
    if not os.access(binary, os.X_OK):
        raise LlamaCppError(f"{binary}: not executable")
    try:
        proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                              errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"{binary}: --help did not finish in {timeout:.0f} s") from None
    except OSError as e:
        raise LlamaCppError(f"{binary}: cannot run it ({e.strerror or e})") from None
    text = proc.stdout + proc.stderr
    if proc.returncode < 0:
        raise LlamaCppError(f"{binary}: --help {_exit_text(proc.returncode)}")
    if not all(flag in text for flag in ("-npp", "-ntg", "-npl")):
        raise LlamaCppError(f"{binary}: not llama.cpp's {BINARY} (its --help does not list "
                            f"-npp/-ntg/-npl)")
    return binary


# ----------------------------------------------------------------------------- runs

@dataclass
class BatchedBenchRow:
    """One row of llama-batched-bench: ``pl`` sequences, each a ``pp``-token prompt
    (prefilled together) then ``tg`` decode steps of one token per sequence."""
    pp: int
    tg: int
    pl: int
    prompt_tok_s: float     # S_PP: prompt tokens / prefill seconds
    decode_tok_s: float     # S_TG: pl * tg / decode seconds (aggregate)
    prompt_seconds: float
    decode_seconds: float


_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|"
                        r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def parse_output(text: str) -> List[BatchedBenchRow]:
    """The rows of llama-batched-bench's output: JSONL (``--output-format jsonl``)
    lines, else its markdown table (|PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|...)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
                rows.append(BatchedBenchRow(int(d["pp"]), int(d["tg"]), int(d["pl"]),
                                            float(d["speed_pp"]), float(d["speed_tg"]),
                                            float(d["t_pp"]), float(d["t_tg"])))
            except (ValueError, KeyError, TypeError):
                continue
        elif (m := _TABLE_ROW.match(line)):
            pp, tg, pl, _, t_pp, s_pp, t_tg, s_tg = m.groups()
            rows.append(BatchedBenchRow(int(pp), int(tg), int(pl), float(s_pp), float(s_tg),
                                        float(t_pp), float(t_tg)))
    return rows


def _context(prompt_len: int, gen_len: int, batch_sizes: Sequence[int]) -> int:
    """-c: every sequence's prompt and generated tokens, rounded up to 256."""
    need = max(batch_sizes) * (prompt_len + gen_len)
    return -(-need // 256) * 256


def run_batched_bench(binary, gguf_path, prompt_len: int, gen_len: int,
                      batch_sizes: Sequence[int], threads: int,
                      timeout: float = 900, attempts: int = 4) -> Dict[int, BatchedBenchRow]:
    """One llama-batched-bench run: for each batch size b, b sequences with their
    own ``prompt_len``-token prompts (prefilled in one batch), then ``gen_len``
    steps decoding one token per sequence; ``threads`` for prefill and decode.
    Returns {b: row}. A run that exits 0 without its rows is repeated, up to
    ``attempts`` runs. Raises LlamaCppError (a failed run, missing rows)."""
    cmd = [str(binary), "-m", str(gguf_path), "-c", str(_context(prompt_len, gen_len,
                                                                 batch_sizes)),
           "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(gen_len),
           "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    # llama.cpp's logger prints from a thread that exit does not wait for (its
    # singleton is leaked on purpose, llama.cpp issue 22142): a run that exits 0
    # sometimes loses its last lines, the rows among them (1 run in 5 on a tiny
    # model here). Such a run is repeated.
    for attempt in range(attempts):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                                  timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise LlamaCppError(f"{binary}: did not finish in {timeout:.0f} s") from None
        except OSError as e:
            raise LlamaCppError(f"{binary}: cannot run it ({e.strerror or e})") from None
        if proc.returncode != 0:
            last = _last_line(proc.stderr) or _last_line(proc.stdout)
            raise LlamaCppError(f"{binary}: {_exit_text(proc.returncode)}"
                                + (f": {last}" if last else ""))
        rows = {r.pl: r for r in parse_output(proc.stdout + "\n" + proc.stderr)
                if r.pp == prompt_len and r.tg == gen_len}
        missing = [b for b in batch_sizes if b not in rows]
        if not missing:
            return rows
    raise LlamaCppError(f"{binary}: its output has no row for -npp {prompt_len} -ntg "
                        f"{gen_len} -npl {','.join(map(str, missing))} ({attempts} runs): "
                        f"{_last_line(proc.stderr) or _last_line(proc.stdout) or 'empty'}")


# ----------------------------------------------------------------------------- the bench

def decode_batches(batch_sizes: Sequence[int]) -> List[int]:
    """The batch sizes of llama.cpp's decode rows: B=1 and B=8 (those of ours)."""
    return [b for b in (1, 8) if b in batch_sizes]


def measure(binary: Path, gguf_path: Path, ours: Callable[[], Dict[str, float]],
            prompt_len: int, prefill_len: int, gen_len: int, batch_sizes: Sequence[int],
            threads: int, rounds: int, say, warmup: int = 1) -> Dict[str, float]:
    """Ours and llama.cpp taking turns, ``warmup`` rounds (not counted) then
    ``rounds`` rounds: each round calls ``ours`` (which measures ours and returns
    {name: tok/s}) then runs llama-batched-bench twice (decode: ``-npp prompt_len
    -ntg gen_len -npl batch_sizes``; prefill: ``-npp prefill_len -ntg 1 -npl 1``).
    Returns medians over the counted rounds: ``ours_alongside_llama_cpp_<name>``
    for ours, ``llama_cpp_decode_tok_s_b<b>`` and ``llama_cpp_prefill_tok_s`` for
    llama.cpp. Raises LlamaCppError."""
    import statistics

    figures: Dict[str, List[float]] = {}
    for r in range(warmup + rounds):
        measured = {f"ours_alongside_llama_cpp_{name}": value for name, value in ours().items()}
        rows = run_batched_bench(binary, gguf_path, prompt_len, gen_len, batch_sizes, threads)
        for b in batch_sizes:
            measured[f"llama_cpp_decode_tok_s_b{b}"] = rows[b].decode_tok_s
        pre = run_batched_bench(binary, gguf_path, prefill_len, 1, [1], threads)[1]
        measured["llama_cpp_prefill_tok_s"] = pre.prompt_tok_s
        label = "warm-up" if r < warmup else f"round {r - warmup + 1}/{rounds}"
        say(f"  {label}: llama.cpp decode " + ", ".join(
            f"B={b} {rows[b].decode_tok_s:.1f}" for b in batch_sizes) +
            f" tok/s, prefill {pre.prompt_tok_s:.0f} tok/s")
        if r >= warmup:
            for key, value in measured.items():
                figures.setdefault(key, []).append(value)
    return {k: statistics.median(v) for k, v in figures.items()}
