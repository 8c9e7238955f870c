"""Lab 01's graders (exercises 1.1-1.4) and the layouts that triton_add and the hand-written kernels must get right."""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable

import torch

from utils import isa
from utils.exercises import check


def _fail_unless(name, ok, hint):
    """check() that prints nothing when it passes (the caller prints one PASS line for many cases)."""
    if not ok:
        check(name, False, hint)


# --- 1.1: the HIP port, compiled by hipcc and compared with hipify's ------------------------------------

def _compiler_hint(stderr: str) -> str:
    """One hint from hipcc's first error."""
    first = next((line for line in stderr.splitlines() if "error:" in line), stderr.strip()[:200])
    name = re.search(r"(?:undeclared identifier|unknown type name|no type named|no member named) '(\w+)'", first)
    name = name.group(1) if name else ""
    if "cuda_runtime.h' file not found" in first:
        return "<cuda_runtime.h> is CUDA's header; HIP's is <hip/hip_runtime.h>"
    if name.lower().startswith("cuda"):
        return f"{name} is CUDA's name; HIP's is hip{name[4:]}"
    if name in ("blockIdx", "blockDim", "threadIdx", "gridDim") or name.startswith("hip"):
        return f"{name} is not declared: #include <hip/hip_runtime.h> (it declares the HIP runtime and the kernel built-ins)"
    return "hipcc could not compile it: " + first.split("error:", 1)[-1].strip()


def _kernel_body(asm: isa.Compiled, name: str) -> str | None:
    """The assembly of kernel `name` (its mangled label to the end of the function)."""
    m = re.search(rf"^_Z{len(name)}{name}\w*:[^\n]*\n(.*?)^\.Lfunc_end", asm.text, re.M | re.S)
    return m.group(1) if m else None


# What saxpy must still do, seen in its CDNA machine code (pattern, what it is, the hint when it is missing)
SAXPY_PARTS = [
    (r"\bv_fmac?_f32", "a * x[i] + y[i] (a fused multiply-add)", "saxpy computes y[i] = a * x[i] + y[i]: keep the "
                                                                 "kernel exactly as in CUDA"),
    (r"\bglobal_load_dword\b", "the loads of x[i] and y[i]", "saxpy reads x[i] and y[i]: keep the kernel as in CUDA"),
    (r"\bglobal_store_dword\b", "the store of y[i]", "saxpy writes y[i]: keep the kernel as in CUDA"),
    (r"\bv_cmp_\w+", "the bounds check i < n", "the bounds check if (i < n) is gone: the last block overhangs n"),
]


def check_hip_port(mine: str, cuda_source: str, compile_port: Callable) -> None:
    """Compile the port with `compile_port` (the lab's hipcc helper: device code for one CDNA architecture
    and the host code) and compare what it became with hipify's translation of the same CUDA program;
    on a ROCm GPU, also run it."""
    check("saxpy_hip returns the port as a string", isinstance(mine, str) and "main" in mine,
          "return the whole HIP program (kernel and main) as one string")
    try:
        ref_dev, ref_host = compile_port(isa.hipify(cuda_source, "saxpy.cu"))
        try:
            dev, host = compile_port(mine)
        except isa.CompileError as err:
            check("the port compiles with hipcc", False, _compiler_hint(str(err)))
    except isa.ToolMissing:
        if "hipcc" in isa.required_tools():
            raise
        print("NOTE: hipcc is not installed (Debian/Ubuntu: apt-get install hipcc), so your port was not compiled: "
              "only CUDA names left in it are looked for")
        left = sorted(set(re.findall(r"\bcuda\w*", mine)))
        check("no CUDA names left", not left, f"{left[0] if left else ''} is a CUDA name: HIP's is hip...")
        return
    check(f"the port compiles with hipcc (device code for {dev.target}, host code)", True, "")
    body = _kernel_body(dev, "saxpy")
    check("the machine code has the kernel saxpy", body is not None, "keep the kernel's name and signature: "
          "__global__ void saxpy(int n, float a, const float* x, float* y)")
    ref_body = _kernel_body(ref_dev, "saxpy")
    for pattern, what, hint in SAXPY_PARTS:
        mine_n, ref_n = len(re.findall(pattern, body)), len(re.findall(pattern, ref_body))
        check(f"saxpy's machine code has {what}", mine_n >= ref_n, hint)
    calls = lambda asm: Counter(re.findall(r"\bcall[lq]?\s+(hip\w+)", asm.text))
    missing = calls(ref_host) - calls(host)
    if "hipLaunchKernel" in missing:
        check("main launches saxpy", False, "saxpy is never launched: keep saxpy<<<grid, block>>>(...) "
                                            "(or hipLaunchKernelGGL(saxpy, grid, block, 0, 0, ...))")
    name = next(iter(missing), "")
    check("main makes every runtime call hipify's port makes", not missing,
          f"hipify's port calls {name} {calls(ref_host)[name]} times, yours {calls(host)[name]}: keep every "
          "runtime call of the CUDA program, renamed")
    if torch.cuda.is_available() and torch.version.hip:
        try:
            printed = isa.run_program(mine, "rocm")
        except isa.CompileError as err:
            printed = str(err)
        check("the port runs on this GPU and gets every element right", "0 of" in printed and "no error" in printed,
              f"it printed: {printed[-300:]}")


# --- 1.2: add_kernel, through a wrapper fn(x, y, out), on contiguous tensors -------------------------------

GUARD = 1024  # poisoned elements around the checkers' tensors (a whole BLOCK: an unmasked program stays inside)


def _guarded(n, device, dtype=torch.float32, fill=None, offset=0, seed=0):
    """A tensor of n elements inside a larger buffer, and the buffer: random values inside, `fill`
    (default: random too) in the GUARD elements on each side. `offset` shifts the start by that many
    elements (1: not 16-byte aligned)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(n + 2 * GUARD + offset, generator=gen).to(device=device, dtype=dtype)
    if fill is not None:
        buf[:GUARD + offset] = fill
        buf[GUARD + offset + n:] = fill
    return buf[GUARD + offset:GUARD + offset + n], buf


def check_add(name, fn, block=1024, sizes=(1, 17, 97, 1024, 1025, 4099), device="cpu",
              dtypes=(torch.float32,)):
    """Check fn(x, y, out) -> out = x + y on contiguous tensors of awkward sizes, with a poisoned
    out (NaN) inside a poisoned buffer; one hint per failure mode. `block`: the elements per program
    of the kernel behind fn, to tell a wrong program offset from other errors."""
    for dtype in dtypes:
        for k, n in enumerate(sizes):
            x, _ = _guarded(n, device, dtype, seed=2 * k)
            y, _ = _guarded(n, device, dtype, seed=2 * k + 1, offset=k % 2 * 4)
            out, buf = _guarded(n, device, dtype, fill=float("nan"), offset=(k % 3 == 2))
            out.fill_(float("nan"))
            fn(x, y, out)
            want = x + y
            where = f"n={n}, {str(dtype).removeprefix('torch.')}"
            outside = torch.cat([buf[:GUARD + (k % 3 == 2)], buf[GUARD + (k % 3 == 2) + n:]])
            _fail_unless(f"{name}: nothing written outside out ({where})", bool(outside.isnan().all()),
                         f"an element past the end of out was written (n={n}): mask the store too, with "
                         "mask = offsets < n (not <=)")
            wrong = (out != want).nonzero().flatten().tolist()      # NaN (never written) differs too
            i = wrong[0] if wrong else 0
            if wrong and n > block and i >= block:
                hint = (f"the first {block} elements are right and element {i} is not (n={n}): program pid "
                        f"must start at element pid * BLOCK (pid = tl.program_id(0))")
            elif wrong and out[i].isnan():
                hint = (f"out[{i}] of n={n} was never written: every offset < n must be stored "
                        "(mask = offsets < n)")
            else:
                hint = (f"out[{i}] = {out[i].item():.6g} but x[{i}] + y[{i}] = {want[i].item():.6g} (n={n}): "
                        "store the sum of the loaded x and y")
            _fail_unless(f"{name} matches x + y ({where})", not wrong, hint)
    check(f"{name} matches x + y for n in {list(sizes)}, "
          + ", ".join(str(d).removeprefix("torch.") for d in dtypes), True, "")


# --- any layout: what triton_add and the hand-written kernels' binding must get right ------------------------

def layouts(device="cpu", dtype=torch.float32, n=97, seed=0):
    """(name, x, y, out) for the layouts real code hands an elementwise kernel, each holding n or about
    n elements; out is NaN-filled and, where strided, a view into a NaN buffer."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    nan = lambda *shape: torch.full(shape, float("nan"), device=device, dtype=dtype)
    rows, cols = max(1, n // 7), 7
    qkv = r(rows, 3 * cols)
    return [
        ("contiguous", r(n), r(n), nan(n)),
        ("x[::2]", r(2 * n)[::2], r(n), nan(n)),
        ("out[::2]", r(n), r(n), nan(2 * n)[::2]),
        ("offset by one element", r(n + 1)[1:], r(n + 1)[1:], nan(n + 1)[1:]),
        ("x.T (2-D)", r(cols, rows).T, r(rows, cols), nan(rows, cols)),
        ("x.T, y.T and out.T", r(cols, rows).T, r(cols, rows).T, nan(cols, rows).T),
        ("expand: a row broadcast", r(1, cols).expand(rows, cols), r(rows, cols), nan(rows, cols)),
        ("expand: one value", r(1).expand(n), r(n), nan(n)),
        ("a column slice of a fused projection", qkv[:, :cols], qkv[:, cols:2 * cols], nan(rows, cols)),
        ("heads transposed (B, N, H, D) -> (B, H, N, D)", r(2, rows, 3, 4).transpose(1, 2),
         r(2, 3, rows, 4), nan(2, 3, rows, 4)),
        ("5-D, permuted", r(2, 3, 2, 3, 2).permute(4, 2, 0, 3, 1), r(2, 2, 2, 3, 3),
         nan(2, 2, 2, 3, 3)),
        ("0-d", r(), r(), nan()),
        ("empty", r(0, 3), r(0, 3), nan(0, 3)),
    ]


def check_layouts(name, fn, device="cpu", dtype=torch.float32, n=97, names=None):
    """fn(x, y, out) gives exactly torch.add's result in every layout of `layouts`, and writes nothing
    of out's buffer outside out's elements."""
    for what, x, y, out in layouts(device, dtype, n):
        if names is not None and what not in names:
            continue
        base = out if out._base is None else out._base          # the buffer out is a view of
        fn(x, y, out)
        want = torch.add(x, y)
        inside = torch.zeros_like(base, dtype=torch.bool)
        inside.as_strided(out.shape, out.stride(), out.storage_offset() - base.storage_offset()).fill_(True)
        outside_ok = bool(base[~inside].isnan().all())
        check(f"{name}: {what}", torch.equal(out, want) and outside_ok,
              f"{'wrong values' if not torch.equal(out, want) else 'wrote outside out'} for {what} "
              f"(shape {tuple(out.shape)}, strides x {x.stride()}, y {y.stride()}, out {out.stride()})")


# --- 1.3: the strides of GPT-2's q ----------------------------------------------------------------------

def check_q_strides(predict, gpt2_qkv):
    """The prediction against what torch reports for q of `gpt2_qkv(batch, seq, heads, head_dim)` (the
    lab's function), for several shapes (one is not enough: a formula must hold for all)."""
    for b, n, h, d in [(2, 5, 3, 4), (1, 7, 2, 8), (3, 2, 4, 16), (2, 9, 12, 64)]:
        q, _, _ = gpt2_qkv(b, n, h, d)
        got, want = tuple(predict(b, n, h, d)), tuple(q.stride())
        e = h * d
        hints = {
            (h * n * d, n * d, d, 1): "those are the strides of a contiguous (batch, heads, seq, head_dim) tensor; "
                                      "q is a view, nothing was copied: it still steps through qkv's rows",
            (n * e, d, e, 1): "one token's row of qkv is 3*E long (q, k and v side by side), not E",
            (n * 3 * e, 3 * e, d, 1): "that is before transpose(1, 2), which swaps the strides of the heads "
                                      "and of the tokens",
        }
        _fail_unless(f"q.stride() for batch={b}, seq={n}, heads={h}, head_dim={d}", got == want,
                     f"you predicted {got}; torch says {want}. " + hints.get(got, "Step through qkv: the next token "
                                                                             "is 3*E elements on, the next head "
                                                                             "head_dim on"))
    check("predict_q_strides matches q.stride() for 4 shapes", True, "")


# --- 1.4: add_rows_kernel, through triton_add_rows, on rows that lie anywhere ------------------------------

def _rows_case(rows, cols, device="cpu", dtype=torch.float32, seed=0):
    """x: the middle third of a fused projection's rows (row stride 3*cols), y: contiguous rows, out:
    rows inside a wider NaN buffer (row stride cols + 5); every tensor is a view into a buffer with
    room behind it, so wrong strides read and write memory the check can see."""
    gen = torch.Generator().manual_seed(seed)
    room = 4 * (rows + 1) * (3 * cols + 8)
    xbuf = torch.randn(room, generator=gen).to(device=device, dtype=dtype)
    ybuf = torch.randn(room, generator=gen).to(device=device, dtype=dtype)
    obuf = torch.full((room,), float("nan"), device=device, dtype=dtype)
    x = xbuf.as_strided((rows, cols), (3 * cols, 1), cols)
    y = ybuf.as_strided((rows, cols), (cols, 1), 0)
    out = obuf.as_strided((rows, cols), (cols + 5, 1), 0)
    return x, y, out, xbuf, obuf


def check_rows(name, fn, device="cpu", cases=((1, 1), (3, 17), (5, 97), (2, 1100), (7, 33)), dtype=torch.float32):
    """fn(x, y, out) -> out = x + y on row layouts (see _rows_case) of awkward sizes; one hint per
    failure mode."""
    for k, (rows, cols) in enumerate(cases):
        x, y, out, xbuf, obuf = _rows_case(rows, cols, device, dtype, seed=k)
        fn(x, y, out)
        want = x + y
        where = f"{rows} rows of {cols}"
        inside = torch.zeros_like(obuf, dtype=torch.bool)
        inside.as_strided(out.shape, out.stride(), 0).fill_(True)
        stray = bool((~obuf.isnan() & ~inside).any())
        bad = (out != want).nonzero().tolist()                   # NaN (never written) differs too
        _fail_unless(f"{name}: nothing written outside out ({where})", not stray,
                     "wrote past the end of a row: mask the columns with cols < n_cols" if not bad else
                     "stored outside out's rows: out's rows are out_row_stride apart (every tensor has its own "
                     "row stride)")
        r, c = bad[0] if bad else (0, 0)
        if bad and rows > 1 and torch.equal(out, xbuf.as_strided((rows, cols), (cols, 1), cols) + y):
            hint = (f"x's rows are x_row_stride apart ({x.stride(0)} here: a slice of a fused projection), "
                    "not n_cols: load row r at x_ptr + r * x_row_stride")
        elif bad and out[r, c].isnan():
            hint = (f"out[{r}, {c}] was never written ({where}): program pid covers row pid // blocks_per_row "
                    "and the columns of block pid % blocks_per_row")
        else:
            hint = (f"out[{r}, {c}] = {out[r, c].item():.6g} but x[{r}, {c}] + y[{r}, {c}] = {want[r, c].item():.6g} "
                    f"({where}): load x and y at their own row strides, add, store")
        _fail_unless(f"{name} matches x + y ({where})", not bad, hint)
    check(f"{name} matches x + y for (rows, columns) in {list(cases)}", True, "")
