"""Lab 08's public `q4_gemv` on an upstream-style grid (llama.cpp's test-backend-ops MUL_MAT cases with one column of
B: rows x K, Q4_0 and Q4_1), on a GPU: each case against the float64 product of gguf's dequantized weights with the
quantized x (the kernel's own contract, to 1e-5 of the largest |y|: stricter than llama.cpp's test, which compares
each backend with its CPU backend, quantizing x to Q8 the same way, within an NMSE of 5e-4, an NMSE this bound keeps
below 1.5e-6 at these sizes); x is never written; a NaN or inf where
the contract's result is finite is a failure. The NMSE against the unquantized x (what x's rounding costs) is printed,
not judged.
Any failure is printed with its case; the exit status is the number of failed cases (0: none).

    python3 bench/lab08_q4_grid.py [out.json]         # from the repository root; about a minute on an H100
    python3 bench/lab08_q4_grid.py --small            # a few cases, for a CPU (Triton's interpreter)"""
import itertools
import json
import os
import sys

import numpy as np
import torch

from utils import blocks, solutions
from utils.machinery import executed   # the commit a run came from ($COURSE_COMMIT on the GPU machine)

# test-backend-ops' MUL_MAT shapes with n = 1 (m = rows of W, k), its small cases and its Llama-sized ones
ROWS = (1, 16, 17, 31, 64, 257, 4096, 14336)
KS = (32, 256, 288, 4096, 14336)
X_KINDS = ("randn", "zeros", "outlier", "tiny")


def x_of(kind: str, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(k, generator=gen)
    if kind == "zeros":
        x[: k // 2] = 0                                   # whole blocks of zeros: scale 0
    elif kind == "outlier":
        x[k // 3] = 1e4                                   # one block's scale set by one value
    elif kind == "tiny":
        x *= 1e-30                                        # scales near float32's smallest normals
    return x


def main(argv):
    small = "--small" in argv
    out = next((a for a in argv if not a.startswith("--")), None)
    if small:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    lab = solutions.load("08")
    dev = "cuda" if torch.cuda.is_available() and not small else "cpu"
    rows, ks = ((1, 17), (32, 288)) if small else (ROWS, KS)
    gen = torch.Generator().manual_seed(0)
    cases, failures, worst = 0, [], {"contract": 0.0, "x rounding nmse": 0.0}
    for qtype, n, k, x_kind in itertools.product(("Q4_0", "Q4_1"), rows, ks, X_KINDS if not small else X_KINDS[:2]):
        if n * k > 4096 * 14336 or (n > 4096 and k > 4096):
            continue                                      # the largest pairs: one of them is enough
        data = blocks.random_blocks(qtype, n * k // 32, seed=cases, awkward=True).reshape(n, -1)
        x = x_of(x_kind, k, gen)
        q, dx = blocks.quantize_q8_rows(x)
        w64 = torch.from_numpy(blocks.dequantize(data, qtype)).double()
        contract = w64 @ torch.from_numpy(q.astype(np.float64) * dx.astype(np.float64)[:, None]).reshape(-1)
        scale = contract.abs().max().item() or 1.0
        contract_finite = bool(torch.isfinite(contract).all())
        exact = w64 @ x.double() if x_kind == "randn" and n >= 16 else None   # x's rounding, over enough rows
        x_dev, w_dev = x.to(dev), torch.from_numpy(data).to(dev)
        x_before = x_dev.clone()
        for per_step, programs in ((lab.BLOCKS, None), (1, 3), (4, None)):
            cases += 1
            what = f"{qtype} {n}x{k} x={x_kind} blocks_per_step={per_step} programs={programs}"
            try:
                y = lab.q4_gemv(w_dev, x_dev, qtype=qtype, blocks_per_step=per_step, programs=programs).double().cpu()
            except Exception as err:                      # a crash is a failure with its case, not a traceback
                failures.append(f"{what}: raised {type(err).__name__}: {err}")
                continue
            err = (y - contract).abs().max().item() / scale
            finite = bool(torch.isfinite(y).all()) or not contract_finite
            if exact is not None:
                worst["x rounding nmse"] = max(worst["x rounding nmse"], (((y - exact) ** 2).sum() / (exact ** 2).sum()).item())
            worst["contract"] = max(worst["contract"], err)
            problems = [p for p, bad in (("not finite", not finite), (f"error {err:.2e} > 1e-5 of the contract", err > 1e-5),
                                         ("x was written", not torch.equal(x_dev, x_before))) if bad]
            if problems:
                failures.append(f"{what}: {'; '.join(problems)}")
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton's interpreter)"
    print(f"{name}: {cases} cases, {len(failures)} failed; largest error against the contract {worst['contract']:.2e} "
          f"(limit 1e-5); x's rounding: NMSE against the unquantized x up to {worst['x rounding nmse']:.2e} (not judged)")
    for line in failures:
        print("FAIL:", line)
    if out:
        with open(out, "w") as f:
            json.dump({"device": name, "commit": executed.commit(), "torch": torch.__version__, "cases": cases,
                       "failures": failures, **worst}, f, indent=1)
    return len(failures)


if __name__ == "__main__":
    sys.exit(min(main(sys.argv[1:]), 255))
