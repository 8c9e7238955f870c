"""Why does SDPA's cuDNN backend read ~13 % faster in bench/lab04_attention.py than in lab 04? One run, three methods.

    PYTHONPATH=$PWD python3 bench/lab04_cudnn_check.py       # about 2-3 minutes on an H100/H200

At the headline shape (bf16, B=4 H=32 N=4096 D=128), causal and not, in this order:
1. independent: SDPA CUDNN and SDPA FLASH, each with and without an L2 flush (512 MiB zeroed before each timed call),
   in a new shuffled order each round; every block starts with 100 ms of its own calls (so it is measured in its own
   steady state, not in the one the previous kernel left), then ~150 ms of calls timed one by one with CUDA events.
2. lab: lab 04's own code path (solutions/04_flash_attention.ipynb, the TMA cell): utils.timing.interleaved over
   {portable, TMA, triton_attention, SDPA CUDNN}, rounds=5, rep_ms=200, warmup_ms=300, flush_l2=False; plus the
   cuDNN figure the way utils/reference/h100.json implies it (a kernel's TFLOP/s over its median per-round ratio).
3. bench: bench/lab04_attention.py's own `measure` (imported, not copied) over its headline candidate list in its
   order (portable tiles, hopper tiles, triton_attention, SDPA FLASH / EFFICIENT / CUDNN, flash-attn-4 if present).
An NVML thread samples the SM clock, power and temperature every 10 ms; each sample is credited to the kernel the
GPU is running then (the one last called: every timer here synchronizes before the next kernel's first call).
Prints TFLOP/s (median), spread (IQR / median of the samples), the per-round range, and the SM clock / power
during each kernel's blocks, and the GPU state before and after each method. No CUDA: prints SKIP and exits 0.
"""
from __future__ import annotations

import importlib.util
import os
import random
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START = time.time()
SHAPE = (4, 32, 4096, 128)
BUDGET_S = float(os.environ.get("CHECK_BUDGET_S", "200"))   # the bench method shrinks its candidate list past this


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def flops(b, h, n, d, causal) -> float:
    return 4 * b * h * n * n * d / (2 if causal else 1)


# ---------------------------------------------------------------- NVML: snapshots and a sampler
class Nvml:
    def __init__(self):
        self.h = None
        self.samples: list[tuple[float, str | None, int, float, int]] = []   # (time, current kernel, MHz, W, C)
        self.current: str | None = None
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            index = 0
            visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            if visible and visible[0].strip().isdigit():
                index = int(visible[0])
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as err:  # no pynvml, no driver access
            self.error = f"{type(err).__name__}: {err}"

    def read(self) -> dict:
        if self.h is None:
            return {"nvml": self.error}
        nv, h = self.nv, self.h
        reasons_of = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        bits = reasons_of(h)
        names = {0x1: "idle", 0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
                 0x80: "power brake"}
        return {"sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "max_sm_mhz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
                "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                "power_w": round(nv.nvmlDeviceGetPowerUsage(h) / 1e3),
                "limit_w": round(nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3),
                "reasons": [name for bit, name in names.items() if bits & bit]}

    def state(self) -> str:
        r = self.read()
        if "nvml" in r:
            return f"(no NVML: {r['nvml']})"
        return (f"SM {r['sm_mhz']}/{r['max_sm_mhz']} MHz, {r['temp_c']} C, {r['power_w']}/{r['limit_w']} W"
                + (f", {'+'.join(r['reasons'])}" if r["reasons"] else ""))

    def _loop(self):
        nv, h = self.nv, self.h
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), self.current, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                                     nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            except Exception:
                pass
            time.sleep(0.01)

    def start(self):
        if self.h is not None:
            threading.Thread(target=self._loop, daemon=True).start()

    def stop(self):
        self._stop.set()

    def during(self, tag: str) -> str:
        """Median SM clock / power / temperature over the samples credited to `tag`."""
        rows = [s for s in self.samples if s[1] == tag]
        if not rows:
            return "clock n/a"
        med = lambda i: statistics.median(r[i] for r in rows)
        lo = min(r[2] for r in rows)
        return f"SM {med(2):.0f} MHz (min {lo}), {med(3):.0f} W, {med(4):.0f} C over {len(rows)} samples"


NV: Nvml | None = None


def tagged(tag: str, fn):
    """fn, marking `tag` as what the GPU runs from this call on (for the NVML sampler)."""
    def run(*args, **kwargs):
        NV.current = tag
        return fn(*args, **kwargs)
    return run


def spread(samples) -> float:
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


RESULTS: dict[tuple[str, bool], dict[str, str]] = {}   # (method, causal) -> {kernel: line}


def note(method: str, causal: bool, kernel: str, line: str) -> None:
    RESULTS.setdefault((method, causal), {})[kernel] = line
    log(f"{method:<12} causal={causal!s:<5} {kernel:<22} {line}")


# ---------------------------------------------------------------- 1. the independent measurement
def independent(torch, F, SDPBackend, sdpa_kernel, causal: bool, rounds: int = 6) -> None:
    b, h, n, d = SHAPE
    work = flops(b, h, n, d, causal)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    flush_buf = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")

    def call(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    cands = {}
    for label, backend in (("CUDNN", SDPBackend.CUDNN_ATTENTION), ("FLASH", SDPBackend.FLASH_ATTENTION)):
        for flush in (True, False):
            cands[f"{label} {'flush' if flush else 'no-flush'}"] = (call(backend), flush)

    def block(tag, fn, flush, reps, warm_ms):
        NV.current = tag
        t0, i = time.perf_counter(), 0
        while (time.perf_counter() - t0) * 1e3 < warm_ms:     # this kernel's own steady state first
            if flush:
                flush_buf.zero_()
            fn()
            i += 1
            if i % 4 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in events:
            if flush:
                flush_buf.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    for fn, _ in cands.values():       # cuDNN builds its graph on the first call
        fn()
    torch.cuda.synchronize()
    est = {}
    for name, (fn, flush) in cands.items():
        est[name] = statistics.median(block("idle", fn, flush, 5, 0))
    NV.current = "warm-up"
    first_fn = cands["CUDNN no-flush"][0]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        first_fn()
        torch.cuda.synchronize()
    reps = {name: max(10, int(150 / est[name])) for name in cands}
    per_round = {name: [] for name in cands}
    allsamples = {name: [] for name in cands}
    order, rng = list(cands), random.Random(7 + causal)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn, flush = cands[name]
            ms = block(f"indep {causal} {name}", fn, flush, reps[name], warm_ms=100)
            per_round[name].append(statistics.median(ms))
            allsamples[name].extend(ms)
    NV.current = None
    for name in cands:
        med = statistics.median(allsamples[name])
        tf = work / (med / 1e3) / 1e12
        lo, hi = (work / (max(per_round[name]) / 1e3) / 1e12, work / (min(per_round[name]) / 1e3) / 1e12)
        note("independent", causal, name,
             f"{tf:6.1f} TFLOP/s, spread {spread(allsamples[name]):.3f}, rounds {lo:.0f}-{hi:.0f}, "
             f"{len(allsamples[name])} samples; {NV.during(f'indep {causal} {name}')}")


# ---------------------------------------------------------------- capture utils.timing.interleaved's Rounds
CAPTURED = []


def capture_interleaved(timing):
    original = timing.interleaved

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        CAPTURED.append(out)
        return out
    timing.interleaved = wrapper
    return original


def report_rounds(method, causal, rounds_obj, work, tags: dict[str, str]):
    for name, ms in rounds_obj.items():
        t = rounds_obj.timing(name)
        per = [work / (x.median_ms / 1e3) / 1e12 for x in rounds_obj.rounds[name]]
        note(method, causal, name,
             f"{work / (ms / 1e3) / 1e12:6.1f} TFLOP/s, spread {t.spread:.3f}, rounds {min(per):.0f}-{max(per):.0f}, "
             f"{len(t.samples_ms)} samples; {NV.during(tags.get(name, name))}")


# ---------------------------------------------------------------- 2. lab 04's path
def lab_method(torch, F, SDPBackend, sdpa_kernel, lab, timing, causal: bool) -> None:
    b, h, n, d = SHAPE       # lab 04's BATCH, HEADS, HEADLINE on a GPU
    work = flops(b, h, n, d, causal)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def sdpa_cudnn(q, k, v, causal):          # the lab's sdpa_cudnn, verbatim
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    t = lambda name: f"lab {causal} {name}"
    both = {"portable": tagged(t("portable"), lambda: lab.portable_attention(q, k, v, causal)),
            "TMA": tagged(t("TMA"), lambda: lab.hopper_attention(q, k, v, causal)),
            "triton_attention": tagged(t("triton_attention"), lambda: lab.triton_attention(q, k, v, causal))}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        both["SDPA CUDNN"] = tagged(t("SDPA CUDNN"), lambda: sdpa_cudnn(q, k, v, causal))
    ms = timing.interleaved(both, rounds=5, rep_ms=200, warmup_ms=300, flush_l2=False)
    NV.current = None
    report_rounds("lab", causal, ms, work, {name: t(name) for name in both})
    tf = {name: work / (x / 1e3) / 1e12 for name, x in ms.items()}
    for name in ("TMA", "triton_attention"):     # how utils/reference/h100.json implies cuDNN's figure
        ratio, sp, _ = ms.ratio("SDPA CUDNN", name)
        note("lab", causal, f"cuDNN implied via {name}", f"{tf[name] / ratio:6.1f} TFLOP/s ({name} {tf[name]:.1f} / "
             f"ratio {ratio:.3f}, spread {sp:.3f})")


# ---------------------------------------------------------------- 3. bench/lab04_attention.py's path
def bench_method(bench, lab, causal: bool, full: bool, fa4) -> None:
    b, h, n, d = SHAPE
    work = flops(b, h, n, d, causal)
    tiles_p = bench.PORTABLE_TILES if full else bench.PORTABLE_TILES[:1]
    tiles_h = bench.HOPPER_TILES if full else bench.HOPPER_TILES[:1]
    raw = {}                 # bench.main's headline candidates, in its order (lines 161-173)
    for tiles in tiles_p:
        raw[f"portable {bench.tiles_name(tiles, lab.attention_configs(d, 'cuda')[0])}"] = \
            (lambda q, k, v, c, t=tiles: lab.portable_attention(q, k, v, c, config=t))
    if lab.why_not_hopper(*(bench.torch.empty(1, 1, 16, 128, device="cuda", dtype=bench.torch.bfloat16),) * 3) is None:
        for tiles in tiles_h:
            raw[f"hopper {bench.tiles_name(tiles, lab.hopper_configs(d, causal)[0])}"] = \
                (lambda q, k, v, c, t=tiles: lab.hopper_attention(q, k, v, c, config=t))
    raw["triton_attention"] = lab.triton_attention
    for backend in (bench.SDPBackend.FLASH_ATTENTION, bench.SDPBackend.EFFICIENT_ATTENTION,
                    bench.SDPBackend.CUDNN_ATTENTION):
        raw[f"SDPA {backend.name}"] = bench.sdpa(backend)
    if fa4:
        raw["flash-attn-4"] = fa4
    cands = {name: tagged(f"bench {causal} {name}", fn) for name, fn in raw.items()}
    before = len(CAPTURED)
    result = bench.measure(cands, b, h, n, d, causal)      # the bench's own timing function
    NV.current = None
    for name, why in result["failed"].items():
        note("bench", causal, name, f"failed: {why}")
    if len(CAPTURED) > before:
        report_rounds("bench", causal, CAPTURED[-1], work, {name: f"bench {causal} {name}" for name in cands})
    else:
        for name, tf in result["tflops"].items():
            note("bench", causal, name, f"{tf:6.1f} TFLOP/s")
    order = list(result["tflops"])
    i = order.index("SDPA CUDNN_ATTENTION") if "SDPA CUDNN_ATTENTION" in order else -1
    if i > 0:
        note("bench", causal, "(order)", f"SDPA CUDNN_ATTENTION runs after {order[i - 1]!r}, "
             f"{len(order)} candidates a round, full list: {full}")


def main() -> int:
    global NV
    try:
        import torch
    except ImportError:
        print("SKIP: bench/lab04_cudnn_check.py needs PyTorch with a CUDA GPU (torch is not installed)")
        return 0
    if not torch.cuda.is_available() or torch.version.cuda is None:
        print("SKIP: bench/lab04_cudnn_check.py needs a CUDA GPU (SDPA's cuDNN backend); none here")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    NV = Nvml()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version()}; GPU now: {NV.state()}")
    NV.start()

    # 1. independent
    for causal in (False, True):
        log(f"independent, causal={causal}: before {NV.state()}")
        independent(torch, F, SDPBackend, sdpa_kernel, causal)
        log(f"independent, causal={causal}: after  {NV.state()}")

    # 2. the lab's helper, imported the way lab 04 does (from utils import timing), the kernels from its exported cells
    from utils import timing
    capture_interleaved(timing)
    spec = importlib.util.spec_from_file_location("lab04_attention_bench", ROOT / "bench" / "lab04_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lab = bench.load_lab()        # utils.solutions.load("04"): the notebook's exported cells
    for causal in (False, True):
        log(f"lab method, causal={causal} (compiling the lab's kernels): before {NV.state()}")
        lab_method(torch, F, SDPBackend, sdpa_kernel, lab, timing, causal)
        log(f"lab method, causal={causal}: after  {NV.state()}")

    # 3. the bench's measure()
    fa4, why = bench.flash_attn_4()
    log("flash-attn-4: " + ("imported" if fa4 else f"not available ({why})"))
    for causal in (False, True):
        full = time.time() - START < BUDGET_S * (0.5 if not causal else 0.62)
        log(f"bench method, causal={causal}, full candidate list: {full}: before {NV.state()}")
        bench_method(bench, lab, causal, full, fa4 if full else None)
        log(f"bench method, causal={causal}: after  {NV.state()}")
    NV.stop()

    print("\n== SDPA cuDNN at B=4 H=32 N=4096 D=128 bf16, three methods (TFLOP/s median, spread = IQR/median, "
          "per-round range; SM clock/power during that kernel's blocks)")
    keys = {"independent": ("CUDNN no-flush", "CUDNN flush", "FLASH no-flush", "FLASH flush"),
            "lab": ("SDPA CUDNN", "cuDNN implied via TMA", "cuDNN implied via triton_attention", "TMA",
                    "triton_attention"),
            "bench": ("SDPA CUDNN_ATTENTION", "SDPA FLASH_ATTENTION", "SDPA EFFICIENT_ATTENTION", "triton_attention",
                      "(order)")}
    for causal in (False, True):
        print(f"\n-- {'causal' if causal else 'full'}")
        for method, names in keys.items():
            got = RESULTS.get((method, causal), {})
            for name in names:
                if name in got:
                    print(f"  {method:<11} {name:<36} {got[name]}")
    print(f"\nGPU at the end: {NV.state()}; total {time.time() - START:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)
