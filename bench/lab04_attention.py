"""Lab 04 on a GPU: the course's attention kernels against SDPA's backends and FlashAttention-4, right and fast.

    python3 bench/lab04_attention.py            # about 2-3 minutes on an H100 (most of it compiling)

What it does, in one run:
1. Headline, B=4 H=32 N=4096 D=128 bf16, causal and not: the portable kernel (`portable_attention`, a few tiles),
   the Hopper kernel (`hopper_attention`: tensor descriptors / TMA, a grid of tiles, warp specialization tried),
   SDPA FLASH / EFFICIENT / CUDNN, and flash-attn-4 (`from flash_attn.cute import flash_attn_func`) when it imports.
   TFLOP/s = median of interleaved rounds (utils.timing.interleaved), and each variant's ratio to SDPA CUDNN.
2. A sweep of shapes, small and odd ones included: triton_attention (what the lab's public API runs there), the
   portable kernel, SDPA's backends, flash-attn-4: TFLOP/s per shape and which wins.
3. Correctness of every variant on every shape measured: max error against an fp32 reference within flash-attn's rule
   (2x PyTorch's own error in bf16 + 1e-3); the headline checked on one batch of four heads.
Prints compact tables last; writes everything to $OUT/lab04_attention.json when OUT is set.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from utils import timing  # noqa: E402

START = time.time()
ROUNDS = 5
HEADLINE = (4, 32, 4096, 128)
SHAPES = [  # (batch, heads, n, d, causal)
    (2, 16, 1000, 64, False), (2, 8, 777, 96, True), (1, 8, 2048, 256, False), (1, 8, 2048, 256, True),
    (8, 16, 512, 128, True), (2, 12, 1024, 80, True), (1, 16, 8192, 64, True),
]
PORTABLE_TILES = [None, dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)]
HOPPER_TILES = [None, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
                dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)]


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def load_lab():
    """The lab's exported cells (utils.solutions); without nbformat, the same cells read from the notebook's JSON."""
    try:
        from utils import solutions
        return solutions.load("04")
    except ImportError as err:
        log(f"utils.solutions unavailable ({err}); reading the exported cells from the notebook's JSON")
        import importlib.util
        nb = json.loads((ROOT / "solutions" / "04_flash_attention.ipynb").read_text())
        cells = ["".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "code" and "export" in c["metadata"].get("tags", [])]
        source = "\n\n\n".join("\n".join(line for line in cell.split("\n")
                                        if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
                               for cell in cells)
        path = ROOT / "build" / "export" / "lab04_bench_export.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("lab04_bench_export", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def flash_attn_4():
    """FlashAttention-4's forward as (q, k, v, causal) -> out in (batch, heads, n, d), or None with the reason."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as err:  # ImportError, or a CUDA/CuTe DSL mismatch at import
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"

    def run(q, k, v, causal=False):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return run, None


def sdpa(backend):
    def run(q, k, v, causal=False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def versions() -> dict:
    import triton
    out = {"gpu": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
           "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
           "cudnn": torch.backends.cudnn.version()}
    try:
        from importlib import metadata
        out["flash-attn-4"] = metadata.version("flash-attn-4")
    except Exception:
        out["flash-attn-4"] = None
    return out


def flops(b, h, n, d, causal) -> float:
    return 4 * b * h * n * n * d / (2 if causal else 1)


def check(lab, fn, b, h, n, d, causal) -> dict:
    """fn's max error against the fp32 reference on (a slice of) the shape, by flash-attn's rule."""
    if n >= 4096:
        b, h = 1, min(h, 4)
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    try:
        ok, err, allowed = lab.within_tolerance(fn(q, k, v, causal), q, k, v, causal)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"ok": bool(ok), "max_error": err, "allowed": allowed}


def measure(candidates: dict, b, h, n, d, causal) -> dict:
    """{name: TFLOP/s} by the median of ROUNDS interleaved rounds; a candidate that fails is left out, with why."""
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runnable, failed = {}, {}
    for name, fn in candidates.items():
        try:
            fn(q, k, v, causal)
            torch.cuda.synchronize()
            runnable[name] = (lambda fn=fn: fn(q, k, v, causal))
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    # the lab's settings (rep_ms=200 after 300 ms of warm-up; each block warmed, the order shuffled: utils/timing.py), so
    # the bench and lab 04 report the same sustained figure, not a burst one
    times = timing.interleaved(runnable, rounds=ROUNDS, rep_ms=200, warmup_ms=300, flush_l2=False) if runnable else {}
    return {"tflops": {name: flops(b, h, n, d, causal) / (ms / 1e3) / 1e12 for name, ms in times.items()},
            "failed": failed}


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: bench/lab04_attention.py needs a CUDA GPU")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    info = versions()
    log(f"{info}")
    lab = load_lab()
    fa4, fa4_missing = flash_attn_4()
    log("flash-attn-4: " + ("imported" if fa4 else f"not available ({fa4_missing})"))
    reason = lab.why_not_hopper(*(torch.empty(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16),) * 3)
    log("Hopper (TMA) path: " + ("runs here" if reason is None else f"not here: {reason}"))
    report = {"versions": info, "flash_attn_4": fa4_missing or "imported", "hopper_path": reason or "runs",
              "headline": {}, "shapes": [], "checks": {}}

    # 1. the headline: every variant, causal and not
    b, h, n, d = HEADLINE
    for causal in (False, True):
        cands = {}
        for tiles in PORTABLE_TILES:
            cands[f"portable {tiles_name(tiles, lab.attention_configs(d, 'cuda')[0])}"] = \
                (lambda q, k, v, c, t=tiles: lab.portable_attention(q, k, v, c, config=t))
        if reason is None:
            for tiles in HOPPER_TILES:
                cands[f"hopper {tiles_name(tiles, lab.hopper_configs(d, causal)[0])}"] = \
                    (lambda q, k, v, c, t=tiles: lab.hopper_attention(q, k, v, c, config=t))
        cands["triton_attention"] = lab.triton_attention
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            cands[f"SDPA {backend.name}"] = sdpa(backend)
        if fa4:
            cands["flash-attn-4"] = fa4
        log(f"headline causal={causal}: {len(cands)} variants (compiling)")
        result = measure(cands, b, h, n, d, causal)
        for name in list(result["tflops"]):
            report["checks"][f"headline causal={causal} {name}"] = check(lab, cands[name], b, h, n, d, causal)
        report["headline"][f"causal={causal}"] = result
        log(f"headline causal={causal} measured")

    # 2. the sweep of shapes
    for b, h, n, d, causal in SHAPES:
        cands = {"triton_attention": lab.triton_attention, "portable": lab.portable_attention}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            cands[f"SDPA {backend.name}"] = sdpa(backend)
        if fa4:
            cands["flash-attn-4"] = fa4
        result = measure(cands, b, h, n, d, causal)
        shape = f"B{b} H{h} N{n} D{d}{' causal' if causal else ''}"
        for name in result["tflops"]:
            report["checks"][f"{shape} {name}"] = check(lab, cands[name], b, h, n, d, causal)
        report["shapes"].append({"shape": shape, **result})
        log(f"{shape} measured")

    report["warp_specialize"] = warp_specialize_probe() if reason is None else "not run (no TMA path here)"
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "lab04_attention.json").write_text(json.dumps(report, indent=1, default=str))
    print_tables(report)
    bad = [k for k, v in report["checks"].items() if not v["ok"]]
    return 1 if bad else 0


def warp_specialize_probe() -> dict | str:
    """Warp specialization (tl.range(..., warp_specialize=True)) of the TMA kernel, non-causal headline, in a child
    process: Triton's Hopper warp-specialization passes can abort the process (they did, with 4 warps, in 3.7.1)."""
    import subprocess
    try:
        run = subprocess.run([sys.executable, __file__, "--warp-specialize"], capture_output=True, text=True,
                             timeout=240)
    except subprocess.TimeoutExpired:
        return "timed out"
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    if run.returncode != 0:
        result["process"] = f"ended with exit {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
    return result


def warp_specialize_child() -> None:
    lab = load_lab()
    b, h, n, d = HEADLINE
    out = {}
    for warps in (8, 4):
        tiles = dict(BLOCK_M=128, BLOCK_N=128, num_warps=warps, num_stages=2)
        cands = {f"ws={ws} w{warps}": (lambda q, k, v, c, ws=ws, t=tiles: lab.hopper_attention(
            q, k, v, c, config=t, warp_specialize=ws)) for ws in (False, True)}
        result = measure(cands, b, h, n, d, False)
        out.update(result["tflops"])
        out.update({f"{k} failed": v for k, v in result["failed"].items()})
        for name in result["tflops"]:
            out[f"{name} check"] = check(lab, cands[name], b, h, n, d, False)
        print(json.dumps(out), flush=True)


def tiles_name(tiles, default) -> str:
    t = tiles or default
    text = f"{t['BLOCK_M']}x{t['BLOCK_N']} w{t.get('num_warps', 4)} s{t.get('num_stages', '-')}"
    return text + (" (default)" if tiles is None else "")


def print_tables(report) -> None:
    print("\n== lab 04 attention bench:", report["versions"])
    print(f"flash-attn-4: {report['flash_attn_4']}; Hopper TMA path: {report['hopper_path']}")
    for key, result in report["headline"].items():
        tf = result["tflops"]
        cudnn = tf.get("SDPA CUDNN_ATTENTION")
        print(f"\nheadline B4 H32 N4096 D128 bf16 {key} (TFLOP/s, ratio to SDPA CUDNN)")
        for name, value in sorted(tf.items(), key=lambda kv: -kv[1]):
            ok = report["checks"].get(f"headline {key} {name}", {})
            print(f"  {name:<44} {value:7.1f}  {value / cudnn if cudnn else float('nan'):5.2f}"
                  f"  {'ok' if ok.get('ok') else 'WRONG ' + str(ok)}")
        for name, why in result["failed"].items():
            print(f"  {name:<44} failed: {why}")
    print("\nshapes (TFLOP/s; * = fastest)")
    names = sorted({n for s in report["shapes"] for n in s["tflops"]})
    print(f"  {'shape':<26}" + "".join(f"{n.replace('SDPA ', '').replace('_ATTENTION', ''):>17}" for n in names))
    for s in report["shapes"]:
        best = max(s["tflops"], key=s["tflops"].get) if s["tflops"] else None
        cells = []
        for n in names:
            v = s["tflops"].get(n)
            ok = report["checks"].get(f"{s['shape']} {n}", {}).get("ok", True)
            cells.append(f"{'' if v is None else f'{v:.0f}'}{'*' if n == best else ''}{'' if ok else '!WRONG'}")
        print(f"  {s['shape']:<26}" + "".join(f"{c:>17}" for c in cells))
    bad = [k for k, v in report["checks"].items() if not v["ok"]]
    print(f"\nwarp specialization (TMA kernel, non-causal headline, TFLOP/s): {report.get('warp_specialize')}")
    print(f"\ncorrectness: {len(report['checks']) - len(bad)} of {len(report['checks'])} within tolerance"
          + ("" if not bad else "; WRONG: " + "; ".join(bad[:10])))
    print(f"total {time.time() - START:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:] == ["--warp-specialize"]:
        warp_specialize_child()
        sys.exit(0)
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)
