"""Lab 06 on ONE GPU: the hand-written tensor-parallel step, checked and timed before the 2-GPU run (issue 22).

    python3 bench/lab06_gpu.py                      # llama-3.1-8b, 128 tokens: about 3 minutes on an H100
    python3 bench/lab06_gpu.py --shape llama-3.2-1b # about 1.5 minutes

On one GPU it answers what the 2-GPU run depends on:
1. `utils.multigpu.tp.TPLlama` (world 1) against transformers' Llama: BF16 logits within `tp.tolerance` (raised to 3x the
   measured BF16-vs-FP32 noise of transformers itself), eager and "graph" (torch.compile, then the whole step in
   one CUDA graph); tokens/s and the seconds compile + capture took.
2. The same step with its all-reduces and the logits' all-gather forced through NCCL on a one-rank process group
   (NVLink multicast off): that torch.compile traces the functional collectives and a CUDA graph captures them,
   with the NCCL watchdog running; torch.profiler's split (NCCL kernels vs the rest) and the collective counts.
3. transformers' generate, eager, on one GPU (the baseline of issue 17).
Prints a compact table last; writes $OUT/lab06_gpu.json when OUT is set. Needs only torch, transformers and
safetensors (the GPU machine has them); the random model is written to /tmp (16 GB for the 8B shape).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.base.paths import private_dir  # noqa: E402
from utils.llm import models  # noqa: E402
from utils.multigpu import launch, tp  # noqa: E402

os.environ.update(launch.NVLS_OFF)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=list(models.SHAPES))
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode measurement")
    p.add_argument("--model-dir", default="/tmp/lab06-bench-model")
    a = p.parse_args()
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    assert torch.cuda.is_available(), "this script needs a GPU"
    dev, dtype = torch.device("cuda", 0), torch.bfloat16
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": a.shape, "tokens": a.tokens}
    rows, results = [], {}
    tokens = torch.randint(0, models.llama_config(a.shape).vocab_size, (16,),
                           generator=torch.Generator().manual_seed(6)).tolist()

    _, info["save_s"] = timed(lambda: tp.save_random_model(a.shape, a.model_dir, dtype=dtype, device="cuda"))
    hf = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype).to(dev).eval()
    reference = tp.hf_reference_logits(hf, tokens)
    prompt = torch.tensor([tokens], device=dev)
    results["hf eager"] = {"tokens_per_s": models.decode_tokens_per_s(hf, prompt, a.tokens, warmup=1)}
    noise = tp.compare(reference, tp.hf_reference_logits(hf.float(), tokens))
    info["bf16_noise"], info["tolerance"] = noise, tp.tolerance(dtype, noise)
    del hf
    tp.free(dev)

    model = tp.TPLlama(a.model_dir, device=dev, dtype=dtype, max_len=tp.max_len_for(tokens, a.tokens))
    store_dir = private_dir(launch.build_root() / "bench-store")   # a file store: no TCP store on every interface
    for comm in ("none", "nccl"):
        if comm == "nccl":
            dist.init_process_group("nccl", store=dist.FileStore(str(store_dir / f"store-{os.getpid()}"), 1),
                                    rank=0, world_size=1, device_id=dev)
            model.comm = tp.Collectives(dist.group.WORLD)
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        for mode in ("eager", "graph"):
            name = f"by hand, {mode}, collectives: {comm}"
            entry = results[name] = {}
            try:
                model.reset(0)
                step, entry["make_step_s"] = timed(lambda: tp.make_step(model, mode))
                logits = tp.teacher_forced_logits(model, step, tokens)
                entry["max_rel_err"] = tp.compare(logits, reference)
                entry["ok"] = entry["max_rel_err"] <= info["tolerance"]
                entry["tokens_per_s"] = tp.tokens_per_s(model, step, a.tokens, start=len(tokens))
                model.reset(len(tokens))
                entry["profile"] = tp.profile_split(step, 8, dev)
            except Exception as exc:  # noqa: BLE001 - reported in the table, the rest still runs
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()[-3000:]
            torch._dynamo.reset()
            tp.free(dev)
    if dist.is_initialized():
        dist.destroy_process_group()

    for name, e in results.items():
        prof = e.get("profile", {})
        rows.append([name, f"{e['tokens_per_s']:.1f}" if "tokens_per_s" in e else "-",
                     f"{1e3 / e['tokens_per_s']:.2f}" if "tokens_per_s" in e else "-",
                     f"{e['max_rel_err']:.1e}" + ("" if e.get("ok") else " FAIL") if "max_rel_err" in e else "-",
                     f"{e['make_step_s']:.0f}" if "make_step_s" in e else "-",
                     f"{prof.get('compute_ms', 0):.2f}/{prof.get('comm_ms', 0):.2f}" if "compute_ms" in prof else "-",
                     json.dumps(prof.get("counts")) if prof else "-", e.get("error", "")[:120]])
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "lab06_gpu.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    print(json.dumps(info))
    header = ["path", "tok/s", "ms/tok", "max rel err", "make_step s", "compute/comm ms", "collectives/token", "error"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0 if all(e.get("ok") for e in results.values() if "max_rel_err" in e) else 1


if __name__ == "__main__":
    raise SystemExit(main())
