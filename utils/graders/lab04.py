"""Lab 04's graders (exercises 4.1-4.4), with the seeded inputs they build and flash-attn's tolerance rule they apply."""
import numbers

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

from utils import solutions
from utils.exercises import check

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


def check_prediction(predict, measured):
    """Exercise 4.1: `predict(batch, heads, n)` against the measured peaks [(batch, heads, n, bytes), ...]."""
    for batch, heads, n, got in measured:
        want = predict(batch, heads, n)
        scores = batch * heads * n * n
        number = isinstance(want, numbers.Real) and not isinstance(want, bool)
        if not number or abs(want - got) > 0.05 * got:
            said = f"{want:,.0f} bytes ({want / scores:.3g} per score)" if number else f"{want!r}, not a number"
            check("your prediction is within 5% of the measured peak at every N", False,
                  f"at B={batch} H={heads} N={n} you predict {said}, the measurement says {got:,} bytes "
                  f"({got / scores:.3g} per score): list the N x N tensors alive at once while the softmax runs, "
                  "with their dtypes")
    check("your prediction is within 5% of the measured peak at every N", True, "")


def _check_cases(attention, device, causal, cases, hint, name="attention"):
    for n, d, layout in cases:
        q, k, v = make_inputs(1, 2, n, d, layout, torch.bfloat16, device, seed=n + d)
        out = attention(q, k, v, causal)
        ok, err, allowed = within_tolerance(out, q, k, v, causal)
        check(f"{name} N={n}{f' D={d}' if name == 'attention' else ''} {layout}{' causal' if causal else ''}", ok,
              f"max error {err:.3g}, allowed {allowed:.3g}: {hint}")


def check_attention(attention, device="cpu"):
    """Exercise 4.2: non-causal attention on ragged lengths, a padded head dim and a model's layout."""
    _check_cases(attention, device, False, ((1, 64, "contiguous"), (100, 64, "contiguous"), (77, 80, "model"),
                                            (200, 32, "contiguous")),
                 "check the new running max, p = exp2(s - max), the rescaling of l_i and acc by alpha, and m_i")


def check_causal(attention, device="cpu"):
    """Exercise 4.3: causal attention; one block, several, ragged, a padded head dim, a model's layout."""
    _check_cases(attention, device, True, ((1, 64, "contiguous"), (100, 64, "contiguous"), (77, 80, "model"),
                                           (200, 32, "contiguous")),
                 "every query sees the keys up to its own position: the blocks before the diagonal unmasked, the "
                 "diagonal ones masked (NaN: some row saw no key at all)")


def check_tiles(attention, config_for, head_dim, device):
    """Exercise 4.4: the tiles `config_for(head_dim, device)` are valid (the lab's `check_config`), launch, and give
    right answers through `attention(q, k, v, causal, config=...)` (the lab's `portable_attention`)."""
    device = torch.device(device)
    config = config_for(head_dim, device)
    try:
        solutions.load("04").check_config(config)
    except ValueError as err:
        check("your tiles are a valid config", False, str(err))
    check("your tiles are a valid config", True, "")
    try:
        _check_cases(lambda q, k, v, causal: attention(q, k, v, causal, config=config), device, True,
                     ((100, head_dim, "contiguous"), (300, head_dim, "model")),
                     "with the course's kernel only the tiles changed: is BLOCK_M a multiple of BLOCK_N?", "your tiles")
    except OutOfResources as err:
        check("your tiles fit the GPU", False, f"{err}: smaller tiles or fewer stages")
