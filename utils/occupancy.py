"""How many wavefronts/warps stay resident on one CU/SM, from a kernel's register and LDS/shared
memory use (as the compilers report them) and the architecture's limits (utils/data/gpu_specs.toml).

This is the register-and-LDS part of the CUDA Occupancy Calculator and of LLVM's AMDGPU occupancy;
it ignores block-count and barrier limits, which the course's kernels do not reach.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from functools import lru_cache

from utils.device import SPECS_FILE


@lru_cache(maxsize=1)
def arch_table() -> dict[str, dict]:
    with SPECS_FILE.open("rb") as f:
        return {row["arch"]: row for row in tomllib.load(f)["arch"]}


def limits(arch: str) -> dict:
    try:
        return arch_table()[arch]
    except KeyError:
        raise KeyError(f"no occupancy limits for {arch!r}; known: {sorted(arch_table())}") from None


@dataclass(frozen=True)
class Occupancy:
    arch: str
    registers: int          # per lane, as the compiler reported them
    allocated: int          # after rounding up to the allocation granule
    per_unit: int           # resident waves/warps per SIMD (AMD) or SM (NVIDIA)
    per_cu: int             # resident waves/warps per CU/SM
    max_per_cu: int         # the architecture's maximum
    limited_by: str         # "registers", "shared memory" or "maximum"

    @property
    def fraction(self) -> float:
        return self.per_cu / self.max_per_cu


def occupancy(arch: str, registers: int, *, shared_bytes: int = 0, threads_per_block: int = 256) -> Occupancy:
    lim = limits(arch)
    allocated = max(lim["alloc_granule"], math.ceil(registers / lim["alloc_granule"]) * lim["alloc_granule"])
    by_registers = lim["lane_registers"] // allocated
    per_unit = min(lim["max_groups_per_unit"], by_registers)
    limited_by = "registers" if by_registers < lim["max_groups_per_unit"] else "maximum"
    per_cu = per_unit * lim["units_per_cu"]
    if shared_bytes:
        groups_per_block = math.ceil(threads_per_block / lim["width"])
        by_shared = (lim["shared_per_cu"] // shared_bytes) * groups_per_block
        if by_shared < per_cu:
            per_cu, limited_by = by_shared, "shared memory"
    return Occupancy(arch, registers, allocated, per_unit, per_cu,
                     lim["max_groups_per_unit"] * lim["units_per_cu"], limited_by)
