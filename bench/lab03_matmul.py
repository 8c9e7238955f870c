#!/usr/bin/env python3
"""Lab 03 on a GPU: the lab's tutorial matmul (`triton_matmul`, autotuned), its persistent matmul
(`persistent_matmul`: autotuned, a few fixed tile configs through TMA, and the plain-load version) and cuBLAS
(`torch.matmul`), BF16, at 4096^3 and 8192^3: every kernel checked first (awkward shapes and layouts, then each
size), then 5 interleaved rounds of `triton.testing.do_bench`; the table gives the median of the per-round
ratios to cuBLAS and their spread.

    python3 bench/lab03_matmul.py            # from the repository root; 2 to 3 minutes on an H100 (compiles included)
    OUT=/some/dir python3 bench/lab03_matmul.py   # also writes /some/dir/lab03_matmul.json

Look at: the `ratio` column (>= 1.0 means as fast as cuBLAS), `% of peak` (989 dense BF16 TFLOP/s on an H100 SXM),
and the "failed" lines (a config that does not compile or fit on this Triton). The kernels come from the lab's
exported cells (solutions/03_bf16_matmul.ipynb), not from a copy.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

SIZES = [4096, 8192]
ROUNDS = 5
PEAK = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 SXM": 989.4, "NVIDIA H200": 989.4}
FIXED = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, split epilogue)
    (128, 256, 64, 8, 8, 3, True), (128, 256, 64, 8, 8, 3, False), (128, 256, 64, 8, 8, 4, True),
    (128, 256, 64, 16, 8, 3, True), (256, 128, 64, 8, 8, 3, True), (128, 128, 64, 8, 8, 4, False),
    (128, 128, 64, 8, 4, 4, False),
]


def load_lab():
    """The lab's exported cells: through utils.solutions, or (no nbformat here) straight from the notebook's JSON."""
    try:
        from utils import solutions

        return solutions.load("03")
    except ImportError:
        import importlib.util

        nb = json.loads((ROOT / "solutions" / "03_bf16_matmul.ipynb").read_text())
        cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and "export" in c["metadata"].get("tags", [])]
        keep = lambda line: line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION") and not line.lstrip().startswith(("%", "!"))
        source = "\n\n\n".join("\n".join(filter(keep, c.split("\n"))) for c in cells)
        path = Path(os.environ.get("TMPDIR", "/tmp")) / "lab03_export_bench.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("lab03_export_bench", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def rel_error(c, a, b):
    ref = a.float() @ b.float()
    return ((c.float() - ref).norm() / ref.norm()).item()


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA or ROCm GPU")
        return 0
    started = time.time()
    lab = load_lab()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    peak = PEAK.get(props.name)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "hip": torch.version.hip, "peak_bf16_tflops": peak}
    print(f"{props.name}, {props.multi_processor_count} SMs/CUs; torch {torch.__version__}, Triton {triton.__version__}")

    contenders = {"cublas": lambda a, b: torch.matmul(a, b), "tutorial": lab.triton_matmul,
                  "persistent": lab.persistent_matmul,
                  "persistent-plain": lambda a, b: lab.persistent_matmul(a, b, tma=False)}
    probe = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    tma = lab.uses_tma(probe, probe)
    info["tma"] = tma
    if tma:
        for cfg in FIXED:
            contenders["tma " + "x".join(map(str, cfg[:3])) + f" g{cfg[3]} w{cfg[4]} s{cfg[5]}" + (" split" if cfg[6] else "")] = \
                (lambda cfg: lambda a, b: lab.persistent_matmul(a, b, config=cfg))(cfg)

    # 1. correctness on awkward shapes and layouts (the TMA path too: transposed operands, ragged edges)
    gen = torch.Generator(device="cpu").manual_seed(0)
    awkward = [(1, 17, 97, False, False), (127, 4096, 129, False, False), (256, 320, 192, True, False),
               (300, 200, 136, False, True), (1000, 1000, 1000, True, True), (64, 8, 4096, False, False)]
    failed, checks = {}, []
    for name, fn in contenders.items():
        try:
            for m, n, k, at, bt in awkward:
                a = (torch.randn(k, m, generator=gen).T if at else torch.randn(m, k, generator=gen)).to(dev, torch.bfloat16)
                b = (torch.randn(n, k, generator=gen).T if bt else torch.randn(k, n, generator=gen)).to(dev, torch.bfloat16)
                err = rel_error(fn(a, b), a, b)
                checks.append({"kernel": name, "shape": [m, n, k], "a_t": at, "b_t": bt, "rel_error": err})
                if not err < 1e-2:
                    raise AssertionError(f"{m}x{n}x{k} (a.T={at}, b.T={bt}): relative error {err:.2e}")
        except Exception as err:  # noqa: BLE001 - a config that does not compile or is wrong is reported, not fatal
            failed[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}"
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
    for name in failed:
        contenders.pop(name)

    # 2. each size: correctness, then ROUNDS interleaved rounds
    results = {}
    for size in SIZES:
        a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        flops = 2 * size ** 3
        alive = {}
        for name, fn in contenders.items():
            try:
                err = rel_error(fn(a, b), a, b)          # runs the autotuners once
                if not err < 1e-2:
                    raise AssertionError(f"{size}^3: relative error {err:.2e}")
                alive[name] = fn
            except Exception as err:  # noqa: BLE001
                failed[f"{name} @ {size}"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"
        times = {name: [] for name in alive}
        names = list(alive)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:     # a different order each round
                times[name].append(triton.testing.do_bench(lambda: alive[name](a, b), warmup=25, rep=100))
        base = times["cublas"]
        results[size] = {}
        for name, ms in times.items():
            ratios = [b_ms / t for b_ms, t in zip(base, ms)]
            tflops = flops / (statistics.median(ms) / 1e3) / 1e12
            results[size][name] = {"ms": ms, "tflops": tflops, "ratio_median": statistics.median(ratios),
                                   "ratio_min": min(ratios), "ratio_max": max(ratios),
                                   "of_peak": tflops / peak if peak else None}
        best = getattr(lab.tuned_tma_kernel.get(2), "best_config", None) if tma else None
        if best is not None:
            results[size]["persistent"]["autotuner_choice"] = str(best)
        for cfg in FIXED:
            tiles_count = triton.cdiv(size, cfg[0]) * triton.cdiv(size, cfg[1])
            info.setdefault("waves", {})[f"{size} {cfg[0]}x{cfg[1]}"] = round(tiles_count / props.multi_processor_count, 2)

    # 3. the table
    print(f"\nchecks: {len(checks)} shape/layout runs; failed: {len(failed)}")
    for name, why in failed.items():
        print(f"  failed: {name}: {why}")
    print(f"\n{'size':>6} {'kernel':<40} {'TFLOP/s':>8} {'% of peak':>9} {'ratio':>6} {'min':>6} {'max':>6}   (ratio: cuBLAS time / "
          f"kernel time, median of {ROUNDS} interleaved rounds)")
    for size, rows in results.items():
        for name, row in sorted(rows.items(), key=lambda kv: -kv[1]["ratio_median"]):
            share = f"{row['of_peak']:.1%}" if row["of_peak"] else "-"
            print(f"{size:>6} {name:<40} {row['tflops']:>8.1f} {share:>9} {row['ratio_median']:>6.3f} {row['ratio_min']:>6.3f} "
                  f"{row['ratio_max']:>6.3f}")
        if "autotuner_choice" in rows.get("persistent", {}):
            print(f"{'':>6} persistent's autotuner chose: {rows['persistent']['autotuner_choice']}")
    elapsed = time.time() - started
    print(f"\n{elapsed:.0f} s in all")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "lab03_matmul.json").write_text(json.dumps(
            {"info": info, "failed": failed, "checks": checks, "results": {str(k): v for k, v in results.items()},
             "seconds": elapsed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
