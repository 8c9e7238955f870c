"""Lab 03's graders (exercises 3.1-3.7) and the error measure and tolerances its checks of a BF16 matmul use."""
import math
import numbers
import random

import torch
import triton

from utils import fp8, grading_guard, solutions
from utils.exercises import call_answer, check, error_line, is_not_done

TOLERANCE = {"cuda": 1e-2, "rocm": 2e-2, "cpu": 1e-2}   # relative Frobenius error of a BF16 product


def rel_error(c, a, b):
    """|c - a @ b| / |a @ b| (Frobenius), against a float64 product of the same inputs."""
    ref = a.double() @ b.double()
    return ((c.double() - ref).norm() / ref.norm()).item()


def _raise_if_not_done(err: BaseException) -> None:
    """Let an exercise stub's own error through (the lab says NOT DONE for it); anything else is the answer's."""
    if is_not_done(err):
        raise err


def _describe(t) -> str:
    return f"{'x'.join(map(str, t.shape))} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) \
        else type(t).__name__


# --- 3.1: FLOP per byte ------------------------------------------------------------------------------

def check_intensity(intensity):
    """The prediction against 2 n^3 FLOPs over 3 n^2 BF16 values of 2 bytes at a few sizes, each printed, then two
    drawn fresh on every call (`grading_guard.fresh_seed`: a table of the printed sizes' answers fails), not printed;
    a hint per usual slip."""
    hints = {0.5: "half the answer: count 2 FLOPs per term (a multiply and an add), 2 bytes per BF16 value, and each "
                  "of A, B and C moved once (not twice)",
             2.0: "twice the answer: a BF16 value takes 2 bytes",
             1.5: "you moved only A and B: C is written too (3 matrices of n*n values)",
             0.25: "a quarter of the answer: that is FP32's 4 bytes per value, and one FLOP per term",
             4.0: "four times the answer: a BF16 value takes 2 bytes, and a term is 2 FLOPs, not 4"}
    rng = random.Random(grading_guard.fresh_seed())
    printed = (64, 1000, 4096)
    for n in (*printed, *(rng.randrange(2, 20000) for _ in range(2))):
        want = 2 * n**3 / (2 * 3 * n**2)
        try:
            got = intensity(n)
        except Exception as err:                     # the stub's NotImplementedError: NOT DONE
            _raise_if_not_done(err)
            check(f"intensity({n})", False, f"intensity({n}) raised {error_line(err)}: return a number (FLOP per byte)")
        number = isinstance(got, numbers.Real) and not isinstance(got, bool)
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got, number = got.item(), True
        ratio = float(got) / want if number and got == got else float("nan")
        if not number:
            hint = f"return a number (FLOP per byte), not {type(got).__name__}"
        elif got == want // 1 and got != want:
            hint = "the fraction is dropped (integer division // or rounding): divide with /"
        else:
            hint = next((h for r, h in hints.items() if abs(ratio - r) < 1e-6),
                        "count the FLOPs (a multiply and an add per term) and the bytes of A, B and C, each moved once")
        ok = number and abs(ratio - 1) < 1e-6
        if n in printed or not ok:
            check(f"intensity({n})", ok, f"got {got!r}, expected {want:.6g}: {hint}")


# --- 3.2: the K loop ---------------------------------------------------------------------------------

GUARD = 256   # elements of NaN before and after every operand, times its longer side


def nan_around(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` in fresh memory with NaNs before and after them: a kernel that reads outside the matrix
    (past its end, or before its start) gets NaN."""
    pad = GUARD * max(t.shape)
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    buf[pad:pad + t.numel()] = t.reshape(-1)
    return buf[pad:pad + t.numel()].view(t.shape)


nan_after = nan_around   # the name the lab's first version used


def _operands(m, n, k, gen, device, dtype=torch.bfloat16, layout="contiguous"):
    """A (m x k) and B (k x n), NaN before and after each in memory, laid out as "contiguous", "a.T" (A is a
    transposed view), "b.T", or "sliced" (every other row of a wider matrix: row strides that are not the width)."""
    def make(rows, cols, transposed, sliced):
        if sliced:
            t = nan_around(torch.randn(2 * rows, cols + 3, generator=gen).to(device, dtype))
            return t[::2, 1:cols + 1]
        t = torch.randn(cols, rows, generator=gen) if transposed else torch.randn(rows, cols, generator=gen)
        t = nan_around(t.to(device, dtype))
        return t.T if transposed else t
    sliced = layout == "sliced"
    return make(m, k, layout == "a.T", sliced), make(k, n, layout == "b.T", sliced)


# Each stage adds what the one before did not test, so the first failing stage names the mistake. The shapes
# after the printed ones (sliced operands, FP16 and FP32) are checked too, without a line of their own.
MATMUL_STAGES = [
    ("one full K step", [(64, 48, 32, "contiguous"), (33, 17, 32, "contiguous")],
     "wrong with a single K step (K = BLOCK_K): load a at a_ptrs and b at b_ptrs, a masked along its columns "
     "(offs_k[None, :]) and b along its rows (offs_k[:, None])"),
    ("several K steps", [(64, 64, 128, "contiguous"), (32, 48, 256, "contiguous")],
     "right for one K step, wrong for several: after the loads, move both pointers one step (BLOCK_K values) along K, "
     "in units of each matrix's K stride (a_ptrs += BLOCK_K * stride_ak; b_ptrs += BLOCK_K * stride_bk)"),
    ("a ragged last K step", [(100, 70, 90, "contiguous"), (1, 17, 97, "contiguous"), (64, 48, 200, "contiguous")],
     "right when K is a multiple of BLOCK_K, wrong when the last step overhangs K: mask the loads with "
     "offs_k < K - k * BLOCK_K (strictly less) and other=0.0"),
    ("transposed inputs", [(100, 70, 90, "a.T"), (17, 97, 50, "b.T")],
     "right for contiguous matrices, wrong for transposed ones: move the pointers by BLOCK_K * stride_ak and "
     "BLOCK_K * stride_bk, the strides the wrapper passes, not by BLOCK_K"),
]
UNPRINTED = {"transposed inputs": [(37, 29, 75, "sliced", torch.bfloat16), (65, 33, 47, "a.T", torch.float16),
                                   (19, 70, 33, "b.T", torch.float32)]}
DOT_TOLERANCE = {torch.float16: 2e-3, torch.float32: 1e-4}   # FP32 inputs: "ieee", no TF32

# What the interpreter (or compiler) says for a slip in the K loop, and the mistake it means
CRASH_HINTS = [
    (("make_shape_compatible", "incompatible dimensions", "Cannot broadcast", "shape mismatch"),
     "a mask is not shaped like its tile: a is BLOCK_M x BLOCK_K, masked along its columns (offs_k[None, :]); "
     "b is BLOCK_K x BLOCK_N, masked along its rows (offs_k[:, None])"),
    (("same dtype",), "tl.dot takes a and b of one dtype: load both as they are (no .to(...)); the accumulator "
                      "is FP32 already"),
    (("reduction dimension", "reduction dim"),
     "tl.dot(a, b) needs a as BLOCK_M x BLOCK_K and b as BLOCK_K x BLOCK_N: load the tiles at a_ptrs and b_ptrs "
     "as they are (no transpose)"),
]


def _crash_hint(err: BaseException) -> str:
    text = str(err)
    return next((h for keys, h in CRASH_HINTS if any(k in text for k in keys)),
                "check the shapes of the tiles and masks you load and the dtypes you pass to tl.dot")


def _fresh_shapes(stage: str, rng: random.Random) -> list:
    """A shape drawn for `stage`, of the kind it tests (K = one step of 32, several, a ragged last one; any layout
    and dtype), so that a failure still gets the stage's hint."""
    mn = lambda: (rng.randrange(1, 130), rng.randrange(1, 130))
    k = {"one full K step": lambda: 32, "several K steps": lambda: 32 * rng.randrange(2, 6),
         "a ragged last K step": lambda: 32 * rng.randrange(1, 6) + rng.randrange(1, 32)}.get(
        stage, lambda: rng.randrange(1, 200))
    transposed = stage == "transposed inputs"
    return [(*mn(), k(), rng.choice(["a.T", "b.T", "sliced"]) if transposed else "contiguous",
             rng.choice([torch.bfloat16, torch.float16, torch.float32]) if transposed else torch.bfloat16)]


def check_matmul(matmul, device="cpu"):
    """A matmul of BF16 matrices against a float64 product of the same inputs, stage by stage, NaN before and after
    every operand (a load outside a matrix shows), then sliced operands and FP16 and FP32 ones. Each stage also
    tries a shape drawn fresh on every call, and every value is fresh (`grading_guard.fresh_seed`: a table of the
    printed cases, or a result kept from an earlier call, fails); those shapes are not printed. An answer that
    writes into a or b fails, naming it."""
    backend = "cpu" if str(device) == "cpu" else ("rocm" if torch.version.hip else "cuda")
    rng = random.Random(grading_guard.fresh_seed())
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for stage, shapes, hint in MATMUL_STAGES:
        extra = UNPRINTED.get(stage, []) + _fresh_shapes(stage, rng)
        for m, n, k, layout, dtype in [(*s, torch.bfloat16) for s in shapes] + extra:
            tolerance = TOLERANCE[backend] if dtype == torch.bfloat16 else DOT_TOLERANCE[dtype]
            a, b = _operands(m, n, k, gen, device, dtype, layout=layout)
            name = f"{stage}: {m}x{n}x{k} ({layout}{'' if dtype == torch.bfloat16 else ', ' + str(dtype)[6:]})"
            try:
                c, changed = grading_guard.changed_inputs((a, b), matmul, ["a", "b"])
            except Exception as err:                 # the stub's NotImplementedError: NOT DONE
                _raise_if_not_done(err)
                check(name, False, f"matmul(a, b) with a {_describe(a)} and b {_describe(b)} raised {error_line(err)}: "
                                   f"{_crash_hint(err)}")
            if changed:
                check(name, False, f"matmul changed its input {' and '.join(changed)}: read A and B, write only C")
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != (m, n):
                check(f"{stage}: result shape", False, f"C must be a {m}x{n} tensor, got {_describe(c)}")
            if torch.isnan(c).all() and stage == MATMUL_STAGES[0][0]:
                check(name, False, "every value of C is NaN with a single K step: the first loads already read "
                                   "outside A and B (the checker puts NaN there): load a at a_ptrs and b at b_ptrs "
                                   "first, then move the pointers")
            if torch.isnan(c).any():
                check(name, False, "NaN in C: a load read outside a matrix (the checker puts NaN before and after "
                                   "each): mask both loads with offs_k < K - k * BLOCK_K (strictly less), other=0.0, "
                                   "and move the pointers after loading, one step along K: a_ptrs by BLOCK_K * "
                                   "stride_ak, b_ptrs by BLOCK_K * stride_bk")
            err = rel_error(c, a, b)
            if not err < tolerance:
                check(name, False, f"relative error {err:.2e}, tolerance {tolerance:g}: {hint}")
        print(f"PASS: {stage} ({', '.join(f'{m}x{n}x{k}' for m, n, k, _ in shapes)})")


# --- 3.3: matrix instructions per K step -------------------------------------------------------------

def check_instruction_prediction(predicted: dict, measured: dict):
    """The prediction against the counts in the compiled kernels (one K step = one pass of the loop body)."""
    if not (isinstance(predicted, dict) and {"gfx942", "sm_90"} <= set(predicted)):
        check("a dict with gfx942 and sm_90", False, 'return {"gfx942": ..., "sm_90": ...}')
    tile_hints = {"gfx942": {128: "that is the whole 128x128 tile's count: 4 wavefronts share it, each computes a quarter",
                             4: "that is one wavefront's C tiles (32x32 each); each takes BLOCK_K / 8 = 8 MFMAs per K step",
                             8: "that is one 32x32 C tile's count; a wavefront holds 128 * 128 / 4 values of C: 4 such tiles"},
                  "sm_90": {8: "that is the whole program's count: 8 warps are 2 warp groups, each computes half of C",
                            1: "one wgmma covers K = 16 only: BLOCK_K = 64 takes 4",
                            2: "a warp group's half of C (64x256) is one wgmma tile wide; K = 64 takes 64 / 16 of them"}}
    for target in ("gfx942", "sm_90"):
        got, want = predicted[target], measured[target]
        number = isinstance(got, numbers.Real) and not isinstance(got, bool)
        hint = tile_hints[target].get(got) if number else f"give a whole number, not {type(got).__name__}"
        check(f"{target}: {want} per K step", number and got == want, hint or f"you said {got!r}; count the "
              "instructions' tiles in the program's C tile (split between its warps) times BLOCK_K over their K")


# --- 3.4: rounding FP32 to TF32 ----------------------------------------------------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def tf32_test_values(n: int, seed: int = 0) -> torch.Tensor:
    """Values that tell roundings apart: exact ties, just below and above them, both signs, the edges of
    FP32's range (largest, smallest normal, subnormal, zero, infinities, NaN), then seeded random ones."""
    one = 1.0
    special = [0.0, -0.0, one, -one, one + 2**-11, -(one + 2**-11), one + 2**-12, one + 3 * 2**-12, 3 * 2**-11 + one,
               1.5 + 2**-11, 2.0**100 * (one + 2**-11), torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny,
               1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 0.1, -0.1, 1 / 3, 65504.0]
    # NaNs with other payloads (a signalling one, the largest payload, a negative one): the bit trick turns them into
    # inf, -0.0 and 0.0, as lab 03 says; the grader takes either that or a NaN for them
    payloads = torch.tensor([0x7F800001, 0x7FFFF000, -1], dtype=torch.int32).view(torch.float32)
    special = torch.cat([torch.tensor(special, dtype=torch.float32), payloads])
    gen = torch.Generator().manual_seed(seed)
    count = max(n - len(special), 0)
    rest = (torch.randn(count, generator=gen) * 10.0 ** torch.randint(-6, 7, (count,), generator=gen)).float()
    tie = torch.rand(count, generator=gen) < 0.3      # about a third of them exact ties: low 13 bits 0x1000
    bits = torch.where(tie, (rest.view(torch.int32) & -0x2000) | 0x1000, rest.view(torch.int32))
    return torch.cat([special, bits.view(torch.float32)])[:n]


TF32_MISTAKES = [   # (what the bits become, the hint), tried in order on the values that are not NaN
    (lambda b: b, "y equals x: clear the 13 low mantissa bits (bits & -0x2000) after adding 0x1000"),
    (lambda b: b & -0x2000, "you cleared the 13 low bits without rounding: add half a TF32 step (0x1000) to the bits first"),
    (lambda b: (b + 0x8000) & -0x10000, "that keeps 7 mantissa bits (bfloat16); TF32 keeps 10: clear 13 bits, adding 0x1000"),
    (lambda b: (b + 0x0FFF) & -0x2000, "ties round toward zero: TF32 (cvt.rna) rounds them away from zero: add 0x1000, "
                                       "half a step, not 0xFFF"),
    (lambda b: (b + 0x0FFF + ((b >> 13) & 1)) & -0x2000,
     "ties round to even: TF32 as the course defines it (cvt.rna) rounds them away from zero: add 0x1000 and clear "
     "13 bits"),
    (lambda b: (b + 0x2000) & -0x2000, "you added a whole TF32 step (0x2000): add half of one (0x1000)"),
    (lambda b: (b + 0x0800) & -0x1000, "that keeps 11 mantissa bits; TF32 keeps 10: clear 13 bits (& -0x2000), "
                                       "adding 0x1000"),
    (lambda b: (b + 0x2000) & -0x4000, "that keeps 9 mantissa bits; TF32 keeps 10: clear 13 bits (& -0x2000), "
                                       "adding 0x1000"),
]


def check_tf32_round(tf32_round, device="cpu"):
    """tf32_round(x) bit for bit against the course's to_tf32 (round to nearest, ties away), with a hint per mistake:
    the values of `tf32_test_values` at ragged sizes and one drawn fresh, the random ones fresh on every call
    (`grading_guard.fresh_seed`); an answer that writes into x fails."""
    to_tf32 = solutions.load("03").to_tf32
    rng = random.Random(grading_guard.fresh_seed())
    seed = rng.randrange(2**31)
    for n in (1, 17, 22, 1000, 4097, rng.randrange(23, 3000)):
        x = tf32_test_values(n, seed=seed + n).to(device)
        try:
            y, changed = grading_guard.changed_inputs((x,), tf32_round, ["x"])
        except Exception as err:                     # the stub's NotImplementedError: NOT DONE
            _raise_if_not_done(err)
            hint = str(err) if "mask the store" in str(err) else \
                f"tf32_round(x) with x {_describe(x)} raised {error_line(err)}" + \
                ("; a bitcast keeps the size: view x's 32 bits as tl.int32, and the result's as tl.float32"
                 if "bitcast" in str(err) else "")
            check(f"TF32 rounding of {n} values", False, hint)
        if changed:
            check(f"TF32 rounding of {n} values", False, "tf32_round changed its input x: return the rounded values "
                  "in a new tensor (the kernel reads x_ptr and stores to y_ptr)")
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != torch.float32:
            check(f"TF32 rounding of {n} values", False, f"return float32 values of x's shape {tuple(x.shape)}, "
                  f"got {_describe(y)}")
        want, got, xb = _bits(to_tf32(x)).cpu(), _bits(y).cpu(), _bits(x).cpu()
        nan = torch.isnan(x).cpu()
        as_bits = (xb + 0x1000) & -0x2000          # what the rounding does to a NaN's bits, payload and all
        wrong = ~((got == want) | (nan & (torch.isnan(y).cpu() | (got == as_bits))))
        if not wrong.any():
            continue
        first = int(wrong.nonzero()[0])
        example = f"x = {x[first].item()!r} gave {y[first].item()!r}, TF32 keeps {to_tf32(x)[first].item()!r}"
        hint = next((h for f, h in TF32_MISTAKES if torch.equal(got[~nan], f(xb)[~nan])),
                    "round the bits to 10 mantissa bits, ties away from zero, viewing x as int32 and the result as "
                    "float32")
        check(f"TF32 rounding of {n} values", False, f"{int(wrong.sum())} wrong, e.g. {example}: {hint}")
    print("PASS: TF32 rounding, bit for bit: ties, both signs, the edges of FP32's range, ragged sizes; NaNs kept, "
          "or (other payloads) rounded as bits")


# --- 3.5: a tile configuration -----------------------------------------------------------------------

# Shared memory (LDS) one block may use, and where the A and B tiles' bytes go: on sm_90 (Triton's pipeliner) one pair
# of tiles per stage, on gfx942 (AMD's stream pipeliner) one pair per stage fetched ahead (num_stages - 1, at least
# one); both checked against ahead-of-time builds of matmul_kernel. Limits: CUDA C++ Programming Guide, compute
# capability 9.0 (227 KiB per block with opt-in); AMD CDNA3 ISA guide (64 KiB of LDS per workgroup).
SHARED = {"cuda": ("an H100 (sm_90)", 232448, lambda stages: max(stages, 1)),
          "rocm": ("an MI300X (gfx942)", 65536, lambda stages: max(stages - 1, 1))}
AMD_ONLY = {"waves_per_eu", "matrix_instr_nonkdim", "kpack"}   # options only AMD's backend takes


def matmul_tile_bytes(config: triton.Config, backend: str) -> int:
    """Shared memory (LDS) the BF16 A and B tiles of `config` take on `backend`'s GPU ("cuda": sm_90, "rocm": gfx942)."""
    kw = config.kwargs
    pair = (kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]) * 2
    return pair * SHARED[backend][2](config.num_stages)


def _check_fields(config, backend: str, prefix: str = "") -> None:
    """The checks of a config that need no GPU, for `backend`'s GPU: what it names, tile sizes, warps and stages in
    range, options that backend takes, tiles within one block's shared memory (LDS) there. `prefix` goes before each
    check's name (the other vendor's config: its checks print nothing when they pass)."""
    say = (lambda name, ok, hint: ok or check(prefix + name, ok, hint)) if prefix else check
    say("a triton.Config", isinstance(config, triton.Config),
        "return triton.Config({...}, num_warps=..., num_stages=...)")
    kw = config.kwargs
    missing = sorted({"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"} - set(kw))
    say("names the tile sizes and GROUP_M", not missing, f"add {missing} to the config's dictionary")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = kw[name]
        say(f"{name} = {v} is a power of two from 16 to 256",
            isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 256 and v & (v - 1) == 0,
            "tl.arange and tl.dot need powers of two; the matrix instructions need at least 16")
    say("GROUP_M >= 1", isinstance(kw["GROUP_M"], int) and kw["GROUP_M"] >= 1, "GROUP_M is a count of tile rows")
    say("num_warps is 1, 2, 4, 8 or 16", config.num_warps in (1, 2, 4, 8, 16), f"num_warps={config.num_warps}")
    say("num_stages from 1 to 6", isinstance(config.num_stages, int) and 1 <= config.num_stages <= 6,
        f"num_stages={config.num_stages}")
    unknown = sorted(set(kw) - {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"} - AMD_ONLY)
    if unknown:
        check(prefix + "names only the kernel's parameters", False, f"{unknown}: matmul_kernel has no such parameter; "
              "the config names BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M (and on ROCm waves_per_eu)")
    amd = sorted(AMD_ONLY & set(kw))
    if backend == "cuda" and amd:
        check(prefix + "options the backend takes", False, f"{amd} are AMD options: the CUDA backend refuses them "
              "(keep them for the ROCm config)")
    where, limit, _ = SHARED[backend]
    need = matmul_tile_bytes(config, backend)
    if need > limit:
        per = "num_stages" if backend == "cuda" else "each of the num_stages - 1 steps fetched ahead"
        check(prefix + "fits one block's shared memory", False,
              f"your A and B tiles take {need:,} bytes ({need / 1024:.0f} KiB) of shared memory on {where} "
              f"((BLOCK_M x BLOCK_K + BLOCK_K x BLOCK_N) x 2 bytes, for {per}); one block may use {limit:,} "
              f"({limit // 1024} KiB): use smaller tiles or fewer stages")


def check_config(config, device="cpu", backend=None):
    """A triton.Config the kernel can run: tile sizes, warps and stages in range, options the backend takes, tiles
    within one block's shared memory on `backend`'s GPU (computed from their bytes, so a CPU refuses what no GPU
    could launch; default: this GPU's vendor, on a CPU "cuda" unless the config names AMD-only options); then the
    K-loop check with it, through the course's matmul_with (so it grades the configuration, whatever state exercise
    3.2 is in).

    `config` may also be my_config itself, a function of the backend: then every vendor's branch is graded, on any
    machine: my_config("cuda") against an H100's shared memory and my_config("rocm") against an MI300X's LDS, the
    other vendor's checks in one PASS line, and the K-loop check runs with `backend`'s config (default: this GPU's
    vendor, "cuda" on a CPU)."""
    if callable(config) and not isinstance(config, triton.Config):
        here = backend or (("rocm" if torch.version.hip else "cuda") if str(device) != "cpu" else "cuda")
        configs = {b: call_answer(f'my_config("{b}")', config, (b,), f'backend "{b}"') for b in SHARED}
        for other in (b for b in SHARED if b != here):
            where, limit, _ = SHARED[other]
            _check_fields(configs[other], other, prefix=f'my_config("{other}"), for {where}: ')
            check(f'my_config("{other}") fits {where}: tile sizes, warps, stages and options it takes, A and B tiles '
                  f"within its {limit // 1024} KiB of shared memory (LDS)", True, "")
        config, backend = configs[here], here
    if backend is None:
        kw = config.kwargs if isinstance(config, triton.Config) else {}
        backend = ("rocm" if torch.version.hip else "cuda") if str(device) != "cpu" else \
            ("rocm" if AMD_ONLY & set(kw) else "cuda")
    _check_fields(config, backend)
    lab = solutions.load("03")
    try:
        check_matmul(lab.matmul_with(config), device)
    except triton.runtime.errors.OutOfResources as err:
        check("fits this GPU", False, f"{err}. The tiles take {matmul_tile_bytes(config, backend) / 1024:.0f} KiB of "
              "shared memory: use smaller tiles or fewer stages")


# --- 3.6: quantizing to FP8 with a scale -------------------------------------------------------------

def _fp8_rows(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """rows x cols float32 of mixed magnitudes (10^-3 to 10^3 per row), with the awkward rows the contract names:
    all zeros, one huge outlier, all negative, a NaN."""
    x = torch.randn(rows, cols, generator=gen) * 10.0 ** (torch.rand(rows, 1, generator=gen) * 6 - 3)
    specials = torch.randperm(rows, generator=gen)[:4].tolist()
    for kind, r in zip(("zeros", "outlier", "negative", "nan"), specials):
        c = int(torch.randint(cols, (1,), generator=gen))
        if kind == "zeros":
            x[r] = 0.0
        elif kind == "outlier":
            x[r, c] = x[r].abs().max().clamp_min(1.0) * 1e4
        elif kind == "negative":
            x[r] = -x[r].abs()
        elif cols > 1:
            x[r, c] = float("nan")
    return x


def _fp8_step(y: torch.Tensor, fmt) -> torch.Tensor:
    """The spacing of `fmt`'s values around |y| (float64): 2^(exponent - mantissa bits), the subnormals' below."""
    info = torch.finfo(fmt.dtype)
    e = torch.floor(torch.log2(y.abs().clamp_min(info.tiny)))
    return 2.0 ** (e - fmt.mantissa_bits)


def check_fp8_quantize(quantize_fp8, device="cpu"):
    """quantize_fp8(x, row_wise, dtype) -> (q, scale) with x ~ q * scale, on fresh matrices with a row of zeros, one
    huge outlier, negatives and a NaN (e4m3fn, e4m3fnuz and e5m2; float32 and bfloat16 x; per tensor and row-wise):
    q is x / scale rounded to the nearest FP8 value, nothing saturates to inf or NaN, NaN stays NaN, each scale maps its
    largest finite |x| into the format's top binade (max/2 to max); x is left as it was. A hint per usual slip."""
    rng = random.Random(grading_guard.fresh_seed())
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    cases = [(fmt, row_wise, src) for fmt in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
             for row_wise in (False, True) for src in (torch.float32,)]
    cases += [("float8_e4m3fn", True, torch.bfloat16), ("float8_e4m3fnuz", False, torch.bfloat16)]
    for name, row_wise, src in cases:
        fmt = fp8.FORMATS[name]
        rows, cols = rng.randrange(5, 12), rng.randrange(1, 70)
        x = _fp8_rows(gen, rows, cols).to(src).to(device)
        what = f"{name}, {'row-wise' if row_wise else 'per tensor'}, x {rows}x{cols} {str(src).removeprefix('torch.')}"
        label = f"quantize_fp8 to {what}"
        out = call_answer(label, quantize_fp8, (x, row_wise, fmt.dtype), f"x {rows}x{cols}", names=["x"],
                          hint=lambda e: "; a row-wise scale of shape (M,) lines up with the columns: keep the reduced "
                          "dimension, amax(dim=1, keepdim=True)" if "must match the size" in str(e) else "")
        _check_fp8_answer(label, out, x, fmt, row_wise)
    print("PASS: FP8 quantization on fresh inputs (e4m3fn, e4m3fnuz, e5m2; per tensor and row-wise; zeros, an outlier, "
          "negatives, NaN): nearest values, nothing saturated, NaN kept, scales in range")


def _check_fp8_answer(label, out, x, fmt, row_wise):
    fmax = fmt.max
    if not (isinstance(out, tuple) and len(out) == 2):
        check(label, False, f"return (q, scale), a tuple of two tensors, not {type(out).__name__}")
    q, scale = out
    rows = x.shape[0]
    if not isinstance(q, torch.Tensor) or q.dtype != fmt.dtype or q.shape != x.shape:
        # a row-wise scale of shape (M,) broadcasts along the columns: with one column, q comes out M x M
        dropped = row_wise and isinstance(scale, torch.Tensor) and tuple(scale.shape) == (rows,)
        check(label, False, f"q must be a {fmt.name} tensor of x's shape {tuple(x.shape)}, not {_describe(q)}"
              + ("; cast it: .to(dtype)" if isinstance(q, torch.Tensor) and q.shape == x.shape else "")
              + ("; the scale has shape (M,), which lines up with the columns: keep the reduced dimension, "
                 "amax(dim=1, keepdim=True)" if dropped else ""))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        check(label, False, f"the scale must be float32 (what torch._scaled_mm takes), not {_describe(scale)}")
    if row_wise and tuple(scale.shape) != (rows, 1):
        hint = ("keep the reduced dimension: amax(dim=1, keepdim=True) gives shape (M, 1)" if tuple(scale.shape) == (rows,)
                else "one scale per ROW: reduce along dim=1 (the columns of each row)" if scale.numel() == x.shape[1]
                and x.shape[1] != rows else "row-wise: one scale per row of x, shape (M, 1)")
        check(label, False, f"scale has shape {tuple(scale.shape)}: {hint}")
    if not row_wise and scale.numel() != 1:
        check(label, False, f"per tensor: one scale for all of x (shape ()), not shape {tuple(scale.shape)}")
    xf = x.double().cpu()
    s = scale.double().cpu().reshape(-1, 1) if row_wise else scale.double().cpu().reshape(1, 1)
    qf = q.cpu().float().double()
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), 0.0).amax(dim=1, keepdim=True)
    if not row_wise:
        amax = amax.max().reshape(1, 1)
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        bad = int((~(torch.isfinite(s) & (s > 0))).nonzero()[0, 0])
        hint = ("a row of zeros: its amax is 0, so its scale is 0 and x / scale is 0/0 = NaN: give such a row scale 1"
                if amax[bad].item() == 0 else
                "a NaN in x made the amax NaN (max propagates NaN): take the amax over finite values "
                "(torch.where(x.isfinite(), x.abs(), 0))" if torch.isnan(xf[bad if row_wise else slice(None)]).any()
                else "the scale must be a positive finite number")
        check(label, False, f"scale {s[bad].item()!r} for {'row ' + str(bad) if row_wise else 'x'}: {hint}")
    nan_x, nan_q = torch.isnan(xf), torch.isnan(qf)
    over = (xf.abs() / s).where(finite, 0.0).amax()
    if (nan_q & ~nan_x).any() or torch.isinf(qf).any():
        if fmt.dialect == "fnuz" and bool((amax / s > fmax * 1.01).any()) and bool((amax / s <= 448 * 1.01).all()):
            hint = (f"values above {fmax:g} became NaN: 448 is e4m3fn's largest value, {fmt.name}'s is {fmax:g} (the "
                    "FNUZ dialect): take the max from torch.finfo(dtype).max")
        else:
            hint = (f"values beyond ±{fmax:g} turned into {'inf' if torch.isinf(qf).any() else 'NaN'}: the scale must make "
                    f"the largest finite |x| at most {fmax:g}, and clamp x / scale to ±max before the cast")
        check(label, False, hint)
    if (nan_x & ~nan_q).any():
        check(label, False, "a NaN in x came out as a number: NaN must stay NaN (clamp keeps NaN; nan_to_num on x or "
              "a where() that zeroes it does not)")
    ratio = amax / s
    used = amax > 0
    # a NaN in the amax makes `amax > 0` false, so the scale falls back to 1: too small or too large a range after
    has_nan = torch.isnan(xf).any(dim=1, keepdim=True) if row_wise else torch.isnan(xf).any().reshape(1, 1)
    off = (ratio > fmax * (1 + 1e-5)) | (ratio < fmax / 2 * (1 - 1e-5))
    if bool((has_nan & (s == 1) & used & off).any()):
        check(label, False, "a NaN in x made the amax NaN (max propagates NaN), and its scale fell back to 1: take "
              "the amax over finite values (torch.where(x.isfinite(), x.abs(), 0))")
    if bool((ratio[used] > fmax * (1 + 1e-5)).any()) or over > fmax * (1 + 1e-5):
        inverted = bool(torch.allclose(s[used], (fmax / amax)[used], rtol=1e-3))
        check(label, False, "the scale is max / amax: the course's scale is the dequantization factor, amax / max, so "
              "that x ~ q * scale (torch._scaled_mm multiplies by it)" if inverted else
              f"the largest |x| / scale is {ratio.max().item():.4g}, above {fmax:g}: those values were clipped; "
              "scale = amax / torch.finfo(dtype).max")
    if bool((ratio[used] < fmax / 2 * (1 - 1e-5)).any()):
        bad = ratio[used].min().item()
        check(label, False, f"a scale maps its largest |x| to {bad:.4g}, below half the format's max ({fmax:g}): "
              "values lose precision to the smaller exponents (and the subnormals); scale = amax / max"
              + (" of each ROW (amax along dim=1)" if row_wise else ""))
    y = xf / s
    ok = finite & (y.abs() <= fmax)
    err = (qf - y).abs()
    bound = _fp8_step(y, fmt) / 2 + y.abs() * 1e-6      # a tie may go either way after float32's own rounding
    bad = ok & (err > bound)
    if bad.any():
        i, j = (int(v) for v in bad.nonzero()[0])
        check(label, False, f"q is not x / scale rounded to the nearest {fmt.name} value, e.g. x[{i}, {j}] / scale = "
              f"{y[i, j].item():.6g} became {qf[i, j].item():.6g}: divide x by the scale (the one you return) and cast "
              "with .to(dtype)")


# --- 3.7: the scaled epilogue of an FP8 matmul -------------------------------------------------------

def _fp8_operands(gen, m, n, k, dtype, b_layout):
    a = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    b = (torch.randn(n, k, generator=gen) * 4).to(dtype).T if b_layout == "column-major" else \
        (torch.randn(k, n, generator=gen) * 4).to(dtype)
    return a, b


def _fp8_scales(gen, m, n, row_wise):
    if row_wise:
        sa, sb = torch.rand(m, 1, generator=gen) * 8 + 0.05, torch.rand(1, n, generator=gen) * 0.5 + 0.01
        if abs(math.log2(float(sa[0, 0] * sb[0, 0]))) < 0.5:   # "the first scale only" would equal "no scales"
            sa[0, 0] *= 4
        return sa, sb
    # per tensor: what each mistake computes (acc times 1, sa, sb, 1 / (sa sb)) and the right sa sb all at least
    # 1.4x apart, so that every mistake's product differs from the right one and from every other mistake's by more
    # than the hints' 10 % and each slip gets its own hint
    def apart(sa, sb):
        logs = [0.0, math.log2(sa), math.log2(sb), -math.log2(sa * sb), math.log2(sa * sb)]
        return all(abs(x - y) >= 0.5 for i, x in enumerate(logs) for y in logs[i + 1:])

    while True:                           # a few draws at most: most scale_b values leave several exponents
        sb = 0.11 + 0.6 * float(torch.rand(1, generator=gen))
        exponents = [e for e in range(-5, 6) if apart(1.37 * 2.0 ** e, sb)]
        if exponents:
            e = exponents[int(torch.randint(0, len(exponents), (1,), generator=gen))]
            return torch.tensor(1.37 * 2.0 ** e), torch.tensor(sb)


def check_fp8_matmul(fp8_matmul, device="cpu"):
    """fp8_matmul(a, b, scale_a, scale_b, out_dtype) against (a * scale_a) @ (b * scale_b) in float64, per tensor and
    row-wise, at printed and fresh sizes (ragged, B column- and row-major, scales far from 1 and different per row and
    column), out_dtype bfloat16 and float32; a hint for each usual slip of the epilogue."""
    dtype = fp8.e4m3_of(fp8.arch_of(device))
    rng = random.Random(grading_guard.fresh_seed())
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    big = 300 if str(device).startswith("cuda") else 80
    shapes = [(64, 64, 64), (37, 37, 50)] + [(rng.randrange(1, big), rng.randrange(1, big), rng.randrange(1, big))
                                             for _ in range(2)]
    for i, (m, n, k) in enumerate(shapes):
        for row_wise in (False, True):
            out_dtype = torch.float32 if i == 1 else torch.bfloat16
            a, b = _fp8_operands(gen, m, n, k, dtype, "row-major" if i == 2 else "column-major")
            sa, sb = _fp8_scales(gen, m, n, row_wise)
            a, b, sa, sb = (t.to(device) for t in (a, b, sa, sb))
            label = f"fp8_matmul {m}x{n}x{k}, {'row-wise' if row_wise else 'per-tensor'} scales, {str(out_dtype)[6:]} out"
            c = call_answer(label, fp8_matmul, (a, b, sa, sb, out_dtype), f"a {m}x{k}, b {k}x{n}",
                            hint=lambda e: "; scale_a holds M values (rows: offs_m), scale_b N (columns: offs_n)"
                            if "out of bounds" in str(e).lower() or "illegal" in str(e).lower() else "",
                            names=["a", "b", "scale_a", "scale_b", "out_dtype"])
            if not isinstance(c, torch.Tensor) or tuple(c.shape) != (m, n) or c.dtype != out_dtype:
                check(label, False, f"return an {m}x{n} {out_dtype} tensor, not {_describe(c)}")
            _check_fp8_product(label, c, a, b, sa, sb, out_dtype)
    print("PASS: fp8_matmul's scaled epilogue: per tensor and row-wise, ragged sizes, both B layouts, bfloat16 and "
          "float32 out, fresh inputs")


def _check_fp8_product(label, c, a, b, sa, sb, out_dtype):
    acc = a.double().cpu() @ b.double().cpu()
    sa64, sb64 = sa.double().cpu().reshape(-1, 1), sb.double().cpu().reshape(1, -1)
    want = acc * sa64 * sb64
    got = c.double().cpu()
    # float32 out: Hopper's FP8 tensor cores accumulate with fewer bits than FP32 (7e-5 seen on an H200 at K = 50)
    tol = 1e-3 if out_dtype == torch.float32 else 1e-2
    rel = lambda ref: ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    if rel(want) <= tol:
        return
    m, n = acc.shape
    models = [(acc, "the scales are missing: multiply the accumulator by scale_a and scale_b"),
              (acc * sa64, "only scale_a is applied: multiply by scale_b too"),
              (acc * sb64, "only scale_b is applied: multiply by scale_a too"),
              (acc / sa64 / sb64, "the accumulator is divided by the scales: x ~ q * scale, so the product multiplies"),
              (acc * sa64.reshape(-1)[0] * sb64.reshape(-1)[0],
               "one scale for every row and column: row-wise, load scale_a at the tile's rows (offs_m) and scale_b at "
               "its columns (offs_n)")]
    if m == n and sa64.numel() == m and sb64.numel() == n:
        models.append((acc * sb64.reshape(-1, 1) * sa64.reshape(1, -1),
                       "scale_a went along the columns and scale_b along the rows: scale_a[offs_m][:, None], "
                       "scale_b[offs_n][None, :]"))
    differs = lambda ref: ((ref - want).norm() / want.norm().clamp_min(1e-300)).item() > 0.1
    hint = next((h for ref, h in models if differs(ref) and rel(ref) <= max(tol, 1e-2)),
                "compute acc * scale_a * scale_b: per tensor one value each, row-wise scale_a per row and scale_b per column")
    check(label, False, f"relative error {rel(want):.3g} against (a * scale_a) @ (b * scale_b): {hint}")
