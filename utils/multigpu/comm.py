"""How the tensor-parallel ranks talk: NCCL/RCCL (or gloo) collectives, or a one-shot all-reduce over symmetric memory.

Both classes have the two methods `utils.multigpu.tp.TPLlama` calls, `all_reduce(x)` (the sum over the ranks) and
`all_gather(x)` ([part] rows of every rank stacked), and both return new tensors, so `torch.compile` traces them and
a CUDA/HIP graph captures them with the rest of a decode step.

- `Collectives`: torch.distributed's functional collectives: NCCL on NVIDIA, RCCL on AMD (PyTorch's "nccl"
  backend either way), gloo on CPUs. NCCL picks its algorithm (ring, tree) and protocol per message size.
- `SymmMemCollectives`: the all-reduce of one token's hidden vector as a **one-shot** all-reduce: every rank copies
  its partial sum into a buffer of *symmetric memory* (`torch.distributed._symmetric_memory`: the same allocation on
  every GPU, each mapped into the others' address space over NVLink/xGMI), the ranks meet at a barrier of flags in
  that memory, and every rank reads all peers' buffers with plain loads and adds them, then a second barrier says
  the buffers may be reused. One kernel, no protocol: what vLLM's custom all-reduce and PyTorch's
  `symm_mem.one_shot_all_reduce` do for small messages. It uses peer loads only, never the NVSwitch's multicast
  (`multimem`) operations, which the course keeps off (`utils.multigpu.launch.NVLS_OFF`).
- `OneShotNormCollectives`: the course's own one-shot kernel (`utils.multigpu.oneshot`, Triton), which also adds the
  residual and applies the next RMSNorm in the same kernel: `all_reduce_add_norm(x, residual, weight, eps, slot)`.
"""
from __future__ import annotations

import torch

from utils.multigpu import oneshot

# Symmetric-memory buffers by process-group name, set by SymmMemCollectives; the one-shot op reads them (an op's
# arguments are tensors, and this buffer must stay the one allocation every rank rendezvoused on, never a copy).
_BUFFERS: dict[str, torch.Tensor] = {}
_OP = None


class Collectives:
    """The split's two collectives over a torch.distributed group (functional collectives: they return new tensors,
    so torch.compile can trace them and a CUDA/HIP graph can capture them)."""

    name = "nccl"

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.name = dist.get_backend(self.group)

    def all_reduce(self, x):
        import torch.distributed._functional_collectives as fc

        return fc.all_reduce(x, "sum", self.group)

    def all_gather(self, x):
        """[rows, part] on every rank -> [ranks * rows, part], rank r's rows at r * rows."""
        import torch.distributed._functional_collectives as fc

        gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor   # the newer name, same call
        return gather(x, 0, self.group)


def symm_skip_reason(device) -> str | None:
    """Why the symmetric-memory all-reduce cannot run on `device` with this PyTorch, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"symmetric memory needs GPUs (CUDA or ROCm); this rank runs on {device.type}"
    ops = torch.ops.symm_mem
    if not hasattr(ops, "one_shot_all_reduce"):
        return "this PyTorch build has no torch.ops.symm_mem.one_shot_all_reduce"
    import torch.distributed as dist

    if dist.is_initialized():
        world = dist.get_world_size()
        if world < 2:
            return "one rank: there is nothing to all-reduce"
        me = device.index if device.index is not None else torch.cuda.current_device()
        peers = [d for d in range(torch.cuda.device_count()) if d != me][: world - 1]
        blocked = [d for d in peers if not torch.cuda.can_device_access_peer(me, d)]
        if blocked:
            return f"GPU {me} cannot load from GPU(s) {blocked} directly (no peer access: PCIe without P2P?)"
    return None


def _one_shot_op():
    """The course's op `course::one_shot_all_reduce(x, group_name)`: an opaque operation to torch.compile (so it
    stays one kernel in the compiled step, wherever the PyTorch version's own lowering of symm_mem ops stands)."""
    global _OP
    if _OP is not None:
        return _OP

    @torch.library.custom_op("course::one_shot_all_reduce", mutates_args=())
    def one_shot_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
        buf = _BUFFERS[group_name]
        if x.dtype != buf.dtype or x.numel() > buf.numel():
            raise ValueError(f"one-shot all-reduce of {tuple(x.shape)} {x.dtype}: the symmetric buffer holds "
                             f"{buf.numel()} x {buf.dtype}")
        x = x.contiguous()
        view = buf[: x.numel()].view(x.shape)
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_copy"):        # the copy into the buffer inside the same kernel
            return ops.one_shot_all_reduce_copy(view, x, "sum", group_name)
        view.copy_(x)
        return ops.one_shot_all_reduce(view, "sum", group_name)

    @one_shot_all_reduce.register_fake
    def _(x, group_name):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _OP = one_shot_all_reduce
    return _OP


class _SymmetricCollectives(Collectives):
    """What both symmetric-memory classes share: refused with the reason where symmetric memory cannot run, their
    own `name`, and the group's name (what a rendezvous and the ops take)."""

    def __init__(self, group, device):
        reason = symm_skip_reason(device)
        if reason:
            raise RuntimeError(reason)
        super().__init__(group)
        self.name = type(self).name
        self.group_name = self.group.group_name


class SymmMemCollectives(_SymmetricCollectives):
    """`all_reduce` as a one-shot all-reduce over symmetric memory (see the module docstring) for tensors of up to
    `numel` elements of `dtype`; `all_gather` stays NCCL's. Every rank of the group must construct it together (the
    buffer's rendezvous is collective)."""

    name = "symmetric memory (one-shot)"

    def __init__(self, group=None, *, numel: int, dtype, device):
        super().__init__(group, device)
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        _BUFFERS[self.group_name] = self.buffer
        self.op = _one_shot_op()

    def all_reduce(self, x):
        return self.op(x, self.group_name)


class OneShotNormCollectives(_SymmetricCollectives):
    """`all_reduce_add_norm` as one kernel (`utils.multigpu.oneshot`): the one-shot all-reduce of up to `rows` rows of
    `hidden` numbers over symmetric memory, the residual add and the RMSNorm after it; `all_gather` stays NCCL's.
    Every rank of the group must construct it together (the buffer's rendezvous is collective)."""

    name = "one-shot all-reduce + add + RMSNorm (Triton, symmetric memory)"

    def __init__(self, group=None, *, rows: int, hidden: int, dtype, device):
        super().__init__(group, device)
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size(self.group)
        size, _ = oneshot.layout(rows, hidden, dtype, world)
        raw = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self.buffers = oneshot.Buffers(raw, symm_mem.rendezvous(raw, self.group_name), rows=rows, hidden=hidden,
                                       dtype=dtype)
        # the flags start at 0 on every rank before any rank can raise one (this memory may have held an older
        # buffer's flags): zero ours, then meet
        self.buffers.flags.zero_()
        torch.cuda.synchronize(device)
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        torch.cuda.synchronize(device)
        oneshot.register(self.group_name, self.buffers)
        self.op = oneshot.op()

    def all_reduce_add_norm(self, x, residual, weight, eps: float, slot: int):
        """(residual + the sum of `x` over the ranks, its RMSNorm times `weight`); consecutive calls alternate `slot`
        between 0 and 1."""
        return self.op(x, residual, weight, eps, self.group_name, slot)
