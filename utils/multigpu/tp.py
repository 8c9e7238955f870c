"""Tensor-parallel Llama decode by hand: a Megatron-style split over ranks, two all-reduces per layer.

Rank r of `world` holds:
- attention: the rows of q/k/v_proj for its heads (column-parallel: no communication), the matching
  columns of o_proj (row-parallel: a partial sum, then one all-reduce of the hidden vector);
- MLP: the rows of gate/up_proj for its share of the intermediate features, the matching columns of
  down_proj (one more all-reduce);
- the embedding and the norms whole (a lookup reads one row), the rows of lm_head for its share of the
  vocabulary (one all-gather of the logits at the end).

So one generated token costs 2 x layers all-reduces of `hidden` numbers (per sequence of the batch) and one
all-gather. `TPLlama` reads only its shard of each weight from the safetensors files (`safe_open(...).get_slice`),
keeps a static KV cache in buffers updated with `index_copy_`, and takes one step with no host synchronisation, so
its step can be compiled and captured in one CUDA/HIP graph together with its collectives (`make_step`). A
`Variant` names how a step runs (eager or graph, fused or separate products, NCCL or a one-shot all-reduce over
symmetric memory: `utils.multigpu.comm`, tuned kernels); `utils.multigpu.attribution` says where its time goes.
`python -m utils.multigpu.tp` is the program every rank runs (`utils.multigpu.launch`).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from utils import timing
from utils.base import state
from utils.llm import models
from utils.multigpu import attribution, launch
from utils.multigpu.collectives import init, library_version
from utils.multigpu.comm import Collectives, OneShotNormCollectives, SymmMemCollectives, symm_skip_reason

# A Llama small enough for two CPU ranks in CI, divisible by 1, 2 and 4 ranks.
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, vocab_size=512, tie_word_embeddings=False)
MODES = ("eager", "graph")
# Lab 06's sets of variants (`Variant`), each step one more optimisation: TP_VARIANTS chooses one.
PRESETS = {"ladder": ("eager", "graph", "graph+symm", "graph+symm+tuned", "graph+arnorm", "graph+arnorm+tuned"),
           "quick": ("eager", "graph+arnorm+tuned"),
           "all": ("eager", "graph+unfused", "graph", "graph+tuned", "graph+symm", "graph+symm+tuned",
                   "graph+arnorm", "graph+arnorm+tuned")}
LARGE_VARIANTS = ("graph", "graph+arnorm+tuned")     # at the larger batch, on GPUs
SPLIT_BY = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def model_config(shape: str, **overrides):
    """A LlamaConfig: "tiny" (CPU) or a published shape of `utils.llm.models.SHAPES`."""
    from transformers import LlamaConfig

    if shape == "tiny":
        return LlamaConfig(**{**TINY, **overrides})
    return models.llama_config(shape, **overrides)


def split(total: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of `total`; a clear error if it does not divide."""
    if total % world:
        raise ValueError(f"{what}={total} does not split over {world} ranks (it must be a multiple of {world})")
    size = total // world
    return rank * size, (rank + 1) * size


def ranks_for(config, available: int) -> tuple[int, str | None]:
    """The most ranks, up to `available`, that every split dimension of `config` divides (`SPLIT_BY`), and a note
    when that is fewer than `available` (Llama-3.1-8B's 8 KV heads do not split over 3 GPUs: 2 ranks)."""
    n = max(1, available)
    while n > 1 and any(getattr(config, what) % n for what in SPLIT_BY):
        n -= 1
    if n == available or available < 1:
        return n, None
    blocked = [f"{what}={getattr(config, what)}" for what in SPLIT_BY if getattr(config, what) % available]
    return n, (f"{available} GPUs, but {', '.join(blocked)} do not split {available} ways: {n} ranks "
               f"(RANKS={n}; the other GPUs stay idle)")


def one_gpu_variants(variants) -> list[str]:
    """`variants` as one GPU runs them: no all-reduce to replace (the symmetric-memory flags dropped), each once."""
    return list(dict.fromkeys(Variant.parse(v).name.replace("+symm", "").replace("+arnorm", "") for v in variants))


def max_len_for(tokens: list[int], decode: int, profile_tokens: int = 4) -> int:
    """KV-cache length for the checked tokens, then the timed and the profiled decodes (each from the end of them)."""
    return len(tokens) + max(decode, profile_tokens) + 8


def tolerance(dtype, noise: float | None = None) -> float:
    """Largest accepted max|a - b| / max|b| between logits of the same model from two correct programs
    (other summation orders): FP32 rounding, or BF16/FP16 rounding through every layer. `noise`, how far
    one process in this dtype lands from FP32 math, raises it to 3x that when larger."""
    base = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-4)
    return base if noise is None else max(base, 3 * noise)


def compare(logits, reference) -> float:
    """max|logits - reference| / max|reference|, in float32."""
    a, b = logits.float(), reference.float()
    if a.shape != b.shape:
        raise ValueError(f"logits of shape {tuple(a.shape)} cannot be compared with {tuple(b.shape)}")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def save_random_model(shape: str, out_dir: str | Path, *, dtype, device: str = "cpu", seed: int = 0) -> Path:
    """A Llama of `shape` with random weights, saved as safetensors (what from_pretrained and TPLlama read)."""
    import shutil

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape), dtype=dtype)
    shutil.rmtree(out, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    del model
    return out


class _Weights:
    """Reads whole tensors or row/column slices from a safetensors model folder, without loading the rest."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.stack = contextlib.ExitStack()
        index = folder / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else ["model.safetensors"])
        self.where = {}
        for name in files:
            handle = self.stack.enter_context(safe_open(str(folder / name), framework="pt", device="cpu"))
            for key in handle.keys():
                self.where[key] = handle

    def __contains__(self, name):
        return name in self.where

    def get(self, name, *, rows=None, cols=None):
        sl = self.where[name].get_slice(name)
        if rows is not None:
            return sl[rows[0]:rows[1]]
        if cols is not None:
            return sl[:, cols[0]:cols[1]]
        return sl[:]

    def close(self):
        self.stack.close()


def _mlp_shard(w: _Weights, layer: int, features: tuple[int, int]):
    """Layer `layer`'s MLP shard for the intermediate features [start, stop): the rows of gate_proj and up_proj
    in one matrix (column-parallel), the matching columns of down_proj (row-parallel)."""
    p = f"model.layers.{layer}.mlp."
    wgu = torch.cat([w.get(p + "gate_proj.weight", rows=features), w.get(p + "up_proj.weight", rows=features)])
    return wgu, w.get(p + "down_proj.weight", cols=features)


def mlp(x, wgu, wd, *, fuse: bool = True):
    """A rank's MLP: SiLU(gate) * up on its features, times its columns of down_proj: a partial sum of the
    whole MLP's output (the all-reduce over the ranks makes it whole). `fuse=False` computes gate and up as two
    products over the halves of `wgu` (the same numbers, one more kernel)."""
    if fuse:
        gate, up = F.linear(x, wgu).chunk(2, dim=-1)
    else:
        gate, up = (F.linear(x, w) for w in wgu.chunk(2))
    return F.linear(F.silu(gate) * up, wd)


def mlp_partial(model_dir, layer: int, x, *, rank: int, world: int):
    """Rank `rank` of `world`'s partial output of layer `layer`'s MLP on `x`, before the all-reduce: the shard
    `TPLlama` reads and the computation it runs, in x's dtype and on its device (lab 06 compares it with the
    learner's column- and row-parallel layers)."""
    from transformers import AutoConfig   # heavy: imported where it is needed, as TPLlama does

    cfg = AutoConfig.from_pretrained(model_dir)
    w = _Weights(Path(model_dir))
    try:
        wgu, wd = _mlp_shard(w, layer, split(cfg.intermediate_size, rank, world, "intermediate_size"))
    finally:
        w.close()
    return mlp(x, wgu.to(x), wd.to(x))


class _Layer(torch.nn.Module):
    """One decoder layer's shards and KV cache, as buffers (what torch.compile and CUDA graphs need)."""

    def __init__(self, tensors: dict):
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)


def rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

def _check_batch(batch) -> None:
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a whole number >= 1")


class TPLlama(torch.nn.Module):
    """Rank `rank` of `world`'s shard of a Llama from `model_dir`, decoding `batch` sequences in step (one token
    each, all at the same position); `decode_step()` takes one step. `fuse=False` runs q, k, v (and gate, up) as
    separate products over views of the fused weights: the same numbers, more and smaller kernels."""

    def __init__(self, model_dir, *, rank: int = 0, world: int = 1, group=None, device="cpu",
                 dtype=None, max_len: int = 256, comm=None, batch: int = 1, fuse: bool = True):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        folder = Path(model_dir)
        cfg = AutoConfig.from_pretrained(folder)
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("TPLlama handles Llama without biases (attention_bias and mlp_bias False)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"TPLlama handles the SiLU MLP of Llama, not hidden_act={cfg.hidden_act!r}")
        _check_batch(batch)
        self.config, self.rank, self.world, self.batch, self.fuse = cfg, rank, world, batch, fuse
        # how the ranks talk (utils.multigpu.comm): NCCL/RCCL or gloo collectives over `group`, or a one-shot
        # all-reduce over symmetric memory; a test can pass another object with the same two methods
        self.comm = comm if comm is not None else (Collectives(group) if world > 1 else None)
        self.device = torch.device(device)
        dtype = dtype or torch.float32
        self.dtype = dtype
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        H, KV, I, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size
        h0, h1 = split(H, rank, world, "num_attention_heads")
        k0, k1 = split(KV, rank, world, "num_key_value_heads")
        i0, i1 = split(I, rank, world, "intermediate_size")
        v0, v1 = split(V, rank, world, "vocab_size")
        self.D, self.Hl, self.KVl, self.max_len = D, h1 - h0, k1 - k0, max_len
        # the cache rounded up to 16 positions, as lab 05's lean decoder does: SDPA's memory-efficient kernel wants
        # the mask's rows 16-aligned and would pad them in every layer otherwise; the extra positions stay masked
        self.cache_len = -(-max_len // 16) * 16
        self.eps = cfg.rms_norm_eps
        put = dict(device=self.device, dtype=dtype)
        w = _Weights(folder)
        try:
            p = "model.layers.{}."
            layers = []
            for i in range(cfg.num_hidden_layers):
                g = lambda n, **kw: w.get(p.format(i) + n, **kw)   # noqa: E731
                wqkv = torch.cat([g("self_attn.q_proj.weight", rows=(h0 * D, h1 * D)),
                                  g("self_attn.k_proj.weight", rows=(k0 * D, k1 * D)),
                                  g("self_attn.v_proj.weight", rows=(k0 * D, k1 * D))])
                wgu, wd = _mlp_shard(w, i, (i0, i1))
                layers.append(_Layer({
                    "ln1": g("input_layernorm.weight").to(**put), "wqkv": wqkv.to(**put),
                    "wo": g("self_attn.o_proj.weight", cols=(h0 * D, h1 * D)).to(**put),
                    "ln2": g("post_attention_layernorm.weight").to(**put), "wgu": wgu.to(**put),
                    "wd": wd.to(**put),
                    "k_cache": torch.zeros(batch, self.KVl, self.cache_len, D, **put),
                    "v_cache": torch.zeros(batch, self.KVl, self.cache_len, D, **put)}))
                del wqkv, wgu, wd
            self.layers = torch.nn.ModuleList(layers)
            head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
            self.register_buffer("embed", w.get("model.embed_tokens.weight").to(**put), persistent=False)
            self.register_buffer("norm", w.get("model.norm.weight").to(**put), persistent=False)
            self.register_buffer("lm_head", w.get(head, rows=(v0, v1)).to(**put), persistent=False)
        finally:
            w.close()
        rope = LlamaRotaryEmbedding(config=cfg)
        cos, sin = rope(torch.empty(1, dtype=dtype, device=self.device), torch.arange(max_len, device=self.device)[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        self.register_buffer("positions", torch.arange(self.cache_len, device=self.device), persistent=False)
        self.register_buffer("token", torch.zeros(batch, dtype=torch.long, device=self.device), persistent=False)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=self.device), persistent=False)
        self.register_buffer("logits", torch.zeros(batch, V, dtype=dtype, device=self.device), persistent=False)
        self.scale = D ** -0.5
        self.vocab = V

    def set_batch(self, batch: int) -> None:
        """Decode `batch` sequences from now on: new (zeroed) KV caches and token/logits buffers; the weights stay."""
        _check_batch(batch)
        self.batch = batch
        for L in self.layers:
            L.k_cache = L.v_cache = None
            L.k_cache = torch.zeros(batch, self.KVl, self.cache_len, self.D, device=self.device, dtype=self.dtype)
            L.v_cache = torch.zeros_like(L.k_cache)
        self.token = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.logits = torch.zeros(batch, self.vocab, dtype=self.dtype, device=self.device)

    def weight_bytes(self) -> int:
        """Bytes of weights this rank reads per step: its shards of every layer and of the output layer (one row
        of the embedding besides: negligible)."""
        names = ("ln1", "wqkv", "wo", "ln2", "wgu", "wd")
        per_layer = sum(getattr(self.layers[0], n).nbytes for n in names)
        return per_layer * len(self.layers) + self.lm_head.nbytes + self.norm.nbytes

    # --- communication: the only two places ranks talk ---
    def all_reduce(self, x):
        return x if self.comm is None else self.comm.all_reduce(x)

    def all_gather_logits(self, x):
        """[batch, vocab/world] on every rank -> [batch, vocab]: the ranks' parts side by side."""
        if self.comm is None:
            return x
        parts = self.comm.all_gather(x)                                  # [world * batch, vocab / world]
        return parts.view(self.world, self.batch, -1).transpose(0, 1).reshape(self.batch, self.vocab)

    def all_reduce_add_norm(self, partial, h, weight, slot: int):
        """(h + the all-reduced `partial`, its RMSNorm times `weight`): where a layer's halves end. One kernel when
        the communication object has it (`utils.multigpu.oneshot`), else the all-reduce, the add and the norm;
        `slot` (0 attention, 1 MLP) tells that kernel which half of its buffer to use."""
        fused = getattr(self.comm, "all_reduce_add_norm", None)
        if fused is not None:
            return fused(partial, h, weight, self.eps, slot)
        h = h + self.all_reduce(partial)
        return h, rms_norm(h, weight, self.eps)

    # --- one step in three functions (each compiled on its own in graph mode; see make_step) ---
    def head(self, token, pos):
        """The embedding of `token` [batch], normalised for the first layer, and what every layer shares: cos/sin at
        `pos` and the attention mask (0 where a cached position may be seen, -inf after `pos`)."""
        D = self.D
        h = self.embed.index_select(0, token)                            # [batch, hidden]
        cos = self.cos.index_select(0, pos.view(1)).view(1, 1, 1, D)
        sin = self.sin.index_select(0, pos.view(1)).view(1, 1, 1, D)
        visible = (self.positions <= pos).view(1, 1, 1, self.cache_len)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device).masked_fill(~visible, float("-inf"))
        return h, rms_norm(h, self.layers[0].ln1, self.eps), cos, sin, mask

    def layer(self, h, x, cos, sin, mask, pos, wqkv, wo, ln2, wgu, wd, ln_next, k_cache, v_cache):
        """One decoder layer on this rank's shard: `h` is the residual stream, `x` its RMSNorm for this layer's
        attention; returns the stream after the layer and its RMSNorm by `ln_next` (the next layer's input norm, or
        the final one): each all-reduce meets the residual add and the norm after it (`all_reduce_add_norm`)."""
        B, D, Hl, KVl = self.batch, self.D, self.Hl, self.KVl
        if self.fuse:
            q, k, v = F.linear(x, wqkv).split([Hl * D, KVl * D, KVl * D], dim=-1)
        else:
            q, k, v = (F.linear(x, wqkv[a:b]) for a, b in ((0, Hl * D), (Hl * D, (Hl + KVl) * D),
                                                           ((Hl + KVl) * D, (Hl + 2 * KVl) * D)))
        q, k, v = q.view(B, Hl, 1, D), k.view(B, KVl, 1, D), v.view(B, KVl, 1, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.index_copy_(2, pos.view(1), k)
        v_cache.index_copy_(2, pos.view(1), v)
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=self.scale,
                                           enable_gqa=Hl != KVl)
        h, x = self.all_reduce_add_norm(F.linear(a.reshape(B, Hl * D), wo), h, ln2, 0)       # all-reduce 1
        return self.all_reduce_add_norm(mlp(x, wgu, wd, fuse=self.fuse), h, ln_next, 1)      # all-reduce 2

    def finish(self, x):
        """`x`, the last layer's output after the final norm: this rank's part of the vocabulary, the all-gather of
        the logits, the greedy next token; advances the position."""
        logits = self.all_gather_logits(F.linear(x, self.lm_head))
        self.logits.copy_(logits)
        self.token.copy_(logits.argmax(-1))
        self.pos.add_(1)

    def decode_step(self, fns=None):
        """One greedy step on the buffers: logits of `token` at `pos`, next token, pos + 1. `fns`: compiled
        (head, layer, finish), else these methods."""
        head, layer, finish = fns or (self.head, self.layer, self.finish)
        h, x, cos, sin, mask = head(self.token, self.pos)
        norms = [L.ln1 for L in self.layers[1:]] + [self.norm]
        for L, ln_next in zip(self.layers, norms):
            h, x = layer(h, x, cos, sin, mask, self.pos, L.wqkv, L.wo, L.ln2, L.wgu, L.wd, ln_next,
                         L.k_cache, L.v_cache)
        finish(x)

    def reset(self, pos: int = 0, token: int | None = None):
        self.pos.fill_(pos)
        if token is not None:
            self.token.fill_(token)


# --- variants of the step ------------------------------------------------------------------------------

def _sync(device):
    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Variant:
    """How a step runs: "eager" (Python, one launch per operation) or "graph" (each of head, layer, finish compiled
    by torch.compile, the whole step, collectives included, captured in one CUDA/HIP graph); fused or separate
    q/k/v and gate/up products; NCCL's all-reduce, PyTorch's one-shot one over symmetric memory ("symm"), or the
    course's one-shot kernel fused with the residual add and RMSNorm after it ("arnorm", `utils.multigpu.oneshot`);
    inductor's
    coordinate-descent tuning of its kernels (with it, torch.compile also writes the one-row products as its own
    kernels, fused with the norms and activations around them). Written like "graph+symm+tuned" (`Variant.parse`)."""
    mode: str = "eager"
    fuse: bool = True
    comm: str = "nccl"
    tune: bool = False

    @classmethod
    def parse(cls, text: str) -> "Variant":
        mode, *flags = text.strip().split("+")
        if mode not in MODES:
            raise ValueError(f"variant {text!r}: its mode must be one of {MODES}")
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"variant {text!r}: unknown {sorted(unknown)}; use {'+'.join(FLAGS)} after the mode")
        if {"symm", "arnorm"} <= set(flags):
            raise ValueError(f"variant {text!r}: choose one all-reduce, symm or arnorm")
        if mode == "eager" and "tuned" in flags:
            raise ValueError(f"variant {text!r}: 'tuned' tunes compiled kernels (graph mode only)")
        comm = next((f for f in ("symm", "arnorm") if f in flags), "nccl")
        return cls(mode, "unfused" not in flags, comm, "tuned" in flags)

    @property
    def name(self) -> str:
        return "+".join([self.mode] + ["unfused"] * (not self.fuse) + [self.comm] * (self.comm != "nccl")
                        + ["tuned"] * self.tune)

    def describe(self) -> str:
        parts = {"eager": "eager", "graph": "compiled, one CUDA/HIP graph"}[self.mode]
        parts += ", q/k/v and gate/up fused" if self.fuse else ", q/k/v and gate/up separate"
        if self.comm == "symm":
            parts += ", one-shot all-reduce (symmetric memory)"
        if self.comm == "arnorm":
            parts += ", one-shot all-reduce + add + RMSNorm in one kernel (Triton, symmetric memory)"
        return parts + (", kernels tuned" if self.tune else "")


FLAGS = ("unfused", "symm", "arnorm", "tuned")


def make_step(model, mode: str | Variant = "eager", *, tune: bool = False):
    """A function that takes one decode step: "eager" (Python, one kernel launch per operation) or "graph"
    (`head`, `layer` and `finish` compiled by torch.compile, each once, then the whole step, collectives included,
    captured in one CUDA/HIP graph: one launch per token)."""
    if isinstance(mode, Variant):
        mode, tune = mode.mode, mode.tune
    if mode == "eager":
        return model.decode_step
    if mode != "graph":
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if model.device.type != "cuda":
        raise RuntimeError("graph mode needs a GPU (CUDA or HIP graphs)")
    options = {"coordinate_descent_tuning": True} if tune else None
    fns = tuple(torch.compile(f, fullgraph=True, dynamic=False, options=options)
                for f in (model.head, model.layer, model.finish))
    start = int(model.pos.item())
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):
        for _ in range(3):                        # compile and warm up outside the capture
            model.decode_step(fns)
    torch.cuda.current_stream(model.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        model.decode_step(fns)
    _sync(model.device)
    model.reset(start)
    return graph.replay


def teacher_forced_logits(model, step, tokens: list[int]):
    """Logits [len(tokens), vocab] (float32, on the CPU; the first sequence of the batch, every sequence being fed
    the same tokens) of feeding `tokens` one step at a time from position 0: the same as one forward pass over the
    whole sequence."""
    model.reset(0)
    out = []
    for t in tokens:
        model.token.fill_(t)
        step()
        out.append(model.logits[0].to("cpu", torch.float32, copy=True))   # the buffer is overwritten
    return torch.stack(out)


def decode_rate(model, step, n: int, *, start: int, rounds: int = 5, warmup: int = 3) -> dict:
    """Greedy decode with `step`: `rounds` timings of `n` steps each (from position `start`), after `warmup`
    untimed steps. Returns the median step in ms, tokens/s over the batch, each round's ms per step, and their
    spread (interquartile range / median, as `utils.timing.Timing` has it)."""
    samples = []
    model.reset(start)
    for _ in range(warmup):
        step()
    for _ in range(rounds):
        model.reset(start)
        _sync(model.device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _sync(model.device)
        samples.append((time.perf_counter() - t0) / n * 1e3)
    t = timing.Timing(tuple(samples), "perf_counter")
    return {"step_ms": t.median_ms, "tokens_per_s": model.batch * 1e3 / t.median_ms, "samples_ms": samples,
            "spread": t.spread}


def copy_gbps(device, nbytes: int = 1 << 30) -> float | None:
    """This GPU's measured device-to-device copy bandwidth (bytes read + written per second, GB/s, `utils.timing`'s
    median): the ceiling a rank's weight reads are set against; None on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return timing.benchmark(lambda: b.copy_(a), warmup=3, reps=10, flush_l2=False, device=device).gbps(2 * nbytes)


def hf_reference_logits(model, tokens: list[int]):
    """Logits [len(tokens), vocab] (float32, CPU) of one forward pass of a transformers model."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        return model(ids).logits[0].float().cpu()


def hf_collectives_per_token(model, tokens: list[int]) -> dict:
    """Collectives one decode step of a transformers model runs (after a prefill), from torch.profiler.

    The step's logits are read before the profiler stops: a DTensor or transformers collective may still be running
    then (functional collectives are waited on lazily), and gloo ends its "gloo:..." profiler event on its own worker
    thread, racing the profiler's teardown (a rank once died of SIGSEGV in the profiler's __exit__ on a 2-core CPU)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = model(ids[:, -1:], past_key_values=past, use_cache=True)
            out.logits.float().sum().item()   # waits for every collective the step started
    counts = {}
    for e in prof.key_averages():
        name = attribution.collective_name(e.key)
        if name:
            counts[name] = counts.get(name, 0) + e.count
    return counts


def free(device):
    """Let go of what a measurement left: compiled code (it holds the model), then cached GPU memory."""
    torch._dynamo.reset()
    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


# --- the program every rank runs, and its launch -----------------------------------------------------------

def launch_split(model_dir, tokens: list[int], *, nproc: int, decode: int, variants, large_batch: int = 0,
                 large_variants=(), hf: bool = False, dtensor: bool = False, timeout: float,
                 variant_timeout: float | None = None, name: str = "tensor-parallel"):
    """`python -m utils.multigpu.tp` on `nproc` ranks (`utils.multigpu.launch`). Returns (result, run, failure): what
    rank 0 wrote (when a rank failed or a variant hung, what it had saved before: `result["partial"]` is then True),
    the `Run`, and the `RankFailed` (None when every rank ended well)."""
    args = ["--model", model_dir, "--tokens", ",".join(map(str, tokens)), "--decode", decode,
            "--variants", ",".join(variants)]
    if large_batch > 1 and large_variants:
        args += ["--large-batch", large_batch, "--large-variants", ",".join(large_variants)]
    args += ["--hf"] * hf + ["--dtensor"] * dtensor
    args += ["--variant-timeout", variant_timeout] if variant_timeout else []
    try:
        run = launch.torchrun("utils.multigpu.tp", args, nproc=nproc, timeout=timeout, name=name)
        return run.result(), run, None
    except launch.RankFailed as exc:
        try:
            result = exc.run.result() if exc.run else None
        except (OSError, ValueError):
            result = None
        return result, exc.run, exc


def _record(fn):
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return fn
    return record(fn)


def _comm_for(variant: Variant, model, comms: dict, group, device):
    """The communication object of `variant` on this rank: NCCL's (made once), or a symmetric-memory one (made once,
    collectively: every rank reaches this call for the same variant); None on one rank."""
    if model.world == 1:
        return None
    hidden = model.config.hidden_size
    if variant.comm == "symm" and "symm" not in comms:
        comms["symm"] = SymmMemCollectives(group, numel=model.batch * hidden, dtype=model.dtype, device=device)
    if variant.comm == "arnorm" and "arnorm" not in comms:
        comms["arnorm"] = OneShotNormCollectives(group, rows=model.batch, hidden=hidden, dtype=model.dtype,
                                                 device=device)
    if variant.comm != "nccl":
        return comms[variant.comm]
    if "nccl" not in comms:
        comms["nccl"] = Collectives(group)
    return comms["nccl"]


def run_hand(model_dir, tokens, *, rank, world, group, device, dtype, decode, plans, out: Path | None,
             profile_tokens: int = 4, variant_timeout: float | None = None, on_result=None) -> dict:
    """The hand-written split on this rank, for each (batch, [variant names]) of `plans`: each variant's logits of
    `tokens` (saved as hand-<variant>-b<batch>-rank<r>.pt), its decode rate, and where a step's time goes
    (`utils.multigpu.attribution`). A variant this machine cannot run is reported with its reason and the others
    still run; one that does not end within `variant_timeout` seconds (a hung graph capture, say) ends the process
    with every thread's traceback (faulthandler), after `on_result` has been given what was measured so far."""
    results = {"batches": {}}
    model = TPLlama(model_dir, rank=rank, world=world, group=group, device=device, dtype=dtype, batch=plans[0][0],
                    max_len=max_len_for(tokens, decode, profile_tokens))
    results["weight_bytes"] = model.weight_bytes()
    results["copy_gbps"] = copy_gbps(device)
    comms = {}                                # this rank's communication objects, made once each
    for batch, variants in plans:
        if batch != model.batch:
            model.set_batch(batch)
            comms.pop("symm", None)           # their buffers hold one batch's hidden vectors
            comms.pop("arnorm", None)
        entries = results["batches"][str(batch)] = {}
        for name in variants:
            variant = Variant.parse(name)
            entry = entries[variant.name] = {"describe": variant.describe()}
            why = symm_skip_reason(device) or ("one rank: there is nothing to all-reduce" if world == 1 else None)
            if variant.comm != "nccl" and why:
                entry["skip"] = why
                continue
            if variant.mode == "graph" and torch.device(device).type != "cuda":
                entry["skip"] = "graph mode needs a GPU (CUDA or HIP graphs)"
                continue
            _run_variant(model, variant, entry, tokens, decode=decode, profile_tokens=profile_tokens, out=out,
                         comm=functools.partial(_comm_for, variant, model, comms, group, device),
                         timeout=variant_timeout)
            if on_result:
                on_result(results)
    del model, comms
    free(device)
    return results


def _run_variant(model, variant: Variant, entry: dict, tokens, *, decode, profile_tokens, out, comm, timeout):
    """One variant on this rank, into `entry`: checked logits (saved), decode rate, profile; an error is recorded."""
    if timeout:
        faulthandler.dump_traceback_later(timeout, exit=True)
    step = None
    try:
        model.fuse = variant.fuse
        model.comm = comm()
        t0 = time.perf_counter()
        step = make_step(model, variant)
        entry["make_step_s"] = time.perf_counter() - t0
        logits = teacher_forced_logits(model, step, tokens)
        if out is not None:
            torch.save(logits, out / f"hand-{variant.name}-b{model.batch}-rank{model.rank}.pt")
        entry.update(decode_rate(model, step, decode, start=len(tokens)))
        model.reset(len(tokens))
        try:
            entry["profile"] = attribution.profile_step(step, profile_tokens, model.device, entry["step_ms"])
        except Exception as exc:  # noqa: BLE001 - the speed stands without the profile
            entry["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # noqa: BLE001 - reported (a graph this stack cannot capture); the rest runs
        entry["error"] = f"{type(exc).__name__}: {exc}"
        print(f"rank {model.rank}: by hand, {variant.name}, batch {model.batch}: {entry['error']}", flush=True)
    finally:
        if timeout:
            faulthandler.cancel_dump_traceback_later()
        step = None
        model.comm = None
        free(model.device)


def dtensor_plans(config) -> tuple[dict, dict]:
    """PyTorch's own tensor parallelism for a transformers Llama, the split `TPLlama` writes by hand, as
    `parallelize_module` plans: (the plan of every decoder layer, the plan of the whole model). Column-parallel
    q/k/v and gate/up (each rank its heads and features, no communication), row-parallel o_proj and down_proj
    (a partial sum, then an all-reduce); the output layer split by vocabulary with its logits gathered
    (Replicate), unless it shares its weight with the embedding, which stays whole."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    top = {} if getattr(config, "tie_word_embeddings", False) else {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    return layer, top


def dtensor_llama(model_dir, *, world: int, device, dtype):
    """A transformers Llama from `model_dir`, split over the `world` ranks of the default group by
    `torch.distributed.tensor.parallel.parallelize_module` on a one-dimensional DeviceMesh: its weights become
    DTensors (each rank keeps its shard), its activations stay plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    mesh = init_device_mesh(torch.device(device).type, (world,))
    layer_plan, top_plan = dtensor_plans(model.config)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    if top_plan:
        parallelize_module(model, mesh, top_plan)
    return model


def _measure_sharded(model, tokens, logits_file: str, decode: int, out: Path | None) -> dict:
    """What each rank of a library's tensor parallelism reports: the logits of `tokens` (saved as `out/logits_file`),
    the collectives of one decode step, and transformers' generate's decode rate."""
    logits = hf_reference_logits(model, tokens)
    if out is not None:
        torch.save(logits, out / logits_file)
    ids = torch.tensor([tokens], device=model.device)
    return {"counts": hf_collectives_per_token(model, tokens),
            "tokens_per_s": models.decode_tokens_per_s(model, ids, decode, warmup=1)}


def run_dtensor(model_dir, tokens, *, rank, world, device, dtype, decode, out: Path | None) -> dict:
    """PyTorch's parallelize_module (DTensor) on this rank: logits of `tokens` (saved), the collectives of one
    decode step, and transformers' generate's decode rate, as for `run_hf_tp`."""
    model = dtensor_llama(model_dir, world=world, device=device, dtype=dtype)
    result = _measure_sharded(model, tokens, f"dtensor-rank{rank}.pt", decode, out)
    del model
    free(device)
    return result


def run_hf_tp(model_dir, tokens, *, rank, device, dtype, decode, out: Path | None) -> dict:
    """transformers' own tensor parallelism: from_pretrained(dir, tp_plan="auto") on every rank."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=dtype).eval()
    result = _measure_sharded(model, tokens, f"hf-rank{rank}.pt", decode, out)
    del model
    free(device)
    return result


@_record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m utils.multigpu.tp", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a safetensors Llama folder")
    p.add_argument("--tokens", required=True, help="comma-separated token ids whose logits are checked")
    p.add_argument("--decode", type=int, default=16, help="tokens timed per measurement")
    p.add_argument("--variants", default="eager", help="batch 1: comma-separated Variant names (eager,graph,graph+symm)")
    p.add_argument("--large-batch", type=int, default=0, help="a larger batch for the hand-written split (0: none)")
    p.add_argument("--large-variants", default="", help="the variants run at --large-batch")
    p.add_argument("--variant-timeout", type=float, default=None, help="seconds one variant may take on a rank")
    p.add_argument("--hf", action="store_true", help="also transformers' tp_plan='auto'")
    p.add_argument("--dtensor", action="store_true", help="also PyTorch's parallelize_module (DTensor)")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    device = init(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = [int(t) for t in a.tokens.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"world": world, "backend": dist.get_backend(), "library": library_version(), "dtype": str(dtype),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    save = (lambda r: state.write_json(a.out / "result.json", r)) if rank == 0 else (lambda r: None)
    # the libraries first: a variant of the hand-written split that hangs (and is ended) cannot take them away
    if a.hf:
        try:
            result["hf"] = run_hf_tp(a.model, tokens, rank=rank, device=device, dtype=dtype, decode=a.decode,
                                     out=a.out)
        except Exception as exc:  # noqa: BLE001 - transformers' API moves; the hand-written results still count
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: transformers tp_plan='auto' failed: {result['hf']['error']}", flush=True)
        save({**result, "partial": True})
    if a.dtensor:
        try:
            result["dtensor"] = run_dtensor(a.model, tokens, rank=rank, world=world, device=device, dtype=dtype,
                                            decode=a.decode, out=a.out)
        except Exception as exc:  # noqa: BLE001 - reported beside the other paths, which still count
            result["dtensor"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: parallelize_module failed: {result['dtensor']['error']}", flush=True)
        save({**result, "partial": True})
    plans = [(1, [v for v in a.variants.split(",") if v])]
    if a.large_batch > 1 and a.large_variants:
        plans.append((a.large_batch, a.large_variants.split(",")))
    if any(v for _, v in plans):
        result["hand"] = run_hand(a.model, tokens, rank=rank, world=world, group=dist.group.WORLD, device=device,
                                  dtype=dtype, decode=a.decode, plans=[p for p in plans if p[1]], out=a.out,
                                  variant_timeout=a.variant_timeout,
                                  on_result=lambda hand: save({**result, "hand": hand, "partial": True}))
    save(result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
