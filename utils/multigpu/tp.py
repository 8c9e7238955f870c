"""Tensor-parallel Llama decode by hand: a Megatron-style split over ranks, two all-reduces per layer.

Rank r of `world` holds:
- attention: the rows of q/k/v_proj for its heads (column-parallel: no communication), the matching
  columns of o_proj (row-parallel: a partial sum, then one all-reduce of the hidden vector);
- MLP: the rows of gate/up_proj for its share of the intermediate features, the matching columns of
  down_proj (one more all-reduce);
- the embedding and the norms whole (a lookup reads one row), the rows of lm_head for its share of the
  vocabulary (one all-gather of the logits at the end).

So one generated token costs 2 x layers all-reduces of `hidden` numbers and one all-gather. `TPLlama`
reads only its shard of each weight from the safetensors files (`safe_open(...).get_slice`), keeps a
static KV cache in buffers updated with `index_copy_`, and takes one step with no host synchronisation,
so `decode_step` can be compiled and captured in a CUDA/HIP graph together with its collectives
(`make_step(model, "graph")`). `python -m utils.multigpu.tp` is the program every rank runs (`utils.multigpu.launch`).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from utils.llm import models
from utils.multigpu.collectives import init, library_version

# A Llama small enough for two CPU ranks in CI, divisible by 1, 2 and 4 ranks.
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, vocab_size=512, tie_word_embeddings=False)
MODES = ("eager", "graph")
COMM_PREFIXES = ("nccl:", "gloo:")   # the names torch.profiler gives collectives (RCCL: ProcessGroupNCCL too)


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


def max_len_for(tokens: list[int], decode: int, profile_tokens: int = 4) -> int:
    """KV-cache length for the checked tokens, then a timed and a profiled decode (each from the same start)."""
    return len(tokens) + 2 * (decode + profile_tokens + 8)


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


def mlp(x, wgu, wd):
    """A rank's MLP: SiLU(gate) * up on its features, times its columns of down_proj: a partial sum of the
    whole MLP's output (the all-reduce over the ranks makes it whole)."""
    gate, up = F.linear(x, wgu).chunk(2, dim=-1)
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


class Collectives:
    """The two collectives of the split, over a torch.distributed group (functional collectives: they
    return new tensors, so torch.compile can trace them and a CUDA/HIP graph can capture them)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD

    def all_reduce(self, x):
        import torch.distributed._functional_collectives as fc

        return fc.all_reduce(x, "sum", self.group)

    def all_gather(self, x):
        """[1, part] on every rank -> [ranks, part], rank r's part in row r."""
        import torch.distributed._functional_collectives as fc

        gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor   # the newer name, same call
        return gather(x, 0, self.group)


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

class TPLlama(torch.nn.Module):
    """Rank `rank` of `world`'s shard of a Llama from `model_dir`; `decode_step()` takes one token."""

    def __init__(self, model_dir, *, rank: int = 0, world: int = 1, group=None, device="cpu",
                 dtype=None, max_len: int = 256, comm=None):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        folder = Path(model_dir)
        cfg = AutoConfig.from_pretrained(folder)
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("TPLlama handles Llama without biases (attention_bias and mlp_bias False)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"TPLlama handles the SiLU MLP of Llama, not hidden_act={cfg.hidden_act!r}")
        self.config, self.rank, self.world = cfg, rank, world
        # how the ranks talk: torch.distributed's functional collectives over `group` (traceable by
        # torch.compile, capturable in a graph); a test can pass another object with the same two methods
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
                    "k_cache": torch.zeros(1, self.KVl, max_len, D, **put),
                    "v_cache": torch.zeros(1, self.KVl, max_len, D, **put)}))
                del wqkv, wgu, wd
            self.layers = torch.nn.ModuleList(layers)
            head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
            self.register_buffer("embed", w.get("model.embed_tokens.weight").to(**put), persistent=False)
            self.register_buffer("norm", w.get("model.norm.weight").to(**put), persistent=False)
            self.register_buffer("lm_head", w.get(head, rows=(v0, v1)).to(**put), persistent=False)
        finally:
            w.close()
        rope = LlamaRotaryEmbedding(config=cfg)
        positions = torch.arange(max_len, device=self.device)
        cos, sin = rope(torch.empty(1, dtype=dtype, device=self.device), positions[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        self.register_buffer("positions", positions, persistent=False)
        self.register_buffer("token", torch.zeros(1, dtype=torch.long, device=self.device), persistent=False)
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=self.device), persistent=False)
        self.register_buffer("logits", torch.zeros(1, V, dtype=dtype, device=self.device), persistent=False)
        self.scale = D ** -0.5
        self.vocab = V

    # --- communication: the only two places ranks talk ---
    def all_reduce(self, x):
        return x if self.comm is None else self.comm.all_reduce(x)

    def all_gather_logits(self, x):
        return x if self.comm is None else self.comm.all_gather(x).reshape(1, self.vocab)

    def forward(self, token, pos):
        """Logits [1, vocab] of `token` at position `pos` (0-dim), every earlier position cached."""
        D, Hl, KVl = self.D, self.Hl, self.KVl
        h = self.embed.index_select(0, token)                           # [1, hidden]
        cos = self.cos.index_select(0, pos.view(1)).view(1, 1, 1, D)
        sin = self.sin.index_select(0, pos.view(1)).view(1, 1, 1, D)
        mask = (self.positions <= pos).view(1, 1, 1, self.max_len)
        for layer in self.layers:
            x = rms_norm(h, layer.ln1, self.eps)
            q, k, v = F.linear(x, layer.wqkv).split([Hl * D, KVl * D, KVl * D], dim=-1)
            q, k, v = q.view(1, Hl, 1, D), k.view(1, KVl, 1, D), v.view(1, KVl, 1, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            layer.k_cache.index_copy_(2, pos.view(1), k)
            layer.v_cache.index_copy_(2, pos.view(1), v)
            a = F.scaled_dot_product_attention(q, layer.k_cache, layer.v_cache, attn_mask=mask,
                                               scale=self.scale, enable_gqa=Hl != KVl)
            h = h + self.all_reduce(F.linear(a.reshape(1, Hl * D), layer.wo))      # all-reduce 1
            x = rms_norm(h, layer.ln2, self.eps)
            h = h + self.all_reduce(mlp(x, layer.wgu, layer.wd))                    # all-reduce 2
        x = rms_norm(h, self.norm, self.eps)
        return self.all_gather_logits(F.linear(x, self.lm_head))

    def decode_step(self):
        """One greedy step on the buffers: logits of `token` at `pos`, next token, pos + 1."""
        logits = self.forward(self.token, self.pos)
        self.logits.copy_(logits)
        self.token.copy_(logits.argmax(-1))
        self.pos.add_(1)

    def reset(self, pos: int = 0, token: int | None = None):
        self.pos.fill_(pos)
        if token is not None:
            self.token.fill_(token)



# --- running it ----------------------------------------------------------------------------------------

def _sync(device):
    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize(device)


def make_step(model, mode: str):
    """A function that takes one decode step: "eager" (Python, one kernel launch per operation) or
    "graph" (torch.compile, then the whole step, collectives included, captured in one CUDA/HIP graph)."""
    if mode == "eager":
        return model.decode_step
    if mode != "graph":
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if model.device.type != "cuda":
        raise RuntimeError("graph mode needs a GPU (CUDA or HIP graphs)")
    compiled = torch.compile(model.decode_step, fullgraph=True, dynamic=False)
    start = int(model.pos.item())
    side = torch.cuda.Stream(model.device)
    side.wait_stream(torch.cuda.current_stream(model.device))
    with torch.cuda.stream(side):
        for _ in range(3):                        # compile and warm up outside the capture
            compiled()
    torch.cuda.current_stream(model.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        compiled()
    _sync(model.device)
    model.reset(start)
    return graph.replay


def teacher_forced_logits(model, step, tokens: list[int]):
    """Logits [len(tokens), vocab] (float32, on the CPU) of feeding `tokens` one step at a time from
    position 0: the same as one forward pass over the whole sequence."""
    model.reset(0)
    out = []
    for t in tokens:
        model.token.fill_(t)
        step()
        out.append(model.logits[0].to("cpu", torch.float32, copy=True))   # the buffer is overwritten
    return torch.stack(out)


def tokens_per_s(model, step, n: int, *, start: int, warmup: int = 3) -> float:
    """Greedy decode rate of `step`, tokens/s, for `n` tokens after `warmup` untimed ones."""
    model.reset(start)
    for _ in range(warmup):
        step()
    _sync(model.device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    _sync(model.device)
    return n / (time.perf_counter() - t0)


def collective_name(key: str) -> str | None:
    """"nccl:all_reduce" -> "all_reduce"; None for anything that is not a collective."""
    low = key.lower()
    if not low.startswith(COMM_PREFIXES):
        return None
    for name, words in (("reduce_scatter", ("reduce_scatter", "reducescatter")),
                        ("all_reduce", ("all_reduce", "allreduce")), ("all_gather", ("all_gather", "allgather")),
                        ("all_to_all", ("all_to_all", "alltoall")), ("broadcast", ("broadcast",))):
        if any(w in low for w in words):
            return name
    return low.split(":", 1)[1]


def profile_split(step, n: int, device) -> dict:
    """Per token, from torch.profiler over `n` steps: the collectives each rank ran (counts), and the
    time in communication and in compute. On a GPU both are kernel times (NCCL/RCCL kernels, which
    include the wait for the peer, against all others); on a CPU, communication is the time gloo's
    operations took and compute is the rest of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    gpu = getattr(device, "type", device) == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        _sync(device)
    wall = (time.perf_counter() - t0) / n
    counts, comm, compute = {}, 0.0, 0.0
    for e in prof.key_averages():
        name = collective_name(e.key)
        if name:
            counts[name] = counts.get(name, 0) + e.count / n
        if gpu:
            dev_time = getattr(e, "self_device_time_total", None)
            if dev_time is None:
                dev_time = getattr(e, "self_cuda_time_total", 0)
            if dev_time and _is_kernel(e):
                if "nccl" in e.key.lower() or "rccl" in e.key.lower():
                    comm += dev_time
                else:
                    compute += dev_time
        elif name:
            comm += e.cpu_time_total
    comm_ms = comm / 1e3 / n
    compute_ms = compute / 1e3 / n if gpu else max(0.0, wall * 1e3 - comm_ms)
    return {"counts": counts, "comm_ms": comm_ms, "compute_ms": compute_ms, "wall_ms": wall * 1e3,
            "kernel_times": gpu}


def _is_kernel(event) -> bool:
    from torch.autograd import DeviceType

    return getattr(event, "device_type", None) == DeviceType.CUDA


def hf_reference_logits(model, tokens: list[int]):
    """Logits [len(tokens), vocab] (float32, CPU) of one forward pass of a transformers model."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        return model(ids).logits[0].float().cpu()


def hf_collectives_per_token(model, tokens: list[int]) -> dict:
    """Collectives one decode step of a transformers model runs (after a prefill), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids[:, -1:], past_key_values=past, use_cache=True)
    counts = {}
    for e in prof.key_averages():
        name = collective_name(e.key)
        if name:
            counts[name] = counts.get(name, 0) + e.count
    return counts


def free(device):
    """Let go of what a measurement left: compiled code (it holds the model), then cached GPU memory."""
    torch._dynamo.reset()
    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


# --- the program every rank runs ------------------------------------------------------------------------

def _record(fn):
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return fn
    return record(fn)


def run_hand(model_dir, tokens, *, rank, world, group, device, dtype, decode, modes, out: Path | None,
             profile_tokens: int = 4) -> dict:
    """The hand-written split on this rank: logits of `tokens` for each mode (saved), tokens/s, profile."""
    results = {}
    model = TPLlama(model_dir, rank=rank, world=world, group=group, device=device, dtype=dtype,
                    max_len=max_len_for(tokens, decode, profile_tokens))
    for mode in modes:
        entry = results[mode] = {}
        try:
            step = make_step(model, mode)
            logits = teacher_forced_logits(model, step, tokens)
            if out is not None:
                torch.save(logits, out / f"hand-{mode}-rank{rank}.pt")
            entry["tokens_per_s"] = tokens_per_s(model, step, decode, start=len(tokens))
            model.reset(len(tokens))
            try:
                entry["profile"] = profile_split(step, profile_tokens, device)
            except Exception as exc:  # noqa: BLE001 - the speed stands without the profile
                entry["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported (a graph this stack cannot capture); the rest runs
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: by hand, {mode}: {results[mode]['error']}", flush=True)
        step = None
        free(device)
    del model
    free(device)
    return results


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
    p.add_argument("--modes", default="eager", help="eager,graph")
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
    result["hand"] = run_hand(a.model, tokens, rank=rank, world=world, group=dist.group.WORLD, device=device,
                              dtype=dtype, decode=a.decode, modes=a.modes.split(","), out=a.out)
    if a.hf:
        try:
            result["hf"] = run_hf_tp(a.model, tokens, rank=rank, device=device, dtype=dtype, decode=a.decode,
                                     out=a.out)
        except Exception as exc:  # noqa: BLE001 - transformers' API moves; the hand-written results still count
            result["hf"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: transformers tp_plan='auto' failed: {result['hf']['error']}", flush=True)
    if a.dtensor:
        try:
            result["dtensor"] = run_dtensor(a.model, tokens, rank=rank, world=world, device=device, dtype=dtype,
                                            decode=a.decode, out=a.out)
        except Exception as exc:  # noqa: BLE001 - reported beside the other paths, which still count
            result["dtensor"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"rank {rank}: parallelize_module failed: {result['dtensor']['error']}", flush=True)
    if rank == 0:
        (a.out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
