"""A tiny model of one SIMT machine: wavefronts/warps of `width` lanes executing in lock-step.

- `branch`, `shfl_down`, `wave_sum`: a model, not a simulator: just enough to show, on a CPU, what the lane
  width does to a lane-dependent branch (both sides run, one after the other, each with part of the lanes
  masked off) and to a shuffle-based reduction. Lanes are numbered inside their wavefront: lane = thread % width.
- `run_kernel(source, name, args, grid=, block=, width=, platform=)`: runs real CUDA/HIP kernel source on the
  CPU (compiled by the host's C++ compiler): every lane is a coroutine, the lanes of a wavefront meet at each
  cross-lane operation (shuffles, ballots, `__syncwarp`) and at each memory access (in lock-step: all lanes at one
  load or store make it together), the block at `__syncthreads`; wavefronts and up to 4 blocks take turns in an
  order drawn from a seed. `platform="hip"` offers HIP's cross-lane API (64-bit masks, any `width`), `"cuda"`
  CUDA's (32-bit masks, `_sync` only, width 32). It reports what a GPU would not tell you: a lane left out of a
  mask, a read of a lane that had returned, a store past the end of a buffer, which lanes did atomics, the lanes
  of each cross-lane operation, and races: two lanes on one address between the same barriers, one of them
  writing, not both atomic, with nothing to order them (two blocks; two wavefronts of a block; one instruction
  of one wavefront storing different values; on CUDA, whose warps are not in lock-step since Volta, two
  instructions of one warp with no `_sync` operation between), named by lane and address (buffer or `__shared__`
  variable, index). Accesses are tracked byte by byte, and a write is checked against the last two readers of
  different wavefronts.
"""
from __future__ import annotations

import functools
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

RUNTIME = r"""// utils.simt's CPU runtime, the part compiled with each kernel (no C++ library headers: it compiles in a fraction of
// a second): CUDA/HIP kernel code run on the host, each lane a coroutine, the lanes of a wavefront meeting at every
// cross-lane operation (shuffle, ballot, __syncwarp) and memory access, the block at __syncthreads. Compiled with
// -D__HIP_PLATFORM_AMD__ it offers HIP's cross-lane API (64-bit masks), without it CUDA's (32-bit masks, _sync only).
// warpSize is a variable, as in CUDA and in HIP since ROCm 7.0. The rest is RUNTIME_IMPL, compiled once.
#include <ucontext.h>
#include <setjmp.h>
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

#define SIMT_QUIET __attribute__((no_sanitize_thread))   // not instrumented

extern int warpSize;

namespace simt {
enum Op { NONE, SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, SYNCWARP, SYNCTHREADS, MEM };
enum Kind { READ, WRITE, ATOMIC };
struct Lane {
    ucontext_t ctx;          // how it starts; after that it switches with _setjmp/_longjmp (no system call)
    jmp_buf where;
    bool started;
    dim3 tid, bid;
    int wave, lane, state;   // state: 0 ready, 1 parked, 2 done
    int op, arg, width;
    uint64_t value, mask, result;
    bool masked;
    char *addr, *stack_top;  // op MEM: the access the lane waits to make (kind, size), where in the code (pc) and how
    int size, kind;          // deep in calls (depth): the wavefront's lanes at the deepest, lowest pc go first
    uintptr_t pc;
    long depth;
};
extern Lane* lanes;   // the lanes of the block that runs now
extern Lane* cur;     // the lane that runs now
extern dim3 g_block_dim, g_grid_dim;
extern int lock_step;   // 1: a wavefront's lanes run in lock-step (AMD); 0: a warp's only meet at _sync operations (CUDA)
void problem(const char* text);
uint64_t park(int op, uint64_t value, int arg, int width, bool masked, uint64_t mask);
int threads();
int wave_size(int wave);
void track(void* lo, long long bytes, bool shared);
long long last_writer(const void* p);   // the grid's thread that last wrote *p, or -1
void note_atomic(void* p, int size, void* pc, void* frame);
void launch_entry(int width, dim3 grid, dim3 block, uint64_t seed, int resident, void (*entry)(void*), void* arg);
void report(FILE* f);
template <class F> void call(void* f) { (*(F*)f)(); }
// Up to `resident` blocks at once, their wavefronts a step at a time in an order drawn from `seed`.
template <class F> void launch(int width, dim3 grid, dim3 block, uint64_t seed, int resident, F kernel) {
    launch_entry(width, grid, block, seed, resident, call<F>, &kernel);
}
template <class T> uint64_t bits(T v) { uint64_t b = 0; memcpy(&b, &v, sizeof(T)); return b; }
template <class T> T from_bits(uint64_t b) { T v; memcpy(&v, &b, sizeof(T)); return v; }
template <class T> T shuffle(int op, T v, int arg, int width, bool masked, uint64_t mask) {
    static_assert(sizeof(T) <= 8, "shuffles move values of up to 8 bytes");
    return from_bits<T>(park(op, bits(v), arg, width, masked, mask));
}
}  // namespace simt

#define threadIdx (simt::cur->tid)
#define blockIdx (simt::cur->bid)
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

// An atomic: one step of its wavefront (not instrumented, not inlined: its read and write are one)
#define SIMT_ATOMIC(name, expr)                                                                    \
    template <class T, class U> SIMT_QUIET __attribute__((noinline)) T name(T* address, U value) {   \
        simt::note_atomic(address, sizeof(T), __builtin_return_address(0), __builtin_frame_address(0)); \
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
template <class T> SIMT_QUIET __attribute__((noinline)) T atomicCAS(T* address, T compare, T value) {
    simt::note_atomic(address, sizeof(T), __builtin_return_address(0), __builtin_frame_address(0));
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
// CUDA (9 and later): only the _sync functions, with 32-bit masks; a warp has 32 lanes, and since Volta its lanes are
// scheduled independently: two accesses of one warp are ordered only by a _sync operation (or __syncthreads) between.
#ifndef SIMT_RUNTIME_IMPL   // in the kernel's own program only (the runtime is compiled once for both)
namespace simt { static const int cuda_lanes_independent = (lock_step = 0); }
#endif
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

RUNTIME_IMPL = r"""// utils.simt's runtime proper, compiled once (without -fsanitize=thread) and linked with every kernel: the
// scheduler, the memory bookkeeping that finds races, the report.
#define SIMT_RUNTIME_IMPL
#include "simt_cpu.h"

int warpSize = 64;

namespace simt {
static const char* const op_names[] = {"-", "a shuffle (idx)", "__shfl_up", "__shfl_down", "__shfl_xor", "a ballot/vote",
                                       "__syncwarp", "__syncthreads", "a memory access"};
// Every byte of the buffers and __shared__ variables keeps its last write and last read: by whom (1 + the thread's
// index in the grid; 0: none), after how many __syncthreads of its block (epoch), at which step of its wavefront.
// wsync: how many _sync cross-lane operations (shuffles, ballots, __syncwarp) its wavefront had made.
struct Access { int who, epoch, step, atomic, wsync; };
// r2: a read by another wavefront or block than the last reader's, kept so a later write is checked against both
struct Cell { Access w, r, r2; uint64_t value; };          // value: the byte the last write left
struct Region { char* lo; long long bytes, at; bool shared; };   // shared: at = its offset in each block's copy
struct Block { long long id; int epoch, steps[32], wsyncs[32]; Lane* lanes; char *stacks, *shared; Cell* shared_cells; };
struct Race { int region, size, a_kind, b_kind, rel; long long offset; Access a, b; };
struct CrossLane { int n; unsigned char op[16]; uint64_t mask[16]; };   // the active lanes of each cross-lane op
const int STACK = 64 * 1024, RESIDENT = 4, MAX_REGIONS = 64, MAX_RACES = 8;
Lane* lanes = nullptr;
Lane* cur = nullptr;
static Block blocks[RESIDENT];
static Block *current = nullptr, *shared_owner = nullptr;
static Region regions[MAX_REGIONS];
static Cell* cells[MAX_REGIONS];
static int n_regions = 0, n_races = 0;
static long long shared_bytes = 0;
static Race races[MAX_RACES];
static uint64_t rng = 1;
static ucontext_t scheduler;
static jmp_buf scheduler_at;
dim3 g_block_dim, g_grid_dim;
int lock_step = 1;
static void (*g_entry)(void*) = nullptr;
static void* g_arg = nullptr;
static char problems[20][320];
static int n_problems = 0;
static uint64_t* atomic_lanes = nullptr;   // per wavefront of the grid: a bit per lane that did an atomic
static CrossLane* cross = nullptr;         // per wavefront of the grid
static long long n_waves = 0;
static int max_shuffle_delta = 0;

void problem(const char* text) {
    for (int i = 0; i < n_problems; ++i) if (!strcmp(problems[i], text)) return;
    if (n_problems < 20) snprintf(problems[n_problems++], sizeof problems[0], "%s", text);
}
static void lane_main() {
    g_entry(g_arg);
    cur->state = 2;
    _longjmp(scheduler_at, 1);
}
uint64_t park(int op, uint64_t value, int arg, int width, bool masked, uint64_t mask) {
    cur->op = op; cur->value = value; cur->arg = arg; cur->width = width; cur->masked = masked; cur->mask = mask;
    cur->state = 1;
    if (!_setjmp(cur->where)) _longjmp(scheduler_at, 1);
    return cur->result;
}
int threads() { return g_block_dim.x * g_block_dim.y * g_block_dim.z; }
static int waves() { return (threads() + warpSize - 1) / warpSize; }
int wave_size(int wave) { int left = threads() - wave * warpSize; return left < warpSize ? left : warpSize; }

// --- memory: what each lane reads and writes, and the races between them
void track(void* lo, long long bytes, bool shared) {
    if (n_regions == MAX_REGIONS || bytes <= 0) return;
    Region& g = regions[n_regions];
    g.lo = (char*)lo; g.bytes = bytes; g.shared = shared; g.at = shared ? shared_bytes : 0;
    if (shared) shared_bytes += bytes;
    else cells[n_regions] = (Cell*)calloc(bytes, sizeof(Cell));
    ++n_regions;
}
static Cell* cell_at(const char* p, int* region) {
    for (int i = 0; i < n_regions; ++i) {
        Region& g = regions[i];
        if (p < g.lo || p >= g.lo + g.bytes) continue;
        *region = i;
        return g.shared ? current->shared_cells + g.at + (p - g.lo) : cells[i] + (p - g.lo);
    }
    return nullptr;
}
long long last_writer(const void* p) {
    int region;
    Cell* c = cell_at((const char*)p, &region);
    return c && c->w.who ? c->w.who - 1 : -1;
}
// Whether nothing orders access a before b (0: ordered or no conflict; 1: two blocks; 2: two wavefronts of a block
// between the same barriers; 3: one instruction of one wavefront; 4: two instructions of one CUDA warp with no _sync
// operation between them).
static int relation(const Access& a, const Access& b) {
    if (!a.who || a.who == b.who || (a.atomic && b.atomic)) return 0;
    long long n = threads(), ta = a.who - 1, tb = b.who - 1;
    if (ta / n != tb / n) return 1;
    if (a.epoch != b.epoch) return 0;
    if ((ta % n) / warpSize != (tb % n) / warpSize) return 2;
    if (a.step == b.step) return 3;
    return !lock_step && a.wsync == b.wsync ? 4 : 0;   // AMD: a later step of a wavefront comes after (lock-step)
}
static bool same_wave(const Access& a, const Access& b) {
    long long n = threads();
    return a.who && b.who && (a.who - 1) / n == (b.who - 1) / n && ((a.who - 1) % n) / warpSize == ((b.who - 1) % n) / warpSize;
}
static void race(int region, const char* p, int size, const Access& a, int a_kind, const Access& b, int b_kind, int rel) {
    for (int i = 0; i < n_races; ++i) if (races[i].region == region) return;   // one per buffer or variable
    if (n_races < MAX_RACES) races[n_races++] = {region, size, a_kind, b_kind, rel, p - regions[region].lo, a, b};
}
// Lane x of block b makes its access (a read: just before; a write or atomic: just after, its value in memory),
// byte by byte: accesses that overlap without starting at one address meet too.
static void note(Block& b, Lane& x, const char* p, int size, int kind) {
    int region, rel;
    Access me = {1 + (int)(b.id * threads() + (&x - b.lanes)), b.epoch, b.steps[x.wave], kind == ATOMIC,
                 b.wsyncs[x.wave]};
    for (int i = 0; i < size; ++i) {
        Cell* c = cell_at(p + i, &region);
        if (!c) continue;
        if (kind == READ) {
            if ((rel = relation(c->w, me))) race(region, p, size, c->w, c->w.atomic ? ATOMIC : WRITE, me, READ, rel);
            if (c->r.who && !same_wave(c->r, me)) c->r2 = c->r;
            c->r = me;
            continue;
        }
        uint64_t value = (unsigned char)p[i];
        rel = relation(c->w, me);
        if (rel && !(rel == 3 && !c->w.atomic && !me.atomic && c->value == value))   // lanes storing one value agree
            race(region, p, size, c->w, c->w.atomic ? ATOMIC : WRITE, me, kind, rel);
        if ((rel = relation(c->r, me))) race(region, p, size, c->r, READ, me, kind, rel);
        else if ((rel = relation(c->r2, me))) race(region, p, size, c->r2, READ, me, kind, rel);
        c->w = me;
        c->value = value;
    }
}
// Called by the instrumented kernel code before each load and store: a lane waits there for its wavefront's step.
static void access(void* p, int size, int kind, void* pc, void* frame) {
    int region;
    if (!cur || !cell_at((const char*)p, &region)) return;
    cur->addr = (char*)p; cur->size = size; cur->kind = kind; cur->pc = (uintptr_t)pc;
    cur->depth = cur->stack_top - (char*)frame;
    park(MEM, 0, 0, 0, false, 0);
}
void note_atomic(void* p, int size, void* pc, void* frame) {
    atomic_lanes[current->id * waves() + cur->wave] |= 1ull << cur->lane;
    access(p, size, ATOMIC, pc, frame);
}

// --- the scheduler
static void run(Lane& x) {
    cur = &x;
    if (_setjmp(scheduler_at)) return;
    if (x.started) _longjmp(x.where, 1);
    x.started = true;
    swapcontext(&scheduler, &x.ctx);
}
static uint64_t random_bits() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static void shuffled(int* order, int n) {
    for (int i = 0; i < n; ++i) order[i] = i;
    for (int i = n - 1; i > 0; --i) { int j = (int)(random_bits() % (i + 1)), t = order[i]; order[i] = order[j]; order[j] = t; }
}
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
    CrossLane& seen = cross[current->id * waves() + wave];
    if (seen.n < 16) seen.op[seen.n] = op, seen.mask[seen.n++] = active;
    for (int l = 0; l < n; ++l)          // a _sync operation orders its lanes' accesses before and after it
        if (((active >> l) & 1) && lanes[first + l].masked) { ++current->wsyncs[wave]; break; }
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
// One step of wavefront w of block b: its lanes that are ready run to their next stop; else the lanes waiting at the
// same memory access (the deepest in calls, the lowest in the code: where a wavefront in lock-step is) make it
// together, all reads of that instruction before any write of the next; else its cross-lane operation executes.
// False when every live lane waits at __syncthreads.
static bool step(Block& b, int w) {
    int first = w * warpSize, n = wave_size(w);
    bool ready = false, waiting = false;
    Lane* lead = nullptr;
    for (int l = 0; l < n; ++l) {
        Lane& x = b.lanes[first + l];
        if (x.state == 0) ready = true;
        else if (x.state == 1 && x.op == MEM) {
            if (!lead || x.depth > lead->depth || (x.depth == lead->depth && x.pc < lead->pc)) lead = &x;
        } else if (x.state == 1 && x.op != SYNCTHREADS) waiting = true;
    }
    if (ready) {
        for (int l = 0; l < n; ++l) if (b.lanes[first + l].state == 0) run(b.lanes[first + l]);
        return true;
    }
    if (!lead) {
        if (waiting) resolve(w);
        return waiting;
    }
    ++b.steps[w];
    uintptr_t pc = lead->pc;
    long depth = lead->depth;
    uint64_t group = 0;
    for (int l = 0; l < n; ++l) {
        Lane& x = b.lanes[first + l];
        if (x.state == 1 && x.op == MEM && x.pc == pc && x.depth == depth) group |= 1ull << l;
    }
    for (int l = 0; l < n; ++l) {
        if (!((group >> l) & 1)) continue;
        Lane& x = b.lanes[first + l];
        const char* p = x.addr;
        int size = x.size, kind = x.kind;
        if (kind == READ) note(b, x, p, size, kind);
        x.state = 0; x.op = NONE;
        run(x);
        if (kind != READ) note(b, x, p, size, kind);
    }
    return true;
}
// The block slot in use: its lanes, and its copy of the __shared__ variables in place.
static void use(Block& b) {
    current = &b; lanes = b.lanes;
    if (shared_owner == &b) return;
    for (int i = 0; i < n_regions; ++i) {
        Region& g = regions[i];
        if (!g.shared) continue;
        if (shared_owner) memcpy(shared_owner->shared + g.at, g.lo, g.bytes);
        memcpy(g.lo, b.shared + g.at, g.bytes);
    }
    shared_owner = &b;
}
static void start(Block& b, long long id) {
    int n = threads();
    if (!b.lanes) {
        b.lanes = (Lane*)malloc(n * sizeof(Lane));
        b.stacks = (char*)malloc((size_t)n * STACK);
        b.shared = (char*)malloc(shared_bytes + 1);
        b.shared_cells = (Cell*)malloc((shared_bytes + 1) * sizeof(Cell));
    }
    b.id = id; b.epoch = 0;
    memset(b.steps, 0, sizeof b.steps);
    memset(b.wsyncs, 0, sizeof b.wsyncs);
    memset(b.shared, 0, shared_bytes);
    memset(b.shared_cells, 0, shared_bytes * sizeof(Cell));
    if (shared_owner == &b) shared_owner = nullptr;   // the new block's __shared__ start at 0
    dim3 bid(id % g_grid_dim.x, (id / g_grid_dim.x) % g_grid_dim.y, id / ((long long)g_grid_dim.x * g_grid_dim.y));
    for (int t = 0; t < n; ++t) {
        Lane& x = b.lanes[t];
        memset(&x, 0, sizeof x);
        x.tid.x = t % g_block_dim.x; x.tid.y = (t / g_block_dim.x) % g_block_dim.y; x.tid.z = t / (g_block_dim.x * g_block_dim.y);
        x.bid = bid;
        x.wave = t / warpSize; x.lane = t % warpSize;
        x.stack_top = b.stacks + (size_t)(t + 1) * STACK;
        getcontext(&x.ctx);
        x.ctx.uc_stack.ss_sp = b.stacks + (size_t)t * STACK;
        x.ctx.uc_stack.ss_size = STACK;
        x.ctx.uc_link = &scheduler;
        makecontext(&x.ctx, lane_main, 0);
    }
}
void launch_entry(int width, dim3 grid, dim3 block, uint64_t seed, int resident, void (*entry)(void*), void* arg) {
    warpSize = width;
    g_grid_dim = grid; g_block_dim = block; g_entry = entry; g_arg = arg;
    rng = (seed + 1) * 0x9E3779B97F4A7C15ull | 1;
    long long total = (long long)grid.x * grid.y * grid.z, next = 0;
    n_waves = total * waves();
    atomic_lanes = (uint64_t*)calloc(n_waves, sizeof(uint64_t));
    cross = (CrossLane*)calloc(n_waves, sizeof(CrossLane));
    int slots = (int)(total < resident ? total : resident), live = 0, order[RESIDENT], wave_order[32];
    if (slots > RESIDENT) slots = RESIDENT;
    if (slots < 1) slots = 1;
    for (int s = 0; s < slots; ++s) start(blocks[s], next++), ++live;
    while (live) {
        shuffled(order, slots);
        for (int k = 0; k < slots; ++k) {
            Block& b = blocks[order[k]];
            if (b.id < 0) continue;
            use(b);
            bool moved = false;
            shuffled(wave_order, waves());
            for (int i = 0; i < waves(); ++i) if (step(b, wave_order[i])) moved = true;
            if (moved) continue;
            bool done = true;
            for (int t = 0; t < threads(); ++t) if (b.lanes[t].state != 2) done = false;
            if (!done) {   // every live lane waits at __syncthreads
                ++b.epoch;
                for (int t = 0; t < threads(); ++t) if (b.lanes[t].state == 1) b.lanes[t].state = 0, b.lanes[t].op = NONE;
            } else if (next < total) {
                start(b, next++);
            } else {
                b.id = -1;
                --live;
            }
        }
    }
    cur = nullptr;
}
void report(FILE* f) {
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
    fprintf(f, "], \"cross_lane\": [");
    for (long long w = 0; w < n_waves; ++w) {
        fprintf(f, "%s[", w ? ", " : "");
        for (int k = 0; k < cross[w].n; ++k) fprintf(f, "%s[%d, %llu]", k ? ", " : "", cross[w].op[k], (unsigned long long)cross[w].mask[k]);
        fprintf(f, "]");
    }
    fprintf(f, "], \"races\": [");
    for (int i = 0; i < n_races; ++i) {
        Race& r = races[i];
        fprintf(f, "%s[%d, %lld, %d, %d, %d, %d, %d, %d]", i ? ", " : "", r.region, r.offset, r.size, r.a.who - 1, r.a_kind,
                r.b.who - 1, r.b_kind, r.rel);
    }
    fprintf(f, "]}\n");
}
}  // namespace simt

// What GCC's -fsanitize=thread calls before each load and store of the kernel code (no ThreadSanitizer is linked):
// the access, its size and where it is made (this file itself is compiled without it).
#define SIMT_HOOK(name, size, kind) \
    extern "C" void name(void* p) { simt::access(p, size, kind, __builtin_return_address(0), __builtin_frame_address(0)); }
#define SIMT_HOOKS(size) SIMT_HOOK(__tsan_read##size, size, simt::READ) SIMT_HOOK(__tsan_write##size, size, simt::WRITE) \
    SIMT_HOOK(__tsan_unaligned_read##size, size, simt::READ) SIMT_HOOK(__tsan_unaligned_write##size, size, simt::WRITE) \
    SIMT_HOOK(__tsan_volatile_read##size, size, simt::READ) SIMT_HOOK(__tsan_volatile_write##size, size, simt::WRITE)
SIMT_HOOKS(1) SIMT_HOOKS(2) SIMT_HOOKS(4) SIMT_HOOKS(8) SIMT_HOOKS(16)
extern "C" void __tsan_read_range(void* p, unsigned long n) { simt::access(p, (int)n, simt::READ, __builtin_return_address(0), __builtin_frame_address(0)); }
extern "C" void __tsan_write_range(void* p, unsigned long n) { simt::access(p, (int)n, simt::WRITE, __builtin_return_address(0), __builtin_frame_address(0)); }
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_vptr_update(void*, void*) {}
extern "C" void __tsan_vptr_read(void*) {}

"""

_CTYPES = {np.dtype(np.int32): "int", np.dtype(np.uint32): "unsigned int", np.dtype(np.int64): "long long",
           np.dtype(np.uint64): "unsigned long long", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_PAD = 1024   # elements after each buffer: a kernel that reads past the end gets these, one that writes there is caught


class KernelError(RuntimeError):
    """The kernel did not compile, crashed, did not finish, or wrote outside its buffers."""


@dataclass
class KernelRun:
    buffers: dict[str, np.ndarray]     # the pointer arguments after the kernel ran
    problems: list[str]                # what the runtime saw that a GPU would not report (empty: none), races included
    atomic_lanes: list[list[int]]      # per wavefront of the grid, in order: the lanes that did an atomic
    max_shuffle_delta: int             # the largest offset a shuffle up/down/xor used
    races: list[str]                   # the races among those problems: one per buffer or __shared__ variable
    cross_lane: list[list[tuple[str, int]]]   # per wavefront of the grid: each cross-lane op ("shuffle", "ballot",
                                              # "syncwarp") with the mask of the lanes that took part (up to 16)


def compiler() -> str:
    """The C++ compiler simt builds kernels with (g++, c++ or clang++); KernelError with the install line if none."""
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
             "    unsigned long long seed = strtoull(argv[6], 0, 10); int resident = atoi(argv[7]);",
             "    FILE* in = fopen(argv[4], \"rb\");"]
    call = []
    for i, (arg_name, value) in enumerate(args):
        if isinstance(value, np.ndarray):
            ctype = _CTYPES[value.dtype]
            lines += [f"    long long n{i}; if (fread(&n{i}, 8, 1, in) != 1) return 3;",
                      f"    {ctype}* a{i} = ({ctype}*)malloc(n{i} * sizeof({ctype}));",
                      f"    if (fread(a{i}, sizeof({ctype}), n{i}, in) != (size_t)n{i}) return 3;",
                      f"    simt::track(a{i}, n{i} * (long long)sizeof({ctype}), false);"]
            call.append(f"a{i}")
        else:
            ctype = "double" if isinstance(value, float) else "long long"
            lines.append(f"    {ctype} s{i}; if (fread(&s{i}, 8, 1, in) != 1) return 3;")
            call.append(f"({'float' if isinstance(value, float) else 'int'})s{i}")
    lines += ["    long long n_shared; if (fread(&n_shared, 8, 1, in) != 1) return 3;",
              "    for (long long k = 0; k < n_shared; ++k) {   // the __shared__ variables: address, bytes",
              "        long long at[2]; if (fread(at, 8, 2, in) != 2) return 3;",
              "        simt::track((void*)at[0], at[1], true);",
              "    }",
              "    fclose(in);",
              f"    simt::launch(width, grid, block, seed, resident, [&] {{ {name}({', '.join(call)}); }});",
              "    FILE* out = fopen(argv[5], \"wb\");"]
    lines += [f"    fwrite(a{i}, sizeof(a{i}[0]), n{i}, out);"
              for i, (_, value) in enumerate(args) if isinstance(value, np.ndarray)]
    lines += ["    fclose(out);", "    simt::report(stdout);", "    return 0;", "}"]
    return "\n".join(lines)


# -O1 -w for all; -U_FORTIFY_SOURCE: a lane's _longjmp goes to another stack, which a fortified one refuses
_FLAGS = ["-std=c++17", "-O1", "-w", "-U_FORTIFY_SOURCE"]


def _build(source: str, name: str, args: list, platform: str) -> Path:
    main = _main_source(name, args)
    cxx = compiler()
    key = hashlib.sha256("\0".join([RUNTIME, RUNTIME_IMPL, source, main, platform, cxx]).encode()).hexdigest()[:20]
    # compiled helpers live in this user's private build folder (0700, checked), never in a shared /tmp where
    # another user could plant a program of the expected name; each is run only if its bytes still hash to what
    # was recorded when it was built
    cache = private_dir(build_dir() / "cache" / "simt")
    exe = cache / f"{name}-{platform}-{key}"
    if _trusted(exe):
        return exe
    runtime = _runtime_object(cxx, cache)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        tmp = Path(tmp)
        for header in ("cuda_runtime.h", "cuda.h", "hip/hip_runtime.h"):
            (tmp / "include" / header).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "include" / header).write_text("")
        (tmp / "simt_cpu.h").write_text(RUNTIME)
        (tmp / "kernel.cu").write_text(source)
        (tmp / "main.cpp").write_text(f'#line 1 "kernel.cu"\n{source}\n#line 1 "main.cpp"\n{main}\n')
        # -fsanitize=thread: the compiler calls the runtime's __tsan_* hooks at every load and store, and
        # -nodefaultlibs keeps ThreadSanitizer's own library out (the usual ones are named); -no-pie: the
        # addresses nm gives are those the program runs at
        cmd = [cxx, *_FLAGS, "-fsanitize=thread", "-no-pie", "-nodefaultlibs", "-x", "c++", "-I", str(tmp / "include"),
               "-include", str(tmp / "simt_cpu.h"), *(["-D__HIP_PLATFORM_AMD__"] if platform == "hip" else []),
               str(tmp / "main.cpp"), "-x", "none", str(runtime), "-lstdc++", "-lm", "-lc", "-lgcc_s", "-lgcc",
               "-o", str(tmp / "exe")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            lines = run.stderr.splitlines()
            errors = [line.split("error: ", 1)[1] if "error: " in line else line.split(": ", 1)[-1]
                      for line in lines if "error: " in line or "undefined reference" in line]
            where = sorted({int(m.group(1)) for line in lines if (m := re.match(r".*kernel\.cu:(\d+):", line))})
            raise KernelError(f"the kernel does not compile ({'HIP' if platform == 'hip' else 'CUDA'}): "
                              + "; ".join(dict.fromkeys(errors[:3]))
                              + (f" (kernel line {', '.join(map(str, where[:3]))})" if where else ""))
        _keep(tmp / "exe", exe)
    return exe


def _runtime_object(cxx: str, cache: Path) -> Path:
    """RUNTIME_IMPL compiled (once per compiler and runtime), kept as the helpers are."""
    key = hashlib.sha256("\0".join([RUNTIME, RUNTIME_IMPL, cxx]).encode()).hexdigest()[:20]
    obj = private_dir(cache / "runtime") / f"simt-{key}.o"
    if _trusted(obj):
        return obj
    with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
        tmp = Path(tmp)
        (tmp / "simt_cpu.h").write_text(RUNTIME)
        (tmp / "runtime.cpp").write_text(RUNTIME_IMPL)
        run = subprocess.run([cxx, *_FLAGS, "-c", str(tmp / "runtime.cpp"), "-o", str(tmp / "runtime.o")],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise KernelError(f"utils.simt's runtime does not compile with {cxx}: {run.stderr.strip()[-600:]}")
        _keep(tmp / "runtime.o", obj)
    return obj


def _keep(built: Path, dest: Path) -> None:
    """Moves `built` to `dest`, with the digest of its bytes recorded beside it (see _trusted)."""
    digest = hashlib.sha256(built.read_bytes()).hexdigest()
    os.replace(built, dest)
    state.write_text_atomic(dest.with_suffix(".sha256"), digest + "\n")


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


@functools.lru_cache(maxsize=64)
def _shared_variables(exe: str) -> tuple | None:
    """(address, bytes, name) of each variable `static` inside a function of `exe` (the kernel's `__shared__`
    variables: `__shared__` is `static` here), as nm lists them; None if nm cannot say."""
    try:
        listed = subprocess.run([shutil.which("nm") or "nm", "-p", "-S", "--defined-only", exe], capture_output=True,
                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    found = []
    for fields in map(str.split, listed):
        # _ZZ <function> E <length><name> [discriminator]: e.g. _ZZ12sum_portablePKiPiiE7partial
        if len(fields) == 4 and fields[3].startswith("_ZZ") and fields[2] in "bBdDuVv" and int(fields[1], 16):
            symbol = fields[3]
            names = [symbol[m.end():m.end() + int(m.group(1))] for m in re.finditer(r"E(\d+)", symbol)
                     if re.fullmatch(r"(_\d|__\d+_)?", symbol[m.end() + int(m.group(1)):])]
            found.append((int(fields[0], 16), int(fields[1], 16), names[-1] if names else symbol))
    return tuple(found)


_ACCESS = ("read", "wrote", "atomically updated")
CROSS_LANE = {1: "shuffle", 2: "shuffle", 3: "shuffle", 4: "shuffle", 5: "ballot", 6: "syncwarp"}


def _race_text(race: list, regions: list, threads: int, width: int) -> str:
    """What the runtime's race record says, in words: the address (buffer or __shared__ variable, and index) and
    the two lanes."""
    region, offset, size, a, a_kind, b, b_kind, rel = race
    name, itemsize, shared = regions[region]
    where = f"{'__shared__ ' if shared else ''}`{name}[{offset // (itemsize or size or 1)}]`"

    def who(t):
        lane = t % threads
        return f"thread {lane} of block {t // threads} (wavefront {lane // width}, lane {lane % width})"

    if rel == 3:
        return (f"a race on {where}: lanes {a % threads % width} and {b % threads % width} of wavefront "
                f"{a % threads // width} of block {a // threads} stored different values there at one instruction, "
                "without an atomic: only one store survives (a += from several lanes keeps one lane's addition)")
    if rel == 4:
        return (f"a race on {where}: {who(a)} {_ACCESS[a_kind]} it and {who(b)} {_ACCESS[b_kind]} it, lanes of one "
                "CUDA warp with no __syncwarp (or other _sync operation) between: since Volta a warp's lanes are "
                "scheduled independently, so nothing orders the two (on AMD a wavefront runs in lock-step)")
    why = ("two blocks of one launch run in any order" if rel == 1 else
           "with no __syncthreads between them, two wavefronts of a block run in any order")
    return (f"a race on {where}: {who(a)} {_ACCESS[a_kind]} it and {who(b)} {_ACCESS[b_kind]} it, without an atomic "
            f"and with nothing to order them ({why})")


def run_kernel(source: str, name: str, args: list, *, grid: int, block: int, width: int, platform: str = "hip",
               timeout: float = 30.0, seed: int = 0) -> KernelRun:
    """Run `name(args...)` from CUDA/HIP `source` on the CPU over `grid` blocks of `block` threads (1-D), in
    wavefronts of `width` lanes. `args` are (name, value) pairs in the kernel's order: a NumPy array becomes
    a pointer to a copy of it (int32, uint32, int64, uint64, float32, float64), a Python int an `int`, a
    float a `float`. Up to 4 blocks run at once; their wavefronts take turns a memory access at a time, in an
    order drawn from `seed`, each wavefront's lanes in lock-step. Races (two lanes, one writing, on one address
    between the same barriers, not both atomic) are reported among the problems. Raises KernelError if the kernel
    does not compile, crashes, runs longer than `timeout` seconds, or stores past the end of a buffer."""
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
    shared = _shared_variables(str(exe)) if "__shared__" in source else ()
    regions = [(arg_name, value.itemsize, False) for arg_name, value in args if isinstance(value, np.ndarray)]
    regions += [(var, None, True) for _, _, var in shared or ()]
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
            f.write(np.array([len(shared or ()), *[v for address, size, _ in shared or () for v in (address, size)]],
                             np.int64).tobytes())
        try:
            # blocks one at a time where the __shared__ variables are unknown (each block needs its own copy)
            run = subprocess.run([str(exe), str(width), str(grid), str(block), str(tmp / "in.bin"),
                                  str(tmp / "out.bin"), str(seed % 2**63), "4" if shared is not None else "1"],
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
    races = [_race_text(race, regions, block, width) for race in report["races"]]
    cross_lane = [[(CROSS_LANE.get(op, "?"), mask) for op, mask in ops] for ops in report["cross_lane"]]
    return KernelRun(buffers, report["problems"] + races, report["atomic_lanes"], report["max_shuffle_delta"], races,
                     cross_lane)
