"""utils.simt: the SIMT model that stands in for a GPU in lab 02."""
import numpy as np
import pytest

from utils import simt

PORTABLE = {32: [16, 8, 4, 2, 1], 64: [32, 16, 8, 4, 2, 1]}


def test_lane_layout():
    wave, lane = simt.lane_layout(256, 64)
    assert (wave[100], lane[100]) == (1, 36) and wave.max() == 3
    wave, lane = simt.lane_layout(256, 32)
    assert (wave[100], lane[100]) == (3, 4) and wave.max() == 7


@pytest.mark.parametrize("width", [32, 64])
def test_branch_cost_is_two_passes_below_the_width_and_one_from_it(width):
    for period in (1, 2, 4, 8, 16, 32, 64, 128):
        cost = simt.branch(width, period)
        expected = 2.0 if period < width else 1.0
        assert cost.relative_cost == expected, (width, period)
        assert cost.lane_utilization == pytest.approx(1 / expected)


def test_branch_rejects_partial_waves():
    with pytest.raises(ValueError, match="multiple of width"):
        simt.branch(64, 1, threads=96)


def test_shuffle_down_stays_inside_the_wavefront():
    v = np.arange(8)
    assert simt.shfl_down(v, 2, 4).tolist() == [2, 3, 2, 3, 6, 7, 6, 7]   # lanes 2,3 of each wave keep theirs
    assert simt.shfl_down(v, 1, 8).tolist() == [1, 2, 3, 4, 5, 6, 7, 7]


def test_the_32_lane_reduction_is_right_at_32_and_wrong_at_64():
    values = np.arange(4096) % 7
    exact = int(values.sum())
    assert simt.wave_sum(values, 32, [16, 8, 4, 2, 1]) == exact
    wrong = simt.wave_sum(values, 64, [16, 8, 4, 2, 1])
    # lane 0 of each 64-lane wave only gathers lanes 0..31: exactly the upper halves are lost
    upper_halves = int(values.reshape(-1, 64)[:, 32:].sum())
    assert wrong == exact - upper_halves and wrong < exact


@pytest.mark.parametrize("width", [32, 64])
def test_the_portable_reduction_is_right_at_both_widths(width):
    values = np.random.default_rng(0).integers(0, 100, 1000)   # not a multiple of the width: padded
    assert simt.wave_sum(values, width, PORTABLE[width]) == int(values.sum())


# --- run_kernel: CUDA/HIP source on the CPU ------------------------------------------------------------

SHUFFLES = r"""
__global__ void shuffles(const int* x, int* down, int* up, int* xr, int* idx, unsigned long long* votes, int delta) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = x[i];
#if defined(__HIP_PLATFORM_AMD__)
    down[i] = __shfl_down(v, delta); up[i] = __shfl_up(v, delta); xr[i] = __shfl_xor(v, delta);
    idx[i] = __shfl(v, 5); votes[i] = __ballot(v % 3 == 0);
#else
    down[i] = __shfl_down_sync(0xffffffffu, v, delta); up[i] = __shfl_up_sync(0xffffffffu, v, delta);
    xr[i] = __shfl_xor_sync(0xffffffffu, v, delta); idx[i] = __shfl_sync(0xffffffffu, v, 5);
    votes[i] = __ballot_sync(0xffffffffu, v % 3 == 0);
#endif
}
"""


@pytest.mark.parametrize("platform, width", [("hip", 64), ("hip", 32), ("cuda", 32)])
def test_run_kernel_shuffles_and_ballots_follow_cuda_and_hip(platform, width):
    n, delta = 128, 3
    x = np.arange(n, dtype=np.int32) * 10
    outs = [("down", np.zeros(n, np.int32)), ("up", np.zeros(n, np.int32)), ("xr", np.zeros(n, np.int32)),
            ("idx", np.zeros(n, np.int32)), ("votes", np.zeros(n, np.uint64))]
    run = simt.run_kernel(SHUFFLES, "shuffles", [("x", x), *outs, ("delta", delta)], grid=1, block=n,
                          width=width, platform=platform)
    lane, base = np.arange(n) % width, np.arange(n) - np.arange(n) % width
    src = np.where(lane + delta < width, np.arange(n) + delta, np.arange(n))
    assert np.array_equal(run.buffers["down"], x[src])
    assert np.array_equal(run.buffers["up"], x[np.where(lane >= delta, np.arange(n) - delta, np.arange(n))])
    assert np.array_equal(run.buffers["xr"], x[base + (lane ^ delta)])
    assert np.array_equal(run.buffers["idx"], x[base + 5])
    expected_votes = [sum(1 << l for l in range(width) if x[b + l] % 3 == 0) for b in range(0, n, width)]
    assert [int(v) for v in run.buffers["votes"][::width]] == expected_votes
    assert run.problems == [] and run.max_shuffle_delta == delta


def test_run_kernel_refuses_32_bit_masks_on_hip_and_plain_shuffles_on_cuda():
    masked = "__global__ void k(int* x) { x[threadIdx.x] = __shfl_down_sync(0xffffffff, x[threadIdx.x], 1); }"
    with pytest.raises(simt.KernelError, match="does not compile \\(HIP\\).*mask must be a 64-bit integer"):
        simt.run_kernel(masked, "k", [("x", np.zeros(64, np.int32))], grid=1, block=64, width=64)
    plain = "__global__ void k(int* x) { x[threadIdx.x] = __shfl_down(x[threadIdx.x], 1); }"
    with pytest.raises(simt.KernelError, match="does not compile \\(CUDA\\)"):
        simt.run_kernel(plain, "k", [("x", np.zeros(32, np.int32))], grid=1, block=32, width=32, platform="cuda")
    constant = "__global__ void k(int* x) { constexpr int w = warpSize; x[threadIdx.x] = w; }"
    with pytest.raises(simt.KernelError, match="does not compile"):   # a variable, as in CUDA and ROCm 7
        simt.run_kernel(constant, "k", [("x", np.zeros(64, np.int32))], grid=1, block=64, width=64)


def test_run_kernel_reports_what_a_gpu_would_not():
    left_out = ("__global__ void k(int* x) { unsigned long long m = 0xffffffffull; "
                "x[threadIdx.x] = __shfl_down_sync(m, x[threadIdx.x], 1); }")
    run = simt.run_kernel(left_out, "k", [("x", np.zeros(64, np.int32))], grid=1, block=64, width=64)
    assert any("lane 32 called __shfl_down with a mask that leaves it out (mask 0xffffffff)" in p for p in run.problems)
    exited = ("__global__ void k(int* x, int n) { int i = threadIdx.x; if (i >= n) return; "
              "x[i] = __shfl_down(x[i], 4); }")
    run = simt.run_kernel(exited, "k", [("x", np.arange(64, dtype=np.int32)), ("n", 40)], grid=1, block=64, width=64)
    assert any("read lane 40" in p and "had returned" in p for p in run.problems)
    past_end = "__global__ void k(float* x, int n) { x[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f; }"
    with pytest.raises(simt.KernelError, match="wrote past the end of `x` \\(100 elements\\)"):
        simt.run_kernel(past_end, "k", [("x", np.zeros(100, np.float32)), ("n", 100)], grid=1, block=128, width=64)
    forever = "__global__ void k(int* x) { for (int o = 0; o >= 0; o /= 2) x[0] += 1; }"
    with pytest.raises(simt.KernelError, match="did not finish in 2 s"):
        simt.run_kernel(forever, "k", [("x", np.zeros(1, np.int32))], grid=1, block=1, width=64, timeout=2)


def test_run_kernel_block_barrier_shared_memory_and_atomic_lanes():
    block_sum = r"""
__global__ void block_sum(const float* x, float* out) {
    __shared__ float partial[32];
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = warpSize / 2; o > 0; o /= 2) v += __shfl_down(v, o);
    if (threadIdx.x % warpSize == 0) partial[threadIdx.x / warpSize] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0;
        for (int w = 0; w < blockDim.x / warpSize; ++w) s += partial[w];
        atomicAdd(out, s);
    }
}
"""
    x = np.arange(512, dtype=np.float32)
    run = simt.run_kernel(block_sum, "block_sum", [("x", x), ("out", np.zeros(1, np.float32))], grid=2, block=256, width=64)
    assert run.buffers["out"][0] == x.sum() and run.problems == []
    assert run.atomic_lanes == [[0], [], [], [], [0], [], [], []]   # 2 blocks x 4 wavefronts: lane 0 of the first


@pytest.mark.parametrize("kwargs, message", [({"width": 48}, "width=48"), ({"width": 64, "platform": "cuda"}, "warp 32"),
                                             ({"width": 64, "block": 2048}, "block=2048"), ({"width": 64, "platform": "sycl"}, "platform")])
def test_run_kernel_rejects_bad_launches(kwargs, message):
    kwargs = {"grid": 1, "block": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        simt.run_kernel("__global__ void k(int* x) {}", "k", [("x", np.zeros(1, np.int32))], **kwargs)


# --- races: wavefronts and blocks interleaved, each wavefront in lock-step -----------------------------------------

TOTAL = r"""
__global__ void total(const int* x, int* out) {   // lane 0 of each wavefront adds its element, without an atomic
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (threadIdx.x % warpSize == 0) out[0] += x[i];
}
"""
IN_SHARED = r"""
__global__ void in_shared(const int* x, int* out, int sync) {
    __shared__ int sum;                  // every lane adds into one __shared__ int: a race inside the wavefront
    __shared__ int partial[32];          // a value per wavefront, read by thread 0: a race unless sync
    int t = threadIdx.x;
    if (t == 0) sum = 0;
    __syncthreads();
    sum += x[t];
    if (t % warpSize == 0) partial[t / warpSize] = x[t];
    if (sync) __syncthreads();
    if (t == 0) { int s = 0; for (int w = 0; w < blockDim.x / warpSize; ++w) s += partial[w]; out[0] = s; }
}
"""
# right warp-synchronous code: a tree in __shared__ inside each wavefront, no barrier (lock-step, volatile), in a
# template helper; every lane then stores the same total to one address (the same value: no race)
WARP_TREE = r"""
template <int UNUSED> __device__ int tree(int v) {
    __shared__ volatile int s[1024];
    int t = threadIdx.x, lane = t % warpSize;
    s[t] = v;
    for (int o = warpSize / 2; o > 0; o /= 2)
        if (lane < o) s[t] += s[t + o];
    return s[t - lane];
}
__global__ void warp_tree(const int* x, int* per_wave, int* out) {
    int v = tree<0>(x[blockIdx.x * blockDim.x + threadIdx.x]);
    per_wave[blockIdx.x * (blockDim.x / warpSize) + threadIdx.x / warpSize] = v;
    if (threadIdx.x % warpSize == 0) atomicAdd(out, v);
}
"""


def test_run_kernel_names_the_lanes_and_address_of_a_race():
    x = np.arange(512, dtype=np.int32)
    run = simt.run_kernel(TOTAL, "total", [("x", x), ("out", np.zeros(1, np.int32))], grid=2, block=256, width=64)
    assert len(run.races) == 1 and run.races[0] in run.problems
    assert run.races[0].startswith("a race on `out[0]`: thread ") and "(wavefront " in run.races[0], run.races
    assert "without an atomic" in run.races[0] and "run in any order" in run.races[0]
    run = simt.run_kernel(TOTAL, "total", [("x", x), ("out", np.zeros(1, np.int32))], grid=8, block=64, width=64)
    assert "two blocks of one launch run in any order" in run.races[0]     # one wavefront per block
    def shared(block, sync):
        args = [("x", x), ("out", np.zeros(1, np.int32)), ("sync", sync)]
        return simt.run_kernel(IN_SHARED, "in_shared", args, grid=1, block=block, width=64)

    run = shared(64, 0)                        # one wavefront: its lanes store different sums at one instruction
    assert len(run.races) == 1 and run.races[0].startswith("a race on __shared__ `sum[0]`: lanes "), run.races
    assert "of wavefront 0 of block 0 stored different values there at one instruction" in run.races[0]
    for sync in (0, 1):                        # four: between wavefronts too, and partial[] unless a __syncthreads
        run = shared(256, sync)
        assert any(r.startswith("a race on __shared__ `sum[0]`") for r in run.races), run.races
        partial = [r for r in run.races if "`partial[" in r]
        if sync:
            assert not partial and int(run.buffers["out"][0]) == int(x[:256:64].sum())
        else:
            assert partial and "read it" in partial[0] and "no __syncthreads between them" in partial[0], run.races


def test_run_kernel_interleaves_wavefronts_in_a_seeded_order_so_a_lost_update_shows():
    x = np.arange(1, 257, dtype=np.int32)
    exact = int(x[::64].sum())
    got = [int(simt.run_kernel(TOTAL, "total", [("x", x), ("out", np.zeros(1, np.int32))], grid=1, block=256,
                               width=64, seed=seed).buffers["out"][0]) for seed in (0, 0, 1, 2, 3, 4, 5, 6, 7)]
    assert got[0] == got[1] and exact not in got and len(set(got)) > 1, got   # the same seed, the same order


WARP_TREE_SYNCED = WARP_TREE.replace("""    for (int o = warpSize / 2; o > 0; o /= 2)
        if (lane < o) s[t] += s[t + o];""", """    __syncwarp();
    for (int o = warpSize / 2; o > 0; o /= 2) {
        int other = lane < o ? s[t + o] : 0;
        __syncwarp();
        if (lane < o) s[t] += other;
        __syncwarp();
    }""")


@pytest.mark.parametrize("platform, width, source", [("hip", 64, WARP_TREE), ("cuda", 32, WARP_TREE_SYNCED)])
def test_run_kernel_keeps_warp_synchronous_code_right(platform, width, source):
    """A wavefront's tree in __shared__: on AMD in lock-step as written; on CUDA with __syncwarp between its steps."""
    x = np.random.default_rng(0).integers(-50, 50, 512).astype(np.int32)
    args = [("x", x), ("per_wave", np.zeros(512 // width, np.int32)), ("out", np.zeros(1, np.int32))]
    run = simt.run_kernel(source, "warp_tree", args, grid=2, block=256, width=width, platform=platform)
    assert run.problems == [] and run.races == []
    assert run.buffers["per_wave"].tolist() == x.reshape(-1, width).sum(axis=1).tolist()
    assert int(run.buffers["out"][0]) == int(x.sum())


def test_run_kernel_records_the_lanes_of_each_cross_lane_op():
    inside = ("__global__ void k(const int* x, unsigned long long* out) { int i = threadIdx.x; "
              "if (x[i] > 0) out[i] = __ballot(1); }")
    x = np.where(np.arange(64) % 3 == 0, 1, 0).astype(np.int32)
    run = simt.run_kernel(inside, "k", [("x", x), ("out", np.zeros(64, np.uint64))], grid=1, block=64, width=64)
    mask = sum(1 << lane for lane in range(64) if x[lane] > 0)
    assert run.cross_lane == [[("ballot", mask)]] and int(run.buffers["out"][0]) == mask


def test_cuda_warps_are_not_lock_step_without_a_sync():
    """Since Volta a CUDA warp's lanes are scheduled independently: the tree that is right on AMD's lock-step
    wavefronts is a race on CUDA, named as such, until __syncwarp orders its steps."""
    x = np.random.default_rng(0).integers(-50, 50, 512).astype(np.int32)
    args = [("x", x), ("per_wave", np.zeros(16, np.int32)), ("out", np.zeros(1, np.int32))]
    run = simt.run_kernel(WARP_TREE, "warp_tree", args, grid=2, block=256, width=32, platform="cuda")
    assert run.races and "no __syncwarp" in run.races[0] and "scheduled independently" in run.races[0], run.races


OVERLAP = r"""
__global__ void overlap(int* words, int* out) {
    // wavefront 0 writes a whole int; wavefront 1 writes its second byte: they overlap, not at one start address
    if (threadIdx.x == 0) words[0] = 0x01020304;
    if (threadIdx.x == 64) ((unsigned char*)words)[1] = 7;
}
__global__ void readers(int* x, int* out) {
    // wavefronts 0 and 1 read x[0]; then wavefront 1 writes it: wavefront 0's read is unordered with that write
    int t = threadIdx.x;
    if (t == 0 || t == 64) out[t / 64] = x[0];
    if (t == 64) x[0] = 5;
}
"""


def test_races_between_overlapping_accesses_and_with_an_earlier_reader():
    run = simt.run_kernel(OVERLAP, "overlap", [("words", np.zeros(2, np.int32)), ("out", np.zeros(1, np.int32))],
                          grid=1, block=128, width=64)
    assert run.races and "`words[0]`" in run.races[0], run.races
    for seed in range(4):
        run = simt.run_kernel(OVERLAP, "readers", [("x", np.ones(1, np.int32)), ("out", np.zeros(2, np.int32))],
                              grid=1, block=128, width=64, seed=seed)
        assert run.races and "`x[0]`" in run.races[0], (seed, run.races)
