"""Lab 08: q4_gemv's ways to turn nibbles into floats (GPU), at the Llama-3.1-8B MLP shape over more than L2.

    python bench/lab08_q4_variants.py      # the lab's kernel (solutions/08) and variants, each over a tile sweep
    VARIANTS=dp4a,bf16 python bench/lab08_q4_variants.py     # any of lab, blocks3d, stream, stream1, dp4a,
                                                             # dp4a1-3, magic_bytes, magic_words, bf16, soa, soa2-3
    TRITON_INTERPRET=1 python bench/lab08_q4_variants.py     # a check of the script on a CPU (tiny, no timing)

The lab's kernel converts each nibble with an integer-to-float instruction; the variants use the exponent trick
(OR the nibble into the mantissa of 2^23, subtract) on bytes and on 16-bit words. Each runs the up (14336 x 4096) and
down (4096 x 14336) projections of enough layers to exceed four L2s, replayed from a CUDA graph; bandwidth = Q4_0
bytes read / time, against a copy (read + write) and torch.sum (read only). On an H200 (2026-11-28) all three
stayed near 0.3 of the copy bandwidth (best 0.99 TB/s against 2.7 TB/s copy, 4.3 TB/s read). Nsight Compute on the
lab's kernel: L1/TEX throughput 75-80 %, DRAM about 10 % of a single launch's, 40 registers, 62 % occupancy: the loads
of x and d for every byte, not memory, set the pace. 2026-12-02, H200 (utils/reference/h200-lab08.md, raw
output in utils/reference/raw/2026-12-02-h200/): blocks3d 933 GB/s, stream 1,045, dp4a (x quantized to int8 per 32,
integer dot products) 2,076 GB/s, torch.mv on BF16 3,588; against the eager copy (4,080 GB/s, how lab 08 times it)
0.23, 0.26, 0.51 and 0.88. The "copy" this script prints is now timed eagerly too (it was a graph's memcpy node).
Later that day (raw/2026-12-02-h200/soa_run*.txt, lab_run9.txt): `soa`, the blocks packed once (nibbles, then
scales), a persistent grid and evict-first loads, 2,818 GB/s with its quantizer and 3,256 alone (0.68 / 0.78); it
became lab 08's kernel, whose own q4_gemv (`lab`) read 2,831 / 3,276 GB/s = 0.70 / 0.81 of that run's copy. `soa`
stays here as the knobs the lab leaves out (rows a program, x kept in registers, eviction and cache options).
"""
import itertools
import os
import sys

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



@triton.jit
def x_stream_kernel(x_ptr, xs_ptr, K, row_bytes, S, BYTES: tl.constexpr, OFF: tl.constexpr, BLOCK: tl.constexpr):
    """xs[0, p], xs[1, p]: the x elements the low and high nibble of a row's byte p multiply (0 at scale bytes and
    past the row's end), so the GEMV reads x at the same positions, and widths, as the weights."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = p // BYTES
    o = p % BYTES
    ok = (o >= OFF) & (p < row_bytes)
    at = x_ptr + b * 32 + o - OFF
    lo = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(at + 16, mask=ok, other=0.0).to(tl.float32)
    tl.store(xs_ptr + p, lo, mask=p < S)
    tl.store(xs_ptr + S + p, hi, mask=p < S)


@triton.jit
def stream_gemv(w_ptr, xs_ptr, y_ptr, N, row_bytes, S, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr,
                VECS: tl.constexpr, MAGIC: tl.constexpr = False, XB: tl.constexpr = False):
    """Each row read as 16-byte vectors, in order; a vector's bytes belong to at most two blocks (A, then B)."""
    BYTES: tl.constexpr = 20 if HAS_MIN else 18
    ZERO: tl.constexpr = 0.0 if HAS_MIN else 8.0
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_at = w_ptr + rows.to(tl.int64) * row_bytes
    v = tl.arange(0, VECS)
    j = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, VECS], dtype=tl.float32)
    nblk = row_bytes // BYTES
    for p0 in range(0, S, VECS * 16):
        start = p0 + v * 16                                    # (VECS,) first byte of each vector
        pos = start[:, None] + j[None, :]                      # (VECS, 16)
        blk_a = start // BYTES
        cut = (blk_a + 1) * BYTES - start                      # bytes j >= cut belong to block B
        in_b = j[None, :] >= cut[:, None]                      # (VECS, 16)
        q = tl.load(row_at[:, None, None] + pos[None, :, :], mask=row_ok[:, None, None] & (pos < row_bytes)[None, :, :],
                    other=0).to(tl.int32)
        if XB:   # x loaded in the weights' own 3D shape (one layout, no conversion; a load per row)
            xat = xs_ptr + pos[None, :, :] + 0 * rows[:, None, None]
            x_lo3 = tl.load(xat)
            x_hi3 = tl.load(xat + S)
            x_lo = tl.load(xs_ptr + pos)
            x_hi = tl.load(xs_ptr + S + pos)
        else:
            x_lo = tl.load(xs_ptr + pos)                       # zero at scale bytes and past the row
            x_hi = tl.load(xs_ptr + S + pos)
            x_lo3 = x_lo[None, :, :]
            x_hi3 = x_hi[None, :, :]
        if MAGIC:
            lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            lo = (q & 0xF).to(tl.float32)
            hi = (q >> 4).to(tl.float32)
        part = lo * x_lo3 + hi * x_hi3  # (BLOCK_N, VECS, 16)
        part_b = tl.sum(tl.where(in_b[None, :, :], part, 0.0), axis=2)
        part_a = tl.sum(part, axis=2) - part_b
        xsum = x_lo + x_hi
        xsum_b = tl.sum(tl.where(in_b, xsum, 0.0), axis=1)    # (VECS,): row-independent
        xsum_a = tl.sum(xsum, axis=1) - xsum_b
        ok_a = row_ok[:, None] & (blk_a < nblk)[None, :]
        ok_b = row_ok[:, None] & (blk_a + 1 < nblk)[None, :]
        at_a = row_at[:, None] + (blk_a * BYTES)[None, :]
        d_a = tl.load(at_a.to(tl.pointer_type(tl.float16)), mask=ok_a, other=0.0).to(tl.float32)
        d_b = tl.load((at_a + BYTES).to(tl.pointer_type(tl.float16)), mask=ok_b, other=0.0).to(tl.float32)
        acc += d_a * (part_a - ZERO * xsum_a[None, :]) + d_b * (part_b - ZERO * xsum_b[None, :])
        if HAS_MIN:
            m_a = tl.load((at_a + 2).to(tl.pointer_type(tl.float16)), mask=ok_a, other=0.0).to(tl.float32)
            m_b = tl.load((at_a + BYTES + 2).to(tl.pointer_type(tl.float16)), mask=ok_b, other=0.0).to(tl.float32)
            acc += m_a * xsum_a[None, :] + m_b * xsum_b[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=row_ok)


def stream_q4_gemv(w, x, out=None, *, has_min=False, block_n=4, vecs=8, num_warps=4, magic=False, xs=None):
    BYTES, OFF = (20, 4) if has_min else (18, 2)
    n, row_bytes = w.shape
    S = triton.cdiv(row_bytes, vecs * 16) * vecs * 16
    if xs is None:
        xs = torch.empty(2 * S, device=x.device, dtype=torch.float32)
    x_stream_kernel[(triton.cdiv(S, 1024),)](x, xs, x.shape[0], row_bytes, S, BYTES=BYTES, OFF=OFF, BLOCK=1024)
    out = torch.empty(n, device=x.device, dtype=torch.float32) if out is None else out
    stream_gemv[(triton.cdiv(n, block_n),)](w, xs, out, n, row_bytes, S, HAS_MIN=has_min, BLOCK_N=block_n,
                                            VECS=vecs, MAGIC=magic, num_warps=num_warps)
    return out



@triton.jit
def dot4(a, b, c, DOT4: tl.constexpr):
    """c + the dot product of a's and b's four signed bytes (int32 each): one instruction on a GPU."""
    if DOT4 == "ptx":
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    elif DOT4 == "amdgcn":
        return tl.inline_asm_elementwise("v_dot4_i32_i8 $0, $1, $2, $3", "=v,v,v,v", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
        return c


@triton.jit
def quantize_x_kernel(x_ptr, xq_ptr, dx_ptr, K, S, BYTES: tl.constexpr, OFF: tl.constexpr, G: tl.constexpr):
    """x in blocks of 32 -> int8 (scale dx = max|x| / 127 per block), laid out along a row's bytes: xq[p] is the x of
    the low nibble of byte p, xq[S + p] the high nibble's (the positions of scales stay 0)."""
    b = tl.program_id(0) * G + tl.arange(0, G)
    j = tl.arange(0, 32)
    ok = (b < K // 32)[:, None]
    xv = tl.load(x_ptr + b[:, None] * 32 + j[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(xv), axis=1)
    dx = amax / 127.0
    v = xv / tl.where(dx > 0, dx, 1.0)[:, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int8)
    tl.store(dx_ptr + b, dx, mask=b < K // 32)
    at = b[:, None] * BYTES + OFF + (j % 16)[None, :] + (j // 16)[None, :] * S
    tl.store(xq_ptr + at, q, mask=ok)


@triton.jit
def dp4a_gemv(w_ptr, xq_ptr, dx_ptr, y_ptr, N, row_bytes, row_units, S, HAS_MIN: tl.constexpr, WORDS: tl.constexpr,
              BLOCK_N: tl.constexpr, VECS: tl.constexpr, DOT4: tl.constexpr, XB: tl.constexpr = False,
              STAGES: tl.constexpr = 1, UNROLL: tl.constexpr = 1):
    """Each row as 16-byte vectors of four 32-bit words; a word's nibbles all belong to one block, a vector's to at
    most two (A, then B); per word two integer dot products of 4 nibbles with 4 bytes of x. WORDS: rows are whole
    32-bit words (row_units = row_bytes / 4); else 16-bit halves put together (row_units = row_bytes / 2)."""
    BYTES: tl.constexpr = 20 if HAS_MIN else 18
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    v = tl.arange(0, VECS)
    i = tl.arange(0, 4)
    nblk = row_bytes // BYTES
    acc = tl.zeros([BLOCK_N, VECS], dtype=tl.float32)
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32))
    for w0 in tl.range(0, S // 4, VECS * 4, num_stages=STAGES, loop_unroll_factor=UNROLL):
        wi = w0 + v[:, None] * 4 + i[None, :]                          # (VECS, 4): word index along the row
        live = (wi * 4 < row_bytes)[None, :, :] & row_ok[:, None, None]
        if WORDS:
            word = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None, None] * row_units
                           + wi[None, :, :], mask=live, other=0)
        else:
            at = w_ptr.to(tl.pointer_type(tl.int16)) + rows.to(tl.int64)[:, None, None] * row_units + 2 * wi[None, :, :]
            lo16 = tl.load(at, mask=live, other=0).to(tl.int32)
            hi16 = tl.load(at + 1, mask=live, other=0).to(tl.int32)
            word = (lo16 & 0xFFFF) | (hi16 << 16)
        x_lo = tl.load(xq32 + wi)                                       # 4 int8 x per word, low nibbles'
        x_hi = tl.load(xq32 + S // 4 + wi)
        if XB:    # x loaded again in the words' own shape: no layout conversion, a load per row
            x_lo3 = tl.load(xq32 + wi[None, :, :] + 0 * rows[:, None, None])
            x_hi3 = tl.load(xq32 + S // 4 + wi[None, :, :] + 0 * rows[:, None, None])
        else:
            x_lo3 = x_lo[None, :, :]
            x_hi3 = x_hi[None, :, :]
        dots = dot4(word & 0x0F0F0F0F, x_lo3, tl.zeros_like(word), DOT4)
        dots = dot4((word >> 4) & 0x0F0F0F0F, x_hi3, dots, DOT4)
        sx = dot4(x_lo, 0x01010101 + tl.zeros_like(x_lo), tl.zeros_like(x_lo), DOT4)
        sx = dot4(x_hi, 0x01010101 + tl.zeros_like(x_hi), sx, DOT4)     # (VECS, 4): the sum of the word's x
        start = (w0 + v * 4) * 4                                         # (VECS,) each vector's first byte
        blk_a = start // BYTES
        in_b = (wi * 4) >= (blk_a + 1)[:, None] * BYTES                 # (VECS, 4): the word is in block B
        dot_b = tl.sum(tl.where(in_b[None, :, :], dots, 0), axis=2)
        dot_a = tl.sum(dots, axis=2) - dot_b
        sx_b = tl.sum(tl.where(in_b, sx, 0), axis=1)
        sx_a = tl.sum(sx, axis=1) - sx_b
        ok_a = blk_a < nblk
        ok_b = blk_a + 1 < nblk
        dx_a = tl.load(dx_ptr + blk_a, mask=ok_a, other=0.0)
        dx_b = tl.load(dx_ptr + blk_a + 1, mask=ok_b, other=0.0)
        at_a = w_ptr + rows.to(tl.int64)[:, None] * row_bytes + (blk_a * BYTES)[None, :]
        m_ok_a = row_ok[:, None] & ok_a[None, :]
        m_ok_b = row_ok[:, None] & ok_b[None, :]
        d_a = tl.load(at_a.to(tl.pointer_type(tl.float16)), mask=m_ok_a, other=0.0).to(tl.float32)
        d_b = tl.load((at_a + BYTES).to(tl.pointer_type(tl.float16)), mask=m_ok_b, other=0.0).to(tl.float32)
        if HAS_MIN:      # w = d q + m: sum d q x + m sum x
            m_a = tl.load((at_a + 2).to(tl.pointer_type(tl.float16)), mask=m_ok_a, other=0.0).to(tl.float32)
            m_b = tl.load((at_a + BYTES + 2).to(tl.pointer_type(tl.float16)), mask=m_ok_b, other=0.0).to(tl.float32)
            acc += (dx_a[None, :] * (d_a * dot_a.to(tl.float32) + m_a * sx_a.to(tl.float32)[None, :])
                    + dx_b[None, :] * (d_b * dot_b.to(tl.float32) + m_b * sx_b.to(tl.float32)[None, :]))
        else:            # w = d (q - 8)
            acc += (dx_a[None, :] * d_a * (dot_a - 8 * sx_a[None, :]).to(tl.float32)
                    + dx_b[None, :] * d_b * (dot_b - 8 * sx_b[None, :]).to(tl.float32))
    tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=row_ok)


@triton.jit
def quantize_plain_kernel(x_ptr, xq_ptr, ds_ptr, K, G: tl.constexpr):
    """x in blocks of 32 -> int8 in x's own order (llama.cpp's Q8_1): xq[32 b + j], and per block ds[b] = (dx, dx *
    sum q) (the sum is what Q4_0's -8 and Q4_1's minimum multiply)."""
    b = tl.program_id(0) * G + tl.arange(0, G)
    j = tl.arange(0, 32)
    ok = (b < K // 32)[:, None]
    xv = tl.load(x_ptr + b[:, None] * 32 + j[None, :], mask=ok, other=0.0).to(tl.float32)
    dx = tl.math.div_rn(tl.max(tl.abs(xv), axis=1), 127.0)
    v = tl.math.div_rn(xv, tl.where(dx > 0, dx, 1.0)[:, None])
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(ds_ptr + 2 * b, dx, mask=b < K // 32)
    tl.store(ds_ptr + 2 * b + 1, dx * tl.sum(q, axis=1), mask=b < K // 32)
    tl.store(xq_ptr + b[:, None] * 32 + j[None, :], q.to(tl.int8), mask=ok)


@triton.jit
def soa_gemv(qs_ptr, d_ptr, m_ptr, xq_ptr, ds_ptr, y_ptr, N, nblk, row_words, HAS_MIN: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, DOT4: tl.constexpr, UNROLL: tl.constexpr = 1,
             PERSIST: tl.constexpr = False, XONCE: tl.constexpr = False, EVICT: tl.constexpr = "",
             D_EVICT: tl.constexpr = "", CM: tl.constexpr = ""):
    """The weights re-laid once (llama.cpp's SYCL backend reorders Q4_0 the same way): a row's nibbles contiguous
    (16 bytes a block, row_words = 4 * nblk 32-bit words), its scales d (and minimums m) in their own (N, nblk)
    fp16 arrays. A block is one 16-byte vector: its 8 words meet 8 words of x in 8 dp4a into one int32, with no
    block boundary inside a vector and no per-word sum of x (ds holds it per block)."""
    b = tl.arange(0, BLOCKS)
    i = tl.arange(0, 4)
    xq32 = xq_ptr.to(tl.pointer_type(tl.int32))
    qs32 = qs_ptr.to(tl.pointer_type(tl.int32))
    step = tl.num_programs(0) * BLOCK_N if PERSIST else N
    if XONCE:     # the whole row in one step (nblk <= BLOCKS): x loaded once a program, kept in registers
        live1 = b < nblk
        x_at1 = xq32 + b[None, :, None] * 8 + i[None, None, :] + tl.zeros([BLOCK_N, 1, 1], tl.int32)
        x_lo1 = tl.load(x_at1, mask=live1[None, :, None], other=0)
        x_hi1 = tl.load(x_at1 + 4, mask=live1[None, :, None], other=0)
    for r0 in tl.range(tl.program_id(0) * BLOCK_N, N, step):
        rows = r0 + tl.arange(0, BLOCK_N)
        row_ok, r64 = rows < N, rows.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCKS], dtype=tl.float32)
        for b0 in tl.range(0, nblk, BLOCKS, loop_unroll_factor=UNROLL):
            blk = b0 + b
            live = blk < nblk
            wi = blk[None, :, None] * 4 + i[None, None, :]                      # (1, BLOCKS, 4)
            ok3 = row_ok[:, None, None] & live[None, :, None]
            word = tl.load(qs32 + r64[:, None, None] * row_words + wi, mask=ok3, other=0, eviction_policy=EVICT,
                           cache_modifier=CM)
            if XONCE:
                x_lo = x_lo1
                x_hi = x_hi1
            else:
                x_at = xq32 + blk[None, :, None] * 8 + i[None, None, :] + 0 * rows[:, None, None]
                x_lo = tl.load(x_at, mask=ok3, other=0)                          # x 0..15 of the block
                x_hi = tl.load(x_at + 4, mask=ok3, other=0)                      # x 16..31
            dots = dot4(word & 0x0F0F0F0F, x_lo, tl.zeros_like(word), DOT4)
            dots = dot4((word >> 4) & 0x0F0F0F0F, x_hi, dots, DOT4)
            dot = tl.sum(dots, axis=2).to(tl.float32)                            # (BLOCK_N, BLOCKS)
            ok2 = row_ok[:, None] & live[None, :]
            d = tl.load(d_ptr + r64[:, None] * nblk + blk[None, :], mask=ok2, other=0.0,
                        eviction_policy=D_EVICT).to(tl.float32)
            dx = tl.load(ds_ptr + 2 * blk, mask=live, other=0.0)[None, :]
            sx = tl.load(ds_ptr + 2 * blk + 1, mask=live, other=0.0)[None, :]
            if HAS_MIN:
                m = tl.load(m_ptr + r64[:, None] * nblk + blk[None, :], mask=ok2, other=0.0).to(tl.float32)
                acc += d * dx * dot + m * sx
            else:
                acc += d * (dx * dot - 8.0 * sx)
        tl.store(y_ptr + rows, tl.sum(acc, axis=1), mask=row_ok)


def pack_soa(wt, nbytes=18):
    """gguf's (N, nblk * nbytes) Q4_0/Q4_1 blocks -> (qs (N, nblk * 16) uint8, d (N, nblk) fp16, m or None)."""
    n = wt.shape[0]
    b = wt.view(n, -1, nbytes)
    d = b[:, :, 0:2].contiguous().view(torch.float16).reshape(n, -1)
    m = b[:, :, 2:4].contiguous().view(torch.float16).reshape(n, -1) if nbytes == 20 else None
    return b[:, :, nbytes - 16:].contiguous().reshape(n, -1), d, m


PACKED = {}     # data_ptr of a layer's gguf tensor -> its pack_soa form


def soa_of(bn, blocks_, nw, unroll=1, programs=None, g=4, qwarps=4, xonce=False, evict="", quantize=True, d_evict="",
           cm=""):
    """y = W @ x on weights packed once by pack_soa (packing outside the timing, like a model load)."""
    kind = "none" if SMOKE else ("amdgcn" if torch.version.hip else "ptx")
    bufs = {}
    if not PACKED:      # every layer packed before any timing: a pack captured into a CUDA graph would be replayed
        PACKED.update({wt.data_ptr(): pack_soa(wt) for wt in up + down})

    def run(wt, a, o):
        qs, d, m = PACKED[wt.data_ptr()]
        k = a.shape[0]
        if k not in bufs:
            bufs[k] = (torch.empty(k, device=dev, dtype=torch.int8), torch.empty(2 * (k // 32), device=dev))
        xq, ds = bufs[k]
        if quantize or k not in run.ready:
            quantize_plain_kernel[(triton.cdiv(k // 32, g),)](a, xq, ds, k, G=g, num_warps=qwarps)
            run.ready.add(k)
        n, nblk = d.shape
        one = xonce and nblk <= blocks_
        grid = min(programs, triton.cdiv(n, bn)) if programs else triton.cdiv(n, bn)
        soa_gemv[(grid,)](qs, d, d if m is None else m, xq, ds, o, n, nblk, 4 * nblk, HAS_MIN=m is not None,
                          BLOCK_N=bn, BLOCKS=blocks_, DOT4=kind, UNROLL=unroll, PERSIST=programs is not None,
                          XONCE=one, EVICT=evict, D_EVICT=d_evict, CM=cm, num_warps=nw)
    run.ready = set()
    return run


SMOKE = os.environ.get("TRITON_INTERPRET") == "1"     # a check of this script on a CPU: tiny shapes, no timing
N, K = (64, 256) if SMOKE else (14336, 4096)
dev = "cpu" if SMOKE else "cuda"
l2 = 0 if SMOKE else torch.cuda.get_device_properties(0).L2_cache_size
layer = blocks.Q4_0.row_bytes(K) * N + blocks.Q4_0.row_bytes(N) * K
LAYERS = max(2, -(-4 * l2 // layer))
up = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=i)).reshape(N, -1).to(dev) for i in range(LAYERS)]
down = [torch.from_numpy(blocks.random_blocks("Q4_0", N * K // 32, seed=99 + i)).reshape(K, -1).to(dev) for i in range(LAYERS)]
x, h, y = torch.randn(K, device=dev), torch.empty(N, device=dev), torch.empty(K, device=dev)


def timed(fn, calls=LAYERS, reps=20):
    """Median ms per call of `fn`, `calls` calls replayed from one CUDA graph (no launch overhead from Python)."""
    if SMOKE:
        fn()
        return 1.0
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


src = torch.ones(1 << (10 if SMOKE else 28), device=dev)
dst = torch.empty_like(src)
def eager(fn, reps=20):
    """Median ms of `fn` timed call by call with CUDA events (no graph: in a graph a copy is a memcpy node, which ran
    at 2.7 TB/s on an H200 where the same copy launched from a stream moved 4.1: lab 08 times it this way)."""
    if SMOKE:
        return 1.0
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


copy = 2 * src.numel() * 4 / eager(lambda: dst.copy_(src)) / 1e6
read = src.numel() * 4 / timed(lambda: src.sum(), calls=4) / 1e6
del src, dst
print(f"{'CPU smoke run' if SMOKE else torch.cuda.get_device_name()}: copy {copy:,.0f} GB/s, read-only (sum) {read:,.0f} GB/s; {LAYERS} layers "
      f"({LAYERS * layer / 2**20:,.0f} MiB of Q4_0) against an L2 of {l2 / 2**20:,.0f} MiB", flush=True)
want = torch.from_numpy(blocks.decode(up[0].cpu().numpy(), "Q4_0")).double() @ x.double().cpu()


def gemv_of(kern, bn, bs, nw, extra):
    """y = W @ x with one of the one-kernel variants (the lab's, blocks3d, magic_*)."""
    def run(wt, a, o):
        kern[(triton.cdiv(wt.shape[0], bn),)](wt, a, o, wt.shape[0], a.shape[0], wt.shape[1], BLOCK_N=bn, BLOCKS=bs,
                                               num_warps=nw, **extra)
    return run


def stream_of(bn, vecs, nw, magic, xb):
    """y = W @ x with the stream variant: x laid out along the row's bytes (one small kernel), then the GEMV."""
    bufs = {}

    def run(wt, a, o):
        if wt.shape[1] not in bufs:
            bufs[wt.shape[1]] = torch.empty(2 * triton.cdiv(wt.shape[1], vecs * 16) * vecs * 16, device=dev)
        xs = bufs[wt.shape[1]]
        S = xs.numel() // 2
        x_stream_kernel[(triton.cdiv(S, 1024),)](a, xs, a.shape[0], wt.shape[1], S, BYTES=18, OFF=2, BLOCK=1024)
        stream_gemv[(triton.cdiv(wt.shape[0], bn),)](wt, xs, o, wt.shape[0], wt.shape[1], S, HAS_MIN=False,
                                                     BLOCK_N=bn, VECS=vecs, MAGIC=magic, XB=xb, num_warps=nw)
    return run


def dp4a_of(bn, vecs, nw, xb=False, quantize=True, stages=1, unroll=1, g=16, qwarps=4, maxnreg=None):
    """y = W @ x with x quantized to int8 per 32 (llama.cpp's Q8 activations), then integer dot products."""
    bufs = {}
    kind = "none" if SMOKE else ("amdgcn" if torch.version.hip else "ptx")

    def run(wt, a, o):
        row_bytes = wt.shape[1]
        S = triton.cdiv(row_bytes, vecs * 16) * vecs * 16
        if row_bytes not in bufs:
            bufs[row_bytes] = (torch.zeros(2 * S, device=dev, dtype=torch.int8),
                               torch.empty(a.shape[0] // 32, device=dev))
        xq, dx = bufs[row_bytes]
        if quantize or not getattr(run, "ready", {}).get(row_bytes):
            quantize_x_kernel[(triton.cdiv(a.shape[0] // 32, g),)](a, xq, dx, a.shape[0], S, BYTES=18, OFF=2, G=g,
                                                                   num_warps=qwarps)
            run.ready = {**getattr(run, "ready", {}), row_bytes: True}
        words = row_bytes % 4 == 0
        dp4a_gemv[(triton.cdiv(wt.shape[0], bn),)](wt, xq, dx, o, wt.shape[0], row_bytes,
                                                   row_bytes // (4 if words else 2), S, HAS_MIN=False, WORDS=words,
                                                   BLOCK_N=bn, VECS=vecs, DOT4=kind, XB=xb, STAGES=stages,
                                                   UNROLL=unroll, num_warps=nw,
                                                   **({"maxnreg": maxnreg} if maxnreg and not SMOKE else {}))
    return run


def measure(name, gemv, cfg, tol=1e-4):
    out = torch.empty(N, device=dev)
    try:
        gemv(up[0], x, out)
        err = ((out.double().cpu() - want).abs().max() / want.abs().max()).item()
        if not err < tol:
            print(name, cfg, f"WRONG: relative error {err:.2e}", flush=True)
            return None
        turn = itertools.count()

        def mlp():
            i = next(turn) % LAYERS
            gemv(up[i], x, h)
            gemv(down[i], h, y)
        return layer / timed(mlp) / 1e6
    except Exception as err:  # noqa: BLE001 - a config the compiler refuses is skipped, named
        print(name, cfg, "failed", str(err).strip().splitlines()[-1][:100], flush=True)
        return None


results = []
only = os.environ.get("VARIANTS", "lab,blocks3d,stream").split(",")
sweeps = {"blocks3d": (blocks3d, itertools.product((4, 8, 16), (8, 16, 32), (2, 4)), {}),
          "magic_bytes": (magic_bytes, itertools.product((2, 4, 8), (32, 64), (4, 8)), {}),
          "magic_words": (magic_words, itertools.product((4, 8), (32, 64), (4, 8)), {})}
for name in [n for n in sweeps if n in only]:
    kern, configs, extra = sweeps[name]
    best = (0,)
    for cfg in configs:
        gbps = measure(name, gemv_of(kern, *cfg, extra), cfg)
        if gbps:
            best = max(best, (gbps, cfg))
            results.append((gbps, name, cfg))
    print(f"{name:<12} best {best[0]:7,.0f} GB/s = {best[0] / copy:.2f} of copy, {best[0] / read:.2f} of read "
          f"(BLOCK_N, BLOCKS, warps) = {best[1:]}", flush=True)
if "lab" in only:       # lab 08's own q4_gemv (its exported cells: utils.solutions, which needs nbformat)
    from utils import solutions
    lab = solutions.load("08")
    packs = {wt.data_ptr(): lab.q4_pack(wt) for wt in up + down}          # once, as a model is loaded
    for per_step, nw, per_sm in ((32, 1, 32), (64, 1, 32), (64, 2, 16), (32, 1, 16)):
        sms = 1 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
        opts = dict(blocks_per_step=per_step, num_warps=nw, programs=None if SMOKE else sms * per_sm)
        gbps = measure("lab", lambda wt, a, o, c=opts: lab.q4_gemv(packs[wt.data_ptr()], a, o, **c),
                       (per_step, nw, per_sm), tol=2e-2)
        results.append((gbps or 0, "lab q4_gemv", (per_step, nw, per_sm)))
        xqs = {}        # x quantized beforehand (per input): the kernel alone

        def kernel_only(wt, a, o, c=opts):
            if a.data_ptr() not in xqs:
                xqs[a.data_ptr()] = lab.quantize_x(a)
            lab.q4_gemv(packs[wt.data_ptr()], xqs[a.data_ptr()], o, **c)
        gbps = measure("lab", kernel_only, (per_step, nw, per_sm, "kernel alone"), tol=2e-2)
        results.append((gbps or 0, "lab q4_gemv, its kernel alone", (per_step, nw, per_sm)))
if "stream" in only:
    stage1 = []
    for bn, vecs, nw in itertools.product((1, 2, 4, 8, 16, 32), (2, 4, 8, 16, 32), (1, 2, 4, 8)):
        if 32 * nw <= bn * vecs <= 32 * nw * 8:
            gbps = measure("stream", stream_of(bn, vecs, nw, True, False), (bn, vecs, nw, "magic"))
            if gbps:
                stage1.append((gbps, (bn, vecs, nw)))
    stage1.sort(reverse=True)
    print("stream, magic conversion, x in its own layout: top 8:",
          ", ".join(f"{g:,.0f} GB/s {c}" for g, c in stage1[:8]), flush=True)
    for gbps, cfg in stage1[:5]:
        results.append((gbps, "stream magic", cfg))
        for magic, xb in ((False, False), (True, True), (False, True)):
            g = measure("stream", stream_of(*cfg, magic, xb), cfg + (magic, xb))
            if g:
                results.append((g, f"stream {'magic' if magic else 'cvt'}{' x-3d' if xb else ''}", cfg))
if "dp4a" in only:      # x quantized to int8: its error against the exact product is that of the quantization
    stage1 = []
    for bn, vecs, nw, xb in itertools.product((1, 2), (16, 32, 64, 128), (1, 2, 4), (False, True)):
        if 32 * nw <= bn * vecs <= 32 * nw * 8:
            gbps = measure("dp4a", dp4a_of(bn, vecs, nw, xb), (bn, vecs, nw, xb), tol=2e-2)
            if gbps:
                stage1.append((gbps, (bn, vecs, nw, xb)))
                results.append((gbps, "dp4a", (bn, vecs, nw, xb)))
    stage1.sort(reverse=True)
    print("dp4a, top 8:", ", ".join(f"{g:,.0f} GB/s {c}" for g, c in stage1[:8]), flush=True)
    for gbps, cfg in stage1[:3]:   # the same without quantizing x each call: what the small kernel costs
        g = measure("dp4a", dp4a_of(*cfg, quantize=False), cfg, tol=2e-2)
        print(f"  {cfg}: {gbps:,.0f} GB/s with x quantized each call, {g or 0:,.0f} GB/s without", flush=True)
    stage2 = []
    for cfg in [c for _, c in stage1[:4]]:  # stage 2: the quantizer's grid, the loop's pipelining and unrolling
        for g, qw, stages, unroll in itertools.product((1, 4, 16), (1, 4), (1, 2, 3), (1, 2)):
            if (g, qw) == (16, 1):
                continue
            gbps = measure("dp4a", dp4a_of(*cfg, stages=stages, unroll=unroll, g=g, qwarps=qw), cfg, tol=2e-2)
            if gbps:
                stage2.append((gbps, cfg, (g, qw, stages, unroll)))
                results.append((gbps, f"dp4a quantizer G={g} warps={qw}, stages={stages}, unroll={unroll}", cfg))
    stage2.sort(reverse=True)
    print("dp4a stage 2, top 6:", ", ".join(f"{g:,.0f} GB/s {c} (G, qwarps, stages, unroll)={o}"
                                           for g, c, o in stage2[:6]), flush=True)
if "dp4a2" in only:     # around run 4's best: more unrolling, two rows or warps a program
    for bn, vecs, nw, unroll in itertools.product((1, 2), (16, 32, 64), (1, 2), (1, 2, 4, 8)):
        if bn * vecs >= 32 * nw:
            cfg = (bn, vecs, nw, True)
            gbps = measure("dp4a", dp4a_of(*cfg, unroll=unroll, g=1, qwarps=4), cfg + (unroll,), tol=2e-2)
            if gbps:
                results.append((gbps, f"dp4a x-3d unroll={unroll}", cfg))
if "dp4a3" in only:     # fewer registers a thread (Nsight Compute: 64, occupancy 50 % at most, 38 % achieved)
    for cfg, unroll, reg in [((1, 32, 1, True), u, r) for u in (1, 2) for r in (None, 32, 40, 48)] + \
                            [((2, 32, 1, False), u, r) for u in (1, 2) for r in (None, 48)]:
        gbps = measure("dp4a", dp4a_of(*cfg, unroll=unroll, g=1, qwarps=4, maxnreg=reg), cfg + (unroll, reg), tol=2e-2)
        if gbps:
            results.append((gbps, f"dp4a unroll={unroll} maxnreg={reg}", cfg))
if "soa" in only:      # the weights re-laid once (nibbles, then scales): one block = one 16-byte vector
    stage1 = []
    for bn, bl, nw, unroll in itertools.product((1, 2, 4), (32, 64, 128, 256), (1, 2, 4, 8), (1, 2)):
        if 32 * nw <= bl <= 32 * nw * 4 and bn * bl <= 512:
            cfg = (bn, bl, nw, unroll)
            gbps = measure("soa", soa_of(*cfg), cfg, tol=2e-2)
            if gbps:
                stage1.append((gbps, cfg))
                results.append((gbps, "soa", cfg))
    stage1.sort(reverse=True)
    print("soa, top 8:", ", ".join(f"{g:,.0f} GB/s {c}" for g, c in stage1[:8]), flush=True)
    sms = 1 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for gbps, cfg in stage1[:3]:      # a persistent grid: each program loops over rows
        for per_sm in (4, 8, 16, 32):
            g = measure("soa", soa_of(*cfg, programs=sms * per_sm), cfg + (f"persistent {per_sm}/SM",), tol=2e-2)
            if g:
                results.append((g, f"soa persistent {per_sm}/SM", cfg))
                print(f"  soa {cfg} persistent {per_sm}/SM: {g:,.0f} GB/s (grid-per-row {gbps:,.0f})", flush=True)
if "dp4a1" in only:     # run 4's best dp4a configuration alone, for a same-run comparison
    g = measure("dp4a", dp4a_of(1, 32, 1, True, unroll=2, g=1, qwarps=4), (1, 32, 1, True, 2), tol=2e-2)
    results.append((g or 0, "dp4a x-3d unroll=2 G=1", (1, 32, 1, True)))
if "soa2" in only:     # around soa's best: x kept in registers, evict-first weights, the quantizer's share
    sms = 1 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    base = [((1, 32, 1, 2), 32), ((1, 64, 1, 1), 32), ((1, 64, 2, 1), None)]
    for cfg, per_sm in base:
        prog = sms * per_sm if per_sm else None
        for evict in ("", "evict_first"):
            g = measure("soa", soa_of(*cfg, programs=prog, evict=evict), cfg + (per_sm, evict), tol=2e-2)
            results.append((g or 0, f"soa2 per_sm={per_sm} evict={evict or '-'}", cfg))
        g = measure("soa", soa_of(*cfg, programs=prog, quantize=False), cfg + (per_sm, "no quantizer"), tol=2e-2)
        results.append((g or 0, f"soa2 per_sm={per_sm} WITHOUT the quantizer", cfg))
    for nw, per_sm, unroll in itertools.product((1, 2, 4), (8, 16, 32), (1, 2)):    # x once: up's 128 blocks
        if per_sm * nw <= 64:
            cfg = (1, 128, nw, unroll)
            g = measure("soa", soa_of(*cfg, programs=sms * per_sm, xonce=True), cfg + (per_sm, "x once"), tol=2e-2)
            results.append((g or 0, f"soa2 x-once per_sm={per_sm}", cfg))
    print("soa2:", ", ".join(f"{g:,.0f} {n} {c}" for g, n, c in results if n.startswith("soa2")), flush=True)
if "soa3" in only:     # evict-first weights (run 3's gain): the grid, the scales' policy, L1 bypass, quantizer
    sms = 1 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    stage = []
    for cfg, per_sm, d_evict, cm in itertools.product(((1, 32, 1, 2), (1, 64, 1, 1), (1, 32, 1, 1), (1, 64, 1, 2)),
                                                     (16, 24, 32), ("", "evict_first"), ("", ".cg")):
        opts = dict(programs=sms * per_sm, evict="evict_first", d_evict=d_evict, cm=cm)
        g = measure("soa", soa_of(*cfg, **opts), cfg + (per_sm, d_evict, cm), tol=2e-2)
        if g:
            stage.append((g, cfg, opts))
            results.append((g, f"soa3 per_sm={per_sm} d_evict={d_evict or '-'} cm={cm or '-'}", cfg))
    stage.sort(key=lambda t: -t[0])
    for g0, cfg, opts in stage[:2]:
        for gq, qw in ((1, 1), (1, 4), (4, 1), (16, 4), (32, 4)):
            g = measure("soa", soa_of(*cfg, g=gq, qwarps=qw, **opts), cfg + (gq, qw), tol=2e-2)
            results.append((g or 0, f"soa3 {opts} quantizer G={gq} warps={qw}", cfg))
        g = measure("soa", soa_of(*cfg, quantize=False, **opts), cfg, tol=2e-2)
        results.append((g or 0, f"soa3 {opts} WITHOUT the quantizer", cfg))
if "stream1" in only:   # the stream variant's best config of the first H200 run (2026-12-02), for comparison
    g = measure("stream", stream_of(4, 32, 4, False, False), (4, 32, 4))
    results.append((g or 0, "stream cvt", (4, 32, 4)))
if "bf16" in only:      # torch.mv (cuBLAS) on BF16 weights, the same rotation and graph
    up16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    down16 = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    x16, h16 = x.bfloat16(), torch.empty(N, device=dev, dtype=torch.bfloat16)
    turn16 = itertools.count()

    def mlp16():
        i = next(turn16) % LAYERS
        torch.mv(up16[i], x16, out=h16)
        torch.mv(down16[i], h16)
    g16 = 2 * N * K * 2 / timed(mlp16) / 1e6
    print(f"torch.mv (bf16, cuBLAS): {g16:,.0f} GB/s = {g16 / copy:.2f} of copy, {g16 / read:.2f} of read", flush=True)
    del up16, down16
results.sort(reverse=True)
print("\nbest ten of every variant (GB/s of Q4_0 bytes read, Llama-3.1-8B MLP up + down, batch 1):")
for gbps, name, cfg in results[:10]:
    print(f"  {gbps:7,.0f} GB/s = {gbps / copy:.2f} of copy, {gbps / read:.2f} of read  {name} {cfg}")
if results and results[0][1].startswith("stream"):
    gbps, name, cfg = results[0]
    bn, vecs, nw = cfg[:3]
    magic, xb = "magic" in name, "x-3d" in name
    run = stream_of(bn, vecs, nw, magic, xb)
    xs = torch.empty(2 * triton.cdiv(up[0].shape[1], vecs * 16) * vecs * 16, device=dev)
    S = xs.numel() // 2
    t_x = timed(lambda: x_stream_kernel[(triton.cdiv(S, 1024),)](x, xs, K, up[0].shape[1], S, BYTES=18, OFF=2,
                                                                   BLOCK=1024), calls=8)
    print(f"the x-stream kernel alone (K={K}): {t_x * 1e3:.1f} us a call; per layer two of them, "
          f"{2 * t_x * 1e3:.1f} us of the layer's {layer / gbps / 1e3:.1f} us")
