"""A lean batch-1 Llama decoder in plain PyTorch: static KV cache, one compiled step per token.

``LeanDecoder.from_hf(model, max_len)`` takes the weights of a transformers ``LlamaForCausalLM``
(shared, not copied, unless ``fuse=True`` concatenates the Q/K/V and gate/up projections) and
decodes greedily with a KV cache preallocated for ``max_len`` positions and updated in place. One
decode step (embedding, every layer, the output layer and the argmax) is a single function of
``(token, position)`` with fixed shapes, so ``torch.compile(mode="reduce-overhead",
fullgraph=True)`` captures it whole in one CUDA (HIP) graph: one launch per token, no Python per
layer. Prefill runs the same code eagerly.

``compare_with_generate`` checks its greedy tokens and logits against transformers' ``generate``;
``tokens_per_s`` measures decode like ``models.decode_tokens_per_s`` (the prompt's prefill
removed); ``profile_tokens`` and ``time_table`` show where one decode step's time goes (kernels,
launch gaps) for any ``generate``-like function; ``serve_step_breakdown`` times the phases of a
step of transformers' continuous batching, the engine of ``transformers serve``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from utils.llm import models

# RoPE variants whose tables depend on the sequence length reached so far (transformers rescales
# them as the sequence grows): a fixed table cannot reproduce them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_clock = time.perf_counter                     # what tokens_per_s times with (a test replaces it)
ATTENTION = ("sdpa", "grouped")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, in the order transformers computes it (FP32 statistics, cast, then scale)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (..., T, head_dim) with ``cos``/``sin`` (T, head_dim): rotate halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_tables(model, max_len: int):
    """cos and sin for positions 0..max_len-1 from the model's own rotary module (its theta, its
    scaling and attention factor), in the model's dtype as transformers applies them."""
    config = model.config
    rope_type = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
                 or {}).get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"rope_type={rope_type!r} changes with the sequence length; LeanDecoder supports "
                         f"fixed RoPE tables only (not {', '.join(_LENGTH_DEPENDENT_ROPE)})")
    rotary = model.model.rotary_emb
    device = rotary.inv_freq.device
    positions = torch.arange(max_len, device=device)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros((), dtype=torch.float32, device=device), positions)
    return cos[0].to(model.dtype), sin[0].to(model.dtype)


class _Layer(nn.Module):
    """One decoder layer's weights (buffers sharing the transformers model's storage, or fused
    copies) and its KV cache."""

    def __init__(self, hf_layer, *, fuse: bool, max_len: int, kv_heads: int, head_dim: int):
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        w = lambda linear: linear.weight.detach()  # noqa: E731
        self.fused = fuse
        self.register_buffer("attn_norm", hf_layer.input_layernorm.weight.detach(), persistent=False)
        self.register_buffer("mlp_norm", hf_layer.post_attention_layernorm.weight.detach(), persistent=False)
        if fuse:
            self.register_buffer("wqkv", torch.cat([w(attn.q_proj), w(attn.k_proj), w(attn.v_proj)]),
                                 persistent=False)
            self.register_buffer("w_gate_up", torch.cat([w(mlp.gate_proj), w(mlp.up_proj)]), persistent=False)
        else:
            for name, linear in (("wq", attn.q_proj), ("wk", attn.k_proj), ("wv", attn.v_proj),
                                 ("w_gate", mlp.gate_proj), ("w_up", mlp.up_proj)):
                self.register_buffer(name, w(linear), persistent=False)
        self.register_buffer("wo", w(attn.o_proj), persistent=False)
        self.register_buffer("w_down", w(mlp.down_proj), persistent=False)
        ref = attn.q_proj.weight
        shape = (1, kv_heads, max_len, head_dim)       # max_len: the decoder's cache_len
        self.register_buffer("k_cache", torch.zeros(shape, dtype=ref.dtype, device=ref.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=ref.dtype, device=ref.device), persistent=False)


class LeanDecoder(nn.Module):
    """Greedy batch-1 decoding of a Llama with a static KV cache; see the module docstring.

    Build it with ``from_hf``; ``generate(input_ids, new_tokens)`` returns the prompt followed by
    ``new_tokens`` greedy tokens, like ``model.generate(..., do_sample=False)`` with end-of-sequence
    ignored. ``compile()`` replaces the eager decode step by a compiled one.
    """

    def __init__(self, model, max_len: int, *, fuse: bool = True, attention: str = "sdpa"):
        super().__init__()
        _check_supported(model)
        config = model.config
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2:
            raise ValueError(f"max_len={max_len!r} must be a whole number >= 2 (prompt + new tokens)")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}; use one of {', '.join(map(repr, ATTENTION))}")
        self.max_len, self.fuse, self.attention = max_len, fuse, attention
        # the cache rounded up to 16 positions: SDPA's memory-efficient kernel wants the mask's rows
        # 16-aligned and would pad them in every layer otherwise; the extra positions stay masked
        self.cache_len = -(-max_len // 16) * 16
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.layers = nn.ModuleList(
            _Layer(layer, fuse=fuse, max_len=self.cache_len, kv_heads=self.kv_heads, head_dim=self.head_dim)
            for layer in model.model.layers)
        self.register_buffer("embed", model.model.embed_tokens.weight.detach(), persistent=False)
        self.register_buffer("norm", model.model.norm.weight.detach(), persistent=False)
        self.register_buffer("lm_head", model.lm_head.weight.detach(), persistent=False)   # tied: same storage
        cos, sin = _rope_tables(model, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("positions", torch.arange(self.cache_len, device=cos.device), persistent=False)
        self._step_fn = self._step
        self.compiled = None

    @classmethod
    def from_hf(cls, model, max_len: int, *, fuse: bool = True, attention: str = "sdpa") -> "LeanDecoder":
        """A decoder over ``model``'s weights with room for ``max_len`` positions (prompt + new tokens).

        ``fuse=True`` concatenates the Q, K, V projections and the gate and up projections into
        two matrices per layer (fewer, larger matrix-vector products; a copy of ~55% of each
        layer's weights, freed with the decoder). ``attention="sdpa"`` calls SDPA with
        ``enable_gqa=True``; ``"grouped"`` folds each KV head's query heads into the query length
        instead (the same arithmetic, no GQA support needed from the SDPA backend).
        """
        return cls(model, max_len, fuse=fuse, attention=attention)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # -- the model --------------------------------------------------------------------------------
    def _mask(self, pos: torch.Tensor) -> torch.Tensor:
        """The attention mask of queries at ``pos`` (T,) over the cache, built once per step for
        every layer: 0 where a query may attend (cache position <= its own), -inf elsewhere. (A
        boolean mask means the same to SDPA, which converts it to this in every layer.)"""
        visible = self.positions[None, :] <= pos[:, None]                       # (T, L)
        if self.attention == "grouped":
            visible = visible.repeat(self.heads // self.kv_heads, 1)            # (group * T, L)
        mask = torch.zeros(visible.shape, dtype=self.cos.dtype, device=visible.device)
        return mask.masked_fill(~visible, float("-inf"))

    def _attend(self, q, k, v, mask):
        """q (1, H, T, D) against the whole cache k, v (1, Hkv, L, D) under ``_mask``."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        # "grouped": query head h uses KV head h // group, so (H, T) regroups as (Hkv, group * T)
        _, heads, t, d = q.shape
        out = F.scaled_dot_product_attention(q.reshape(1, self.kv_heads, heads // self.kv_heads * t, d), k, v,
                                             attn_mask=mask)
        return out.reshape(1, heads, t, d)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits (1, 1, vocab) of the last of ``tokens`` (1, T) at positions ``pos`` (T,); writes
        their keys and values into the cache at ``pos``."""
        t = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self._mask(pos)
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, self.eps)
            if layer.fused:
                q, k, v = F.linear(h, layer.wqkv).split([nq, nkv, nkv], dim=-1)
            else:
                q, k, v = F.linear(h, layer.wq), F.linear(h, layer.wk), F.linear(h, layer.wv)
            q = rope(q.view(1, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = rope(k.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
            layer.k_cache.index_copy_(2, pos, k)
            layer.v_cache.index_copy_(2, pos, v)
            o = self._attend(q, layer.k_cache, layer.v_cache, mask)
            x = x + F.linear(o.transpose(1, 2).reshape(1, t, nq), layer.wo)
            h = rms_norm(x, layer.mlp_norm, self.eps)
            if layer.fused:
                gate, up = F.linear(h, layer.w_gate_up).chunk(2, dim=-1)
            else:
                gate, up = F.linear(h, layer.w_gate), F.linear(h, layer.w_up)
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        return F.linear(rms_norm(x[:, -1:], self.norm, self.eps), self.lm_head)

    def _step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step: the greedy next token (1, 1) after ``token`` (1, 1) at ``pos`` (1,)."""
        return self.forward(token, pos).argmax(dim=-1)

    # -- compiling and generating -----------------------------------------------------------------
    def compile(self, mode: str | None = "reduce-overhead", *, backend: str = "inductor", **inductor_options):
        """Compile the decode step whole (``fullgraph=True``: a graph break is an error, not a slow
        path). ``mode`` is a ``torch.compile`` mode; extra ``inductor_options`` (for example
        ``coordinate_descent_tuning=True``) are added to that mode's options. The compile itself
        happens on the first step (tens of seconds for an 8B model on a GPU)."""
        if inductor_options:
            import torch._inductor as inductor

            options = {**inductor.list_mode_options(mode or "default"), **inductor_options}
            fn = torch.compile(self._step, backend=backend, fullgraph=True, options=options)
        elif backend == "inductor":
            fn = torch.compile(self._step, backend=backend, fullgraph=True, mode=mode)
        else:
            fn = torch.compile(self._step, backend=backend, fullgraph=True)
        self._step_fn = fn
        self.compiled = dict(mode=mode, backend=backend, **inductor_options)
        return self

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """The prompt ``input_ids`` (1, T) followed by ``new_tokens`` greedy tokens: (1, T + new_tokens)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape (1, T) (batch 1), not {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids is on {input_ids.device}, the decoder on {self.device}")
        t = input_ids.shape[1]
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"new_tokens={new_tokens!r} must be a whole number >= 1")
        if t < 1 or t + new_tokens > self.max_len:
            raise ValueError(f"the prompt needs at least 1 token and prompt ({t}) + new_tokens ({new_tokens}) "
                             f"at most max_len={self.max_len}")
        vocab = self.embed.shape[0]
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        token = self._step(input_ids, torch.arange(t, device=self.device))      # prefill, eager
        tokens = [input_ids, token]
        pos = torch.full((1,), t, dtype=torch.long, device=self.device)
        for _ in range(new_tokens - 1):
            # a compiled step's output lives in the CUDA graph's memory, which the next replay
            # overwrites: keep and feed back a copy
            token = self._step_fn(token, pos).clone()
            tokens.append(token)
            pos += 1
        return torch.cat(tokens, dim=1)

    @torch.no_grad()
    def teacher_forced_logits(self, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """FP32 logits (N, vocab) that predict ``ids[:, prompt_len:]`` (N tokens), one eager step at a
        time along ``ids`` (not along the decoder's own picks): what ``generate`` computes when the
        tokens agree, comparable with transformers' logits step by step."""
        if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= prompt_len < ids.shape[1] <= self.max_len:
            raise ValueError(f"ids {tuple(ids.shape)} must be (1, T) with 1 <= prompt_len={prompt_len} < T <= "
                             f"max_len={self.max_len}")
        logits = [self.forward(ids[:, :prompt_len], torch.arange(prompt_len, device=self.device))]
        for i in range(prompt_len, ids.shape[1] - 1):
            logits.append(self.forward(ids[:, i:i + 1], torch.full((1,), i, device=self.device)))
        return torch.cat(logits, dim=1)[0].float()


def _check_supported(model) -> None:
    """Raise a clear error for the Llama variants this decoder does not implement."""
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head") or not hasattr(model, "config"):
        raise ValueError(f"LeanDecoder needs a transformers LlamaForCausalLM, not {type(model).__name__}")
    config = model.config
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"{flag}=True is not supported by LeanDecoder (Llama has no biases)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (Llama uses 'silu')")
    if model.device.type == "meta":
        raise ValueError("the model is on the meta device: load or initialise its weights first")


# -- checking, timing, profiling ------------------------------------------------------------------
@dataclass
class Agreement:
    """How a decoder's greedy tokens and logits compare with transformers' ``generate``."""

    steps: int                   # new tokens compared
    identical: int               # leading new tokens identical to generate's
    logit_error: float           # max |Δ logit| / max |logit|, teacher-forced along generate's tokens
    margin: float | None         # at the first differing token: generate's logit of its token minus
                                 # its logit of the decoder's token (small = a near-tie), else None
    scale: float = 1.0           # max |logit| of generate's logits: what logit_error is relative to

    @property
    def all_identical(self) -> bool:
        return self.identical == self.steps

    def ok(self, tolerance: float) -> bool:
        """Logits within ``tolerance`` (relative) and tokens identical, or diverging only at a
        near-tie: where generate's two candidates are closer than the logits' own tolerance."""
        if not self.logit_error <= tolerance:
            return False
        return self.all_identical or self.margin <= tolerance * self.scale

    def __str__(self) -> str:
        text = f"{self.identical}/{self.steps} tokens identical to generate, logits within {self.logit_error:.1e}"
        if self.margin is not None:
            text += f"; first difference at step {self.identical}, where generate's top logit leads by {self.margin:.3g}"
        return text


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative logit tolerance for ``dtype`` (of the largest logit): the same arithmetic in another
    order (fused matrices, other kernels) rounds differently, and the differences grow with depth.
    1e-4 for FP32, 3e-2 for 16-bit formats; tests/test_decode.py shows real bugs (a wrong RoPE
    base, swapped KV heads, a mask that ignores positions) exceed the FP32 one over 100 times."""
    return {torch.float32: 1e-4, torch.float64: 1e-9}.get(dtype, 3e-2)


@torch.no_grad()
def reference(model, input_ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy ``generate`` for ``steps`` new tokens, end-of-sequence ignored: the
    sequence (1, T + steps) and the FP32 logits (steps, vocab) that chose each new token."""
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=steps, eos_token_id=None, pad_token_id=_pad_id(model),
                         output_logits=True, return_dict_in_generate=True)
    if out.sequences.shape[1] != input_ids.shape[1] + steps:
        raise RuntimeError(f"generate returned {out.sequences.shape[1] - input_ids.shape[1]} tokens, not {steps}")
    return out.sequences, torch.cat([step.float() for step in out.logits])


@torch.no_grad()
def compare_with_generate(model, decoder: LeanDecoder, input_ids: torch.Tensor, steps: int,
                          ref: tuple[torch.Tensor, torch.Tensor] | None = None) -> Agreement:
    """Greedy tokens of ``decoder`` (compiled or not) against ``model.generate`` for ``steps`` new
    tokens (end-of-sequence ignored by both), and the decoder's eager logits against generate's,
    step by step along generate's tokens. ``ref``: a ``reference(model, input_ids, steps)`` to reuse."""
    ref_ids, ref_logits = ref if ref is not None else reference(model, input_ids, steps)
    t = input_ids.shape[1]
    if ref_ids.shape[1] != t + steps or not torch.equal(ref_ids[:, :t], input_ids):
        raise ValueError("ref is not a reference for this prompt and number of steps")
    ours = decoder.generate(input_ids, steps)[0, t:]
    expected = ref_ids[0, t:]
    differ = (ours != expected).nonzero()
    identical = int(differ[0, 0]) if len(differ) else steps
    logits = decoder.teacher_forced_logits(ref_ids, t)
    scale = float(ref_logits.abs().max().clamp_min(1e-30))
    error = float((logits - ref_logits).abs().max()) / scale
    margin = None
    if identical < steps:
        row = ref_logits[identical]
        margin = float(row[expected[identical]] - row[ours[identical]])
    return Agreement(steps, identical, error, margin, scale)


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = eos if isinstance(eos, int) else 0
    return pad


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def tokens_per_s(decoder: LeanDecoder, prompt_ids: torch.Tensor, new_tokens: int, *, warmup: int = 1,
                 rounds: int = 3) -> float:
    """Batch-1 decode rate of ``decoder.generate``, measured like ``models.decode_tokens_per_s``:
    ``(new_tokens - 1) / (t(new_tokens) - t(1))`` over interleaved rounds, so the prompt's prefill cancels
    out (NaN when no decode time could be measured). ``warmup`` runs come first (a compiled step compiles
    and records its graph on its first calls). ``rate()`` gives the figure with its rounds and reason."""
    return rate(decoder, prompt_ids, new_tokens, warmup=warmup, rounds=rounds).tokens_per_s


def rate(decoder: LeanDecoder, prompt_ids: torch.Tensor, new_tokens: int, *, warmup: int = 1, rounds: int = 3):
    """``tokens_per_s`` as a ``models.DecodeRate``: the rate, each round's time per token, and why it is
    unreliable when it is."""
    sync = _sync(prompt_ids.device)

    def run(n: int) -> float:
        sync()
        start = _clock()
        decoder.generate(prompt_ids, n)
        sync()
        return _clock() - start

    return models.time_decode(run, new_tokens, warmup=warmup, rounds=rounds)


def compile_skip_reason(device) -> str | None:
    """Why the compiled decode step (CUDA/HIP graphs) cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"the compiled step replays a CUDA/HIP graph (torch.compile mode='reduce-overhead'), which needs "
                f"a GPU; on {device.type} the decoder runs eagerly")
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "torch.compile's inductor backend needs Triton for GPU kernels: pip install triton"
    return None


# Kernel families by name: cuBLAS/cuBLASLt/CUTLASS and hipBLASLt matrix products, attention kernels,
# kernels that torch.compile generated (Triton), copies; everything else is PyTorch's own kernels.
_KINDS = (
    ("attention", ("fmha", "flash", "attention", "attn", "sdpa")),
    ("matmul (vendor library)", ("gemv", "gemm", "xmma", "cutlass", "cublas", "nvjet", "hipblaslt", "Cijk")),
    ("Triton (compiled)", ("triton",)),
    ("copies", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    """The family of a GPU kernel (or CPU operator) from its name: see ``_KINDS``."""
    low = name.lower()
    if low.startswith("aten::"):
        if any(s in low for s in ("linear", "mm", "matmul")):
            return "matmul (vendor library)"
        if "attention" in low:
            return "attention"
        return "other"
    for kind, needles in _KINDS:
        if any(s.lower() in low for s in needles):
            return kind
    return "other"


def _profiled(run, device) -> tuple[list, float]:
    """Run ``run()`` under torch.profiler: (kernels, wall seconds). Kernels are (name, start µs,
    end µs): GPU kernels and copies on a GPU, top-level PyTorch operators on a CPU."""
    gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    sync = _sync(device)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync()
        wall = time.perf_counter() - start
    events = prof.events()
    if gpu:
        from torch.autograd import DeviceType

        kernels = [e for e in events if e.device_type != DeviceType.CPU]
    else:
        kernels = [e for e in events if e.name.startswith("aten::")
                   and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return [(e.name, e.time_range.start, e.time_range.end) for e in kernels], wall


def _totals(kernels: list) -> dict:
    """Totals of ``kernels`` (name, start µs, end µs): count, busy µs (the union of their
    intervals), µs by family (``kernel_kind``) and by name (calls, µs)."""
    busy, end = 0.0, float("-inf")
    for _, s, e in sorted(kernels, key=lambda k: k[1]):
        if e > end:
            busy += e - max(s, end)
            end = e
    by_kind, by_name = {}, {}
    for name, s, e in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + e - s
        calls, total = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, total + e - s)
    return dict(count=len(kernels), busy=busy, by_kind=by_kind, by_name=by_name)


def _per_token(totals: dict, base: dict | None, tokens: int, unit: str) -> dict:
    """Per-token figures of ``totals`` minus ``base`` (a run that differs by ``tokens`` tokens)."""
    base = base or dict(count=0, busy=0.0, by_kind={}, by_name={})
    by_kind = {k: (v - base["by_kind"].get(k, 0.0)) / 1e3 / tokens for k, v in totals["by_kind"].items()}
    by_name = {n: ((c - base["by_name"].get(n, (0, 0.0))[0]) / tokens,
                   (us - base["by_name"].get(n, (0, 0.0))[1]) / 1e3 / tokens) for n, (c, us) in totals["by_name"].items()}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
    return dict(unit=unit, launches_per_token=(totals["count"] - base["count"]) / tokens,
                busy_ms_per_token=(totals["busy"] - base["busy"]) / 1e3 / tokens,
                ms_per_token_by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                top=[dict(name=n[:120], calls_per_token=c, ms_per_token=ms) for n, (c, ms) in top])


def profile_tokens(generate, new_tokens: int, device) -> dict:
    """Where one decode step's time goes: profile ``generate(new_tokens)`` and ``generate(1)``
    (any callable that generates that many tokens after a prompt) and divide the difference by
    ``new_tokens - 1``, so that the prefill cancels out as in ``tokens_per_s``. On a GPU it counts
    kernels (launches, busy time = the union of their intervals, time by family, the top kernels),
    on a CPU the top-level PyTorch operators. Run it after a warm-up (compiles, graph capture)."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens!r} must be a whole number >= 2")
    device = torch.device(device)
    unit = "kernels" if device.type == "cuda" else "operators"
    if device.type == "cuda":
        # what torch.compile sets for CUDA graphs: without it, profiling again after graphs were
        # used can crash CUPTI's re-initialisation
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
        os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
    many, wall_many = _profiled(lambda: generate(new_tokens), device)
    one, wall_one = _profiled(lambda: generate(1), device)
    out = _per_token(_totals(many), _totals(one), new_tokens - 1, unit)
    out["profiled_ms_per_token"] = (wall_many - wall_one) * 1e3 / (new_tokens - 1)
    return out


def time_table(profiles: dict[str, dict], rates: dict[str, float] | None = None) -> str:
    """A Markdown table of where one decode step's time goes, a row per ``profile_tokens`` result
    in ``profiles`` (label: result); ``rates`` (label: tokens/s timed without the profiler) add a
    column. Idle = the profiled step minus the busy time: launch gaps and host work that the
    device (on a CPU: the operators) waits for."""
    rates = rates or {}
    kinds = []
    for prof in profiles.values():
        kinds += [k for k in prof["ms_per_token_by_kind"] if k not in kinds]
    unit = next(iter(profiles.values()))["unit"] if profiles else "kernels"
    head = ["", "ms/token timed", "ms/token profiled", "busy ms", "idle ms", f"{unit}/token"] + [f"{k} ms" for k in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, prof in profiles.items():
        rate, step, busy = rates.get(label), prof["profiled_ms_per_token"], prof["busy_ms_per_token"]
        cells = [label, f"{1e3 / rate:.2f}" if rate else "–", f"{step:.2f}", f"{busy:.2f}", f"{step - busy:.2f}",
                 f"{prof['launches_per_token']:.0f}"]
        cells += [f"{prof['ms_per_token_by_kind'].get(k, 0.0):.2f}" for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve_step_breakdown(model, prompt_ids: torch.Tensor, new_tokens: int, cb_config=None) -> dict:
    """Where a continuous-batching decode step of transformers goes at concurrency 1 (the engine
    behind ``transformers serve --continuous-batching``): ``model.generate_batch`` on one request.
    The batch processor's three phases are timed on the host in every step (scheduling and
    building the batch's tensors, the generation step, updating the requests); on a GPU the
    kernels of one step are profiled as in ``profile_tokens``. Returns milliseconds per decode step
    (the prefill step left out), and the profile (None on a CPU: the profiler does not see the
    operators of the engine's own thread there).

    The phases are methods of transformers' internal ``ContinuousBatchProcessor``
    (``prepare_next_batch``, ``_generation_step``, ``update_batch``; the same in 5.17 and 5.23): a
    version without them raises ``RuntimeError``. (Continuous batching switches the model to a
    paged attention implementation and back when it stops.)
    """
    import functools

    import transformers
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching import continuous_api

    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 4:
        raise ValueError(f"new_tokens={new_tokens!r} must be a whole number >= 4")
    proc = continuous_api.ContinuousBatchProcessor
    phases = ("prepare_next_batch", "_generation_step", "update_batch")
    missing = [p for p in phases if not callable(getattr(proc, p, None))]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__}: ContinuousBatchProcessor has no "
                           f"{', '.join(missing)}; this breakdown knows 5.17-5.23")
    calls: list[tuple[str, float, float]] = []

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                calls.append((name, start, time.perf_counter()))
        return wrapper

    def run(n: int):
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=_pad_id(model))
        kwargs = dict(generation_config=gen, progress_bar=False)
        if cb_config is not None:
            kwargs["continuous_batching_config"] = cb_config
        return model.generate_batch([prompt_ids[0].tolist()], **kwargs)

    device = prompt_ids.device
    originals = {p: proc.__dict__[p] for p in phases}
    run(new_tokens)                                                          # warm-up: graphs, compiles
    try:
        for p in phases:
            setattr(proc, p, timed(p, originals[p]))
        run(new_tokens)
    finally:
        for p in phases:
            setattr(proc, p, originals[p])
    steps = [c for c in calls if c[0] == "_generation_step"][1:]            # decode steps, not the prefill
    if len(steps) < 3:
        raise RuntimeError(f"generate_batch made {len(steps) + 1} generation steps for {new_tokens} tokens")
    first, last = steps[0][1], steps[-1][1]
    n = len(steps) - 1                                                      # whole steps between the two
    period = (last - first) / n
    window = [c for c in calls if first <= c[1] < last]
    per_step = {p: sum(c[2] - c[1] for c in window if c[0] == p) * 1e3 / n for p in phases}
    per_step["outside the three phases"] = period * 1e3 - sum(per_step.values())
    profile = profile_tokens(run, new_tokens, device) if device.type == "cuda" else None
    return dict(transformers=transformers.__version__, steps=len(steps), step_ms=period * 1e3,
                phases_ms=per_step, profile=profile)
