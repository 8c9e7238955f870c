"""Lab 01's graders (exercises 1.1-1.4) and the layouts that triton_add and the hand-written kernels must get right."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from utils import grading_guard, isa, simt
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
    """One hint from the first error of hipcc (clang) or of the host's g++ (the checks that run the port on the CPU)."""
    first = next((line for line in stderr.splitlines() if "error:" in line), stderr.strip()[:200])
    name = re.search(r"(?:undeclared identifier|unknown type name|no type named|no member named) ['‘](\w+)['’]|"
                     r"['‘](\w+)['’] (?:was not declared|does not name a type|has not been declared)", first)
    name = next((g for g in name.groups() if g), "") if name else ""
    if "cuda_runtime.h" in first and re.search(r"not found|No such file", first):
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
    Then, on any machine, run it on the CPU: its kernel by utils.simt on fixed awkward and fresh sizes
    (`_check_port_kernel`), and its whole program against a model of the HIP runtime, beside hipify's port
    (`_check_port_run`): the copies' sizes, the launch's grid and the result are graded there. On a ROCm GPU
    it is also run, and must print "no error, 0 of ... wrong"."""
    check("saxpy_hip returns the port as a string", isinstance(mine, str) and "main" in mine,
          "return the whole HIP program (kernel and main) as one string")
    reference = isa.hipify(cuda_source, "saxpy.cu")
    try:
        ref_dev, ref_host = compile_port(reference)
        try:
            dev, host = compile_port(mine)
        except isa.CompileError as err:
            check("the port compiles with hipcc", False, _compiler_hint(str(err)))
    except isa.ToolMissing:
        if "hipcc" in isa.required_tools():
            raise
        print("NOTE: hipcc is not installed (Debian/Ubuntu: apt-get install hipcc), so your port was not compiled for "
              "a GPU: it is run on the CPU only")
        left = sorted(set(re.findall(r"\bcuda\w*", mine)))
        check("no CUDA names left", not left, f"{left[0] if left else ''} is a CUDA name: HIP's is hip...")
        copies = _copy_hint(mine)
        check("every hipMemcpy copies the way its kind says", copies is None, copies or "")
        _check_port_kernel(mine, compiled=False)
        _check_port_run(mine, reference, compiled=False)
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
                 BOUND_HINT)
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
    _check_port_kernel(mine, compiled=True)
    _check_port_run(mine, reference, compiled=True)
    if torch.cuda.is_available() and torch.version.hip:
        try:
            printed = isa.run_program(mine, "rocm")
        except isa.CompileError as err:
            printed = str(err)
        check("the port runs on this GPU and gets every element right", "0 of" in printed and "no error" in printed,
              f"it printed: {printed[-300:]}")


# --- 1.1 on the CPU: the port's kernel on fresh sizes, its whole program against a model of the HIP runtime ---------

BOUND_HINT = ("the bounds check lets i == n through (i <= n): that thread writes y[n], one past the end, whenever n is "
              "not a multiple of the block; the bound is i < n")
PAST_END_HINT = ("saxpy stored past the end of y: a thread whose i >= n wrote y[i]; the last block overhangs n, so the "
                 "kernel keeps if (i < n) (strictly less) before it touches y[i]")
PORT_BLOCK = 256          # the CUDA program's block size: the kernel is run on grids of it that overhang n
PORT_SIZES = [(1, 0), (255, 0), (257, 0), (1000, 1)]   # (n, blocks launched beyond the ones n needs), then fresh ones


def _note_not_run(what: str, why: str, compiled: bool) -> None:
    print(f"NOTE: {'hipcc compiled your port, but ' if compiled else ''}{what} could not be built on the CPU "
          f"({why.strip()[:200]}): that part was {'checked from the machine code only' if compiled else 'not checked'}")


def _check_port_kernel(source: str, compiled: bool) -> None:
    """saxpy, as the code above main defines it, run by utils.simt on 64-lane wavefronts (CDNA) over grids of
    PORT_BLOCK threads that overhang n, for PORT_SIZES and two fresh sizes (values and `a` fresh too, seeded by
    `grading_guard.fresh_seed`), against a * x + y computed here; a store past y's end fails."""
    main = re.search(r"^[^\n]*\bmain\s*\(", source, re.M)
    head = source[:main.start()] if main else source
    rng = np.random.default_rng(grading_guard.fresh_seed())
    fresh = [(int(rng.integers(2, 5000)), int(rng.integers(0, 2))) for _ in range(2)]
    for n, extra in PORT_SIZES + fresh:
        a = float(np.float32(rng.uniform(0.5, 4.0) * rng.choice([-1, 1])))   # |a| >= 0.5: y[n] = a * 1e30 + 1e30 shows
        x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        grid = -(-n // PORT_BLOCK) + extra
        where = f"n = {n}, a = {a:g}, {grid} block{'s' * (grid > 1)} of {PORT_BLOCK} threads"
        try:
            run = simt.run_kernel(head, "saxpy", [("n", n), ("a", a), ("x", x), ("y", y)], grid=grid,
                                  block=PORT_BLOCK, width=64, platform="hip")
        except simt.KernelError as err:
            text = str(err)
            if "does not compile" in text and compiled:
                return _note_not_run("its kernel", text, compiled)
            hint = (f"{_compiler_hint(text)} (the kernel, compiled on the CPU: keep __global__ void saxpy(int n, "
                    "float a, const float* x, float* y))" if "does not compile" in text else
                    PAST_END_HINT if "past the end of `y`" in text else text)
            check(f"saxpy on the CPU ({where})", False, hint)
        if run.problems:       # e.g. a race on one y[i] from two threads: both had that index
            problem = run.problems[0]
            check(f"saxpy on the CPU ({where})", False, problem + (
                "; several threads had the same index i: thread i of the grid is blockIdx.x * blockDim.x + threadIdx.x"
                if "race" in problem else ""))
        out = run.buffers["y"]
        want = np.float32(a) * x + y
        _fail_unless(f"saxpy on the CPU ({where})", np.array_equal(run.buffers["x"], x),
                     "saxpy wrote into x: it reads x[i] and writes y[i] only; keep the kernel as in CUDA")
        bad = ~np.isclose(out, want, rtol=1e-6, atol=1e-6)
        if bad.any():
            i = int(np.argmax(bad))
            updates = float(out[i] - y[i]) / float(a * x[i]) if x[i] else float("nan")   # NaN: no count fits
            times = round(updates) if np.isfinite(updates) else -1
            if times >= 0 and np.isclose(out[i], y[i] + times * a * x[i], rtol=1e-5, atol=1e-5) and times != 1:
                hint = (f"y[{i}] was updated {times} times: " + (
                    "no thread had index i; " if times == 0 else "several threads had the same index i; ") +
                    "thread i of the grid is blockIdx.x * blockDim.x + threadIdx.x, and each i < n is one element")
            else:
                hint = (f"y[{i}] = {out[i]:.6g}, but a * x[{i}] + y[{i}] = {want[i]:.6g}: saxpy computes "
                        "y[i] = a * x[i] + y[i]; keep the kernel as in CUDA")
            check(f"saxpy on the CPU ({where})", False, hint)
    check("saxpy, run on the CPU (utils.simt, 64-lane wavefronts), computes y = a * x + y on grids that overhang n, "
          "nothing written past the end", True, "")


PORT_RUNTIME = r"""// lab 01's model of the HIP runtime on a CPU (utils/graders/lab01.py): a whole HIP program, compiled by the
// host's C++ compiler, runs against it. GPU memory is host memory the model tracks: NaN bytes when allocated, then guard
// bytes, four times its size (a kernel that indexes n floats in n bytes stays inside them). A launch runs the kernel
// for every thread of the grid, one after another. Every copy is checked against the allocations it touches and its
// kind. At exit it writes what it saw (allocations, copies, launches, what was wrong) as JSON to $PORT_REPORT, and
// the allocations' bytes to $PORT_REPORT.bin.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <math.h>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define HIP_KERNEL_NAME(...) __VA_ARGS__
static dim3 threadIdx, blockIdx, blockDim, gridDim;
static int warpSize = 64;
#define hipThreadIdx_x threadIdx.x
#define hipBlockIdx_x blockIdx.x
#define hipBlockDim_x blockDim.x
#define hipGridDim_x gridDim.x

enum hipError_t { hipSuccess = 0, hipErrorInvalidValue = 1, hipErrorOutOfMemory = 2, hipErrorInvalidConfiguration = 9,
                  hipErrorInvalidDevicePointer = 17, hipErrorInvalidMemcpyDirection = 21 };
enum hipMemcpyKind { hipMemcpyHostToHost = 0, hipMemcpyHostToDevice = 1, hipMemcpyDeviceToHost = 2,
                     hipMemcpyDeviceToDevice = 3, hipMemcpyDefault = 4 };
typedef struct port_stream* hipStream_t;
typedef struct port_event* hipEvent_t;

namespace port {
struct Alloc { char* p; size_t bytes, guard; const char *what, *size; };
struct Copy { const char *dst, *src, *size; size_t bytes; int kind, dst_alloc, src_alloc, launches; };
struct Launch { char kernel[64]; dim3 grid, block; };
static Alloc allocs[64];
static Copy copies[256];
static Launch launches[64];
static int n_allocs = 0, n_copies = 0, n_launches = 0, n_problems = 0;
static char problems[8][480];
static hipError_t last = hipSuccess;

template <class... T> static void problem(const char* format, T... args) {
    if (n_problems < 8) snprintf(problems[n_problems++], sizeof problems[0], format, args...);
}
static int find(const void* p, size_t* offset) {   // the allocation p points into (or just past), else -1: host memory
    for (int i = 0; i < n_allocs; ++i)
        if ((const char*)p >= allocs[i].p && (const char*)p < allocs[i].p + allocs[i].bytes + allocs[i].guard) {
            *offset = (const char*)p - allocs[i].p;
            return i;
        }
    return -1;
}
static const char* name(const char* expr) {   // "&x" or "(void**)&x" -> "x"
    const char* amp = strrchr(expr, '&');
    return amp ? amp + 1 : expr;
}
static hipError_t malloc_(const char* what, const char* size, void** p, size_t bytes) {
    if (!p || n_allocs == 64 || bytes > (size_t(1) << 34)) {
        problem("hipMalloc(%s, %s) asks for %zu bytes: more than this check gives (16 GiB)", what, size, bytes);
        return last = hipErrorOutOfMemory;
    }
    size_t guard = 4096 + 4 * bytes;
    char* mem = (char*)malloc(bytes + guard);
    memset(mem, 0xFF, bytes);              // NaN as float: an element nothing wrote reads NaN
    memset(mem + bytes, 0xA5, guard);
    allocs[n_allocs++] = {mem, bytes, guard, name(what), size};
    *p = mem;
    return hipSuccess;
}
static hipError_t free_(const char* what, void* p) {
    size_t offset = 0;
    int a = find(p, &offset);
    if (p && (a < 0 || offset)) problem("hipFree(%s) frees memory that hipMalloc did not give", what);
    return hipSuccess;
}
static const char* kinds[] = {"hipMemcpyHostToHost", "hipMemcpyHostToDevice", "hipMemcpyDeviceToHost",
                              "hipMemcpyDeviceToDevice", "hipMemcpyDefault"};
static bool within(const char* call, const char* role, int a, size_t offset, size_t bytes) {
    if (a < 0 || offset + bytes <= allocs[a].bytes) return true;
    problem("%s: its %s, %s, holds %zu bytes (hipMalloc(&%s, %s)), but the copy reaches byte %zu of it: the size is "
            "in bytes, n * sizeof(float) for n floats", call, role, allocs[a].what, allocs[a].bytes, allocs[a].what,
            allocs[a].size, offset + bytes);
    return false;
}
static hipError_t memcpy_(const char* d, const char* s, const char* size, void* dst, const void* src, size_t bytes,
                          int kind, hipStream_t = 0) {
    char call[320];
    snprintf(call, sizeof call, "hipMemcpy(%s, %s, %s, %s)", d, s, size, kind >= 0 && kind <= 4 ? kinds[kind] : "?");
    size_t doff = 0, soff = 0;
    int da = find(dst, &doff), sa = find(src, &soff);
    if (n_copies < 256) copies[n_copies++] = {d, s, size, bytes, kind, da, sa, n_launches};
    if (!dst || !src) {
        problem("%s: a null pointer (was it allocated?)", call);
        return last = hipErrorInvalidValue;
    }
    if (!within(call, "destination", da, doff, bytes) || !within(call, "source", sa, soff, bytes))
        return last = hipErrorInvalidValue;
    if (kind < 0 || kind > 4) {
        problem("%s: the kind is not a hipMemcpyKind", call);
        return last = hipErrorInvalidMemcpyDirection;
    }
    bool from_gpu = kind == hipMemcpyDeviceToHost || kind == hipMemcpyDeviceToDevice;
    bool to_gpu = kind == hipMemcpyHostToDevice || kind == hipMemcpyDeviceToDevice;
    if (kind != hipMemcpyDefault && (from_gpu != (sa >= 0) || to_gpu != (da >= 0)))
        problem("%s copies from %s memory to %s memory, but its kind says otherwise: hipMemcpy(dst, src, bytes, kind) "
                "copies src to dst, and the kind names that direction", call, sa >= 0 ? "GPU" : "host",
                da >= 0 ? "GPU" : "host");
    memmove(dst, src, bytes);
    return hipSuccess;
}
static hipError_t memset_(const char* what, void* p, int value, size_t bytes) {
    size_t offset = 0;
    int a = find(p, &offset);
    char call[320];
    snprintf(call, sizeof call, "hipMemset(%s, ...)", what);
    if (a < 0) problem("%s: hipMemset sets GPU memory, and this is not memory from hipMalloc", call);
    else if (within(call, "destination", a, offset, bytes)) memset(p, value, bytes);
    return hipSuccess;
}
template <class F> static void launch(const char* kernel, F run, dim3 grid, dim3 block, size_t = 0, hipStream_t = 0) {
    Launch& l = launches[n_launches < 63 ? n_launches++ : 63];
    l.grid = grid, l.block = block;
    int k = 0;                                  // the name alone: hipify writes hipLaunchKernelGGL(( saxpy), ...)
    for (; *kernel && k < 63; ++kernel)
        if (*kernel == '_' || *kernel == ':' || (*kernel | 32) - 'a' < 26u || *kernel - '0' < 10u)
            l.kernel[k++] = *kernel;
    l.kernel[k] = 0;
    kernel = l.kernel;
    unsigned long long threads = 1ull * block.x * block.y * block.z, blocks = 1ull * grid.x * grid.y * grid.z;
    if (threads == 0 || threads > 1024 || blocks == 0 || grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
        problem("%s is launched with a grid of (%u, %u, %u) blocks of (%u, %u, %u) threads: a block has 1 to 1024 "
                "threads and a grid at least one block, so on a GPU this launch fails (hipErrorInvalidConfiguration) "
                "and nothing runs", kernel, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        last = hipErrorInvalidConfiguration;
        return;
    }
    if (blocks * threads > (1ull << 31)) {
        problem("%s is launched with %llu threads: more than this check runs on a CPU (2^31)", kernel,
                blocks * threads);
        return;
    }
    gridDim = grid;
    blockDim = block;
    for (blockIdx.z = 0; blockIdx.z < grid.z; ++blockIdx.z)
        for (blockIdx.y = 0; blockIdx.y < grid.y; ++blockIdx.y)
            for (blockIdx.x = 0; blockIdx.x < grid.x; ++blockIdx.x)
                for (threadIdx.z = 0; threadIdx.z < block.z; ++threadIdx.z)
                    for (threadIdx.y = 0; threadIdx.y < block.y; ++threadIdx.y)
                        for (threadIdx.x = 0; threadIdx.x < block.x; ++threadIdx.x) run();
}
static void text(FILE* f, const char* s) {
    fputc('"', f);
    for (; *s; ++s) {
        if (*s == '"' || *s == '\\') fputc('\\', f);
        if ((unsigned char)*s >= ' ') fputc(*s, f);
    }
    fputc('"', f);
}
static void report() {
    const char* path = getenv("PORT_REPORT");
    if (!path) return;
    for (int i = 0; i < n_allocs; ++i)
        for (size_t b = 0; b < allocs[i].guard; ++b)
            if ((unsigned char)allocs[i].p[allocs[i].bytes + b] != 0xA5) {
                problem("something wrote past the end of %s's %zu bytes (hipMalloc(&%s, %s)), at byte %zu: the "
                        "kernel's bound (i < n), its launch, or the size hipMalloc was given", allocs[i].what,
                        allocs[i].bytes, allocs[i].what, allocs[i].size, allocs[i].bytes + b);
                break;
            }
    FILE* f = fopen(path, "w");
    fprintf(f, "{\"allocs\": [");
    for (int i = 0; i < n_allocs; ++i) {
        fprintf(f, "%s{\"what\": ", i ? ", " : "");
        text(f, allocs[i].what);
        fprintf(f, ", \"size\": ");
        text(f, allocs[i].size);
        fprintf(f, ", \"bytes\": %zu}", allocs[i].bytes);
    }
    fprintf(f, "], \"copies\": [");
    for (int i = 0; i < n_copies; ++i) {
        const Copy& c = copies[i];
        fprintf(f, "%s{\"dst\": ", i ? ", " : "");
        text(f, c.dst);
        fprintf(f, ", \"src\": ");
        text(f, c.src);
        fprintf(f, ", \"size\": ");
        text(f, c.size);
        fprintf(f, ", \"bytes\": %zu, \"kind\": %d, \"dst_alloc\": %d, \"src_alloc\": %d, \"launches\": %d}", c.bytes,
                c.kind, c.dst_alloc, c.src_alloc, c.launches);
    }
    fprintf(f, "], \"launches\": [");
    for (int i = 0; i < n_launches; ++i) {
        const Launch& l = launches[i];
        fprintf(f, "%s{\"kernel\": ", i ? ", " : "");
        text(f, l.kernel);
        fprintf(f, ", \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u]}", l.grid.x, l.grid.y, l.grid.z, l.block.x,
                l.block.y, l.block.z);
    }
    fprintf(f, "], \"problems\": [");
    for (int i = 0; i < n_problems; ++i) {
        fprintf(f, "%s", i ? ", " : "");
        text(f, problems[i]);
    }
    fprintf(f, "]}\n");
    fclose(f);
    char bin[4096];
    snprintf(bin, sizeof bin, "%s.bin", path);
    FILE* b = fopen(bin, "wb");
    for (int i = 0; i < n_allocs; ++i) fwrite(allocs[i].p, 1, allocs[i].bytes, b);
    fclose(b);
}
static int reporting = atexit(report);
static int call_main(int (*f)(), int, char**) { return f(); }
static int call_main(int (*f)(int, char**), int argc, char** argv) { return f(argc, argv); }
}  // namespace port

#define hipMalloc(p, bytes) port::malloc_(#p, #bytes, (void**)(p), bytes)
#define hipFree(p) port::free_(#p, p)
#define hipMemcpy(dst, src, bytes, kind) port::memcpy_(#dst, #src, #bytes, dst, src, bytes, kind)
#define hipMemcpyAsync(dst, src, bytes, ...) port::memcpy_(#dst, #src, #bytes, dst, src, bytes, __VA_ARGS__)
#define hipMemset(p, value, bytes) port::memset_(#p, p, value, bytes)
#define hipLaunchKernelGGL(kernel, grid, block, shared, stream, ...) \
    port::launch(#kernel, [&]() { kernel(__VA_ARGS__); }, dim3(grid), dim3(block), shared, stream)
inline hipError_t hipGetLastError() { hipError_t e = port::last; port::last = hipSuccess; return e; }
inline hipError_t hipPeekAtLastError() { return port::last; }
inline hipError_t hipDeviceSynchronize() { return hipSuccess; }
inline hipError_t hipStreamSynchronize(hipStream_t) { return hipSuccess; }
inline hipError_t hipStreamCreate(hipStream_t* s) { *s = nullptr; return hipSuccess; }
inline hipError_t hipStreamDestroy(hipStream_t) { return hipSuccess; }
inline hipError_t hipSetDevice(int) { return hipSuccess; }
inline hipError_t hipGetDevice(int* d) { *d = 0; return hipSuccess; }
inline hipError_t hipGetDeviceCount(int* c) { *c = 1; return hipSuccess; }
inline hipError_t hipDeviceReset() { return hipSuccess; }
inline hipError_t hipEventCreate(hipEvent_t* e) { *e = nullptr; return hipSuccess; }
inline hipError_t hipEventRecord(hipEvent_t, hipStream_t = nullptr) { return hipSuccess; }
inline hipError_t hipEventSynchronize(hipEvent_t) { return hipSuccess; }
inline hipError_t hipEventElapsedTime(float* ms, hipEvent_t, hipEvent_t) { *ms = 0.0f; return hipSuccess; }
inline hipError_t hipEventDestroy(hipEvent_t) { return hipSuccess; }
inline const char* hipGetErrorName(hipError_t e) {
    switch (e) {
        case hipSuccess: return "hipSuccess";
        case hipErrorInvalidValue: return "hipErrorInvalidValue";
        case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
        case hipErrorInvalidConfiguration: return "hipErrorInvalidConfiguration";
        case hipErrorInvalidDevicePointer: return "hipErrorInvalidDevicePointer";
        default: return "hipErrorInvalidMemcpyDirection";
    }
}
inline const char* hipGetErrorString(hipError_t e) {
    switch (e) {
        case hipSuccess: return "no error";
        case hipErrorInvalidValue: return "invalid argument";
        case hipErrorOutOfMemory: return "out of memory";
        case hipErrorInvalidConfiguration: return "invalid configuration argument";
        case hipErrorInvalidDevicePointer: return "invalid device pointer";
        default: return "invalid memcpy direction";
    }
}
#define main port_main
"""


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] in "([{") - (text[i] in ")]}")
        if depth == 0:
            return i + 1
    return len(text)


def _cpu_program(source: str) -> str:
    """The port as PORT_RUNTIME runs it: each kernel<<<grid, block>>>(args) a port::launch, main the model's."""
    code = source
    while (m := re.search(r"\b([A-Za-z_]\w*)\s*<<<", code)) and (end := code.find(">>>", m.end())) > 0:
        paren = end + 3 + len(code[end + 3:]) - len(code[end + 3:].lstrip())
        if code[paren:paren + 1] != "(":
            break
        close = _closing(code, paren)
        kernel = m.group(1)
        code = (f'{code[:m.start()]}port::launch("{kernel}", [&]() {{ {kernel}{code[paren:close]}; }}, '
                f'{code[m.end():end]}){code[close:]}')
    return code + "\n#undef main\nint main(int argc, char** argv) { return port::call_main(port_main, argc, argv); }\n"


@functools.lru_cache(maxsize=4)
def _run_on_cpu(source: str) -> dict:
    """A HIP program compiled by the host's C++ compiler against PORT_RUNTIME and run: {"error": why it did not
    build or finish, else None, "message": the compiler's errors; then "rc", "stdout" and the model's report:
    "allocs", "copies", "launches", "problems", and "contents", the bytes each allocation held at the end}."""
    cxx = simt.compiler()
    env = dict(os.environ, LC_ALL="C")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "include" / "hip").mkdir(parents=True)
        (tmp / "include" / "hip" / "hip_runtime.h").write_text("")
        (tmp / "port_runtime.h").write_text(PORT_RUNTIME)
        (tmp / "port.cpp").write_text(_cpu_program(source))
        build = subprocess.run([cxx, "-std=c++17", "-O1", "-w", "-x", "c++", "-I", str(tmp / "include"), "-include",
                                str(tmp / "port_runtime.h"), str(tmp / "port.cpp"), "-o", str(tmp / "port")],
                               capture_output=True, text=True, env=env)
        if build.returncode:
            return {"error": "does not compile", "message": build.stderr}
        try:
            run = subprocess.run([str(tmp / "port")], capture_output=True, text=True, errors="replace", timeout=30,
                                 cwd=tmp, env=dict(env, PORT_REPORT=str(tmp / "report.json")))
        except subprocess.TimeoutExpired:
            return {"error": "did not finish in 30 s on the CPU (does a loop never end?); hipify's port takes a second"}
        if not (tmp / "report.json").exists():
            how = f"signal {-run.returncode}" if run.returncode < 0 else f"exit status {run.returncode} before its end"
            return {"error": f"crashed on the CPU ({how}): it read or wrote far outside its memory (a copy's size, "
                             "the kernel's index, a pointer that was never allocated)"}
        report = json.loads((tmp / "report.json").read_text(errors="replace"))
        raw, at = (tmp / "report.json.bin").read_bytes(), 0
    report["contents"] = []
    for alloc in report["allocs"]:
        report["contents"].append(raw[at:at + alloc["bytes"]])
        at += alloc["bytes"]
    return {**report, "error": None, "rc": run.returncode, "stdout": run.stdout.strip()}


def _wrong_count(stdout: str) -> str | None:
    found = re.search(r"(\d+) of (\d+) wrong", stdout)
    return found.group(0) if found else None


def _copy_call(copy: dict) -> str:
    kinds = ["hipMemcpyHostToHost", "hipMemcpyHostToDevice", "hipMemcpyDeviceToHost", "hipMemcpyDeviceToDevice",
             "hipMemcpyDefault"]
    kind = kinds[copy["kind"]] if 0 <= copy["kind"] < len(kinds) else "?"
    return f"hipMemcpy({copy['dst']}, {copy['src']}, {copy['size']}, {kind})"


def _check_port_run(mine: str, reference: str, compiled: bool) -> None:
    """The port's whole program run on the CPU against PORT_RUNTIME, beside hipify's port of the CUDA program: no
    copy or store outside its memory, no launch a GPU refuses, and it must end as that one does (exit status, the
    count it prints, what GPU memory holds); when it does not, the hint names the allocation, copy or launch that
    makes the difference."""
    try:
        want = _run_on_cpu(reference)
    except simt.KernelError as err:                  # no C++ compiler on this machine
        print(f"NOTE: {err}: your port's program was not run on the CPU")
        return
    assert want["error"] is None and want["rc"] == 0, f"hipify's port does not run on the CPU model: {want}"
    got = _run_on_cpu(mine)
    error = next((line for line in got.get("message", "").splitlines() if "error:" in line), "")
    if got["error"] == "does not compile" and (compiled or re.search(r"'hip\w+' was not declared", error)):
        return _note_not_run("its program, against a model of the HIP runtime (which lacks a call it makes?),",
                             error, compiled)
    _fail_unless("the port builds and runs on the CPU", got["error"] is None,
                 _compiler_hint(got.get("message", "")) if got["error"] == "does not compile" else
                 f"the program {got['error']}")
    whole = want["copies"][0]                       # every copy of the CUDA program moves one whole vector
    n = whole["bytes"] // 4
    name = "the port's program, run on the CPU against a model of the HIP runtime"
    if got["problems"]:                            # the model's words, its numbers written as Python writes them
        check(name, False, re.sub(r"\b\d{5,}\b", lambda m: f"{int(m.group()):,}", got["problems"][0]))
    big = next((c for c in got["copies"] if c["bytes"] > whole["bytes"]), None)
    if big:
        check(name, False, f"{_copy_call(big)} copies {big['bytes']:,} bytes, more than a vector of n = {n:,} floats "
                           f"holds ({whole['size']} = {whole['bytes']:,} bytes): it reads or writes past the end of a "
                           "std::vector on the host")
    count = _wrong_count(got["stdout"])
    if (got["rc"] == want["rc"] and count in (None, _wrong_count(want["stdout"]))
            and all(any(c[:len(w)] == w for c in got["contents"]) for w in want["contents"])):
        check(f"{name}: its copies, its launch and its result are the CUDA program's", True, "")
        return
    small = next((a for a in got["allocs"] if a["bytes"] < whole["bytes"]), None)
    short = next((c for c in got["copies"] if c["bytes"] < whole["bytes"]), None)
    threads = max((int(np.prod(k["grid"])) * int(np.prod(k["block"])) for k in got["launches"]), default=0)
    back = any(c["src_alloc"] >= 0 and c["dst_alloc"] < 0 and c["launches"] > 0 for c in got["copies"])
    inputs = lambda report: sum(c["dst_alloc"] >= 0 and c["src_alloc"] < 0 and c["launches"] == 0
                                for c in report["copies"])
    if small:
        hint = (f"hipMalloc(&{small['what']}, {small['size']}) allocates {small['bytes']:,} bytes, but a vector of "
                f"n = {n:,} floats takes {whole['size']} = {whole['bytes']:,}: hipMalloc's size is in bytes")
    elif short:
        hint = (f"{_copy_call(short)} copies {short['size']} = {short['bytes']:,} bytes, {short['bytes'] / 4:,.0f} "
                f"floats of the n = {n:,}: hipMemcpy's size is in bytes, {whole['size']} for a whole vector")
    elif not got["launches"]:
        hint = ("saxpy is never launched: keep saxpy<<<grid, block>>>(...) (or hipLaunchKernelGGL(saxpy, grid, block, "
                "0, 0, ...))")
    elif threads < n:
        k = got["launches"][0]
        hint = (f"{k['kernel']} is launched with {tuple(k['grid'])} blocks of {tuple(k['block'])} threads: "
                f"{threads:,} threads for n = {n:,} elements, so the last {n - threads:,} are never computed; the grid "
                f"rounds up, (n + {k['block'][0]} - 1) / {k['block'][0]} blocks")
    elif inputs(got) < inputs(want):
        hint = (f"{inputs(got)} copy(ies) from the host to the GPU before saxpy is launched; the CUDA program makes "
                f"{inputs(want)} (x and y): the kernel reads both, so copy both first (hipMemcpyHostToDevice)")
    elif not back:
        hint = ("y is never copied back to the host after saxpy is launched: the check reads hy, so copy y into it "
                "after the launch (hipMemcpyDeviceToHost)")
    else:
        hint = (f"it printed {got['stdout'][-200:]!r} and returned {got['rc']}; hipify's port of the CUDA program "
                f"prints {want['stdout']!r} and returns {want['rc']}: keep main as in CUDA, with HIP's names")
    check(name, False, hint)


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
    (the CPU run of the lab, and the course's tests, see it). After `sizes`, two sizes drawn fresh on every
    call (and fresh values throughout, seeded by `grading_guard.fresh_seed`), not printed."""
    rng = random.Random(grading_guard.fresh_seed())
    seed = rng.randrange(2**31)
    for dtype in dtypes:
        for k, n in enumerate([*sizes, *(rng.randrange(2, 5000) for _ in range(2))]):
            x, xbuf = _guarded(n, device, dtype, fill=SENTINEL, seed=seed + 2 * k)
            y, ybuf = _guarded(n, device, dtype, fill=SENTINEL, seed=seed + 2 * k + 1, offset=k % 2 * 4)
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
    """fn(x, y, out) gives exactly torch.add's result (of x and y as they were) in every layout of `layouts`,
    leaves x and y as they are, and writes nothing of out's buffer outside out's elements: each layout at about
    n elements, then at a size drawn fresh on every call, values fresh in both (`grading_guard.fresh_seed`), one
    PASS line per layout."""
    rng = random.Random(grading_guard.fresh_seed())
    fresh = layouts(device, dtype, rng.randrange(2, 300), seed=rng.randrange(2**31))
    for (what, *fixed), (_, *drawn) in zip(layouts(device, dtype, n, seed=rng.randrange(2**31)), fresh):
        if names is not None and what not in names:
            continue
        for x, y, out in (fixed, drawn):
            base = out if out._base is None else out._base          # the buffer out is a view of
            x0, y0 = x.clone(), y.clone()
            where = f"{what} (shape {tuple(out.shape)}, strides x {x.stride()}, y {y.stride()}, out {out.stride()})"
            _call(f"{name}: {what}", where, fn, x, y, out)
            want = torch.add(x0, y0)
            inside = torch.zeros_like(base, dtype=torch.bool)
            inside.as_strided(out.shape, out.stride(), out.storage_offset() - base.storage_offset()).fill_(True)
            outside_ok = bool(base[~inside].isnan().all())
            _fail_unless(f"{name}: {what}", torch.equal(x, x0) and torch.equal(y, y0),
                         f"x or y changed for {where}: read the inputs, write only into out")
            _fail_unless(f"{name}: {what}", torch.equal(out, want) and outside_ok,
                         f"{'wrong values' if not torch.equal(out, want) else 'wrote outside out'} for {where}")
        check(f"{name}: {what}", True, "")


# --- 1.3: the strides of GPT-2's q ----------------------------------------------------------------------

def check_q_strides(predict, gpt2_qkv):
    """The prediction against what torch reports for q of `gpt2_qkv(batch, seq, heads, head_dim)` (the
    lab's function), for several shapes (one is not enough: a formula must hold for all), then two drawn fresh
    on every call (`grading_guard.fresh_seed`: a table of the fixed shapes' answers fails)."""
    rng = random.Random(grading_guard.fresh_seed())
    fresh = [(rng.randrange(1, 5), rng.randrange(2, 20), rng.randrange(2, 17), rng.choice([2, 4, 8, 16, 32, 64]))
             for _ in range(2)]
    for b, n, h, d in [(2, 5, 3, 4), (1, 7, 2, 8), (3, 2, 4, 16), (2, 9, 12, 64), *fresh]:
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
    """fn(x, y, out) -> out = x + y on row layouts (see _rows_case) of awkward sizes, then two drawn fresh on every
    call (values fresh throughout, `grading_guard.fresh_seed`), not printed; one hint per failure mode."""
    rng = random.Random(grading_guard.fresh_seed())
    seed = rng.randrange(2**31)
    fresh = [(rng.randrange(1, 10), rng.randrange(2, 2100)) for _ in range(2)]
    for k, (rows, cols) in enumerate([*cases, *fresh]):
        x, y, out, xbuf, ybuf, obuf = _rows_case(rows, cols, device, dtype, seed=seed + k)
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
