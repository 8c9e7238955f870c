"""Lab 02 (wavefront vs warp): the graders of exercises 2.1-2.4 (utils/graders/lab02.py) with reference, alternative
and known-wrong answers. The kernels run on the CPU through utils.simt.run_kernel (CUDA's API on 32 lanes, HIP's on
64 and 32); on a GPU, `@pytest.mark.gpu` runs the reference kernels on it too."""
import numpy as np
import pytest

from grading import errors, run_lab_with, stream_text
from utils import exercises, solutions
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
SUM_WRONG = {
    "offsets from 16": (SUM.replace("warpSize / 2", "16"), "64-lane wavefronts", "largest shuffle offset was 16", "needs 32"),
    "& 31 picks the adding lane": (SUM.replace("threadIdx.x % warpSize == 0", "(threadIdx.x & 31) == 0"),
                                   "lanes [0, 32] of one 64-lane wavefront each added"),
    "0xffffffff mask": (SUM.replace("SHFL_DOWN(v, offset)", "__shfl_down_sync(0xffffffff, v, offset)"),
                        "mask must be a 64-bit integer", "64-bit mask"),
    "64-bit type, 32-bit mask": (SUM.replace("SHFL_DOWN(v, offset)", "__shfl_down_sync(0xffffffffull, v, offset)"),
                                 "lane 32 called __shfl_down with a mask that leaves it out"),
    "no guard on n": (SUM.replace("i < n ? x[i] : 0", "x[i]"), "CUDA, 32-lane warps, n = 1", "the guard i < n"),
}


def test_grader_2_2_reference_and_alternatives(lab):
    graders.check_portable_sum(lab.sum_portable_kernel)
    for source in SUM_ALTERNATIVES.values():
        graders.check_portable_sum(given(source))
    alt = solutions.load("02", {"2.2": kernel_answer(SUM_ALTERNATIVES["width as a template parameter"])})
    graders.check_portable_sum(alt.sum_portable_kernel)


@pytest.mark.parametrize("mistake", SUM_WRONG, ids=list(SUM_WRONG))
def test_grader_2_2_known_wrong(lab, mistake):
    source, *hint = SUM_WRONG[mistake]
    fails_with(lambda: graders.check_portable_sum(given(source)), *hint)


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
COUNT_WRONG = {
    "__popc of a 64-bit ballot": (COUNT.replace("__popcll(votes)", "__popc(votes)"), "only lanes 0-31", "__popcll"),
    "32-bit votes": (COUNT.replace("unsigned long long votes", "unsigned int votes"), "only lanes 0-31"),
    "& 31 picks the adding lane": (COUNT.replace("threadIdx.x % warpSize == 0", "(threadIdx.x & 31) == 0"),
                                   "each added to the total"),
    "no guard on n": (COUNT.replace("i < n && x[i] > 0.0f", "x[i] > 0.0f"), "lanes past the end (i >= n) voted"),
    "CUDA's ballot on HIP": (COUNT.replace("BALLOT(i < n && x[i] > 0.0f)", "__ballot_sync(0xffffffff, i < n && x[i] > 0.0f)"),
                             "64-bit mask"),
}


def test_grader_2_3_reference_and_alternative(lab):
    graders.check_count_positive(lab.count_positive_kernel)
    graders.check_count_positive(given(COUNT_SHUFFLE))


@pytest.mark.parametrize("mistake", COUNT_WRONG, ids=list(COUNT_WRONG))
def test_grader_2_3_known_wrong(lab, mistake):
    source, *hint = COUNT_WRONG[mistake]
    fails_with(lambda: graders.check_count_positive(given(source)), *hint)


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


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_reference_kernels_are_exact_on_the_gpu(lab):
    import torch
    from torch.utils.cpp_extension import load_inline

    binding = r'''
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
torch::Tensor sum(torch::Tensor x) {
    auto out = torch::zeros({1}, x.options()); int n = x.numel();
    sum_portable<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<int>(), out.data_ptr<int>(), n);
    return out;
}
torch::Tensor count(torch::Tensor x) {
    auto out = torch::zeros({1}, x.options().dtype(torch::kInt)); int n = x.numel();
    count_positive<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), out.data_ptr<int>(), n);
    return out;
}
void both(torch::Tensor x, torch::Tensor y, int64_t period) {
    int n = x.numel();
    divergent<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(), n, period, 7);
    converged<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(y.data_ptr<float>(), n, period, 7);
}
'''
    mod = load_inline("test_lab02_kernels", cpp_sources="torch::Tensor sum(torch::Tensor x); torch::Tensor count(torch::Tensor x); "
                      "void both(torch::Tensor x, torch::Tensor y, int64_t period);",
                      cuda_sources=lab.SHUFFLE + lab.DIVERGENT + lab.sum_portable_kernel() + lab.count_positive_kernel()
                      + lab.converged_kernel() + binding, functions=["sum", "count", "both"])
    for n in (1, 1000, 4099, 1 << 20):
        x = torch.randint(-4, 7, (n,), device="cuda", dtype=torch.int32)
        assert int(mod.sum(x)) == int(x.sum())
        f = torch.randn(n, device="cuda")
        assert int(mod.count(f)) == int((f > 0).sum())
        for period in (1, 2, 32, 64, 128):
            a = torch.rand(n, device="cuda")
            b = a.clone()
            mod.both(a, b, period)
            torch.testing.assert_close(a, b)
