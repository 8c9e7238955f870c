"""Lab 06's tensor-parallel variant sweep: the hand-written split on one GPU and on N, each variant checked and timed.

    python3 bench/lab06_tp.py                         # llama-3.1-8b on every GPU, batch 1 and 16: ~6 min on 2 H100s
    python3 bench/lab06_tp.py --gpus 2 --batches 1 --no-lean --shape llama-3.2-1b
    python3 bench/lab06_tp.py --gpus 2,4 --one graph+tuned           # one GPU, then 2 and 4 ranks

One random-weight model (BF16, safetensors) is written once; then, for each GPU count (1 and N; batch 1, then the
largest of --batches in the same ranks), the course's launcher starts the ranks of `python -m utils.multigpu.tp` with a list of `Variant`s (eager; graph, i.e.
compiled with the whole step in one CUDA graph; separate or fused products; NCCL or the one-shot all-reduce over
symmetric memory; tuned kernels). Each variant's logits are checked against transformers' own Llama (one forward
pass), its decode timed (median of rounds), and its step split by torch.profiler into compute, communication and
idle time; the compute is set beside its own ceiling (this rank's weight bytes / its measured copy bandwidth).
Lab 05's lean decoder (one GPU, the whole step in one graph) is timed too: the baseline is the faster of it and the
split's best one-GPU variant, as lab 06 takes it. NVLink multicast stays off (`utils.multigpu.launch.NVLS_OFF`).

Prints one table last; writes $OUT/lab06_tp.json (partial results too, after every run) when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.multigpu import launch, tp  # noqa: E402  (launch: NVLS_OFF)

os.environ.update(launch.NVLS_OFF)
ONE = "eager,graph+unfused,graph,graph+tuned"
MANY = "eager,graph+unfused,graph,graph+symm,graph+symm+tuned,graph+arnorm,graph+arnorm+tuned"
LARGE_BATCH = "graph,graph+symm+tuned,graph+arnorm+tuned"


def lean_baseline(hf, tokens: list[int], n: int) -> dict:
    """Lab 05's lean decoder (`utils.llm.decode.LeanDecoder`, fused, compiled whole, one graph) on this GPU."""
    import torch

    from utils.llm import decode

    t0 = time.perf_counter()
    lean = decode.LeanDecoder.from_hf(hf, max_len=len(tokens) + n + 8).compile()
    rate = decode.rate(lean, torch.tensor([tokens], device=hf.device), n, warmup=2, rounds=5)
    out = {"tokens_per_s": rate.tokens_per_s, "seconds": time.perf_counter() - t0, "problem": rate.problem}
    del lean
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--gpus", default=None, help="ranks of the split, one count or several (2,4); default: every GPU")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed round")
    p.add_argument("--one", default=ONE, help="variants on one GPU")
    p.add_argument("--many", default=MANY, help="variants on N GPUs")
    p.add_argument("--large", default=LARGE_BATCH, help="variants at the larger batches")
    p.add_argument("--no-lean", action="store_true", help="skip lab 05's lean decoder")
    p.add_argument("--model-dir", default="/tmp/lab06-bench-model")
    p.add_argument("--budget-s", type=float, default=540, help="start no new run after this many seconds")
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    assert torch.cuda.is_available(), "this script needs a GPU"
    t_start = time.perf_counter()
    worlds = [int(g) for g in a.gpus.split(",")] if a.gpus else [torch.cuda.device_count()]
    gpus = max(worlds)
    dtype = torch.bfloat16
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    info = {"gpu": torch.cuda.get_device_name(0), "gpus": worlds, "torch": torch.__version__, "shape": a.shape,
            "tokens": a.tokens, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    cfg = tp.model_config(a.shape)
    tokens = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(6)).tolist()
    runs = []
    report = {"info": info, "runs": runs}

    def save():
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "lab06_tp.json").write_text(json.dumps(report, indent=1))

    t0 = time.perf_counter()
    if not (Path(a.model_dir) / "config.json").exists():
        tp.save_random_model(a.shape, a.model_dir, dtype=dtype, device="cuda")
    info["save_s"] = time.perf_counter() - t0
    hf = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype, device_map="cuda").eval()
    reference = tp.hf_reference_logits(hf, tokens)
    noise = tp.compare(reference, tp.hf_reference_logits(hf.float(), tokens))
    hf = hf.to(dtype)
    info["tolerance"] = tol = tp.tolerance(dtype, noise)
    if not a.no_lean:
        try:
            info["lean"] = lean_baseline(hf, tokens, a.tokens)
        except Exception as exc:  # noqa: BLE001 - reported; the split's own baseline still stands
            info["lean"] = {"error": f"{type(exc).__name__}: {exc}"}
    del hf
    tp.free("cuda")
    print(json.dumps(info), flush=True)
    save()

    one_large = tp.one_gpu_variants(a.large.split(","))     # no communication on one GPU
    batches = [int(b) for b in a.batches.split(",")]
    large = max(batches) if max(batches) > 1 else 0
    plan = [(1, a.one.split(","), one_large)] if a.one else []
    plan += [(world, a.many.split(","), a.large.split(",")) for world in worlds if world > 1]
    for world, variants, large_variants in plan:
        if time.perf_counter() - t_start > a.budget_s:
            runs.append({"world": world, "skipped": f"past the {a.budget_s:.0f} s budget"})
            continue
        t0 = time.perf_counter()
        result, run, failure = tp.launch_split(a.model_dir, tokens, nproc=world, decode=a.tokens, variants=variants,
                                               large_batch=large, large_variants=large_variants, timeout=480,
                                               variant_timeout=240, name=f"bench-{world}")
        entry = {"world": world, "result": result, "seconds": time.perf_counter() - t0}
        if failure:
            entry["error"] = f"{type(failure).__name__}: {failure}"
        for batch, variants_run in ((result or {}).get("hand") or {}).get("batches", {}).items():
            for name, v in variants_run.items():
                f = run.out_dir / f"hand-{name}-b{batch}-rank0.pt"
                if f.exists():
                    v["max_rel_err"] = tp.compare(torch.load(f), reference)
                    v["ok"] = v["max_rel_err"] <= tol
        runs.append(entry)
        save()
        print(f"{world} GPU(s): {entry['seconds']:.0f} s{' ' + entry['error'][:300] if 'error' in entry else ''}",
              flush=True)

    lean = info.get("lean", {}).get("tokens_per_s")
    base = {1: lean} if lean else {}
    rows = [["GPUs", "batch", "variant", "tok/s", "ms/step", "spread", "kernels", "compute (ceiling)", "comm", "idle",
             "AR kernels", "rel err", "vs base", "error"]]
    flat = []
    for r in runs:
        hand = ((r.get("result") or {}).get("hand") or {})
        ceiling = hand.get("weight_bytes", 0) / (hand.get("copy_gbps") or float("inf")) / 1e6
        for batch, variants_run in hand.get("batches", {}).items():
            flat.append({"world": r["world"], "batch": int(batch), "variants": variants_run, "ceiling": ceiling})
    for r in flat:
        ceiling = r["ceiling"]
        for name, v in r["variants"].items():
            if "tokens_per_s" not in v:
                rows.append([r["world"], r["batch"], name, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                             (v.get("error") or v.get("skip", ""))[:70]])
                continue
            if r["world"] == 1:
                base[r["batch"]] = max(base.get(r["batch"], 0), v["tokens_per_s"])
            pr = v.get("profile", {})
            rows.append([r["world"], r["batch"], name, f"{v['tokens_per_s']:.1f}", f"{v['step_ms']:.3f}",
                         f"{v['spread']:.1%}", f"{pr.get('kernels', 0):.0f}",
                         f"{pr.get('compute_ms', 0):.2f} ({ceiling:.2f})", f"{pr.get('comm_ms', 0):.2f}",
                         f"{pr.get('idle_ms', 0):.2f}", f"{pr.get('kernel_counts', {}).get('all_reduce', 0):g}",
                         f"{v.get('max_rel_err', float('nan')):.1e}" + ("" if v.get("ok", True) else " FAIL"),
                         f"{v['tokens_per_s'] / base[r['batch']]:.2f}x" if base.get(r["batch"]) else "-", ""])
    if lean:
        print(f"lab 05's lean decoder, one GPU, batch 1: {lean:.1f} tokens/s")
    info["baseline_tokens_per_s"] = base
    save()
    for r in flat:     # where the best variant of each run spends its compute
        variants = r["variants"]
        timed = {n: v for n, v in variants.items() if "tokens_per_s" in v and "top_kernels" in v.get("profile", {})}
        if timed:
            name = max(timed, key=lambda n: timed[n]["tokens_per_s"])
            pr = timed[name]["profile"]
            print(f"{r['world']} GPU(s), batch {r['batch']}, {name}: compute by kind (ms/step) "
                  + ", ".join(f"{k} {v:.3f}" for k, v in pr.get("compute_by_kind", {}).items()))
            for kname, calls, ms in pr["top_kernels"]:
                print(f"    {ms * 1e3:8.1f} us  x{calls:<6g} {kname[:100]}")
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
