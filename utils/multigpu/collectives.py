"""Collectives measured the way nccl-tests does: time per operation, algorithm and bus bandwidth, checked results.

Formulas (nccl-tests, doc/PERFORMANCE.md): `algbw = S / t`, `busbw = algbw * factor`, where S is the
size of the whole buffer (all_gather: the gathered output; reduce_scatter: the input; all_to_all: one
rank's buffer) and the factor makes busbw comparable with the link's peak whatever the rank count n:
all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast 1.

The measurement runs on every rank (`python -m utils.multigpu.collectives ...`), started by the course's
launcher on one machine or by torchrun on several (`utils.multigpu.launch`): per size, one checked call,
`warmup` calls, then `iters` calls timed by the host clock between two device synchronisations, averaged
over the ranks, as nccl-tests does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# The file store through which the ranks of one machine meet (set by `utils.multigpu.launch.start_ranks`);
# without it, `init` joins the group torchrun set up (env://, its TCP store).
RENDEZVOUS_FILE_VAR = "COURSE_RENDEZVOUS_FILE"


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `collective` on `n` ranks."""
    if n < 1:
        raise ValueError(f"n={n} ranks: must be at least 1")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def algbw_gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def busbw_gbps(collective: str, nbytes: float, seconds: float, n: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(collective, n)


def element_count(collective: str, nbytes: int, n: int, element_size: int = 4) -> int:
    """Elements of the whole buffer for a size of `nbytes`: rounded down to a multiple of n where the
    buffer is split among the ranks (at least n, or 1), as nccl-tests does."""
    count = max(1, nbytes // element_size)
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(n, count // n * n)
    return count


def half_bandwidth_bytes(latency_s: float, busbw_gbps: float, collective: str, n: int, *,
                         factor=bus_factor) -> float:
    """Message size at which a collective reaches half of `busbw_gbps` if t(S) = latency + S*factor/busbw;
    `factor(collective, n)` is busbw / algbw (lab 06 passes the learner's, exercise 6.1)."""
    return latency_s * busbw_gbps * 1e9 / factor(collective, n)


# --- on every rank -----------------------------------------------------------------------------------

def _ops(torch, dist):
    """The five collectives over torch.distributed, with the newer names where this torch has them."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {"all_reduce": lambda out, inp: dist.all_reduce(inp),
            "all_gather": lambda out, inp: gather(out, inp),
            "reduce_scatter": lambda out, inp: scatter(out, inp),
            "all_to_all": lambda out, inp: dist.all_to_all_single(out, inp),
            "broadcast": lambda out, inp: dist.broadcast(inp, 0)}


def _buffers(torch, collective: str, count: int, n: int, rank: int, device):
    """(output, input, expected output) for one checked call; output is None for in-place ones."""
    f32 = dict(dtype=torch.float32, device=device)
    part = count // n
    if collective == "all_reduce":
        return None, torch.full((count,), float(rank + 1), **f32), torch.full((count,), n * (n + 1) / 2, **f32)
    if collective == "all_gather":
        expected = torch.arange(n, **f32).repeat_interleave(part)
        return torch.empty(count, **f32), torch.full((part,), float(rank), **f32), expected
    if collective == "reduce_scatter":
        return torch.empty(part, **f32), torch.full((count,), float(rank + 1), **f32), torch.full((part,), n * (n + 1) / 2, **f32)
    if collective == "all_to_all":
        inp = (rank * n + torch.arange(n, **f32)).repeat_interleave(part)          # chunk j goes to rank j
        expected = (torch.arange(n, **f32) * n + rank).repeat_interleave(part)     # chunk i came from rank i
        return torch.empty(count, **f32), inp, expected
    if collective == "broadcast":
        return None, torch.full((count,), 7.0 if rank == 0 else 0.0, **f32), torch.full((count,), 7.0, **f32)
    raise ValueError(collective)


def measure(collective: str, nbytes: int, *, iters: int, warmup: int, device) -> dict:
    """Time one collective at one size on this rank's group (every rank calls it); returns a row."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    op = _ops(torch, dist)[collective]
    count = element_count(collective, nbytes, n)
    out, inp, expected = _buffers(torch, collective, count, n, rank, device)
    op(out, inp)                                                  # the checked call
    got = inp if out is None else out
    wrong = torch.tensor([float((got != expected).sum().item())], dtype=torch.float64, device=device)
    inp.zero_()                                                   # timed calls on zeros: sums stay finite
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        op(out, inp)
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        op(out, inp)
    sync()
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds)                                      # averaged over the ranks, as nccl-tests
    dist.all_reduce(wrong)
    t = seconds.item() / n
    size = count * 4
    return {"collective": collective, "bytes": size, "time_s": t, "algbw_gbps": algbw_gbps(size, t),
            "busbw_gbps": busbw_gbps(collective, size, t, n), "wrong": int(wrong.item())}


def init(backend: str | None = None, timeout_s: float = 600.0):
    """Join the ranks' process group (NCCL/RCCL on GPUs, gloo on CPUs); returns the device.

    Through the file store named by RENDEZVOUS_FILE_VAR when the course's launcher started the ranks on one
    machine (no socket: torch's TCP store would listen on every interface), else through the env://
    rendezvous torchrun set up (MASTER_ADDR, MASTER_PORT), as on a cluster.

    The group's timeout is long on purpose: a rank may wait in a collective while its peer still compiles
    (torch.compile of an 8B model takes a minute or more); the launcher's own limit ends a hang sooner."""
    import datetime

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
    gpu = torch.cuda.is_available() and backend != "gloo"
    if gpu:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        how = {"timeout": datetime.timedelta(seconds=timeout_s)}
        store_file = os.environ.get(RENDEZVOUS_FILE_VAR)
        if store_file:
            world = int(os.environ["WORLD_SIZE"])
            how.update(store=dist.FileStore(store_file, world), rank=int(os.environ["RANK"]), world_size=world)
        dist.init_process_group(backend or ("nccl" if gpu else "gloo"), **how)
    return device


def library_version() -> str:
    """"NCCL 2.28.9" / "RCCL 2.22.3" (ROCm's PyTorch reports RCCL's version through the same call), or gloo."""
    import torch

    if not torch.cuda.is_available():
        return "gloo"
    try:
        v = torch.cuda.nccl.version()
        v = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:   # noqa: BLE001 - a build without NCCL
        return "unknown"
    return f"{'RCCL' if torch.version.hip else 'NCCL'} {v}"


def _record(fn):
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return fn
    return record(fn)


def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s]


@_record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m utils.multigpu.collectives", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, required=True, help="bytes, comma-separated")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--latency-iters", type=int, default=100, help="all_reduce of 8 bytes")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank raises after joining (a demo)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    device = init(a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    if a.fail_rank == rank:
        raise ValueError(f"rank {rank} fails on purpose (--fail-rank {rank}); the others are ended")
    rows = []
    for collective in a.collectives.split(","):
        for nbytes in a.sizes:
            rows.append(measure(collective, nbytes, iters=a.iters, warmup=a.warmup, device=device))
    latency = measure("all_reduce", 8, iters=a.latency_iters, warmup=a.warmup, device=device)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        result = {"backend": dist.get_backend(), "library": library_version(), "world": n, "device": name,
                  "nodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)), "rows": rows,
                  "latency_8b_s": latency["time_s"], "torch": torch.__version__}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "result.json").write_text(json.dumps(result, indent=1))
        print(f"rank 0 of {n} ({result['backend']}, {result['library']}): {len(rows)} measurements, "
              f"all_reduce of 8 bytes {latency['time_s'] * 1e6:.1f} us", flush=True)
    dist.destroy_process_group()
    return 0


# --- in the notebook -----------------------------------------------------------------------------------

def plot(rows: list[dict], *, n: int, peak_gbps: float | None = None, peak_label: str = "", title: str = ""):
    """Time and bus bandwidth against message size, log-log, one line per collective, the link's peak."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for collective in dict.fromkeys(r["collective"] for r in rows):
        mine = sorted((r for r in rows if r["collective"] == collective), key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in mine]
        ax_t.plot(sizes, [r["time_s"] * 1e6 for r in mine], marker="o", ms=3, label=collective)
        ax_b.plot(sizes, [r["busbw_gbps"] for r in mine], marker="o", ms=3, label=collective)
    if peak_gbps:
        ax_b.axhline(peak_gbps, color="k", ls="--", lw=1)
        ax_b.text(ax_b.get_xlim()[0], peak_gbps, f" {peak_label or 'link peak'}: {peak_gbps:,.0f} GB/s",
                  va="bottom", fontsize=8)
    for ax, label in ((ax_t, "time per operation (us)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_title("flat: latency-bound; rising: bandwidth-bound", fontsize=9)
    ax_b.set_title(f"busbw = algbw x factor(n={n})", fontsize=9)
    ax_b.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def row_at(rows: list[dict], collective: str, nbytes: int) -> dict | None:
    """The measured row of `collective` whose size is `nbytes` (after rounding to the rank count)."""
    mine = [r for r in rows if r["collective"] == collective]
    best = min(mine, key=lambda r: abs(math.log(r["bytes"] / nbytes)), default=None)
    return best if best and abs(math.log(best["bytes"] / nbytes)) < 0.01 else None


if __name__ == "__main__":
    raise SystemExit(main())
