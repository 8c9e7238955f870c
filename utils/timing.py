"""Timing for every lab: device events on a GPU, `perf_counter` on the CPU.

`benchmark(fn)` runs `fn` `warmup` times, then `reps` times, each timed on its own, and returns
median, min, IQR and all samples. On a GPU each rep is bracketed by torch's CUDA/HIP events (the
same mechanism as `triton.testing.do_bench`); with `flush_l2=True` a large buffer is overwritten
before each rep so that data left in the cache by the previous rep does not flatter the result.

Warm up long enough. A GPU changes its clock under load (a boost clock at first, lower once it reaches its
power limit): `warmup_ms` keeps calling `fn` until that much time has passed, so the figures are the sustained
ones, not a burst. Each Timing keeps the machine's state before and after its repetitions (`utils.machine`), so
a recorder can tell a steady measurement from one the clock or other programs moved (lab 00, section 10).
"""
from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from utils import backend, machine

# Bytes overwritten before each rep to flush caches: larger than an H100's 50 MB L2 and an
# MI300X's 256 MB Infinity Cache (PyTorch reports only the 4 MB L2 there, so it is not derived).
GPU_FLUSH_BYTES = 512 * 2**20
CPU_FLUSH_BYTES = 64 * 2**20


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9


def tflops(flops: float, seconds: float) -> float:
    """Throughput in TFLOP/s (10^12 floating-point operations per second)."""
    return flops / seconds / 1e12


@dataclass(frozen=True)
class Timing:
    samples_ms: tuple[float, ...]
    clock: str  # "device events" or "perf_counter"
    # the machine before the warm-up and after the timed repetitions (utils.machine.snapshot): {"before", "after"}
    window: dict | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def iqr_ms(self) -> float:
        if len(self.samples_ms) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q3 - q1

    @property
    def spread(self) -> float:
        """The interquartile range over the median: 0.05 means the middle half of the samples lie within 5%."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else float("inf")

    @property
    def median_s(self) -> float:
        return self.median_ms / 1e3

    def gbps(self, nbytes: float) -> float:
        return gbps(nbytes, self.median_s)

    def tflops(self, flops: float) -> float:
        return tflops(flops, self.median_s)

    def __str__(self) -> str:
        return (f"median {self.median_ms:.4g} ms, min {self.min_ms:.4g} ms, IQR {self.iqr_ms:.3g} ms "
                f"over {len(self.samples_ms)} reps ({self.clock})")


@contextlib.contextmanager
def one_cpu_thread(device):
    """On a CPU, PyTorch's own work on one thread while the block runs (restored after). Above its grain size
    (32,768 elements, `at::internal::GRAIN_SIZE`) an element-wise op splits across intra-op threads, and on a busy
    2-core machine the second thread waits for a core: lab 01's sweep fell towards zero at 65,536 elements there,
    where one thread gave steady figures. On a GPU nothing changes."""
    import torch

    if _platform(device).is_gpu:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _platform(device) -> backend.Backend:
    """The backend that times `device` (a DeviceInfo, a torch device or its string); by default the GPU
    PyTorch sees, else the CPU."""
    if device is not None:
        return backend.of(device)
    plat = backend.this_torch_build()
    return plat if plat.available() else backend.CPU


def benchmark(fn: Callable[[], object], *, warmup: int = 5, reps: int = 50,
              flush_l2: bool = True, warmup_ms: float = 0.0, batch: int = 1, graph: bool = False,
              device=None) -> Timing:
    """Time `fn()`: at least `warmup` untimed calls lasting at least `warmup_ms`, then `reps` timed
    calls. `device` is a `DeviceInfo` or a torch device string; by default a GPU is used when PyTorch
    sees one. Returns a `Timing` (median, min, IQR, samples in milliseconds per call of `fn`).

    For kernels of a few microseconds, launch overhead hides the kernel: `batch=K` times K calls per
    repetition, and with `graph=True` (GPU only) those K calls are captured once in a CUDA/HIP graph
    and each repetition replays it, which leaves almost no gap between the kernels."""
    if warmup < 0 or reps < 1 or batch < 1:
        raise ValueError(f"benchmark needs warmup >= 0, reps >= 1 and batch >= 1, "
                         f"got warmup={warmup}, reps={reps}, batch={batch}")
    import torch

    plat = _platform(device)
    gpu = plat.is_gpu
    single = fn
    if gpu and graph:
        fn = _capture_graph(single, batch, plat)
    elif batch > 1:
        def fn():
            for _ in range(batch):
                single()
    flush = None
    if flush_l2:
        flush = torch.empty(GPU_FLUSH_BYTES if gpu else CPU_FLUSH_BYTES, dtype=torch.int8,
                            device=plat.torch_device)
    # the window the machine is judged over starts before the warm-up: it runs the same work under the same
    # conditions, and a window of a few milliseconds is too short to count other programs' CPU time
    before = machine.snapshot(plat)
    _warm_up(fn, warmup, warmup_ms, plat)
    samples: list[float] = []
    if gpu:
        starts = [plat.event() for _ in range(reps)]
        ends = [plat.event() for _ in range(reps)]
        plat.synchronize()
        for start, end in zip(starts, ends):
            if flush is not None:
                flush.zero_()
            start.record()
            fn()
            end.record()
        plat.synchronize()
        samples = [s.elapsed_time(e) / batch for s, e in zip(starts, ends)]
        return Timing(tuple(samples), "device events" + (f", graph of {batch} calls" if graph else ""),
                      {"before": before, "after": machine.snapshot(plat)})
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3 / batch)
    return Timing(tuple(samples), "perf_counter", {"before": before, "after": machine.snapshot(plat)})


def _capture_graph(fn, calls: int, plat: backend.Backend):
    """A CUDA/HIP graph of `calls` calls of `fn`; returns its replay function."""
    mod = plat.module()
    side = mod.Stream()
    side.wait_stream(mod.current_stream())
    with mod.stream(side):      # warm-up off the default stream, as graph capture requires
        for _ in range(3):
            fn()
    mod.current_stream().wait_stream(side)
    g = mod.CUDAGraph()
    with mod.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def _warm_up(fn, calls: int, min_ms: float, plat: backend.Backend) -> None:
    t0 = time.perf_counter()
    done = 0
    while done < calls or (time.perf_counter() - t0) * 1e3 < min_ms:
        fn()
        done += 1
        if done % 8 == 0:
            plat.synchronize()   # wall time must track device time, not the launch queue
    plat.synchronize()


class Rounds(dict):
    """`interleaved`'s result: {name: median ms} like a dict, and per name every round's Timing
    (`.timing(name)`: all their samples and the window of the whole run; `.ratio(a, b)`: per-round ratios)."""

    def __init__(self, medians: dict[str, float], rounds: dict[str, list[Timing]], window: dict):
        super().__init__(medians)
        self.rounds = rounds
        self.window = window

    def timing(self, name: str) -> Timing:
        """Every sample of `name` over all rounds, as one Timing (its spread includes drift between rounds)."""
        parts = self.rounds[name]
        return Timing(tuple(s for t in parts for s in t.samples_ms), parts[0].clock + f", {len(parts)} rounds",
                      self.window)

    def ratio(self, a: str, b: str) -> tuple[float, float, int]:
        """(median of the per-round ratios a/b of median times, their IQR over that median, rounds)."""
        ratios = [ta.median_ms / tb.median_ms for ta, tb in zip(self.rounds[a], self.rounds[b])]
        t = Timing(tuple(ratios), "ratio")
        return t.median_ms, t.spread, len(ratios)


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 3, rep_ms: float = 200.0,
                warmup_ms: float = 500.0, flush_l2: bool = True, block_warmup_ms: float = 100.0,
                shuffle: bool = True) -> Rounds:
    """Median time in ms of each function in `fns`, measured in alternating rounds after a common
    warm-up, so that clock changes under load (a GPU slows down as it heats) hit all of them alike.
    On a GPU each block first runs its own function for `block_warmup_ms` and the order changes every round
    (`shuffle`, seeded): a power-hungry kernel (cuDNN's attention at the power cap) lowers the clock for the one after
    it, and without this a kernel that always follows a cool one is measured at a burst clock it cannot hold (13 %
    above its sustained figure on an H100, 2026-11-28).
    A value may also be the string "do_bench:" + key, which times `fns[key]` with Triton's do_bench.
    The result is a dict of medians that also keeps every round (`Rounds`)."""
    plat = _platform(None)
    first = next(f for f in fns.values() if callable(f))
    before = machine.snapshot(plat)
    _warm_up(first, 1, warmup_ms, plat)
    reps = {}
    for name, fn in fns.items():
        if callable(fn):
            estimate = benchmark(fn, warmup=1, reps=3, flush_l2=flush_l2).median_ms
            reps[name] = max(5, int(rep_ms / max(estimate, 1e-3)))
    samples: dict[str, list[Timing]] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    block_ms = block_warmup_ms if plat.is_gpu else 0.0
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)        # no function always pays (or profits) for the one before it
        for name in order:
            fn = fns[name]
            if callable(fn):
                samples[name].append(benchmark(fn, warmup=1, warmup_ms=block_ms, reps=reps[name], flush_l2=flush_l2))
            else:
                from triton.testing import do_bench   # optional: Triton's own timer, only when asked for

                ms = do_bench(fns[fn.removeprefix("do_bench:")], warmup=25, rep=rep_ms, return_mode="median")
                samples[name].append(Timing((ms,), "triton do_bench"))
    window = {"before": before, "after": machine.snapshot(plat)}
    return Rounds({name: statistics.median(t.median_ms for t in values) for name, values in samples.items()},
                  samples, window)


def compare_with_do_bench(fn: Callable[[], object], *, rounds: int = 3, rep_ms: float = 200.0,
                          warmup_ms: float = 500.0) -> tuple[float, float]:
    """Median time of `fn` in ms by `benchmark` and by `triton.testing.do_bench`, in alternating
    rounds (see `interleaved`). Returns (ours_ms, do_bench_ms). Needs a GPU and Triton."""
    times = interleaved({"ours": fn, "do_bench": "do_bench:ours"}, rounds=rounds, rep_ms=rep_ms, warmup_ms=warmup_ms)
    return times["ours"], times["do_bench"]


def relative_difference(a: float, b: float) -> float:
    """|a - b| / b: how far a measurement `a` is from a reference `b`."""
    return abs(a - b) / b
