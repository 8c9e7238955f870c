"""Lab 03's FP32 ("ieee") matmuls against torch.matmul's own FP32 error, on an upstream-style grid of shapes: each
error is the largest |C - C64| over the largest |C64| (C64: the float64 product of the same inputs); the ratio is
the kernel's error over torch's. Run on a GPU: `python bench/lab03_fp32_error.py [out.json]`."""
import json
import sys

import torch

from utils import solutions

# Triton's matmul tests (python/test/unit, tutorials) and the skinny shapes of inference: M x N x K
SHAPES = [(1, 1, 16384), (1, 4096, 4096), (16, 4096, 4096), (17, 97, 16384), (64, 64, 65536), (107, 233, 83),
          (107, 233, 128), (128, 128, 64), (256, 256, 256), (384, 128, 640), (512, 512, 4096), (1024, 1024, 1024),
          (1000, 1000, 8192), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 1024)]


def rel_error(c: torch.Tensor, exact: torch.Tensor) -> float:
    return ((c.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-300)).item()


def main(out=None):
    lab = solutions.load("03")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in SHAPES:
        worst = {"torch": 0.0, "triton_matmul": 0.0, "persistent_matmul": 0.0}
        for _ in range(3):
            a = torch.randn(m, k, device="cuda", generator=gen)
            b = torch.randn(k, n, device="cuda", generator=gen)
            exact = a.double() @ b.double()
            results = {"torch": a @ b, "triton_matmul": lab.triton_matmul(a, b, input_precision="ieee"),
                       "persistent_matmul": lab.persistent_matmul(a, b, input_precision="ieee")}
            for name, c in results.items():
                worst[name] = max(worst[name], rel_error(c, exact))
        row = {"shape": [m, n, k], **worst,
               **{f"{name} / torch": worst[name] / worst["torch"] for name in ("triton_matmul", "persistent_matmul")}}
        rows.append(row)
        print(f"{m:>5} x {n:>5} x {k:>6}: torch {worst['torch']:.2e}  triton_matmul {worst['triton_matmul']:.2e} "
              f"({row['triton_matmul / torch']:.2f}x)  persistent_matmul {worst['persistent_matmul']:.2e} "
              f"({row['persistent_matmul / torch']:.2f}x)", flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "seeds": 3, "rows": rows}
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
