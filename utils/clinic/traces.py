"""One decode step under torch.profiler: every GPU kernel (or CPU operator) with the module that ran it, its role
(GEMM, attention, norm, elementwise, ...) and the library it comes from; the other vendor's kernels from a described
trace (`utils/data/decode_traces.json`) to put beside it."""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

from utils.base.paths import DATA_DIR

TRACES_FILE = DATA_DIR / "decode_traces.json"
ROLES = ("GEMM", "attention", "norm", "elementwise", "embedding", "copy")

# (pattern, library) in order; the first match names the library of a kernel or operator.
LIBRARIES = [
    (r"^nvjet|xmma_gemm|_cublas|cublasLt|gemvx|gemv2T|gemmSN|splitKreduce", "cuBLAS"),
    (r"^Cijk_", "hipBLASLt / rocBLAS (Tensile kernels)"),
    (r"cudnn", "cuDNN"),
    (r"pytorch_flash|flash_fwd|flash::", "FlashAttention (built into PyTorch)"),
    (r"fmha_cutlass|AttentionKernel|mem_eff", "PyTorch memory-efficient attention (CUTLASS)"),
    (r"^attn_fwd|aotriton", "AOTriton (PyTorch's attention on ROCm)"),
    (r"ck_tile|^ck::|fmha_fwd", "Composable Kernel (CK)"),
    (r"^triton_|^triton", "Triton (generated)"),
    (r"at::native|^void at::|elementwise_kernel|reduce_kernel", "PyTorch's own kernels (ATen)"),
    (r"^aten::(mm|addmm|bmm|baddbmm)$", "ATen CPU GEMM (oneDNN / MKL / OpenBLAS)"),
    (r"^aten::_scaled_dot_product", "ATen CPU attention (flash-style, C++)"),
    (r"^aten::", "ATen CPU operators"),
]
_GEMM = re.compile(r"^nvjet|gemm|gemv|^Cijk_|^aten::(mm|addmm|bmm|baddbmm)$", re.IGNORECASE)
_ATTENTION = re.compile(r"flash|fmha|attn_fwd|sdpa|scaled_dot_product|attention", re.IGNORECASE)
_COPY = re.compile(r"copy|^aten::(cat|index_copy_?|clone|_to_copy|to)$|CatArrayBatched|cat_", re.IGNORECASE)
_TRIVIAL = re.compile(r"^aten::(empty.*|view|reshape|_reshape_alias|as_strided|expand|t|transpose|permute|unsqueeze|"
                      r"squeeze|slice|select|detach|alias|_unsafe_view|contiguous|resolve_conj|resolve_neg|"
                      r"lift_fresh|split|chunk|unbind|narrow|lift|item|_local_scalar_dense|size|stride|result_type|"
                      r"is_nonzero|zeros|ones|full|fill_|arange|scalar_tensor|broadcast_to|linear|matmul|dropout|"
                      r"scaled_dot_product_attention|embedding|_has_compatible_shallow_copy_type|numpy_T|"
                      r"expand_as|view_as|type_as|repeat_interleave|_assert_async|new_empty.*|to|_to_copy)$")


def library(name: str) -> str:
    return next((lib for pattern, lib in LIBRARIES if re.search(pattern, name)), "other")


def role(name: str, module_kind: str) -> str:
    """A kernel's or operator's role, from its name first, else from the module that ran it."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "GEMM"
    if "Norm" in module_kind:
        return "norm"
    if "Embedding" in module_kind and "Rotary" not in module_kind:
        return "embedding"
    if _COPY.search(name):
        return "copy"
    return "elementwise"


@dataclass(frozen=True)
class Item:
    module: str          # the innermost module that ran it
    module_kind: str
    name: str            # kernel name (GPU) or operator (CPU)
    role: str
    library: str
    time_us: float


@dataclass
class Trace:
    label: str
    kind: str            # "GPU kernels" | "CPU operators" | "described"
    items: list[Item]
    about: str = ""

    def by_role(self) -> dict:
        """{role: {"count", "time_us", "libraries": {library: count}, "example"}} in ROLES order."""
        out = {}
        for it in self.items:
            r = out.setdefault(it.role, {"count": 0, "time_us": 0.0, "libraries": defaultdict(int), "example": it.name})
            r["count"] += 1
            r["time_us"] += it.time_us
            r["libraries"][it.library] += 1
        order = {r: i for i, r in enumerate(ROLES)}
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def _module_ranges(model):
    """Forward pre/post hooks that open and close a profiler range "module:<name>:<class>" around every module."""
    from torch.autograd.profiler import record_function

    stack, handles = [], []
    for name, module in model.named_modules():
        label = f"module:{name or '(model)'}:{type(module).__name__}"

        def pre(mod, args, label=label):
            rf = record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(mod, args, output):
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    return handles


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 for the block: the profiler's C++ side prints a 'profiler_start/stop' line
    there, which is not an error."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _is_work(event) -> bool:
    return event.name.startswith("aten::") and not _TRIVIAL.match(event.name)


def _has_work(event) -> bool:
    return _is_work(event) or any(_has_work(c) for c in event.cpu_children)


def _owner(event) -> tuple[str, str]:
    e = event
    while e is not None:
        if e.name.startswith("module:"):
            _, name, kind = e.name.split(":", 2)
            return name, kind
        e = e.cpu_parent
    return "(outside the model)", ""


@torch.no_grad()
def decode_step(model, batch: dict, *, label: str | None = None) -> Trace:
    """Prefill `batch` (a `divergence.prompt_batch`), then profile one greedy decode step with a KV cache.
    On a GPU the items are the kernels it launched; on a CPU the innermost ATen operators that did work (wrappers
    such as aten::linear -> aten::matmul -> aten::mm count once, as aten::mm)."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    feed = {k: v.to(device) for k, v in batch.items()}
    out = model(**feed, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    step = {"input_ids": nxt,
            "attention_mask": torch.cat([feed["attention_mask"], torch.ones_like(nxt)], dim=1),
            "position_ids": feed["position_ids"][:, -1:] + 1,
            "past_key_values": out.past_key_values, "use_cache": True}
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    handles = _module_ranges(model)
    try:
        with _quiet_native_stderr(), profile(activities=activities) as prof:
            model(**step)
            if gpu:
                torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    items = []
    for e in prof.events():
        if e.name.startswith("module:"):
            continue
        if gpu:
            for k in e.kernels:
                module, kind = _owner(e)
                items.append(Item(module, kind, k.name, role(k.name, kind), library(k.name), float(k.duration)))
        elif _is_work(e) and not any(_has_work(c) for c in e.cpu_children):
            module, kind = _owner(e)
            items.append(Item(module, kind, e.name, role(e.name, kind), library(e.name), float(e.self_cpu_time_total)))
    what = "GPU kernels" if gpu else "CPU operators"
    return Trace(label or f"{what} of one decode step on {torch.cuda.get_device_name(device) if gpu else 'the CPU'}",
                 what, items)


def described() -> dict:
    """The described traces: {key: {"label", "about", "roles": {role: {"library", "kernels": [...]}}}}."""
    data = json.loads(TRACES_FILE.read_text())
    data.pop("_about", None)
    return data


def comparison(trace: Trace, other_keys) -> list[dict]:
    """Rows per role: this trace's count, time share, libraries and an example name, beside each described trace's
    library and kernel names for the same role."""
    table = described()
    roles = trace.by_role()
    total = sum(r["time_us"] for r in roles.values()) or 1.0
    rows = []
    for name in ROLES:
        mine = roles.get(name)
        others = {k: table[k]["roles"].get(name) for k in other_keys}
        if not mine and not any(others.values()):
            continue
        rows.append({
            "role": name,
            "count": mine["count"] if mine else 0,
            "share": (mine["time_us"] / total) if mine else 0.0,
            "libraries": ", ".join(sorted(mine["libraries"], key=lambda lib: -mine["libraries"][lib])) if mine else "-",
            "example": mine["example"] if mine else "-",
            **{k: (f"{o['library']}: {o['kernels'][0]}" if o else "-") for k, o in others.items()},
        })
    return rows


def print_comparison(trace: Trace, other_keys, width: int = 60) -> None:
    cut = lambda s: s if len(s) <= width else s[:width - 1] + "…"
    table = described()
    print(f"{trace.label} ({len(trace.items)} {trace.kind})")
    for row in comparison(trace, other_keys):
        print(f"  {row['role']:<11} {row['count']:>4} x, {100 * row['share']:5.1f}% of the time  {cut(row['libraries'])}")
        print(f"  {'':<11} e.g. {cut(row['example'])}")
        for k in other_keys:
            print(f"  {'':<11} {table[k]['vendor']}: {cut(row[k])}")
