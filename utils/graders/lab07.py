"""Lab 07's graders: 7.1 which code a GPU runs, 7.2 the culprit, 7.3 a float32 GEMV, 7.4 a mask for left padding, 7.5 the prediction."""
import math

import torch

from utils.clinic import divergence, doctor, faults
from utils.clinic.divergence import Row
from utils.exercises import check


CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
ROCM_OLD = ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102", "gfx1200", "gfx1201"]
RUNNABLE_CASES = [   # (GPU, PyTorch's arch list, what the case is about)
    ("sm_90", CU130, "an H100 with its own machine code"),
    ("sm_89", ["sm_80", "sm_86", "sm_90"], "no sm_89 code: the newest cubin of the same major (8) with a lower minor runs"),
    ("sm_90", ["sm_80", "sm_86", "compute_86"], "machine code of another major never runs: only the PTX, compiled at first use"),
    ("sm_120", ["sm_90", "sm_100", "compute_90", "compute_100"], "several PTX entries: the newest one not newer than the GPU"),
    ("sm_100", ["sm_90a", "sm_80"], "sm_90a is arch-specific and another major: nothing runs"),
    ("sm_90", ["sm_80", "sm_90a"], "sm_90a is sm_90's own arch-specific build: it runs there"),
    ("sm_75", ["sm_80", "compute_80"], "code for newer GPUs (cubin or PTX) never runs on an older one"),
    ("gfx942", ROCM_OLD, "an MI300X with its own code objects"),
    ("gfx1151", ROCM_OLD, "gfx1100 code is not gfx1151 code: nothing runs without the override"),
    ("gfx1151", ROCM_OLD + ["gfx11-generic"], "the family's generic target runs on every member"),
    ("gfx90a", ["gfx908", "gfx942"], "neighbouring CDNA chips do not share code objects"),
]


def check_runnable_target(fn) -> None:
    for arch, archs, why in RUNNABLE_CASES:
        want, got = doctor.runnable_target(arch, archs), fn(arch, list(archs))
        check(f"{arch} on [{' '.join(archs[:3])}{' ...' if len(archs) > 3 else ''}]", got == want,
              f"{why}: expected {want!r}, got {got!r}")


def _rows(*spec):
    return [Row(name, "Linear", prop, iso, 0.0) for name, prop, iso in spec]


CULPRIT_CASES = [  # (rows, tolerance, the culprit, what the case is about)
    (_rows(("q_proj", 0, 0), ("o_proj", 0.9, 1e-7), ("self_attn", 0.8, 0.7), ("mlp", 0.9, 0.0)), 1e-3, "self_attn",
     "o_proj's output is wrong only because its input was: the isolated error names the module whose own code is off"),
    (_rows(("norm", 0, 0), ("down_proj", 0.2, 0.01), ("lm_head", 3.0, 0.4)), 1e-3, "down_proj",
     "the first module above the tolerance, not the one with the largest error"),
    (_rows(("embed", 0, 0), ("rotary", math.nan, math.nan), ("attn", math.nan, None)), 1e-3, "rotary",
     "NaN is above every tolerance (and NaN <= tol is False, while NaN > tol is False too)"),
    (_rows(("a", 1e-4, 1e-4), ("b", 2e-3, 2e-3)), 2e-3, None, "an error equal to the tolerance is within it"),
    (_rows(("a", 0.5, None), ("b", 0.5, 0.0)), 1e-3, None, "a module that was not replayed (isolated None) is no culprit"),
    (_rows(("a", math.inf, math.inf)), 1e-3, "a", "an infinite error is above the tolerance"),
]


def check_culprit(fn) -> None:
    for rows, tol, want, why in CULPRIT_CASES:
        got = fn(list(rows), tol)
        check(f"culprit of [{', '.join(r.name for r in rows)}]", got == want, f"{why}: expected {want!r}, got {got!r}")


def _gemv_cases():
    g = torch.Generator().manual_seed(7)
    for rows, k, out, scale, dtype in ((1, 576, 37, 1.0, torch.bfloat16), (3, 1000, 9, 50.0, torch.bfloat16),
                                       (2, 4097, 5, 1e3, torch.bfloat16), (2, 333, 11, 1.0, torch.float32)):
        x = (torch.randn(rows, k, generator=g) * scale).to(dtype)
        w = (torch.randn(out, k, generator=g) + 0.5).to(dtype)     # a positive bias: the sum grows with k
        yield x, w


def check_gemv(fn, model=None, captured=None, ref_tokens=None, new_tokens: int = 8) -> None:
    for x, w in _gemv_cases():
        got = fn(x, w)
        name = f"{tuple(x.shape)} @ {tuple(w.shape)}.T in {str(x.dtype).replace('torch.', '')}"
        if tuple(got.shape) != (x.shape[0], w.shape[0]) or got.dtype != x.dtype:
            check(f"{name}: shape and dtype", False,
                  f"expected shape {(x.shape[0], w.shape[0])} in {x.dtype}, got {tuple(got.shape)} in {got.dtype}")
        exact = x.double() @ w.double().t()
        rel = float(((got.double() - exact).norm(dim=1) / exact.norm(dim=1)).max())
        # one rounding of the result to the output dtype: 2^-8 relative for bf16, 2^-23 for float32
        allowed = 2.0 ** -8 if x.dtype == torch.bfloat16 else 1e-6
        check(f"{name}: within one rounding of the exact product", rel <= allowed,
              f"relative error {rel:.2e} > {allowed:.1e}: the running sum loses bits (is it kept in bf16, or rounded "
              "every few products?)")
    if model is not None:
        handle = model.lm_head.register_forward_hook(faults.gemv_hook(fn))
        try:
            found = divergence.find(captured, model)
            tokens = divergence.generate(model, captured.batch, new_tokens)
        finally:
            handle.remove()
        check("the model with your GEMV: no module diverges", found.first_propagated is None, found.summary())
        same = divergence.compare_tokens(ref_tokens[:, :new_tokens], tokens)
        check("the model with your GEMV: the tokens equal the unmodified model's", same.equal, str(same))


def _padding(lengths, keys):
    real = torch.zeros(len(lengths), keys, dtype=torch.bool)
    for b, n in enumerate(lengths):
        real[b, keys - n:] = True          # left padding: the real tokens are the last n
    return real


MASK_CASES = [  # (real, q_len, what)
    (_padding([9, 6, 2], 9), 9, "a prompt's forward pass (every position is a query)"),
    (_padding([12, 7, 1], 12), 1, "a decode step: one query, the newest position"),
    (_padding([5, 3], 8), 3, "three queries at the end"),
    (_padding([4], 4), 4, "no padding at all"),
]


def check_keep_mask(fn, model=None, captured=None, ref_tokens=None, new_tokens: int = 8) -> None:
    for real, q_len, what in MASK_CASES:
        want = faults.keep_left_padded(real, q_len)
        got = fn(real.clone(), q_len)
        name = f"{what}: lengths {real.sum(1).tolist()} of {real.shape[1]}, {q_len} queries"
        if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.bool:
            check(f"{name}: shape", False,
                  f"expected a bool tensor of shape {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}")
        if torch.equal(got, want):
            check(name, True, "")
            continue
        sees_pad = bool((got & ~real[:, None, None, :]).any())
        future = bool((got & ~faults.causal(q_len, real.shape[1])[None, None]).any())
        hides = bool((want & ~got).any())
        right_padded = torch.equal(got, faults.keep_right_padded(real, q_len))
        hint = ("right padding assumed: keys 0..length-1 are not where a left-padded sequence's tokens are; use "
                "`real` itself" if right_padded else
                "a query sees padding: mask the keys that are not real tokens" if sees_pad else
                "a query sees a key after its own position: the queries are the LAST q_len positions" if future else
                "a query misses real keys at or before its position (right padding assumed? position of query i is "
                "keys - q_len + i)" if hides else "wrong mask")
        check(name, False, hint)
    if model is not None:
        before = faults.use_attention(model, "lab07_your_mask", faults.attention_function(fn))
        try:
            found = divergence.find(captured, model)
            tokens = divergence.generate(model, captured.batch, new_tokens)
        finally:
            model.set_attn_implementation(before)
        check("the model with your mask: no module diverges", found.first_propagated is None, found.summary())
        same = divergence.compare_tokens(ref_tokens[:, :new_tokens], tokens)
        check("the model with your mask: the tokens equal the unmodified model's", same.equal, str(same))


def check_prediction(fn, found) -> None:
    guess = fn()
    check("a module name", isinstance(guess, str) and guess != "", f"return a name such as 'lm_head', not {guess!r}")
    hint = (f"the finder names {found.culprit!r}. " + (
        "The angles are applied inside attention, but attention is right when its inputs (cos, sin) are right: "
        "which module computes cos and sin?" if "self_attn" in guess or "layers" in guess else
        "Which module computes the cos/sin of every position, once per forward pass?"))
    check(f"your prediction {guess!r}", guess == found.culprit, hint)
