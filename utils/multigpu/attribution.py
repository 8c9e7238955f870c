"""Where a tensor-parallel decode step's time goes, from torch.profiler: collectives counted once, GPU time split into communication, compute and idle.

`torch.profiler` reports one collective twice when it records both CPU and GPU activity: once as the host-side
operation (`nccl:all_reduce`, `gloo:all_reduce`, ...), and once more as a *user annotation* of the same name on the
GPU's timeline, spanning the kernels the operation launched. Counting every event whose name looks like a
collective doubles the count (lab 06 once saw 128 all-reduces per token where the split runs 64). Here:

- **collectives run from the host** are counted from host events only (`device_type` CPU): the eager path;
- **collective kernels** are counted from GPU kernels only (never annotations): NCCL/RCCL's `ncclDevKernel_...`
  and the symmetric-memory one-shot kernel. A step replayed from a CUDA/HIP graph launches no host operation at
  all, so its collectives are visible only this way;
- **time** on a GPU is kernel time: communication kernels (which include waiting for the slower peer), every other
  kernel (compute), and the rest of the step's wall time, when the GPU ran nothing (launch gaps, host work).
  On a CPU (gloo), communication is the time gloo's operations took and compute is the rest.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

from utils.llm.decode import kernel_kind

HOST_PREFIXES = ("nccl:", "gloo:", "course::")   # host-side names: ProcessGroupNCCL (RCCL too), gloo, the course's op
# Communication kernels: NCCL's and RCCL's (ncclDevKernel_AllReduce_Sum_bf16_RING_LL, ...) and PyTorch's
# symmetric-memory kernels (c10d::symmetric_memory::one_shot_all_reduce_kernel<...>). A kernel torch.compile
# generated is named after the operations it fuses ("triton_poi_fused_add_one_shot_all_reduce_3"): never communication.
COMM_KERNEL_WORDS = ("nccl", "rccl", "symmetric_memory", "one_shot_all_reduce_kernel", "two_shot_all_reduce_kernel",
                     "one_shot_all_reduce_add_rms_norm_kernel")
TOP = 12   # the kernels that took the most time in a step, listed by name
_KINDS = (("reduce_scatter", ("reduce_scatter", "reducescatter")), ("all_reduce", ("all_reduce", "allreduce")),
          ("all_gather", ("all_gather", "allgather")), ("all_to_all", ("all_to_all", "alltoall")),
          ("broadcast", ("broadcast",)))


def _kind(low: str) -> str | None:
    for name, words in _KINDS:
        if any(w in low for w in words):
            return name
    return None


def collective_name(key: str) -> str | None:
    """The collective a host-side profiler event runs ("nccl:all_reduce" -> "all_reduce"); None for anything else."""
    low = key.lower()
    if not low.startswith(HOST_PREFIXES):
        return None
    if low.startswith("course::"):
        return _kind(low)
    return _kind(low) or low.split(":", 1)[1]


def is_comm_kernel(name: str) -> bool:
    low = name.lower()
    return not low.startswith("triton") and any(w in low for w in COMM_KERNEL_WORDS)


def collective_kernel(name: str) -> str | None:
    """The collective a GPU kernel belongs to ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL" -> "all_reduce", the
    symmetric-memory one-shot kernel -> "all_reduce"); None for a kernel that is not communication."""
    if not is_comm_kernel(name):
        return None
    return _kind(name.lower()) or "other communication"


def compute_kind(name: str) -> str:
    """A compute kernel's family: "matrix products" (cuBLAS/cuBLASLt/CUTLASS, hipBLASLt, or a kernel torch.compile
    wrote for a product, named after the `mm` it fuses: the weight reads), "attention", or "other" (norms, RoPE, the
    cache update, activations)."""
    if name.startswith("triton") and {"mm", "addmm", "bmm"} & set(name.split("_")):
        return "matrix products"
    kind = kernel_kind(name)
    return {"matmul (vendor library)": "matrix products", "attention": "attention"}.get(kind, "other")


def _device_time(e) -> float:
    t = getattr(e, "self_device_time_total", None)
    return t if t is not None else getattr(e, "self_cuda_time_total", 0) or 0


def _is_cpu(e) -> bool:
    from torch.autograd import DeviceType

    return getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU


def split(events, steps: int, wall_s: float, gpu: bool, step_ms: float | None = None) -> dict:
    """Per step, from `events` (torch.profiler's `key_averages()` rows, or anything with their fields: key, count,
    device_type, is_user_annotation, self_device_time_total, cpu_time_total) over `steps` steps taking `wall_s`:
    collectives from the host, collective kernels, kernel count, and ms of communication, compute and idle.
    `step_ms`, the step's time measured without the profiler, is the wall time to split when given (the
    profiler's own overhead would otherwise count as idle)."""
    host, kernels, by_kind, by_name = {}, {}, {}, {}
    comm = compute = 0.0
    launched = 0
    for e in events:
        if _is_cpu(e):
            name = collective_name(e.key)
            if name:
                host[name] = host.get(name, 0) + e.count / steps
                if not gpu:
                    comm += e.cpu_time_total
            continue
        if getattr(e, "is_user_annotation", False) or not gpu:   # an annotation spans kernels: never count it
            continue
        launched += e.count
        t = _device_time(e)
        calls, total = by_name.get(e.key, (0.0, 0.0))
        by_name[e.key] = (calls + e.count / steps, total + t / 1e3 / steps)
        name = collective_kernel(e.key)
        if name:
            kernels[name] = kernels.get(name, 0) + e.count / steps
            comm += t
        else:
            compute += t
            kind = compute_kind(e.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + t / 1e3 / steps
    wall_ms = step_ms if step_ms is not None else wall_s * 1e3 / steps
    comm_ms = comm / 1e3 / steps
    out = {"counts": host, "kernel_counts": kernels, "comm_ms": comm_ms, "wall_ms": wall_ms, "kernel_times": gpu}
    if gpu:
        out["compute_ms"] = compute / 1e3 / steps
        out["idle_ms"] = max(0.0, wall_ms - comm_ms - out["compute_ms"])
        out["kernels"] = launched / steps
        out["compute_by_kind"] = by_kind
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]
        out["top_kernels"] = [[name[:120], round(calls, 2), round(ms, 4)] for name, (calls, ms) in top]
    else:
        out["compute_ms"] = max(0.0, wall_ms - comm_ms)
    return out


@contextlib.contextmanager
def _native_stderr_quiet():
    """The profiler's own C++ log lines ("USDT: ... profiler_start") off the process's stderr for the block: in a
    notebook they land in the cell's output. Python's own stderr is untouched."""
    try:
        fd = sys.__stderr__.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def profile_step(step, steps: int, device, step_ms: float | None = None) -> dict:
    """Run `step` `steps` times under torch.profiler (CPU, and the GPU's kernels on a GPU) and `split` the result
    (with `step_ms`, the step's unprofiled time, as its wall time when given)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if gpu else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sync()
    t0 = time.perf_counter()
    with _native_stderr_quiet(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    wall = time.perf_counter() - t0
    return split(prof.key_averages(), steps, wall, gpu, step_ms)


# --- in the notebook: one row and one bar per variant --------------------------------------------------------

SEGMENTS = (("products at their ceiling", "tab:blue", None), ("products above it", "lightsteelblue", None),
            ("attention and other kernels", "tab:orange", None), ("communication", "tab:red", None),
            ("idle", "lightgray", None))


def segments(entry: dict, ceiling_ms: float | None) -> dict[str, float]:
    """A measured step (`utils.multigpu.tp.decode_rate` and `profile_step` results) as ms per segment of `SEGMENTS`;
    on a CPU (no kernel times) just compute and communication."""
    p = entry.get("profile") or {}
    if not p.get("kernel_times"):
        return {"compute": p.get("compute_ms", entry["step_ms"]), "communication": p.get("comm_ms", 0.0)}
    kinds = p.get("compute_by_kind", {})
    products = kinds.get("matrix products", 0.0)
    at_ceiling = min(products, ceiling_ms or 0.0)
    return {"products at their ceiling": at_ceiling, "products above it": products - at_ceiling,
            "attention and other kernels": p["compute_ms"] - products, "communication": p["comm_ms"],
            "idle": p.get("idle_ms", 0.0)}


def step_row(where: str, batch, name: str, entry: dict, ceiling_ms: float | None, baseline: float | None) -> list:
    """One row of lab 06's table of variants: tokens/s, ms per step (spread), kernels, the step's segments,
    and the ratio to `baseline` (tokens/s)."""
    if "tokens_per_s" not in entry:
        return [where, batch, name, "–", "–", "–", "not measured: " + (entry.get("skip") or entry.get("error", "?"))[:90],
                "–", "–", "–"]
    p = entry.get("profile") or {}
    seg = segments(entry, ceiling_ms)
    if p.get("kernel_times"):
        compute = (f"{seg['products at their ceiling'] + seg['products above it']:.2f} ({ceiling_ms:.2f}) + "
                   f"{seg['attention and other kernels']:.2f}")
    else:
        compute = f"{seg['compute']:.2f}"
    return [where, batch, name, f"{entry['tokens_per_s']:,.1f}", f"{entry['step_ms']:.2f} ({entry['spread']:.0%})",
            f"{p['kernels']:.0f}" if "kernels" in p else "–", compute, f"{p.get('comm_ms', 0):.2f}",
            f"{p['idle_ms']:.2f}" if "idle_ms" in p else "–",
            f"{entry['tokens_per_s'] / baseline:.2f}x" if baseline else "–"]


HEADER = ["where", "batch", "variant", "tokens/s", "ms per step (spread)", "kernels per step",
          "compute: products (their ceiling) + other, ms", "communication, ms", "idle, ms", "vs baseline"]


def plot_steps(bars: list[tuple[str, dict, float | None, str | None]], title: str):
    """One horizontal bar per measured step, split into its segments (ms); `bars`: (label, entry, ceiling ms, why
    unreliable or None). An unreliable step is drawn hollow, its reason in its label."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.5 * len(bars) + 1.6))
    used = set()
    for i, (label, entry, ceiling, why) in enumerate(bars):
        left = 0.0
        for name, ms in segments(entry, ceiling).items():
            color, hatch = next(((c, h) for n, c, h in SEGMENTS if n == name), ("tab:blue", None))
            ax.barh(i, ms, left=left, color="none" if why else color, edgecolor=color, hatch=hatch or ("xx" if why else None),
                    label=None if name in used else name)
            used.add(name)
            left += ms
        text = f" {entry['tokens_per_s']:,.0f} tok/s" + (f" (unreliable: {why})" if why else "")
        ax.text(left, i, text, va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.5 * len(bars) + 1.4) - 0.12),
              ncol=len(used), frameon=False)
    ax.margins(x=0.4)
    fig.tight_layout()
    return fig
