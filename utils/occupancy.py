"""How many wavefronts/warps stay resident on one CU/SM, by each vendor's own allocation rules.

NVIDIA: the arithmetic of the CUDA Occupancy Calculator as the CUDA toolkit ships it (`cuda_occupancy.h`, CUDA 13.0):
registers are allocated per warp in units of 256, each of the SM's 4 sub-partitions holds a quarter of the register
file and only whole warps, shared memory is allocated in units of 128 bytes plus 1 KiB the runtime reserves per block,
and an SM holds at most 64 warps and 32 blocks (compute capability 7.0 and 9.0; CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability"). It is what `cudaOccupancyMaxActiveBlocksPerMultiprocessor`
computes (tests/test_occupancy.py compares the two on an H100).

AMD: LLVM's AMDGPU occupancy (`AMDGPUBaseInfo.cpp`, `llvm-calc-occupancy`): VGPRs (with AGPRs, one unified file on
CDNA2/3) allocated in granules per lane, a maximum of waves per SIMD, a workgroup's waves spread over the CU's SIMDs,
at most 16 workgroups per CU (40 single-wave ones), LDS allocated in 512-byte granules.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from functools import lru_cache

from utils.device import SPECS_FILE

# NVIDIA's rules that are not in the spec table: cuda_occupancy.h (cudaOccRegAllocationGranularity,
# cudaOccSubPartitionsPerMultiprocessor, cudaOccMaxBlocksPerMultiprocessor, cudaOccSMemAllocationGranularity,
# reservedSharedMemPerBlock), and the CUDA C++ Programming Guide's table for the per-SM limits.
NVIDIA = {
    "sm_90": dict(reg_unit=256, sub_partitions=4, max_blocks=32, max_regs_per_thread=255, regs_per_block=65536,
                  smem_unit=128, smem_reserved=1024, smem_per_block=227 * 1024),
    # compute capability 7.0 (V100): the CUDA C++ Best Practices Guide's worked example ("Calculating Occupancy")
    "sm_70": dict(reg_unit=256, sub_partitions=4, max_blocks=32, max_regs_per_thread=255, regs_per_block=65536,
                  smem_unit=256, smem_reserved=0, smem_per_block=96 * 1024),
}
SM_70 = dict(arch="sm_70", lane_group="warp", width=32, units_per_cu=1, lane_registers=2048, alloc_granule=8,
             max_groups_per_unit=64, shared_per_cu=96 * 1024)

# AMD (LLVM AMDGPUBaseInfo: getMaxWorkGroupsPerCU, and AMDGPUUsage's LDS allocation granularity for GFX7-GFX11)
AMD_MAX_WORKGROUPS, AMD_WAVE_SLOTS, AMD_LDS_GRANULE = 16, 40, 512


@lru_cache(maxsize=1)
def arch_table() -> dict[str, dict]:
    with SPECS_FILE.open("rb") as f:
        table = {row["arch"]: row for row in tomllib.load(f)["arch"]}
    table.setdefault("sm_70", SM_70)
    return table


def limits(arch: str) -> dict:
    try:
        return arch_table()[arch]
    except KeyError:
        raise KeyError(f"no occupancy limits for {arch!r}; known: {sorted(arch_table())}") from None


@dataclass(frozen=True)
class Occupancy:
    arch: str
    registers: int          # per lane, as the compiler reported them
    allocated: int          # per lane, after rounding up to the allocation granule
    per_unit: int           # resident waves/warps per SIMD (AMD) or SM (NVIDIA)
    per_cu: int             # resident waves/warps per CU/SM
    max_per_cu: int         # the architecture's maximum
    limited_by: str         # "registers", "shared memory", "blocks", or "maximum"
    blocks: int = 0         # resident blocks (workgroups) per CU/SM

    @property
    def fraction(self) -> float:
        return self.per_cu / self.max_per_cu


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _smallest(limits_by: dict[str, int]) -> tuple[int, str]:
    """The binding limit; ties go to the first named."""
    name = min(limits_by, key=lambda k: limits_by[k])
    return limits_by[name], name


def _nvidia(arch: str, lim: dict, registers: int, shared_bytes: int, threads: int) -> Occupancy:
    r = NVIDIA[arch]
    warps = math.ceil(threads / lim["width"])
    per_warp = _round_up(registers * lim["width"], r["reg_unit"])
    smem = _round_up(shared_bytes + r["smem_reserved"], r["smem_unit"])
    if (registers > r["max_regs_per_thread"] or per_warp * _round_up(warps, r["sub_partitions"]) > r["regs_per_block"]
            or shared_bytes > r["smem_per_block"] or warps > lim["max_groups_per_unit"]):
        blocks, limited_by = 0, "registers" if registers > r["max_regs_per_thread"] else "launch limits"
    else:
        per_partition = (lim["lane_registers"] * lim["width"] // r["sub_partitions"]) // per_warp if per_warp else 10**9
        blocks, limited_by = _smallest({
            "maximum": lim["max_groups_per_unit"] // warps,
            "blocks": r["max_blocks"],
            "registers": per_partition * r["sub_partitions"] // warps,
            "shared memory": lim["shared_per_cu"] // smem if smem else 10**9,
        })
    per_cu = blocks * warps
    return Occupancy(arch, registers, per_warp // lim["width"], per_cu, per_cu, lim["max_groups_per_unit"],
                     limited_by, blocks)


def _amd(arch: str, lim: dict, registers: int, shared_bytes: int, threads: int) -> Occupancy:
    simds, max_waves = lim["units_per_cu"], lim["max_groups_per_unit"]
    allocated = _round_up(max(registers, 1), lim["alloc_granule"])
    by_registers = min(max_waves, lim["lane_registers"] // allocated)
    waves = math.ceil(threads / lim["width"])
    groups = AMD_WAVE_SLOTS if waves == 1 else min(AMD_WAVE_SLOTS // waves, AMD_MAX_WORKGROUPS)
    by_lds = lim["shared_per_cu"] // _round_up(shared_bytes, AMD_LDS_GRANULE) if shared_bytes else groups
    by_groups = min(max_waves, max(1, math.ceil(min(groups, by_lds) * waves / simds)))
    per_unit, limited_by = _smallest({"maximum": max_waves, "registers": by_registers,
                                      "shared memory" if by_lds < groups else "blocks": by_groups})
    per_cu = per_unit * simds
    return Occupancy(arch, registers, allocated, per_unit, per_cu, max_waves * simds, limited_by,
                     per_cu // waves)


def occupancy(arch: str, registers: int, *, shared_bytes: int = 0, threads_per_block: int = 256) -> Occupancy:
    """Resident waves/warps of a kernel using `registers` per lane and `shared_bytes` of LDS/shared memory per block
    of `threads_per_block` threads, on `arch` ("gfx942", "gfx90a", "gfx1100", "sm_90", "sm_70")."""
    lim = limits(arch)
    if lim["lane_group"] == "warp":
        return _nvidia(arch, lim, registers, shared_bytes, threads_per_block)
    return _amd(arch, lim, registers, shared_bytes, threads_per_block)
