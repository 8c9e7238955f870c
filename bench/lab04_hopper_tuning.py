"""Where lab 04's Hopper attention kernel spends its time, and what brings it closer to cuDNN (issue 19).

    python3 bench/lab04_hopper_tuning.py               # about 3 minutes on an H100, most of it compiling
    python3 bench/lab04_hopper_tuning.py --one NAME    # run one variant a few times (for ncu), nothing else

One kernel, `attention_variant`, the lab's `flash_attention_tma` with switches:
  PIPE     the softmax of key block j runs while P V of block j-1 is still on the tensor cores (wgmma is asynchronous;
           FlashAttention-3's intra-warpgroup overlap, in the order Triton's pipeliner can keep a wgmma in flight)
  LAZY     the accumulator is rescaled only when some row's max grew by more than 8 (log2 units), as
           FlashAttention-4 does; otherwise the old max is kept (p stays below 2^8, exact either way)
  ABLATE   0 the whole kernel; 1 no exp2 (p = the exponent itself); 2 no rescale of the accumulator; 3 no softmax
           (p = S): the differences in time say what each part costs (the answers are wrong, never checked)
Each variant at B=4 H=32 N=4096 D=128 bf16, causal and not, against SDPA's cuDNN and FLASH backends in the same run
(median of interleaved rounds, utils.timing.interleaved); every non-ablated variant checked against the fp32 reference
by the lab's rule (`within_tolerance`) on the headline's first batch and four heads and on ragged and odd shapes.
Writes $OUT/lab04_hopper_tuning.json when OUT is set.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from bench.lab04_attention import measure, sdpa  # noqa: E402

START = time.time()
HEADLINE = (4, 32, 4096, 128)


@triton.jit
def _softmax_pv(s, acc, l_i, m_i, v, qk_scale, LAZY: tl.constexpr, ABLATE: tl.constexpr):
    """One block of unmasked scores s (raw Q Kᵀ) through the online softmax into acc."""
    if ABLATE == 3:
        acc = tl.dot(s.to(v.dtype), v, acc)
        l_i = l_i + tl.sum(s, 1)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if LAZY:
            if tl.max(m_new - m_i, 0) > 8.0:                  # some row's max grew by more than 2^8: rescale
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            x = s * qk_scale - m_i[:, None]
            p = x if ABLATE == 1 else tl.math.exp2(x)
            acc = tl.dot(p.to(v.dtype), v, acc)
            l_i = l_i + tl.sum(p, 1)
        else:
            x = s * qk_scale - m_new[:, None]
            p = x if ABLATE == 1 else tl.math.exp2(x)
            alpha = tl.math.exp2(m_i - m_new)
            if ABLATE != 2:
                acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _softmax(s, l_i, m_i, qk_scale, ABLATE: tl.constexpr):
    """p, alpha and the new l_i, m_i of a block of unmasked scores (no accumulator: that waits for the tensor cores)."""
    if ABLATE == 3:
        return s, l_i, l_i + tl.sum(s, 1), m_i
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    x = s * qk_scale - m_new[:, None]
    p = x if ABLATE == 1 else tl.math.exp2(x)
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _unmasked(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, qk_scale, BLOCK_N: tl.constexpr, PIPE: tl.constexpr,
              LAZY: tl.constexpr, ABLATE: tl.constexpr, WS: tl.constexpr):
    """Key blocks [lo, hi) that need no mask (hi - lo a multiple of BLOCK_N)."""
    if PIPE:
        # Order in the loop: softmax of block j (P V of block j-1 still running on the tensor cores), S of block j+1
        # (synchronous: Triton waits for every wgmma here), rescale, then P V of block j, left running into the next
        # iteration. Triton keeps a wgmma in flight across iterations only if what reads its result from the last
        # iteration comes after a full wait (WGMMAPipeline.cpp, dotCanBeProperlyAsync, rule 3b): here acc * alpha.
        if hi > lo:
            s = tl.dot(q, k_desc.load([lo, 0]).T)
            for start_n in tl.range(lo, hi - BLOCK_N, BLOCK_N):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                if LAZY:
                    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                    grow = tl.max(m_new - m_i, 0)
                    m_use = tl.where(grow > 8.0, m_new, m_i)
                    p = tl.math.exp2(s * qk_scale - m_use[:, None])
                    alpha = tl.math.exp2(m_i - m_use)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    s = tl.dot(q, k_desc.load([start_n + BLOCK_N, 0]).T)
                    if grow > 8.0:
                        acc = acc * alpha[:, None]
                    m_i = m_use
                else:
                    p, alpha, l_i, m_i = _softmax(s, l_i, m_i, qk_scale, ABLATE)
                    s = tl.dot(q, k_desc.load([start_n + BLOCK_N, 0]).T)
                    if ABLATE != 2 and ABLATE != 3:
                        acc = acc * alpha[:, None]
                v = v_desc.load([start_n, 0])
                acc = tl.dot(p.to(v.dtype), v, acc)
            v = v_desc.load([hi - BLOCK_N, 0])
            acc, l_i, m_i = _softmax_pv(s, acc, l_i, m_i, v, qk_scale, LAZY, ABLATE)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            s = tl.dot(q, k_desc.load([start_n, 0]).T)
            v = v_desc.load([start_n, 0])
            acc, l_i, m_i = _softmax_pv(s, acc, l_i, m_i, v, qk_scale, LAZY, ABLATE)
    return acc, l_i, m_i


@triton.jit
def _masked(acc, l_i, m_i, q, k_desc, v_desc, offs_m, lo, hi, n_ctx, qk_scale, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr):
    """Key blocks [lo, hi) with a mask (the diagonal, the ragged end): as the lab's `tma_blocks`."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        s = tl.dot(q, k_desc.load([start_n, 0]).T)
        cols = start_n + offs_n
        keep = cols[None, :] < n_ctx
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= cols[None, :])
        s = tl.where(keep, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_ctx"])
def attention_variant(q_ptr, k_ptr, v_ptr, o_ptr, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, n_ctx, sm_scale,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, PIPE: tl.constexpr, LAZY: tl.constexpr, ABLATE: tl.constexpr,
                      WS: tl.constexpr):
    start_m = tl.program_id(0)
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - start_m
    head, batch = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(q_ptr + batch * stride_qb + head * stride_qh, shape=[n_ctx, HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, D_PAD])
    k_desc = tl.make_tensor_descriptor(k_ptr + batch * stride_kb + head * stride_kh, shape=[n_ctx, HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, D_PAD])
    v_desc = tl.make_tensor_descriptor(v_ptr + batch * stride_vb + head * stride_vh, shape=[n_ctx, HEAD_DIM],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, D_PAD])
    o_desc = tl.make_tensor_descriptor(o_ptr + batch * stride_ob + head * stride_oh, shape=[n_ctx, HEAD_DIM],
                                       strides=[stride_om, 1], block_shape=[BLOCK_M, D_PAD])
    first = start_m * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    q = q_desc.load([first, 0])
    if CAUSAL:
        acc, l_i, m_i = _unmasked(acc, l_i, m_i, q, k_desc, v_desc, 0, first, qk_scale, BLOCK_N, PIPE, LAZY, ABLATE, WS)
        acc, l_i, m_i = _masked(acc, l_i, m_i, q, k_desc, v_desc, offs_m, first, tl.minimum(first + BLOCK_M, n_ctx),
                                n_ctx, qk_scale, BLOCK_N, True)
    else:
        full = n_ctx // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _unmasked(acc, l_i, m_i, q, k_desc, v_desc, 0, full, qk_scale, BLOCK_N, PIPE, LAZY, ABLATE, WS)
        acc, l_i, m_i = _masked(acc, l_i, m_i, q, k_desc, v_desc, offs_m, full, n_ctx, n_ctx, qk_scale, BLOCK_N, False)
    o_desc.store([first, 0], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def run_variant(q, k, v, causal, *, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, PIPE=False, LAZY=False,
                ABLATE=0, maxnreg=None, WS=False):
    B, H, N, D = q.shape
    out = torch.empty_like(q)
    triton.set_allocator(_scratch)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    kernel = attention_variant[(triton.cdiv(N, BLOCK_M), H, B)](
        q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], N, 1.0 / math.sqrt(D),
        HEAD_DIM=D, D_PAD=max(16, triton.next_power_of_2(D)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=causal,
        PIPE=PIPE, LAZY=LAZY, ABLATE=ABLATE, WS=WS, num_warps=num_warps, num_stages=num_stages, **extra)
    if kernel is not None and hasattr(kernel, "n_regs"):
        BUILDS[(BLOCK_M, BLOCK_N, num_warps, num_stages, PIPE, LAZY, ABLATE, maxnreg, WS, causal)] = dict(
            regs=kernel.n_regs, spills=kernel.n_spills, shared=kernel.metadata.shared,
            ctas_per_sm=min(65536 // (max(kernel.n_regs, 1) * 32 * num_warps) if kernel.n_regs else 32,
                            232448 // max(kernel.metadata.shared + 1024, 1)))
    return out


BUILDS = {}   # (tiles, switches, causal) -> registers, spills, shared memory, blocks per SM they allow


# name -> options of run_variant; the first is the lab's kernel as it is (its configs: 128x128 s2 full, 128x64 s3 causal)
VARIANTS = {
    "1 CTA/SM 128x128 s2": dict(BLOCK_N=128, num_stages=2),     # the lab's tiles before (non-causal)
    "1 CTA/SM 128x64 s3": dict(BLOCK_N=64, num_stages=3),       # the lab's tiles before (causal)
    "2 CTAs/SM 128x64 s2 r128": dict(BLOCK_N=64, num_stages=2, maxnreg=128),   # the lab's tiles now
    "2 CTAs/SM lazy 128x64 s2 r128": dict(BLOCK_N=64, num_stages=2, maxnreg=128, LAZY=True),
    "pipe 128x128 s2": dict(BLOCK_N=128, num_stages=2, PIPE=True),
    "64x64 w4 s2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
}
ABLATED = ("2 CTAs/SM 128x64 s2 r128",)
ABLATIONS = {"no exp2": 1, "no rescale": 2, "no softmax (matmuls only)": 3}


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def load_lab():
    from bench.lab04_attention import load_lab as load
    return load()


def main() -> int:
    from importlib import metadata
    versions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    log(str(versions))
    lab = load_lab()
    within_tolerance = lab.within_tolerance
    b, h, n, d = HEADLINE
    report = {"versions": versions, "date": time.strftime("%Y-%m-%d"), "headline": {}, "checks": {}, "failed": {}}
    for causal in (False, True):
        cands = {"SDPA CUDNN": sdpa(SDPBackend.CUDNN_ATTENTION), "SDPA FLASH": sdpa(SDPBackend.FLASH_ATTENTION),
                 "lab hopper_attention": lab.hopper_attention}
        for name, opts in VARIANTS.items():
            cands[name] = (lambda q, k, v, c, o=opts: run_variant(q, k, v, c, **o))
        for ablated in ABLATED:
            for what, ablate in ABLATIONS.items():
                cands[f"{ablated} {what}"] = (lambda q, k, v, c, o=dict(VARIANTS[ablated], ABLATE=ablate):
                                              run_variant(q, k, v, c, **o))
        log(f"causal={causal}: {len(cands)} candidates (compiling, then timing)")
        result = measure(cands, b, h, n, d, causal)
        for name, why in result["failed"].items():
            report["failed"][f"causal={causal} {name}"] = why
            log(f"{name} failed: {why}")
        tf = report["headline"][f"causal={causal}"] = result["tflops"]
        small = [torch.randn(1, 4, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for name in tf:
            if name.startswith("SDPA") or any(name.endswith(a) for a in ABLATIONS):
                continue
            results = []
            for qq, kk, vv in [small] + [[torch.randn(1, 2, nn, d, device="cuda", dtype=torch.bfloat16)
                                          for _ in range(3)] for nn in (1, 100, 333, 1000)]:
                ok, err, allowed = within_tolerance(cands[name](qq, kk, vv, causal), qq, kk, vv, causal)
                results.append((qq.shape[2], bool(ok), err, allowed))
            report["checks"][f"causal={causal} {name}"] = results
        cudnn = tf.get("SDPA CUDNN")
        print(f"\nB={b} H={h} N={n} D={d} bf16 {'causal' if causal else 'full'} (TFLOP/s, x cuDNN)")
        for name, value in sorted(tf.items(), key=lambda kv: -kv[1]):
            checks = report["checks"].get(f"causal={causal} {name}")
            verdict = "" if checks is None else ("right" if all(c[1] for c in checks) else
                                                 "WRONG " + str([c for c in checks if not c[1]]))
            opts = VARIANTS.get(name) or next((dict(VARIANTS[a], ABLATE=ABLATIONS[name[len(a) + 1:]]) for a in ABLATED
                                               if name.startswith(a + " ")), None)
            build = {}
            if opts:
                o = dict(dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, PIPE=False, LAZY=False, ABLATE=0,
                              maxnreg=None, WS=False), **opts)
                build = BUILDS.get((o["BLOCK_M"], o["BLOCK_N"], o["num_warps"], o["num_stages"], o["PIPE"], o["LAZY"],
                                    o["ABLATE"], o["maxnreg"], o["WS"], causal), {})
                report["headline"].setdefault(f"builds causal={causal}", {})[name] = build
            b_txt = (f"{build['regs']:3d} regs {build['spills']:3d} spills {build['shared'] // 1024:3d} KiB "
                     f"{build['ctas_per_sm']} CTA/SM") if build else ""
            print(f"  {name:<40} {value:7.1f}  {value / cudnn:5.3f}  {b_txt:<40} {verdict}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "lab04_hopper_tuning.json").write_text(json.dumps(report, indent=1, default=str))
    bad = [k for k, v in report["checks"].items() if not all(c[1] for c in v)]
    print(f"\nchecks: {len(report['checks']) - len(bad)} of {len(report['checks'])} right; total {time.time() - START:.0f} s")
    return 1 if bad else 0


def one(name: str, causal: bool) -> None:
    """Run one variant (or `lab`: the lab's hopper_attention, or `cudnn`) a few times, for a profiler."""
    b, h, n, d = HEADLINE
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if name == "cudnn":
        fn = sdpa(SDPBackend.CUDNN_ATTENTION)
    else:
        opts = VARIANTS[name]
        fn = (lambda q, k, v, c: run_variant(q, k, v, c, **opts))
    for _ in range(3):
        fn(q, k, v, causal)
    torch.cuda.synchronize()


NCU_FIELDS = {  # name in the record -> the line of `ncu --print-details all` it comes from
    "duration_ms": r"Duration\s+(ms|us)\s+([\d.,]+)", "sm_ghz": r"SM Frequency\s+Ghz\s+([\d.]+)",
    "tensor_pipe_pct": r"SM: Pipe Tensor Cycles Active\s+%\s+([\d.]+)",
    "xu_pipe_pct": r"SM: Inst Executed Pipe Xu\s+%\s+([\d.]+)",
    "fma_pipe_pct": r"SM: Pipe Fma Cycles Active\s+%\s+([\d.]+)",
    "registers": r"Registers Per Thread\s+register/thread\s+(\d+)", "block_size": r"Block Size\s+(\d+)",
    "grid_size": r"Grid Size\s+([\d,]+)", "shared_kib": r"Dynamic Shared Memory Per Block\s+Kbyte/block\s+([\d.]+)",
    "achieved_occupancy_pct": r"Achieved Occupancy\s+%\s+([\d.]+)",
    "warp_cycles_per_issue": r"Warp Cycles Per Issued Instruction\s+cycle\s+([\d.]+)",
}
STALLS = ("Barrier", "Long Scoreboard", "Wait", "MIO Throttle", "Math Pipe Throttle", "GMMA", "Not Selected")


def parse_ncu(text: str) -> dict:
    """The figures of one kernel's `ncu --print-details all` report (NCU_FIELDS, stall reasons in cycles/issue)."""
    import re
    out = {}
    for name, pattern in NCU_FIELDS.items():
        m = re.search(pattern, text)
        if m:
            value = float(m.groups()[-1].replace(",", ""))
            out[name] = value / 1000 if m.groups()[0] == "us" else value
    out["stalls"] = {}
    for stall in STALLS:
        m = re.search(rf"Stall {stall}\s+inst\s+([\d.]+)", text)
        if m:
            out["stalls"][stall.lower().replace(" ", "_")] = float(m.group(1))
    return out


def summarize(folder: Path) -> dict:
    """utils/reference/h100_attention_profile.json from one device run's $OUT: timings, checks, ncu reports."""
    run = json.loads((folder / "lab04_hopper_tuning.json").read_text())
    profiles = {}
    for f in sorted(folder.glob("ncu_*.txt")):
        parsed = parse_ncu(f.read_text())
        if parsed.get("duration_ms"):
            profiles[f.stem[4:]] = parsed
    return {"what": "lab 04's Hopper attention kernel (flash_attention_tma) against SDPA's cuDNN backend at B=4 H=32 "
                    "N=4096 D=128 bf16: TFLOP/s of tiles and switches in one run (median of interleaved rounds), "
                    "ablations, Nsight Compute profiles",
            "made_by": "python3 bench/lab04_hopper_tuning.py; bash bench/lab04_hopper_profile.sh "
                       "'2 CTAs/SM 128x64 s2 r128' '1 CTA/SM 128x128 s2' cudnn; --summarize",
            "device": run["versions"]["gpu"], "date": run.get("date"), "software": run["versions"],
            "tflops": {k: v for k, v in run["headline"].items() if not k.startswith("builds")},
            "builds": {k: v for k, v in run["headline"].items() if k.startswith("builds")},
            "all_right": all(all(c[1] for c in v) for v in run["checks"].values()), "profiles": profiles}


if __name__ == "__main__":
    if "--summarize" in sys.argv:
        print(json.dumps(summarize(Path(sys.argv[sys.argv.index("--summarize") + 1])), indent=1))
        sys.exit(0)
    if "--one" in sys.argv:
        i = sys.argv.index("--one")
        one(sys.argv[i + 1], "--causal" in sys.argv)
        sys.exit(0)
    sys.exit(main())
