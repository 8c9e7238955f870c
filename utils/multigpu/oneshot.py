"""The course's one-shot all-reduce fused with the residual add and RMSNorm: one Triton kernel over symmetric memory.

A tensor-parallel layer ends each half with `h = h + all_reduce(partial)` and the next half starts with
`rms_norm(h)`: three kernels (two with PyTorch's one-shot all-reduce, which already copies and reduces in one) for a
vector of 8 KiB per sequence. `one_shot_all_reduce_add_rms_norm_kernel` does all of it in one, a program a row:

1. store this rank's partial row into its own buffer of symmetric memory (the same allocation on every GPU, each
   mapped into the others' address space over NVLink/xGMI: `torch.distributed._symmetric_memory`);
2. meet the same program on every peer at a barrier of flags in that memory (`_barrier`: each program counts its
   barriers and writes the count into its flag at every peer, then waits for every peer's count in its own flags);
3. load every rank's row with plain loads (rank 0's first on every rank, so all ranks get the same bits), add the
   residual, store h; normalise it (float32, as `utils.multigpu.tp.rms_norm`), scale, store y.

No second barrier: a layer's two calls use two slots of the buffer, and consecutive calls must alternate them. A
rank can write slot s again only after passing the barrier of the call in between, which every peer reaches after
it has read slot s. Triton writes it for NVIDIA and AMD alike (`tl.atomic_xchg` and `tl.atomic_add` at system scope,
no inline PTX); it
is the same idea as vLLM's custom all-reduce and `symm_mem.one_shot_all_reduce` (peer loads; never the NVSwitch's
multicast `multimem` operations, which the course keeps off).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SLOTS = 2      # a layer's two all-reduces (attention, MLP); consecutive calls alternate
_HANDLES: dict[str, "Buffers"] = {}   # group name -> its buffers, set by `register`
_OP = None


@triton.jit
def _barrier(bufs, flags_at, epochs, block, RANK: tl.constexpr, WORLD: tl.constexpr):
    """This program meets program `block` of every peer. Each program counts its barriers (`epochs[block]`, in this
    rank's own memory); at barrier e it writes e into its flag in every peer's buffer and waits until every peer's
    flag in its own buffer has reached e. Release on the write (this program's stores are seen before the flag),
    acquire on the read (the peers' stores are seen after it). Nothing is reset, so a CUDA/HIP graph replays it as
    it is, and no write waits for an answer: one crossing of the link per barrier."""
    e = tl.load(epochs + block) + 1
    tl.store(epochs + block, e)
    peers = tl.arange(0, WORLD)
    others = peers != RANK
    theirs = tl.load(bufs + peers).to(tl.pointer_type(tl.int32)) + flags_at + block * WORLD + RANK
    tl.atomic_xchg(theirs, tl.full([WORLD], 0, tl.int32) + e, mask=others, sem="release", scope="sys")
    mine = tl.load(bufs + RANK).to(tl.pointer_type(tl.int32)) + flags_at + block * WORLD + peers
    behind = tl.sum(others.to(tl.int32))
    while behind > 0:
        seen = tl.atomic_add(mine, tl.zeros([WORLD], tl.int32), mask=others, sem="acquire", scope="sys")
        behind = tl.sum(tl.where(others & (seen - e < 0), 1, 0))     # a wrapped-around count compares right too


@triton.jit
def one_shot_all_reduce_add_rms_norm_kernel(x, residual, weight, h_out, y_out, bufs, flags_at, epochs, slot_offset,
                                            eps, D: tl.constexpr, BLOCK: tl.constexpr, RANK: tl.constexpr,
                                            WORLD: tl.constexpr):
    """Row `program_id` of: h_out = residual + sum over ranks of x; y_out = rms_norm(h_out) * weight."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    dt = x.dtype.element_ty
    bufs = bufs.to(tl.pointer_type(tl.uint64))
    at = slot_offset + row * D + cols
    own = tl.load(bufs + RANK).to(tl.pointer_type(dt))
    tl.store(own + at, tl.load(x + row * D + cols, mask=inside), mask=inside)
    tl.debug_barrier()                   # every thread's store before the flag
    _barrier(bufs, flags_at, epochs, row, RANK, WORLD)
    tl.debug_barrier()                   # the flags before any thread's load
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        part = tl.load(bufs + r).to(tl.pointer_type(dt))
        total += tl.load(part + at, mask=inside, other=0.0).to(tl.float32)
    # the rounding of the unfused path: the all-reduce's sum, then h + it, each in the tensors' dtype
    h = (tl.load(residual + row * D + cols, mask=inside, other=0.0).to(tl.float32)
         + total.to(dt).to(tl.float32)).to(dt)
    hf = h.to(tl.float32)
    normed = (hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / D + eps)).to(dt)
    y = (tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dt)
    tl.store(h_out + row * D + cols, h, mask=inside)
    tl.store(y_out + row * D + cols, y, mask=inside)


def layout(rows: int, hidden: int, dtype, world: int) -> tuple[int, int]:
    """Bytes of one rank's symmetric buffer for `rows` x `hidden` values of `dtype` in `SLOTS` slots, then a flag
    (int32) per (row, rank); and where the flags start, in int32s from the buffer's start."""
    data = -(-SLOTS * rows * hidden * dtype.itemsize // 16) * 16
    return data + 4 * rows * world, data // 4


class Buffers:
    """One group's symmetric buffer (`raw`: bytes, the slots then the `flags`), the device address table of every
    rank's buffer (a rendezvous handle's `buffer_ptrs_dev`), and this rank's barrier counts (`epochs`, one a row)."""

    def __init__(self, raw: torch.Tensor, handle, *, rows: int, hidden: int, dtype):
        self.world, self.rank = handle.world_size, handle.rank
        size, self.flags_at = layout(rows, hidden, dtype, self.world)
        self.raw, self.handle, self.rows, self.hidden, self.dtype = raw, handle, rows, hidden, dtype
        self.flags = raw[4 * self.flags_at: size].view(torch.int32)
        self.epochs = torch.zeros(rows, dtype=torch.int32, device=raw.device)


def register(group_name: str, buffers: Buffers) -> None:
    """Make `buffers` the ones the op uses for the group `group_name`."""
    _HANDLES[group_name] = buffers


def launch(x, residual, weight, eps: float, *, buffer_ptrs: int, flags_at: int, epochs, rank: int, world: int,
           slot_offset: int):
    """Run the kernel on [rows, D] `x` (this rank's partial sums), `residual` and [D] `weight`; returns (h, y).
    `buffer_ptrs`: the device address of a table of every rank's buffer address; `flags_at`: where the flags start
    in each buffer (int32s); `epochs`: this rank's barrier counts, one a row; `slot_offset`: where this call's slot
    starts in each buffer (elements of x's dtype)."""
    rows, D = x.shape
    h_out, y_out = torch.empty_like(residual), torch.empty_like(residual)
    block = triton.next_power_of_2(D)
    one_shot_all_reduce_add_rms_norm_kernel[(rows,)](
        x, residual, weight, h_out, y_out, buffer_ptrs, flags_at, epochs, slot_offset, eps,
        D=D, BLOCK=block, RANK=rank, WORLD=world, num_warps=max(1, min(16, block // 256)))
    return h_out, y_out


def op():
    """`course::one_shot_all_reduce_add_rms_norm(x, residual, weight, eps, group_name, slot) -> (h, y)`, an opaque
    operation to torch.compile (one kernel in the compiled step, captured by a CUDA/HIP graph like any other)."""
    global _OP
    if _OP is not None:
        return _OP

    @torch.library.custom_op("course::one_shot_all_reduce_add_rms_norm", mutates_args=())
    def one_shot_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                         group_name: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = _HANDLES[group_name]
        D = x.shape[-1]
        rows = x.numel() // D
        if x.dtype != b.dtype or D != b.hidden or rows > b.rows:
            raise ValueError(f"one-shot all-reduce of {tuple(x.shape)} {x.dtype}: the symmetric buffer holds "
                             f"{b.rows} rows of {b.hidden} x {b.dtype}")
        if slot not in range(SLOTS):
            raise ValueError(f"slot={slot}: use 0 or 1, alternating")
        h, y = launch(x.reshape(rows, D).contiguous(), residual.reshape(rows, D).contiguous(), weight, eps,
                      buffer_ptrs=b.handle.buffer_ptrs_dev, flags_at=b.flags_at, epochs=b.epochs, rank=b.rank,
                      world=b.world, slot_offset=slot * b.rows * b.hidden)
        return h.view(residual.shape), y.view(residual.shape)

    @one_shot_all_reduce_add_rms_norm.register_fake
    def _(x, residual, weight, eps, group_name, slot):
        return (torch.empty_like(residual, memory_format=torch.contiguous_format),
                torch.empty_like(residual, memory_format=torch.contiguous_format))

    _OP = one_shot_all_reduce_add_rms_norm
    return _OP
