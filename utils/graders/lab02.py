"""Lab 02's graders (exercises 2.1-2.4): the SIMT model's passes, and the lab's kernels run by utils.simt on CUDA's and HIP's lane widths."""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from utils import simt, solutions
from utils.exercises import check

# Where the graders run a kernel: CUDA's API on a 32-lane warp, HIP's on a 64-lane (CDNA) and a 32-lane (RDNA) wavefront.
MACHINES = [("cuda", 32, "CUDA, 32-lane warps"), ("hip", 64, "HIP, 64-lane wavefronts (CDNA)"),
            ("hip", 32, "HIP, 32-lane wavefronts (RDNA)")]
MASK_HINT = ("HIP's __shfl_*_sync and __ballot_sync take a 64-bit mask, so a 32-bit 0xffffffff does not compile there "
             "(and would leave lanes 32-63 out): use the lab's macros (SHFL_DOWN, SHFL_XOR, BALLOT), which pick each "
             "platform's own call")
HIP_ONLY_HINT = ("CUDA has no unmasked __shfl_down, __shfl_xor, __ballot, __any or __all (gone since CUDA 9; only the "
                 "_sync forms with a 32-bit mask), nor __lane_id(): use the lab's macros (SHFL_DOWN, SHFL_XOR, BALLOT), "
                 "which pick each platform's own call, and threadIdx.x % warpSize for the lane")
CONSTANT_HINT = ("warpSize is a variable, not a compile-time constant (in CUDA, and in HIP since ROCm 7.0): it cannot "
                 "size an array or be a template argument; make the width a template parameter and pick the instance "
                 "at run time: warpSize == 64 ? f<64>(v) : f<32>(v)")
WAVEFRONT_SIZE_HINT = ("__AMDGCN_WAVEFRONT_SIZE is HIP-only and deprecated since ROCm 7.0 (CUDA has no such macro): "
                       "read warpSize at run time")
SHIFT_HINT = ("A mask of 0 names no lane: was it (1ull << warpSize) - 1? Shifting a 64-bit value by 64 is undefined in "
              "C++ (x86 and AMD GPUs shift by 0 and get 0): use ~0ull, or __activemask()")

# Compiled in front of the learner's kernel (after utils.simt's runtime, before the lab's SHUFFLE macros): every
# cross-lane call goes through a wrapper that adds, to the runtime's own list of problems, what the runtime lets pass
# but one vendor leaves undefined: a shuffle width that is not a power of two up to the lane count (or, for this lab's
# whole-wavefront reductions, not the lane count), and, on HIP, a mask naming a lane that does not make the call
# (HIP's __hip_check_mask: the mask must be exactly the lanes that call; CUDA tolerates lanes that have exited). The
# lanes that left an operation together are found by the first of them to run again: the runtime releases them all
# (state 0) before any of them runs, and no other lane of the wavefront moves meanwhile.
PROBE = r"""#line 1 "lab02_probe.h"
namespace lab02 {
static uint64_t released[32], released_set[32];   // per wavefront of the block (1024 threads / 32 lanes at most)
static bool parked = false;                       // whether a lane ever waited at a cross-lane op or __syncthreads
static uint64_t wave_bits() { int n = simt::wave_size(simt::cur->wave); return n >= 64 ? ~0ull : (1ull << n) - 1; }
static uint64_t released_with_me() {
    simt::Lane* me = simt::cur;
    int w = me->wave, first = w * warpSize, n = simt::wave_size(w);
    uint64_t bit = 1ull << me->lane;
    if (!(released[w] & bit)) {
        uint64_t s = 0;
        for (int l = 0; l < n; ++l) if (simt::lanes[first + l].state == 0) s |= 1ull << l;
        released[w] = released_set[w] = s;
    }
    released[w] &= ~bit;
    return released_set[w];
}
static void check_width(const char* what, int width) {
    parked = true;
    if (width == warpSize) return;
    char text[320];
    if (width < 1 || (width & (width - 1)) || width > warpSize)
        snprintf(text, sizeof text, "%s with width %d on a %d-lane wavefront: the width must be a power of two no larger "
                 "than the lane count (undefined otherwise, on CUDA and on HIP); leave the width out, it defaults to "
                 "warpSize", what, width, warpSize);
    else
        snprintf(text, sizeof text, "%s with width %d on a %d-lane wavefront shuffles inside groups of %d lanes, not "
                 "across the wavefront: leave the width out (it defaults to warpSize, the lane count)", what, width,
                 warpSize, width);
    simt::problem(text);
}
static void check_mask(const char* what, uint64_t mask, uint64_t together) {
#if defined(__HIP_PLATFORM_AMD__)
    if (warpSize == 32) mask &= 0xffffffffull;                 // HIP ignores the upper half on wave32
    uint64_t idle = mask & wave_bits() & ~together;
    if (!idle || !(mask & (1ull << simt::cur->lane))) return;  // a caller left out of the mask: the runtime says so
    int first = simt::cur->wave * warpSize, lo = __builtin_ctzll(idle), count = __builtin_popcountll(idle), gone = 0;
    for (int l = 0; l < 64; ++l) if (((idle >> l) & 1) && simt::lanes[first + l].state == 2) ++gone;
    char text[320];
    snprintf(text, sizeof text, "%s's mask 0x%llx names %d lane%s (from lane %d) that did not call it (%s): undefined on "
             "HIP, where the mask must be exactly the calling lanes. Keep every lane alive to the call (vote i < n && ...) "
             "rather than return or branch around it", what, (unsigned long long)mask, count, count == 1 ? "" : "s", lo,
             gone == count ? "they had finished: returned, or went around the call"
             : gone ? "some had finished, some waited at another call" : "they waited at another call");
    simt::problem(text);
#else
    (void)what; (void)mask; (void)together;
#endif
}
template <class M, class T> T shfl_sync(M mask, T v, int src, int width = warpSize) {
    check_width("__shfl_sync", width); T r = ::__shfl_sync(mask, v, src, width);
    check_mask("__shfl_sync", (uint64_t)mask, released_with_me()); return r;
}
template <class M, class T> T shfl_up_sync(M mask, T v, unsigned int d, int width = warpSize) {
    check_width("__shfl_up_sync", width); T r = ::__shfl_up_sync(mask, v, d, width);
    check_mask("__shfl_up_sync", (uint64_t)mask, released_with_me()); return r;
}
template <class M, class T> T shfl_down_sync(M mask, T v, unsigned int d, int width = warpSize) {
    check_width("__shfl_down_sync", width); T r = ::__shfl_down_sync(mask, v, d, width);
    check_mask("__shfl_down_sync", (uint64_t)mask, released_with_me()); return r;
}
template <class M, class T> T shfl_xor_sync(M mask, T v, int m, int width = warpSize) {
    check_width("__shfl_xor_sync", width); T r = ::__shfl_xor_sync(mask, v, m, width);
    check_mask("__shfl_xor_sync", (uint64_t)mask, released_with_me()); return r;
}
static auto activemask() -> decltype(::__activemask()) { parked = true; auto r = ::__activemask(); released_with_me(); return r; }
template <class M> auto ballot_sync(M mask, int pred, const char* what = "__ballot_sync") -> decltype(::__ballot_sync(mask, pred)) {
    parked = true; auto r = ::__ballot_sync(mask, pred); check_mask(what, (uint64_t)mask, released_with_me()); return r;
}
template <class M> int any_sync(M mask, int pred) { return ballot_sync(mask, pred, "__any_sync") != 0; }
template <class M> int all_sync(M mask, int pred) { auto b = ballot_sync(mask, pred, "__all_sync"); return b == (activemask() & mask); }
template <class M> void syncwarp(M mask) { parked = true; ::__syncwarp(mask); check_mask("__syncwarp", (uint64_t)mask, released_with_me()); }
static void syncthreads() { parked = true; ::__syncthreads(); }
#if defined(__HIP_PLATFORM_AMD__)
template <class T> T shfl(T v, int src, int width = warpSize) { check_width("__shfl", width); T r = ::__shfl(v, src, width); released_with_me(); return r; }
template <class T> T shfl_up(T v, unsigned int d, int width = warpSize) { check_width("__shfl_up", width); T r = ::__shfl_up(v, d, width); released_with_me(); return r; }
template <class T> T shfl_down(T v, unsigned int d, int width = warpSize) { check_width("__shfl_down", width); T r = ::__shfl_down(v, d, width); released_with_me(); return r; }
template <class T> T shfl_xor(T v, int m, int width = warpSize) { check_width("__shfl_xor", width); T r = ::__shfl_xor(v, m, width); released_with_me(); return r; }
static unsigned long long ballot(int pred) { parked = true; auto r = ::__ballot(pred); released_with_me(); return r; }
static int any(int pred) { return ballot(pred) != 0; }
static int all(int pred) { auto b = ballot(pred); return b == activemask(); }
#else
static void syncwarp() { syncwarp(0xffffffffu); }
#endif
}  // namespace lab02
#define __shfl_sync lab02::shfl_sync
#define __shfl_up_sync lab02::shfl_up_sync
#define __shfl_down_sync lab02::shfl_down_sync
#define __shfl_xor_sync lab02::shfl_xor_sync
#define __ballot_sync lab02::ballot_sync
#define __any_sync lab02::any_sync
#define __all_sync lab02::all_sync
#define __activemask lab02::activemask
#define __syncwarp lab02::syncwarp
#define __syncthreads lab02::syncthreads
#if defined(__HIP_PLATFORM_AMD__)
#define __shfl lab02::shfl
#define __shfl_up lab02::shfl_up
#define __shfl_down lab02::shfl_down
#define __shfl_xor lab02::shfl_xor
#define __ballot lab02::ballot
#define __any lab02::any
#define __all lab02::all
#endif
"""

# 2.4 only: the learner's `converged` runs inside this wrapper, which finds, for every lane, the elements it changed
# (a kernel without cross-lane operations or __syncthreads runs each lane to its end before the next one starts) and
# reports a wavefront whose lanes processed elements of both sides: its lanes took both sides of the branch.
DIVERGES = "processed A-elements and B-elements"
CONVERGED_RENAME = "#define converged lab02_learner_converged\n"
CONVERGED_WATCH = r"""
#undef converged
namespace lab02 {
static float* before = nullptr;
static long long watched_block = -1;
static int sides[32];   // per wavefront of the block: bit 0 an A-element written, bit 1 a B-element
}
void converged(float* x, int n, int period, int iters) {
    if (!lab02::before) {
        lab02::before = (float*)malloc((n > 0 ? n : 1) * sizeof(float));
        memcpy(lab02::before, x, (n > 0 ? n : 0) * sizeof(float));
    }
    if (lab02::watched_block != (long long)blockIdx.x) {
        lab02::watched_block = blockIdx.x;
        memset(lab02::sides, 0, sizeof lab02::sides);
    }
    lab02_learner_converged(x, n, period, iters);
    if (lab02::parked || period < 1) return;
    int wave = simt::cur->wave;
    for (int e = 0; e < n; ++e) {
        if (memcmp(&x[e], &lab02::before[e], sizeof(float)) == 0) continue;
        lab02::before[e] = x[e];
        int in_block = e % (int)blockDim.x;
        lab02::sides[wave] |= ((in_block / period) % 2 == 0) ? 1 : 2;
    }
    if (lab02::sides[wave] == 3) {
        char text[320];
        snprintf(text, sizeof text, "wavefront %d of block %d (%d lanes) processed A-elements and B-elements at period %d: "
                 "its lanes take both sides of the branch, so it still diverges. The side must depend only on which half "
                 "of the block a thread is in", wave, (int)blockIdx.x, warpSize, period);
        simt::problem(text);
    }
}
"""

# --- 2.1: predict what a branch costs -----------------------------------------------------------------

def check_passes(predicted_passes: Callable[[], dict]) -> None:
    """The prediction against the SIMT model (which the lab's GPU measurement confirms)."""
    predicted = predicted_passes()
    wanted = {(w, p): simt.branch(w, p).passes_per_wave for w in (32, 64) for p in (16, 32, 64)}
    if not isinstance(predicted, dict) or set(predicted) != set(wanted):
        check("a dict for each (lanes, period)", False, f"return a dict with the keys {sorted(wanted)}")
    for (w, p), want in sorted(wanted.items()):
        got = predicted[w, p]
        if isinstance(got, (int, float, np.integer, np.floating)) and not isinstance(got, bool) and got == want:
            continue
        if want == 2:
            hint = (f"with period {p} the side changes every {p} lanes, so a {w}-lane wavefront holds lanes of both "
                    "sides: both run, one after the other")
        else:
            hint = f"with period {p} all {w} lanes of a wavefront take the same side: one pass"
        check(f"{w} lanes, period {p}", False, f"you said {got!r}: {hint}")


# --- running a kernel on the SIMT machine --------------------------------------------------------------

def kernel_source(make_source: Callable[[], str], name: str) -> str:
    """The source the learner's function returns, or the check's failure if it is not a kernel named `name`."""
    source = make_source()
    if not isinstance(source, str):
        check(f"the source of {name}", False, f"return the kernel's CUDA source as a string (r\"\"\"...\"\"\"), "
              f"not a {type(source).__name__}")
    if not re.search(rf"\b{name}\s*\(", source):
        check(f"the source of {name}", False, f"the source must define the kernel `__global__ void {name}(...)`")
    return source


def compile_hint(message: str, platform: str) -> str:
    """A hint for what the compiler said about a kernel, where it names a known portability mistake."""
    if "64-bit integer" in message:
        return MASK_HINT
    if platform == "cuda" and re.search(r"\W(__shfl|__shfl_up|__shfl_down|__shfl_xor|__ballot|__any|__all|__lane_id)\W+ "
                                        r"was not declared", message):   # quoted '' or ‘’, as the locale has it
        return HIP_ONLY_HINT
    if "__AMDGCN_WAVEFRONT_SIZE" in message:
        return WAVEFRONT_SIZE_HINT
    if "warpSize" in message and re.search(r"constant|template argument|constexpr", message):
        return CONSTANT_HINT
    return ""


def run_on(lab, source: str, name: str, args: list, n: int, platform: str, width: int, what: str, watch: bool = False):
    """`name` from `source` (after the lab's SHUFFLE macros and the PROBE around every cross-lane call) over
    ceil(n / THREADS) blocks, or the check's failure. `lab` is the lab's exported module (`solutions.load("02")`:
    SHUFFLE, THREADS, DIVERGENT). `watch`: the kernel is 2.4's converged, run inside CONVERGED_WATCH."""
    full = (PROBE + '#line 1 "lab02_macros.h"\n' + lab.SHUFFLE + (CONVERGED_RENAME if watch else "")
            + '#line 1 "kernel.cu"\n' + source + '\n#line 1 "lab02_watch.h"\n' + (CONVERGED_WATCH if watch else ""))
    try:
        run = simt.run_kernel(full, name, args, grid=max(1, -(-n // lab.THREADS)), block=lab.THREADS,
                              width=width, platform=platform)
    except simt.KernelError as err:
        message = str(err).replace("lab02_learner_converged", "converged")
        message = re.sub(r"\blab02::(\w+)", r"__\1", message)
        hint = compile_hint(message, platform)
        check(f"{name} on {what}", False, message + (f". {hint}" if hint else ""))
    problems = [p for p in run.problems if not (watch and DIVERGES in p)]   # judged after the values: check_converged
    if problems:
        problem = problems[0]
        check(f"{name} on {what}, n = {n}", False, problem + (f". {SHIFT_HINT}" if "(mask 0x0)" in problem else ""))
    return run


def wave_starts(run, width: int, threads: int) -> list[int]:
    """The first element index of each wavefront of the grid, in run.atomic_lanes's order."""
    per_block = -(-threads // width)
    return [(k // per_block) * threads + (k % per_block) * width for k in range(len(run.atomic_lanes))]


def lanes_per_wave_hint(run, width: int, n: int | None = None, threads: int = 256) -> str | None:
    """A hint if some wavefront had more than one lane add to the total, or (given n) a wavefront holding
    elements had none, or none at all did."""
    many = next((lanes for lanes in run.atomic_lanes if len(lanes) > 1), None)
    if many:
        shown = str(many) if len(many) <= 4 else f"[{many[0]}, {many[1]}, ..., {many[-1]}] ({len(many)} lanes)"
        return (f"lanes {shown} of one {width}-lane wavefront each added to the total: one lane per wavefront must "
                "add (threadIdx.x % warpSize == 0), not every 32nd (& 31, % 32) nor every lane")
    if all(not lanes for lanes in run.atomic_lanes):
        return "no lane added anything to the total: lane 0 of each wavefront adds its sum with atomicAdd"
    if n is not None:
        starts = wave_starts(run, width, threads)
        idle = next((k for k, lanes in enumerate(run.atomic_lanes) if not lanes and starts[k] < n), None)
        if idle is not None:
            return (f"the {width}-lane wavefront holding elements {starts[idle]} to {min(starts[idle] + width, n) - 1} "
                    "added nothing to the total: lane 0 of every wavefront adds (threadIdx.x % warpSize == 0), not "
                    "every 64th lane")
    return None


def one_adder_per_wave(run, width: int, name: str, what: str, n: int) -> None:
    """The exercise's rule, checked even when the total is right: at most one atomicAdd per wavefront."""
    many = next((lanes for lanes in run.atomic_lanes if len(lanes) > 1), None)
    if many:
        check(f"{name} on {what}, n = {n}", False, "the total is right, but " + lanes_per_wave_hint(run, width))


# --- 2.2: a reduction for any lane width ---------------------------------------------------------------

def sum_inputs() -> list[tuple[str, np.ndarray]]:
    """(what, x): small integers of both signs at ragged sizes, then large ones whose sum is small (exact in int,
    not in float)."""
    out = []
    for n in (1, 33, 1000):
        out.append(("", ((np.arange(n) * 7 + 3) % 11 - 4).astype(np.int32)))
    n = 4099
    big = np.where(np.arange(n) % 2 == 0, (1 << 24) + 1, -(1 << 24)).astype(np.int64) + (np.arange(n) % 5 - 2)
    out.append((" (values near +-2^24)", big.astype(np.int32)))
    return out


def check_portable_sum(sum_portable_kernel: Callable[[], str]) -> None:
    """sum_portable(x, out, n), the source `sum_portable_kernel()` returns, must give the exact integer sum on
    every machine in MACHINES, with one atomicAdd per wavefront."""
    source, lab = kernel_source(sum_portable_kernel, "sum_portable"), solutions.load("02")
    inputs = sum_inputs()
    for platform, width, what in MACHINES:
        for label, x in inputs:
            n = x.size
            run = run_on(lab, source, "sum_portable", [("x", x), ("out", np.zeros(1, np.int32)), ("n", n)], n,
                         platform, width, what)
            got, exact = int(run.buffers["out"][0]), int(x.astype(np.int64).sum())
            if got == exact:
                one_adder_per_wave(run, width, "sum_portable", what, n)
                continue
            hint = lanes_per_wave_hint(run, width, n, lab.THREADS)
            if hint is None and run.max_shuffle_delta < width // 2:
                hint = (f"the largest shuffle offset was {run.max_shuffle_delta}: a {width}-lane wavefront needs "
                        f"{width // 2} first (offsets warpSize / 2, ..., 1)")
            if hint is None and run.max_shuffle_delta >= width:
                hint = (f"a shuffle offset of {run.max_shuffle_delta} on a {width}-lane wavefront reads no other lane "
                        f"(each lane gets its own value back and adds it twice): start at warpSize / 2 = {width // 2}")
            if hint is None and label:
                hint = ("these values are large integers: the sum must stay exact, so keep v and the sum in int "
                        "(a float rounds integers beyond 2^24)")
            check(f"sum_portable on {what}, n = {n}{label}", False, f"sum {got}, exact {exact}: "
                  + (hint or "check the guard i < n (lanes past the end add 0) and the loop"))
        print(f"PASS: sum_portable exact on {what}")


# --- 2.3: counting with a ballot -----------------------------------------------------------------------

def count_inputs() -> list[np.ndarray]:
    """Normal values with zeros and negative zeros (neither is positive) at ragged sizes, and a run of positives."""
    out = []
    for n in (1, 33, 1000, 4099):
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        x[::7] = 0.0
        x[3::13] = -0.0
        x[n // 2:n // 2 + 130] = np.abs(x[n // 2:n // 2 + 130]) + 1.0   # whole wavefronts voting yes
        out.append(x)
    return out


def check_count_positive(count_positive_kernel: Callable[[], str]) -> None:
    """count_positive(x, count, n), the source `count_positive_kernel()` returns, must count exactly on every
    machine in MACHINES, with one atomicAdd per wavefront."""
    source, lab = kernel_source(count_positive_kernel, "count_positive"), solutions.load("02")
    inputs = count_inputs()
    for platform, width, what in MACHINES:
        for x in inputs:
            n = x.size
            run = run_on(lab, source, "count_positive", [("x", x), ("count", np.zeros(1, np.int32)), ("n", n)],
                         n, platform, width, what)
            got, exact = int(run.buffers["count"][0]), int((x > 0).sum())
            if got == exact:
                one_adder_per_wave(run, width, "count_positive", what, n)
                continue
            padded = np.concatenate([x > 0, np.ones(-(-n // lab.THREADS) * lab.THREADS - n, bool)])  # lanes past n say yes
            per_wave = [np.concatenate([x > 0, np.zeros(-(-n // width) * width - n, bool)])[k:k + width]
                        for k in range(0, n, width)]
            if got == sum(int(w[:32].sum()) for w in per_wave) and width == 64:
                hint = ("only lanes 0-31 of each 64-lane wavefront were counted: the ballot is 64 bits there; keep it in "
                        "an unsigned long long and count with __popcll")
            elif got == int(padded.sum()):
                hint = "lanes past the end (i >= n) voted too: vote i < n && x[i] > 0"
            elif got == int((x >= 0).sum()):
                hint = "zeros were counted: 0 (and -0) is not greater than zero"
            else:
                hint = (lanes_per_wave_hint(run, width, n, lab.THREADS)
                        or "one ballot per wavefront; lane 0 adds __popcll(votes)")
            check(f"count_positive on {what}, n = {n}", False, f"counted {got}, exact {exact}: {hint}")
        print(f"PASS: count_positive exact on {what}")


# --- 2.4: one side per wavefront -----------------------------------------------------------------------

CONVERGED_CASES = ((1000, 1), (1000, 2), (1000, 32), (777, 64), (256, 128), (1, 1))


def check_converged(converged_kernel: Callable[[], str]) -> None:
    """converged, the source `converged_kernel()` returns, must leave x exactly as the lab's divergent does, for
    every period and a ragged n, on 64 and 32 lanes, and no wavefront may process elements of both sides."""
    source, lab = kernel_source(converged_kernel, "converged"), solutions.load("02")
    for platform, width, what in (MACHINES[1], MACHINES[0]):   # no cross-lane operations: one machine per width
        for n, period in CONVERGED_CASES:
            x = np.random.default_rng(n + period).uniform(-1, 1, n).astype(np.float32)
            args = lambda: [("x", x.copy()), ("n", n), ("period", period), ("iters", 3)]
            want = run_on(lab, lab.DIVERGENT, "divergent", args(), n, platform, width, what).buffers["x"]
            run = run_on(lab, source, "converged", args(), n, platform, width, what, watch=True)
            got = run.buffers["x"]
            if np.array_equal(got, want):
                diverged = [p for p in run.problems if DIVERGES in p]
                if diverged:
                    check(f"converged on {what}, n = {n}, period = {period}", False, "the values are right, but "
                          + diverged[0])
                continue
            bad = np.flatnonzero(got != want)
            untouched = np.isin(bad, np.flatnonzero(got == x))
            hint = ("some elements were never processed: each element of the block goes to exactly one thread"
                    if untouched.all() else "an element got the other side's arithmetic, or another element's value")
            e = int(bad[0])
            check(f"converged on {what}, n = {n}, period = {period}", False,
                  f"{bad.size} of {n} elements differ from divergent, e.g. x[{e}] = {got[e]!r}, expected {want[e]!r}: {hint}")
    # one line, as the lab's stored output has it; the 32-lane run and the one-side rule passed too
    print(f"PASS: converged = divergent on {MACHINES[1][2]}, periods 1 to 128, ragged n")
