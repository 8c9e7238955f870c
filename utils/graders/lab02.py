"""Lab 02's graders (exercises 2.1-2.4): the SIMT model's passes, and the lab's kernels run by utils.simt on CUDA's and HIP's lane widths."""
from __future__ import annotations

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


# --- 2.1: predict what a branch costs -----------------------------------------------------------------

def check_passes(predicted_passes: Callable[[], dict]) -> None:
    """The prediction against the SIMT model (which the lab's GPU measurement confirms)."""
    predicted = predicted_passes()
    wanted = {(w, p): simt.branch(w, p).passes_per_wave for w in (32, 64) for p in (16, 32, 64)}
    if not isinstance(predicted, dict) or set(predicted) != set(wanted):
        check("a dict for each (lanes, period)", False, f"return a dict with the keys {sorted(wanted)}")
    for (w, p), want in sorted(wanted.items()):
        got = predicted[w, p]
        if got == want:
            continue
        if want == 2:
            hint = (f"with period {p} the side changes every {p} lanes, so a {w}-lane wavefront holds lanes of both "
                    "sides: both run, one after the other")
        else:
            hint = f"with period {p} all {w} lanes of a wavefront take the same side: one pass"
        check(f"{w} lanes, period {p}", False, f"you said {got!r}: {hint}")


# --- running a kernel on the SIMT machine --------------------------------------------------------------

def run_on(lab, source: str, name: str, args: list, n: int, platform: str, width: int, what: str):
    """`name` from `source` (after the lab's SHUFFLE macros) over ceil(n / THREADS) blocks, or the check's failure.
    `lab` is the lab's exported module (`solutions.load("02")`: SHUFFLE, THREADS, DIVERGENT)."""
    try:
        run = simt.run_kernel(lab.SHUFFLE + source, name, args, grid=max(1, -(-n // lab.THREADS)), block=lab.THREADS,
                              width=width, platform=platform)
    except simt.KernelError as err:
        check(f"{name} on {what}", False, str(err) + (f". {MASK_HINT}" if "64-bit integer" in str(err) else ""))
    if run.problems:
        check(f"{name} on {what}, n = {n}", False, run.problems[0])
    return run


def lanes_per_wave_hint(run, width: int) -> str | None:
    """A hint if some wavefront had more than one lane (or none) add to the total."""
    many = next((lanes for lanes in run.atomic_lanes if len(lanes) > 1), None)
    if many:
        return (f"lanes {many} of one {width}-lane wavefront each added to the total: one lane per wavefront must add "
                "(threadIdx.x % warpSize == 0), not every 32nd (& 31, % 32)")
    if all(not lanes for lanes in run.atomic_lanes):
        return "no lane added anything to the total: lane 0 of each wavefront adds its sum with atomicAdd"
    return None


# --- 2.2: a reduction for any lane width ---------------------------------------------------------------

def check_portable_sum(sum_portable_kernel: Callable[[], str]) -> None:
    """sum_portable(x, out, n), the source `sum_portable_kernel()` returns, must give the exact integer sum on
    every machine in MACHINES."""
    source, lab = sum_portable_kernel(), solutions.load("02")
    for platform, width, what in MACHINES:
        for n in (1, 1000, 4099):
            x = ((np.arange(n) * 7 + 3) % 11 - 4).astype(np.int32)      # small integers, both signs: sums are exact
            run = run_on(lab, source, "sum_portable", [("x", x), ("out", np.zeros(1, np.int32)), ("n", n)], n,
                         platform, width, what)
            got, exact = int(run.buffers["out"][0]), int(x.sum())
            if got == exact:
                continue
            hint = lanes_per_wave_hint(run, width)
            if hint is None and run.max_shuffle_delta < width // 2:
                hint = (f"the largest shuffle offset was {run.max_shuffle_delta}: a {width}-lane wavefront needs "
                        f"{width // 2} first (offsets warpSize / 2, ..., 1)")
            check(f"sum_portable on {what}, n = {n}", False, f"sum {got}, exact {exact}: "
                  + (hint or "check the guard i < n (lanes past the end add 0) and the loop"))
        print(f"PASS: sum_portable exact on {what}")


# --- 2.3: counting with a ballot -----------------------------------------------------------------------

def check_count_positive(count_positive_kernel: Callable[[], str]) -> None:
    """count_positive(x, count, n), the source `count_positive_kernel()` returns, must count exactly on every
    machine in MACHINES."""
    source, lab = count_positive_kernel(), solutions.load("02")
    for platform, width, what in MACHINES:
        for n in (1, 1000, 4099):
            gen = np.random.default_rng(n)
            x = gen.standard_normal(n).astype(np.float32)
            x[::7] = 0.0                                                        # zero is not positive
            run = run_on(lab, source, "count_positive", [("x", x), ("count", np.zeros(1, np.int32)), ("n", n)],
                         n, platform, width, what)
            got, exact = int(run.buffers["count"][0]), int((x > 0).sum())
            if got == exact:
                continue
            padded = np.concatenate([x > 0, np.ones(-(-n // lab.THREADS) * lab.THREADS - n, bool)])  # lanes past n say yes
            per_wave = [np.concatenate([x > 0, np.zeros(-(-n // width) * width - n, bool)])[k:k + width]
                        for k in range(0, n, width)]
            if got == sum(int(w[:32].sum()) for w in per_wave) and width == 64:
                hint = ("only lanes 0-31 of each 64-lane wavefront were counted: the ballot is 64 bits there; keep it in "
                        "an unsigned long long and count with __popcll")
            elif got == int(padded.sum()):
                hint = "lanes past the end (i >= n) voted too: vote i < n && x[i] > 0"
            else:
                hint = lanes_per_wave_hint(run, width) or "one ballot per wavefront; lane 0 adds __popcll(votes)"
            check(f"count_positive on {what}, n = {n}", False, f"counted {got}, exact {exact}: {hint}")
        print(f"PASS: count_positive exact on {what}")


# --- 2.4: one side per wavefront -----------------------------------------------------------------------

def check_converged(converged_kernel: Callable[[], str]) -> None:
    """converged, the source `converged_kernel()` returns, must leave x exactly as the lab's divergent does, for
    every period and a ragged n."""
    source, lab = converged_kernel(), solutions.load("02")
    for platform, width, what in MACHINES[1:2]:   # no cross-lane operations: one machine is enough
        for n, period in ((1000, 1), (1000, 2), (1000, 32), (777, 64), (256, 128), (1, 1)):
            x = np.random.default_rng(n + period).uniform(-1, 1, n).astype(np.float32)
            args = lambda: [("x", x.copy()), ("n", n), ("period", period), ("iters", 3)]
            want = run_on(lab, lab.DIVERGENT, "divergent", args(), n, platform, width, what).buffers["x"]
            got = run_on(lab, source, "converged", args(), n, platform, width, what).buffers["x"]
            if np.array_equal(got, want):
                continue
            bad = np.flatnonzero(got != want)
            untouched = np.isin(bad, np.flatnonzero(got == x))
            hint = ("some elements were never processed: each element of the block goes to exactly one thread"
                    if untouched.all() else "an element got the other side's arithmetic, or another element's value")
            e = int(bad[0])
            check(f"converged on {what}, n = {n}, period = {period}", False,
                  f"{bad.size} of {n} elements differ from divergent, e.g. x[{e}] = {got[e]!r}, expected {want[e]!r}: {hint}")
        print(f"PASS: converged = divergent on {what}, periods 1 to 128, ragged n")
