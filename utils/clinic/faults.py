"""Realistic porting bugs to switch on, one at a time, in a transformers Llama model, and the kernels behind them.

Each fault goes in through a documented extension point, never by editing transformers: a forward hook that replaces
a module's output (`register_forward_hook`), an attention function registered with `AttentionInterface` (and its
mask function with `AttentionMaskInterface`) and selected by `model.set_attn_implementation`, or a module rebuilt
from an edited config. `inject(model, "c")` is a context manager: the model is as it was when the block ends.

    (a) lanes32   RMSNorm's sum of squares: a shuffle reduction written for 32 lanes, run on 64-lane wavefronts
    (b) bf16acc   the vocabulary projection (a GEMV) keeps its running sum in a bf16 register instead of fp32
    (c) rightpad  an attention kernel that takes sequence lengths and assumes right padding, given a left-padded batch
    (d) rope      the RoPE base lost in a config conversion: 10000 (LlamaConfig's default) instead of the model's
    (e) target    the GPU's code object is missing: PyTorch built for other targets (the doctor explains it)
    (f) fp8       an FP8 checkpoint (OCP e4m3fn, a scale per row) whose bytes are read as MI300X's FNUZ e4m3fnuz
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from utils import fp8


@dataclass(frozen=True)
class Fault:
    key: str
    name: str
    story: str          # the field report it stands for
    where: str          # the module the finder should name


FAULTS = {
    "a": Fault("a", "32-lane reduction on 64-lane wavefronts",
               "an RMSNorm kernel whose shuffle tree starts at offset 16: right on NVIDIA and RDNA (32 lanes), "
               "half the sum of squares on CDNA (64 lanes)", "model.layers.0.input_layernorm"),
    "b": Fault("b", "GEMV accumulating in bf16",
               "a decode GEMV for the vocabulary projection that keeps its running sum in a bf16 register "
               "(8 significant bits) instead of fp32", "lm_head"),
    "c": Fault("c", "attention mask that assumes right padding",
               "an attention kernel that takes sequence lengths (keys 0..len-1) and is given a left-padded batch",
               "model.layers.0.self_attn"),
    "d": Fault("d", "RoPE base lost in a config conversion",
               "a converted config without rope_theta, so LlamaConfig's default 10000 replaces the model's own base",
               "model.rotary_emb"),
    "e": Fault("e", "kernel compiled for another target",
               "a PyTorch build without the GPU's architecture: the weights load, the first kernel launch fails",
               "model.embed_tokens"),
    "f": Fault("f", "FP8 checkpoint read in the other dialect",
               "the decoder's linear layers quantized to OCP float8_e4m3fn with a scale per row (an NVIDIA or MI355X "
               "checkpoint), their bytes read as float8_e4m3fnuz (MI300X's FNUZ dialect): every weight half its value, "
               "and any -0.0 byte a NaN", "model.layers.0.self_attn.q_proj"),
}
WRONG_ROPE_THETA = 10000.0


def describe(key: str) -> Fault:
    if key not in FAULTS:
        raise ValueError(f"unknown fault {key!r}; the faults are {', '.join(FAULTS)}")
    return FAULTS[key]


# --- (a) a reduction over lanes, as the SIMT model runs it ---------------------------------------

def reduction_offsets(width: int) -> list[int]:
    """The shuffle offsets of a tree reduction over `width` lanes: width/2, ..., 2, 1."""
    if width < 1 or width & (width - 1):
        raise ValueError(f"width={width} must be a power of two")
    offsets, o = [], width // 2
    while o >= 1:
        offsets.append(o)
        o //= 2
    return offsets


def lane_sum(x: torch.Tensor, width: int, offsets) -> torch.Tensor:
    """The sum over the last dimension that a shuffle reduction computes (`utils.simt.wave_sum`, batched): the
    elements are spread over wavefronts of `width` lanes; each wavefront adds `shfl_down(v, offset)` for each
    offset (a lane whose source lies outside its wavefront keeps its own value), then lane 0 of each wavefront
    contributes its value. Shape (..., n) -> (..., 1)."""
    n = x.shape[-1]
    v = torch.nn.functional.pad(x, (0, (-n) % width)).reshape(*x.shape[:-1], -1, width)
    lane = torch.arange(width, device=x.device)
    for offset in offsets:
        src = torch.roll(v, -int(offset), dims=-1)
        v = v + torch.where(lane + int(offset) < width, src, v)
    return v[..., 0].sum(-1, keepdim=True)


def rms_norm_lanes(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int, offsets) -> torch.Tensor:
    """Llama's RMSNorm (float32 inside, like transformers') with its sum of squares done by `lane_sum`."""
    dtype = x.dtype
    h = x.float()
    variance = lane_sum(h * h, width, offsets) / h.shape[-1]
    return weight * (h * torch.rsqrt(variance + eps)).to(dtype)


def _norm_hook(width: int, offsets):
    def hook(module, args, output):
        return rms_norm_lanes(args[0], module.weight, module.variance_epsilon, width, offsets)
    return hook


# --- (b) a GEMV and its accumulator --------------------------------------------------------------

def gemv_bf16_accumulator(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T with bf16 inputs and a bf16 running sum, one multiply-add per k in order (the rounding of
    `acc = __hfma(a, b, acc)` on bf16 values): the fault. Output in x's dtype."""
    xb, wt = x.to(torch.bfloat16), weight.to(torch.bfloat16).t().contiguous()
    acc = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=torch.bfloat16, device=x.device)
    for k in range(x.shape[-1]):
        acc = torch.addcmul(acc, xb[..., k:k + 1], wt[k])
    return acc.to(x.dtype)


def gemv_fp32_accumulator(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same kernel done right: bf16 inputs, products summed in float32, rounded to bf16 once at the end."""
    return (x.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().t()).to(torch.bfloat16).to(x.dtype)


def gemv_hook(gemv):
    """A forward hook that replaces a Linear's output by `gemv(input, weight)` (+ bias)."""
    def hook(module, args, output):
        x = args[0]
        out = gemv(x.reshape(-1, x.shape[-1]), module.weight).reshape(*x.shape[:-1], -1)
        return out if module.bias is None else out + module.bias
    return hook


# --- (c) attention and its mask -------------------------------------------------------------------

def causal(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """(q_len, k_len) bool: query i (the last q_len positions of k_len) may see key j <= its position."""
    i = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] <= i


def keep_right_padded(real: torch.Tensor, q_len: int) -> torch.Tensor:
    """The fault's mask: from each sequence's length only, keys 0..len-1 (right padding assumed). (B,1,q,k)."""
    k_len = real.shape[-1]
    lengths = real.sum(-1)
    return causal(q_len, k_len, real.device)[None, None] & (
        torch.arange(k_len, device=real.device)[None, None, None, :] < lengths[:, None, None, None])


def keep_left_padded(real: torch.Tensor, q_len: int) -> torch.Tensor:
    """The right mask for any padding: causal, and only real keys. (B,1,q,k)."""
    return causal(q_len, real.shape[-1], real.device)[None, None] & real[:, None, None, :]


def attention_function(keep_fn):
    """An attention function for `AttentionInterface`: the mask comes from `keep_fn(real, q_len)`, where `real`
    is the (batch, keys) bool mask of real tokens (read from the mask transformers passes, or all True)."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, h, q_len, d = query.shape
        k_len = key.shape[2]
        if attention_mask is None:
            real = torch.ones(b, k_len, dtype=torch.bool, device=query.device)
        else:
            last = attention_mask[:, 0, -1, :]
            real = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
        keep = keep_fn(real, q_len)
        rep = h // key.shape[1]
        k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        scale = scaling if scaling is not None else d ** -0.5
        scores = (query @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(query.dtype)   # padding rows: all masked
        return (probs @ v).transpose(1, 2).contiguous(), None
    return attention


def use_attention(model, name: str, fn):
    """Register `fn` under `name` (with transformers' SDPA mask function) and switch `model` to it; returns
    the implementation it had."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    return before


# --- (d) the rotary embedding of an edited config ------------------------------------------------

def rebuild_rotary(model, **rope_changes):
    """A copy of the model's rotary-embedding module built from its config with `rope_parameters` changed."""
    rotary = model.model.rotary_emb
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, **rope_changes}
    return type(rotary)(config=config).to(next(rotary.buffers()).device)


# --- switching a fault on ------------------------------------------------------------------------

def _norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


MISSING_CODE_OBJECT = ("HIP error: invalid device function\nHIP kernel errors might be asynchronously reported at "
                       "some other API call, so the stacktrace below might be incorrect.")


def _raise_missing_code_object(module, args):
    raise RuntimeError(MISSING_CODE_OBJECT + "\n(simulated by utils.clinic.faults.inject(model, 'e'): what PyTorch "
                       "raises when its build has no code object for the GPU's architecture)")


@contextlib.contextmanager
def lanes_norm(model, width: int, offsets):
    """Every RMSNorm of `model` computes its sum of squares as a shuffle reduction over `width`-lane
    wavefronts with these `offsets`, for the block (fault (a) with offsets 16..1 on 64 lanes; its fix with
    `reduction_offsets(width)`)."""
    handles = [m.register_forward_hook(_norm_hook(width, offsets)) for m in _norms(model)]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def _linear_hook(weight: torch.Tensor):
    def hook(module, args, output):
        bias = None if module.bias is None else module.bias.to(output.dtype)
        return torch.nn.functional.linear(args[0], weight.to(output.device, output.dtype), bias)
    return hook


@contextlib.contextmanager
def fp8_weights(model, written=torch.float8_e4m3fn, read_as=torch.float8_e4m3fnuz):
    """For the block, every nn.Linear of the decoder layers computes with its weight quantized to `written` (a float32
    scale per row) and its bytes read back as `read_as`, then scaled: fault (f) with the defaults; its fix reads them
    as they were written (`read_as=written`). Yields {module name: (bytes that are NaN when read, of how many)}."""
    handles, stats = [], {}
    try:
        for name, m in model.model.layers.named_modules():
            if isinstance(m, torch.nn.Linear):
                q, scale = fp8.quantize_rows(m.weight, written)
                w = q.view(torch.uint8).view(read_as).float() * scale
                stats[f"model.layers.{name}"] = (int(torch.isnan(w).sum()), w.numel())
                handles.append(m.register_forward_hook(_linear_hook(w)))
        if not handles:
            raise ValueError("fault (f) found no nn.Linear in the model's decoder layers")
        yield stats
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def inject(model, key: str, *, lanes: int = 64):
    """Switch fault `key` on in `model` for the block (see the module's docstring); `lanes` is the wavefront
    width fault (a) runs on."""
    describe(key)
    handles, restore = [], []
    try:
        if key == "a":
            handles += [m.register_forward_hook(_norm_hook(lanes, reduction_offsets(32))) for m in _norms(model)]
            if not handles:
                raise ValueError("fault (a) found no RMSNorm module in the model")
        elif key == "b":
            handles.append(model.lm_head.register_forward_hook(gemv_hook(gemv_bf16_accumulator)))
        elif key == "c":
            before = use_attention(model, "lab07_right_padded", attention_function(keep_right_padded))
            restore.append(lambda: model.set_attn_implementation(before))
        elif key == "d":
            original = model.model.rotary_emb
            model.model.rotary_emb = rebuild_rotary(model, rope_theta=WRONG_ROPE_THETA)
            restore.append(lambda: setattr(model.model, "rotary_emb", original))
        elif key == "e":
            handles.append(model.model.embed_tokens.register_forward_pre_hook(_raise_missing_code_object))
        elif key == "f":
            stack = contextlib.ExitStack()
            stack.enter_context(fp8_weights(model))
            restore.append(stack.close)
        yield model
    finally:
        for h in handles:
            h.remove()
        for undo in reversed(restore):
            undo()


def tiny_llama(*, vocab_size: int = 512, layers: int = 3, seed: int = 0, rope_theta: float = 100000.0):
    """A small random-weight Llama (float32, CPU) to try the faults on where SmolLM2 is not installed, and in the
    tests: 64 wide, GQA (4 query heads, 2 key/value heads), the same module structure as SmolLM2."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
