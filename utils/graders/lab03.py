"""Lab 03's graders (exercises 3.1-3.5) and the error measure and tolerances its checks of a BF16 matmul use."""
import torch
import triton

from utils import solutions
from utils.exercises import check

TOLERANCE = {"cuda": 1e-2, "rocm": 2e-2, "cpu": 1e-2}   # relative Frobenius error of a BF16 product


def rel_error(c, a, b):
    """|c - a @ b| / |a @ b| (Frobenius), against a float64 product of the same inputs."""
    ref = a.double() @ b.double()
    return ((c.double() - ref).norm() / ref.norm()).item()


# --- 3.1: FLOP per byte ------------------------------------------------------------------------------

def check_intensity(intensity):
    """The prediction against 2 n^3 FLOPs over 3 n^2 BF16 values of 2 bytes at a few sizes, with a hint per usual slip."""
    for n in (64, 1000, 4096):
        want = 2 * n**3 / (2 * 3 * n**2)
        got = intensity(n)
        ratio = got / want if isinstance(got, (int, float)) and got == got else float("nan")
        hints = {0.5: "half the answer: count 2 FLOPs per term (a multiply and an add) and 2 bytes per BF16 value",
                 2.0: "twice the answer: a BF16 value takes 2 bytes",
                 1.5: "you moved only A and B: C is written too (3 matrices of n*n values)",
                 0.25: "a quarter of the answer: that is FP32's 4 bytes per value, and one FLOP per term"}
        hint = next((h for r, h in hints.items() if abs(ratio - r) < 1e-6), "2 n^3 FLOPs over 3 n^2 values of 2 bytes")
        check(f"intensity({n})", abs(ratio - 1) < 1e-6, f"got {got!r}, expected {want:.6g}: {hint}")


# --- 3.2: the K loop ---------------------------------------------------------------------------------

def nan_after(t: torch.Tensor) -> torch.Tensor:
    """The values of `t` in fresh memory followed by NaNs: a kernel that reads past the end gets NaN."""
    buf = torch.full((t.numel() + 256 * max(t.shape),), float("nan"), dtype=t.dtype, device=t.device)
    buf[:t.numel()] = t.reshape(-1)
    return buf[:t.numel()].view(t.shape)


def _operands(m, n, k, gen, device, dtype=torch.bfloat16, layout="contiguous"):
    """A (m x k) and B (k x n), NaN after each in memory, laid out as "contiguous", "a.T" (A is a
    transposed view) or "b.T"."""
    def make(rows, cols, transposed):
        t = torch.randn(cols, rows, generator=gen) if transposed else torch.randn(rows, cols, generator=gen)
        t = nan_after(t.to(device, dtype))
        return t.T if transposed else t
    return make(m, k, layout == "a.T"), make(k, n, layout == "b.T")


# Each stage adds what the one before did not test, so the first failing stage names the mistake.
MATMUL_STAGES = [
    ("one full K step", [(64, 48, 32, "contiguous"), (33, 17, 32, "contiguous")],
     "wrong with a single K step (K = BLOCK_K): load a at a_ptrs and b at b_ptrs, a masked along its columns "
     "(offs_k[None, :]) and b along its rows (offs_k[:, None])"),
    ("several K steps", [(64, 64, 128, "contiguous"), (32, 48, 256, "contiguous")],
     "right for one K step, wrong for several: after the loads, move both pointers one step along K "
     "(a_ptrs += BLOCK_K * stride_ak; b_ptrs += BLOCK_K * stride_bk)"),
    ("a ragged last K step", [(100, 70, 90, "contiguous"), (1, 17, 97, "contiguous"), (64, 48, 200, "contiguous")],
     "right when K is a multiple of BLOCK_K, wrong when the last step overhangs K: mask the loads with "
     "offs_k < K - k * BLOCK_K (strictly less) and other=0.0"),
    ("transposed inputs", [(100, 70, 90, "a.T"), (17, 97, 50, "b.T")],
     "right for contiguous matrices, wrong for transposed ones: move the pointers by BLOCK_K * stride_ak and "
     "BLOCK_K * stride_bk, the strides the wrapper passes, not by BLOCK_K"),
]


def check_matmul(matmul, device="cpu"):
    """A matmul of BF16 matrices against a float64 product of the same inputs, stage by stage."""
    backend = "cpu" if str(device) == "cpu" else ("rocm" if torch.version.hip else "cuda")
    tolerance = TOLERANCE[backend]
    gen = torch.Generator().manual_seed(3)
    for stage, shapes, hint in MATMUL_STAGES:
        for m, n, k, layout in shapes:
            a, b = _operands(m, n, k, gen, device, layout=layout)
            c = matmul(a, b)
            if tuple(c.shape) != (m, n):
                check(f"{stage}: result shape", False, f"C must be {m}x{n}, got {tuple(c.shape)}")
            err = rel_error(c, a, b)
            if torch.isnan(c).any():
                check(f"{stage}: {m}x{n}x{k} ({layout})", False, "NaN in C: a load read past the end of a matrix (the "
                      "checker puts NaN there): mask both loads with offs_k < K - k * BLOCK_K (strictly less), other=0.0")
            if not err < tolerance:
                check(f"{stage}: {m}x{n}x{k} ({layout})", False, f"relative error {err:.2e}, tolerance {tolerance:g}: {hint}")
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
        check(f"{target}: {want} per K step", got == want, tile_hints[target].get(got, f"you said {got!r}; count the "
              "instructions' tiles in the program's C tile (split between its warps) times BLOCK_K over their K"))


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
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randn(max(n - len(special), 0), generator=gen) * 10.0 ** torch.randint(-6, 7, (max(n - len(special), 0),), generator=gen)
    return torch.cat([torch.tensor(special, dtype=torch.float32), rest.float()])[:n]


def check_tf32_round(tf32_round, device="cpu"):
    """tf32_round(x) bit for bit against the course's to_tf32 (round to nearest, ties away), with a hint per mistake."""
    to_tf32 = solutions.load("03").to_tf32
    for n in (1, 17, 22, 1000, 4097):
        x = tf32_test_values(n, seed=n).to(device)
        try:
            y = tf32_round(x)
        except RuntimeError as err:
            check(f"TF32 rounding of {n} values", False, str(err))
        if y.shape != x.shape or y.dtype != torch.float32:
            check(f"TF32 rounding of {n} values", False, f"return float32 values of x's shape {tuple(x.shape)}, "
                  f"got {y.dtype} {tuple(y.shape)}")
        want, got, xb = _bits(to_tf32(x)).cpu(), _bits(y).cpu(), _bits(x).cpu()
        nan = torch.isnan(x).cpu()
        wrong = ~((got == want) | (nan & torch.isnan(y).cpu()))
        if not wrong.any():
            continue
        first = int(wrong.nonzero()[0])
        example = f"x = {x[first].item()!r} gave {y[first].item()!r}, TF32 keeps {to_tf32(x)[first].item()!r}"
        if torch.equal(got[~nan], xb[~nan]):
            hint = "y equals x: clear the 13 low mantissa bits (bits & -0x2000) after adding 0x1000"
        elif torch.equal(got[~nan], (xb & -0x2000)[~nan]):
            hint = "you cleared the 13 low bits without rounding: add half a TF32 step (0x1000) to the bits first"
        elif torch.equal(got[~nan], ((xb + 0x8000) & -0x10000)[~nan]):
            hint = "that keeps 7 mantissa bits (bfloat16); TF32 keeps 10: clear 13 bits, adding 0x1000"
        else:
            hint = "round the bits: ((bits + 0x1000) & -0x2000), viewing x as int32 and the result as float32"
        check(f"TF32 rounding of {n} values", False, f"{int(wrong.sum())} wrong, e.g. {example}: {hint}")
    print("PASS: TF32 rounding, bit for bit: ties, both signs, the edges of FP32's range, NaN, ragged sizes")


# --- 3.5: a tile configuration -----------------------------------------------------------------------

def check_config(config, device="cpu"):
    """A triton.Config the kernel can run: tile sizes, warps and stages in range; then the K-loop check with it,
    through the course's matmul_with (so it grades the configuration, whatever state exercise 3.2 is in)."""
    check("a triton.Config", isinstance(config, triton.Config), "return triton.Config({...}, num_warps=..., num_stages=...)")
    kw = config.kwargs
    missing = sorted({"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"} - set(kw))
    check("names the tile sizes and GROUP_M", not missing, f"add {missing} to the config's dictionary")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = kw[name]
        check(f"{name} = {v} is a power of two from 16 to 256", isinstance(v, int) and 16 <= v <= 256 and v & (v - 1) == 0,
              "tl.arange and tl.dot need powers of two; the matrix instructions need at least 16")
    check("GROUP_M >= 1", isinstance(kw["GROUP_M"], int) and kw["GROUP_M"] >= 1, "GROUP_M is a count of tile rows")
    check("num_warps is 1, 2, 4, 8 or 16", config.num_warps in (1, 2, 4, 8, 16), f"num_warps={config.num_warps}")
    check("num_stages from 1 to 6", isinstance(config.num_stages, int) and 1 <= config.num_stages <= 6, f"num_stages={config.num_stages}")
    lab = solutions.load("03")
    try:
        check_matmul(lab.matmul_with(config), device)
    except triton.runtime.errors.OutOfResources as err:
        check("fits this GPU", False, f"{err}. The tiles take {lab.tile_bytes(config) / 1024:.0f} KiB of shared memory: "
              "use smaller tiles or fewer stages")
