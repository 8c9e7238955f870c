"""Lab 02 (wavefront vs warp): the graders of exercises 2.1-2.4 (utils/graders/lab02.py) with reference, alternative
and known-wrong answers. The kernels run on the CPU through utils.simt.run_kernel (CUDA's API on 32 lanes, HIP's on
64 and 32); on a GPU, `@pytest.mark.gpu` runs the lab's own builds of them (its load_inline bindings, which
check what they are given) there too, also under compute-sanitizer's memcheck with bad calls included."""

import numpy as np
import pytest

from grading import errors, run_lab_with, run_under_memcheck, stream_text
from utils import exercises, grading_guard, solutions
from utils.exercises import ExerciseFailed
from utils.graders import lab02 as graders


@pytest.fixture(scope="module")
def lab():
    return solutions.load("02")


def fails_with(fn, *hint):
    with pytest.raises(ExerciseFailed) as err:
        fn()
    for part in hint:
        assert part in str(err.value), str(err.value)


def passes(fn, what):
    """A right answer: PASS, or the test fails naming it and the grader's verdict."""
    try:
        fn()
    except ExerciseFailed as err:
        pytest.fail(f"a right answer ({what}) was refused: {err}")


def given(value):
    """A learner's function that returns `value` (the graders take the function, as ex.grade passes it)."""
    return lambda: value


def kernel_answer(source: str) -> str:
    """An answer for a region that returns CUDA source."""
    return f'return r"""{source}"""'


# --- 2.1 predict ---------------------------------------------------------------------------------------

def test_grader_2_1(lab):
    graders.check_passes(lab.predicted_passes)
    alt = solutions.load("02", {"2.1": "return {(w, p): 1 if p >= w else 2 for w in (32, 64) for p in (16, 32, 64)}"})
    graders.check_passes(alt.predicted_passes)
    right = lab.predicted_passes()
    fails_with(lambda: graders.check_passes(given({**right, (64, 32): 1})), "64 lanes, period 32", "both run")
    fails_with(lambda: graders.check_passes(given({**right, (32, 32): 2})), "32 lanes, period 32", "one pass")
    fails_with(lambda: graders.check_passes(given([2, 1])), "return a dict")
    fails_with(lambda: graders.check_passes(given({**right, (64, 16): np.array([2, 2])})), "64 lanes, period 16", "both run")
    fails_with(lambda: graders.check_passes(given({**right, (32, 64): "1"})), "32 lanes, period 64", "one pass")
    graders.check_passes(given({k: float(v) for k, v in right.items()}))          # 2.0 is 2


# --- 2.2 the portable reduction ------------------------------------------------------------------------

SUM = r"""
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? x[i] : 0;
    for (int offset = warpSize / 2; offset > 0; offset /= 2)
        v += SHFL_DOWN(v, offset);
    if (threadIdx.x % warpSize == 0) atomicAdd(out, v);
}
"""
SUM_ALTERNATIVES = {
    "xor butterfly, another loop order": SUM.replace("for (int offset = warpSize / 2; offset > 0; offset /= 2)\n        v += SHFL_DOWN(v, offset);",
                                                     "for (int lanes = 1; lanes < warpSize; lanes *= 2)\n        v += SHFL_XOR(v, lanes);"),
    "width as a template parameter": r"""
template <int WIDTH> __device__ int wave_sum(int v) {
    for (int offset = WIDTH / 2; offset > 0; offset /= 2) v += SHFL_DOWN(v, offset);
    return v;
}
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? x[i] : 0;
    v = warpSize == 64 ? wave_sum<64>(v) : wave_sum<32>(v);
    if (threadIdx.x % warpSize == 0) atomicAdd(out, v);
}
""",
}
SUM_ALTERNATIVES["shuffle width given as warpSize"] = SUM.replace("SHFL_DOWN(v, offset)", "DOWN_W(v, offset)").replace(
    "__global__", """#if defined(__HIP_PLATFORM_AMD__)
#define DOWN_W(v, o) __shfl_down(v, o, warpSize)
#else
#define DOWN_W(v, o) __shfl_down_sync(0xffffffffu, v, o, warpSize)
#endif
__global__""", 1)
SUM_ALTERNATIVES["a block reduction in shared memory, one atomic per block"] = r"""
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    __shared__ int partial[1024 / 32];
    int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % warpSize, wave = threadIdx.x / warpSize;
    int v = i < n ? x[i] : 0;
    for (int offset = warpSize / 2; offset > 0; offset /= 2) v += SHFL_DOWN(v, offset);
    if (lane == 0) partial[wave] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < (int)blockDim.x / warpSize; ++w) total += partial[w];
        atomicAdd(out, total);
    }
}
"""
# the same without __syncwarp: right on AMD's lock-step wavefronts, a race on CUDA since Volta
VOLATILE_TREE = r"""
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    __shared__ volatile int s[1024];
    int i = blockIdx.x * blockDim.x + threadIdx.x, t = threadIdx.x, lane = t % warpSize;
    s[t] = i < n ? x[i] : 0;
    for (int offset = warpSize / 2; offset > 0; offset /= 2)
        if (lane < offset) s[t] += s[t + offset];
    if (lane == 0) atomicAdd(out, s[t]);
}
"""
# the classic reduction with its last wavefront unrolled without a barrier (volatile): the same, on CUDA a race
UNROLLED_TREE = r"""
__device__ void last(volatile int* v, int t) { for (int o = warpSize; o > 0; o >>= 1) v[t] += v[t + o]; }
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    __shared__ int s[1024 + 64];
    int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    s[t] = i < n ? x[i] : 0;
    if (t < 64) s[blockDim.x + t] = 0;
    __syncthreads();
    for (int o = blockDim.x / 2; o > warpSize; o >>= 1) { if (t < o) s[t] += s[t + o]; __syncthreads(); }
    if (t < warpSize) last(s, t);
    if (t == 0) atomicAdd(out, s[0]);
}
"""
# the cases: warp-level code the SIMT machine ran although one vendor leaves it undefined, and answers
# that are right on one lane width only (both directions of the compatibility rules)
OWN_MACROS = """#if defined(__HIP_PLATFORM_AMD__)
#define FULL 0xffffffffffffffffull
#define DOWN_W(v, o, w) __shfl_down(v, o, w)
#else
#define FULL 0xffffffffu
#define DOWN_W(v, o, w) __shfl_down_sync(0xffffffffu, v, o, w)
#endif
"""
# warp-synchronous, as CUDA wants it since Volta: a tree in __shared__ inside each wavefront, each step's reads and
# writes apart by __syncwarp() (a warp's lanes are scheduled independently; on AMD a wavefront runs in lock-step, and
# HIP's __syncwarp orders the same)
SUM_ALTERNATIVES["a tree in __shared__ memory inside each wavefront, __syncwarp between steps"] = OWN_MACROS + r"""
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    __shared__ int s[1024];
    int i = blockIdx.x * blockDim.x + threadIdx.x, t = threadIdx.x, lane = t % warpSize;
    s[t] = i < n ? x[i] : 0;
    __syncwarp(FULL);
    for (int offset = warpSize / 2; offset > 0; offset /= 2) {
        int other = lane < offset ? s[t + offset] : 0;
        __syncwarp(FULL);
        if (lane < offset) s[t] += other;
        __syncwarp(FULL);
    }
    if (lane == 0) atomicAdd(out, s[t]);
}
"""
SUM_WRONG = {
    "a tree in volatile __shared__ inside each warp, no __syncwarp (right on AMD only)": (
        VOLATILE_TREE, "CUDA, 32-lane warps", "no __syncwarp", "scheduled independently"),
    "the last wavefront unrolled without a barrier (volatile; right on AMD only)": (
        UNROLLED_TREE, "CUDA, 32-lane warps", "no __syncwarp"),
    "width 32 on a 64-lane wavefront, every 32nd lane adds (right total)": (
        OWN_MACROS + SUM.replace("warpSize / 2", "16").replace("SHFL_DOWN(v, offset)", "DOWN_W(v, offset, 32)")
        .replace("threadIdx.x % warpSize == 0", "threadIdx.x % 32 == 0"),
        "HIP, 64-lane wavefronts", "__shfl_down with width 32 on a 64-lane wavefront shuffles inside groups of 32 lanes"),
    "width 64 (not a lane count on CUDA)": (OWN_MACROS + SUM.replace("SHFL_DOWN(v, offset)", "DOWN_W(v, offset, 64)"),
                                            "CUDA, 32-lane warps", "__shfl_down_sync with width 64 on a 32-lane",
                                            "power of two no larger than the lane count"),
    "width 48 (not a power of two)": (OWN_MACROS + SUM.replace("SHFL_DOWN(v, offset)", "DOWN_W(v, offset, 48)"),
                                      "width 48", "power of two"),
    "every lane adds its element (right total)": (SUM.replace("    for (int offset = warpSize / 2; offset > 0; offset /= 2)\n"
                                                              "        v += SHFL_DOWN(v, offset);\n", "")
                                                  .replace("if (threadIdx.x % warpSize == 0) ", ""),
                                                  "the total is right, but lanes", "each added", "nor every lane"),
    "early return, then a full-mask shuffle": (OWN_MACROS + SUM.replace("int v = i < n ? x[i] : 0;", "if (i >= n) return;\n    int v = x[i];")
                                               .replace("SHFL_DOWN(v, offset)", "__shfl_down_sync(FULL, v, offset)"),
                                               "had returned", "undefined"),
    "offsets from 64": (SUM.replace("warpSize / 2", "64"), "CUDA, 32-lane warps", "a shuffle offset of 64 on a 32-lane",
                        "start at warpSize / 2 = 16"),
    "every 64th lane adds": (SUM.replace("threadIdx.x % warpSize == 0", "threadIdx.x % 64 == 0"), "CUDA, 32-lane warps, n = 33",
                             "holding elements 32 to 32 added nothing", "not every 64th lane"),
    "a float sum": (SUM.replace("int v = i < n ? x[i] : 0;", "float v = i < n ? x[i] : 0;")
                    .replace("atomicAdd(out, v)", "atomicAdd(out, (int)v)"), "values near +-2^24", "keep v and the sum in int"),
    "HIP's unmasked __shfl_down used on CUDA": (SUM.replace("SHFL_DOWN(v, offset)", "__shfl_down(v, offset)"),
                                                "does not compile (CUDA)", "CUDA has no unmasked __shfl_down"),
    "warpSize as a template argument": (SUM_ALTERNATIVES["width as a template parameter"].replace(
        "v = warpSize == 64 ? wave_sum<64>(v) : wave_sum<32>(v);", "v = wave_sum<warpSize>(v);"),
        "does not compile", "warpSize is a variable, not a compile-time constant"),
    "__AMDGCN_WAVEFRONT_SIZE": (SUM.replace("warpSize / 2", "__AMDGCN_WAVEFRONT_SIZE / 2"), "does not compile",
                                "__AMDGCN_WAVEFRONT_SIZE is HIP-only"),
    "(1ull << warpSize) - 1 as the mask": (SUM.replace("SHFL_DOWN(v, offset)", "MY_DOWN(v, offset)").replace("__global__", """#if defined(__HIP_PLATFORM_AMD__)
#define MY_DOWN(v, o) __shfl_down_sync((1ull << warpSize) - 1, v, o)
#else
#define MY_DOWN(v, o) __shfl_down_sync(0xffffffffu, v, o)
#endif
__global__""", 1), "HIP, 64-lane wavefronts", "(mask 0x0)", "(1ull << warpSize) - 1"),

    "offsets from 16": (SUM.replace("warpSize / 2", "16"), "64-lane wavefronts", "largest shuffle offset was 16", "needs 32"),
    "& 31 picks the adding lane": (SUM.replace("threadIdx.x % warpSize == 0", "(threadIdx.x & 31) == 0"),
                                   "lanes [0, 32] of one 64-lane wavefront each added"),
    "0xffffffff mask": (SUM.replace("SHFL_DOWN(v, offset)", "__shfl_down_sync(0xffffffff, v, offset)"),
                        "mask must be a 64-bit integer", "64-bit mask"),
    "64-bit type, 32-bit mask": (SUM.replace("SHFL_DOWN(v, offset)", "__shfl_down_sync(0xffffffffull, v, offset)"),
                                 "lane 32 called __shfl_down with a mask that leaves it out"),
    "no guard on n": (SUM.replace("i < n ? x[i] : 0", "x[i]"), "CUDA, 32-lane warps, n = 1", "the guard i < n"),
    # races (issue 46): utils.simt interleaves the wavefronts and blocks and names the lanes and the address
    "a += to the total, no atomic": (SUM.replace("atomicAdd(out, v)", "*out += v"), "a race on `out[0]`",
                                     "(wavefront ", "without an atomic", "need atomicAdd"),
    "a block reduction without __syncthreads": (SUM_ALTERNATIVES["a block reduction in shared memory, one atomic per block"]
                                                .replace("    __syncthreads();\n", ""),
                                                "a race on __shared__ `partial[", "no __syncthreads between them"),
    "a block total in __shared__ with +=": (r"""
__global__ void sum_portable(const int* __restrict__ x, int* __restrict__ out, int n) {
    __shared__ int total;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    if (i < n) total += x[i];
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(out, total);
}
""", "a race on __shared__ `total[0]`", "lanes ", "atomicAdd"),
}


def test_grader_2_2_reference_and_alternatives(lab):
    graders.check_portable_sum(lab.sum_portable_kernel)
    for what, source in SUM_ALTERNATIVES.items():
        passes(lambda: graders.check_portable_sum(given(source)), what)
    alt = solutions.load("02", {"2.2": kernel_answer(SUM_ALTERNATIVES["width as a template parameter"])})
    graders.check_portable_sum(alt.sum_portable_kernel)


@pytest.mark.parametrize("mistake", SUM_WRONG, ids=list(SUM_WRONG))
def test_grader_2_2_known_wrong(lab, mistake):
    source, *hint = SUM_WRONG[mistake]
    fails_with(lambda: graders.check_portable_sum(given(source)), *hint)


def test_grader_2_2_not_a_kernel():
    fails_with(lambda: graders.check_portable_sum(given(None)), "as a string", "not a NoneType")
    fails_with(lambda: graders.check_portable_sum(given(SUM.replace("sum_portable", "my_sum"))),
               "must define the kernel `__global__ void sum_portable(...)`")


# --- 2.3 counting with a ballot ------------------------------------------------------------------------

COUNT = r"""
__global__ void count_positive(const float* __restrict__ x, int* __restrict__ count, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);
    if (threadIdx.x % warpSize == 0) atomicAdd(count, __popcll(votes));
}
"""
COUNT_SHUFFLE = r"""
__global__ void count_positive(const float* __restrict__ x, int* __restrict__ count, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int yes = (i < n && x[i] > 0.0f) ? 1 : 0;              // a reduction of 0/1 instead of a ballot
    for (int offset = warpSize / 2; offset > 0; offset /= 2) yes += SHFL_DOWN(yes, offset);
    if (threadIdx.x % warpSize == 0) atomicAdd(count, yes);
}
"""
COUNT_ALTERNATIVES = {
    "a shuffle reduction of 0/1": COUNT_SHUFFLE,
    "early return, then the lab's BALLOT (HIP: unmasked; CUDA: exited lanes may be named)": COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);", "if (i >= n) return;\n    unsigned long long votes = BALLOT(x[i] > 0.0f);"),
    "early return, then a ballot over the active lanes": COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);",
        "if (i >= n) return;\n    unsigned long long votes = __ballot_sync(__activemask(), x[i] > 0.0f);"),
    "a full 64-bit mask with every lane calling": OWN_MACROS + COUNT.replace("BALLOT(i < n && x[i] > 0.0f)",
                                                                            "__ballot_sync(FULL, i < n && x[i] > 0.0f)"),
    "the last lane adds, only when there are votes": COUNT.replace("threadIdx.x % warpSize == 0",
                                                                  "threadIdx.x % warpSize == warpSize - 1 && votes"),
}
COUNT_WRONG = {
    # the case: a ballot whose mask names lanes that returned (undefined on HIP, where the SIMT machine ran it)
    "early return, then a full 64-bit mask": (OWN_MACROS + COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);",
        "if (i >= n) return;\n    unsigned long long votes = __ballot_sync(FULL, x[i] > 0.0f);"),
        "HIP, 64-lane wavefronts (CDNA), n = 1", "__ballot_sync's mask 0xffffffffffffffff names 63 lanes (from lane 1)",
        "they had finished", "undefined on HIP"),
    "a full mask inside a branch": (OWN_MACROS + COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);",
        "unsigned long long votes = 0;\n    if (i < n) votes = __ballot_sync(FULL, x[i] > 0.0f);"),
        "HIP, 64-lane", "did not call it", "rather than return or branch around it"),
    "__any_sync with a 32-lane mask on 64 lanes": (COUNT.replace("unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);",
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);\n#if defined(__HIP_PLATFORM_AMD__)\n"
        "    if (!__any_sync(0xffffffffull, votes != 0)) return;\n#endif"),
        "lane 32 called a ballot/vote with a mask that leaves it out"),
    "every positive lane adds 1 (right total)": (COUNT.replace("if (threadIdx.x % warpSize == 0) atomicAdd(count, __popcll(votes));",
                                                               "if (i < n && x[i] > 0.0f) atomicAdd(count, 1);"),
                                                 "the total is right, but lanes", "one lane per wavefront"),
    "zeros counted": (COUNT.replace("x[i] > 0.0f", "x[i] >= 0.0f"), "zeros were counted"),

    "__popc of a 64-bit ballot": (COUNT.replace("__popcll(votes)", "__popc(votes)"), "only lanes 0-31", "__popcll"),
    "32-bit votes": (COUNT.replace("unsigned long long votes", "unsigned int votes"), "only lanes 0-31"),
    "& 31 picks the adding lane": (COUNT.replace("threadIdx.x % warpSize == 0", "(threadIdx.x & 31) == 0"),
                                   "each added to the total"),
    "no guard on n": (COUNT.replace("i < n && x[i] > 0.0f", "x[i] > 0.0f"), "lanes past the end (i >= n) voted"),
    "CUDA's ballot on HIP": (COUNT.replace("BALLOT(i < n && x[i] > 0.0f)", "__ballot_sync(0xffffffff, i < n && x[i] > 0.0f)"),
                             "64-bit mask"),
    # issue 46: a ballot inside a branch some lanes skip (the lowest voting lane adds: the total is right on HIP)
    "a ballot inside a branch some lanes skip": (COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);\n    if (threadIdx.x % warpSize == 0) atomicAdd(count, __popcll(votes));",
        "if (i < n && x[i] > 0.0f) {\n        unsigned long long votes = BALLOT(1);\n"
        "        if (threadIdx.x % warpSize == __ffsll(votes) - 1) atomicAdd(count, __popcll(votes));\n    }"),
        "n = 33", "lanes 0, 1, ..., 14 (10 lanes) of the 32-lane wavefront holding elements 0 to 31",
        "hold elements but took no part in its ballot", "not in its result", "BALLOT(i < n && x[i] > 0.0f)"),
    "a return before the ballot for lanes that vote no": (COUNT.replace(
        "unsigned long long votes = BALLOT(i < n && x[i] > 0.0f);",
        "if (i >= n || !(x[i] > 0.0f)) return;\n    unsigned long long votes = BALLOT(1);"),
        "took no part in", "a return before it"),
    "the count added without an atomic": (COUNT.replace("atomicAdd(count, __popcll(votes))", "*count += __popcll(votes)"),
                                          "a race on `count[0]`", "lane 0", "need atomicAdd"),
    "x changed": (COUNT.replace("if (threadIdx.x % warpSize == 0)",
                                "if (i < n) const_cast<float*>(x)[i] = 0.0f;\n    if (threadIdx.x % warpSize == 0)"),
                  "wrote into its input `x`", "it may only read it"),
    # fitting the test: right at the fixed sizes only; the size drawn for each grade finds it (the seed is set below)
    "right at the fixed sizes only": (COUNT.replace("int i = blockIdx.x * blockDim.x + threadIdx.x;",
                                                    "int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                                    "    if (n != 1 && n != 33 && n != 1000 && n != 4099) return;"),
                                      "counted 0, exact"),
}


def test_grader_2_3_reference_and_alternatives(lab):
    graders.check_count_positive(lab.count_positive_kernel)
    for what, source in COUNT_ALTERNATIVES.items():
        passes(lambda: graders.check_count_positive(given(source)), what)


@pytest.mark.parametrize("mistake", COUNT_WRONG, ids=list(COUNT_WRONG))
def test_grader_2_3_known_wrong(lab, mistake, monkeypatch):
    monkeypatch.setenv(grading_guard.SEED_VAR, "46")     # the size drawn for the grade: not one of the fixed ones
    fresh = graders.count_inputs(46)[-1][0].size
    assert fresh not in (1, 33, 1000, 4099)
    source, *hint = COUNT_WRONG[mistake]
    fails_with(lambda: graders.check_count_positive(given(source)), *hint,
               *([f"n = {fresh}"] if mistake == "right at the fixed sizes only" else []))


# --- 2.4 one side per wavefront ------------------------------------------------------------------------

CONVERGED_BITS = r"""
__global__ void converged(float* __restrict__ x, int n, int period, int iters) {
    int half = blockDim.x >> 1;
    bool side_a = threadIdx.x < half;
    int t = side_a ? threadIdx.x : threadIdx.x - half;
    int e = ((t & ~(period - 1)) << 1) | (side_a ? 0 : period) | (t & (period - 1));   // periods are powers of two
    int i = blockIdx.x * blockDim.x + e;
    if (i < n) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) v = side_a ? v * 1.0001f + 0.5f : v * v * 0.5f - 0.25f;
        x[i] = v;
    }
}
"""


def converged_wrong(lab):
    reference = lab.converged_kernel() if lab else ""
    return {
        "period 1 only": (reference.replace("int e = (t / period) * 2 * period + (side_a ? 0 : period) + t % period;",
                                            "int e = 2 * t + (side_a ? 0 : 1);"), "period = 2", "differ from divergent"),
        "no bounds check": (reference.replace("    if (i >= n) return;\n", ""), "wrote past the end of `x`"),
        "arithmetic of the other side": (reference.replace("if (side_a) {", "if (!side_a) {"),
                                         "the other side's arithmetic"),
        # right values, but still divergent: the exercise's point (its speed is measured only on a GPU)
        "divergent itself, renamed": (lab.DIVERGENT.replace("divergent", "converged"), "period = 1",
                                      "processed A-elements and B-elements", "still diverges"),
        "a side per thread parity": (reference.replace("int half = blockDim.x / 2;", "int half = 0;")
                                     .replace("int t = threadIdx.x < half ? threadIdx.x : threadIdx.x - half;", "int t = threadIdx.x / 2;")
                                     .replace("bool side_a = threadIdx.x < half;", "bool side_a = threadIdx.x % 2 == 0;"),
                                     "still diverges"),
        # on 32 lanes its threads past the first 128 reach the next block's elements: a race, named
        "the half as two wavefronts": (reference.replace("int half = blockDim.x / 2;", "int half = 2 * warpSize;"),
                                       "CUDA, 32-lane warps", "a race on `x[", "of block", "exactly one thread"),
    }


def test_grader_2_4(lab):
    graders.check_converged(lab.converged_kernel)
    graders.check_converged(given(CONVERGED_BITS))
    wrong = converged_wrong(lab)
    for source, *hint in wrong.values():
        assert source != lab.converged_kernel()
        fails_with(lambda: graders.check_converged(given(source)), *hint)


def test_unfinished_exercises_are_not_done(capsys):
    stub = solutions.load("02", stubs=True)
    ex = exercises.Lab("02_test_unfinished")
    assert ex.grade("2.1", "predict", graders.check_passes, stub.predicted_passes) is False
    assert ex.grade("2.2", "reduction", graders.check_portable_sum, stub.sum_portable_kernel) is False
    assert ex.grade("2.3", "ballot", graders.check_count_positive, stub.count_positive_kernel) is False
    assert ex.grade("2.4", "converged", graders.check_converged, stub.converged_kernel) is False
    assert capsys.readouterr().out.count("NOT DONE: exercise 2.") == 4


def test_through_papermill_an_alternative_passes_then_a_32_lane_reduction_stops_with_its_hint(tmp_path, build_dir):
    nb, error = run_lab_with("02", {"2.1": "return {(w, p): 1 if p >= w else 2 for w in (32, 64) for p in (16, 32, 64)}",
                                    "2.2": kernel_answer(SUM_WRONG["& 31 picks the adding lane"][0])}, tmp_path)
    assert "PASS: exercise 2.1 (what a branch costs)" in stream_text(nb)
    assert error and error[0] == "ExerciseFailed" and "each added to the total" in error[1], error
    assert len(errors(nb)) == 1


gpu_only = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA or ROCm GPU")


@pytest.fixture(scope="module")
def built(lab):
    """The lab's hand kernels as its notebook builds them (build_divergent, build_reduce, build_converged)."""
    return {"run_divergent": lab.build_divergent().run_divergent, "run_sum": lab.build_reduce().run_sum,
            "run_count": lab.build_reduce().run_count, "run_converged": lab.build_converged().run_converged}


@pytest.mark.gpu
@gpu_only
def test_reference_kernels_are_exact_on_the_gpu(built):
    import torch

    for n in (0, 1, 1000, 4099, 1 << 20):
        x = torch.randint(-4, 7, (n,), device="cuda", dtype=torch.int32)
        assert int(built["run_sum"](x, True)) == int(x.sum())
        f = torch.randn(n, device="cuda")
        assert int(built["run_count"](f)) == int((f > 0).sum())
        for period in (1, 2, 32, 64, 128):
            a = torch.rand(n, device="cuda")
            b = a.clone()
            built["run_divergent"](a, period, 7)
            built["run_converged"](b, period, 7)
            torch.testing.assert_close(a, b)


def _cuda(*shape, dtype="float32"):
    import torch

    return torch.ones(shape, device="cuda", dtype=getattr(torch, dtype))


BAD_CALLS = {   # id: (function, arguments, error, words)
    "float64": ("run_divergent", lambda: (_cuda(8, dtype="float64"), 1, 7), TypeError, "takes a torch.float32 tensor"),
    "cpu": ("run_divergent", lambda: (__import__("torch").ones(8), 1, 7), ValueError, "runs on a GPU"),
    "strided": ("run_divergent", lambda: (_cuda(16)[::2], 1, 7), ValueError, "contiguous"),
    "expanded": ("run_converged", lambda: (_cuda(1).expand(8), 1, 7), ValueError, "contiguous"),
    "2-D transposed": ("run_divergent", lambda: (_cuda(4, 6).T, 1, 7), ValueError, "contiguous"),
    "period 0": ("run_divergent", lambda: (_cuda(8), 0, 7), ValueError, "period from 1"),
    "negative iters": ("run_divergent", lambda: (_cuda(8), 1, -1), ValueError, "iters from 0"),
    "period past half a block": ("run_converged", lambda: (_cuda(8), 129, 7), ValueError, "period from 1 to 128"),
    "period not dividing 128": ("run_converged", lambda: (_cuda(300), 3, 7), ValueError, "must divide 128"),
    "sum of floats": ("run_sum", lambda: (_cuda(8), True), TypeError, "takes a torch.int32 tensor"),
    "sum of int64": ("run_sum", lambda: (_cuda(8, dtype="int64"), False), TypeError, "takes a torch.int32 tensor"),
    "sum strided": ("run_sum", lambda: (_cuda(8, dtype="int32")[::2], True), ValueError, "contiguous"),
    "count of ints": ("run_count", lambda: (_cuda(8, dtype="int32"),), TypeError, "takes a torch.float32 tensor"),
    "count on the CPU": ("run_count", lambda: (__import__("torch").ones(8),), ValueError, "runs on a GPU"),
    "not a tensor": ("run_count", lambda: ([1.0, 2.0],), TypeError, "incompatible function arguments"),
}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_gpu_hand_kernels_say_what_they_support(built, case):
    import torch

    name, args, error, words = BAD_CALLS[case]
    with pytest.raises(error, match=words):
        built[name](*args())
    torch.cuda.synchronize()                   # nothing was launched that could fail later


MEMCHECKED = r"""
import torch
from utils import solutions

lab = solutions.load("02")
divergent, reduce, converged = lab.build_divergent(), lab.build_reduce(), lab.build_converged()   # built by the test
for n in (0, 1, 255, 257, 4099):
    x = torch.randint(-4, 7, (n,), device="cuda", dtype=torch.int32)
    assert int(reduce.run_sum(x, True)) == int(x.sum()) and int(reduce.run_sum(x, False)) == int(x.sum())
    f = torch.randn(n, device="cuda")
    assert int(reduce.run_count(f)) == int((f > 0).sum())
    for period in (1, 2, 32, 64, 128):      # converged takes periods that divide 128 (period 3 is refused below)
        a = torch.rand(n, device="cuda")
        b = a.clone()
        divergent.run_divergent(a, period, 3)
        converged.run_converged(b, period, 3)
        torch.testing.assert_close(a, b)
    divergent.run_divergent(torch.rand(n, device="cuda"), 3, 3)
cuda = dict(device="cuda")
bad = [(divergent.run_divergent, lambda: (torch.ones(16, **cuda)[::2], 1, 3)),
       (divergent.run_divergent, lambda: (torch.ones(1, **cuda).expand(300), 1, 3)),
       (divergent.run_divergent, lambda: (torch.ones(8), 1, 3)),
       (divergent.run_divergent, lambda: (torch.ones(8, dtype=torch.float64, **cuda), 1, 3)),
       (divergent.run_divergent, lambda: (torch.ones(8, **cuda), 0, 3)),
       (converged.run_converged, lambda: (torch.ones(300, **cuda), 200, 3)),
       (converged.run_converged, lambda: (torch.ones(300, **cuda), 3, 3)),
       (converged.run_converged, lambda: (torch.ones(1, **cuda).expand(300), 1, 3)),
       (reduce.run_sum, lambda: (torch.ones(300, **cuda), True)),
       (reduce.run_sum, lambda: (torch.ones(300, dtype=torch.int64, **cuda), False)),
       (reduce.run_count, lambda: (torch.ones(300, dtype=torch.int32, **cuda),)),
       (reduce.run_count, lambda: (torch.ones(600, **cuda)[::2],))]
refused = 0
for fn, args in bad:
    try:
        fn(*args())
    except (TypeError, ValueError):
        refused += 1
    else:
        raise AssertionError(f"{fn.__name__} took a bad call")
torch.cuda.synchronize()
print(f"memcheck: lab 02's hand kernels ran at sizes 0 to 4099; {refused} bad calls refused")
"""


@pytest.mark.gpu
@gpu_only
def test_gpu_hand_kernels_under_compute_sanitizer(built, tmp_path):
    """Ragged small sizes, every period the lab uses and the bad calls, under memcheck."""
    print(run_under_memcheck(MEMCHECKED, tmp_path).strip().splitlines()[-2:])
