"""Lab 04's public `triton_attention` against every path and tile of the course's own kernels, per shape (issue 33).

    python3 bench/lab04_dispatch.py              # measure (about 3 minutes on an H100, most of it compiling)
    python3 bench/lab04_dispatch.py --final      # the wrapper, the old rule, the best course kernel, cuDNN, FA4
    python3 bench/lab04_dispatch.py --headline   # the same at the headline shape only (a re-check)
    python3 bench/lab04_dispatch.py --table TUNE.json [FINAL.json [HEADLINE.json]] > utils/data/lab04_dispatch.json

What a run does:
1. Every shape of SHAPES (the headline B=4 H=32 N=4096 D=128 bf16, both masks, and bench/lab04_attention.py's sweep):
   `triton_attention`, the portable kernel and the TMA kernel with each tile of TILES, SDPA's cuDNN and FLASH backends
   and FlashAttention-4 when it imports, each checked against the fp32 reference first (the lab's rule), then timed in
   ROUNDS interleaved rounds. Kept per round: each candidate's median ms; a ratio is the median of per-round ratios.
   The kernels compile in parallel processes first (Triton's disk cache), so the timing process only loads them.
2. Host time per call (the GPU kept busy with torch.cuda._sleep, so calls only queue) of the wrapper, each path, the
   input checks alone and a bare Triton launch; a torch.profiler trace of one wrapper call (kernels, copies,
   allocations) at the smallest and the headline shape.
Writes $OUT/lab04_dispatch_run.json (and the profiler tables) when OUT is set; prints compact tables last.
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from bench.lab04_attention import check, flash_attn_4, flops, load_lab, sdpa, versions  # noqa: E402

START = time.time()
ROUNDS = 5
SHAPES = [  # (batch, heads, n, d, causal): the headline, then bench/lab04_attention.py's sweep
    (4, 32, 4096, 128, False), (4, 32, 4096, 128, True),
    (2, 16, 1000, 64, False), (2, 8, 777, 96, True), (1, 8, 2048, 256, False), (1, 8, 2048, 256, True),
    (8, 16, 512, 128, True), (2, 12, 1024, 80, True), (1, 16, 8192, 64, True),
]
T = lambda m, n, w, s, r=None: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, **({"maxnreg": r} if r else {}))
TILES = {  # path -> padded head dim -> tiles tried (each path's default is added first)
    "hopper": {64: [T(128, 128, 8, 3), T(128, 64, 4, 3), T(128, 64, 8, 3), T(64, 64, 4, 3), T(64, 32, 4, 3)],
               128: [T(128, 64, 8, 2, 128), T(128, 64, 8, 3), T(128, 128, 8, 2), T(64, 64, 4, 3), T(64, 64, 4, 4),
                     T(64, 32, 4, 3), T(64, 32, 4, 4)],
               256: [T(128, 64, 8, 2), T(64, 64, 4, 2), T(128, 32, 8, 3), T(64, 32, 4, 3)]},
    "portable": {64: [T(128, 64, 4, 3), T(128, 64, 8, 3), T(64, 64, 4, 3), T(128, 128, 8, 3)],
                 128: [T(128, 64, 8, 4), T(128, 64, 8, 3), T(64, 64, 4, 3), T(128, 128, 8, 2)],
                 256: [T(128, 64, 8, 2), T(64, 64, 4, 2), T(64, 32, 4, 2), T(128, 32, 8, 2)]},
}


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def tile_name(c: dict) -> str:
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c.get('num_warps', 4)} s{c.get('num_stages', '-')}"
            + (f" r{c['maxnreg']}" if c.get("maxnreg") else ""))


def d_pad(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def tiles_for(lab, path: str, d: int, causal: bool) -> list[dict]:
    first = lab.hopper_configs(d, causal)[0] if path == "hopper" else lab.attention_configs(d, "cuda")[0]
    out = [first]
    for c in TILES[path][d_pad(d)]:
        if c not in out:
            out.append(c)
    return out


def course_kernel(lab, path: str, config: dict):
    fn = lab.hopper_attention if path == "hopper" else lab.portable_attention
    return lambda q, k, v, c: fn(q, k, v, c, config=config)


def old_wrapper(lab):
    """`triton_attention` as it was before issue 33, on the lab's kernels: its checks twice, Triton's whole launch
    path on every call, the TMA kernel's default tiles where it runs, else the portable kernel's."""
    import triton

    def run(q, k, v, causal=False, sm_scale=None):
        lab.check_inputs(q, k, v, causal, sm_scale)
        tma = lab.why_not_hopper(q, k, v) is None
        lab.check_inputs(q, k, v, causal, sm_scale)
        B, H, N, D = q.shape
        scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
        out = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
        c = dict((lab.hopper_configs(D, causal) if tma else lab.attention_configs(D, "cuda"))[0])
        grid = (triton.cdiv(N, c["BLOCK_M"]), H, B)
        with torch.cuda.device(q.device):
            if tma:
                lab.why_not_hopper(q, k, v)
                triton.set_allocator(lab._tma_scratch)
                lab.flash_attention_tma[grid](q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                                              *out.stride()[:3], N, scale, HEAD_DIM=D, D_PAD=d_pad(D),
                                              CAUSAL=bool(causal), WARP_SPECIALIZE=False, **c)
            else:
                lab.flash_attention[grid](q, k, v, out, *q.stride(), *k.stride(), *v.stride(), *out.stride(), N,
                                          scale, HEAD_DIM=D, D_PAD=d_pad(D), CAUSAL=bool(causal), **c)
        return out
    return run


def candidates(lab, shape, tma_runs: bool, fa4, final: bool, table: dict | None = None) -> dict:
    """name -> fn(q, k, v, causal): the wrapper, the old one, the course's paths (every tile, or in --final each
    path's default and the table's best at this shape), SDPA CUDNN and FLASH, FA4."""
    b, h, n, d, causal = shape
    out = {"triton_attention": lab.triton_attention, "old wrapper": old_wrapper(lab)}
    for path in ("hopper", "portable"):
        if path == "hopper" and not tma_runs:
            continue
        tiles = final_tiles(lab, path, shape, table) if final else tiles_for(lab, path, d, causal)
        for c in tiles:
            out[f"{path} {tile_name(c)}"] = course_kernel(lab, path, c)
    out["SDPA CUDNN"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    out["SDPA FLASH"] = sdpa(SDPBackend.FLASH_ATTENTION)
    if fa4:
        out["flash-attn-4"] = fa4
    return out


def _compile_jobs(jobs) -> list[str]:
    """Run each (path, config, d, causal) once on a small input of the same specialization: fills Triton's cache."""
    os.environ.pop("TRITON_INTERPRET", None)
    lab = load_lab()
    failed = []
    for path, config, d, causal in jobs:
        q = k = v = torch.randn(1, 2, 256, d, device="cuda", dtype=torch.bfloat16)
        try:
            course_kernel(lab, path, config)(q, k, v, causal)
            lab.triton_attention(q, k, v, causal)
        except Exception as exc:
            failed.append(f"{path} {tile_name(config)} D{d} causal={causal}: {type(exc).__name__}: {exc}"[:200])
    torch.cuda.synchronize()
    return failed


def final_tiles(lab, path: str, shape, table: dict | None) -> list[dict]:
    """In --final: the path's default tiles and the table's best at this shape."""
    tiles = tiles_for(lab, path, shape[3], shape[4])[:1]
    for e in (table or {}).get("entries", []):
        if (e["B"], e["H"], e["N"], e["D"], e["causal"]) == tuple(shape) and path in e and e[path] not in tiles:
            tiles.append(e[path])
    return tiles


def precompile(lab, tma_runs: bool, final: bool, table: dict | None) -> None:
    jobs = sorted({(path, json.dumps(c, sort_keys=True), shape[3], shape[4]) for shape in SHAPES
                   for path in ("hopper", "portable") if tma_runs or path == "portable"
                   for c in (final_tiles(lab, path, shape, table) if final
                             else tiles_for(lab, path, shape[3], shape[4]))})
    jobs = [(p, json.loads(c), d, causal) for p, c, d, causal in jobs]
    workers = min(14, os.cpu_count() or 2)
    chunks = [jobs[i::workers] for i in range(workers)]
    import multiprocessing
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = [f for part in pool.map(_compile_jobs, chunks) for f in part]
    log(f"precompiled {len(jobs)} kernels in {workers} processes" + (f"; failed: {failed}" if failed else ""))


def bench(fn, reps: int, warm_ms: float = 0.0) -> float:
    """Median ms of `reps` calls, each bracketed by CUDA events (as utils.timing.benchmark, without its machine
    snapshots: this loop runs hundreds of times), after calls for `warm_ms` (at least one)."""
    t0 = time.perf_counter()
    fn()
    while (time.perf_counter() - t0) * 1e3 < warm_ms:
        fn()
        torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rounds(fns: dict, rep_ms: float = 50.0) -> dict[str, list[float]]:
    """Each candidate's median ms in each of ROUNDS interleaved rounds (after a common warm-up), in a new order
    each round."""
    first = next(iter(fns.values()))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        first()
    torch.cuda.synchronize()
    reps = {name: max(5, int(rep_ms / max(bench(fn, 3), 1e-3)))
            for name, fn in fns.items()}
    out = {name: [] for name in fns}
    order, shuffle = list(fns), random.Random(0).shuffle
    for _ in range(ROUNDS):
        # A new order each round, and 20 ms of calls before each timing: the GPU's clock after a power-hungry kernel
        # (cuDNN, FA4) is lower for a while, so in a fixed cyclic order the one after it always paid for it.
        shuffle(order)
        for name in order:
            out[name].append(bench(fns[name], reps[name], warm_ms=20))
    return out


def measure_shape(lab, shape, cands: dict) -> dict:
    b, h, n, d, causal = shape
    right, checks = {}, {}
    for name, fn in cands.items():
        first = check(lab, fn, b, h, n, d, causal)       # the first call: Triton's launch path
        again = check(lab, fn, b, h, n, d, causal)       # the same inputs again: the course's direct launch
        checks[name] = again if first["ok"] else first
        if first["ok"] and again["ok"]:
            right[name] = fn
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = rounds({name: (lambda fn=fn: fn(q, k, v, causal)) for name, fn in right.items()})
    work = flops(b, h, n, d, causal)
    graph_us = {}
    if work < 2e11:                # small calls: also the GPU's time alone (launches replayed from a CUDA graph)
        for name, fn in right.items():
            graph_us[name] = graph_time_us(lambda fn=fn: fn(q, k, v, causal))
    return {"shape": dict(B=b, H=h, N=n, D=d, causal=causal), "ms_per_round": ms, "checks": checks,
            "tflops": {name: work / (statistics.median(v) / 1e3) / 1e12 for name, v in ms.items()},
            "graph_us": graph_us}


def graph_time_us(fn, calls: int = 10) -> float | str:
    """Microseconds per call of `fn` replayed from a CUDA graph of `calls` calls (no host time), or why not."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        ms = bench(g.replay, 20) / calls
        del g
        return ms * 1e3
    except Exception as exc:  # a backend that cannot be captured
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"


def kernel_times(shape, fns: dict) -> dict:
    """From torch.profiler over 20 eager calls of each: the median GPU time of its kernels per call, and the median
    gap between one call's last kernel and the next call's first (time the GPU waited for the host)."""
    from torch.profiler import ProfilerActivity, profile
    b, h, n, d, causal = shape
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, fn in fns.items():
        fn(q, k, v, causal)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn(q, k, v, causal)
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        gaps = [y.time_range.start - x.time_range.end for x, y in zip(kernels, kernels[1:])]
        out[name] = {"kernels": len(kernels), "kernel_us": statistics.median(e.time_range.elapsed_us() for e in kernels),
                     "gap_us": statistics.median(gaps) if gaps else None,
                     "names": sorted({e.name[:48] for e in kernels})}
    return out


def ratio(ms_per_round: dict, a: str, b: str) -> float:
    """Median over rounds of (b's time / a's time) = a's speed over b's, round by round."""
    return statistics.median(y / x for x, y in zip(ms_per_round[a], ms_per_round[b]))


def host_times(lab, shape) -> dict:
    """Host microseconds per call while the GPU is busy elsewhere (calls only queue)."""
    b, h, n, d, causal = shape
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {"triton_attention": lambda: lab.triton_attention(q, k, v, causal),
           "old wrapper": lambda: old_wrapper(lab)(q, k, v, causal),
           "portable_attention": lambda: lab.portable_attention(q, k, v, causal),
           "check_inputs": lambda: lab.check_inputs(q, k, v, causal, None),
           "why_not_hopper": lambda: lab.why_not_hopper(q, k, v),
           "torch.empty_like": lambda: torch.empty_like(q),
           "SDPA CUDNN": lambda: sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, causal)}
    if lab.why_not_hopper(q, k, v) is None:
        fns["hopper_attention"] = lambda: lab.hopper_attention(q, k, v, causal)
        out = torch.empty_like(q)
        c = dict(lab.hopper_configs(d, causal)[0])
        grid = (-(-n // c["BLOCK_M"]), h, b)
        fns["bare TMA launch"] = lambda: lab.flash_attention_tma[grid](
            q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], n, 0.1, HEAD_DIM=d,
            D_PAD=d_pad(d), CAUSAL=causal, WARP_SPECIALIZE=False, **c)
    result = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            torch.cuda._sleep(60_000_000)          # ~30 ms of GPU work ahead of the calls
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            samples.append((time.perf_counter() - t0) / 50 * 1e6)
            torch.cuda.synchronize()
        result[name] = statistics.median(samples)
    return result


def profile_call(lab, shape, out_dir: Path | None) -> dict:
    """torch.profiler over 3 wrapper calls: every CUDA kernel and memcpy/memset, and the CPU ops by self time."""
    from torch.profiler import ProfilerActivity, profile
    b, h, n, d, causal = shape
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lab.triton_attention(q, k, v, causal)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        for _ in range(3):
            lab.triton_attention(q, k, v, causal)
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=20)
    name = f"profile_B{b}_H{h}_N{n}_D{d}{'_causal' if causal else ''}.txt"
    if out_dir:
        (out_dir / name).write_text(table)
    gpu = [(e.key, e.count, e.device_time_total / e.count) for e in events if e.device_time_total > 0]
    return {"gpu_ops": gpu, "cpu_top": [(e.key, e.count, e.self_cpu_time_total / e.count)
                                        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]]}


def main(final: bool, headline_only: bool = False) -> int:
    global ROUNDS, SHAPES
    ROUNDS = 7 if final else ROUNDS
    SHAPES = SHAPES[:2] if headline_only else SHAPES
    os.environ.pop("TRITON_INTERPRET", None)
    info = versions()
    log(str(info))
    lab = load_lab()
    fa4, fa4_missing = flash_attn_4()
    log("flash-attn-4: " + ("imported" if fa4 else f"not available ({fa4_missing})"))
    tma_runs = lab.why_not_hopper(*(torch.empty(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16),) * 3) is None
    table_path = ROOT / "utils" / "data" / "lab04_dispatch.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else None
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = {"versions": info, "date": time.strftime("%Y-%m-%d"), "mode": "final" if final else "tune",
              "rounds": ROUNDS, "shapes": [], "host_us": {}, "profiles": {}}
    precompile(lab, tma_runs, final, table)
    for shape in SHAPES:
        cands = candidates(lab, shape, tma_runs, fa4, final, table)
        result = measure_shape(lab, shape, cands)
        if final:
            course = [name for name in result["ms_per_round"] if name.startswith(COURSE)]
            best = min(course, key=lambda name: statistics.median(result["ms_per_round"][name]))
            result["kernel_us"] = kernel_times(shape, {name: cands[name] for name in ("triton_attention", best)})
        report["shapes"].append(result)
        log(f"{shape}: {len(result['tflops'])} of {len(cands)} timed")
    for shape in (SHAPES[7], SHAPES[0]) if not headline_only else ():
        key = "B{B} H{H} N{N} D{D} causal={causal}".format(**dict(zip("BHND", shape[:4]), causal=shape[4]))
        report["host_us"][key] = host_times(lab, shape)
        report["profiles"][key] = profile_call(lab, shape, out_dir)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"lab04_dispatch_{report['mode']}{'_headline' if headline_only else ''}.json").write_text(json.dumps(report, indent=1, default=str))
    print_tables(report)
    bad = [f"{r['shape']} {name}" for r in report["shapes"] for name, c in r["checks"].items() if not c["ok"]]
    print("correctness: " + ("all within tolerance" if not bad else "WRONG: " + "; ".join(bad)))
    print(f"total {time.time() - START:.0f} s")
    return 1 if bad else 0


def print_tables(report) -> None:
    print(f"\n== lab 04 dispatch ({report['mode']}): {report['versions']}")
    for r in report["shapes"]:
        s, ms = r["shape"], r["ms_per_round"]
        print(f"\nB{s['B']} H{s['H']} N{s['N']} D{s['D']}{' causal' if s['causal'] else ''}: TFLOP/s, x cuDNN "
              "(median of per-round ratios), x triton_attention")
        for name, value in sorted(r["tflops"].items(), key=lambda kv: -kv[1]):
            x_cudnn = ratio(ms, name, "SDPA CUDNN") if "SDPA CUDNN" in ms else float("nan")
            x_wrap = ratio(ms, name, "triton_attention") if "triton_attention" in ms else float("nan")
            g = r.get("graph_us", {}).get(name)
            g = "" if g is None else f"  graph {g:7.1f} us" if isinstance(g, float) else f"  graph: {g}"
            print(f"  {name:<40} {value:7.1f}  {x_cudnn:5.3f}  {x_wrap:5.3f}  {statistics.median(ms[name]) * 1e3:9.1f} us{g}")
    for r in report["shapes"]:
        if r.get("kernel_us"):
            print(f"profiler, {r['shape']}: " + "; ".join(f"{k}: {v['kernels']} kernels, {v['kernel_us']:.1f} us each, "
                                                          f"gap {v['gap_us']:.1f} us" for k, v in r["kernel_us"].items()))
    for key, host in report["host_us"].items():
        print(f"\nhost us per call, {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    for key, prof in report["profiles"].items():
        print(f"profile of 3 wrapper calls, {key}: GPU ops " + "; ".join(f"{k} x{c} {t:.1f}us" for k, c, t in
                                                                        prof["gpu_ops"]))
        print("  CPU top (self us per call): " + "; ".join(f"{k} x{c} {t:.1f}" for k, c, t in prof["cpu_top"][:8]))


COURSE = ("hopper ", "portable ")     # the names of the course's kernels among the candidates


def gpu_bound(r: dict) -> bool:
    """Whether a shape's calls were timed by the GPU (each course kernel's GPU time alone, from a CUDA graph, at
    least 90% of its time per call, or no graph timing: a large call), not by the host."""
    graph = r.get("graph_us", {})
    return all(not isinstance(graph.get(name), float) or graph[name] >= 0.9 * statistics.median(v) * 1e3
               for name, v in r["ms_per_round"].items() if name.startswith(COURSE))


def make_table(tune_path: str, final_path: str | None = None, recheck_path: str | None = None) -> dict:
    """utils/data/lab04_dispatch.json: from a tune run, per shape the fastest tiles of each course kernel (median
    of the rounds, host time included: what a caller waits) and which kernel was fastest; where a final run timed
    the shape by the GPU, its run-off (the tune's best against each kernel's default, in shuffled rounds) decides.
    From the final run (and a re-check of the headline with the table's final choice), the figures the lab prints:
    the wrapper, the old one, the course's best kernel, cuDNN, FA4; x cuDNN as the median of per-round ratios."""
    run = json.loads(Path(tune_path).read_text())
    final = json.loads(Path(final_path).read_text()) if final_path else {"shapes": []}
    runoff = {tuple(r["shape"].values()): r for r in final["shapes"] if gpu_bound(r)}
    entries = []
    for r in run["shapes"]:
        source = "tune"
        if tuple(r["shape"].values()) in runoff:
            r, source = runoff[tuple(r["shape"].values())], "final"
        med = {name: statistics.median(v) for name, v in r["ms_per_round"].items()}
        best = {}
        for path in ("hopper", "portable"):
            mine = {name: t for name, t in med.items() if name.startswith(path + " ")}
            if mine:
                best[path] = min(mine, key=mine.get)
        fastest = min(best.values(), key=med.get)
        entries.append(dict(**r["shape"], fastest=fastest.split()[0],
                            **{path: parse_tile(name.split(" ", 1)[1]) for path, name in best.items()},
                            us={path: round(med[name] * 1e3, 1) for path, name in best.items()}, run=source))
    v = run["versions"]
    table = {"what": "lab 04's dispatch: per shape measured, the fastest tiles of each of the course's kernels "
                     "(hopper: flash_attention_tma, portable: flash_attention) and which was fastest; tuning data "
                     "(bench/lab04_dispatch.py), not a reference figure",
             "made_by": "python3 bench/lab04_dispatch.py [--final]; python3 bench/lab04_dispatch.py --table "
                        "lab04_dispatch_tune.json [lab04_dispatch_final.json]",
             "device": v["gpu"], "capability": v["capability"], "torch": v["torch"], "triton": v["triton"],
             "cudnn": v["cudnn"], "date": run["date"], "rounds": run["rounds"], "entries": entries}
    if final_path:
        table["measured"] = summarize(final)
    if recheck_path:
        table["measured"]["headline_recheck"] = summarize(json.loads(Path(recheck_path).read_text()))
    return table


def summarize(run: dict) -> dict:
    """A final run's figures per shape: TFLOP/s and x cuDNN (median of per-round ratios) of the wrapper, the old
    wrapper, the fastest course kernel, cuDNN and FA4; the wrapper's host time and the GPU's time alone."""
    v = run["versions"]
    out = {"device": v["gpu"], "torch": v["torch"], "triton": v["triton"], "cudnn": v["cudnn"],
           "flash-attn-4": v.get("flash-attn-4"), "date": run["date"], "rounds": run["rounds"], "shapes": [],
           "host_us": {k: {n: round(t, 1) for n, t in h.items()} for k, h in run["host_us"].items()}}
    for r in run["shapes"]:
        ms, tf = r["ms_per_round"], r["tflops"]
        course = [name for name in ms if name.startswith(COURSE)]
        best = min(course, key=lambda name: statistics.median(ms[name]))
        row = {"shape": r["shape"], "best course kernel": best, "figures": {}}
        for label, name in (("triton_attention", "triton_attention"), ("old wrapper", "old wrapper"),
                            ("best course kernel", best), ("SDPA CUDNN", "SDPA CUDNN"), ("FA4", "flash-attn-4")):
            if name in ms:
                row["figures"][label] = {"tflops": round(tf[name], 1),
                                         "x_cudnn": round(ratio(ms, name, "SDPA CUDNN"), 3) if "SDPA CUDNN" in ms
                                         else None,
                                         "us": round(statistics.median(ms[name]) * 1e3, 1)}
                g = r.get("graph_us", {}).get(name)
                if isinstance(g, float):
                    row["figures"][label]["gpu_us"] = round(g, 1)
        row["wrapper_over_best"] = round(ratio(ms, "triton_attention", best), 3)
        if r.get("kernel_us"):
            row["kernel_us"] = {name: round(v["kernel_us"], 1) for name, v in r["kernel_us"].items()}
        out["shapes"].append(row)
    return out


def parse_tile(text: str) -> dict:
    parts = text.split()
    m, n = parts[0].split("x")
    c = dict(BLOCK_M=int(m), BLOCK_N=int(n), num_warps=int(parts[1][1:]), num_stages=int(parts[2][1:]))
    if len(parts) > 3:
        c["maxnreg"] = int(parts[3][1:])
    return c


if __name__ == "__main__":
    if "--table" in sys.argv:
        paths = sys.argv[sys.argv.index("--table") + 1:]
        print(json.dumps(make_table(*paths[:3]), indent=1))
        sys.exit(0)
    if not torch.cuda.is_available():
        print("SKIP: bench/lab04_dispatch.py needs a CUDA GPU")
        sys.exit(0)
    sys.exit(main("--final" in sys.argv or "--headline" in sys.argv, "--headline" in sys.argv))
