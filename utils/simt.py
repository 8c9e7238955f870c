"""A tiny model of one SIMT machine: wavefronts/warps of `width` lanes executing in lock-step.

- `branch`, `shfl_down`, `wave_sum`: a model, not a simulator: just enough to show, on a CPU, what the lane
  width does to a lane-dependent branch (both sides run, one after the other, each with part of the lanes
  masked off) and to a shuffle-based reduction. Lanes are numbered inside their wavefront: lane = thread % width.
- `run_kernel(source, name, args, grid=, block=, width=, platform=)`: runs real CUDA/HIP kernel source on the
  CPU (compiled by the host's C++ compiler): every lane is a coroutine, the lanes of a wavefront meet at each
  cross-lane operation (shuffles, ballots, `__syncwarp`) and the block at `__syncthreads`. `platform="hip"`
  offers HIP's cross-lane API (64-bit masks, any `width`), `"cuda"` CUDA's (32-bit masks, `_sync` only,
  width 32). It reports what a GPU would not tell you: a lane left out of a mask, a read of a lane that had
  returned, a store past the end of a buffer, which lanes did atomics.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from utils.base import state
from utils.base.paths import build_dir, private_dir


def lane_layout(threads: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(wave id, lane id) of each thread of a block of `threads` threads."""
    t = np.arange(threads)
    return t // width, t % width


@dataclass(frozen=True)
class BranchCost:
    width: int
    period: int
    passes_per_wave: float    # instruction streams issued per wavefront: 1 = converged, 2 = both sides
    lane_utilization: float   # useful lane-slots / issued lane-slots

    @property
    def relative_cost(self) -> float:
        return self.passes_per_wave


def branch(width: int, period: int, threads: int = 256) -> BranchCost:
    """`if ((threadIdx.x / period) % 2 == 0) A(); else B();` with A and B of equal length: a
    wavefront whose lanes disagree runs A with the B-lanes masked off, then B with the A-lanes masked."""
    if width < 1 or period < 1:
        raise ValueError("width and period must be >= 1")
    if threads % width:
        raise ValueError(f"threads={threads} must be a multiple of width={width}")
    take_a = (np.arange(threads) // period) % 2 == 0
    waves = take_a.reshape(-1, width)
    passes = np.where(waves.all(axis=1) | (~waves).all(axis=1), 1, 2)
    # every lane does one side's work; a divergent wavefront issues both sides for all its lanes
    return BranchCost(width, period, float(passes.mean()), float(1.0 / passes.mean()))


def shfl_down(values: np.ndarray, offset: int, width: int) -> np.ndarray:
    """`__shfl_down(v, offset)` for every lane: lane i reads lane i + offset of its own wavefront; a lane
    whose source would fall outside the wavefront keeps its own value (CUDA's and HIP's rule)."""
    v = np.asarray(values)
    lane = np.arange(v.size) % width
    src = np.arange(v.size) + offset
    out = v.copy()
    inside = lane + offset < width
    out[inside] = v[src[inside]]
    return out


def wave_sum(values, width: int, offsets) -> int:
    """The reduction kernel's result: each wavefront adds `shfl_down(v, offset)` for each offset, then
    the wavefront's lane 0 (thread % width == 0) adds its v to the total."""
    v = np.asarray(values).copy()
    if v.size % width:
        v = np.concatenate([v, np.zeros(width - v.size % width, dtype=v.dtype)])
    for offset in offsets:
        v = v + shfl_down(v, offset, width)
    return int(v[::width].sum())


# --- CUDA/HIP kernels on the CPU ---------------------------------------------------------------------

RUNTIME = r"""// utils.simt's CPU runtime (no C++ library headers: it compiles in a fraction of a second): CUDA/HIP kernel code run on the host, each lane a coroutine, the lanes of a
// wavefront meeting at every cross-lane operation (shuffle, ballot, __syncwarp) and the block at
// __syncthreads. Compiled with -D__HIP_PLATFORM_AMD__ it offers HIP's cross-lane API (64-bit masks), without
// it CUDA's (32-bit masks, _sync only). warpSize is a variable, as in CUDA and in HIP since ROCm 7.0.
#include <ucontext.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __threadfence() ((void)0)
#define __threadfence_block() ((void)0)

int warpSize = 64;

namespace simt {
enum Op { NONE, SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, SYNCWARP, SYNCTHREADS };
static const char* const op_names[] = {"-", "a shuffle (idx)", "__shfl_up", "__shfl_down", "__shfl_xor", "a ballot/vote",
                                       "__syncwarp", "__syncthreads"};
struct Lane {
    ucontext_t ctx;
    dim3 tid;
    int wave, lane, state;   // state: 0 ready, 1 parked, 2 done
    int op, arg, width;
    uint64_t value, mask, result;
    bool masked;
};
const int STACK = 64 * 1024;
static Lane* lanes = nullptr;
static char* stacks = nullptr;
static int capacity = 0;
static ucontext_t scheduler;
static Lane* cur = nullptr;
static dim3 g_block, g_block_dim, g_grid_dim;
static void (*g_entry)(void*) = nullptr;
static void* g_arg = nullptr;
static char problems[20][320];
static int n_problems = 0;
static uint64_t* atomic_lanes = nullptr;   // per wavefront of the grid: a bit per lane that did an atomic
static long long n_waves = 0, wave_base = 0;
static int max_shuffle_delta = 0;

static void problem(const char* text) {
    for (int i = 0; i < n_problems; ++i) if (!strcmp(problems[i], text)) return;
    if (n_problems < 20) snprintf(problems[n_problems++], sizeof problems[0], "%s", text);
}
static void lane_main() {
    g_entry(g_arg);
    cur->state = 2;
    swapcontext(&cur->ctx, &scheduler);
}
static uint64_t park(int op, uint64_t value, int arg, int width, bool masked, uint64_t mask) {
    cur->op = op; cur->value = value; cur->arg = arg; cur->width = width; cur->masked = masked; cur->mask = mask;
    cur->state = 1;
    swapcontext(&cur->ctx, &scheduler);
    return cur->result;
}
static int threads() { return g_block_dim.x * g_block_dim.y * g_block_dim.z; }
static int wave_size(int wave) { int left = threads() - wave * warpSize; return left < warpSize ? left : warpSize; }
// Execute the cross-lane operation the lowest parked lane of `wave` waits at, for every lane parked at it.
static void resolve(int wave) {
    char text[320];
    int first = wave * warpSize, n = wave_size(wave), live = 0, op = NONE;
    for (int l = 0; l < n; ++l) {
        Lane& x = lanes[first + l];
        if (x.state != 2) ++live;
        if (x.state == 1 && x.op != SYNCTHREADS && op == NONE) op = x.op;
    }
    uint64_t active = 0;
    int count = 0;
    for (int l = 0; l < n; ++l)
        if (lanes[first + l].state == 1 && lanes[first + l].op == op) active |= 1ull << l, ++count;
    if (count < live) {
        snprintf(text, sizeof text, "lanes of one wavefront reached different cross-lane operations (%s with only %d of "
                 "its %d lanes): is it inside a lane-dependent branch?", op_names[op], count, live);
        problem(text);
    }
    for (int l = 0; l < n; ++l) {
        if (!((active >> l) & 1)) continue;
        Lane& x = lanes[first + l];
        if (x.masked && !((x.mask >> l) & 1)) {
            snprintf(text, sizeof text, "lane %d called %s with a mask that leaves it out (mask 0x%llx): on a %d-lane "
                     "wavefront a full mask has %d bits", l, op_names[op], (unsigned long long)x.mask, warpSize, warpSize);
            problem(text);
        }
    }
    for (int l = 0; l < n; ++l) {
        if (!((active >> l) & 1)) continue;
        Lane& x = lanes[first + l];
        if (op == BALLOT) {
            x.result = 0;
            for (int j = 0; j < n; ++j) if (((active >> j) & 1) && lanes[first + j].value) x.result |= 1ull << j;
            continue;
        }
        if (op == SYNCWARP) { x.result = active; continue; }
        int w = x.width > 0 ? x.width : warpSize, seg = (l / w) * w, src = l;
        if (op == SHFL_IDX) src = seg + ((x.arg % w) + w) % w;
        if (op == SHFL_UP) src = (l - seg) >= x.arg ? l - x.arg : l;
        if (op == SHFL_DOWN) src = (l - seg) + x.arg < w ? l + x.arg : l;
        if (op == SHFL_XOR) src = ((l ^ x.arg) >= seg && (l ^ x.arg) < seg + w) ? (l ^ x.arg) : l;
        if ((op == SHFL_DOWN || op == SHFL_UP || op == SHFL_XOR) && x.arg > max_shuffle_delta) max_shuffle_delta = x.arg;
        if (src >= n) {
            x.result = 0;
            snprintf(text, sizeof text, "a shuffle read lane %d, past the end of its wavefront", src);
            problem(text);
        } else if (!((active >> src) & 1)) {
            x.result = 0;
            snprintf(text, sizeof text, "lane %d read lane %d with %s, but that lane %s: on a GPU the value is undefined",
                     l, src, op_names[op], lanes[first + src].state == 2 ? "had returned" : "was elsewhere");
            problem(text);
        } else {
            x.result = lanes[first + src].value;
        }
    }
    for (int l = 0; l < n; ++l)
        if ((active >> l) & 1) lanes[first + l].state = 0, lanes[first + l].op = NONE;
}
static void run_block() {
    int n = threads(), waves = (n + warpSize - 1) / warpSize;
    if (n > capacity) {
        lanes = (Lane*)realloc(lanes, n * sizeof(Lane));
        stacks = (char*)realloc(stacks, (size_t)n * STACK);
        capacity = n;
    }
    for (int t = 0; t < n; ++t) {
        Lane& x = lanes[t];
        memset(&x, 0, sizeof x);
        x.tid.x = t % g_block_dim.x; x.tid.y = (t / g_block_dim.x) % g_block_dim.y; x.tid.z = t / (g_block_dim.x * g_block_dim.y);
        x.wave = t / warpSize; x.lane = t % warpSize;
        getcontext(&x.ctx);
        x.ctx.uc_stack.ss_sp = stacks + (size_t)t * STACK;
        x.ctx.uc_stack.ss_size = STACK;
        x.ctx.uc_link = &scheduler;
        makecontext(&x.ctx, lane_main, 0);
    }
    for (;;) {
        bool ran = false;
        for (int t = 0; t < n; ++t)
            if (lanes[t].state == 0) { cur = &lanes[t]; swapcontext(&scheduler, &lanes[t].ctx); ran = true; }
        if (ran) continue;
        bool resolved = false, all_done = true;
        for (int w = 0; w < waves; ++w) {
            bool wave_op = false;
            for (int l = 0; l < wave_size(w); ++l) {
                Lane& x = lanes[w * warpSize + l];
                if (x.state != 2) all_done = false;
                if (x.state == 1 && x.op != SYNCTHREADS) wave_op = true;
            }
            if (wave_op) { resolve(w); resolved = true; }
        }
        if (all_done) break;
        if (!resolved)   // every live lane waits at __syncthreads
            for (int t = 0; t < n; ++t) if (lanes[t].state == 1) lanes[t].state = 0, lanes[t].op = NONE;
    }
}
template <class F> static void call(void* f) { (*(F*)f)(); }
template <class F> static void launch(int width, dim3 grid, dim3 block, F kernel) {
    warpSize = width;
    g_grid_dim = grid; g_block_dim = block; g_entry = call<F>; g_arg = &kernel;
    int waves = (threads() + width - 1) / width;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                g_block.x = x; g_block.y = y; g_block.z = z;
                wave_base = n_waves;
                n_waves += waves;
                atomic_lanes = (uint64_t*)realloc(atomic_lanes, n_waves * sizeof(uint64_t));
                memset(atomic_lanes + wave_base, 0, waves * sizeof(uint64_t));
                run_block();
            }
}
static void note_atomic() { atomic_lanes[wave_base + cur->wave] |= 1ull << cur->lane; }
static void report(FILE* f) {
    fprintf(f, "{\"problems\": [");
    for (int i = 0; i < n_problems; ++i) {
        fprintf(f, "%s\"", i ? ", " : "");
        for (const char* c = problems[i]; *c; ++c) fprintf(f, *c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
        fprintf(f, "\"");
    }
    fprintf(f, "], \"max_shuffle_delta\": %d, \"atomic_lanes\": [", max_shuffle_delta);
    for (long long w = 0; w < n_waves; ++w) {
        fprintf(f, "%s[", w ? ", " : "");
        for (int l = 0, k = 0; l < 64; ++l) if ((atomic_lanes[w] >> l) & 1) fprintf(f, "%s%d", k++ ? ", " : "", l);
        fprintf(f, "]");
    }
    fprintf(f, "]}\n");
}
template <class T> uint64_t bits(T v) { uint64_t b = 0; memcpy(&b, &v, sizeof(T)); return b; }
template <class T> T from_bits(uint64_t b) { T v; memcpy(&v, &b, sizeof(T)); return v; }
template <class T> T shuffle(int op, T v, int arg, int width, bool masked, uint64_t mask) {
    static_assert(sizeof(T) <= 8, "shuffles move values of up to 8 bytes");
    return from_bits<T>(park(op, bits(v), arg, width, masked, mask));
}
}  // namespace simt

#define threadIdx (simt::cur->tid)
#define blockIdx (simt::g_block)
#define blockDim (simt::g_block_dim)
#define gridDim (simt::g_grid_dim)

inline void __syncthreads() { simt::park(simt::SYNCTHREADS, 0, 0, 0, false, 0); }
template <class A, class B> inline auto min(A a, B b) -> decltype(a < b ? a : b) { return a < b ? a : b; }
template <class A, class B> inline auto max(A a, B b) -> decltype(a < b ? a : b) { return a < b ? b : a; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }

#define SIMT_ATOMIC(name, expr)                                                                    \
    template <class T, class U> inline T name(T* address, U value) {                              \
        simt::note_atomic();                                                                     \
        T old = *address;                                                                        \
        *address = (expr);                                                                       \
        return old;                                                                              \
    }
SIMT_ATOMIC(atomicAdd, old + (T)value)
SIMT_ATOMIC(atomicSub, old - (T)value)
SIMT_ATOMIC(atomicMax, old < (T)value ? (T)value : old)
SIMT_ATOMIC(atomicMin, (T)value < old ? (T)value : old)
SIMT_ATOMIC(atomicOr, old | (T)value)
SIMT_ATOMIC(atomicAnd, old & (T)value)
SIMT_ATOMIC(atomicExch, (T)value)
template <class T> inline T atomicCAS(T* address, T compare, T value) {
    simt::note_atomic();
    T old = *address;
    if (old == compare) *address = value;
    return old;
}

#if defined(__HIP_PLATFORM_AMD__)
// HIP: the plain cross-lane functions work on the whole wavefront; masks are 64-bit.
inline unsigned int __lane_id() { return simt::cur->lane; }
template <class T> inline T __shfl(T v, int src, int width = warpSize) { return simt::shuffle(simt::SHFL_IDX, v, src, width, false, 0); }
template <class T> inline T __shfl_up(T v, unsigned int d, int width = warpSize) { return simt::shuffle(simt::SHFL_UP, v, (int)d, width, false, 0); }
template <class T> inline T __shfl_down(T v, unsigned int d, int width = warpSize) { return simt::shuffle(simt::SHFL_DOWN, v, (int)d, width, false, 0); }
template <class T> inline T __shfl_xor(T v, int m, int width = warpSize) { return simt::shuffle(simt::SHFL_XOR, v, m, width, false, 0); }
inline unsigned long long __ballot(int pred) { return simt::park(simt::BALLOT, pred != 0, 0, 0, false, 0); }
inline unsigned long long __activemask() { return simt::park(simt::SYNCWARP, 0, 0, 0, false, 0); }
inline int __any(int pred) { return __ballot(pred) != 0; }
inline int __all(int pred) { return __ballot(pred) == __activemask(); }
#define SIMT_HIP_MASK(M)                                                                                            \
    static_assert(sizeof(M) == 8, "The mask must be a 64-bit integer. "                                              \
                                  "Implicitly promoting a smaller integer is almost always an error.")
template <class M, class T> inline T __shfl_sync(M mask, T v, int src, int width = warpSize) { SIMT_HIP_MASK(M); return simt::shuffle(simt::SHFL_IDX, v, src, width, true, mask); }
template <class M, class T> inline T __shfl_up_sync(M mask, T v, unsigned int d, int width = warpSize) { SIMT_HIP_MASK(M); return simt::shuffle(simt::SHFL_UP, v, (int)d, width, true, mask); }
template <class M, class T> inline T __shfl_down_sync(M mask, T v, unsigned int d, int width = warpSize) { SIMT_HIP_MASK(M); return simt::shuffle(simt::SHFL_DOWN, v, (int)d, width, true, mask); }
template <class M, class T> inline T __shfl_xor_sync(M mask, T v, int m, int width = warpSize) { SIMT_HIP_MASK(M); return simt::shuffle(simt::SHFL_XOR, v, m, width, true, mask); }
template <class M> inline unsigned long long __ballot_sync(M mask, int pred) { SIMT_HIP_MASK(M); return simt::park(simt::BALLOT, pred != 0, 0, 0, true, mask) & mask; }
template <class M> inline int __any_sync(M mask, int pred) { return __ballot_sync(mask, pred) != 0; }
template <class M> inline int __all_sync(M mask, int pred) { return __ballot_sync(mask, pred) == (__activemask() & mask); }
template <class M> inline void __syncwarp(M mask) { SIMT_HIP_MASK(M); simt::park(simt::SYNCWARP, 0, 0, 0, true, mask); }
#else
// CUDA (9 and later): only the _sync functions, with 32-bit masks; a warp has 32 lanes.
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = warpSize) { return simt::shuffle(simt::SHFL_IDX, v, src, width, true, mask); }
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned int d, int width = warpSize) { return simt::shuffle(simt::SHFL_UP, v, (int)d, width, true, mask); }
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned int d, int width = warpSize) { return simt::shuffle(simt::SHFL_DOWN, v, (int)d, width, true, mask); }
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = warpSize) { return simt::shuffle(simt::SHFL_XOR, v, m, width, true, mask); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return (unsigned)simt::park(simt::BALLOT, pred != 0, 0, 0, true, mask) & mask; }
inline unsigned __activemask() { return (unsigned)simt::park(simt::SYNCWARP, 0, 0, 0, false, 0); }
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == (__activemask() & mask); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { simt::park(simt::SYNCWARP, 0, 0, 0, true, mask); }
#endif
"""

_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.uint32): "unsigned int", np.dtype(np.int64): "long long",
           np.dtype(np.uint64): "unsigned long long", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_PAD = 1024   # elements after each buffer: a kernel that reads past the end gets these, one that writes there is caught


class KernelError(RuntimeError):
    """The kernel did not compile, crashed, did not finish, or wrote outside its buffers."""


@dataclass
class KernelRun:
    buffers: dict[str, np.ndarray]     # the pointer arguments after the kernel ran
    problems: list[str]                # what the runtime saw that a GPU would not report (empty: none)
    atomic_lanes: list[list[int]]      # per wavefront of the grid, in order: the lanes that did an atomic
    max_shuffle_delta: int             # the largest offset a shuffle up/down/xor used


def _compiler() -> str:
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise KernelError("no C++ compiler found (g++, c++ or clang++); install one: sudo apt-get install g++")


def _canary(dtype: np.dtype):
    return 1e30 if dtype.kind == "f" else 0x5A5A5A5A   # large, positive, finite: it shows in sums, counts and arithmetic


def _main_source(name: str, args: list) -> str:
    lines = ["int main(int argc, char** argv) {",
             "    int width = atoi(argv[1]); dim3 grid, block; grid.x = atoi(argv[2]); block.x = atoi(argv[3]);",
             "    FILE* in = fopen(argv[4], \"rb\");"]
    call = []
    for i, (arg_name, value) in enumerate(args):
        if isinstance(value, np.ndarray):
            ctype = _CTYPES[value.dtype]
            lines += [f"    long long n{i}; if (fread(&n{i}, 8, 1, in) != 1) return 3;",
                      f"    {ctype}* a{i} = ({ctype}*)malloc(n{i} * sizeof({ctype}));",
                      f"    if (fread(a{i}, sizeof({ctype}), n{i}, in) != (size_t)n{i}) return 3;"]
            call.append(f"a{i}")
        else:
            ctype = "double" if isinstance(value, float) else "long long"
            lines.append(f"    {ctype} s{i}; if (fread(&s{i}, 8, 1, in) != 1) return 3;")
            call.append(f"({'float' if isinstance(value, float) else 'int'})s{i}")
    lines += ["    fclose(in);",
              f"    simt::launch(width, grid, block, [&] {{ {name}({', '.join(call)}); }});",
              "    FILE* out = fopen(argv[5], \"wb\");"]
    lines += [f"    fwrite(a{i}, sizeof(a{i}[0]), n{i}, out);"
              for i, (_, value) in enumerate(args) if isinstance(value, np.ndarray)]
    lines += ["    fclose(out);", "    simt::report(stdout);", "    return 0;", "}"]
    return "\n".join(lines)


def _build(source: str, name: str, args: list, platform: str) -> Path:
    main = _main_source(name, args)
    cxx = _compiler()
    key = hashlib.sha256("\0".join([RUNTIME, source, main, platform, cxx]).encode()).hexdigest()[:20]
    # compiled helpers live in this user's private build folder (0700, checked), never in a shared /tmp where
    # another user could plant a program of the expected name; each is run only if its bytes still hash to what
    # was recorded when it was built
    cache = private_dir(build_dir() / "cache" / "simt")
    exe = cache / f"{name}-{platform}-{key}"
    if _trusted(exe):
        return exe
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp = Path(tmp)
        for header in ("cuda_runtime.h", "cuda.h", "hip/hip_runtime.h"):
            (tmp / "include" / header).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "include" / header).write_text("")
        (tmp / "simt_cpu.h").write_text(RUNTIME)
        (tmp / "kernel.cu").write_text(source)
        (tmp / "main.cpp").write_text(f'#line 1 "kernel.cu"\n{source}\n#line 1 "main.cpp"\n{main}\n')
        cmd = [cxx, "-std=c++17", "-O1", "-w", "-x", "c++", "-I", str(tmp / "include"), "-include", str(tmp / "simt_cpu.h"),
               *(["-D__HIP_PLATFORM_AMD__"] if platform == "hip" else []), str(tmp / "main.cpp"), "-o", str(tmp / "exe")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            lines = run.stderr.splitlines()
            errors = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
            where = sorted({int(m.group(1)) for line in lines if (m := re.match(r".*kernel\.cu:(\d+):", line))})
            raise KernelError(f"the kernel does not compile ({'HIP' if platform == 'hip' else 'CUDA'}): "
                              + "; ".join(dict.fromkeys(errors[:3]))
                              + (f" (kernel line {', '.join(map(str, where[:3]))})" if where else ""))
        digest = hashlib.sha256((tmp / "exe").read_bytes()).hexdigest()
        os.replace(tmp / "exe", exe)
        state.write_text_atomic(exe.with_suffix(".sha256"), digest + "\n")
    return exe


def _trusted(exe: Path) -> bool:
    """Whether `exe` is a helper this user built: a regular file of ours, not writable by others, whose bytes
    hash to the digest recorded beside it."""
    try:
        info = os.lstat(exe)
        recorded = exe.with_suffix(".sha256").read_text().strip()
    except OSError:
        return False
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
            and hashlib.sha256(exe.read_bytes()).hexdigest() == recorded)


def run_kernel(source: str, name: str, args: list, *, grid: int, block: int, width: int, platform: str = "hip",
               timeout: float = 30.0) -> KernelRun:
    """Run `name(args...)` from CUDA/HIP `source` on the CPU over `grid` blocks of `block` threads (1-D), in
    wavefronts of `width` lanes. `args` are (name, value) pairs in the kernel's order: a NumPy array becomes
    a pointer to a copy of it (int32, uint32, int64, uint64, float32, float64), a Python int an `int`, a
    float a `float`. Raises KernelError if the kernel does not compile, crashes, runs longer than `timeout`
    seconds, or stores past the end of a buffer."""
    if platform not in ("hip", "cuda"):
        raise ValueError(f"platform must be 'hip' or 'cuda', not {platform!r}")
    if width not in (32, 64) or (platform == "cuda" and width != 32):
        raise ValueError(f"width={width}: a wavefront has 32 or 64 lanes (HIP), a warp 32 (CUDA)")
    if grid < 1 or block < 1 or block > 1024:
        raise ValueError(f"grid={grid} must be >= 1 and block={block} from 1 to 1024")
    for arg_name, value in args:
        if isinstance(value, np.ndarray) and value.dtype not in _CTYPES:
            raise ValueError(f"{arg_name}: {value.dtype} is not one of {sorted(str(d) for d in _CTYPES)}")
    exe = _build(source, name, args, platform)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        padded = {}
        with open(tmp / "in.bin", "wb") as f:
            for arg_name, value in args:
                if isinstance(value, np.ndarray):
                    buf = np.concatenate([value.ravel(), np.full(_PAD, _canary(value.dtype), dtype=value.dtype)])
                    padded[arg_name] = buf
                    f.write(np.int64(buf.size).tobytes() + buf.tobytes())
                else:
                    f.write(np.float64(value).tobytes() if isinstance(value, float) else np.int64(value).tobytes())
        try:
            run = subprocess.run([str(exe), str(width), str(grid), str(block), str(tmp / "in.bin"), str(tmp / "out.bin")],
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise KernelError(f"the kernel did not finish in {timeout:g} s on the CPU: does a loop never end "
                              "(an offset that never reaches 0)?") from None
        if run.returncode != 0:
            how = f"signal {-run.returncode}" if run.returncode < 0 else f"exit status {run.returncode}"
            raise KernelError(f"the kernel crashed on the CPU ({how}): it read or wrote far outside its buffers")
        raw = (tmp / "out.bin").read_bytes()
    buffers, offset = {}, 0
    for arg_name, value in args:
        if isinstance(value, np.ndarray):
            buf = padded[arg_name]
            out = np.frombuffer(raw, dtype=buf.dtype, count=buf.size, offset=offset).copy()
            offset += buf.nbytes
            tail, canary = out[value.size:], buf[value.size:]
            if not np.array_equal(tail, canary):
                raise KernelError(f"the kernel wrote past the end of `{arg_name}` ({value.size} elements)")
            buffers[arg_name] = out[:value.size].reshape(value.shape)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    return KernelRun(buffers, report["problems"], report["atomic_lanes"], report["max_shuffle_delta"])
