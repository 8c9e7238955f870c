"""Lab 05, exercise 5.5 on a GPU: decode attention over a paged KV cache, timed the way the lab times it.

    python3 bench/lab05_paged.py            # ~1 minute on an H100; needs torch with CUDA or ROCm

Loads the lab's exported cells (make_paged_cache, paged_attention_loop, the course's paged_attention) straight from
solutions/05_llm_serving.ipynb (plain json, no nbformat needed), checks the course's answer against the loop on the
GPU in BF16, then times both with utils.timing.interleaved on Llama-3.1-8B heads (32 query, 8 KV heads of 128),
blocks of 16, for 8 and 64 sequences of seeded random lengths up to 1024 and 4096 tokens. Prints a table last:
ms, GB/s of KV cache read, fraction of a large copy's bandwidth measured in the same run, and which SDPA kernel
PyTorch picks for the masked GQA call. Writes $OUT/lab05_paged.json when OUT is set.
"""
import json
import os
import re
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def exported(notebook: Path) -> types.ModuleType:
    """The notebook's cells tagged `export`, executed as one module (what utils.solutions.load does)."""
    nb = json.loads(notebook.read_text())
    source = "\n\n".join("".join(c["source"]) for c in nb["cells"]
                         if c["cell_type"] == "code" and "export" in c.get("metadata", {}).get("tags", []))
    source = re.sub(r"(?m)^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", source)
    module = types.ModuleType("lab05_exported")
    exec(compile(source, str(notebook), "exec"), module.__dict__)
    return module


def main():
    import torch

    from utils import timing

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA or ROCm GPU")
    started = time.perf_counter()
    lab = exported(ROOT / "solutions" / "05_llm_serving.ipynb")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()

    src = torch.empty(1 << 28, dtype=torch.float32, device=dev).fill_(1.0)     # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = timing.interleaved({"copy": lambda: dst.copy_(src)}, rounds=3)["copy"]
    bandwidth = 2 * src.numel() * 4 / (copy_ms * 1e-3) / 1e9
    del src, dst

    rows = []
    for batch, max_len in ((8, 1024), (64, 1024), (8, 4096), (64, 4096)):
        lengths = torch.randint(1, max_len + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()
        inputs = lab.make_paged_cache(lengths, q_heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=dev)
        err = (lab.paged_attention(*inputs).float() - lab.paged_attention_loop(*inputs).float()).abs().max().item()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            lab.paged_attention(*inputs)
            torch.cuda.synchronize()
        kernels = sorted({e.name for e in prof.events() if "attention" in e.name.lower() or "fmha" in e.name.lower()
                          or "flash" in e.name.lower() or "softmax" in e.name.lower()})
        nbytes = lab.kv_bytes_read(inputs[1], inputs[4])
        times = timing.interleaved({"course": lambda: lab.paged_attention(*inputs),
                                    "loop": lambda: lab.paged_attention_loop(*inputs)}, rounds=3)
        for what, ms in times.items():
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"batch": batch, "max_len": max_len, "tokens": int(sum(lengths)), "what": what, "ms": ms,
                         "kv_gbps": gbps, "of_copy": gbps / bandwidth, "max_abs_err_vs_loop": err,
                         "sdpa_kernels": kernels[:4]})
    result = {"device": name, "torch": torch.__version__, "copy_gbps": bandwidth, "rows": rows,
              "seconds": time.perf_counter() - started}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab05_paged.json").write_text(json.dumps(result, indent=1))
    print(f"{name}, torch {torch.__version__}; copy {bandwidth:,.0f} GB/s; {result['seconds']:.0f} s")
    print(f"{'B':>3} {'max':>5} {'what':>7} {'ms':>8} {'KV GB/s':>8} {'of copy':>7} {'err':>8}  SDPA kernels")
    for r in rows:
        print(f"{r['batch']:>3} {r['max_len']:>5} {r['what']:>7} {r['ms']:8.3f} {r['kv_gbps']:8.1f} {r['of_copy']:7.3f} "
              f"{r['max_abs_err_vs_loop']:8.1e}  {', '.join(k[:40] for k in r['sdpa_kernels']) if r['what'] == 'course' else ''}")


if __name__ == "__main__":
    main()
