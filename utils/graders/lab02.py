"""Lab 02's graders (exercises 2.1-2.4): the SIMT model's passes, and the lab's kernels run by utils.simt on CUDA's and HIP's lane widths."""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from utils import grading_guard, simt, solutions
from utils.exercises import check

# Where the graders run a kernel: CUDA's API on a 32-lane warp, HIP's on a 64-lane (CDNA) and a 32-lane (RDNA) wavefront.
MACHINES = [("cuda", 32, "CUDA, 32-lane warps"), ("hip", 64, "HIP, 64-lane wavefronts (CDNA)"),
            ("hip", 32, "HIP, 32-lane wavefronts (RDNA)")]
BIG = " (values near +-2^24)"   # 2.2's case of large integers
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
RACE_HINT = ("Lanes or wavefronts that add into one address need atomicAdd, or must combine their values first (in "
             "registers with shuffles, or in __shared__ memory with a __syncthreads between the writes and the reads)")
ONE_OWNER_HINT = ("Two threads reached one element: each element of a block goes to exactly one thread of that block "
                  "(its index e in the block, from 0 to blockDim.x - 1)")
SKIPPED_BALLOT = ("so their votes are not in its result (and those lanes never get it). Every lane holding an element "
                  "must reach the ballot: put the condition in the vote, BALLOT(i < n && x[i] > 0.0f), not around it")
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
static auto activemask() -> decltype(::__activemask()) { auto r = ::__activemask(); released_with_me(); return r; }
template <class M> auto ballot_sync(M mask, int pred, const char* what = "__ballot_sync") -> decltype(::__ballot_sync(mask, pred)) {
    auto r = ::__ballot_sync(mask, pred); check_mask(what, (uint64_t)mask, released_with_me()); return r;
}
template <class M> int any_sync(M mask, int pred) { return ballot_sync(mask, pred, "__any_sync") != 0; }
template <class M> int all_sync(M mask, int pred) { auto b = ballot_sync(mask, pred, "__all_sync"); return b == (activemask() & mask); }
template <class M> void syncwarp(M mask) { ::__syncwarp(mask); check_mask("__syncwarp", (uint64_t)mask, released_with_me()); }
#if defined(__HIP_PLATFORM_AMD__)
template <class T> T shfl(T v, int src, int width = warpSize) { check_width("__shfl", width); T r = ::__shfl(v, src, width); released_with_me(); return r; }
template <class T> T shfl_up(T v, unsigned int d, int width = warpSize) { check_width("__shfl_up", width); T r = ::__shfl_up(v, d, width); released_with_me(); return r; }
template <class T> T shfl_down(T v, unsigned int d, int width = warpSize) { check_width("__shfl_down", width); T r = ::__shfl_down(v, d, width); released_with_me(); return r; }
template <class T> T shfl_xor(T v, int m, int width = warpSize) { check_width("__shfl_xor", width); T r = ::__shfl_xor(v, m, width); released_with_me(); return r; }
static unsigned long long ballot(int pred) { auto r = ::__ballot(pred); released_with_me(); return r; }
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

# 2.4 only: the learner's `converged` runs inside this wrapper (not instrumented itself), where the last lane of each
# block to finish asks utils.simt which thread last wrote each element, and reports a wavefront whose lanes wrote
# elements of both sides: its lanes took both sides of the branch.
DIVERGES = "processed A-elements and B-elements"
CONVERGED_RENAME = "#define converged lab02_learner_converged\n"
CONVERGED_WATCH = r"""
#undef converged
SIMT_QUIET void converged(float* x, int n, int period, int iters) {
    lab02_learner_converged(x, n, period, iters);
    int threads = blockDim.x, sides[32] = {0};
    for (int t = 0; t < threads; ++t)
        if (&simt::lanes[t] != simt::cur && simt::lanes[t].state != 2) return;   // not the block's last lane
    for (int e = 0; e < n && period >= 1; ++e) {
        long long who = simt::last_writer(&x[e]);
        if (who >= 0 && who / threads == (long long)blockIdx.x)
            sides[(who % threads) / warpSize] |= (((e % threads) / period) % 2 == 0) ? 1 : 2;
    }
    for (int wave = 0; wave < 32; ++wave) {
        if (sides[wave] != 3) continue;
        char text[320];
        snprintf(text, sizeof text, "wavefront %d of block %d (%d lanes) processed A-elements and B-elements at period %d: "
                 "its lanes take both sides of the branch, so it still diverges. The side must depend only on which half "
                 "of the block a thread is in", wave, (int)blockIdx.x, warpSize, period);
        simt::problem(text);
        return;
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
    if re.search(r"storage size of .* isn.t constant|variable[- ]length array", message):   # __shared__ x[warpSize]
        return CONSTANT_HINT
    return ""


def run_on(lab, source: str, name: str, args: list, n: int, platform: str, width: int, what: str, watch: bool = False,
           seed: int = 0, unchanged: tuple = (), race_hint: str = ""):
    """`name` from `source` (after the lab's SHUFFLE macros and the PROBE around every cross-lane call) over
    ceil(n / THREADS) blocks, its wavefronts interleaved in an order drawn from `seed`, or the check's failure: a
    problem the runtime saw (a race among them), or a change to one of the `unchanged` arguments. `lab` is the lab's
    exported module (`solutions.load("02")`: SHUFFLE, THREADS, DIVERGENT). `watch`: the kernel is 2.4's converged,
    run inside CONVERGED_WATCH. `race_hint`: what to do about a race (default RACE_HINT)."""
    full = (PROBE + '#line 1 "lab02_macros.h"\n' + lab.SHUFFLE + (CONVERGED_RENAME if watch else "")
            + '#line 1 "kernel.cu"\n' + source + '\n#line 1 "lab02_watch.h"\n' + (CONVERGED_WATCH if watch else ""))
    try:
        run = simt.run_kernel(full, name, args, grid=max(1, -(-n // lab.THREADS)), block=lab.THREADS,
                              width=width, platform=platform, seed=seed)
    except simt.KernelError as err:
        message = str(err).replace("lab02_learner_converged", "converged")
        message = re.sub(r"\blab02::(\w+)", r"__\1", message)
        hint = compile_hint(message, platform)
        check(f"{name} on {what}", False, message + (f". {hint}" if hint else ""))
    problems = [p for p in run.problems if not (watch and DIVERGES in p)]   # judged after the values: check_converged
    if problems:
        problem = problems[0]
        hint = SHIFT_HINT if "(mask 0x0)" in problem else (race_hint or RACE_HINT) if problem in run.races else ""
        check(f"{name} on {what}, n = {n}", False, problem + (f". {hint}" if hint else ""))
    for arg_name, value in args:
        if arg_name in unchanged:
            after = run.buffers[arg_name]
            changed = np.flatnonzero(value.view(f"u{value.itemsize}") != after.view(f"u{value.itemsize}"))
            if changed.size:
                k = int(changed[0])
                check(f"{name} on {what}, n = {n}", False, f"the kernel wrote into its input `{arg_name}` "
                      f"({changed.size} element{'s' if changed.size > 1 else ''}, e.g. {arg_name}[{k}] was "
                      f"{value[k].item()!r}, is {after[k].item()!r}): it may only read it")
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

def sum_inputs(seed: int) -> list[tuple[str, np.ndarray, int]]:
    """(what, x, schedule seed): small integers of both signs at ragged sizes, large ones whose sum is small (exact
    in int, not in float), then a size and values drawn from `seed` (a grade's fresh_seed), run in an order drawn
    from it too."""
    out = []
    for n in (1, 33, 1000):
        out.append(("", ((np.arange(n) * 7 + 3) % 11 - 4).astype(np.int32), 0))
    n = 4099
    big = np.where(np.arange(n) % 2 == 0, (1 << 24) + 1, -(1 << 24)).astype(np.int64) + (np.arange(n) % 5 - 2)
    out.append((BIG, big.astype(np.int32), 0))
    rng = np.random.default_rng(seed)
    out.append((" (drawn for this grade)", rng.integers(-1000, 1000, int(rng.integers(2, 3000)), dtype=np.int32), seed))
    return out


def check_portable_sum(sum_portable_kernel: Callable[[], str]) -> None:
    """sum_portable(x, out, n), the source `sum_portable_kernel()` returns, must give the exact integer sum on
    every machine in MACHINES, with one atomicAdd per wavefront."""
    source, lab = kernel_source(sum_portable_kernel, "sum_portable"), solutions.load("02")
    inputs = sum_inputs(grading_guard.fresh_seed())
    for platform, width, what in MACHINES:
        for label, x, seed in inputs:
            n = x.size
            run = run_on(lab, source, "sum_portable", [("x", x), ("out", np.zeros(1, np.int32)), ("n", n)], n,
                         platform, width, what, seed=seed, unchanged=("x",))
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
            if hint is None and label == BIG:
                hint = ("these values are large integers: the sum must stay exact, so keep v and the sum in int "
                        "(a float rounds integers beyond 2^24)")
            check(f"sum_portable on {what}, n = {n}{label}", False, f"sum {got}, exact {exact}: "
                  + (hint or "check the guard i < n (lanes past the end add 0) and the loop"))
        print(f"PASS: sum_portable exact on {what}")


# --- 2.3: counting with a ballot -----------------------------------------------------------------------

def count_inputs(seed: int) -> list[tuple[np.ndarray, int]]:
    """(x, schedule seed): normal values with zeros and negative zeros (neither is positive) at ragged sizes, and a
    run of positives; the last at a size, and with values, drawn from `seed` (a grade's fresh_seed), run in an order
    drawn from it too."""
    out = []
    cases = [(n, n, 0) for n in (1, 33, 1000, 4099)]                     # n, values seed, schedule seed
    cases.append((int(np.random.default_rng(seed).integers(2, 3000)), seed, seed))
    for n, values, schedule in cases:
        x = np.random.default_rng(values).standard_normal(n).astype(np.float32)
        x[::7] = 0.0
        x[3::13] = -0.0
        x[n // 2:n // 2 + 130] = np.abs(x[n // 2:n // 2 + 130]) + 1.0   # whole wavefronts voting yes
        out.append((x, schedule))
    return out


def skipped_ballot_hint(run, width: int, n: int, threads: int) -> str | None:
    """A hint if a kernel that takes ballots ran one without lanes of its wavefront that hold an element (i < n):
    they went around it (a branch, or a return before it). utils.simt records the lanes of each cross-lane op."""
    if not any(op == "ballot" for ops in run.cross_lane for op, _ in ops):
        return None
    for start, ops in zip(wave_starts(run, width, threads), run.cross_lane):
        holders = (1 << max(0, min(width, n - start))) - 1
        ballots = [mask for op, mask in ops if op == "ballot"]
        for mask in ballots or [0]:
            left_out = [lane for lane in range(width) if (holders & ~mask) >> lane & 1]
            if left_out:
                shown = (", ".join(map(str, left_out)) if len(left_out) <= 4 else
                         f"{left_out[0]}, {left_out[1]}, ..., {left_out[-1]} ({len(left_out)} lanes)")
                return (f"lanes {shown} of the {width}-lane wavefront holding elements {start} to "
                        f"{min(start + width, n) - 1} hold elements but took no part in {'its' if ballots else 'a'} "
                        f"ballot: they went around it (a branch some lanes skip, or a return before it), "
                        + SKIPPED_BALLOT)
    return None


def check_count_positive(count_positive_kernel: Callable[[], str]) -> None:
    """count_positive(x, count, n), the source `count_positive_kernel()` returns, must count exactly on every
    machine in MACHINES, with one atomicAdd per wavefront."""
    source, lab = kernel_source(count_positive_kernel, "count_positive"), solutions.load("02")
    inputs = count_inputs(grading_guard.fresh_seed())
    for platform, width, what in MACHINES:
        for x, seed in inputs:
            n = x.size
            run = run_on(lab, source, "count_positive", [("x", x), ("count", np.zeros(1, np.int32)), ("n", n)],
                         n, platform, width, what, seed=seed, unchanged=("x",))
            skipped = skipped_ballot_hint(run, width, n, lab.THREADS)
            if skipped:
                check(f"count_positive on {what}, n = {n}", False, skipped)
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

# n, period, iters
CONVERGED_CASES = ((1000, 1, 3), (1000, 2, 3), (1000, 32, 3), (777, 64, 3), (256, 128, 3), (1, 1, 3))


def check_converged(converged_kernel: Callable[[], str]) -> None:
    """converged, the source `converged_kernel()` returns, must leave x exactly as the lab's divergent does, for
    every period and a ragged n, on 64 and 32 lanes, and no wavefront may process elements of both sides."""
    source, lab = kernel_source(converged_kernel, "converged"), solutions.load("02")
    seed = grading_guard.fresh_seed()
    rng = np.random.default_rng(seed)
    cases = [(n, period, iters, n + period, 0) for n, period, iters in CONVERGED_CASES]   # ..., values seed, schedule
    cases.append((int(rng.integers(1, 2000)), 2 ** int(rng.integers(0, 8)), int(rng.integers(0, 6)), seed, seed))
    for platform, width, what in (MACHINES[1], MACHINES[0]):   # no cross-lane operations: one machine per width
        for n, period, iters, values, schedule in cases:
            x = np.random.default_rng(values).uniform(-1, 1, n).astype(np.float32)
            args = lambda: [("x", x.copy()), ("n", n), ("period", period), ("iters", iters)]
            want = run_on(lab, lab.DIVERGENT, "divergent", args(), n, platform, width, what).buffers["x"]
            run = run_on(lab, source, "converged", args(), n, platform, width, what, watch=True, seed=schedule,
                         race_hint=ONE_OWNER_HINT)
            got = run.buffers["x"]
            if np.array_equal(got, want):
                diverged = [p for p in run.problems if DIVERGES in p]
                if diverged:
                    check(f"converged on {what}, n = {n}, period = {period}, iters = {iters}", False,
                          "the values are right, but " + diverged[0])
                continue
            bad = np.flatnonzero(got != want)
            untouched = np.isin(bad, np.flatnonzero(got == x))
            hint = ("some elements were never processed: each element of the block goes to exactly one thread"
                    if untouched.all() else "an element got the other side's arithmetic, or another element's value")
            e = int(bad[0])
            check(f"converged on {what}, n = {n}, period = {period}, iters = {iters}", False,
                  f"{bad.size} of {n} elements differ from divergent, e.g. x[{e}] = {got[e]!r}, expected {want[e]!r}: {hint}")
    # one line, as the lab's stored output has it; the 32-lane run and the one-side rule passed too
    print(f"PASS: converged = divergent on {MACHINES[1][2]}, periods 1 to 128, ragged n")
