#!/usr/bin/env python3
"""Lab 03's FP8 section on a GPU, before it was written: which Triton FP8 matmul design reaches torch._scaled_mm.

Three designs of C = (A * sa) @ (B * sb) in e4m3fn with FP32 scales applied in the epilogue (per tensor, or per row
of A and column of B), each at a few tile shapes, against `torch._scaled_mm` (cuBLASLt) with the same operand layout
(A row-major, B column-major: K contiguous in both, what Hopper's FP8 wgmma wants), at 4096^3 and 8192^3:
- `ptr`: one program per tile of C, plain pointer loads (section 3's kernel with the scales in its epilogue);
- `tma`: one program per tile, the tiles through host-side tensor descriptors (TMA);
- `tma_persistent`: one program per SM walking the tiles (section 7's design) through descriptors.
Every kernel is checked against a float64 product first; then 5 interleaved rounds (utils.timing.interleaved, L2
flushed, shuffled order); the table gives TFLOP/s medians and the ratio to cuBLASLt of the same rounds.

    python3 bench/lab03_fp8_variants.py        # from the repository root; ~2-3 minutes on an H100 / H200
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from utils import timing  # noqa: E402

E4M3 = torch.float8_e4m3fn


@triton.jit
def _scales(sa_ptr, sb_ptr, offs_m, offs_n, ROW_WISE: tl.constexpr):
    if ROW_WISE:
        return tl.load(sa_ptr + offs_m)[:, None], tl.load(sb_ptr + offs_n)[None, :]
    return tl.load(sa_ptr), tl.load(sb_ptr)


@triton.jit
def ptr_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_bn, stride_cm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               ROW_WISE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m, pid_n = first_m + (pid % group) % rows, (pid % group) // rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa, sb = _scales(sa_ptr, sb_ptr, offs_m, offs_n, ROW_WISE)
    acc = acc * sa * sb
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + cm[:, None] * stride_cm + cn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(cm[:, None] < M) & (cn[None, :] < N))


@triton.jit
def tma_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               ROW_WISE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    pid_m, pid_n = first_m + (pid % group) % rows, (pid % group) // rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
        acc = tl.dot(a, b, acc)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    sa, sb = _scales(sa_ptr, sb_ptr, offs_m, offs_n, ROW_WISE)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (acc * sa * sb).to(c_desc.dtype))


@triton.jit
def tma_persistent_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, M, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          ROW_WISE: tl.constexpr, PROGRAMS: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    tile_c = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        group = GROUP_M * tiles_n
        first_m = (tile // group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m, pid_n = first_m + (tile % group) % rows, (tile % group) // rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            acc = tl.dot(a, b, acc)
        tile_c += PROGRAMS
        first_m = (tile_c // group) * GROUP_M
        rows = min(tiles_m - first_m, GROUP_M)
        pid_m, pid_n = first_m + (tile_c % group) % rows, (tile_c % group) // rows
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        sa, sb = _scales(sa_ptr, sb_ptr, offs_m, offs_n, ROW_WISE)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (acc * sa * sb).to(c_desc.dtype))


def run_ptr(cfg):
    bm, bn, bk, g, w, s = cfg

    def run(a, b, sa, sb, row_wise):
        (M, K), N = a.shape, b.shape[1]
        c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        ptr_kernel[grid](a, b, c, sa, sb, M, N, K, a.stride(0), b.stride(1), c.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, ROW_WISE=row_wise, num_warps=w, num_stages=s)
        return c
    return run


def run_tma(cfg, persistent):
    bm, bn, bk, g, w, s = cfg
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(a, b, sa, sb, row_wise):
        (M, K), N = a.shape, b.shape[1]
        c = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b.T, [bn, bk])     # b column-major: b.T is (N, K) row-major
        c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
        tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
        if persistent:
            tma_persistent_kernel[(min(sms, tiles),)](a_desc, b_desc, c_desc, sa, sb, M, N, K, BLOCK_M=bm, BLOCK_N=bn,
                                                      BLOCK_K=bk, GROUP_M=g, ROW_WISE=row_wise, PROGRAMS=min(sms, tiles),
                                                      num_warps=w, num_stages=s)
        else:
            tma_kernel[(tiles,)](a_desc, b_desc, c_desc, sa, sb, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 GROUP_M=g, ROW_WISE=row_wise, num_warps=w, num_stages=s)
        return c
    return run


CONFIGS = [(128, 256, 128, 8, 8, 3), (128, 256, 128, 8, 8, 4), (128, 128, 128, 8, 8, 4), (128, 128, 128, 8, 4, 5),
           (256, 128, 128, 8, 8, 3), (128, 256, 64, 8, 8, 5)]


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}")
    variants = {}
    for cfg in CONFIGS:
        tag = "x".join(map(str, cfg[:3])) + f"_w{cfg[4]}s{cfg[5]}"
        variants[f"ptr_{tag}"] = run_ptr(cfg)
        variants[f"tma_{tag}"] = run_tma(cfg, False)
        variants[f"tmap_{tag}"] = run_tma(cfg, True)
    for n in (4096, 8192):
        gen = torch.Generator(device="cuda").manual_seed(n)
        a32 = torch.randn(n, n, device="cuda", generator=gen)
        b32 = torch.randn(n, n, device="cuda", generator=gen)
        a = a32.to(E4M3)
        b = b32.T.contiguous().to(E4M3).T       # column-major, as _scaled_mm wants
        abf, bbf = a32.bfloat16(), b32.bfloat16()
        for row_wise in (False, True):
            if row_wise:
                sa = torch.rand(n, 1, device="cuda", generator=gen) + 0.5
                sb = torch.rand(1, n, device="cuda", generator=gen) + 0.5
            else:
                sa = torch.tensor(0.75, device="cuda")
                sb = torch.tensor(1.25, device="cuda")
            ref = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            exact = (a.double() * sa.double()) @ (b.double() * sb.double())
            err = lambda c: ((c.double() - exact).norm() / exact.norm()).item()
            fns = {"scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)}
            if not row_wise:
                fns["bf16_mm"] = lambda: abf @ bbf
            print(f"\n== {n}^3, {'row-wise' if row_wise else 'per-tensor'} scales; scaled_mm error {err(ref):.2e}")
            srow, scol = (sa.flatten(), sb.flatten()) if row_wise else (sa.reshape(1), sb.reshape(1))
            for name, fn in variants.items():
                try:
                    c = fn(a, b, srow, scol, row_wise)
                    torch.cuda.synchronize()
                    e = err(c)
                    if e > 2e-2:
                        print(f"  {name}: WRONG, error {e:.2e}")
                        continue
                    fns[name] = (lambda fn=fn: fn(a, b, srow, scol, row_wise))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name}: failed: {traceback.format_exception_only(exc)[-1].strip()[:200]}")
            # a first quick round keeps the three best of each design, then 5 interleaved rounds
            quick = timing.interleaved(fns, rounds=1, rep_ms=60, warmup_ms=300)
            keep = {"scaled_mm", "bf16_mm"}
            for design in ("ptr_", "tma_", "tmap_"):
                ranked = sorted((k for k in fns if k.startswith(design)), key=lambda k: quick[k])
                keep.update(ranked[:2])
            times = timing.interleaved({k: v for k, v in fns.items() if k in keep}, rounds=5, rep_ms=200, warmup_ms=500)
            flops = 2 * n**3
            for name in sorted(times, key=lambda k: times[k]):
                ratio, spread, rounds = times.ratio("scaled_mm", name)
                print(f"  {name:<26} {flops / times[name] / 1e9:8.1f} TFLOP/s  {ratio:.3f} of scaled_mm (spread {spread:.1%})")


if __name__ == "__main__":
    main()
