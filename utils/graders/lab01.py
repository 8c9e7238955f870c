"""Lab 01's graders (exercises 1.1-1.4) and the layouts that triton_add and the hand-written kernels must get right."""
from __future__ import annotations

import contextlib
import re
import sys
from collections import Counter
from typing import Callable

import numpy as np
import torch

from utils import isa
from utils.exercises import ExerciseFailed, check, is_not_done


def _fail_unless(name, ok, hint):
    """check() that prints nothing when it passes (the caller prints one PASS line for many cases)."""
    if not ok:
        check(name, False, hint)


def _call(name: str, where: str, fn, *args):
    """fn(*args), or a hint naming the input (`where`) and what the learner's code raised; a stub's own
    exception goes on (NOT DONE)."""
    try:
        return fn(*args)
    except ExerciseFailed:
        raise
    except Exception as err:
        if is_not_done(err):
            raise
        text = (str(err).strip().split("\n") or [""])[0][:240]
        check(name, False, f"raised {type(err).__name__} for {where}: {text}")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}, strides {t.stride()}"


@contextlib.contextmanager
def _watched():
    """Under Triton's CPU interpreter, the byte addresses that kernels load from and store to while the block
    runs ({"load": [...], "store": [...]}, masked-off lanes left out). Compiled kernels (a GPU) are not
    seen: the lists stay empty, and a read past the end that changes no output goes unnoticed there."""
    interp = sys.modules.get("triton.runtime.interpreter")
    seen = {"load": [], "store": []}
    if interp is None:
        yield seen
        return
    builder = interp.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def picked(ptrs, mask):
        return np.asarray(ptrs.data)[np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))]

    def watched_load(self, ptrs, mask, *rest):
        seen["load"].append(picked(ptrs, mask))
        return load(self, ptrs, mask, *rest)

    def watched_store(self, ptrs, value, mask, *rest):
        seen["store"].append(picked(ptrs, mask))
        return store(self, ptrs, value, mask, *rest)

    builder.create_masked_load, builder.create_masked_store = watched_load, watched_store
    try:
        yield seen
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store


def _addresses(t: torch.Tensor) -> np.ndarray:
    """The byte address of every element of a (strided) tensor."""
    off = np.zeros((), dtype=np.int64)
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = size
        off = off + np.arange(size, dtype=np.int64).reshape(shape) * stride
    return (np.uint64(t.data_ptr()) + off.reshape(-1).astype(np.uint64) * np.uint64(t.element_size()))


def _stray(seen: list, allowed: list[torch.Tensor], buffers: list[torch.Tensor]) -> np.ndarray:
    """The watched addresses inside the checker's `buffers` (tensors with guard memory around them) but outside
    every tensor of `allowed` (a wrapper's own temporaries are no business of the check)."""
    if not seen:
        return np.zeros(0, dtype=np.uint64)
    got = np.unique(np.concatenate([a.reshape(-1).astype(np.uint64) for a in seen]))
    inside = np.zeros(got.shape, dtype=bool)
    for b in buffers:
        lo = b.data_ptr()
        inside |= (got >= np.uint64(lo)) & (got < np.uint64(lo + b.numel() * b.element_size()))
    got = got[inside]
    return got[~np.isin(got, np.concatenate([_addresses(t) for t in allowed]))]


def _nearest(strays: np.ndarray, tensors: dict) -> str:
    """The stray address nearest the end (or start) of one of `tensors`, as that tensor's element: 'x[1024]'
    (past x's elements), 'x[-3]' (before its first)."""
    best = None                           # ties go to the first tensor named (x before y), not to memory order
    for name, t in tensors.items():
        for addr in strays[:4096]:
            i = (int(addr) - t.data_ptr()) // t.element_size()
            gap = i - (t.numel() - 1) if i >= t.numel() else -i
            if best is None or gap < best[0]:
                best = (gap, f"{name}[{i}]")
    return best[1]


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


def _args(text: str, start: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose '(' is at text[start]."""
    depth, args, cur = 0, [], ""
    for ch in text[start:]:
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append(cur.strip())
                return args
        elif ch == "," and depth == 1:
            args.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return args


def _copy_hint(source: str) -> str | None:
    """What is wrong with the port's hipMemcpy calls, read from its source: the direction named by each kind
    against where its destination and source live (device: a pointer from hipMalloc), and the copy of the
    result back to the host after the launch. None: nothing seen wrong (only a run proves the copies right)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)
    device = set(re.findall(r"\bhipMalloc\s*\(\s*(?:\([^()]*\)\s*)?&\s*(\w+)", code))
    if not device:
        return None
    side = lambda expr: "device" if set(re.findall(r"[A-Za-z_]\w*", expr)) & device else "host"
    launch = re.search(r"\bsaxpy\s*<<<|hipLaunchKernel(?:GGL)?\s*\(", code)
    back_after_launch = False
    for m in re.finditer(r"\bhipMemcpy(?:Async)?\s*(?=\()", code):
        args = _args(code, m.end())
        if len(args) < 4:
            continue
        dst, src, kind = args[0], args[1], args[3]
        named = re.search(r"hipMemcpy(Host|Device)To(Host|Device)", kind)
        call = f"hipMemcpy({dst}, {src}, ..., {kind})"
        if named and (side(dst), side(src)) == ("host", "device") and named.groups() == ("Host", "Device"):
            return (f"{call} copies the result back the wrong way: hipMemcpy(dst, src, bytes, kind) copies src "
                    "to dst, and the kind names that direction: from the GPU to the host is hipMemcpyDeviceToHost")
        if named and (side(dst), side(src)) == ("device", "host") and named.groups() == ("Device", "Host"):
            return (f"{call}: the destination comes first, hipMemcpy(dst, src, bytes, kind), and a copy from the "
                    "host to the GPU is hipMemcpyHostToDevice")
        if named and (named.group(1).lower(), named.group(2).lower()) != (side(src), side(dst)):
            return (f"{call}: its kind says {named.group(1)} to {named.group(2)}, but it copies from {side(src)} "
                    f"memory to {side(dst)} memory (hipMemcpy(dst, src, bytes, kind))")
        if side(src) == "device" and side(dst) == "host" and launch and m.start() > launch.start():
            back_after_launch = True
    if launch and not back_after_launch:
        return ("y is never copied back to the host after saxpy is launched: the check reads hy, so copy y into "
                "it after the launch (hipMemcpyDeviceToHost)")
    return None


def _inclusive_bound(body: str) -> bool:
    """Whether the kernel's bounds check compares i and n inclusively (i <= n): a v_cmp of the scalar n
    against the vector i that is 'ge' (n >= i) or, the other way round, 'le' (i <= n)."""
    for op, a, b in re.findall(r"\bv_cmp_(\w+?)_[iu]32(?:_e32|_e64)?\s+\w+(?:\[\d+:\d+\])?,\s*(\w)\w*,\s*(\w)\w*", body):
        if (a, b, op) in (("s", "v", "ge"), ("v", "s", "le")):
            return True
    return False


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
    and the host code) and compare what it became with hipify's translation of the same CUDA program: the
    kernel's machine code (its multiply-add, loads, store and a strict i < n bound), the runtime calls main
    makes, and, read from the source, the direction of every hipMemcpy against where its pointers live.
    This is inspection, not a run: without a ROCm GPU nothing proves that the program runs and gets every
    element right. On a ROCm GPU it is also run, and must print "no error, 0 of ... wrong"."""
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
        copies = _copy_hint(mine)
        check("every hipMemcpy copies the way its kind says", copies is None, copies or "")
        return
    check(f"the port compiles with hipcc (device code for {dev.target}, host code)", True, "")
    body = _kernel_body(dev, "saxpy")
    check("the machine code has the kernel saxpy", body is not None, "keep the kernel's name and signature: "
          "__global__ void saxpy(int n, float a, const float* x, float* y)")
    ref_body = _kernel_body(ref_dev, "saxpy")
    for pattern, what, hint in SAXPY_PARTS:
        mine_n, ref_n = len(re.findall(pattern, body)), len(re.findall(pattern, ref_body))
        check(f"saxpy's machine code has {what}", mine_n >= ref_n, hint)
    _fail_unless("saxpy's bounds check is i < n", not _inclusive_bound(body) or _inclusive_bound(ref_body),
                 "the bounds check lets i == n through (i <= n): that thread writes y[n], one past the end, whenever "
                 "n is not a multiple of the block; the bound is i < n")
    calls = lambda asm: Counter(re.findall(r"\bcall[lq]?\s+(hip\w+)", asm.text))
    missing = calls(ref_host) - calls(host)
    if "hipLaunchKernel" in missing:
        check("main launches saxpy", False, "saxpy is never launched: keep saxpy<<<grid, block>>>(...) "
                                            "(or hipLaunchKernelGGL(saxpy, grid, block, 0, 0, ...))")
    name = next(iter(missing), "")
    check("main makes every runtime call hipify's port makes", not missing,
          f"hipify's port calls {name} {calls(ref_host)[name]} times, yours {calls(host)[name]}: keep every "
          "runtime call of the CUDA program, renamed")
    copies = _copy_hint(mine)
    _fail_unless("every hipMemcpy copies the way its kind says", copies is None, copies or "")
    if torch.cuda.is_available() and torch.version.hip:
        try:
            printed = isa.run_program(mine, "rocm")
        except isa.CompileError as err:
            printed = str(err)
        check("the port runs on this GPU and gets every element right", "0 of" in printed and "no error" in printed,
              f"it printed: {printed[-300:]}")


# --- 1.2: add_kernel, through a wrapper fn(x, y, out), on contiguous tensors -------------------------------

GUARD = 1024  # poisoned elements around the checkers' tensors (a whole BLOCK: an unmasked program stays inside)
SENTINEL = 4096.0  # the poison around inputs (exact in float16 and bfloat16): a value built from it was read outside


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
    """Check fn(x, y, out) -> out = x + y on contiguous tensors of awkward sizes (none but 1024 a multiple of
    a block), x and y inside a buffer poisoned with SENTINEL, out NaN inside a NaN buffer; one hint per failure
    mode. `block`: the elements per program of the kernel behind fn, to tell a wrong program offset from other
    errors. Under Triton's interpreter every load and store address is also watched, so a kernel that masks
    its store but reads past n is caught; compiled on a GPU such a read changes no output and is not seen
    (the CPU run of the lab, and the course's tests, see it)."""
    for dtype in dtypes:
        for k, n in enumerate(sizes):
            x, xbuf = _guarded(n, device, dtype, fill=SENTINEL, seed=2 * k)
            y, ybuf = _guarded(n, device, dtype, fill=SENTINEL, seed=2 * k + 1, offset=k % 2 * 4)
            start = GUARD + (k % 3 == 2)
            out, buf = _guarded(n, device, dtype, fill=float("nan"), offset=(k % 3 == 2))
            out.fill_(float("nan"))
            x0, y0 = x.clone(), y.clone()
            where = f"n={n}, {str(dtype).removeprefix('torch.')}"
            with _watched() as seen:
                _call(f"{name}(x, y, out) ({where})", f"x, y and out of {n} contiguous "
                      f"{str(dtype).removeprefix('torch.')} elements", fn, x, y, out)
            want = x0 + y0
            _fail_unless(f"{name}: x and y are left as they are ({where})", torch.equal(x, x0) and torch.equal(y, y0),
                         "x or y changed: the kernel stored into an input; the sum goes to out_ptr + offsets")
            stores = _stray(seen["store"], [out], [xbuf, ybuf, buf])
            outside = torch.cat([buf[:start], buf[start + n:]])
            written = (~outside.isnan()).nonzero().flatten()
            if len(stores) or len(written):
                shifted = [s for s in (-2, -1, 1, 2) if 0 <= start + s
                           and torch.equal(buf[start + s:start + s + n], want)]
                before = bool((written < start).any()) or any(int(a) < out.data_ptr() for a in stores)
                past = (written[written >= start] - start + n).tolist()     # element indices past out's start
                if shifted:
                    hint = (f"out[i + {shifted[0]}] holds x[i] + y[i] (n={n}): the sum lands {abs(shifted[0])} "
                            f"element(s) {'late' if shifted[0] > 0 else 'early'}; store at the offsets you load from")
                elif before:
                    hint = (f"an element before out[0] was written (n={n}): store at out_ptr + offsets, offsets "
                            "from pid * BLOCK up")
                elif past == [n]:
                    hint = (f"out[{n}], one past the end, was written (n={n}): the mask is offsets < n "
                            "(not <=): offsets run from 0 to n-1")
                else:
                    hint = (f"an element past the end of out was written (n={n}): mask the store too, with "
                            "mask = offsets < n (not <=)")
                check(f"{name}: nothing written outside out ({where})", False, hint)
            wrong = (out != want).nonzero().flatten().tolist()      # NaN (never written) differs too
            i = wrong[0] if wrong else 0
            if wrong and n > block and i >= block and torch.equal(out[:block], want[:block]):
                hint = (f"the first {block} elements are right and element {i} is not (n={n}): program pid "
                        f"must start at element pid * BLOCK (pid = tl.program_id(0))")
            elif wrong and out[i].isnan():
                hint = (f"out[{i}] of n={n} was never written: every offset < n must be stored "
                        "(mask = offsets < n)")
            elif wrong and abs(float(out[i]) - float(want[i])) > SENTINEL / 2:
                hint = (f"out[{i}] = {out[i].item():.6g}, far from x[{i}] + y[{i}] = {want[i].item():.6g} (n={n}): "
                        "it was built from an element outside x or y; load at the offsets of this program's "
                        "elements, masked")
            elif wrong and any(n > abs(s) and torch.equal(out[max(0, -s):n - max(0, s)], want[max(0, s):n + min(0, s)])
                               for s in (-2, -1, 1, 2)):
                hint = (f"out[{i}] = {out[i].item():.6g} but x[{i}] + y[{i}] = {want[i].item():.6g} (n={n}): the "
                        "sums are right but stored at shifted elements; store at the offsets you load from")
            else:
                hint = (f"out[{i}] = {out[i].item():.6g} but x[{i}] + y[{i}] = {want[i].item():.6g} (n={n}): "
                        "store the sum of the loaded x and y")
            _fail_unless(f"{name} matches x + y ({where})", not wrong, hint)
            loads = _stray(seen["load"], [x, y, out], [xbuf, ybuf, buf])
            if len(loads):
                at = _nearest(loads, {"x": x, "y": y})
                check(f"{name}: nothing read outside x and y ({where})", False,
                      f"the kernel reads {at}, outside the {n} elements (n={n}); out is right, but on a GPU that "
                      "read touches memory that is not x's (another tensor's, or none: a crash): mask the loads "
                      "too, tl.load(..., mask=mask)")
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
        call = f"predict_q_strides({b}, {n}, {h}, {d})"
        got = _call(call, f"batch={b}, seq={n}, heads={h}, head_dim={d}", predict, b, n, h, d)
        want = tuple(q.stride())
        try:
            got = tuple(int(s) for s in got)
        except (TypeError, ValueError):
            check(call, False, f"returned {got!r}: return 4 integers, the strides of (batch, heads, seq, head_dim)")
        if len(got) != 4:
            check(call, False, f"returned {len(got)} strides: q has 4 dimensions (batch, heads, seq, head_dim)")
        e = h * d
        hints = {
            (h * n * d, n * d, d, 1): "those are the strides of a contiguous (batch, heads, seq, head_dim) tensor; "
                                      "q is a view, nothing was copied: it still steps through qkv's rows",
            (n * e, d, e, 1): "one token's row of qkv is 3*E long (q, k and v side by side), not E",
            (n * 3 * e, 3 * e, d, 1): "that is before transpose(1, 2), which swaps the strides of the heads "
                                      "and of the tokens",
        }
        dims = ["batch", "heads", "seq", "head_dim"]
        first = next((i for i in range(4) if got[i] != want[i]), 0)
        by_dim = {
            "batch": "the next sequence of the batch starts seq rows of qkv on",
            "heads": "the next head is the next head_dim elements of the same token's row",
            "seq": "the next token is the next row of qkv, which holds that token's q, k and v",
            "head_dim": "a head's elements are adjacent",
        }[dims[first]]
        _fail_unless(f"q.stride() for batch={b}, seq={n}, heads={h}, head_dim={d}", got == want,
                     f"you predicted {got}; torch says {want}. " + hints.get(
                         got, f"the {dims[first]} stride is off: {by_dim} (step through qkv, rows of 3*E)"))
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
    return x, y, out, xbuf, ybuf, obuf


def check_rows(name, fn, device="cpu", cases=((1, 1), (3, 17), (5, 97), (2, 1100), (7, 33)), dtype=torch.float32):
    """fn(x, y, out) -> out = x + y on row layouts (see _rows_case) of awkward sizes; one hint per
    failure mode."""
    for k, (rows, cols) in enumerate(cases):
        x, y, out, xbuf, ybuf, obuf = _rows_case(rows, cols, device, dtype, seed=k)
        where = f"{rows} rows of {cols}"
        x0, y0 = x.clone(), y.clone()
        with _watched() as seen:
            _call(f"{name}(x, y, out) ({where})", f"x {_describe(x)}, y {_describe(y)}, out {_describe(out)}",
                  fn, x, y, out)
        want = x0 + y0
        _fail_unless(f"{name}: x and y are left as they are ({where})", torch.equal(x, x0) and torch.equal(y, y0),
                     "x or y changed: the kernel stored into an input; the sum goes to out_ptr + row * "
                     "out_row_stride + cols")
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
        loads = _stray(seen["load"], [x, y, out], [xbuf, ybuf, obuf])
        _fail_unless(f"{name}: nothing read outside x and y ({where})", not len(loads),
                     f"the kernel reads elements outside x's and y's rows ({where}): out is right, but on a GPU those "
                     "reads touch other memory (a crash, past the last row): mask the loads too, cols < n_cols")
    check(f"{name} matches x + y for (rows, columns) in {list(cases)}", True, "")
