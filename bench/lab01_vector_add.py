"""Lab 01 on a GPU: the hand-written CUDA/HIP kernels and the Triton kernels against torch.add.

    python3 bench/lab01_vector_add.py          # about 2 minutes (of which ~40-60 s build the CUDA kernels)

1. 256M float32 elements (1 GiB per tensor), contiguous: torch.add, triton_add (add_kernel), the hand-written
   one-float-per-thread and float4 kernels. Target: triton_add >= 0.97x torch.add.
2. A real layout: q + residual where q is the (16384, 4096) slice of a fused (16384, 3*4096) projection:
   torch.add on contiguous tensors of that size (the base), torch.add(q, r), triton_add(q, r) (add_strided_kernel),
   triton_add(q.contiguous(), r), triton_add_rows(q, r) (exercise 1.4's reference), the float4 kernel through its
   binding (contiguous copies). Target of exercise 1.4: triton_add_rows >= 0.9x the base.
Each figure is the median of 5 interleaved rounds (utils.timing.interleaved), every kernel checked first.
The kernels come from solutions/01_vector_add.ipynb (its cells tagged `export`, solution regions filled).
Prints a compact table last; writes the details to $OUT/lab01_vector_add.json when OUT is set.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils import timing  # noqa: E402
from utils.graders import lab01 as graders  # noqa: E402


def load_lab():
    """The lab's exported module: through utils.solutions when nbformat is there, else read from the
    notebook's JSON directly (the solution regions are comments, so the cells run as they are)."""
    try:
        from utils import solutions
        return solutions.load("01")
    except ImportError:
        nb = json.loads((ROOT / "solutions" / "01_vector_add.ipynb").read_text())
        cells = ["".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "code" and "export" in c.get("metadata", {}).get("tags", [])]
        path = Path(tempfile.mkdtemp()) / "lab01_export.py"
        path.write_text("\n\n\n".join(cells) + "\n")
        spec = importlib.util.spec_from_file_location("lab01_export", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["lab01_export"] = module
        spec.loader.exec_module(module)
        return module


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: needs a CUDA or ROCm GPU")
        return 0
    t0 = time.time()
    lab = load_lab()
    print(f"building the hand-written kernels with load_inline ...", flush=True)
    hand = lab.build_hand_kernels()
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    for name, fn, block in [("triton_add", lab.triton_add, 1024), ("add_naive", hand.add_naive, 256),
                            ("add_vec4", hand.add_vec4, 256)]:
        graders.check_add(name, fn, block=block, sizes=(1, 4099, 2**20 + 3), device="cuda")
        graders.check_layouts(name, fn, device="cuda", n=4099, names={"x[::2]", "out[::2]", "x.T (2-D)"})
    graders.check_rows("triton_add_rows", lab.triton_add_rows, device="cuda")

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "rounds": 5}
    # 1. contiguous, 256M float32
    n = 256 * 2**20
    x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
    ways = {"torch.add": lambda: torch.add(x, y, out=out), "triton_add": lambda: lab.triton_add(x, y, out),
            "hand naive": lambda: hand.add_naive(x, y, out), "hand float4": lambda: hand.add_vec4(x, y, out)}
    ms = timing.interleaved(ways, rounds=5, rep_ms=200, warmup_ms=1000)
    contiguous = {k: {"ms": v, "gbps": 3 * n * 4 / v / 1e6, "over_torch": ms["torch.add"] / v} for k, v in ms.items()}
    results["contiguous_256M_fp32"] = contiguous
    del x, y, out
    torch.cuda.empty_cache()

    # 2. the q slice of a fused projection
    rows, e = 16384, 4096
    qkv = torch.randn(rows, 3 * e, device="cuda")
    q, r = qkv[:, :e], torch.randn(rows, e, device="cuda")
    a, b, o = torch.randn_like(r), torch.randn_like(r), torch.empty_like(r)
    ways = {"torch.add contiguous (base)": lambda: torch.add(a, b, out=o),
            "torch.add(q, r)": lambda: torch.add(q, r, out=o),
            "triton_add(q, r) strided": lambda: lab.triton_add(q, r, o),
            "triton_add(q.contiguous(), r)": lambda: lab.triton_add(q.contiguous(), r, o),
            "triton_add_rows(q, r)": lambda: lab.triton_add_rows(q, r, o),
            "hand float4 (binding copies q)": lambda: hand.add_vec4(q, r, o)}
    ms = timing.interleaved(ways, rounds=5, rep_ms=200, warmup_ms=500)
    base = ms["torch.add contiguous (base)"]
    layout = {k: {"ms": v, "gbps": 3 * rows * e * 4 / v / 1e6, "over_base": base / v} for k, v in ms.items()}
    results["q_slice_16384x4096_fp32"] = layout

    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "lab01_vector_add.json").write_text(json.dumps(results, indent=2))
    print(f"\n{results['device']}, torch {results['torch']}, triton {results['triton']}, "
          f"median of 5 interleaved rounds, {time.time() - t0:.0f} s in all")
    print(f"{'256M float32, contiguous':<34} {'GB/s':>8} {'/ torch.add':>12}")
    for k, v in contiguous.items():
        print(f"{k:<34} {v['gbps']:>8,.0f} {v['over_torch']:>12.3f}" + ("   (target >= 0.97)" if k == "triton_add" else ""))
    print(f"{'q (16384 x 4096 of 3*4096) + r':<34} {'GB/s':>8} {'/ base':>12}")
    for k, v in layout.items():
        print(f"{k:<34} {v['gbps']:>8,.0f} {v['over_base']:>12.3f}"
              + ("   (exercise 1.4 target >= 0.9)" if k == "triton_add_rows(q, r)" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
