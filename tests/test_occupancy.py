"""utils.occupancy: resident waves/warps by the vendors' rules, checked against their documented examples, LLVM's own
figure and, on an NVIDIA GPU, cudaOccupancyMaxActiveBlocksPerMultiprocessor."""
import ctypes

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
    # 256-thread blocks (8 warps): 33 registers -> 1280 per warp, 12 warps per sub-partition, 48 per SM, 6 blocks
    ("sm_90", 32, 64, 64), ("sm_90", 33, 48, 48), ("sm_90", 64, 32, 32), ("sm_90", 255, 8, 8),
])
def test_register_limited_occupancy(arch, regs, per_unit, per_cu):
    occ = occupancy.occupancy(arch, regs)
    assert (occ.per_unit, occ.per_cu) == (per_unit, per_cu)


def test_cuda_best_practices_worked_example():
    """CUDA C++ Best Practices Guide, "Calculating Occupancy" (compute capability 7.0): 37 registers per thread give
    12 blocks of 128 threads (75% occupancy) but only 4 blocks of 320 threads (63%)."""
    small = occupancy.occupancy("sm_70", 37, threads_per_block=128)
    large = occupancy.occupancy("sm_70", 37, threads_per_block=320)
    assert (small.blocks, small.fraction) == (12, 0.75)
    assert large.blocks == 4 and round(large.fraction, 3) == 0.625
    assert small.limited_by == large.limited_by == "registers"


def test_llvm_calc_occupancy_worked_example():
    """llvm-calc-occupancy's documented example: gfx90a, 512-lane workgroups, 50 VGPRs -> 8 waves/EU, 32 waves/CU."""
    occ = occupancy.occupancy("gfx90a", 50, threads_per_block=512)
    assert (occ.per_unit, occ.per_cu) == (8, 32)


def test_shared_memory_can_limit_instead():
    occ = occupancy.occupancy("sm_90", 32, shared_bytes=100 * 1024, threads_per_block=256)
    assert occ.limited_by == "shared memory" and occ.per_cu == 2 * 8   # 2 blocks of 8 warps
    # 1 KiB reserved per block: 113 KiB + 1 KiB twice fills the 228 KiB, 113.5 KiB + 1 KiB does not
    assert occupancy.occupancy("sm_90", 16, shared_bytes=113 * 1024).blocks == 2
    assert occupancy.occupancy("sm_90", 16, shared_bytes=113 * 1024 + 512).blocks == 1
    assert occupancy.occupancy("sm_90", 32).limited_by == "maximum"
    lds = occupancy.occupancy("gfx942", 32, shared_bytes=32 * 1024, threads_per_block=256)
    assert lds.limited_by == "shared memory" and lds.per_cu == 2 * 4    # 2 workgroups of 4 waves


def test_block_limit():
    occ = occupancy.occupancy("sm_90", 16, threads_per_block=32)       # 32 blocks of one warp, not 64
    assert (occ.blocks, occ.per_cu, occ.limited_by) == (32, 32, "blocks")


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


@pytest.mark.gpu
def test_agrees_with_cuda_occupancy_api():
    """On an NVIDIA GPU of compute capability 9.0: Triton kernels of several register and shared-memory sizes, compiled
    here, against the driver's cuOccupancyMaxActiveBlocksPerMultiprocessor (what the runtime's
    cudaOccupancyMaxActiveBlocksPerMultiprocessor calls) for their block size and several dynamic shared sizes."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.version.hip or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an NVIDIA GPU of compute capability 9.0")
    import triton
    import triton.language as tl

    @triton.jit
    def tile(a_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(4):
            a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :] + k)
            b = tl.load(a_ptr + rk[:, None] * BN + rn[None, :] + k)
            acc += tl.dot(a, b)
        tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)

    cuda = ctypes.CDLL("libcuda.so.1")
    buf_a = torch.zeros(1 << 20, dtype=torch.float16, device="cuda")
    buf_c = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    checked = []
    for bm, bn, bk, warps, stages in [(16, 16, 16, 1, 1), (32, 32, 32, 2, 2), (64, 64, 32, 4, 3), (64, 128, 64, 4, 3),
                                      (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                      (64, 256, 32, 4, 4), (256, 128, 64, 8, 2)]:
        k = tile.warmup(buf_a, buf_c, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, grid=(1,))
        k._init_handles()
        threads, shared = warps * 32, k.metadata.shared
        # allow up to 227 KiB of dynamic shared memory (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8)
        assert cuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), 8, 227 * 1024) == 0
        for dynamic in sorted({0, shared, 40_000, 70_000, 113 * 1024, 113 * 1024 + 512, 150_000}):
            blocks = ctypes.c_int()
            assert cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(blocks), ctypes.c_void_p(k.function), threads, ctypes.c_size_t(dynamic)) == 0
            ours = occupancy.occupancy("sm_90", k.n_regs, shared_bytes=dynamic, threads_per_block=threads)
            checked.append((bm, bn, bk, warps, k.n_regs, dynamic, blocks.value, ours.blocks, ours.limited_by))
    print("\n".join(f"{c[:6]}: CUDA {c[6]} blocks, utils.occupancy {c[7]} ({c[8]})" for c in checked))
    assert [c[6] for c in checked] == [c[7] for c in checked], checked
    assert len({c[4] for c in checked}) >= 4 and len({c[6] for c in checked}) >= 3   # the grid really varies
    assert {"registers", "shared memory", "blocks"} <= {c[8] for c in checked}       # and each limit binds somewhere
