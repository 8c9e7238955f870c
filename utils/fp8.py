"""FP8 number formats as records (OCP's e4m3fn / e5m2, AMD's FNUZ e4m3fnuz / e5m2fnuz), which GPU uses which, and
the operand checks of a scaled FP8 matmul (lab 03's `fp8_matmul`, shaped like `torch._scaled_mm`)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from utils import backend as _backends


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """One 8-bit float format: its torch dtype's name, its dialect ("ocp": the OCP 8-bit floating point
    specification, as NVIDIA sm_89+ and AMD gfx950 run it; "fnuz": finite, no negative zero, AMD gfx942's), its
    exponent and mantissa bits."""
    name: str                 # torch's dtype name: "float8_e4m3fn"
    dialect: str              # "ocp" | "fnuz"
    exponent_bits: int
    mantissa_bits: int

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.name)

    @property
    def triton_name(self) -> str:
        """Triton's name of the type ("fp8e4nv"), from Triton's own table of torch dtypes."""
        from triton.runtime.jit import type_canonicalisation_dict

        return type_canonicalisation_dict[self.name]

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    def values(self) -> torch.Tensor:
        """The value of each of the 256 bit patterns (index = the byte), as float32."""
        return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(self.dtype).float()

    def bits(self) -> dict:
        """What the 256 patterns hold, read off them (not from a table): the largest finite value, the smallest
        normal and subnormal, the exponent bias, how many patterns are NaN, infinities, and whether -0.0 exists."""
        v = self.values()
        finite = v[torch.isfinite(v)]
        positive = finite[finite > 0]
        negative_zero = bool(((v == 0) & torch.signbit(v)).any())
        info = torch.finfo(self.dtype)
        return {"max": float(finite.max()), "smallest_normal": float(info.tiny), "smallest_subnormal": float(positive.min()),
                "bias": 1 - int(torch.log2(torch.tensor(info.tiny)).item()), "nan_patterns": int(torch.isnan(v).sum()),
                "infinities": int(torch.isinf(v).sum()), "negative_zero": negative_zero}


FORMATS = {f.name: f for f in (FP8Format("float8_e4m3fn", "ocp", 4, 3), FP8Format("float8_e5m2", "ocp", 5, 2),
                               FP8Format("float8_e4m3fnuz", "fnuz", 4, 3), FP8Format("float8_e5m2fnuz", "fnuz", 5, 2))}
E4M3 = {"ocp": FORMATS["float8_e4m3fn"], "fnuz": FORMATS["float8_e4m3fnuz"]}


def of(dtype) -> FP8Format | None:
    """The record of an FP8 dtype (torch.float8_e4m3fn, or its name), None for any other dtype."""
    return FORMATS.get(str(dtype).removeprefix("torch."))


def dialect_of(arch: str) -> str | None:
    """The FP8 dialect a GPU architecture's matrix units take ("ocp" | "fnuz"), None where they have no FP8
    (gfx90a, sm_80) or the architecture is unknown; "ocp" for the CPU (what torch._scaled_mm takes there)."""
    return "ocp" if arch == "cpu" else _backends.fp8_dialect_of(arch)


def arch_of(device) -> str:
    """The architecture of a torch device ("sm_90", "gfx942"); "cpu" for the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _gpu_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_arch(index: int) -> str:
    """A GPU's architecture, read once per device: fp8_matmul asks on every call, and ~10 us of host time per call
    is a tenth of a 4096^3 FP8 matmul (lab 03 measured 0.6x torch._scaled_mm with it, an H200, 2026-12-02)."""
    return _backends.this_torch_build().arch_of(torch.cuda.get_device_properties(index))


def e4m3_of(arch: str) -> torch.dtype | None:
    """The e4m3 dtype a GPU's FP8 matrix units take (float8_e4m3fn on sm_90, float8_e4m3fnuz on gfx942)."""
    dialect = dialect_of(arch)
    return E4M3[dialect].dtype if dialect else None


def quantize_rows(w: torch.Tensor, dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N x K) as FP8 `dtype` with one float32 scale per row (w ~ q * scale, scale (N, 1)): each row's largest
    finite |w| mapped to the format's max, a row of zeros scale 1 (lab 03's exercise 3.6, row-wise)."""
    fmax = torch.finfo(dtype).max
    wf = w.detach().float()
    amax = torch.where(wf.isfinite(), wf.abs(), 0.0).amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / fmax, 1.0)
    return (wf / scale).clamp(-fmax, fmax).to(dtype), scale


def _scale_kinds(s, rows: int, which: str, side: str) -> set:
    """What a scale can be: "tensor" (one value), "row" (one per row of a / column of b); both when rows == 1."""
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise ValueError(f"{which} must be a float32 tensor, not {getattr(s, 'dtype', type(s).__name__)}")
    want = (rows, 1) if side == "rows" else (1, rows)
    kinds = {"tensor"} if s.numel() == 1 and s.dim() <= 2 else set()
    if tuple(s.shape) == want:
        kinds.add("row")
    if not kinds:
        raise ValueError(f"{which} has shape {tuple(s.shape)}: one value for the whole tensor (shape () or (1,)), or "
                         f"{'one per row of a' if side == 'rows' else 'one per column of b'}, shape {want}")
    return kinds


def check_scaled_operands(a, b, scale_a, scale_b, out_dtype, arch: str) -> bool:
    """Raise a ValueError naming the problem unless a (M x K) and b (K x N) are 2-D FP8 e4m3 tensors of the dialect
    `arch` takes, on one device, with float32 scales both per tensor or both row-wise (scale_a (M, 1), scale_b
    (1, N)), and out_dtype bfloat16, float16 or float32 (what torch._scaled_mm takes). Returns whether row-wise."""
    want = e4m3_of(arch)
    if want is None:
        raise ValueError(f"{arch} has no FP8 matrix units that the course knows of (FP8: sm_89 and later, gfx942, gfx950)")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, not {getattr(t, 'shape', type(t).__name__)}")
        if t.dtype != want:
            got = of(t.dtype)
            why = (f"{got.name} is the {got.dialect.upper()} dialect and {arch} takes {dialect_of(arch).upper()}'s "
                   f"{want}: the same bits mean other values (e4m3fnuz's bias is 8, e4m3fn's 7: a factor of 2); "
                   f"quantize again from the higher-precision weights") if got else f"quantize it to {want} first"
            raise ValueError(f"{name} is {t.dtype}: {why}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is {a.shape[0]}x{a.shape[1]} and b is {b.shape[0]}x{b.shape[1]}: a's columns must equal b's rows")
    if a.device != b.device or any(isinstance(s, torch.Tensor) and s.device != a.device for s in (scale_a, scale_b)):
        raise ValueError("a, b and the scales must be on one device")
    kind_a = _scale_kinds(scale_a, a.shape[0], "scale_a", "rows")
    kind_b = _scale_kinds(scale_b, b.shape[1], "scale_b", "columns")
    if not kind_a & kind_b:
        raise ValueError(f"scale_a is per {kind_a.pop()} and scale_b per {kind_b.pop()}: both per tensor, or both "
                         "row-wise (scale_a one per row of a, scale_b one per column of b), as torch._scaled_mm takes them")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype {out_dtype} is not one of torch.bfloat16, torch.float16, torch.float32")
    return "tensor" not in kind_a & kind_b
