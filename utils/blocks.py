"""Block-quantized number formats (GGUF's Q4_0, Q4_1, Q8_0, Q4_K; the 4-bit floats MXFP4 and NVFP4): one record per
format, its bytes and fields."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A format that stores `block` weights in `nbytes` bytes: its scale fields (in this order, at the start of the
    block), then the packed values. `name` is GGUF's (ggml's) type name."""
    name: str
    block: int            # weights per block
    nbytes: int           # bytes per block
    scales: tuple[str, ...] = ()   # scale fields at the block's start: "d" (scale), "m" (minimum)
    bits: int = 4         # bits per packed value
    offset: int = 0       # the integer's zero: w = d * (q - offset) [+ m]
    scale_type: str = "fp16"  # what a scale field is: "fp16", "e8m0" (a power of two) or "ue4m3" (an unsigned e4m3)
    values: str = "int"   # what the packed values are: "int" or "e2m1" (FP4: 1 sign, 2 exponent, 1 mantissa bit)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.block

    @property
    def ggml_type(self):
        """gguf's GGMLQuantizationType for this format (the `gguf` package, imported when asked)."""
        import gguf

        return gguf.GGMLQuantizationType[self.name]

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights; `k` must be a whole number of blocks."""
        if k <= 0 or k % self.block:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block} weights: {k} is not a positive "
                             f"multiple of {self.block}")
        return k // self.block * self.nbytes


# Layouts: ggml's block_q4_0 / block_q4_1 / block_q8_0 / block_q4_K (ggml-common.h); sizes agree with
# gguf.GGML_QUANT_SIZES (tests/test_lab08.py checks).
Q4_0 = BlockFormat("Q4_0", 32, 18, ("d",), 4, 8)
Q4_1 = BlockFormat("Q4_1", 32, 20, ("d", "m"), 4, 0)
Q8_0 = BlockFormat("Q8_0", 32, 34, ("d",), 8, 0)
Q4_K = BlockFormat("Q4_K", 256, 144, ("d", "dmin"), 4, 0)     # super-blocks: 8 sub-blocks with 6-bit scales
FORMATS = {f.name: f for f in (Q4_0, Q4_1, Q8_0, Q4_K)}
# The 4-bit floats as gguf stores them (gguf-py's quants.py): MXFP4, OCP's microscaling FP4, a block of 32 E2M1 values
# and one E8M0 scale; NVFP4, NVIDIA's, 16 values per e4m3 scale, which gguf groups four to a 64-weight block (the
# float32 per-tensor scale lives outside the blocks).
MXFP4 = BlockFormat("MXFP4", 32, 17, ("e",), 4, 0, "e8m0", "e2m1")
NVFP4 = BlockFormat("NVFP4", 64, 36, ("d0", "d1", "d2", "d3"), 4, 0, "ue4m3", "e2m1")
FP4_FORMATS = {f.name: f for f in (MXFP4, NVFP4)}
_ALL_FORMATS = {**FORMATS, **FP4_FORMATS}


def fmt(name: str | BlockFormat) -> BlockFormat:
    """The record for "Q4_0", "q4_1", ... (a BlockFormat passes through)."""
    if isinstance(name, BlockFormat):
        return name
    try:
        return _ALL_FORMATS[str(name).upper()]
    except KeyError:
        raise ValueError(f"unknown block format {name!r}: one of {', '.join(_ALL_FORMATS)}") from None


def random_blocks(name: str | BlockFormat, n: int, *, seed: int = 0, scale: float = 0.02,
                  awkward: bool = False) -> np.ndarray:
    """`n` random blocks of a 4-bit format as uint8 bytes, shape (n, nbytes): nibbles uniform, fp16 scales of
    about `scale` with either sign (Q4_1's minimum too). `awkward`: the first blocks are a zero scale, all-0 and
    all-15 nibbles, a negative minimum, and the largest and smallest normal fp16 scales."""
    f = fmt(name)
    if f.bits != 4 or f.block != 32 or f.values != "int":
        raise ValueError(f"random_blocks draws 32-weight 4-bit blocks (Q4_0, Q4_1), not {f.name}")
    rng = np.random.default_rng(seed)
    out = np.empty((n, f.nbytes), np.uint8)
    out[:, 2 * len(f.scales):] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    for i in range(len(f.scales)):
        s = (rng.standard_normal(n) * scale).astype(np.float16)
        out[:, 2 * i:2 * i + 2] = s.view(np.uint8).reshape(n, 2)
    if awkward:
        specials = [(0.0, -0.5, 0x00), (0.0, 0.0, 0xFF), (1.0, -1.0, 0x00), (1.0, -1.0, 0xFF),
                    (-0.25, -3.0, 0x5A), (65504.0, -65504.0, 0xF0), (6.1035e-05, 6.1035e-05, 0x0F)]
        for i, (d, m, nib) in enumerate(specials[:n]):
            out[i, 0:2] = np.array([d], np.float16).view(np.uint8)
            if "m" in f.scales:
                out[i, 2:4] = np.array([m], np.float16).view(np.uint8)
            out[i, 2 * len(f.scales):] = nib
    return out


def decode(data: np.ndarray, name: str | BlockFormat) -> np.ndarray:
    """The weights of Q4_0, Q4_1 or Q8_0 blocks (uint8, the last axis a row's bytes) as float32, decoded in a few
    NumPy operations: the same values as `dequantize` (tests/test_lab08.py checks), several times faster."""
    f = fmt(name)
    data = np.ascontiguousarray(data, dtype=np.uint8)
    rows = data.shape[:-1]
    b = data.reshape(-1, f.nbytes)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    if f is Q8_0:
        w = d * b[:, 2:].view(np.int8).astype(np.float32)
    elif f in (Q4_0, Q4_1):
        qs = b[:, 2 * len(f.scales):]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        w = d * (q - 8) if f is Q4_0 else d * q + b[:, 2:4].copy().view(np.float16).astype(np.float32)
    else:
        return dequantize(data, f)
    return w.reshape(*rows, -1)


def dequantize(data: np.ndarray, name: str | BlockFormat) -> np.ndarray:
    """The weights `gguf`'s own NumPy dequantizer gives for these blocks (float32; the last axis expands from
    bytes per row to weights per row): the reference every course decoder is checked against."""
    import gguf

    return gguf.quants.dequantize(np.ascontiguousarray(data, dtype=np.uint8), fmt(name).ggml_type)


def quantize(weights: np.ndarray, name: str | BlockFormat) -> np.ndarray:
    """float32 weights (rows of whole blocks) to the format's bytes, by `gguf`'s own quantizer."""
    import gguf

    f = fmt(name)
    try:
        return gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), f.ggml_type)
    except NotImplementedError:
        raise ValueError(f"this gguf ({getattr(gguf, '__version__', '?')}) has no {f.name} quantizer, only its "
                         f"dequantizer: make the codes and scales yourself and pack them with fp4_bytes") from None


def fp4_bytes(codes: np.ndarray, scale_bytes: np.ndarray, name: str | BlockFormat) -> np.ndarray:
    """gguf's bytes of MXFP4 or NVFP4 blocks from E2M1 codes (rows, K) (0-15: bit 3 the sign, bits 0-2 the magnitude's index)
    and one scale byte per 32 (MXFP4: E8M0, the exponent + 127) or per 16 codes (NVFP4: e4m3fn's byte of a positive
    scale). Each group of 32 (MXFP4) or 16 (NVFP4) codes packs two a byte, its first half in the low nibbles."""
    f = fmt(name)
    if f not in FP4_FORMATS.values():
        raise ValueError(f"fp4_bytes packs MXFP4 or NVFP4, not {f.name}")
    codes = np.asarray(codes, dtype=np.uint8)
    group = 32 if f is MXFP4 else 16
    rows, k = codes.shape
    f.row_bytes(k)
    c = codes.reshape(rows, k // group, 2, group // 2)
    nibbles = (c[:, :, 0] & 0x0F) | (c[:, :, 1] << 4)                     # (rows, groups, group / 2)
    scales = np.asarray(scale_bytes, dtype=np.uint8).reshape(rows, k // group)
    if f is MXFP4:
        return np.concatenate([scales[:, :, None], nibbles], axis=2).reshape(rows, -1)
    blocks = k // f.block                                                  # 4 scales, then 4 x 8 bytes, per 64
    return np.concatenate([scales.reshape(rows, blocks, 4), nibbles.reshape(rows, blocks, 32)], axis=2).reshape(rows, -1)


def block_bytes(data, name: str | BlockFormat) -> np.ndarray:
    """`data` as uint8 blocks of format `name`, shape (n, nbytes): uint8 bytes, or integers 0-255 of another dtype
    (a list, int64); a ValueError for another shape (another format's blocks) or values that are not bytes."""
    f = fmt(name)
    a = np.asarray(data)
    if a.ndim != 2 or a.shape[1] != f.nbytes:
        raise ValueError(f"{f.name} blocks are {f.nbytes} bytes each, one a row: give shape (n, {f.nbytes}), not "
                         f"{a.shape}")
    if a.dtype.kind not in "uif" or not ((a >= 0) & (a <= 255) & (a == np.floor(a))).all():
        raise ValueError(f"{f.name} blocks are bytes: give uint8 (or whole numbers 0-255), not {a.dtype} values "
                         "outside them")
    return a.astype(np.uint8, copy=False)


def quantize_q8_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """x (K,) to int8 in blocks of 32, as lab 08's `quantize_x_kernel` does it and llama.cpp's `quantize_q8_1` does
    for its activations (ggml-cuda/quantize.cu): per block d = max|x| / 127 and q = x / d rounded half away from zero
    (q = 0 where d = 0), all in float32. Returns (q int8 (K/32, 32), d float32 (K/32,)); q * d is the x that the
    lab's GEMV multiplies by. x: float32, float16 or bfloat16 (NumPy, or a torch tensor on any device)."""
    if hasattr(x, "detach"):                     # a torch tensor: bfloat16 has no NumPy dtype
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size % 32:
        raise ValueError(f"quantize_q8_rows quantizes whole blocks of 32: {x.size} elements")
    x = x.reshape(-1, 32)
    d = np.abs(x).max(axis=1) / np.float32(127)
    v = x / np.where(d > 0, d, np.float32(1))[:, None]
    q = np.where(v >= 0, np.floor(v + np.float32(0.5)), -np.floor(np.float32(0.5) - v))
    return q.astype(np.int8), d.astype(np.float32)


# --- what lab 08's q4_gemv takes (torch tensors; checked here, out of the lesson's way) -------------------------

class Q4Packed(NamedTuple):
    """A Q4_0/Q4_1 matrix laid out for a GEMV: nibbles `qs` (N, blocks * 16) uint8, scales `d` and minimums `m`
    (Q4_1; else None) (N, blocks) float16, and its format's name: gguf's bytes in another order."""
    qs: Any
    d: Any
    m: Any
    qtype: str


class QuantizedX(NamedTuple):
    """A vector quantized per block of 32 (llama.cpp's Q8_1 activations): int8 `q` (K,) and, per block, `ds` =
    (dx, dx * sum of its int8) float32 (K / 32, 2)."""
    q: Any
    ds: Any


def q4_matrix(weights, qtype: str) -> BlockFormat:
    """The format of `weights` if they are a matrix of gguf's Q4_0 or Q4_1 blocks (uint8 (N, blocks * bytes),
    contiguous, torch); a ValueError naming what is wrong otherwise."""
    f = fmt(qtype)
    if f not in (Q4_0, Q4_1):
        raise ValueError(f"q4_gemv reads Q4_0 and Q4_1 blocks, not {f.name}")
    if str(weights.dtype) != "torch.uint8" or weights.dim() != 2 or weights.shape[1] % f.nbytes or not weights.shape[1]:
        raise ValueError(f"weights must be uint8 (N, blocks x {f.nbytes}) as gguf lays out {f.name}; got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous")
    return f


def float_vector(x, k: int | None = None) -> int:
    """len(x) if x is a contiguous float32/float16/bfloat16 torch vector of whole blocks of 32 (of `k` elements,
    if given); a ValueError naming what is wrong otherwise."""
    kinds = ("torch.float32", "torch.float16", "torch.bfloat16")
    if getattr(x, "dim", lambda: 0)() != 1 or str(x.dtype) not in kinds or x.shape[0] % 32 or not x.shape[0] \
            or (k is not None and x.shape[0] != k):
        want = f"{k} elements (the weights' K)" if k is not None else "whole blocks of 32"
        raise ValueError(f"x must be a float vector of {want}, got {getattr(x, 'dtype', type(x).__name__)} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    return x.shape[0]


def _is(t, dtype: str, shape: tuple, device) -> bool:
    """Whether t is a contiguous torch tensor of this dtype ("torch.uint8"), shape and device."""
    return (hasattr(t, "is_contiguous") and str(t.dtype) == dtype and t.shape == shape and t.device == device
            and t.is_contiguous())


def _what(t) -> str:
    if not hasattr(t, "is_contiguous"):
        return type(t).__name__
    layout = "" if t.is_contiguous() else ", not contiguous"
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}{layout}"


def packed_shape(w: Q4Packed) -> tuple[int, int]:
    """(N, blocks) of a Q4Packed that lab 08's kernel reads right: float16 scales d (N, blocks), uint8 nibbles qs
    (N, blocks x 16) starting 4-byte aligned (read as int32 words), float16 minimums m (N, blocks) for Q4_1 and None
    for Q4_0, all contiguous on one device, as q4_pack makes them; a ValueError naming what is wrong otherwise."""
    if w.qtype not in ("Q4_0", "Q4_1") or (w.m is None) != (w.qtype == "Q4_0") or getattr(w.d, "dim", lambda: 0)() != 2:
        raise ValueError(f"a Q4Packed of {w.qtype!r} with d {_what(w.d)} and m {_what(w.m)}: q4_gemv reads Q4_0 (m "
                         "None) or Q4_1 (m float16 (N, blocks)), d float16 (N, blocks): pack the blocks with q4_pack")
    (n, nblk), dev = w.d.shape, w.d.device
    parts = [("d", w.d, "torch.float16", (n, nblk)), ("qs", w.qs, "torch.uint8", (n, nblk * 16))]
    for name, t, dtype, shape in parts + ([] if w.m is None else [("m", w.m, "torch.float16", (n, nblk))]):
        if not _is(t, dtype, shape, dev):
            raise ValueError(f"the packed weights' {name} is {_what(t)}: for {n} rows of {nblk} blocks (d's shape) it "
                             f"must be contiguous {dtype.removeprefix('torch.')} {shape} on {dev}; pack gguf's blocks "
                             "with q4_pack")
    if w.qs.data_ptr() % 4:
        raise ValueError("the packed weights' qs must start 4-byte aligned (the kernel reads int32 words): q4_pack's "
                         "copy does")
    return n, nblk


def check_quantized_x(x: QuantizedX, nblk: int, device) -> None:
    """A ValueError unless x is what lab 08's kernel reads for weights of `nblk` blocks a row on `device`: q int8
    (nblk x 32,) starting 4-byte aligned, ds float32 (nblk, 2), both contiguous, as quantize_x makes them."""
    for name, t, dtype, shape in (("q", x.q, "torch.int8", (nblk * 32,)), ("ds", x.ds, "torch.float32", (nblk, 2))):
        if not _is(t, dtype, shape, device) or name == "q" and t.data_ptr() % 4:
            raise ValueError(f"x.{name} is {_what(t)}: the weights want {nblk * 32} elements of x, {name} contiguous "
                             f"{dtype.removeprefix('torch.')} {shape} on {device}"
                             f"{', 4-byte aligned' if name == 'q' else ''}; quantize x with quantize_x")
