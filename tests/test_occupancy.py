"""utils.occupancy: resident waves/warps from registers, checked against LLVM's own figure."""
import pytest

from utils import isa, occupancy

KERNEL = r"""
#include <hip/hip_runtime.h>
__global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}
"""


@pytest.mark.parametrize("arch, regs, per_unit, per_cu", [
    ("gfx942", 8, 8, 32), ("gfx942", 64, 8, 32), ("gfx942", 65, 7, 28), ("gfx942", 128, 4, 16), ("gfx942", 512, 1, 4),
    ("gfx1100", 43, 16, 32), ("gfx1100", 128, 10, 20), ("gfx1100", 256, 5, 10),
    ("sm_90", 32, 64, 64), ("sm_90", 33, 51, 51), ("sm_90", 64, 32, 32), ("sm_90", 255, 8, 8),
])
def test_register_limited_occupancy(arch, regs, per_unit, per_cu):
    occ = occupancy.occupancy(arch, regs)
    assert (occ.per_unit, occ.per_cu) == (per_unit, per_cu)


def test_shared_memory_can_limit_instead():
    occ = occupancy.occupancy("sm_90", 32, shared_bytes=100 * 1024, threads_per_block=256)
    assert occ.limited_by == "shared memory" and occ.per_cu == 2 * 8   # 2 blocks of 8 warps
    assert occupancy.occupancy("sm_90", 32).limited_by == "maximum"


def test_unknown_arch():
    with pytest.raises(KeyError, match="no occupancy limits for 'gfx803'"):
        occupancy.limits("gfx803")


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_agrees_with_llvm(arch):
    try:
        asm = isa.compile_hip(KERNEL, arch)
    except isa.ToolMissing:
        if "hipcc" in isa.required_tools():
            raise
        pytest.skip("hipcc is not installed")
    (k,) = asm.kernels().values()
    assert k["wavefront_size"] == occupancy.limits(arch)["width"]
    assert occupancy.occupancy(arch, k["vgprs"]).per_unit == k["occupancy"]
