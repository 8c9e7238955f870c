"""Lab 03 (BF16 matmul): `triton_matmul` and `persistent_matmul` right on every layout, dtype and precision,
clear errors for what they do not take, and the graders of exercises 3.1-3.5 (utils/graders/lab03.py: reference,
alternative and known-wrong answers).

Without a GPU the kernels run in Triton's interpreter on a seeded covering grid (sizes 1, 17, 97; each layout
once; each dtype once); the full grid is behind `@pytest.mark.gpu` (`make test-gpu`)."""
import itertools
import json
import os
import re
import sys

import pytest
import torch

from grading import errors, run_lab_with, stream_text
from utils import exercises, solutions
from utils.exercises import ExerciseFailed
from utils.graders import lab03 as graders

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Without a GPU, Triton's interpreter for the whole module (kernels defined and called under it)."""
    if GPU:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def load(answers=None, stubs=False):
    """The lab's exported cells, with `answers`; imported again if another test imported it compiled."""
    module = solutions.load("03", answers=answers, stubs=stubs)
    if not GPU and type(module.matmul_kernel).__name__ != "InterpretedFunction":
        sys.modules.pop(module.__name__)
        module = solutions.load("03", answers=answers, stubs=stubs)
    return module


@pytest.fixture(scope="module")
def lab():
    return load()


# --- the kernel on real inputs ----------------------------------------------------------------------

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, "ieee": 1e-5, "tf32": 2e-3}


def operand(rows, cols, layout, dtype, gen):
    """A rows x cols operand in `layout`: contiguous, transposed (a view of its transpose), sliced (every
    other row of a wider matrix, from an offset) or expanded (stride 0 along the rows)."""
    base = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)   # views are taken after .to
    if layout == "transposed":
        return base(cols, rows).T
    if layout == "sliced":
        return base(2 * rows + 1, cols + 7)[1::2, 3:cols + 3]
    if layout == "expanded":    # as_strided: expand() keeps a single row's own stride; the kernel must see 0
        return base(1, cols).as_strided((rows, cols), (0, 1))
    return base(rows, cols)


def run_case(lab, m, n, k, a_layout, b_layout, dtype, precision, seed, matmul="triton_matmul"):
    gen = torch.Generator().manual_seed(seed)
    a, b = operand(m, k, a_layout, dtype, gen), operand(k, n, b_layout, dtype, gen)
    for t, layout in ((a, a_layout), (b, b_layout)):
        assert layout != "expanded" or t.stride(0) == 0
        assert layout != "sliced" or (t.stride(0) == 2 * t.stride(1) * (t.shape[1] + 7) and t.storage_offset() > 0)
        assert layout != "transposed" or t.stride(0) == 1 or t.shape[0] == 1
    c = getattr(lab, matmul)(a, b, input_precision=precision)
    assert c.shape == (m, n) and c.dtype == dtype and c.is_contiguous()
    ref = a.double() @ b.double()
    err = ((c.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    tol = TOLERANCE[(precision or "ieee") if dtype == torch.float32 else dtype]   # None: torch's "highest"
    assert err < tol, f"{m}x{n}x{k} a {a_layout} b {b_layout} {dtype} {precision}: relative error {err:.2e} > {tol}"
    return err


# every size of {1, 17, 97} as M, N and K at least once; every layout on each side; every dtype/precision
COVERING = [
    (1, 17, 97, "contiguous", "transposed", torch.bfloat16, None),
    (17, 97, 1, "transposed", "contiguous", torch.float16, None),
    (97, 1, 17, "sliced", "sliced", torch.float32, "ieee"),
    (17, 17, 97, "expanded", "transposed", torch.float32, "tf32"),
    (97, 97, 17, "contiguous", "expanded", torch.bfloat16, None),
    (1, 1, 1, "transposed", "transposed", torch.float32, None),
    (97, 17, 97, "sliced", "contiguous", torch.bfloat16, None),
]


@pytest.mark.parametrize("case", COVERING, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-{c[4]}-{str(c[5])[6:]}-{c[6]}")
def test_covering_grid(lab, case):
    run_case(lab, *case, seed=sum(case[:3]))


@pytest.mark.parametrize("case", COVERING[:4], ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-{c[4]}-{str(c[5])[6:]}-{c[6]}")
def test_covering_grid_persistent(lab, case):
    run_case(lab, *case, seed=sum(case[:3]) + 1, matmul="persistent_matmul")


@pytest.mark.skipif(GPU, reason="the interpreter's run of the TMA kernel; on a GPU the full grid covers it")
@pytest.mark.parametrize("m, n, k, a_t, b_t, split", [(100, 72, 96, False, False, False), (64, 132, 36, True, False, True),
                                                      (17, 64, 40, False, True, True), (4, 8, 16, True, True, False)])
def test_tma_kernel_in_the_interpreter(lab, m, n, k, a_t, b_t, split):
    """The TMA kernel's tile walk, transposes and split epilogue, on FP32 descriptors (ragged edges: zero fill)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(k, m, generator=gen).T if a_t else torch.randn(m, k, generator=gen)
    b = torch.randn(n, k, generator=gen).T if b_t else torch.randn(k, n, generator=gen)
    c = torch.full((m, n), float("nan"))
    (av, at), (bv, bt) = lab.tma_view(a), lab.tma_view(b)
    assert (at, bt) == (a_t, b_t)
    bm, bn, bk = 32, 32, 16
    descs = (TensorDescriptor.from_tensor(av, [bk, bm] if at else [bm, bk]),
             TensorDescriptor.from_tensor(bv, [bn, bk] if bt else [bk, bn]),
             TensorDescriptor.from_tensor(c, [bm, bn // 2 if split else bn]))
    lab.tma_matmul_kernel[(3,)](*descs, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, PROGRAMS=3,
                                A_T=at, B_T=bt, SPLIT_EPILOGUE=split)
    torch.testing.assert_close(c, a @ b, rtol=1e-5, atol=1e-4)


def test_tma_view_takes_only_what_tma_can_read(lab):
    x = torch.randn(64, 512, dtype=torch.bfloat16)
    assert lab.tma_view(x)[1] is False and lab.tma_view(x.T)[1] is True
    assert lab.tma_view(x[:, 1:]) is None                       # base 2 bytes off 16-byte alignment
    assert lab.tma_view(torch.randn(64, 100, dtype=torch.bfloat16)) is None   # rows of 200 bytes
    assert lab.tma_view(x[:1].expand(64, 512)) is None          # stride 0


def test_tma_refusal_names_the_constraint_and_persistent_matmul_routes_around_it(lab):
    """What TMA descriptors can describe is a matter of layout alone (the same answer on any machine): nn.Linear's
    x @ W.T goes through them unless C's rows (N elements) are not a multiple of 16 bytes; what they cannot take
    gets plain loads, and `tma=True` says why instead."""
    x, w = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(24, 64, dtype=torch.bfloat16)
    assert lab.tma_refusal(x, w.T) is None and lab.tma_refusal(x, w.T.contiguous()) is None
    assert lab.tma_refusal(x, w[:20].T) == "C's rows of N = 20 elements take 40 bytes, not a multiple of 16"
    assert "a (shape (8, 63), strides (64, 1), 2-byte elements) is not TMA-readable" in lab.tma_refusal(x[:, 1:], w.T[1:])
    assert "strides (0, 1)" in lab.tma_refusal(x[:1].expand(8, 64), w.T)
    assert "b (shape (64, 24), strides (25, 1)" in lab.tma_refusal(x, torch.randn(64, 25, dtype=torch.bfloat16)[:, :24])
    gen = torch.Generator().manual_seed(3)
    a, weight = torch.randn(5, 32, generator=gen).to(DEVICE), torch.randn(7, 32, generator=gen).to(DEVICE)
    torch.testing.assert_close(lab.persistent_matmul(a, weight.T, input_precision="ieee"),
                               torch.nn.functional.linear(a, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tma=True.*C's rows of N = 7 elements take 28 bytes, not a multiple of 16"):
        lab.persistent_matmul(a, weight.T, tma=True)
    if lab.interpreting():
        with pytest.raises(ValueError, match="tma=True.*Hopper"):
            lab.persistent_matmul(a, torch.randn(32, 8, device=DEVICE), tma=True)
    with pytest.raises(ValueError, match="a is 4x8 and b is 5x6: a's columns must equal b's rows"):
        lab.matmul(torch.randn(4, 8, device=DEVICE), torch.randn(5, 6, device=DEVICE))   # the short wrapper too


def test_fp32_default_follows_torch_and_tf32_is_visible(lab):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(97, 65, generator=gen).to(DEVICE), torch.randn(65, 33, generator=gen).to(DEVICE)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        highest = lab.triton_matmul(a, b)
        torch.set_float32_matmul_precision("high")
        high = lab.triton_matmul(a, b)
    finally:
        torch.set_float32_matmul_precision(old)
    assert torch.equal(highest, lab.triton_matmul(a, b, input_precision="ieee"))
    assert torch.equal(high, lab.triton_matmul(a, b, input_precision="tf32"))
    ref = a.double() @ b.double()
    err = lambda c: ((c.double() - ref).norm() / ref.norm()).item()
    assert err(highest) < 1e-6 and 1e-5 < err(high) < 2e-3


def test_tf32_where_there_is_none(lab, monkeypatch):
    monkeypatch.setattr(lab, "has_tf32", lambda device: False)
    a = torch.randn(8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="no TF32 matrix units.*sm_80.*gfx942.*'ieee'"):
        lab.triton_matmul(a, a, input_precision="tf32")
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")      # "high" allows TF32; without it, full FP32
        assert lab.resolve_precision(None, torch.float32, a.device) == "ieee"
    finally:
        torch.set_float32_matmul_precision(old)
    assert lab.resolve_precision("tf32", torch.bfloat16, a.device) == "ieee"   # BF16 goes in as it is


@pytest.mark.parametrize("a, b, message", [
    (torch.randn(3, 4), torch.randn(5, 6), "a is 3x4 and b is 5x6: a's columns must equal b's rows"),
    (torch.randn(3, 4).half(), torch.randn(4, 5), "a is torch.float16 and b is torch.float32"),
    (torch.randn(2, 3, 4), torch.randn(4, 5), r"a has shape \(2, 3, 4\): triton_matmul multiplies 2-D"),
    (torch.randn(3, 4).double(), torch.randn(4, 5).double(), "takes bfloat16, float16 or float32"),
    (torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 5, dtype=torch.int32), "takes bfloat16"),
    (torch.randn(3, 4), torch.randn(4, 5, device="meta"), "a is on cpu and b on meta"),
    (torch.randn(3, 4), [[1.0]] * 4, "b must be a torch.Tensor, not list"),
], ids=["shapes", "dtypes", "3-D", "float64", "int32", "devices", "not-a-tensor"])
def test_clear_errors(lab, a, b, message):
    with pytest.raises((ValueError, TypeError), match=message):
        lab.triton_matmul(a, b)


def test_bad_precision_and_cpu_tensors_when_compiled(lab, monkeypatch):
    a = torch.randn(4, 4, device=DEVICE)
    with pytest.raises(ValueError, match="input_precision='fp8'.*'ieee'.*'tf32'"):
        lab.triton_matmul(a, a, input_precision="fp8")
    monkeypatch.setattr(lab, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="compiled Triton kernels run on a GPU.*TRITON_INTERPRET=1"):
        lab.triton_matmul(torch.randn(4, 4), torch.randn(4, 4))


@pytest.mark.parametrize("matmul", ["triton_matmul", "persistent_matmul"])
def test_empty_shapes(lab, matmul):
    fn = getattr(lab, matmul)
    assert fn(torch.randn(0, 5, device=DEVICE), torch.randn(5, 3, device=DEVICE)).shape == (0, 3)
    zeros = fn(torch.randn(4, 0, device=DEVICE), torch.randn(0, 3, device=DEVICE))
    assert zeros.shape == (4, 3) and not zeros.any()
    with pytest.raises(ValueError, match="a's columns must equal b's rows"):
        fn(torch.randn(3, 4, device=DEVICE), torch.randn(5, 6, device=DEVICE))


@pytest.mark.parametrize("launch, message", [
    ({"GROUP_M": 0}, "GROUP_M=0: .*GROUP_M a whole number of tile rows, at least 1"),
    ({"GROUP_M": 2.0}, "GROUP_M=2.0: "),
    ({"BLOCK_M": 24}, "BLOCK_M=24: BLOCK_M, BLOCK_N and BLOCK_K must be powers of two, at least 16"),
    ({"BLOCK_K": 8}, "BLOCK_K=8: .*powers of two, at least 16"),
    ({"GROUP_M": None}, r"the tile is missing \['GROUP_M'\]: give all of BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M"),
    ({"BLOCK_Q": 16}, r"unknown launch options \['BLOCK_Q'\]: use kernel, BLOCK_M"),
], ids=["GROUP_M 0", "GROUP_M float", "BLOCK_M 24", "BLOCK_K 8", "GROUP_M missing", "unknown key"])
def test_checked_matmul_refuses_a_tile_the_kernel_cannot_run(lab, launch, message):
    """GROUP_M=0 ran and returned NaN; a BLOCK that is not a power of two of at least 16, or a missing key, failed
    inside Triton: each is a ValueError naming the rule now, before anything runs."""
    tile = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, **launch}
    tile = {k: v for k, v in tile.items() if v is not None}
    a, b = torch.randn(65, 127, device=DEVICE), torch.randn(127, 33, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        lab.checked_matmul(a, b, "ieee", **tile)
    with pytest.raises(ValueError, match="the tile is missing"):
        lab.checked_matmul(a, b, "ieee", num_warps=4)          # launch options alone: no tile for matmul_kernel
    c = lab.checked_matmul(a, b, "ieee", BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=3)
    assert ((c - a @ b).abs().max() / (a @ b).abs().max()).item() < 1e-5


FULL_GRID_PRECISIONS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
                         "fp32-ieee": (torch.float32, "ieee"), "fp32-tf32": (torch.float32, "tf32")}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("precision", FULL_GRID_PRECISIONS)
@pytest.mark.parametrize("matmul", ["triton_matmul", "persistent_matmul"])
def test_full_grid_on_gpu(lab, matmul, precision):
    """Every layout pair x awkward and large sizes, for one kernel and one dtype/precision (make test-gpu; eight
    tests, so that the part's workers share them: each one compiles and autotunes its own kernels)."""
    dtype, p = FULL_GRID_PRECISIONS[precision]
    if p == "tf32" and not lab.has_tf32(torch.device("cuda")):
        pytest.skip("this GPU has no TF32 (NVIDIA sm_80+ or AMD gfx942)")
    sizes = [(1, 17, 97), (17, 97, 1), (97, 97, 97), (1000, 1000, 1000), (127, 4096, 129), (4096, 4096, 4096)]
    layouts = ["contiguous", "transposed", "sliced", "expanded"]
    failures, count = [], 0
    for (m, n, k), la, lb in itertools.product(sizes, layouts, layouts):
        count += 1
        try:
            run_case(lab, m, n, k, la, lb, dtype, p, seed=count, matmul=matmul)
        except AssertionError as err:
            failures.append(f"{matmul}: {err}")
    print(f"full grid, {matmul} {precision}: {count - len(failures)} of {count} cases pass")
    assert not failures, failures[:10]


def layout_operand(rows, cols, layout, dtype, gen):
    """operand's layouts, and two more: "offset" (contiguous rows from one element past a 16-byte boundary) and
    "padded" (rows of `cols` in a buffer whose rows are padded to 16 bytes: strided, but TMA-readable)."""
    if layout == "offset":
        return torch.randn(rows * cols + 1, generator=gen).to(DEVICE, dtype)[1:].view(rows, cols)
    if layout == "padded":
        per_16 = 16 // torch.empty(0, dtype=dtype).element_size()
        return torch.randn(rows, -(-(cols + 1) // per_16) * per_16, generator=gen).to(DEVICE, dtype)[:, :cols]
    return operand(rows, cols, layout, dtype, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
def test_every_layout_takes_a_path_that_reads_it_on_gpu(lab):
    """persistent_matmul with every layout of a against nn.Linear's weight (b = W.T, "transposed") and every layout of b
    against a contiguous a, at sizes whose rows are and are not multiples of 16 bytes, in BF16 and FP32: right through
    whichever path it picks, right with tma=False, right with tma=True where TMA can read the operands and a ValueError
    naming the constraint where not; on Hopper both paths are taken. (The full grid above crosses every layout pair.)"""
    layouts = ["contiguous", "transposed", "sliced", "expanded", "offset", "padded"]
    pairs = [(la, "transposed") for la in layouts] + [("contiguous", lb) for lb in layouts if lb != "transposed"]
    sizes = [(64, 100, 128), (33, 24, 40), (17, 7, 9)]
    precisions = [(torch.bfloat16, None), (torch.float32, "ieee")]
    paths, failures, count = {}, [], 0
    for (m, n, k), (la, lb), (dtype, p) in itertools.product(sizes, pairs, precisions):
        count += 1
        gen = torch.Generator().manual_seed(count)
        a, b = layout_operand(m, k, la, dtype, gen), layout_operand(k, n, lb, dtype, gen)
        ref = a.double() @ b.double()
        tma = lab.uses_tma(a, b)
        paths[str(dtype)[6:], tma] = paths.get((str(dtype)[6:], tma), 0) + 1
        for how, kw in (("auto", {}), ("tma=False", {"tma": False})) + ((("tma=True", {"tma": True}),) if tma else ()):
            c = lab.persistent_matmul(a, b, input_precision=p, **kw)
            err = ((c.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not (c.shape == (m, n) and c.is_contiguous() and err < TOLERANCE[p or dtype]):
                failures.append(f"{how} {m}x{n}x{k} a {la} b {lb} {dtype} ({'TMA' if tma else 'plain'}): error {err:.2e}")
        if not tma and lab.tma_refusal(a, b) is not None:
            with pytest.raises(ValueError, match=r"tma=True\): .*(16-byte|multiple of 16)"):
                lab.persistent_matmul(a, b, input_precision=p, tma=True)
    print(f"layout grid: {count - len(failures)} of {count} cases right; cases per (dtype, TMA): {paths}")
    assert not failures, failures[:10]
    if GPU and not torch.version.hip and torch.cuda.get_device_capability() >= (9, 0):
        assert all(paths.get((str(dtype)[6:], tma), 0) > 0 for dtype, _ in precisions for tma in (True, False)), paths


# --- graders: reference, alternative and known-wrong answers -------------------------------------------

def fails_with(fn, *hint):
    with pytest.raises(ExerciseFailed) as err:
        fn()
    for part in hint:
        assert part in str(err.value), str(err.value)


INTENSITY_RIGHT = ["return matmul_flops(n, n, n) / matmul_bytes(n, n, n)", "return n / 3",
                   "return float(2 * n ** 3) / (3 * n * n * 2)"]
INTENSITY_WRONG = {   # answer: the hint it must get
    "half": ("return n / 6", "half the answer"),
    "A and B only": ("return 2 * n**3 / (2 * 2 * n**2)", "C is written too"),
    "FP32, one FLOP": ("return n**3 / (4 * 3 * n**2)", "FP32's 4 bytes"),
    "integer division": ("return 2 * n**3 // (6 * n**2)", "integer division"),
    "each matrix moved twice": ("return 2 * n**3 / (2 * 6 * n**2)", "not twice"),
    "not a number": ('return f"{n / 3:.1f}"', "return a number"),
    "raises": ("return matmul_flops(n) / matmul_bytes(n)", "raised TypeError"),
    "other": ("return n / 5", "count the FLOPs"),
}


def test_grader_3_1_intensity(lab):
    graders.check_intensity(lab.intensity)
    for answer in INTENSITY_RIGHT:
        graders.check_intensity(load({"3.1": answer}).intensity)


@pytest.mark.parametrize("mistake", INTENSITY_WRONG, ids=list(INTENSITY_WRONG))
def test_grader_3_1_known_wrong(mistake):
    answer, hint = INTENSITY_WRONG[mistake]
    wrong = load({"3.1": answer})
    fails_with(lambda: graders.check_intensity(wrong.intensity), hint)
    assert "1365.33" not in hint and "n / 3" not in hint


K_LOOP_ALTERNATIVE = """
k0 = k * BLOCK_K                      # index arithmetic from the base pointers instead of moving them
a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
            mask=(k0 + offs_k)[None, :] < K, other=0.0)
b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=(k0 + offs_k)[:, None] < K, other=0.0)
"""
K_LOOP = """
a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
a_ptrs += BLOCK_K * stride_ak
b_ptrs += BLOCK_K * stride_bk
"""
K_LOOP_ANOTHER = """
a = tl.load(a_ptrs, mask=(offs_k[None, :] + k * BLOCK_K) < K, other=0.)
b = tl.load(b_ptrs, mask=(k * BLOCK_K + offs_k)[:, None] < K, other=0.)
a_ptrs = a_ptrs + stride_ak * BLOCK_K
b_ptrs = b_ptrs + stride_bk * BLOCK_K
"""
K_LOOP_WRONG = {
    "pointers never move": (K_LOOP.replace("a_ptrs += BLOCK_K * stride_ak\nb_ptrs += BLOCK_K * stride_bk\n", ""),
                            "several K steps", "move both pointers"),
    "off-by-one mask": (K_LOOP.replace(" < K - k", " <= K - k"), "ragged last K step", "NaN in C", "strictly less"),
    "A's loads unmasked": (K_LOOP.replace(", mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0", ""), "NaN in C"),
    "moves by BLOCK_K, not the stride": (K_LOOP.replace("BLOCK_K * stride_ak", "BLOCK_K"), "transposed inputs",
                                         "BLOCK_K * stride_ak"),
    "B moves by BLOCK_K, not the stride": (K_LOOP.replace("BLOCK_K * stride_bk", "BLOCK_K"), "several K steps",
                                           "K stride", "BLOCK_K * stride_bk"),
    "the mask ignores the step": (K_LOOP.replace("K - k * BLOCK_K", "K"), "ragged last K step", "NaN in C",
                                  "offs_k < K - k * BLOCK_K"),
    "moves before loading": ("a_ptrs += BLOCK_K * stride_ak\nb_ptrs += BLOCK_K * stride_bk\n" +
                             K_LOOP.split("a_ptrs +=")[0], "every value of C is NaN", "then move the pointers"),
    # shape and dtype slips: a hint that names the input and the slip, never a traceback (issue: 3.2 crashed)
    "mask axes swapped": (K_LOOP.replace("offs_k[None, :] < K", "offs_k[@] < K").replace("offs_k[:, None] < K",
                          "offs_k[None, :] < K").replace("offs_k[@]", "offs_k[:, None]"),
                          "raised ValueError", "64x32 bfloat16", "not shaped like its tile"),
    "a cast to bfloat16": (K_LOOP.replace("other=0.0)\nb", "other=0.0).to(tl.bfloat16)\nb"), "raised", "one dtype"),
    "b transposed": (K_LOOP.replace("b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)",
                                    "b = tl.trans(tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0))"),
                     "raised", "no transpose"),
}
def test_grader_3_2_k_loop(lab):
    graders.check_matmul(lab.matmul, DEVICE)            # the short wrapper the notebook grades
    graders.check_matmul(lab.triton_matmul, DEVICE)     # the full one, through the same kernel
    graders.check_matmul(load({"3.2": K_LOOP_ALTERNATIVE}).matmul, DEVICE)
    graders.check_matmul(load({"3.2": K_LOOP_ANOTHER}).matmul, DEVICE)


def test_grader_3_2_poisons_memory_before_and_after_every_operand():
    """NaN on both sides of A and B (a load outside either shows), sliced operands, FP16 and FP32 graded too."""
    gen = torch.Generator().manual_seed(0)
    for layout in ("contiguous", "a.T", "b.T", "sliced"):
        a, b = graders._operands(5, 6, 7, gen, "cpu", torch.float32, layout)
        for t in (a, b):
            storage = torch.empty(0).set_(t.untyped_storage())
            lo = t.storage_offset()
            hi = lo + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
            before, after = (storage[:lo], storage[hi:]) if layout != "sliced" else (storage[:graders.GUARD],
                                                                                     storage[-graders.GUARD:])
            assert lo > 0 and len(storage) > hi and torch.isnan(before).all() and torch.isnan(after).all()
            assert not torch.isnan(t).any()
    assert {c[4] for c in graders.UNPRINTED["transposed inputs"]} == {torch.bfloat16, torch.float16, torch.float32}


@pytest.mark.parametrize("mistake", K_LOOP_WRONG, ids=list(K_LOOP_WRONG))
def test_grader_3_2_known_wrong(mistake):
    code, *hint = K_LOOP_WRONG[mistake]
    wrong = load({"3.2": code})
    fails_with(lambda: graders.check_matmul(wrong.matmul, DEVICE), *hint)


def _keeping(compute):
    """An answer that keeps its results across calls, by the inputs' shape, strides and dtype (fitting the test)."""
    kept = {}

    def answer(*args):
        key = tuple((tuple(t.shape), t.stride(), t.dtype) for t in args)
        if key not in kept:
            kept[key] = compute(*args)
        return kept[key].clone()
    return answer


def _scribbling(compute):
    """An answer that computes the right result, then writes into its first input."""
    def answer(first, *rest):
        result = compute(first, *rest).clone()
        first.zero_()
        return result
    return answer


def test_graders_draw_fresh_inputs_on_every_call(lab):
    """A result kept from an earlier call, or a table of the cases tried, fails the next grade; the printed cases stay
    those the lab shows (issue 46: the graders used the same inputs on every call)."""
    seen = []
    recording = lambda a, b: seen.append((tuple(a.shape), a.float().sum().item())) or torch.matmul(a, b)
    graders.check_matmul(recording, DEVICE)
    first, seen[:] = list(seen), []
    graders.check_matmul(recording, DEVICE)
    assert {v for _, v in first}.isdisjoint(v for _, v in seen) and first != seen
    printed = [s[:3] for _, shapes, _ in graders.MATMUL_STAGES for s in shapes]
    assert all(shape in [shape for shape, _ in seen] for shape in [(m, k) for m, n, k in printed])
    kept = _keeping(torch.matmul)
    graders.check_matmul(kept, DEVICE)
    fails_with(lambda: graders.check_matmul(kept, DEVICE), "relative error")
    kept_tf32 = _keeping(lab.to_tf32)
    graders.check_tf32_round(kept_tf32, DEVICE)
    fails_with(lambda: graders.check_tf32_round(kept_tf32, DEVICE), "wrong, e.g.")
    table = {64: 64 / 3, 1000: 1000 / 3, 4096: 4096 / 3}
    fails_with(lambda: graders.check_intensity(lambda n: table[n]), "raised KeyError")


def test_graders_fail_an_answer_that_writes_into_its_inputs(lab):
    fails_with(lambda: graders.check_matmul(_scribbling(torch.matmul), DEVICE), "one full K step",
               "matmul changed its input a")
    fails_with(lambda: graders.check_tf32_round(_scribbling(lab.to_tf32), DEVICE), "changed its input x")


def test_grader_3_3_prediction(lab):
    measured = {"gfx942": 32, "sm_90": 4}   # what the lab's builds count (its notebook checks the same)
    graders.check_instruction_prediction(lab.matrix_instructions_per_k_step(), measured)
    alt = load({"3.3": 'return {"sm_90": 2 * 2, "gfx942": 4 * 8}'})
    graders.check_instruction_prediction(alt.matrix_instructions_per_k_step(), measured)
    fails_with(lambda: graders.check_instruction_prediction({"gfx942": 128, "sm_90": 4}, measured), "4 wavefronts share it")
    fails_with(lambda: graders.check_instruction_prediction({"gfx942": 32, "sm_90": 8}, measured), "2 warp groups")
    fails_with(lambda: graders.check_instruction_prediction(32, measured), 'return {"gfx942"')
    fails_with(lambda: graders.check_instruction_prediction({"gfx942": [32], "sm_90": 4}, measured), "whole number")
    fails_with(lambda: graders.check_instruction_prediction({"gfx942": 32, "sm_90": 3}, measured), "you said 3")
    graders.check_instruction_prediction({"gfx942": 32.0, "sm_90": 4}, measured)


TF32_REFERENCE = """
offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
mask = offs < n
bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True)
bits = (bits + 0x1000) & -0x2000
tl.store(y_ptr + offs, bits.to(tl.float32, bitcast=True), mask=mask)
"""
TF32_ALTERNATIVE = """
offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
u = x.to(tl.uint32, bitcast=True)
tl.store(y_ptr + offs, ((u + 4096) & 0xFFFFE000).to(tl.float32, bitcast=True), mask=offs < n)
"""
TF32_SHIFTS = TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "((bits + 4096) >> 13) << 13")
# a converter that treats NaN apart (as real ones do: lab 03's prose) keeps every NaN, whatever its payload
TF32_KEEPS_NAN = """
offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
rounded = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
tl.store(y_ptr + offs, tl.where(x != x, x, rounded), mask=offs < n)
"""
TF32_WRONG = {
    "truncates": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "bits & -0x2000"), "without rounding"),
    "bfloat16": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "(bits + 0x8000) & -0x10000"), "7 mantissa bits"),
    "store unmasked": (TF32_REFERENCE.replace("bitcast=True), mask=mask)", "bitcast=True))"), "mask the store"),
    "ties toward zero": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "(bits + 0xFFF) & -0x2000"),
                         "ties round toward zero"),
    "ties to even": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000",
                                            "(bits + 0xFFF + ((bits >> 13) & 1)) & -0x2000"), "ties round to even"),
    "a whole step added": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "(bits + 0x2000) & -0x2000"),
                           "a whole TF32 step"),
    "11 bits kept": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "(bits + 0x800) & -0x1000"),
                     "keeps 11 mantissa bits"),
    "a 64-bit view (crashes)": (TF32_REFERENCE.replace(".to(tl.int32, bitcast=True)", ".to(tl.int64, bitcast=True)"),
                                "raised", "x 1 float32", "as tl.int32"),
    "other": (TF32_REFERENCE.replace("(bits + 0x1000) & -0x2000", "(bits + 0x1000) & -0x2001"),
              "round the bits to 10 mantissa bits"),
}


def test_grader_3_4_tf32_rounding(lab):
    graders.check_tf32_round(lab.tf32_round, DEVICE)
    assert torch.isnan(graders.tf32_test_values(40)).sum() == 4     # the canonical NaN and three other payloads
    for code in (TF32_ALTERNATIVE, TF32_SHIFTS, TF32_KEEPS_NAN):
        graders.check_tf32_round(load({"3.4": code}).tf32_round, DEVICE)


@pytest.mark.parametrize("mistake", TF32_WRONG, ids=list(TF32_WRONG))
def test_grader_3_4_known_wrong(mistake):
    code, *hint = TF32_WRONG[mistake]
    wrong = load({"3.4": code})
    fails_with(lambda: graders.check_tf32_round(wrong.tf32_round, DEVICE), *hint)


def test_grader_3_5_config(lab):
    """One triton.Config, as the lab's first version graded it (my_config itself: the test below)."""
    alt = load({"3.5": 'return triton.Config({"GROUP_M": 4, "BLOCK_K": 32, "BLOCK_M": 64, "BLOCK_N": 128}, '
                       'num_warps=4, num_stages=4)'})
    graders.check_config(alt.my_config("cuda"), DEVICE)
    import triton
    C = triton.Config
    if not GPU:   # on a CPU: a ROCm config, judged against gfx942's 64 KiB of LDS
        graders.check_config(C({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8,
                               num_stages=2), DEVICE, backend="rocm")        # 64 KiB: exactly one block's LDS
    graders.check_config(C({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
                         DEVICE, backend="cuda")                            # 192 KiB of 227
    fails_with(lambda: graders.check_config({"BLOCK_M": 64}, DEVICE), "triton.Config(")
    fails_with(lambda: graders.check_config(C({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 8, "GROUP_M": 8}), DEVICE),
               "BLOCK_K = 8", "at least 16")
    fails_with(lambda: graders.check_config(C({"BLOCK_M": 96, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}), DEVICE),
               "powers of two")
    fails_with(lambda: graders.check_config(C({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}), DEVICE), "GROUP_M")


MY_CONFIG_ALTERNATIVE = """
tiles = {"cuda": (128, 128, 64, 4), "rocm": (128, 128, 64, 2)}     # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages)
m, n, k, stages = tiles[backend]
return triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=8 if backend == "rocm" else 4,
                     num_stages=stages)
"""
CUDA_TILES = 'return triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3)'
MY_CONFIG_WRONG = {   # my_config: (the vendor whose branch is wrong, the words of its hint)
    "one config for both": (CUDA_TILES, "rocm", "98,304 bytes", "MI300X (gfx942)", "65,536"),
    "CUDA tiles too big": ('if backend == "rocm":\n    return triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, '
                           '"BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=2)\n' + CUDA_TILES.replace(
                               "num_stages=3", "num_stages=6").replace('"BLOCK_K": 64', '"BLOCK_K": 128'),
                           "cuda", "H100 (sm_90)", "232,448"),
    "an AMD option for CUDA too": ('return triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, '
                                   '"waves_per_eu": 2}, num_warps=8, num_stages=2)', "cuda", "AMD options"),
    "raises for ROCm": ('if backend != "cuda":\n    raise ValueError(f"no config for {backend}")\n' + CUDA_TILES,
                        None, 'my_config("rocm")', 'backend "rocm"', "raised ValueError"),
}


def test_grader_3_5_grades_every_vendor_branch_on_any_machine(lab, capsys):
    """my_config itself: each vendor's config against its own GPU's shared memory, whatever this machine is; the
    K-loop check with this machine's (issue 46: a ROCm branch was never graded off ROCm)."""
    graders.check_config(lab.my_config, DEVICE)
    graders.check_config(load({"3.5": MY_CONFIG_ALTERNATIVE}).my_config, DEVICE)
    out = capsys.readouterr().out
    here = "rocm" if GPU and torch.version.hip else "cuda"
    other = {"cuda": "rocm", "rocm": "cuda"}[here]
    assert out.count(f'PASS: my_config("{other}") fits') == 2 and "PASS: transposed inputs" in out


@pytest.mark.parametrize("mistake", MY_CONFIG_WRONG, ids=list(MY_CONFIG_WRONG))
@pytest.mark.parametrize("here", ["cuda", "rocm"])
def test_grader_3_5_known_wrong_vendor_branches(mistake, here):
    """Graded as on this machine's vendor and as on the other's: the wrong branch fails either way, named."""
    if GPU and here != ("rocm" if torch.version.hip else "cuda"):
        pytest.skip("the K-loop check runs the config on this GPU: only its own vendor's")
    code, branch, *hint = MY_CONFIG_WRONG[mistake]
    wrong = load({"3.5": code}).my_config
    fails_with(lambda: graders.check_config(wrong, DEVICE, backend=here),
               *([f'my_config("{branch}")'] if branch not in (None, here) else []), *hint)


def test_grader_3_5_refuses_tiles_no_gpu_can_hold_on_a_cpu_too():
    """The issue's 512 KiB tiles passed on a CPU: refused from the tiles' bytes (per backend, as the compilers
    allocate them: checked against ahead-of-time builds for sm_90 and gfx942), before anything runs."""
    import triton
    C = triton.Config
    big = C({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=8, num_stages=4)
    assert graders.matmul_tile_bytes(big, "cuda") == 512 * 1024
    fails_with(lambda: graders.check_config(big, DEVICE, backend="cuda"), "524,288 bytes (512 KiB)", "H100",
               "232,448", "smaller tiles or fewer stages")
    rocm = C({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "waves_per_eu": 2}, num_warps=8, num_stages=3)
    fails_with(lambda: graders.check_config(rocm, "cpu"), "131,072 bytes", "MI300X (gfx942)", "65,536")
    fails_with(lambda: graders.check_config(rocm, DEVICE, backend="cuda"), "AMD options", "waves_per_eu")
    fails_with(lambda: graders.check_config(C({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                                                 "BLOCK_SIZE": 64}), DEVICE), "BLOCK_SIZE", "no such parameter")
    # what the compilers allocate (ahead-of-time builds, Triton 3.7): sm_90 one A+B pair per stage, gfx942 per stage - 1
    measured = {("cuda", 128, 256, 64, 3): 147456, ("cuda", 128, 128, 64, 5): 163840, ("rocm", 256, 256, 32, 2): 32768,
                ("rocm", 128, 128, 64, 3): 65536, ("rocm", 256, 256, 64, 2): 65536}
    for (backend, m, n, k, stages), shared in measured.items():
        config = C({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=8, num_stages=stages)
        assert graders.matmul_tile_bytes(config, backend) == shared


def test_unfinished_exercises_are_not_done(capsys):
    lab = load(stubs=True)
    ex = exercises.Lab("03_test_unfinished")
    assert ex.grade("3.2", "the K loop", graders.check_matmul, lab.matmul, DEVICE, uses=[lab.matmul_kernel]) is False
    assert ex.grade("3.4", "TF32", graders.check_tf32_round, lab.tf32_round, DEVICE, uses=[lab.tf32_round_kernel]) is False
    assert ex.grade("3.1", "intensity", graders.check_intensity, lab.intensity) is False
    for matmul in (lab.matmul, lab.triton_matmul):
        with pytest.raises(NotImplementedError, match="exercise not done: 3.2"):
            matmul(torch.randn(4, 4), torch.randn(4, 4))
    assert capsys.readouterr().out.count("NOT DONE: exercise 3.") == 3


def test_through_papermill_an_alternative_passes_then_a_wrong_k_loop_stops_with_its_hint(tmp_path, build_dir):
    nb, error = run_lab_with("03", {"3.1": "return matmul_flops(n, n, n) / matmul_bytes(n, n, n)",
                                    "3.2": K_LOOP_WRONG["pointers never move"][0]}, tmp_path)
    text = stream_text(nb)
    assert "PASS: exercise 3.1 (FLOP per byte of a square matmul)" in text
    assert error and error[0] == "ExerciseFailed" and "several K steps" in error[1] and "move both pointers" in error[1]
    assert len(errors(nb)) == 1


# --- FP8: exercise 3.6 (quantize with a scale), 3.7 (the scaled epilogue), fp8_matmul's contract ------------------

QUANT_REFERENCE = """
fmax = torch.finfo(dtype).max
xf = x.float()
magnitude = torch.where(xf.isfinite(), xf.abs(), 0.0)
amax = magnitude.amax(dim=1, keepdim=True) if row_wise else magnitude.amax()
scale = torch.where(amax > 0, amax / fmax, 1.0)
return (xf / scale).clamp(-fmax, fmax).to(dtype), scale
"""
QUANT_RIGHT = {
    "nan-aware max, reciprocal multiply": """
info = torch.finfo(dtype)
v = x.to(torch.float32)
m = torch.nan_to_num(v.abs(), nan=0.0)
amax = m.max(dim=-1, keepdim=True).values if row_wise else m.max()
scale = (amax / info.max).clamp_min(torch.finfo(torch.float32).tiny)
q = torch.clamp(v * (1.0 / scale), info.min, info.max).to(dtype)
return q, scale.float()
""",
    "power-of-two scales (MX style)": """
fmax = torch.finfo(dtype).max
xf = x.float()
amax = torch.where(torch.isnan(xf), torch.zeros_like(xf), xf.abs())
amax = amax.amax(1, keepdim=True) if row_wise else amax.amax()
scale = torch.exp2(torch.ceil(torch.log2(amax / fmax)))
scale = torch.where(amax == 0, torch.ones_like(scale), scale)
return torch.clamp(xf / scale, -fmax, fmax).to(dtype), scale
""",
}
QUANT_WRONG = {   # answer code: the hints it must get
    "e4m3fn's max for every dtype": (QUANT_REFERENCE.replace("torch.finfo(dtype).max", "448.0"), "448 is e4m3fn's largest"),
    "scale inverted": (QUANT_REFERENCE.replace("amax / fmax, 1.0", "fmax / amax, 1.0").replace("xf / scale", "xf * scale"),
                       "max / amax"),
    "no guard for zeros": (QUANT_REFERENCE.replace("torch.where(amax > 0, amax / fmax, 1.0)", "amax / fmax"), "a row of zeros"),
    "NaN in the amax": (QUANT_REFERENCE.replace("torch.where(xf.isfinite(), xf.abs(), 0.0)", "xf.abs()"), "poison",
                        ) if False else (QUANT_REFERENCE.replace("torch.where(xf.isfinite(), xf.abs(), 0.0)", "xf.abs()"),
                                         "NaN in x made the amax NaN"),
    "per column": (QUANT_REFERENCE.replace("amax(dim=1, keepdim=True)", "amax(dim=0, keepdim=True)"), "scale has shape"),
    "scale without its dimension": (QUANT_REFERENCE.replace("dim=1, keepdim=True", "dim=1"), "keepdim=True"),
    "no clamp": (QUANT_REFERENCE.replace(".clamp(-fmax, fmax)", "").replace("amax / fmax", "amax / fmax * 0.9"),
                 "clipped"),
    "NaN zeroed": (QUANT_REFERENCE.replace("(xf / scale)", "(xf.nan_to_num(0.0) / scale)"), "NaN must stay NaN"),
    "the values left as float": (QUANT_REFERENCE.replace(".to(dtype), scale", ", scale"), "cast it"),
    "a wasted range": (QUANT_REFERENCE.replace("amax / fmax, 1.0", "amax / 16, 1.0"), "below half the format's max"),
    "scale in bfloat16": (QUANT_REFERENCE.replace("return (xf / scale)", "scale = scale.bfloat16()\nreturn (xf / scale.float())"),
                          "must be float32"),
    "changes x": (QUANT_REFERENCE.replace("xf = x.float()", "xf = x.float()\nx.zero_()"), "changed"),
}


def test_grader_3_6_reference_and_alternatives(lab):
    graders.check_fp8_quantize(lab.quantize_fp8, DEVICE)
    for name, code in QUANT_RIGHT.items():
        graders.check_fp8_quantize(load({"3.6": code}).quantize_fp8, DEVICE)


@pytest.mark.parametrize("mistake", QUANT_WRONG, ids=list(QUANT_WRONG))
def test_grader_3_6_known_wrong(mistake):
    code, *hint = QUANT_WRONG[mistake]
    fails_with(lambda: graders.check_fp8_quantize(load({"3.6": code}).quantize_fp8, DEVICE), *hint)


@pytest.mark.parametrize("stubs", [False, True], ids=["solution", "the learner's stub"])
def test_quantize_fp8_refuses_a_dtype_that_is_not_fp8_and_an_empty_or_1d_x(stubs):
    """float32 came back as a float32 "q"; an empty x or a vector failed inside amax. The checks come before the
    exercise, so the learner's lab has them too."""
    quantize_fp8 = load(stubs=stubs).quantize_fp8
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        with pytest.raises(ValueError, match=f"dtype={dtype}: quantize to an FP8 dtype, torch.float8_e4m3fn"):
            quantize_fp8(torch.randn(2, 7), dtype=dtype)
    for x, row_wise in ((torch.randn(0, 7), False), (torch.randn(5, 0), True), (torch.randn(7), True),
                        (torch.randn(7), False)):
        with pytest.raises(ValueError, match=re.escape(f"x has shape {tuple(x.shape)}: quantize_fp8 takes a non-empty "
                                                       "M x K matrix")):
            quantize_fp8(x, row_wise)


EPILOGUE_REFERENCE = """
if ROW_WISE:
    out = acc * tl.load(sa_ptr + offs_m)[:, None] * tl.load(sb_ptr + offs_n)[None, :]
else:
    out = acc * tl.load(sa_ptr) * tl.load(sb_ptr)
"""
EPILOGUE_RIGHT = """
if ROW_WISE:
    sa = tl.load(sa_ptr + offs_m)
    sb = tl.load(sb_ptr + offs_n)
    out = acc * (sa[:, None] * sb[None, :])
else:
    scale = tl.load(sa_ptr) * tl.load(sb_ptr)
    out = scale * acc
"""
EPILOGUE_WRONG = {
    "no scales": ("out = acc + 0.0", "the scales are missing"),
    "scale_a only": (EPILOGUE_REFERENCE.replace(" * tl.load(sb_ptr + offs_n)[None, :]", "").replace(" * tl.load(sb_ptr)", ""),
                     "only scale_a"),
    "divided": (EPILOGUE_REFERENCE.replace("acc * tl.load(sa_ptr + offs_m)[:, None] * tl.load(sb_ptr + offs_n)[None, :]",
                                           "acc / tl.load(sa_ptr + offs_m)[:, None] / tl.load(sb_ptr + offs_n)[None, :]")
                .replace("acc * tl.load(sa_ptr) * tl.load(sb_ptr)", "acc / tl.load(sa_ptr) / tl.load(sb_ptr)"), "divided"),
    "row-wise with the first scale only": ("out = acc * tl.load(sa_ptr) * tl.load(sb_ptr)", "one scale for every row"),
    "rows and columns swapped": (EPILOGUE_REFERENCE.replace("tl.load(sa_ptr + offs_m)[:, None] * tl.load(sb_ptr + offs_n)[None, :]",
                                                            "tl.load(sa_ptr + offs_n)[None, :] * tl.load(sb_ptr + offs_m)[:, None]"),
                                 "scale_a went along the columns"),
}


def test_grader_3_7_reference_and_alternative(lab):
    graders.check_fp8_matmul(lab.fp8_matmul, DEVICE)
    graders.check_fp8_matmul(load({"3.7": EPILOGUE_RIGHT}).fp8_matmul, DEVICE)


@pytest.mark.parametrize("mistake", EPILOGUE_WRONG, ids=list(EPILOGUE_WRONG))
def test_grader_3_7_known_wrong(mistake):
    code, *hint = EPILOGUE_WRONG[mistake]
    fails_with(lambda: graders.check_fp8_matmul(load({"3.7": code}).fp8_matmul, DEVICE), *hint)


def test_fp8_matmul_matches_scaled_mm_and_refuses_what_scaled_mm_refuses(lab):
    """fp8_matmul against torch._scaled_mm (same operands, both scaling modes), and a ValueError naming the problem
    for the other dialect, a mixed scaling, a wrong scale shape or dtype, and an out_dtype _scaled_mm does not take."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(48, 64, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    b = torch.randn(32, 64, generator=gen).to(torch.float8_e4m3fn).to(DEVICE).T
    for sa, sb in ((torch.tensor(0.5), torch.tensor(3.0)), (torch.rand(48, 1, generator=gen), torch.rand(1, 32, generator=gen))):
        sa, sb = sa.to(DEVICE), sb.to(DEVICE)
        want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
        got = lab.fp8_matmul(a, b, sa, sb).float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2
    one = torch.tensor(1.0, device=DEVICE)
    other = torch.float8_e4m3fnuz if DEVICE == "cpu" or not torch.version.hip else torch.float8_e4m3fn
    for args, message in (((a.to(other) if False else a.float().to(other), b, one, one), "dialect"),
                          ((a, b, torch.ones(48, 1, device=DEVICE), one), "both per tensor, or both row-wise"),
                          ((a, b, torch.ones(47, 1, device=DEVICE), torch.ones(1, 32, device=DEVICE)), "shape (48, 1)"),
                          ((a, b, one.double(), one), "float32"),
                          ((a, b.T, one, one), "a's columns must equal b's rows"),
                          ((a.float(), b, one, one), "quantize it to")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            lab.fp8_matmul(*args)
    with pytest.raises(ValueError, match="out_dtype"):
        lab.fp8_matmul(a, b, one, one, torch.float8_e4m3fn)
    assert lab.fp8_matmul(a[:0], b, one, one).shape == (0, 32)
    assert lab.fp8_matmul(a[:, :0], b[:0], one, one).abs().sum() == 0


def test_fp8_formats_read_off_their_bits():
    from utils import fp8

    want = {"float8_e4m3fn": (448.0, 7, 2, 0, True), "float8_e4m3fnuz": (240.0, 8, 1, 0, False),
            "float8_e5m2": (57344.0, 15, 6, 2, True), "float8_e5m2fnuz": (57344.0, 16, 1, 0, False)}
    for name, (fmax, bias, nans, infs, negzero) in want.items():
        b = fp8.FORMATS[name].bits()
        assert (b["max"], b["bias"], b["nan_patterns"], b["infinities"], b["negative_zero"]) == (fmax, bias, nans, infs, negzero)
    assert [fp8.dialect_of(a) for a in ("sm_90", "gfx942", "gfx950", "gfx90a", "sm_80", "cpu")] == \
        ["ocp", "fnuz", "ocp", None, None, "ocp"]
    assert fp8.FORMATS["float8_e4m3fn"].triton_name == "fp8e4nv" and fp8.FORMATS["float8_e4m3fnuz"].triton_name == "fp8e4b8"


# --- FP4 (section 10): quantize_fp4 against gguf's bytes, on awkward blocks -------------------------------

def fp4_values(lab, codes):
    return lab.E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)


def test_fp4_rounds_to_nearest_ties_to_even_and_saturates(lab):
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, -0.75, -5.0, -0.1, 0.26, 4.9, 0.0, -0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -4.0, 0.0, 0.5, 4.0, 0.0, 0.0]
    codes = lab.to_e2m1(v)
    assert fp4_values(lab, codes).tolist() == want
    assert codes[12] == 0 and codes[16] == 0            # what rounds to zero is +0, as gguf writes it


def fp4_case_matrix(gen):
    """Rows of awkward blocks: zeros, one huge value, tiny values near E8M0's and e4m3's floors, negatives only,
    a block at a power of two and one just below the next (E2M1 saturates), beside Gaussian rows."""
    w = torch.randn(8, 64, generator=gen) * 0.02
    w[0] = 0
    w[1, 5] = 3e4
    w[2] = torch.randn(64, generator=gen) * 1e-30
    w[3] = -w[3].abs()
    w[4, :32] = 1.0
    w[4, 32:] = torch.linspace(-7.9, 7.9, 32)
    return w


@pytest.mark.parametrize("fmt", ["MXFP4", "NVFP4"])
def test_fp4_bytes_read_by_gguf_are_the_values_and_mxfp4_matches_its_quantizer(lab, fmt):
    import numpy as np

    from utils import blocks

    gen = torch.Generator().manual_seed(4)
    for w in (fp4_case_matrix(gen), torch.randn(16, 256, generator=gen) * 5):
        codes, scale, tensor_scale = lab.quantize_fp4(w, fmt)
        values = lab.dequantize_fp4(codes, scale, tensor_scale)
        if fmt == "MXFP4":
            sbytes = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8).numpy()
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)       # powers of two
        else:
            assert scale.max() <= 448 and torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)
            sbytes = scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        packed = blocks.fp4_bytes(codes.numpy(), sbytes, fmt)
        assert np.array_equal(blocks.dequantize(packed, fmt) * tensor_scale.item(), values.numpy())
        if fmt == "MXFP4" and w.shape[0] == 16:      # no exact ties among random float32 values
            assert np.array_equal(packed, blocks.quantize(w.numpy(), "MXFP4"))
        # each value is the nearest grid point its block's step allows (or saturated at 6 steps)
        block = 32 if fmt == "MXFP4" else 16
        step = (scale * tensor_scale).repeat_interleave(block, dim=1)
        # an NVFP4 block far below the tensor's largest value gets an e4m3 scale of 0 (below its smallest
        # subnormal, 2^-9): the format holds it as zeros
        lost = step == 0
        assert torch.all(values[lost] == 0)
        if lost.any():
            assert fmt == "NVFP4" and w[lost].abs().max() / 6 / tensor_scale < 2.0**-10
        step = torch.where(lost, 1.0, step)
        grid = torch.cat([-lab.E2M1.flip(0), lab.E2M1])
        nearest = (w[..., None] / step[..., None] - grid).abs().min(dim=-1).values * step
        assert torch.all(((values - w).abs() <= nearest + 1e-5 * step) | lost)
    assert lab.dequantize_fp4(*lab.quantize_fp4(torch.zeros(2, 32), fmt)).abs().sum() == 0


def test_fp4_refuses_what_it_cannot_hold(lab):
    from utils import blocks

    with pytest.raises(ValueError, match="no NaN or infinity"):
        lab.quantize_fp4(torch.tensor([[float("nan")] * 32]), "MXFP4")
    with pytest.raises(ValueError, match="no NaN or infinity"):
        lab.quantize_fp4(torch.full((1, 32), 1e300, dtype=torch.float64), "MXFP4")     # inf once float32
    for shape, fmt in (((1, 20), "MXFP4"), ((2, 48), "MXFP4"), ((40,), "NVFP4"), ((2, 2, 16), "NVFP4")):
        with pytest.raises(ValueError, match=r"rows of whole (32|16)-value blocks"):
            lab.quantize_fp4(torch.ones(shape), fmt)
    with pytest.raises(ValueError, match="NVFP4 quantizer"):
        blocks.quantize(torch.ones(1, 64).numpy(), "NVFP4")
    with pytest.raises(ValueError, match="packs MXFP4 or NVFP4"):
        blocks.fp4_bytes(torch.zeros(1, 32, dtype=torch.uint8).numpy(), torch.zeros(1, 1, dtype=torch.uint8).numpy(), "Q4_0")
    with pytest.raises(ValueError, match="random_blocks"):
        blocks.random_blocks("MXFP4", 2)
    assert blocks.MXFP4.bits_per_weight == 4.25 and blocks.NVFP4.bits_per_weight == 4.5
    from utils.quant import llamacpp

    for f in blocks.FP4_FORMATS.values():
        assert llamacpp.quant_size(f.name) == (f.block, f.nbytes)


def test_quantize_fp4_refuses_another_format_name_and_an_empty_x(lab):
    """Any fmt but "MXFP4" was quantized as NVFP4; an empty x failed in reshape or amax."""
    for fmt in ("mxfp4", "FP4", "", None, "NVFP4 "):
        with pytest.raises(ValueError, match=f"fmt={fmt!r}: use 'MXFP4' .* or 'NVFP4'"):
            lab.quantize_fp4(torch.randn(2, 64), fmt)
    for shape, fmt in (((0, 64), "MXFP4"), ((0, 64), "NVFP4"), ((2, 0), "NVFP4")):
        with pytest.raises(ValueError, match=r"rows of whole (32|16)-value blocks, at least one .*got "
                                             + re.escape(str(shape))):
            lab.quantize_fp4(torch.ones(shape), fmt)


def test_dequantize_fp4_refuses_codes_above_15_and_a_scale_that_does_not_fit(lab):
    """A code of 16 was read as 0 (its low 4 bits); a scale of the wrong shape failed in reshape, or was spread over
    blocks of another size."""
    codes, scale, tensor_scale = lab.quantize_fp4(torch.randn(2, 64), "NVFP4")
    for bad in (codes + 16, codes.to(torch.int64) - 16):
        with pytest.raises(ValueError, match="codes must be uint8 E2M1 codes 0-15"):
            lab.dequantize_fp4(bad, scale, tensor_scale)
    for s, c in ((scale[:, :3], codes), (scale[:1], codes), (scale[:, :0], codes), (scale, codes[:, :40]),
                 (torch.ones(2, 4), torch.zeros(2, 65, dtype=torch.uint8))):
        fits = f"scale {tuple(s.shape)} does not fit codes {tuple(c.shape)}: one scale per 32 (MXFP4) or 16 (NVFP4)"
        with pytest.raises(ValueError, match=re.escape(fits)):
            lab.dequantize_fp4(c, s, tensor_scale)
    assert lab.dequantize_fp4(codes, scale, tensor_scale).shape == (2, 64)


FP8_GRID_SIZES = [(1, 32, 16), (17, 48, 32), (33, 17, 64), (64, 64, 17), (129, 80, 112), (127, 4096, 129),
                  (4096, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
def test_fp8_matmul_upstream_style_grid_on_gpu(lab):
    """fp8_matmul on a grid in the manner of PyTorch's own _scaled_mm tests (test_matmul_cuda.py): sizes from 1 and
    odd ones to 4096, both scaling modes, every out_dtype, B column-major (the fast layout) and row-major, A as a
    transposed view, scales of very different sizes; against the float64 product of the dequantized operands, and
    against torch._scaled_mm wherever it takes the case. No crash, no silent wrong result."""
    from utils import fp8

    e4m3 = fp8.e4m3_of(fp8.arch_of(DEVICE))
    sizes = FP8_GRID_SIZES
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-3}
    failures, count, compared = [], 0, 0
    for (m, n, k), row_wise, out_dtype, b_layout, a_t in itertools.product(
            sizes, (False, True), (torch.bfloat16, torch.float16, torch.float32), ("col", "row"), (False, True)):
        # each case compiles its own specialization: the rarer combinations on the small sizes only
        rare = a_t or out_dtype == torch.float16
        if a_t and b_layout == "row" or (rare and m * n * k > 1e6) or (m * n * k > 1e9 and out_dtype != torch.bfloat16):
            continue
        count += 1
        gen = torch.Generator(device=DEVICE).manual_seed(count)
        a = (torch.randn(k, m, device=DEVICE, generator=gen).T if a_t else torch.randn(m, k, device=DEVICE, generator=gen))
        b = torch.randn(n, k, device=DEVICE, generator=gen).T if b_layout == "col" else torch.randn(k, n, device=DEVICE, generator=gen)
        qa, qb = a.clamp(-400, 400).to(e4m3), b.clamp(-400, 400).to(e4m3)
        if row_wise:
            sa = torch.rand(m, 1, device=DEVICE, generator=gen) * 1e3 + 1e-3
            sb = torch.rand(1, n, device=DEVICE, generator=gen) * 1e-3 + 1e-6
        else:
            sa, sb = torch.tensor(3.5e2, device=DEVICE), torch.tensor(2.0e-4, device=DEVICE)
        ref = (qa.double() * sa.double()) @ (qb.double() * sb.double())
        what = f"{m}x{n}x{k} {'rows' if row_wise else 'tensor'} {str(out_dtype)[6:]} b {b_layout}{' a^T' if a_t else ''}"
        try:
            c = lab.fp8_matmul(qa, qb, sa, sb, out_dtype)
        except Exception as err:  # noqa: BLE001 - a crash is a failure to report, with the case
            failures.append(f"{what}: raised {type(err).__name__}: {str(err)[:120]}")
            continue
        err = ((c.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
        if c.shape != (m, n) or c.dtype != out_dtype or not c.is_contiguous() or not err < tol[out_dtype]:
            failures.append(f"{what}: shape {tuple(c.shape)} {c.dtype}, error {err:.2e}")
            continue
        try:
            want = torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        except (RuntimeError, ValueError):
            continue                                  # a case _scaled_mm refuses (layout, alignment)
        compared += 1
        gap = ((c.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()
        if not gap < 2 * tol[out_dtype]:
            failures.append(f"{what}: {gap:.2e} from torch._scaled_mm")
    print(f"fp8_matmul grid: {count - len(failures)} of {count} cases right, {compared} also against torch._scaled_mm")
    assert not failures, failures[:10]


def test_fp8_matmul_tma_tiles_fit_hoppers_shared_memory_for_every_out_dtype(lab):
    """The Hopper (TMA) tile at the stages fp8_config gives, compiled for sm_90 ahead of time with each out_dtype's C
    descriptor, fits the 227 KiB a block may take (the H200 refused the float32 C at 5 stages: 248 KiB)."""
    from utils import isa

    limit = 227 * 1024
    bm, bn, bk, *_ = lab.FP8_CONFIGS["tma"]
    shared = {}
    jobs = []
    for out, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        *_, warps, stages = lab.fp8_config("tma", out)
        sig = {"a_desc": f"tensordesc<fp8e4nv[{bm},{bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn},{bk}]>",
               "c_desc": f"tensordesc<{name}[{bm},{bn}]>", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
               "M": "i32", "N": "i32", "K": "i32"}
        jobs.append(dict(signature=sig, target="sm_90", num_warps=warps, num_stages=stages,
                         constexprs={"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PROGRAMS": 132,
                                     "A_T": False, "B_T": True, "ROW_WISE": True}))
    for (name, job), built in zip(zip(("bf16", "fp16", "fp32"), jobs), isa.compile_triton_many(lab.tma_fp8_matmul_kernel, jobs)):
        assert not isinstance(built, Exception), built
        shared[name] = json.loads(built["metadata"].text)["shared"]
    assert all(v <= limit for v in shared.values()), shared
    assert lab.fp8_config("tma", torch.float32)[-1] < lab.FP8_CONFIGS["tma"][-1]


def test_fp8_grader_scales_keep_every_mistake_apart_from_the_right_product():
    """Per tensor, the factors each epilogue slip computes (no scale, scale_a only, scale_b only, divided) and the
    right one are pairwise at least 1.4x apart for any seed, so each slip gets its own hint (a scale_b of 1.06 once
    sent "scale_a only" to the generic hint, and sa * sb^2 near 1 sent "divided" to "scale_b only")."""
    import math

    for seed in range(3000):
        sa, sb = graders._fp8_scales(torch.Generator().manual_seed(seed), 4, 4, False)
        sa, sb = float(sa), float(sb)
        products = [1.0, sa, sb, 1 / (sa * sb), sa * sb]     # each mistake's factor, and the right one last
        logs = [math.log2(p) for p in products]
        assert all(abs(x - y) >= 0.48 for i, x in enumerate(logs) for y in logs[i + 1:]), (seed, sa, sb)
        ra, rb = graders._fp8_scales(torch.Generator().manual_seed(seed), 5, 3, True)
        assert abs(math.log2(float(ra[0, 0] * rb[0, 0]))) >= 0.48, seed    # "first scale only" is not "no scales"
