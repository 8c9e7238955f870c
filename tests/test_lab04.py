"""Lab 04: the attention kernel right on every input, its errors, its machine code on both vendors, and the graders.

On a CPU (Triton's interpreter): a seeded covering grid (every head dim, layout, dtype, size and mask), tile shapes,
the errors, ahead-of-time builds for gfx942 and sm_90 at every head dim (shared memory within each GPU's limit), and
for every exercise the reference, other right answers and known-wrong ones, through the graders in
utils/graders/lab04.py (which also hold the seeded inputs and the tolerance). On a GPU (`@pytest.mark.gpu`): the full
grid, every combination, sizes to 4096. Tolerance: flash-attn's rule (`within_tolerance`).
"""
import contextlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

import pytest
import torch

from utils import record, solutions
from utils.base.paths import REPO_ROOT

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
HEAD_DIMS = (16, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256)    # those public models use
DTYPES = (torch.bfloat16, torch.float16)


if not GPU:
    # Triton decides at the first import of triton.language whether its own functions are compiled or interpreted:
    # on a CPU the whole process interprets (as a notebook does), so this is set before anything imports it.
    os.environ["TRITON_INTERPRET"] = "1"

from utils.graders import lab04 as graders   # noqa: E402  (imports triton: after TRITON_INTERPRET is set)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401  (a @triton.jit function below sees it, as in a lab)
from utils import grading_guard  # noqa: E402


def load(**kwargs):
    """The lab's exported module: compiled kernels on a GPU, Triton's interpreter on a CPU."""
    module = solutions.load("04", **kwargs)
    if not GPU and type(module.flash_attention).__name__ != "InterpretedFunction":
        raise RuntimeError("triton.language was imported in this process before TRITON_INTERPRET=1 was set: run "
                           "tests/test_lab04.py in a process of its own (pytest tests/test_lab04.py)")
    return module


@pytest.fixture(scope="module")
def lab():
    return load()


def run_case(lab, d, layout, dtype, n, causal, batch=2, heads=2, attention=None, **kwargs):
    """(ok, error, allowed) of one input against the fp32 reference, by flash-attn's rule."""
    q, k, v = graders.make_inputs(batch, heads, n, d, layout, dtype, DEVICE, seed=zlib.crc32(repr((d, layout, n, causal)).encode()) % 1000)
    out = (attention or lab.triton_attention)(q, k, v, causal, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    return graders.within_tolerance(out, q, k, v, causal, kwargs.get("sm_scale"))


# --- the covering grid (CPU) -------------------------------------------------------------------------

def covering_grid(layouts):
    """Every head dim twice (masked and not), the layouts, dtypes and sizes cycling through them, so that every
    value of every dimension and every (layout, mask) pair occurs; plus N=1025 at D=64 in a model's layout."""
    cases = []
    for i, d in enumerate(HEAD_DIMS):
        for j, causal in enumerate((False, True)):
            k = 2 * i + j
            cases.append((d, layouts[(k // 2 + j) % len(layouts)], DTYPES[k // 3 % 2], (1, 17, 97)[k % 3], causal))
    cases += [(64, "model", torch.bfloat16, 1025, False), (64, "model", torch.float16, 1025, True)]
    return cases


def test_the_covering_grid_covers(lab):
    cases = covering_grid(graders.LAYOUTS)
    for index, values in ((0, HEAD_DIMS), (1, graders.LAYOUTS), (2, DTYPES), (3, (1, 17, 97, 1025)), (4, (False, True))):
        assert {c[index] for c in cases} == set(values)
    assert {(c[1], c[4]) for c in cases} == set(itertools.product(graders.LAYOUTS, (False, True)))
    assert {(c[3], c[4]) for c in cases} >= set(itertools.product((1, 17, 97), (False, True)))


def test_covering_grid(lab, capsys):
    """Every case within tolerance; prints the pass count (the 1025 cases run one head: the interpreter is slow)."""
    failed, cases, start = [], covering_grid(graders.LAYOUTS), time.time()
    for d, layout, dtype, n, causal in cases:
        size = dict(batch=1, heads=1) if n > 200 else {}
        ok, err, allowed = run_case(lab, d, layout, dtype, n, causal, **size)
        if not ok:
            failed.append(f"D={d} {layout} {dtype} N={n} causal={causal}: error {err:.3g} > {allowed:.3g}")
    with capsys.disabled():
        print(f"\nlab 04 covering grid ({DEVICE}): {len(cases) - len(failed)} of {len(cases)} pass "
              f"in {time.time() - start:.0f} s")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("tiles", [dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=16),
                                   dict(BLOCK_M=64, BLOCK_N=64), dict(BLOCK_M=128, BLOCK_N=64)],
                         ids=lambda t: f"{t['BLOCK_M']}x{t['BLOCK_N']}")
def test_tile_shapes_the_gpus_use(lab, tiles):
    """The causal split is right whatever the ratio of BLOCK_M to BLOCK_N, ragged or not."""
    for n, causal in ((200, True), (200, False), (128, True)):
        ok, err, allowed = run_case(lab, 64, "contiguous", torch.bfloat16, n, causal, batch=1, heads=1,
                                    attention=lab.portable_attention, config=tiles)
        assert ok, f"N={n} causal={causal}: {err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("sm_scale", [0.05, 1.0, -0.3, 0])
def test_sm_scale(lab, sm_scale):
    ok, err, allowed = run_case(lab, 48, "contiguous", torch.bfloat16, 33, True, sm_scale=sm_scale)
    assert ok, f"{err:.3g} > {allowed:.3g}"


def test_large_scores_and_a_huge_stride(lab):
    """Scores of hundreds (the running max must keep exp2 finite), and a row stride too large for 32-bit tile
    offsets (the wrapper copies that tensor)."""
    q, k, v = graders.make_inputs(1, 2, 50, 64, "contiguous", torch.bfloat16, DEVICE, seed=3)
    q = (q * 30).to(torch.bfloat16)
    ok, err, allowed = graders.within_tolerance(lab.triton_attention(q, k, v, True), q, k, v, True)
    assert ok, f"{err:.3g} > {allowed:.3g}"
    wide = torch.randn(1, 1, 3, lab.BIG_STRIDE + 64, dtype=torch.bfloat16, device=DEVICE)
    q = k = v = wide[..., :64]
    ok, err, allowed = graders.within_tolerance(lab.triton_attention(q, k, v), q, k, v)
    assert ok, f"{err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("d, layout, n, causal", [(80, "model", 97, True), (64, "kv_broadcast", 17, False),
                                                 (256, "head_dim_slice", 1, True), (40, "contiguous", 70, False)])
def test_the_tma_kernel(lab, d, layout, n, causal):
    """`flash_attention_tma` (tensor descriptors; zeros past the tensor's end and head dim, clipped stores) on a few
    awkward inputs: under the interpreter on a CPU, on the GPU's TMA unit on an H100."""
    if GPU and lab.why_not_hopper(*graders.make_inputs(1, 2, n, d, layout, device=DEVICE)) is not None:
        pytest.skip("the TMA path needs compute capability 9.x")
    ok, err, allowed = run_case(lab, d, layout, torch.bfloat16, n, causal, batch=1, heads=2,
                                attention=lab.hopper_attention, config=None if GPU else dict(BLOCK_M=32, BLOCK_N=16))
    assert ok, f"{err:.3g} > {allowed:.3g}"


def exact_attention(q, k, v, causal, sm_scale=None):
    """softmax(q kᵀ · sm_scale) v in float64, masking by -inf before the softmax: not graders.reference, whose SDPA
    math backend lets a NaN in a masked (future) key into every row."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("kernel", ["hopper_attention", "triton_attention"])
def test_a_masked_key_gets_no_weight_whatever_its_score(lab, kernel):
    """Scores far past any finite mask value: a key past the end (zeros from the TMA unit) must not win over real
    scores below -1e6, a future key above them must not leak into a causal row, and a NaN in a future key must not
    reach an earlier row (an additive mask, s + -1e6, fails all three; tl.where(keep, s, -inf) does not)."""
    attention = getattr(lab, kernel)
    config = {} if GPU or kernel == "triton_attention" else dict(config=dict(BLOCK_M=32, BLOCK_N=16))
    if GPU and kernel == "hopper_attention" and lab.why_not_hopper(*graders.make_inputs(1, 1, 65, 64, device=DEVICE)):
        pytest.skip("the TMA path needs compute capability 9.x")
    g = torch.Generator().manual_seed(5)
    v = torch.randn(1, 1, 65, 64, generator=g).to(DEVICE, torch.float16)
    q = torch.full((1, 1, 65, 64), 300.0).to(DEVICE, torch.float16)
    out = attention(q, -q, v, False, **config)                  # every real score is -5.76e6 x sm_scale
    assert (out.double() - exact_attention(q, -q, v, False)).abs().max() < 1e-2
    q, k = ((torch.randn(1, 1, 65, 64, generator=g) * 1000).to(DEVICE, torch.float16) for _ in range(2))
    out = attention(q, k, v, True, **config)
    assert (out.double() - exact_attention(q, k, v, True)).abs().max() < 1e-2
    q, k = (torch.randn(1, 1, 65, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    k[0, 0, 40, 0] = float("nan")
    out = attention(q, k, v, True, **config)
    assert not out[0, 0, :40].isnan().any() and out[0, 0, 40:].isnan().all()
    assert (out[0, 0, :40].double() - exact_attention(q, k, v, True)[0, 0, :40]).abs().max() < 1e-2


def test_a_negative_sm_scale_runs_the_portable_kernel(lab):
    """The TMA kernel takes each row's max before it scales (one fused multiply-add per score): right for
    sm_scale >= 0 only, so hopper_attention refuses a negative one and triton_attention runs the portable kernel."""
    q, k, v = graders.make_inputs(1, 1, 65, 128, "contiguous", torch.bfloat16, DEVICE, seed=4)
    with pytest.raises(ValueError, match="sm_scale >= 0"):
        lab.hopper_attention(q, k, v, sm_scale=-30.0)
    out = lab.triton_attention(q, k, v, sm_scale=-30.0)
    assert (out.double() - exact_attention(q, k, v, False, -30.0)).abs().max() < 2e-2


# --- the dispatch: which kernel and tiles triton_attention runs ---------------------------------------------

def on_table_gpu(lab) -> bool:
    return GPU and not torch.version.hip and "{}.{}".format(*torch.cuda.get_device_capability()) == \
        lab.DISPATCH["capability"]


def test_the_dispatch_table_is_whole(lab):
    """utils/data/lab04_dispatch.json: per shape measured, valid tiles for each kernel and which was fastest, the
    headline with both masks among them; `dispatch_entry` finds each entry at its own shape."""
    table = lab.DISPATCH
    assert table["capability"] and table["date"] and table["triton"] and table["device"]
    shapes = {(e["B"], e["H"], e["N"], e["D"], e["causal"]) for e in table["entries"]}
    assert {(4, 32, 4096, 128, False), (4, 32, 4096, 128, True)} <= shapes
    for e in table["entries"]:
        assert e["fastest"] in ("hopper", "portable") and "portable" in e and e["fastest"] in e, e
        for path in ("hopper", "portable"):
            if path in e:
                lab.check_config(e[path])
        assert lab.dispatch_entry(e["B"], e["H"], e["N"], e["D"], e["causal"]) is e


def test_the_nearest_entry_has_the_same_mask_and_padded_head_dim(lab):
    for batch, heads, n, d, causal in ((3, 20, 3000, 120, True), (1, 2, 100, 72, False), (2, 4, 50, 200, True)):
        e = lab.dispatch_entry(batch, heads, n, d, causal)
        if e is not None:
            assert e["causal"] == causal and max(16, 1 << (e["D"] - 1).bit_length()) == max(16, 1 << (d - 1).bit_length())
    assert lab.dispatch_entry(1, 2, 100, 16, True) is None or lab.dispatch_entry(1, 2, 100, 16, True)["D"] <= 16


@pytest.mark.skipif(GPU, reason="the CPU's rule")
def test_off_the_tables_gpu_the_interpreter_runs_the_portable_kernel(lab):
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    assert lab.choose(q, q, q, True) == ("portable", lab.attention_configs(64, "interpreter"))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_the_dispatch_runs_each_entrys_kernel_and_is_right(lab, causal):
    """On the table's GPU, at each shape of the table: `choose` picks the entry's fastest kernel and its tiles (the
    portable kernel's when the TMA kernel cannot take the inputs), and `triton_attention` is right there (the first
    batch and two heads checked), twice (the second call launches the build directly)."""
    if not on_table_gpu(lab):
        pytest.skip("the dispatch table was measured on another GPU")
    for e in [e for e in lab.DISPATCH["entries"] if e["causal"] == causal]:
        q, k, v = (torch.randn(e["B"], e["H"], e["N"], e["D"], device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        path, configs = lab.choose(q, k, v, causal)
        assert (path, configs[0]) == (e["fastest"], e[e["fastest"]]), e
        first, again = lab.triton_attention(q, k, v, causal), lab.triton_attention(q, k, v, causal)
        assert torch.equal(first, again)
        ok, err, allowed = graders.within_tolerance(again[:1, :2], q[:1, :2], k[:1, :2], v[:1, :2], causal)
        assert ok, f"{e}: {err:.3g} > {allowed:.3g}"
        strided = torch.randn(e["B"], e["H"], e["D"], e["N"], device=DEVICE, dtype=torch.bfloat16).transpose(2, 3)
        assert lab.choose(strided, k, v, causal) == ("portable", lab.choose(strided, k, v, causal)[1])
        assert lab.choose(strided, k, v, causal)[1][0] == e["portable"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("layout", graders.LAYOUTS)
def test_a_repeated_call_launches_the_same_build(lab, layout):
    """The second call with the same shape, layout and alignment skips Triton's argument binding (`launch`): the
    same answer, bit for bit, for the wrapper and the portable kernel, in every layout, ragged N, both masks."""
    for causal in (False, True):
        q, k, v = graders.make_inputs(2, 3, 97, 80, layout, device=DEVICE, seed=7)
        for fn in (lab.triton_attention, lab.portable_attention):
            first, again = fn(q, k, v, causal), fn(q, k, v, causal)
            assert torch.equal(first, again), (fn.__name__, causal)
            ok, err, allowed = graders.within_tolerance(again, q, k, v, causal)
            assert ok, f"{fn.__name__} causal={causal}: {err:.3g} > {allowed:.3g}"


def test_the_lab_module_offers_the_graders_tolerance_rule(lab):
    """bench/lab04_*.py read flash-attn's rule from the lab's module; it lives in utils/graders/lab04.py."""
    assert lab.within_tolerance is graders.within_tolerance


def test_empty_inputs(lab):
    for shape in ((1, 2, 0, 64), (0, 2, 5, 64)):
        x = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        assert lab.triton_attention(x, x, x, True).shape == shape


# --- errors ------------------------------------------------------------------------------------------

def bad_inputs():
    x = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    return [
        ("fp32", (x.float(), x.float(), x.float()), {}, "torch.bfloat16 or all torch.float16"),
        ("mixed dtypes", (x, x.half(), x), {}, "torch.bfloat16 or all torch.float16"),
        ("int", (x.int(), x.int(), x.int()), {}, "torch.bfloat16"),
        ("head dim 20", (x[..., :20],) * 3, {}, "multiple of 8 from 16 to 256"),
        ("head dim 8", (x[..., :8],) * 3, {}, "multiple of 8 from 16 to 256"),
        ("head dim 264", (torch.zeros(1, 1, 4, 264, dtype=torch.bfloat16, device=DEVICE),) * 3, {}, "from 16 to 256"),
        ("3-D", (x[0], x[0], x[0]), {}, "must be 4-D"),
        ("shapes", (x, x[:, :1], x[:, :1]), {}, "must have one shape"),
        ("lengths", (x, x[:, :, :4], x[:, :, :4]), {}, "must have one shape"),
        ("devices", (x, x.to("meta"), x.to("meta")), {}, "on one device"),
        ("not a tensor", (x.tolist(), x, x), {}, "must be a torch.Tensor"),
        ("causal", (x, x, x), {"causal": "yes"}, "causal='yes' must be True or False"),
        ("sm_scale nan", (x, x, x), {"sm_scale": float("nan")}, "must be a finite number"),
        ("sm_scale str", (x, x, x), {"sm_scale": "0.1"}, "must be a finite number"),
        ("sm_scale bool", (x, x, x), {"sm_scale": True}, "must be a finite number"),
        ("grad", (x.clone().requires_grad_(), x, x), {}, "forward only"),
    ]


@pytest.mark.parametrize("case", bad_inputs(), ids=lambda c: c[0])
def test_unsupported_inputs_raise_a_clear_value_error(lab, case):
    _, args, kwargs, message = case
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lab.triton_attention(*args, **kwargs)


@pytest.mark.parametrize("config, message", [
    (dict(BLOCK_M=32, BLOCK_N=64), "multiple of BLOCK_N"), (dict(BLOCK_M=48, BLOCK_N=16), "power of two"),
    (dict(BLOCK_M=8, BLOCK_N=8), "power of two from 16"), (dict(BLOCK_M=64), "must be a dict with BLOCK_M and BLOCK_N"),
    (dict(BLOCK_M=64, BLOCK_N=32, num_warps=3), "num_warps=3 must be a power of two"),
    (dict(BLOCK_M=64, BLOCK_N=32, stages=2), "unknown keys"), (None, "must be a dict"),
    (dict(BLOCK_M=64, BLOCK_N=32, maxnreg=300), r"maxnreg=300 \(registers per thread, CUDA\) must be a whole number "
                                                r"from 32 to 255"),
    (dict(BLOCK_M=64, BLOCK_N=32, maxnreg="128"), "maxnreg='128'"), (dict(BLOCK_M=64, BLOCK_N=32, maxnreg=True), "maxnreg"),
])
def test_bad_tiles_raise_a_clear_value_error(lab, config, message):
    with pytest.raises(ValueError, match=message):
        lab.check_config(config)


def test_the_hopper_tiles_for_d128_let_two_blocks_share_an_sm(lab):
    """hopper_configs(128, ...) caps the registers so that two blocks of its warps fit an SM's 65,536 (the shared
    memory side is checked on the compiled kernel: the AOT test below and the lab's section 8); both masks."""
    for causal in (False, True):
        tiles = lab.check_config(lab.hopper_configs(128, causal)[0])
        assert 2 * tiles["maxnreg"] * 32 * tiles["num_warps"] <= 65536, tiles


def test_the_recorded_hopper_profile_is_whole():
    """utils/reference/h100_attention_profile.json, which lab 04 prints: both masks timed against cuDNN in one run,
    the lab's kernel among them and right, and an Nsight Compute profile of the lab's tiles and of cuDNN."""
    profile = record.load_reference("h100_attention_profile")
    assert profile["all_right"] and profile["software"]["triton"] and profile["date"]
    for mask in ("causal=False", "causal=True"):
        row = profile["tflops"][mask]
        assert {"SDPA CUDNN", "lab hopper_attention", "2 CTAs/SM 128x64 s2 r128"} <= set(row)
        assert 0 < row["lab hopper_attention"] / row["SDPA CUDNN"] < 1.5
    for name in ("2_CTAs_SM_128x64_s2_r128_full", "2_CTAs_SM_128x64_s2_r128_causal", "cudnn_full", "cudnn_causal"):
        assert 0 < profile["profiles"][name]["tensor_pipe_pct"] <= 100, name


# --- machine code: every head dim fits both vendors' GPUs ---------------------------------------------

AOT = textwrap.dedent("""
    import json, sys
    from utils import solutions
    lab = solutions.load("04")
    target, tma = sys.argv[1].split("+")[0], sys.argv[1].endswith("+tma")
    out = {}
    for d in json.loads(sys.argv[2]):
        for causal in (True, False) if d in (128, 256) else (True,):
            compiled, shared = lab.compile_attention(target, d, causal=causal, tma=tma)
            text = compiled["amdgcn" if target.startswith("gfx") else "ptx"].text
            out[f"{d}{'' if causal else ' full'}"] = [shared, text.count("v_mfma") + text.count("wgmma.mma_async")]
    print(json.dumps(out))
""")


# `make test` compiles a covering subset (an odd head dim, the headline's two blocks per SM, the largest);
# `make test-gpu` every head dim (the three builds take ~100 s on a 2-core machine).
COVERING_HEAD_DIMS = (40, 128, 256)


@pytest.mark.parametrize("dims", [pytest.param(COVERING_HEAD_DIMS, id="covering"),
                                  pytest.param(HEAD_DIMS, id="every", marks=pytest.mark.gpu)])
def test_every_head_dim_compiles_for_gfx942_and_sm_90_within_shared_memory(lab, tmp_path, dims):
    """Triton's ahead-of-time compiler, no GPU needed: the tiles the wrappers launch first fit an MI300X's 64 KiB of
    LDS (portable kernel) and an H100's 227 KiB of shared memory per block (portable and TMA kernels), for each head
    dim, and use the matrix instructions. The three builds run at once, each in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    script = tmp_path / "aot.py"
    script.write_text(AOT)
    procs = {t: subprocess.Popen([sys.executable, str(script), t, json.dumps(dims)], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for t in ("gfx942", "sm_90", "sm_90+tma")}
    for target, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, stderr[-3000:]
        built = json.loads(stdout.strip().splitlines()[-1])
        assert len(built) == len(dims) + 2
        for d, (shared, matrix) in built.items():
            assert 0 < shared <= lab.SHARED_LIMIT[target.split("+")[0]], f"{target} D={d}: {shared} bytes"
            if target == "sm_90+tma" and d.split()[0] == "128":    # two blocks per SM: 228 KB, 1 KB reserved each
                assert 2 * (shared + 1024) <= 228 * 1024, f"D={d}: {shared} bytes leave room for one block per SM"
            assert matrix > 0, f"{target} D={d}: no matrix instructions"


# --- the exercises' graders ----------------------------------------------------------------------------

def grade(checker, *args, build=True):
    """Run a grader of utils/graders/lab04.py; returns None (passed) or the failure's message. build=False: without
    the ahead-of-time builds for sm_90 and gfx942 (a child process, seconds the first time for each kernel), for
    answers whose numbers decide (BUILT lists those graded with them)."""
    from utils.exercises import ExerciseFailed

    unbuilt = contextlib.nullcontext() if build else \
        mock.patch.object(graders, "_building", lambda attention, causal: contextlib.nullcontext())
    try:
        with unbuilt:
            getattr(graders, checker)(*args)
    except ExerciseFailed as err:
        return str(err)
    return None


# The answers graded with the builds for sm_90 and gfx942 too: the references, right answers written differently
# that the build must carry (a helper of their own, one loop), and the mistakes only the compiler sees.
BUILT = {"reference", "alternative: a @triton.jit helper and a constant of its own",
         "alternative: every block masked, one loop"}


@pytest.fixture(scope="module")
def measured():
    """Naive attention's peak memory, measured as the lab measures it."""
    ref = load()
    out = []
    for n in (64, 96):
        q, k, v = (torch.randn(1, 2, n, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
        out.append((1, 2, n, ref.peak_extra_bytes(lambda: ref.naive_attention(q, k, v), DEVICE)))
    return out


PREDICTIONS = {   # answer (None: the reference): None if right, else the parts of the hint it must get
    "reference": (None, None),
    "alternative": ("return 2 * batch * heads * n * n + 2 * (4 * batch * heads * n * n)", None),
    "alternative: numpy, scores counted first": ("import numpy as np\nreturn np.int64(10) * (batch * heads * n ** 2)",
                                                None),
    "wrong: bf16 probabilities instead of the fp32 copy": ("return batch * heads * n * n * (2 + 4 + 2)",
                                                            ("per score", "N x N tensors alive")),
    "wrong: the scores alone": ("return 2 * batch * heads * n * n", ("per score", "N x N tensors alive")),
    "wrong: N x d": ("return 2 * batch * heads * n * 64", ("per score", "N x N tensors alive")),
    "wrong: not a number": ("return None", ("not a number", "N x N tensors alive")),
    # the issue: passed on a CPU, where the lab measures B=1
    "wrong: forgets the batch": ("return heads * n * n * (2 + 4 + 4)",
                                 ("at B=2 H=2", "each sequence of the batch", "does not grow with the batch")),
    "wrong: forgets the heads": ("return batch * n * n * (2 + 4 + 4) * 2",
                                 ("at B=1 H=4", "each head has its own", "does not grow with the heads")),
    "wrong: raises": ("return batch * heads * n * n * (2 + 4 + 4) / d", ("raised NameError", "name 'd'")),
    # issue 46's independent answers: no heads at all fails at the measured H=2, and the hint says so
    "wrong: no heads at all": ("return 10 * batch * n * n", ("at B=1 H=2", "does not grow with the heads")),
    # the issue: a table of the cases an exercise tries (here the measured sizes, and twice their batch and heads)
    "wrong: right only at the sizes checked": ("return batch * heads * n * n * 10 if n in (64, 96) and batch * heads "
                                               "<= 4 else 0", ("drawn for this grade", "not only at the measured")),
}


@pytest.mark.parametrize("name", PREDICTIONS)
def test_grader_4_1(name, measured, monkeypatch):
    monkeypatch.setenv(grading_guard.SEED_VAR, "7")     # a size drawn other than the measured ones (B=3 H=8 N=149)
    answer, hint = PREDICTIONS[name]
    module = load(answers={"4.1": answer}) if answer else load()
    failure = grade("check_prediction", module.predict_peak_bytes, measured)
    if hint:
        assert failure and all(part in failure for part in hint), failure
    else:
        assert failure is None, failure


ONLINE_SOFTMAX = {
    "reference": None,
    "alternative: dot accumulates, other order": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new""",
    "alternative: natural exp": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp((s - m_new[:, None]) * 0.6931471805599453)
        alpha = tl.exp((m_i - m_new) * 0.6931471805599453)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
    "wrong: no rescale by alpha": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
    "wrong: softmax scale (exp of log2 units)": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
    "wrong: running max never kept": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)""",
    "wrong: l_i not rescaled": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
}


ONLINE_SOFTMAX.update({
    "alternative: in-place updates, alpha first": """
        m_new = tl.maximum(tl.max(s, axis=1), m_i)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None]
        acc += tl.dot(p.to(v.dtype), v)
        l_i = alpha * l_i + tl.sum(p, axis=1)
        m_i = m_new""",
    # the issue: without the running max it passed (the scores never spread far; no block was fully masked)
    "wrong: each block's own max, no running max": """
        m_blk = tl.max(s, 1)
        p = tl.math.exp2(s - m_blk[:, None])
        alpha = tl.math.exp2(m_i - m_blk)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_blk""",
    "wrong: no max at all": """
        p = tl.math.exp2(s)
        l_i = l_i + tl.sum(p, 1)
        acc = acc + tl.dot(p.to(v.dtype), v)""",
    "wrong: NaN on a fully masked block": """
        m_blk = tl.max(s, 1)
        m_new = tl.maximum(m_i, m_blk)
        p = tl.math.exp2(s - m_blk[:, None]) * tl.math.exp2(m_blk - m_new)[:, None]
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
    "wrong: a shape slip (v transposed)": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), tl.trans(v))
        m_i = m_new""",
})


@triton.jit
def _rescaled(acc, alpha):
    """A learner's own @triton.jit helper, bound in the lab under another name (the build must carry it)."""
    return acc * alpha[:, None]


def _rescaled_in_python(acc, alpha):
    return acc * alpha[:, None]


ONLINE_SOFTMAX.update({
    "alternative: a @triton.jit helper and a constant of its own": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = rescale_jit(acc, alpha) + tl.dot(p.to(v.dtype), v) * ONE
        m_i = m_new""",
    # the issue: what only a compiler sees (the interpreter runs each; compile_attention refuses it for both GPUs)
    "wrong: tl.dot of FP32 p and BF16 v (the CPU's FP32 copies hide it)": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new""",
    "wrong: acc turned to the inputs' dtype in the loop": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = (acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)).to(v.dtype)
        m_i = m_new""",
    "wrong: a Python helper, not @triton.jit": """
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = rescale_py(acc, alpha) + tl.dot(p.to(v.dtype), v)
        m_i = m_new""",
})
HELPERS = {   # the globals an answer uses, set in its lab module
    "alternative: a @triton.jit helper and a constant of its own": {"rescale_jit": _rescaled,
                                                                    "ONE": tl.constexpr(1.0)},
    "wrong: a Python helper, not @triton.jit": {"rescale_py": _rescaled_in_python},
}
SOFTMAX_HINTS = {   # the hint each wrong answer must get (default: the update's checklist)
    "wrong: tl.dot of FP32 p and BF16 v (the CPU's FP32 copies hide it)": (
        "refuses your kernel for an H100 (sm_90)", "Both operands must be same dtype. Got fp32 and bf16",
        "(at `acc = acc * alpha[:, None] + tl.dot(p, v)`)", "tl.dot(p.to(v.dtype), v)"),
    "wrong: acc turned to the inputs' dtype in the loop": ("refuses your kernel", "Loop-carried variable acc",
                                                           "keep one dtype through the loop"),
    "wrong: a Python helper, not @triton.jit": ("refuses your kernel", "Unsupported function referenced: <function "
                                                "rescale_py>", "only @triton.jit functions"),
    "wrong: each block's own max, no running max": ("spread over hundreds", "never the block's max alone",
                                                    "sm_scale=1"),
    "wrong: no max at all": ("spread over hundreds", "subtract the running max"),
    "wrong: NaN on a fully masked block": ("causal (fully masked key blocks)", "fully masked key block",
                                           "must leave acc, l_i and m_i as they were"),
    "wrong: a shape slip (v transposed)": ("raised", "reduction dimensions", "(1, 2, 1, 64) bfloat16",
                                           "p is BLOCK_M x BLOCK_N"),
}


BUILT |= {name for name, hint in SOFTMAX_HINTS.items() if "refuses your kernel" in " ".join(hint)}


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("name", ONLINE_SOFTMAX)
def test_grader_4_2(name):
    answer = ONLINE_SOFTMAX[name]
    module = load(answers={"4.2": answer}) if answer else load()
    for helper, fn in HELPERS.get(name, {}).items():
        setattr(module, helper, fn)
    failure = grade("check_attention", module.attention, DEVICE, build=name in BUILT)   # as the notebook: its wrapper
    if name.startswith("wrong"):
        hint = SOFTMAX_HINTS.get(name, ("check the new running max",))
        assert failure and all(part in failure for part in hint), failure
    else:
        assert failure is None, failure


def test_grader_4_2_inputs_spread_and_masked_blocks():
    """The spread inputs put each row's maximum in its first key block and the later blocks far below (beyond exp2's
    range in FP32 at sm_scale=1); the fully masked rows are those the wrapper's 64 x 32 tiles give a masked block."""
    q, k, v = graders.spread_inputs(1, 1, 100, 64)
    s = (q.float() @ k.float().transpose(-1, -2))[0, 0] * 1.4427        # log2 units at sm_scale=1
    first, rest = s[:, :32].max(1).values, s[:, 32:].max(1).values
    assert (first - rest).min() > 128 and first.max() > 128
    rows = graders._masked_block_rows(100)
    assert rows.nonzero().flatten().tolist() == list(range(32)) + list(range(64, 96))
    assert graders._masked_block_rows(64).nonzero().flatten().tolist() == list(range(32))


CAUSAL = {
    "reference": None,
    "alternative: every block masked, one loop": """
        end = tl.minimum(start_m * BLOCK_M + BLOCK_M, n_ctx)
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, end, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, True)""",
    "wrong: the diagonal unmasked": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, False, True)
        end = tl.minimum(below + BLOCK_M, n_ctx)
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, below, end, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, False)""",
    "wrong: the diagonal skipped": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, False, True)""",
    "wrong: no causal mask at all": """
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, n_ctx, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, False)""",
}


CAUSAL.update({
    "alternative: the diagonal's end not clipped (its loads are masked)": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, False, True)
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, below,
                                    below + BLOCK_M, n_ctx, stride_kn, stride_vn, qk_scale, BLOCK_N, True, True)""",
    "wrong: the diagonal without the causal flag": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, False, True)
        end = tl.minimum(below + BLOCK_M, n_ctx)
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, below, end, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, False)""",
    "wrong: a crash (a missing argument)": """
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, True)""",
})
CAUSAL.update({
    # the issue: work above the diagonal (right numbers: those blocks are masked); a wrong stride blamed on the masks;
    # what only the compiler sees
    "wrong: every key block, causally masked (work above the diagonal)": """
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, n_ctx, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, True, True)""",
    "wrong: k's row stride for v": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_kn, qk_scale, BLOCK_N, False, True)
        end = tl.minimum(below + BLOCK_M, n_ctx)
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, below, end, n_ctx,
                                    stride_kn, stride_kn, qk_scale, BLOCK_N, True, True)""",
    "wrong: a break in a loop (the compiler refuses it)": """
        below = start_m * BLOCK_M
        acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, 0, below, n_ctx,
                                    stride_kn, stride_vn, qk_scale, BLOCK_N, False, True)
        for _ in range(1):
            end = tl.minimum(below + BLOCK_M, n_ctx)
            acc, l_i, m_i = attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_tile, v_tile, d_ok, offs_m, below, end,
                                        n_ctx, stride_kn, stride_vn, qk_scale, BLOCK_N, True, True)
            break""",
})
CAUSAL_HINTS = {
    "wrong: every key block, causally masked (work above the diagonal)": (
        "no key block above the diagonal", "query block start_m=0 (rows 0 to 63)", "entirely above the diagonal",
        "min((start_m + 1) * BLOCK_M, n_ctx)"),
    "wrong: k's row stride for v": ("v_transposed", "right on contiguous copies", "a stride, not the masks",
                                    "stride_vn"),
    "wrong: a break in a loop (the compiler refuses it)": ("refuses your kernel for an H100 (sm_90)",
                                                           "unsupported AST node type: Break", "(at `break`)"),
    "wrong: the diagonal skipped": ("NaN from query row 0", "saw no key"),
    "wrong: no causal mask at all": ("attention without the causal mask",),
    "wrong: the diagonal unmasked": ("after its own position", "MASKED=True and CAUSAL=True"),
    "wrong: the diagonal without the causal flag": ("after its own position", "MASKED=True and CAUSAL=True"),
    "wrong: a crash (a missing argument)": ("raised TypeError", "missing 1 required positional argument",
                                            "the arguments of your two attn_blocks calls"),
}
BUILT |= {name for name, hint in CAUSAL_HINTS.items() if "refuses your kernel" in " ".join(hint)}


@pytest.mark.filterwarnings("ignore:invalid value encountered")     # 0 / 0 where a wrong answer saw no key
@pytest.mark.parametrize("name", CAUSAL)
def test_grader_4_3(name):
    answer = CAUSAL[name]
    module = load(answers={"4.3": answer}) if answer else load()
    failure = grade("check_causal", module.attention, DEVICE, build=name in BUILT)
    if name.startswith("wrong"):
        hint = CAUSAL_HINTS.get(name, ("every query sees the keys up to its own position",))
        assert failure and all(part in failure for part in hint), failure
    else:
        assert failure is None, failure


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("update", ["wrong: NaN on a fully masked block", "wrong: each block's own max, no running max"])
def test_grader_4_3_a_right_causal_answer_is_not_blamed_for_a_wrong_update(update):
    """The issue: a wrong 4.2 that passed made a correct 4.3 fail with a hint that blamed the causal code."""
    for causal in (None, CAUSAL["alternative: every block masked, one loop"]):
        answers = {"4.2": ONLINE_SOFTMAX[update], **({"4.3": causal} if causal else {})}
        failure = grade("check_causal", load(answers=answers).attention, DEVICE, build=False)
        assert failure and "4.2" in failure and "every query sees the keys" not in failure, failure
        assert "your causal blocks are right" in failure or "not your causal blocks" in failure, failure


TILES = {
    "reference": (None, None),
    "alternative: small square tiles": ("return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)", None),
    "alternative: one config for every GPU (fits both)": ("return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, "
                                                          "num_stages=2)", None),
    "alternative: asks the GPU for its shared memory": ("""
    if device.type == "cpu":
        return dict(BLOCK_M=64, BLOCK_N=32)
    smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2 if smem < 200_000 else 3)""", None),
    "wrong: BLOCK_M not a multiple of BLOCK_N": ("return dict(BLOCK_M=32, BLOCK_N=64)", "multiple of BLOCK_N"),
    "wrong: not a power of two": ("return dict(BLOCK_M=96, BLOCK_N=32)", "power of two"),
    "wrong: no dict": ("return (128, 64)", "must be a dict"),
    # the issue: 458,752 bytes of shared memory at D=128 passed on a CPU
    "wrong: 458,752 B at D=128 on the H100": ("""
    if device.type == "cpu":
        return dict(BLOCK_M=64, BLOCK_N=32)
    return dict(BLOCK_M=256, BLOCK_N=256, num_warps=8, num_stages=3)""",
        ("your tiles fit the GPU", "at D=128 on an H100 (sm_90)", "458,752 bytes", "232,448")),
    "wrong: too big for the MI300X's LDS": ("""
    if device.type == "cpu":
        return dict(BLOCK_M=64, BLOCK_N=32)
    if torch.version.hip:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)""",
        ("your tiles fit the GPU", "MI300X (gfx942)", "at least 131,072 bytes", "65,536")),
    "wrong: a GPU's tiles break the rules": ("""
    if device.type == "cpu":
        return dict(BLOCK_M=64, BLOCK_N=32)
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)""", "multiple of BLOCK_N"),
    "wrong: raises": ("return dict(BLOCK_M=64, BLOCK_N=32)[device]", "raised KeyError"),
    # the issue: fitting the test, not the task (right only at the head dims the grader used to ask)
    "wrong: right only at the head dims it is asked": ("""
    if device.type == "cpu" or head_dim in (64, 128):
        return dict(BLOCK_M=64, BLOCK_N=32)
    return dict(BLOCK_M=64, BLOCK_N=128)""", ("a head dim drawn for this grade", "multiple of BLOCK_N")),
}


@pytest.mark.parametrize("name", TILES)
def test_grader_4_4(name, monkeypatch):
    monkeypatch.setenv(grading_guard.SEED_VAR, "7")     # a head dim drawn other than 64 and 128 (D=96)
    answer, hint = TILES[name]
    module = load(answers={"4.4": answer}) if answer else load()
    saved = torch.version.hip
    failure = grade("check_tiles", module.portable_attention, module.my_config, 64, torch.device(DEVICE))
    assert torch.version.hip == saved
    if hint:
        assert failure and all(part in failure for part in ([hint] if isinstance(hint, str) else hint)), failure
    else:
        assert failure is None, failure


def test_grader_4_4_tile_bytes_match_the_compilers():
    """Shared memory from the tiles' bytes, against what ahead-of-time builds of `flash_attention` reported (Triton
    3.7; the AOT test above builds the course's tiles): exact on sm_90, a lower bound on gfx942."""
    builds = {("sm_90", 128, 128, 64, 4): 163840, ("sm_90", 128, 128, 128, 3): 229376, ("sm_90", 256, 128, 64, 2): 196608,
              ("sm_90", 64, 64, 64, 1): 24576, ("sm_90", 128, 256, 256, 3): 458752,
              ("gfx942", 128, 128, 64, 1): 32768, ("gfx942", 128, 256, 256, 3): 262144,
              ("gfx942", 256, 128, 128, 2): 163840, ("gfx942", 256, 128, 64, 1): 65536, ("gfx942", 64, 64, 64, 1): 8192}
    for (target, d, bm, bn, stages), shared in builds.items():
        bound = graders.attention_tile_bytes(dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=stages), d, target)
        assert bound == shared if target == "sm_90" else bound <= shared, (target, d, bm, bn, stages, bound, shared)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
def test_grader_4_4_tiles_too_big_for_the_gpu():
    module = load(answers={"4.4": "return dict(BLOCK_M=256, BLOCK_N=256, num_warps=8, num_stages=4)"})
    failure = grade("check_tiles", module.portable_attention, module.my_config, 256, torch.device("cuda"))
    assert failure and "your tiles fit the GPU" in failure


def test_generated_lab_with_a_wrong_answer_stops_at_its_grade(tmp_path):
    """Through papermill, as a learner runs it: a right online-softmax update (written another way) passes, and a
    wrong causal function stops the lab at its grading cell with the hint. (Other right answers are graded through
    the exported module above, without running the notebook again.)"""
    from grading import run_lab_with, stream_text

    small = {"SEQ_LENS": [64], "NAIVE_MAX_N": 64, "HEADLINE": [64, 64]}
    nb, error = run_lab_with("04", {"4.2": ONLINE_SOFTMAX["alternative: dot accumulates, other order"],
                                    "4.3": CAUSAL["wrong: the diagonal unmasked"]}, tmp_path, small)
    assert "PASS: exercise 4.2" in stream_text(nb)
    assert error and error[0] == "ExerciseFailed" and "every query sees the keys" in error[1]


# --- the full grid (GPU) ---------------------------------------------------------------------------------

GPU_SIZES = (1, 17, 97, 1025, 4096)


def _grid_chunk(cases):
    """Run some cases of the full grid in this process; [(case, ok, error, allowed)] (a pool worker)."""
    module = solutions.load("04")
    out = []
    for d, layout, dtype, n, causal, fn in cases:
        size = dict(batch=1, heads=2) if n >= 4096 else dict(batch=2, heads=3)
        ok, err, allowed = run_case(module, d, layout, getattr(torch, dtype), n, causal,
                                    attention=getattr(module, fn), **size)
        out.append(((d, layout, dtype, n, causal, fn), ok, err, allowed))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA or ROCm GPU")
def test_full_grid_on_the_gpu(capsys):
    """Every combination of head dim, layout, dtype, size (to 4096) and mask, for the public wrapper and the
    portable kernel; the kernels compile in parallel processes (one per (head dim, dtype)) first."""
    import multiprocessing

    load()
    functions = ["triton_attention", "portable_attention"]     # the first takes the TMA path on an H100
    chunks = {}
    for d, dtype in itertools.product(HEAD_DIMS, ("bfloat16", "float16")):
        for layout, n, causal, fn in itertools.product(graders.LAYOUTS, GPU_SIZES, (False, True), functions):
            chunks.setdefault((d, dtype), []).append((d, layout, dtype, n, causal, fn))
    start = time.time()
    workers = max(1, min(len(chunks), os.cpu_count() or 2, 16))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [r for chunk in pool.map(_grid_chunk, chunks.values()) for r in chunk]
    failed = [f"{case}: error {err:.3g} > {allowed:.3g}" for case, ok, err, allowed in results if not ok]
    with capsys.disabled():
        print(f"\nlab 04 full grid ({torch.cuda.get_device_name()}): {len(results) - len(failed)} of {len(results)} "
              f"pass in {time.time() - start:.0f} s")
    assert not failed, "\n".join(failed[:30])


def test_an_attention_that_writes_into_its_inputs_fails_naming_the_input():
    """The reference is computed from q, k, v after the call: an answer that scales q in place (and attends the scaled
    q with the usual scale) would match it; the grader compares the inputs with copies taken before (issue 46)."""
    import torch.nn.functional as F

    from utils.exercises import ExerciseFailed

    def scales_q_in_place(q, k, v, causal, sm_scale=None):
        q.mul_(2.0)
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                              scale=sm_scale).to(q.dtype)

    with pytest.raises(ExerciseFailed, match="changed its input q"):
        graders.check_attention(scales_q_in_place, "cpu")


# --- issue 46: fresh inputs every grade, the compiler's word on both GPUs -----------------------------------------

def test_every_grade_draws_cases_of_its_own_and_a_seed_draws_them_again(monkeypatch):
    """Beside the fixed cases each grade draws two, small (the interpreter is slow): shapes, layout, dtype, sm_scale
    and values new every time, the same again under COURSE_GRADE_SEED."""
    monkeypatch.delenv(grading_guard.SEED_VAR, raising=False)
    assert len({repr(graders._cases()[-2:]) for _ in range(3)}) == 3
    monkeypatch.setenv(grading_guard.SEED_VAR, "12345")
    assert graders._cases() == graders._cases()
    for batch, heads, n, d, layout, dtype, sm_scale, seed in (c for s in range(300) for c in graders.fresh_cases(s)):
        assert batch * heads <= 2 and 1 <= n <= 160 and d % 8 == 0 and 16 <= d <= 128 and seed is not None
        assert layout in graders.LAYOUTS + ("spread",) and (layout != "spread" or n > 32)


def test_a_table_of_the_cases_tried_fails_on_the_cases_drawn_naming_its_seed(monkeypatch):
    """The issue's "fitting the test": an answer right on every fixed case (their shapes in a table) and wrong
    elsewhere fails on a case drawn for the grade; the failure names the seed that draws it again."""
    from utils import exercises

    fixed = {(1, 2, n, d) for n, d, _ in graders.ATTENTION_CASES} | {case[:4] for case in graders.HIDDEN_CASES}

    def table(q, k, v, causal, sm_scale=None):
        if tuple(q.shape) in fixed:
            return graders.reference(q, k, v, causal, sm_scale).to(q.dtype)
        return torch.zeros_like(q)

    monkeypatch.setenv(grading_guard.SEED_VAR, "3")
    with pytest.raises(exercises.ExerciseFailed, match=r"\(drawn for this grade\).*COURSE_GRADE_SEED=3"):
        exercises.Lab("04_flash_attention").grade("4.2", "the online-softmax update", graders.check_attention, table,
                                                  DEVICE)


def test_the_course_kernel_builds_for_both_gpus_and_once(lab):
    """The grader builds the kernel an answer's `attention` launches for sm_90 and gfx942 as the lab's
    compile_attention does (in a process without the interpreter): the course's builds for both, and grading the
    same kernel again reads what was kept under the build folder, starting no process."""
    built = {f"{t} D={d}": None for t in ("sm_90", "gfx942") for d in graders.AOT_HEAD_DIMS}
    assert graders.AOT_HEAD_DIMS == (64, 128)          # the lab's small head dim and its headline one
    for causal in (False, True):
        assert graders._Build(lab.flash_attention, causal).finish() == built
        again = graders._Build(lab.flash_attention, causal)
        assert again.proc is None and again.finish() == built


def test_a_gpu_this_machine_cannot_build_for_is_said_not_checked_here(lab, monkeypatch, capsys):
    """Where Triton cannot build even the course's kernel for a target (no toolchain for it here), the answer is not
    failed for it: the grade says that target was not checked here."""
    monkeypatch.setattr(graders, "GPU_TARGETS", {"gfx0": ("an imaginary GPU (gfx0)", 0, None)})
    assert grade("check_attention", lab.attention, DEVICE) is None
    assert "gfx0 D=64 not checked here (Triton does not build the course's own kernel for it on this machine either: " \
           "ValueError: unknown target 'gfx0'" in capsys.readouterr().out
