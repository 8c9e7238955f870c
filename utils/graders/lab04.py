"""Lab 04's graders (exercises 4.1-4.4), with the seeded inputs they build and flash-attn's tolerance rule they apply."""
import contextlib
import numbers

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

from utils import solutions
from utils.exercises import ExerciseFailed, check, error_line, is_not_done, unfinished
from utils import grading_guard

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
            check(name, False, f"at B={batch} H={heads} N={n} you predict {said}, the measurement says {got:,} bytes "
                               f"({got / scores:.3g} per score): list the N x N tensors alive at once while the "
                               "softmax runs, with their dtypes")
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
# checked without a line of their own. Spread scores, sm_scale=8, batch > 1, FP16, a broadcast and a sliced layout.
HIDDEN_CASES = [(2, 1, 100, 64, "spread", torch.bfloat16, 1.0), (1, 1, 77, 48, "spread", torch.float16, 1.0),
                (2, 1, 97, 32, "contiguous", torch.bfloat16, 8.0), (1, 2, 45, 48, "kv_broadcast", torch.float16, None),
                (1, 1, 70, 80, "head_dim_slice", torch.bfloat16, 3.0)]


def _hidden(attention, device, causal, name="attention", spread_only=False):
    """The HIDDEN_CASES (or only those with spread scores) that fail: (label, output, error, allowed, spread, (q, k, v))."""
    for batch, heads, n, d, layout, dtype, sm_scale in HIDDEN_CASES:
        spread = layout == "spread"
        if spread_only and not spread:
            continue
        q, k, v = (spread_inputs(batch, heads, n, d, dtype, device, seed=n) if spread else
                   make_inputs(batch, heads, n, d, layout, dtype, device, seed=n + d))
        what = (f"{name} B={batch} H={heads} N={n} D={d} {'spread scores' if spread else layout} {str(dtype)[6:]}"
                f"{'' if sm_scale is None else f' sm_scale={sm_scale:g}'}{' causal' if causal else ''}")
        out = _run(attention, q, k, v, causal, sm_scale, what)
        ok, err, allowed = _within(out, q, k, v, causal, sm_scale, spread)
        if not ok:
            yield what, out, err, allowed, spread, (q, k, v)


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
        check(label, ok, f"max error {err:.3g}, allowed {allowed:.3g}: {hint(out, q, k, v) if callable(hint) else hint}")


ATTENTION_CASES = ((1, 64, "contiguous"), (100, 64, "contiguous"), (77, 80, "model"), (200, 32, "contiguous"))


def check_attention(attention, device="cpu"):
    """Exercise 4.2: non-causal attention on ragged lengths, a padded head dim and a model's layout; then (without a
    line each) scores that spread over hundreds, sm_scale=8, batch > 1, FP16 and other layouts; and, once the causal
    blocks (4.3) are written, causal inputs, where some key blocks are entirely masked for some rows."""
    _check_cases(attention, device, False, ATTENTION_CASES, lambda out, *_: _update_hint(out, False))
    for what, out, err, allowed, spread, _ in _hidden(attention, device, False):
        check(what, False, f"max error {err:.3g}, allowed {allowed:.3g}: {_update_hint(out, spread)}")
    causal_blocks = getattr(attention, "__globals__", {}).get("causal_blocks")
    if causal_blocks is not None and not unfinished(causal_blocks):
        for n in (100,):
            q, k, v = make_inputs(2, 1, n, 64, "contiguous", torch.bfloat16, device, seed=n)
            label = f"attention B=2 H=1 N={n} D=64 causal (fully masked key blocks)"
            out = _run(attention, q, k, v, True, None, label)
            if _fully_masked_nan(out, q):
                check(label, False, FULLY_MASKED_HINT)


CAUSAL_HINT = ("every query sees the keys up to its own position: the blocks before the diagonal unmasked, the "
               "diagonal ones masked (NaN: some row saw no key at all)")
WRAPPER_BLOCK_M, WRAPPER_BLOCK_N = 64, 32     # the tiles `attention` (the lab's short wrapper) launches


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


def check_causal(attention, device="cpu"):
    """Exercise 4.3: causal attention; one block, several, ragged, a padded head dim, a model's layout; then (without
    a line each) spread scores, sm_scale=8, batch > 1, FP16, other layouts. Before any of it, the update of 4.2 on
    non-causal inputs with spread scores, so that a wrong update is not blamed on the causal blocks."""
    for what, out, err, allowed, spread, _ in _hidden(attention, device, False, spread_only=True):
        check("the online-softmax update (exercise 4.2) first", False,
              f"{what}: max error {err:.3g}, allowed {allowed:.3g}: not your causal blocks: the update of exercise "
              f"4.2 is wrong: {_update_hint(out, spread)}")
    _check_cases(attention, device, True, ATTENTION_CASES, _causal_hint)
    for what, out, err, allowed, _, qkv in _hidden(attention, device, True):
        check(what, False, f"max error {err:.3g}, allowed {allowed:.3g}: {_causal_hint(out, *qkv)}")


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


def _check_fits(config, head_dim, target, lab):
    where, limit, _ = GPU_TARGETS[target]
    try:
        tiles = lab.check_config(config)
    except ValueError as err:
        check("your tiles are a valid config", False, f"your tiles for D={head_dim} on {where} (my_config({head_dim}, "
                                                      f"torch.device('cuda'))): {err}")
    need = attention_tile_bytes(tiles, head_dim, target)
    if need > limit:
        stages = tiles.get("num_stages", DEFAULT_STAGES[target])
        how = ("the Q tile (BLOCK_M x D) and a K and a V tile (BLOCK_N x D) for each of num_stages", "exactly") \
            if target == "sm_90" else ("the largest of the Q, K, V tiles and the K and V tiles of the num_stages - 1 "
                                       "steps fetched ahead", "at least")
        check("your tiles fit the GPU", False,
              f"at D={head_dim} on {where} your tiles (BLOCK_M={tiles['BLOCK_M']}, BLOCK_N={tiles['BLOCK_N']}, "
              f"num_stages={stages}) take {how[1]} {need:,} bytes of shared memory ({how[0]}, 2 bytes a value), "
              f"and one block may use {limit:,}: smaller tiles or fewer stages")


def check_tiles(attention, config_for, head_dim, device):
    """Exercise 4.4: the tiles `config_for(head_dim, device)` are valid (the lab's `check_config`), fit the GPU's shared
    memory (computed from the tiles' bytes, on a CPU too: the tiles `config_for` gives for an H100 and an MI300X at
    this head dim and at 128), launch, and give right answers through `attention(q, k, v, causal, config=...)` (the
    lab's `portable_attention`)."""
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
    for target, d, gpu_config in _gpu_tiles(config_for, sorted({head_dim, 128}), device):
        _check_fits(gpu_config, d, target, lab)
    if device.type == "cuda":
        _check_fits(config, head_dim, "gfx942" if torch.version.hip else "sm_90", lab)
    check("your tiles are a valid config", True, "")
    try:
        _check_cases(lambda q, k, v, causal: attention(q, k, v, causal, config=config), device, True,
                     ((100, head_dim, "contiguous"), (300, head_dim, "model")),
                     "with the course's kernel only the tiles changed: is BLOCK_M a multiple of BLOCK_N?", "your tiles")
    except OutOfResources as err:
        check("your tiles fit the GPU", False, f"{err}: smaller tiles or fewer stages")
