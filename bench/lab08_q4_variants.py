"""Lab 08: q4_gemv's ways to turn nibbles into floats (GPU), at the Llama-3.1-8B MLP shape over more than L2.

    python bench/lab08_q4_variants.py      # the lab's kernel (solutions/08) and two variants, each over a tile sweep

The lab's kernel converts each nibble with an integer-to-float instruction; the variants use the exponent trick
(OR the nibble into the mantissa of 2^23, subtract) on bytes and on 16-bit words. Each runs the up (14336 x 4096) and
down (4096 x 14336) projections of enough layers to exceed four L2s, replayed from a CUDA graph; bandwidth = Q4_0
bytes read / time, against a copy (read + write) and torch.sum (read only). On an H200 (2026-11-28) all three
stayed near 0.3 of the copy bandwidth (best 0.99 TB/s against 2.7 TB/s copy, 4.3 TB/s read). Nsight Compute on the
lab's kernel: L1/TEX throughput 75-80 %, DRAM about 10 % of a single launch's, 40 registers, 62 % occupancy: the loads
of x and d for every byte, not memory, set the pace. `blocks3d` (added 2026-12-01, not yet run on a GPU) loads d and x
once per block for all the rows of a program.
"""
import itertools
import json
import os
import sys
import types

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from utils import blocks  # noqa: E402


@triton.jit
def magic_bytes(w_ptr, x_ptr, y_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCKS * 16)
    acc = tl.zeros([BLOCK_N, BLOCKS * 16], dtype=tl.float32)
    for b0 in range(0, K // 32, BLOCKS):
        blk = b0 + c // 16
        live = blk < K // 32
        ok = (rows[:, None] < N) & live[None, :]
        at = w_ptr + rows[:, None].to(tl.int64) * row_bytes + blk[None, :] * 18
        d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
        q = tl.load(at + 2 + (c % 16)[None, :], mask=ok, other=0).to(tl.int32)
        x_lo = tl.load(x_ptr + blk * 32 + c % 16, mask=live, other=0.0)
        x_hi = tl.load(x_ptr + blk * 32 + 16 + c % 16, mask=live, other=0.0)
        lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        acc += d * (lo * x_lo[None, :] + hi * x_hi[None, :])
    tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def magic_words(w_ptr, x_ptr, y_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCKS * 8)                 # 16-bit word c: block c // 8, bytes 2j and 2j+1 (j = c % 8)
    acc = tl.zeros([BLOCK_N, BLOCKS * 8], dtype=tl.float32)
    for b0 in range(0, K // 32, BLOCKS):
        blk = b0 + c // 8
        j = c % 8
        live = blk < K // 32
        ok = (rows[:, None] < N) & live[None, :]
        at = w_ptr + rows[:, None].to(tl.int64) * row_bytes + blk[None, :] * 18
        d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
        word = tl.load((at + 2 + 2 * j[None, :]).to(tl.pointer_type(tl.uint16)), mask=ok, other=0).to(tl.int32)
        base = x_ptr + blk * 32 + 2 * j
        x0 = tl.load(base, mask=live, other=0.0)
        x1 = tl.load(base + 1, mask=live, other=0.0)
        x16 = tl.load(base + 16, mask=live, other=0.0)
        x17 = tl.load(base + 17, mask=live, other=0.0)
        w0 = ((word & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        w1 = (((word >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        w16 = (((word >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        w17 = ((word >> 12) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        acc += d * (w0 * x0[None, :] + w1 * x1[None, :] + w16 * x16[None, :] + w17 * x17[None, :])
    tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def magic_bytes2(w_ptr, x_ptr, y_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    """magic_bytes with two steps' loads issued before either is used (twice the bytes in flight)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCKS * 16)
    acc = tl.zeros([BLOCK_N, BLOCKS * 16], dtype=tl.float32)
    for b0 in range(0, K // 32, 2 * BLOCKS):
        blk = b0 + c // 16
        blk2 = blk + BLOCKS
        live, live2 = blk < K // 32, blk2 < K // 32
        ok, ok2 = (rows[:, None] < N) & live[None, :], (rows[:, None] < N) & live2[None, :]
        at = w_ptr + rows[:, None].to(tl.int64) * row_bytes + blk[None, :] * 18
        at2 = at + BLOCKS * 18
        d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        q = tl.load(at + 2 + (c % 16)[None, :], mask=ok, other=0).to(tl.int32)
        d2 = tl.load(at2.to(tl.pointer_type(tl.float16)), mask=ok2, other=0.0)
        q2 = tl.load(at2 + 2 + (c % 16)[None, :], mask=ok2, other=0).to(tl.int32)
        x_lo = tl.load(x_ptr + blk * 32 + c % 16, mask=live, other=0.0)
        x_hi = tl.load(x_ptr + blk * 32 + 16 + c % 16, mask=live, other=0.0)
        x_lo2 = tl.load(x_ptr + blk2 * 32 + c % 16, mask=live2, other=0.0)
        x_hi2 = tl.load(x_ptr + blk2 * 32 + 16 + c % 16, mask=live2, other=0.0)
        lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        acc += d.to(tl.float32) * (lo * x_lo[None, :] + hi * x_hi[None, :])
        lo2 = ((q2 & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi2 = ((q2 >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        acc += d2.to(tl.float32) * (lo2 * x_lo2[None, :] + hi2 * x_hi2[None, :])
    tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=rows < N)


@triton.jit
def blocks3d(w_ptr, x_ptr, y_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
             STAGES: tl.constexpr = 1):
    """A (rows, blocks, 16 bytes) tile: d loaded once per block and x once per block for all rows (not per byte),
    each thread a few contiguous bytes of one block; not measured yet (the next GPU run)."""
    BYTES: tl.constexpr = 18     # Q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
    ZERO: tl.constexpr = 8.0
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.arange(0, BLOCKS)
    j = tl.arange(0, 16)
    row_ok = rows < N
    row_at = w_ptr + rows.to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_N, BLOCKS, 16], dtype=tl.float32)
    for b0 in tl.range(0, K // 32, BLOCKS, num_stages=STAGES):
        blk = b0 + b
        live = blk < K // 32
        ok = row_ok[:, None] & live[None, :]                          # (rows, blocks)
        at = row_at[:, None] + blk[None, :] * BYTES                   # each block's first byte
        d = tl.load(at.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)
        q = tl.load(at[:, :, None] + (BYTES - 16) + j[None, None, :], mask=ok[:, :, None], other=0)
        xat = x_ptr + blk[:, None] * 32 + j[None, :]
        x_lo = tl.load(xat, mask=live[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(xat + 16, mask=live[:, None], other=0.0).to(tl.float32)
        lo = (q & 0xF).to(tl.float32)
        hi = (q >> 4).to(tl.float32)
        acc += d[:, :, None] * ((lo - ZERO) * x_lo[None, :, :] + (hi - ZERO) * x_hi[None, :, :])
    tl.store(y_ptr + rows, tl.sum(tl.sum(acc, axis=2), axis=1), mask=row_ok)


N, K = 14336, 4096
dev = "cuda"
l2 = torch.cuda.get_device_properties(0).L2_cache_size
layer = blocks.Q4_0.row_bytes(K) * N + blocks.Q4_0.row_bytes(N) * K
LAYERS = max(2, -(-4 * l2 // layer))
up = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=i)).reshape(N, -1).to(dev) for i in range(LAYERS)]
down = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=99 + i)).reshape(K, -1).to(dev) for i in range(LAYERS)]
x, h, y = torch.randn(K, device=dev), torch.empty(N, device=dev), torch.empty(K, device=dev)


def timed(fn, calls=LAYERS, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return sorted(ts)[len(ts) // 2]


src = torch.ones(1 << 28, device=dev)
dst = torch.empty_like(src)
copy = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), calls=4) / 1e6
read = src.numel() * 4 / timed(lambda: src.sum(), calls=4) / 1e6
print(f"{torch.cuda.get_device_name()}: copy {copy:,.0f} GB/s, read-only (sum) {read:,.0f} GB/s; {LAYERS} layers")
w = blocks.decode(up[0].cpu().numpy(), "Q4_0")
want = torch.from_numpy(w).double() @ x.double().cpu()
cells = json.load(open("solutions/08_quantized_inference.ipynb"))["cells"]     # the lab's kernel cell, as JSON
code = next("".join(c["source"]) for c in cells if "def q4_gemv_kernel" in "".join(c["source"]))
os.makedirs("build", exist_ok=True)
with open("build/lab08_kernel.py", "w") as f:      # a real file: Triton reads a kernel's source
    f.write(code)
lab = types.ModuleType("lab08")
exec(compile(code, "build/lab08_kernel.py", "exec"), lab.__dict__)
lab_kernel = lab.q4_gemv_kernel
CONFIGS = {lab_kernel: itertools.product((1, 2, 4, 8), (8, 16, 32), (4, 8)),
           magic_bytes: itertools.product((1, 2, 4, 8), (32, 64, 128), (2, 4, 8)),
           magic_bytes2: itertools.product((1, 2, 4, 8), (16, 32, 64), (2, 4, 8)),
           magic_words: itertools.product((2, 4, 8), (32, 64, 128), (2, 4, 8)),
           blocks3d: itertools.product((2, 4, 8, 16), (8, 16, 32), (2, 4, 8))}
for kern in CONFIGS:
    out = torch.empty(N, device=dev)
    extra = {"HAS_MIN": False} if kern is lab_kernel else {}
    kern[(N // 4,)](up[0], x, out, N, K, up[0].shape[1], BLOCK_N=4, BLOCKS=8, **extra)
    print(kern.fn.__name__, "error", ((out.double().cpu() - want).abs().max() / want.abs().max()).item())
    best = (0,)
    for bn, bs, nw in CONFIGS[kern]:
        turn = itertools.count()

        def mlp():
            i = next(turn) % LAYERS
            for wt, a, o in ((up[i], x, h), (down[i], h, y)):
                kern[(triton.cdiv(wt.shape[0], bn),)](wt, a, o, wt.shape[0], a.shape[0], wt.shape[1], BLOCK_N=bn,
                                                       BLOCKS=bs, num_warps=nw, **extra)
        try:
            gbps = layer / timed(mlp) / 1e6
        except Exception as err:
            print(kern.fn.__name__, bn, bs, nw, "failed", str(err).splitlines()[0][:60])
            continue
        best = max(best, (gbps, bn, bs, nw))
    print(kern.fn.__name__, "best", best, f"= {best[0] / copy:.2f} of copy, {best[0] / read:.2f} of read-only", flush=True)
