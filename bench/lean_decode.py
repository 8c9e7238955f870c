#!/usr/bin/env python3
"""Batch-1 decode of a random-weight Llama-3.1-8B shape (BF16) on one GPU, against the bandwidth ceiling.

    python3 bench/lean_decode.py            # ~5 min on an H100: 5 compiles of 40-60 s (4 lean variants, generate)
    python3 bench/lean_decode.py --variants fused,fused-cdt --skip generate-static    # ~3 min
    python3 bench/lean_decode.py --variants fused-grouped-cdt,unfused-cdt,fused-max-autotune --skip generate-eager,generate-static,serve
    python3 bench/lean_decode.py --smoke    # the same logic on a CPU with a tiny model (~2 min on 2 busy cores)

What it does, in order, each phase timed and guarded (a failing phase prints its error, the rest runs):
1. the model of lab 05 without SmolLM2: a byte-level BPE tokenizer trained on the course's own text
   (models.train_tokenizer, ~8k tokens) and models.random_llama("llama-3.1-8b") in BF16 on the GPU;
2. the ceiling: copy bandwidth of 1 GiB (as lab 05 measures it) / models.weight_bytes(model);
3. transformers' eager greedy `generate` (dynamic cache): the reference tokens and logits for the
   first CHECK steps, and its decode rate;
4. utils.llm.decode.LeanDecoder variants (fused or not, attention kind, compile options): compile time,
   tokens against the reference, decode rate (prefill removed), a kernel profile of one step;
5. `generate(cache_implementation="static")` (transformers compiles the forward): rate and profile;
6. transformers' continuous batching at concurrency 1 (the engine of `transformers serve`): the
   host phases of one step and its kernels.
Prints a table of tokens/s and fraction of the ceiling last; writes everything to $OUT/lean_decode.json
when OUT is set. Needs torch, transformers and a CUDA (or ROCm) GPU; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# torch.compile sets these when CUDA graphs are first used; profiling before and after that (as this
# script does) can crash CUPTI's re-initialisation, so set them before anything is profiled.
os.environ.setdefault("TEARDOWN_CUPTI", "0")
os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
sys.path.insert(0, str(ROOT))

VARIANTS = {
    # name: (LeanDecoder.from_hf options, compile mode, extra inductor options)
    "unfused": (dict(fuse=False, attention="sdpa"), "reduce-overhead", {}),
    "fused": (dict(fuse=True, attention="sdpa"), "reduce-overhead", {}),
    "fused-cdt": (dict(fuse=True, attention="sdpa"), "reduce-overhead", dict(coordinate_descent_tuning=True)),
    "fused-grouped": (dict(fuse=True, attention="grouped"), "reduce-overhead", {}),
    "fused-grouped-cdt": (dict(fuse=True, attention="grouped"), "reduce-overhead",
                          dict(coordinate_descent_tuning=True)),
    "fused-max-autotune": (dict(fuse=True, attention="sdpa"), "max-autotune", {}),
    "unfused-cdt": (dict(fuse=False, attention="sdpa"), "reduce-overhead", dict(coordinate_descent_tuning=True)),
}
DEFAULT_VARIANTS = "unfused,fused,fused-cdt,fused-grouped"
PHASES = ("generate-eager", "lean-eager", "generate-static", "profile", "serve")

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per timed run (default 256)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--check", type=int, default=32, help="steps compared with generate (default 32)")
    ap.add_argument("--profile-tokens", type=int, default=17, help="tokens per profiled run (default 17)")
    ap.add_argument("--skip", default="lean-eager", help=f"comma-separated phases to skip, of: {', '.join(PHASES)}")
    ap.add_argument("--smoke", action="store_true",
                    help="a dry run of this script's logic on the CPU: tiny model, compiles with backend='aot_eager'")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    skip = {s for s in args.skip.split(",") if s}
    bad = [v for v in variants if v not in VARIANTS] + [s for s in skip if s not in PHASES]
    if bad:
        ap.error(f"unknown variant or phase: {', '.join(bad)}")

    import torch

    if args.smoke:
        from utils.llm import models

        models.SHAPES["smoke"] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False)
        args.shape, args.tokens, args.check, args.profile_tokens = "smoke", 8, 8, 4
        skip.add("generate-static")                 # inductor's CPU compile: minutes on a small machine
    elif not torch.cuda.is_available():
        print("SKIP: no CUDA/ROCm GPU visible to PyTorch; this benchmark needs one (or --smoke on a CPU)")
        return 0
    import transformers
    import triton

    from utils import timing
    from utils.llm import decode, models

    dev = torch.device("cpu" if args.smoke else "cuda")
    device_name = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_properties(dev).name
    result = dict(device=device_name, torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, cuda=torch.version.cuda, hip=torch.version.hip,
                  args=vars(args), rows={}, profiles={}, errors={})
    log(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")

    def guarded(name, fn):
        try:
            return fn()
        except Exception as exc:             # a failing phase is reported, the others still run
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"ERROR in {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None

    # 1. tokenizer and model
    from transformers import AutoTokenizer

    tok_dir = models.train_tokenizer(models.course_text_files(), models.models_dir() / "course-bpe")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = models.random_llama(args.shape, tokenizer=tokenizer, dtype=torch.bfloat16, device=dev)
    vocab = len(tokenizer)
    nbytes = models.weight_bytes(model)
    log(f"random {args.shape}, vocabulary {vocab}: {models.param_count(model.config) / 1e9:.2f} B parameters, "
        f"{nbytes / 1e9:.2f} GB")

    # 2. bandwidth and ceiling (as lab 05: a 1 GiB copy reads and writes every byte)
    copy_bytes = (64 << 20) if args.smoke else (1 << 30)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    bandwidth = timing.benchmark(lambda: dst.copy_(src), warmup=3, warmup_ms=200, reps=20, device=dev.type).gbps(
        2 * copy_bytes)
    del src, dst
    ceiling = models.decode_ceiling(bandwidth, nbytes)
    result.update(bandwidth_gbps=bandwidth, weight_bytes=nbytes, ceiling_tokens_per_s=ceiling, vocab=vocab)
    log(f"copy bandwidth ({copy_bytes >> 20} MiB) {bandwidth:,.0f} GB/s -> ceiling {ceiling:.1f} tokens/s ({1e3 / ceiling:.2f} ms/token)")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.prompt), generator=gen).to(dev)
    max_len = args.prompt + max(args.tokens, args.check, args.profile_tokens)
    pad = decode._pad_id(model)
    cache_len = -(-max_len // 16) * 16                  # LeanDecoder pads its cache to 16 positions
    kv_read = cache_len * models.kv_bytes_per_token(model.config, 2)
    result.update(max_len=max_len, kv_bytes_read_per_step=kv_read)
    log(f"lean decoder: KV cache of {cache_len} positions, {kv_read / 1e6:.1f} MB read per step by attention "
        f"({kv_read / nbytes:.2%} of the weights)")

    def row(name, rate, **extra):
        result["rows"][name] = dict(tokens_per_s=rate, fraction=rate / ceiling, **extra)
        log(f"{name}: {rate:.1f} tokens/s = {rate / ceiling:.3f} of the ceiling"
            + "".join(f", {k} {v}" for k, v in extra.items()))

    def hf_generate(n, **kw):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              eos_token_id=None, pad_token_id=pad, **kw)

    def profile(name, fn):
        if "profile" in skip:
            return
        prof = guarded(f"profile {name}", lambda: decode.profile_tokens(fn, args.profile_tokens, dev))
        if prof:
            result["profiles"][name] = prof
            log(f"profile {name}: {prof['launches_per_token']:.0f} kernels/token, busy "
                f"{prof['busy_ms_per_token']:.2f} ms/token")

    # 3. transformers' eager generate: reference and rate
    ref = decode.reference(model, ids, args.check)
    log(f"reference: generate's first {args.check} greedy tokens")
    if "generate-eager" not in skip:
        rate = guarded("generate-eager", lambda: models.decode_tokens_per_s(model, ids, 64, warmup=1))
        if rate:
            row("generate, eager (dynamic cache)", rate)
            profile("generate, eager (dynamic cache)", lambda n: hf_generate(n))

    # 4. the lean decoder
    if "lean-eager" not in skip:
        def lean_eager():
            dec = decode.LeanDecoder.from_hf(model, max_len, fuse=True)
            agree = decode.compare_with_generate(model, dec, ids, args.check, ref)
            row("lean, eager (fused)", decode.tokens_per_s(dec, ids, min(64, args.tokens), warmup=1),
                tokens=str(agree))
        guarded("lean-eager", lean_eager)

    for name in variants:
        opts, mode, inductor = VARIANTS[name]

        def lean_variant():
            from torch._dynamo.utils import counters

            counters.clear()
            dec = decode.LeanDecoder.from_hf(model, max_len, **opts)
            dec.compile(backend="aot_eager") if args.smoke else dec.compile(mode, **inductor)
            start = time.perf_counter()
            agree = decode.compare_with_generate(model, dec, ids, args.check, ref)      # compiles on the way
            compile_s = time.perf_counter() - start
            rate = decode.tokens_per_s(dec, ids, args.tokens, warmup=1)
            skips = counters["inductor"]["cudagraph_skips"]       # > 0: the step ran without a CUDA graph
            graphs = counters["stats"]["unique_graphs"]           # 1: one compile served every step
            label = f"lean {name} ({mode}{', ' + ', '.join(inductor) if inductor else ''})"
            row(label, rate, compile_and_check_s=round(compile_s, 1), tokens=str(agree),
                agrees=agree.ok(decode.default_tolerance(model.dtype)), identical=agree.identical,
                logit_error=agree.logit_error, cudagraph_skips=skips, graphs=graphs)
            profile(label, lambda n: dec.generate(ids, n))
            del dec

        guarded(f"lean {name}", lean_variant)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()

    # 5. generate with a static cache (transformers compiles the forward itself)
    if "generate-static" not in skip:
        def static():
            start = time.perf_counter()
            rate = models.decode_tokens_per_s(model, ids, args.tokens, warmup=2, cache_implementation="static")
            row("generate, static cache (compiled by transformers)", rate,
                total_s=round(time.perf_counter() - start, 1))
            profile("generate, static cache (compiled by transformers)",
                    lambda n: hf_generate(n, cache_implementation="static"))
        guarded("generate-static", static)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()

    # 6. continuous batching at concurrency 1, as `transformers serve --continuous-batching --cb-use-cuda-graph`
    if "serve" not in skip:
        def serve():
            from transformers import ContinuousBatchingConfig

            cfg = ContinuousBatchingConfig(use_cuda_graph=not args.smoke, num_blocks=16, max_batch_tokens=512)
            out = decode.serve_step_breakdown(model, ids, 12 if args.smoke else 48, cfg)
            result["serve"] = out
            log(f"continuous batching, c=1 (transformers {out['transformers']}): {out['step_ms']:.2f} ms/step; "
                + ", ".join(f"{k} {v:.2f} ms" for k, v in out["phases_ms"].items()))
            if out["profile"]:
                result["profiles"]["continuous batching, c=1"] = out["profile"]
        guarded("serve", serve)

    # report
    print()
    print(f"## {device_name}: random {args.shape} (BF16, vocabulary {vocab}, {nbytes / 1e9:.2f} GB), batch 1, "
          f"{args.prompt}-token prompt, {args.tokens} new tokens")
    print(f"ceiling = {bandwidth:,.0f} GB/s ({copy_bytes >> 20} MiB copy) / {nbytes / 1e9:.2f} GB = {ceiling:.1f} tokens/s")
    if result["profiles"]:
        print("\n### One decode step (profiled, prefill removed; idle = profiled step - kernel busy time)\n")
        rates = {name: r["tokens_per_s"] for name, r in result["rows"].items()}
        if result.get("serve"):
            rates["continuous batching, c=1"] = 1e3 / result["serve"]["step_ms"]
        print(decode.time_table(result["profiles"], rates))
        for name, prof in result["profiles"].items():
            print(f"\ntop kernels, {name}:")
            for k in prof["top"][:5]:
                print(f"  {k['ms_per_token']:7.3f} ms  {k['calls_per_token']:6.1f}x  {k['name'][:100]}")
    if result.get("serve"):
        print("\n### transformers continuous batching, one request: host phases per step (ms)\n")
        print(" | ".join(f"{k} {v:.2f}" for k, v in result["serve"]["phases_ms"].items()))
    if result["errors"]:
        print("\nerrors: " + "; ".join(f"{k}: {v[:200]}" for k, v in result["errors"].items()))
    print(f"\n### Batch-1 decode (total {time.perf_counter() - T0:.0f} s)\n")
    print("| | tokens/s | fraction of ceiling | tokens vs generate | compile + check s |")
    print("|---|---|---|---|---|")
    for name, r in result["rows"].items():
        verdict = "" if "agrees" not in r else (" (OK)" if r["agrees"] else " (MISMATCH)")
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['fraction']:.3f} | {r.get('tokens', '')}{verdict} | "
              f"{r.get('compile_and_check_s', '')} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "lean_decode.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
