"""Lab 04's graders (exercises 4.1-4.4), with the seeded inputs they build and flash-attn's tolerance rule they apply."""
import contextlib
import hashlib
import json
import numbers
import os
import random
import subprocess
import sys
import tempfile
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
from triton.runtime.errors import OutOfResources

from utils import solutions
from utils.base.paths import REPO_ROOT, build_dir
from utils.exercises import ExerciseFailed, check, error_line, is_not_done, unfinished
from utils import grading_guard, isa

LAYOUTS = ("contiguous", "model", "q_transposed", "v_transposed", "head_dim_slice", "kv_broadcast")


def make_inputs(batch, heads, n, d, layout="contiguous", dtype=torch.bfloat16, device="cpu", seed=0):
    """Seeded q, k, v of shape (batch, heads, n, d) in one of LAYOUTS: "model" is what a transformers model passes,
    (batch, n, heads, d) transposed to (batch, heads, n, d) for all three; "q_transposed" / "v_transposed" that
    layout for q or v alone; "head_dim_slice" the first d of a wider head dim; "kv_broadcast" k and v of one head
    expanded over the heads (stride 0)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    bnhd = lambda: rand(batch, n, heads, d).transpose(1, 2)
    if layout == "contiguous":
        return rand(batch, heads, n, d), rand(batch, heads, n, d), rand(batch, heads, n, d)
    if layout == "model":
        return bnhd(), bnhd(), bnhd()
    if layout == "q_transposed":
        return bnhd(), rand(batch, heads, n, d), rand(batch, heads, n, d)
    if layout == "v_transposed":
        return rand(batch, heads, n, d), rand(batch, heads, n, d), bnhd()
    if layout == "head_dim_slice":
        return tuple(rand(batch, heads, n, d + 24)[..., :d] for _ in range(3))
    if layout == "kv_broadcast":
        return rand(batch, heads, n, d), rand(batch, 1, n, d).expand(batch, heads, n, d), \
            rand(batch, 1, n, d).expand(batch, heads, n, d)
    raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")


def reference(q, k, v, causal=False, sm_scale=None):
    """Attention in fp32 (SDPA's MATH backend on fp32 copies): what every kernel is compared with."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, scale=sm_scale)


def within_tolerance(out, q, k, v, causal=False, sm_scale=None, floor=1e-3):
    """flash-attn's rule: the max error against the fp32 reference is at most twice PyTorch's own in q's dtype plus
    `floor`. PyTorch's own: SDPA MATH, and on a GPU also SDPA's FLASH and EFFICIENT kernels, which round as the flash
    algorithm does (on the H100, at N=100 D=128 causal, every correct flash kernel, SDPA's included, errs 0.0119
    where MATH errs 0.0039). Returns (ok, error, allowed); NaN and a wrong shape fail."""
    ref = reference(q, k, v, causal, sm_scale)
    backends = [SDPBackend.MATH] + ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if q.is_cuda else [])
    errors = []
    for backend in backends:
        try:
            with sdpa_kernel(backend):
                torch_out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)
        except RuntimeError:          # a backend that does not take these inputs (head dim, layout, GPU)
            continue
        errors.append((torch_out.float() - ref).abs().max().item())
    allowed = 2 * max(errors) + floor
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return False, float("inf"), allowed
    err = (out.float() - ref).abs().max().item()
    return err <= allowed, err, allowed          # NaN <= x is False


def _raise_if_not_done(err: BaseException) -> None:
    """Let an exercise stub's own error through (the lab says NOT DONE for it); anything else is the answer's."""
    if is_not_done(err):
        raise err


def _describe(t) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else type(t).__name__


# --- 4.1: naive attention's peak memory ----------------------------------------------------------------

def check_prediction(predict, measured):
    """Exercise 4.1: `predict(batch, heads, n)` against the measured peaks [(batch, heads, n, bytes), ...], then at
    twice the batch and twice the heads (naive attention's N x N tensors are one per sequence and head, so its peak
    grows with both: on a CPU the lab measures B=1, where a formula without the batch would agree)."""
    name = "your prediction is within 5% of the measured peak at every N"

    def predicted(batch, heads, n):
        try:
            return predict(batch, heads, n)
        except Exception as err:                     # the stub's NotImplementedError: NOT DONE
            _raise_if_not_done(err)
            check(name, False, f"predict_peak_bytes({batch}, {heads}, {n}) raised {error_line(err)}: return a "
                               "number of bytes")

    def off(want, got):
        number = isinstance(want, numbers.Real) and not isinstance(want, bool)
        return not number or not abs(want - got) <= 0.05 * got, number

    for batch, heads, n, got in measured:
        want = predicted(batch, heads, n)
        scores = batch * heads * n * n
        wrong, number = off(want, got)
        if wrong:
            said = f"{want:,.0f} bytes ({want / scores:.3g} per score)" if number else f"{want!r}, not a number"
            missing = [what for what, k in (("heads", heads), ("batch", batch))
                       if number and k > 1 and abs(want * k - got) <= 0.05 * got]
            why = (f"each {'head' if missing[0] == 'heads' else 'sequence of the batch'} has its own N x N tensors: "
                   f"your formula does not grow with the {missing[0]}") if missing else (
                "list the N x N tensors alive at once while the softmax runs, with their dtypes")
            check(name, False, f"at B={batch} H={heads} N={n} you predict {said}, the measurement says {got:,} bytes "
                               f"({got / scores:.3g} per score): {why}")
    for batch, heads, n, got in measured:
        for kb, kh, what, why in ((2, 1, "batch", "sequence of the batch"), (1, 2, "heads", "head")):
            want = predicted(batch * kb, heads * kh, n)
            wrong, number = off(want, got * kb * kh)
            if wrong:
                said = f"{want:,.0f} bytes" if number else f"{want!r}, not a number"
                same = number and abs(want - predicted(batch, heads, n)) <= 0.05 * got
                check(name, False, f"at B={batch * kb} H={heads * kh} N={n} you predict {said}, but naive attention "
                                   f"holds twice what it holds at B={batch} H={heads} ({2 * got:,} bytes): each "
                                   f"{why} has its own N x N tensors" +
                                   (f"; your formula does not grow with the {what}" if same else ""))
    batch, heads, n, got = max(measured, key=lambda m: m[2])    # the longest: scaled to a size drawn per grade
    rng = random.Random(grading_guard.fresh_seed())
    b, h, m = batch * rng.randint(1, 4), heads * rng.randint(1, 4), rng.randint(n // 2, 2 * n)
    holds = got * b * h * m * m / (batch * heads * n * n)
    want = predicted(b, h, m)
    wrong, number = off(want, holds)
    if wrong:
        said = f"{want:,.0f} bytes" if number else f"{want!r}, not a number"
        check(name, False, f"at B={b} H={h} N={m} (a size drawn for this grade) you predict {said}, and naive "
                           f"attention holds {holds:,.0f} there (what it holds at B={batch} H={heads} N={n}, {got:,} "
                           "bytes, scaled: its N x N tensors, one per sequence and head): a formula of batch, heads "
                           "and n, right at every size, not only at the measured ones")
    check(name, True, "")


# --- 4.2, 4.3: the kernel's update and its causal blocks ------------------------------------------------

SPREAD_TOLERANCE = 5e-2   # max abs error where scores spread over hundreds: a right kernel errs ~1e-2 (bf16 p)


def spread_inputs(batch, heads, n, d, dtype=torch.bfloat16, device="cpu", seed=0):
    """q, k, v whose scores spread over hundreds (at sm_scale=1): every query is large along one direction, the
    first 32 keys along it and the later keys against it, so each row's first key block holds its maximum and the
    later blocks' scores lie far below it. Without the running max, exp2 overflows (inf, then NaN); with only each
    block's own max, alpha = exp2(old max - block max) does."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q = rand(batch, heads, n, d) + 2.0
    k = rand(batch, heads, n, d) + 2.0
    k[..., 32:, :] -= 4.0
    v = rand(batch, heads, n, d)
    return tuple(t.to(device, dtype) for t in (q, k, v))


def _within(out, q, k, v, causal, sm_scale, spread):
    if spread:
        ref = reference(q, k, v, causal, sm_scale)
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
            return False, float("inf"), SPREAD_TOLERANCE
        err = (out.float() - ref).abs().max().item()
        return err <= SPREAD_TOLERANCE, err, SPREAD_TOLERANCE
    return within_tolerance(out, q, k, v, causal, sm_scale)


def _run(attention, q, k, v, causal, sm_scale, name):
    """attention(q, k, v, causal[, sm_scale]); an exception becomes a hint that names the inputs, and so does an
    answer that wrote into q, k or v (the reference is computed from them after the call)."""
    try:
        out, changed = grading_guard.changed_inputs(
            (q, k, v), lambda *qkv: attention(*qkv, causal) if sm_scale is None else attention(*qkv, causal, sm_scale),
            ["q", "k", "v"])
        if changed:
            check(name, False, f"your code changed its input {', '.join(changed)} ({_describe(q)}): attention only "
                               "reads q, k and v; scale the scores in registers (qk * sm_scale), never the inputs")
        return out
    except ExerciseFailed:
        raise
    except Exception as err:                         # the stub's NotImplementedError: NOT DONE
        _raise_if_not_done(err)
        where = ("the arguments of your two attn_blocks calls (as in flash_attention's non-causal call, with "
                 "CAUSAL=True), then " if causal else "")
        check(name, False, f"attention(q, k, v, causal={causal}{'' if sm_scale is None else f', sm_scale={sm_scale}'}) "
                           f"with q, k, v {_describe(q)} raised {error_line(err)}: check {where}the shapes and dtypes "
                           "of the tiles in the online-softmax update (p is BLOCK_M x BLOCK_N, acc BLOCK_M x D; l_i and "
                           "m_i one value per row; tl.dot takes p.to(v.dtype))")


# (batch, heads, n, d, layout or "spread", dtype, sm_scale): the cases each grader adds to the printed ones,
# checked without a line of their own. Spread scores, sm_scale=8, batch > 1, FP16, a broadcast and a sliced layout,
# and v alone in a model's layout (its rows another stride apart than k's).
HIDDEN_CASES = [(2, 1, 100, 64, "spread", torch.bfloat16, 1.0), (1, 1, 77, 48, "spread", torch.float16, 1.0),
                (2, 1, 97, 32, "contiguous", torch.bfloat16, 8.0), (1, 2, 45, 48, "kv_broadcast", torch.float16, None),
                (1, 1, 70, 80, "head_dim_slice", torch.bfloat16, 3.0),
                (1, 2, 70, 64, "v_transposed", torch.bfloat16, None)]


def fresh_cases(seed: int) -> list[tuple]:
    """Two cases drawn from `seed` (a grade's `fresh_seed`), small (the interpreter is slow): batch, heads, length,
    head dim (a multiple of 8 from 16 to 128), layout, dtype and sm_scale at random, and spread scores at a random
    length and head dim; as HIDDEN_CASES with the seed of their values last."""
    rng = random.Random(seed)
    dtype = lambda: rng.choice((torch.bfloat16, torch.float16))
    batch, heads = rng.choice(((1, 1), (1, 2), (2, 1)))
    return [(batch, heads, rng.randint(1, 160), 8 * rng.randint(2, 16), rng.choice(LAYOUTS), dtype(),
             rng.choice((None, round(rng.uniform(0.05, 1.5), 3))), seed),
            (1, 1, rng.randint(40, 160), 8 * rng.randint(2, 12), "spread", dtype(), 1.0, seed)]


def _cases() -> list[tuple]:
    """HIDDEN_CASES (their values seeded by their size) and this grade's fresh_cases."""
    return [(*case, None) for case in HIDDEN_CASES] + fresh_cases(grading_guard.fresh_seed())


def _layout_hint(attention, q, k, v, causal, sm_scale, spread):
    """For a wrong output on inputs not all contiguous: a stride hint if contiguous copies of the same values come
    out right (else None), so that a wrong stride is not blamed on the masks or the update."""
    strided = [(name, t) for name, t in zip("qkv", (q, k, v)) if not t.is_contiguous()]
    if not strided:
        return None
    same = [t.contiguous() for t in (q, k, v)]
    try:
        out = _run(attention, *same, causal, sm_scale, "attention on contiguous copies")
    except ExerciseFailed:
        return None
    if not _within(out, *same, causal, sm_scale, spread)[0]:
        return None
    laid = ", ".join(f"{name} {tuple(t.shape)} with strides {t.stride()}" for name, t in strided)
    return (f"right on contiguous copies of these q, k and v, wrong with {laid}: a stride, not the masks or the "
            "update: each tensor's rows are its own row stride apart, so pass k's (stride_kn) with k and v's "
            "(stride_vn) with v, as flash_attention's non-causal call passes them to attn_blocks")


def _hidden(attention, device, causal, cases, name="attention", spread_only=False):
    """The `cases` (or only those with spread scores) that fail: (label, output, error, allowed, spread, (q, k, v),
    the stride hint if the layout is what is wrong)."""
    for batch, heads, n, d, layout, dtype, sm_scale, seed in cases:
        spread = layout == "spread"
        if spread_only and not spread:
            continue
        q, k, v = (spread_inputs(batch, heads, n, d, dtype, device, seed=n if seed is None else seed) if spread else
                   make_inputs(batch, heads, n, d, layout, dtype, device, seed=n + d if seed is None else seed))
        what = (f"{name} B={batch} H={heads} N={n} D={d} {'spread scores' if spread else layout} {str(dtype)[6:]}"
                f"{'' if sm_scale is None else f' sm_scale={sm_scale:g}'}{' causal' if causal else ''}"
                f"{'' if seed is None else ' (drawn for this grade)'}")
        out = _run(attention, q, k, v, causal, sm_scale, what)
        ok, err, allowed = _within(out, q, k, v, causal, sm_scale, spread)
        if not ok:
            yield what, out, err, allowed, spread, (q, k, v), _layout_hint(attention, q, k, v, causal, sm_scale, spread)


UPDATE_HINT = "check the new running max, p = exp2(s - max), the rescaling of l_i and acc by alpha, and m_i"


def _update_hint(out, spread):
    if isinstance(out, torch.Tensor) and not torch.isfinite(out.float()).all() and spread:
        return ("inf or NaN where scores spread over hundreds (the first key block holds each row's maximum, the "
                "later ones lie far below it): subtract the running max, m_new = max(m_i, the block's row max), never "
                "the block's max alone, so that no exp2 overflows; " + UPDATE_HINT)
    if isinstance(out, torch.Tensor) and not torch.isfinite(out.float()).all():
        return "inf or NaN: an exp2 overflowed, or a row divided 0 by 0; " + UPDATE_HINT
    return UPDATE_HINT


def _check_cases(attention, device, causal, cases, hint, name="attention"):
    for n, d, layout in cases:
        q, k, v = make_inputs(1, 2, n, d, layout, torch.bfloat16, device, seed=n + d)
        label = f"{name} N={n}{f' D={d}' if name == 'attention' else ''} {layout}{' causal' if causal else ''}"
        out = _run(attention, q, k, v, causal, None, label)
        ok, err, allowed = within_tolerance(out, q, k, v, causal)
        why = "" if ok else (_layout_hint(attention, q, k, v, causal, None, False) or
                             (hint(out, q, k, v) if callable(hint) else hint))
        check(label, ok, f"max error {err:.3g}, allowed {allowed:.3g}: {why}")


ATTENTION_CASES = ((1, 64, "contiguous"), (100, 64, "contiguous"), (77, 80, "model"), (200, 32, "contiguous"))
WRAPPER_BLOCK_M, WRAPPER_BLOCK_N = 64, 32     # the tiles `attention` (the lab's short wrapper) launches


def check_attention(attention, device="cpu"):
    """Exercise 4.2: non-causal attention on ragged lengths, a padded head dim and a model's layout; then (without a
    line each) scores that spread over hundreds, sm_scale=8, batch > 1, FP16, other layouts and two cases drawn for
    this grade; and, once the causal blocks (4.3) are written, causal inputs, where some key blocks are entirely
    masked for some rows. Meanwhile Triton's compiler builds the kernel for an H100 and an MI300X, as the lab's
    `compile_attention` does: what it refuses fails too, with its message."""
    with _building(attention, causal=False) as build:
        _check_cases(attention, device, False, ATTENTION_CASES, lambda out, *_: _update_hint(out, False))
        for what, out, err, allowed, spread, _, stride in _hidden(attention, device, False, _cases()):
            check(what, False, f"max error {err:.3g}, allowed {allowed:.3g}: {stride or _update_hint(out, spread)}")
        causal_blocks = getattr(attention, "__globals__", {}).get("causal_blocks")
        if causal_blocks is not None and not unfinished(causal_blocks):
            for n in (100,):
                q, k, v = make_inputs(2, 1, n, 64, "contiguous", torch.bfloat16, device, seed=n)
                label = f"attention B=2 H=1 N={n} D=64 causal (fully masked key blocks)"
                out = _run(attention, q, k, v, True, None, label)
                if _fully_masked_nan(out, q):
                    check(label, False, FULLY_MASKED_HINT)
        _check_builds(build, causal=False)


CAUSAL_HINT = ("every query sees the keys up to its own position: the blocks before the diagonal unmasked, the "
               "diagonal ones masked (NaN: some row saw no key at all)")


def _masked_block_rows(n: int) -> torch.Tensor:
    """The query rows that, with the wrapper's tiles, meet a key block of their diagonal that is entirely masked
    after blocks they saw (the first BLOCK_N rows of each query block whose diagonal has a second key block)."""
    rows = torch.arange(n)
    return (rows % WRAPPER_BLOCK_M < WRAPPER_BLOCK_N) & (rows // WRAPPER_BLOCK_M * WRAPPER_BLOCK_M + WRAPPER_BLOCK_N < n)


FULLY_MASKED_HINT = ("NaN exactly in the query rows that meet a fully masked key block (on the diagonal, after keys "
                     "they saw): the online-softmax update of exercise 4.2 must leave acc, l_i and m_i as they were "
                     "for such a block (there the block's row max is -inf): subtract m_new = max(m_i, the block's "
                     "row max), never the block's max alone")


def _fully_masked_nan(out, q) -> bool:
    """Whether `out` is NaN (or inf) in exactly the rows `_masked_block_rows` names, in every batch and head."""
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        return False
    bad = ~torch.isfinite(out.float()).cpu().flatten(0, 1).all(-1).all(0)
    return bool(bad.any()) and torch.equal(bad, _masked_block_rows(q.shape[2]))


def _causal_hint(out, q, k, v):
    """The hint for a wrong causal output, naming the mistake its values show."""
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        return CAUSAL_HINT
    if _fully_masked_nan(out, q):
        return "your causal blocks are right; " + FULLY_MASKED_HINT
    bad = ~torch.isfinite(out.float()).cpu().flatten(0, 1).all(-1).all(0)       # per query row
    if bad.any():
        first = int(bad.nonzero()[0])
        return (f"NaN from query row {first} on (query block start_m={first // WRAPPER_BLOCK_M}): a row that saw no "
                "key divides 0 by 0; " + CAUSAL_HINT)
    full = reference(q, k, v, False)
    if (out.float() - full).abs().max().item() <= within_tolerance(full, q, k, v, False)[2]:
        return "your output is attention without the causal mask: " + CAUSAL_HINT + " (attn_blocks' CAUSAL=True)"
    n = q.shape[2]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    to_block_end = (cols < (rows // WRAPPER_BLOCK_M + 1) * WRAPPER_BLOCK_M).to(q.device)
    with sdpa_kernel(SDPBackend.MATH):
        blockwise = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=to_block_end)
    if (out.float() - blockwise).abs().max().item() <= within_tolerance(full, q, k, v, False)[2]:
        return ("each query saw the keys after its own position, up to the end of its query block: the diagonal "
                "blocks need the causal mask (MASKED=True and CAUSAL=True in that attn_blocks call); " + CAUSAL_HINT)
    return CAUSAL_HINT


def _above_diagonal(attention, device):
    """The first query block (the wrapper's BLOCK_M rows) whose outputs turn NaN when the values of the keys after
    its last query are NaN, which none of its queries may see: a kernel that reads a key block entirely above the
    diagonal multiplies those values by p = 0 and gets NaN (on the interpreter and on a GPU alike). None if none."""
    n = 3 * WRAPPER_BLOCK_M
    q, k, v = make_inputs(1, 1, n, 16, "contiguous", torch.bfloat16, device, seed=n)
    for block in range(n // WRAPPER_BLOCK_M - 1):
        end, length = (block + 1) * WRAPPER_BLOCK_M, (block + 2) * WRAPPER_BLOCK_M   # the block after it is above
        poisoned = v[:, :, :length].clone()
        poisoned[:, :, end:] = float("nan")
        out = _run(attention, q[:, :, :length], k[:, :, :length], poisoned, True, None,
                   f"attention N={length} D=16 causal")
        if isinstance(out, torch.Tensor) and out.shape[2] == length and \
                not torch.isfinite(out[:, :, end - WRAPPER_BLOCK_M:end].float()).all():
            return block
    return None


def check_causal(attention, device="cpu"):
    """Exercise 4.3: causal attention; one block, several, ragged, a padded head dim, a model's layout; then (without
    a line each) spread scores, sm_scale=8, batch > 1, FP16, other layouts, two cases drawn for this grade, and no
    key block above the diagonal read. Before any of it, the update of 4.2 on non-causal inputs with spread scores,
    so that a wrong update is not blamed on the causal blocks. Meanwhile Triton's compiler builds the causal kernel
    for an H100 and an MI300X: what it refuses fails too, with its message."""
    cases = _cases()
    with _building(attention, causal=True) as build:
        for what, out, err, allowed, spread, _, _ in _hidden(attention, device, False, cases, spread_only=True):
            check("the online-softmax update (exercise 4.2) first", False,
                  f"{what}: max error {err:.3g}, allowed {allowed:.3g}: not your causal blocks: the update of exercise "
                  f"4.2 is wrong: {_update_hint(out, spread)}")
        _check_cases(attention, device, True, ATTENTION_CASES, _causal_hint)
        for what, out, err, allowed, _, qkv, stride in _hidden(attention, device, True, cases):
            check(what, False, f"max error {err:.3g}, allowed {allowed:.3g}: {stride or _causal_hint(out, *qkv)}")
        block = _above_diagonal(attention, device)
        if block is not None:
            first, last = block * WRAPPER_BLOCK_M, (block + 1) * WRAPPER_BLOCK_M - 1
            check("attention causal: no key block above the diagonal", False,
                  f"the outputs of query block start_m={block} (rows {first} to {last}) turned NaN when the values of "
                  f"the keys after row {last} were NaN: your causal blocks read key blocks entirely above the "
                  "diagonal, which none of its queries may see (masked, they change no output, and cost as much as "
                  "the blocks below): end the diagonal's keys at the end of this block's queries, "
                  "min((start_m + 1) * BLOCK_M, n_ctx), and call attn_blocks for nothing beyond")
        _check_builds(build, causal=True)


# --- what only a compiler sees: the learner's kernel built for both vendors' GPUs, as the lab's compile_attention ----

AOT_HEAD_DIMS = (64, 128)    # the head dims built, with the wrapper's tiles: the kernel `attention` launches on a GPU


class _Recorded(Exception):
    pass


def _builds() -> dict[str, tuple[str, int]]:
    """Each build by its key ("sm_90 D=64"): (target, head dim)."""
    return {f"{t} D={d}": (t, d) for t in GPU_TARGETS for d in AOT_HEAD_DIMS}


def _compile_call(kernel, target: str, causal: bool, head_dim: int) -> dict:
    """The signature and options that the lab's `compile_attention` hands `isa.compile_triton` for `kernel` (not the
    lab's own `flash_attention`) on `target`, at `head_dim` with the wrapper's tiles: its own code, run with those
    two names rebound, stopped at that call (so that the grader builds exactly what the lab builds)."""
    lab = solutions.load("04")
    call = {}

    def record(_kernel, signature, _target, **options):
        call.update(signature=signature, options=options)
        raise _Recorded

    compile_attention = lab.compile_attention       # run as the grader's own code (__name__), not the lab's
    rebound = types.FunctionType(compile_attention.__code__, {**compile_attention.__globals__, "__name__": __name__,
                                 "flash_attention": kernel, "isa": types.SimpleNamespace(compile_triton=record)},
                                 argdefs=compile_attention.__defaults__)
    with contextlib.suppress(_Recorded):
        rebound(target, head_dim, causal, dict(BLOCK_M=WRAPPER_BLOCK_M, BLOCK_N=WRAPPER_BLOCK_N))
    return call


# Run by a fresh process: defines the kernel from carried.py, builds it for each target as isa.compile_triton does,
# and prints a line {target: null (built) or [[type, message], ...] (the error and what it came from)} for each.
_BUILDER = """
import importlib.util, json, sys
from utils import isa
spec = importlib.util.spec_from_file_location("carried", sys.argv[1])
carried = importlib.util.module_from_spec(spec)
try:
    spec.loader.exec_module(carried)
except Exception as err:
    print(json.dumps({"carried": f"{type(err).__name__}: {err}"}))
    sys.exit()
job = json.load(open(sys.argv[2]))
for key, call in job["calls"].items():
    chain = None
    try:
        isa.compile_triton(getattr(carried, job["kernel"]), call["signature"], call["target"], **call["options"])
    except Exception as err:
        chain = isa.error_chain(err)
    print(json.dumps({key: chain}), flush=True)
"""


class _Build:
    """`kernel` built ahead of time for sm_90 and gfx942 in a child process, started at once (it runs while the
    interpreter checks the answer); `result()` waits for it: {target: None (built) or the compiler's error chain},
    or {"carried": why} if the kernel could not be defined there. What built is remembered under the build folder
    (keyed by the sources and the build's arguments), so that grading the same kernel again costs nothing."""

    def __init__(self, kernel, causal: bool):
        self.proc, self.folder, self.cached, self.source = None, None, None, ""
        try:
            self.source = source = isa.kernel_source(kernel)
        except (OSError, TypeError) as err:       # no source to carry (defined where inspect cannot read it)
            self.cached = {"carried": f"{type(err).__name__}: {err}"}
            return
        job = {"kernel": kernel.fn.__name__, "calls": {key: {"target": t, **_compile_call(kernel, t, causal, d)}
                                                      for key, (t, d) in _builds().items()}}
        text = json.dumps(job, default=list)           # in order: the signature is positional
        key = hashlib.sha256(f"{triton.__version__}\n{source}\n{text}".encode()).hexdigest()[:24]
        self.memo = build_dir() / "lab04_builds" / f"{key}.json"
        if self.memo.exists():
            self.cached = json.loads(self.memo.read_text())
            return
        self.folder = tempfile.TemporaryDirectory()
        carried, job_file = os.path.join(self.folder.name, "carried.py"), os.path.join(self.folder.name, "job.json")
        with open(carried, "w") as f:
            f.write(source)
        with open(job_file, "w") as f:
            f.write(text)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, "-c", _BUILDER, carried, job_file], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(self) -> dict:
        if self.cached is None:
            stdout, stderr = self.proc.communicate()
            self.cached = {}
            for line in stdout.splitlines():
                with contextlib.suppress(ValueError):
                    self.cached.update(json.loads(line))
            if not self.cached or self.proc.returncode:       # the compiler itself crashed on a target
                last = (stderr.strip().splitlines() or [f"exit status {self.proc.returncode}"])[-1]
                self.cached.update({k: [["the compiler crashed", last]] for k in _builds() if k not in self.cached})
            if set(self.cached) == set(_builds()) and not any(self.cached.values()):
                with contextlib.suppress(OSError):
                    self.memo.parent.mkdir(parents=True, exist_ok=True)
                    self.memo.write_text(json.dumps(self.cached))
        return self.cached

    def finish(self) -> dict:
        try:
            return self.result()
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        if self.folder is not None:
            self.folder.cleanup()


@contextlib.contextmanager
def _building(attention, causal: bool):
    """The kernel `attention` launches (its global flash_attention) building for both GPUs while the block runs;
    yields its _Build (None when `attention` launches no Triton kernel of its own)."""
    kernel = getattr(attention, "__globals__", {}).get("flash_attention")
    build = _Build(kernel, causal) if isa.is_kernel(kernel) else None
    try:
        yield build
    finally:
        if build is not None:
            build.stop()


def _compiler_hint(message: str) -> str:
    """What a refusal the interpreter never makes usually means."""
    if "must be same dtype" in message:
        return ("; tl.dot takes two operands of one dtype: on a GPU v is the inputs' BF16 or FP16 (on the CPU the "
                "wrapper hands the interpreter FP32 copies, so it never sees this): tl.dot(p.to(v.dtype), v)")
    if "Loop-carried variable" in message:
        return "; acc, l_i and m_i keep one dtype through the loop (FP32, as flash_attention makes them)"
    if "Unsupported function" in message:
        return "; a kernel calls only @triton.jit functions and triton.language's"
    return ""


def _check_builds(build, causal: bool) -> None:
    """Fails a kernel Triton's compiler refuses for sm_90 or gfx942, with the compiler's message. A target for which
    the course's own kernel does not build here either (no toolchain) is said not checked here, in a NOTE."""
    if build is None:
        return
    name = f"your kernel builds for an H100 and an MI300X{' (causal)' if causal else ''}"
    results = build.result()
    if "carried" in results:
        print(f"NOTE: {name}: not checked here (its source could not be rebuilt in a fresh process: "
              f"{results['carried']})")
        return
    course = theirs = None
    for key, chain in results.items():
        if not chain:
            continue
        target, head_dim = _builds()[key]
        if course is None:
            course = _Build(solutions.load("04").flash_attention, causal)
            theirs = course.finish()
        why = theirs.get("carried") or theirs.get(key)
        if why:
            print(f"NOTE: {name}: {key} not checked here (Triton does not build the course's own kernel for it on "
                  f"this machine either: {isa.compiler_message(why, course.source) if isinstance(why, list) else why})")
            continue
        message = isa.compiler_message(chain, build.source)
        check(name, False, f"Triton's compiler refuses your kernel for {GPU_TARGETS[target][0]} at head dim "
                           f"{head_dim} (what the lab's compile_attention builds, with the tiles `attention` launches, BF16 inputs, "
                           f"{'causal' if causal else 'not causal'}), though it ran here (on a CPU, Triton's "
                           f"interpreter): on that GPU it would not build: {message}{_compiler_hint(message)}")


# --- 4.4: tiles ------------------------------------------------------------------------------------------

# Shared memory (LDS) one block may use: sm_90 227 KiB with opt-in (CUDA C++ Programming Guide, compute capability
# 9.0), gfx942 64 KiB (AMD CDNA3 ISA guide); the same figures as the lab's SHARED_LIMIT.
GPU_TARGETS = {"sm_90": ("an H100 (sm_90)", 232448, None), "gfx942": ("an MI300X (gfx942)", 65536, "6.2")}
DEFAULT_STAGES = {"sm_90": 3, "gfx942": 2}    # Triton's defaults when a config names none


def attention_tile_bytes(config: dict, head_dim: int, target: str) -> int:
    """Shared memory the portable kernel's tiles take on `target`, from their bytes (2 per BF16 value, the head dim
    padded to a power of two). sm_90: the Q tile, and a K and a V tile per stage (what Triton allocates, checked
    against ahead-of-time builds); gfx942: a lower bound, the largest of the Q, K and V tiles and the K and V tiles
    of the num_stages - 1 steps fetched ahead (AMD's pipeliner)."""
    d = max(16, 1 << (int(head_dim) - 1).bit_length())
    q, kv = config["BLOCK_M"] * d * 2, config["BLOCK_N"] * d * 2
    stages = config.get("num_stages", DEFAULT_STAGES[target])
    if target == "sm_90":
        return q + 2 * kv * max(stages, 1)
    return max(q, kv, 2 * kv * (stages - 1))


@contextlib.contextmanager
def _as_vendor(hip):
    """torch.version.hip as on `hip`'s machines (None: NVIDIA), for a config function that reads it."""
    saved = torch.version.hip
    torch.version.hip = hip
    try:
        yield
    finally:
        torch.version.hip = saved


def _gpu_tiles(config_for, head_dims, device):
    """(target, head dim, config) for each GPU target this machine is not (its config asked with torch.version.hip
    as there); a config function that cannot answer without that GPU (e.g. it asks for its properties) is judged on
    that GPU, not here."""
    out = []
    here = None if device.type != "cuda" else ("gfx942" if torch.version.hip else "sm_90")
    for target, (_, _, hip) in GPU_TARGETS.items():
        for d in head_dims:
            if target == here:
                continue
            try:
                with _as_vendor(hip):
                    config = config_for(d, torch.device("cuda") if device.type != "cuda" else device)
            except Exception as err:                 # e.g. asks the GPU's properties: judged on that GPU
                _raise_if_not_done(err)
                continue
            out.append((target, d, config))
    return out


def _check_fits(config, head_dim, target, lab, drawn=False):
    where, limit, _ = GPU_TARGETS[target]
    at = f"D={head_dim}{' (a head dim drawn for this grade)' if drawn else ''}"
    try:
        tiles = lab.check_config(config)
    except ValueError as err:
        check("your tiles are a valid config", False, f"your tiles for {at} on {where} (my_config({head_dim}, "
                                                      f"torch.device('cuda'))): {err}")
    need = attention_tile_bytes(tiles, head_dim, target)
    if need > limit:
        stages = tiles.get("num_stages", DEFAULT_STAGES[target])
        how = ("the Q tile (BLOCK_M x D) and a K and a V tile (BLOCK_N x D) for each of num_stages", "exactly") \
            if target == "sm_90" else ("the largest of the Q, K, V tiles and the K and V tiles of the num_stages - 1 "
                                       "steps fetched ahead", "at least")
        check("your tiles fit the GPU", False,
              f"at {at} on {where} your tiles (BLOCK_M={tiles['BLOCK_M']}, BLOCK_N={tiles['BLOCK_N']}, "
              f"num_stages={stages}) take {how[1]} {need:,} bytes of shared memory ({how[0]}, 2 bytes a value), "
              f"and one block may use {limit:,}: smaller tiles or fewer stages")


def check_tiles(attention, config_for, head_dim, device):
    """Exercise 4.4: the tiles `config_for(head_dim, device)` are valid (the lab's `check_config`), fit the GPU's shared
    memory (computed from the tiles' bytes, on a CPU too: the tiles `config_for` gives for an H100 and an MI300X at
    this head dim, at 128 and at one drawn for this grade), launch, and give right answers through
    `attention(q, k, v, causal, config=...)` (the lab's `portable_attention`)."""
    device = torch.device(device)
    lab = solutions.load("04")
    try:
        config = config_for(head_dim, device)
    except Exception as err:                         # the stub's NotImplementedError: NOT DONE
        _raise_if_not_done(err)
        check("your tiles are a valid config", False, f"my_config({head_dim}, {device!r}) raised {error_line(err)}")
    try:
        lab.check_config(config)
    except ValueError as err:
        check("your tiles are a valid config", False, str(err))
    fresh = 8 * random.Random(grading_guard.fresh_seed()).randint(2, 32)     # a head dim drawn for this grade
    head_dims = sorted({head_dim, 128}) + [fresh] * (fresh not in (head_dim, 128))
    for target, d, gpu_config in _gpu_tiles(config_for, head_dims, device):
        _check_fits(gpu_config, d, target, lab, drawn=d not in (head_dim, 128))
    if device.type == "cuda":
        _check_fits(config, head_dim, "gfx942" if torch.version.hip else "sm_90", lab)
    check("your tiles are a valid config", True, "")
    try:
        _check_cases(lambda q, k, v, causal: attention(q, k, v, causal, config=config), device, True,
                     ((100, head_dim, "contiguous"), (300, head_dim, "model")),
                     "with the course's kernel only the tiles changed: is BLOCK_M a multiple of BLOCK_N?", "your tiles")
    except OutOfResources as err:
        check("your tiles fit the GPU", False, f"{err}: smaller tiles or fewer stages")
