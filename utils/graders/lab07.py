"""Lab 07's graders: 7.1 which code a GPU runs, 7.2 the culprit, 7.3 a float32 GEMV, 7.4 a mask for left padding, 7.5 the prediction."""
import math
import random

import torch

from utils import grading_guard
from utils.clinic import divergence, doctor, faults
from utils.clinic.divergence import Row
from utils.exercises import call_answer, check


def _quiet(name, ok, hint):
    """check() without its PASS line (for the cases the notebook's stored output does not list)."""
    if not ok:
        check(name, False, hint)


def _fresh_rng() -> random.Random:
    """Random cases drawn on every grade, beside the fixed ones, without PASS lines of their own (a table of the
    tried cases, or a result kept from an earlier grade, fails); a failure names the seed (utils.grading_guard)."""
    return random.Random(grading_guard.fresh_seed())


def _left_alone(name, inputs, what, given, original):
    """Fail an answer that changed a list it was given (call_answer sees to tensors)."""
    if given != original:
        check(name, False, f"on {inputs} your code changed its input {what}: read it, never write into it (sort or "
                           "filter a copy)")


def _kind(t):
    return (f"[{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')}"
            + ("" if t.is_contiguous() else " (a strided view)"))


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
MORE_RUNNABLE_CASES = [   # the other direction of each rule (checked without PASS lines of their own)
    ("sm_80", ["sm_86", "sm_89"], "a higher minor's machine code never runs on a lower one (sm_86 code on sm_80)"),
    ("sm_90", ["compute_90"], "PTX of the GPU's own architecture runs (compiled at first use)"),
    ("sm_90", ["sm_80", "compute_80", "compute_90"], "several PTX entries: the newest one not newer than the GPU"),
    ("sm_86", ["sm_80", "sm_90", "compute_90"], "the same major with a lower minor runs; a newer PTX does not"),
    ("gfx1100", ["gfx11-generic", "gfx1100"], "the chip's own code objects come first, before its family's generic "
                                              "ones"),
    ("gfx1101", ["gfx1100", "gfx1102"], "gfx1100 and gfx1102 code is not gfx1101 code, in either direction"),
    ("gfx950", ["gfx942", "gfx9-4-generic"], "the family's generic target runs on every member"),
    ("gfx90a", ["gfx9-generic", "gfx942"], "gfx90a belongs to no generic family (doctor.family says which does)"),
]


NVIDIA_GPUS = ["sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120"]
NVIDIA_TARGETS = NVIDIA_GPUS + ["sm_90a", "sm_100a", "compute_70", "compute_80", "compute_86", "compute_90",
                                "compute_100", "compute_120"]
AMD_GPUS = sorted({"gfx908", "gfx90a", *(g for members in doctor.AMD_FAMILIES.values() for g in members)})
AMD_TARGETS = AMD_GPUS + list(doctor.AMD_FAMILIES)


def _fresh_runnable_cases(n=6):
    """`n` GPUs, each with a random shuffled arch list of its vendor's targets: two thirds of them hold a target
    that runs, the rest none."""
    rng, cases = _fresh_rng(), []
    while len(cases) < n:
        gpus, targets = rng.choice([(NVIDIA_GPUS, NVIDIA_TARGETS), (AMD_GPUS, AMD_TARGETS)])
        arch, archs = rng.choice(gpus), rng.sample(targets, rng.randint(1, 7))
        if (doctor.runnable_target(arch, archs) is not None) == (len(cases) % 3 != 2):
            cases.append((arch, archs, "an arch list drawn at random"))
    return cases


def check_runnable_target(fn) -> None:
    for (arch, archs, why), say in [*((case, check) for case in RUNNABLE_CASES),
                                    *((case, _quiet) for case in MORE_RUNNABLE_CASES + _fresh_runnable_cases())]:
        name = f"{arch} on [{' '.join(archs[:3])}{' ...' if len(archs) > 3 else ''}]"
        want, inputs, given = doctor.runnable_target(arch, archs), f"runnable_target({arch!r}, {archs})", list(archs)
        got = call_answer(name, fn, (arch, given), inputs)
        _left_alone(name, inputs, "arch_list", given, archs)
        if not isinstance(got, (str, type(None))):
            check(name, False, f"on {inputs}: return one entry of arch_list (a str) or None, got {got!r}")
        say(name, got == want, f"{why}: expected {want!r}, got {got!r}")


# what computes the answer: the grader may call it, the answer may not
check_runnable_target.may_not_call = ('utils.clinic.doctor.runnable_target',)


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
MORE_CULPRIT_CASES = [   # checked without PASS lines of their own
    ([], 1e-3, None, "no modules: no culprit"),
    (_rows(("a", 0.5, None), ("b", 0.6, math.nan), ("c", 0.7, 0.9)), 1e-3, "b",
     "the first module above the tolerance in finishing order (NaN is above it)"),
    (_rows(("x", 0.0, 0.0), ("y", 5e-4, 5e-4), ("z", 0.2, 0.0)), 1e-3, None,
     "every module is within the tolerance on the reference's inputs"),
]


def _fresh_culprit_cases(n=4):
    """`n` random tables: errors around the tolerance, NaN, infinity and None among them; the culprit by the rule."""
    rng, cases = _fresh_rng(), []
    for _ in range(n):
        tol = rng.choice([1e-3, 2e-3, 1e-2])
        error = lambda: rng.choice([0.0, tol, tol / 2, tol * 1.5, rng.uniform(0, 4 * tol), math.nan, math.inf, None])
        rows = _rows(*((name, rng.uniform(0, 1), error()) for name in rng.sample(
            ["embed", "norm", "q_proj", "rotary", "attn", "o_proj", "mlp", "lm_head"], rng.randint(1, 6))))
        want = next((r.name for r in rows if r.isolated is not None and not r.isolated <= tol), None)
        cases.append((rows, tol, want, "a table drawn at random: the first module whose isolated error is above "
                                       "the tolerance (NaN is), or None"))
    return cases


def check_culprit(fn) -> None:
    for (rows, tol, want, why), say in [*((case, check) for case in CULPRIT_CASES),
                                        *((case, _quiet) for case in MORE_CULPRIT_CASES + _fresh_culprit_cases())]:
        name = f"culprit of [{', '.join(r.name for r in rows)}]"
        inputs, given = f"culprit({rows}, {tol})", list(rows)
        got = call_answer(name, fn, (given, tol), inputs)
        _left_alone(name, inputs, "rows", given, rows)
        if not isinstance(got, (str, type(None))):
            check(name, False, f"on {inputs}: return the culprit's name (row.name, a str) or None, got {got!r}")
        say(name, got == want, f"{why}: expected {want!r}, got {got!r}")


GEMV_CASES = [(1, 576, 37, 1.0, torch.bfloat16, False), (3, 1000, 9, 50.0, torch.bfloat16, False),   # the notebook
              (2, 4097, 5, 1e3, torch.bfloat16, False), (2, 333, 11, 1.0, torch.float32, False)]    # lists these
MORE_GEMV_CASES = [(4, 1500, 7, 1.0, torch.float16, False), (3, 700, 6, 2.0, torch.bfloat16, True),
                   (1, 1, 1, 1.0, torch.float32, False)]


def _gemv_inputs(g, rows, k, out, scale, dtype, strided, x_bias=0.0):
    x = ((torch.randn(rows, k, generator=g) + x_bias) * scale).to(dtype)
    w = (torch.randn(out, k, generator=g) + 0.5).to(dtype)     # a positive bias: the sum grows with k
    if strided:   # rows of a (rows, 2, k) tensor: row stride 2k, what a reshape of a sliced input gives
        x = torch.stack([x, torch.full_like(x, float("nan"))], dim=1)[:, 0]
    return x, w


def _gemv_cases():
    """(x, weight, shown): the four cases the notebook lists, then FP16, a strided x (as lm_head's input of the last
    position is), one row of one column, and two of random sizes and values (x biased too: no sum cancels out to
    nearly 0, where float32's own rounding would be a large relative error), without PASS lines of their own."""
    g = torch.Generator().manual_seed(7)
    for i, case in enumerate(GEMV_CASES + MORE_GEMV_CASES):
        yield *_gemv_inputs(g, *case), i < len(GEMV_CASES)
    rng = _fresh_rng()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    for dtype, k in ((rng.choice([torch.bfloat16, torch.float16]), rng.randint(2, 2000)),
                     (torch.float32, rng.randint(2, 300))):
        yield *_gemv_inputs(g, rng.randint(1, 4), k, rng.randint(4, 16), rng.choice([1.0, 8.0]), dtype,
                            rng.random() < 0.5, x_bias=0.5), False


def _matmul_slip(exc):
    text = str(exc)
    if "cannot be multiplied" in text or "size mismatch" in text:
        return "; x @ weight.T is (rows, out): weight is (out, k), so it is transposed"
    if "dtype" in text:
        return "; both operands of a matmul need the same dtype (float32 for the sum)"
    return ""


# one rounding of the result to the output dtype: 2^-8 relative for bf16, 2^-10 for fp16 (its 2^-11, with room for
# the order of the sum), about 2^-20 for float32
ALLOWED = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 1e-6}


def check_gemv(fn, model=None, captured=None, ref_tokens=None, new_tokens: int = 8) -> None:
    for x, w, shown in _gemv_cases():
        say = check if shown else _quiet
        name = f"{tuple(x.shape)} @ {tuple(w.shape)}.T in {str(x.dtype).replace('torch.', '')}"
        exact = x.double() @ w.double().t()
        got = call_answer(name, fn, (x, w), f"x {_kind(x)}, weight {_kind(w)}", _matmul_slip, names=["x", "weight"])
        if not isinstance(got, torch.Tensor):
            check(f"{name}: shape and dtype", False, f"return a tensor, got {type(got).__name__}")
        shape = (x.shape[0], w.shape[0])
        if tuple(got.shape) != shape or got.dtype != x.dtype:
            check(f"{name}: shape and dtype", False,
                  f"expected shape {shape} in {x.dtype}, got {tuple(got.shape)} in {got.dtype}"
                  + ("; return it in x's dtype (.to(x.dtype))" if tuple(got.shape) == shape else
                     "; that is weight @ x.T: x @ weight.T is (rows, out)" if tuple(got.shape) == shape[::-1] else ""))
        rel = float(((got.double() - exact).norm(dim=1) / exact.norm(dim=1)).max())
        allowed = ALLOWED[x.dtype]
        say(f"{name}: within one rounding of the exact product", rel <= allowed,
            f"relative error {rel:.2e} > {allowed:.1e}" + (
                ": x here is a strided view, and your result shows what lies between its rows (NaN): read x through "
                "its strides (matmul, or .contiguous())" if not math.isfinite(rel) and not x.is_contiguous() else
                ": the running sum loses bits (is it kept in bf16, or rounded every few products?)" if rel < 0.25 else
                ": that is not x @ weight.T (out[r, o] = the sum over k of x[r, k] * weight[o, k]); an error this large "
                "is no rounding"))
    if model is not None:
        handle = model.lm_head.register_forward_hook(faults.gemv_hook(fn))
        try:
            found = call_answer("the model with your GEMV", divergence.find, (captured, model),
                          "the model's lm_head (x is its input, reshaped to (tokens, hidden))")
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
MORE_MASK_CASES = [  # checked without PASS lines of their own
    (_padding([1, 5, 3, 2], 5), 2, "two queries, a sequence of one token"),
    (_padding([7, 7], 11), 11, "both sequences padded by 4"),
]


def _fresh_mask_cases(n=2):
    rng, cases = _fresh_rng(), []
    for _ in range(n):
        keys = rng.randint(2, 16)
        cases.append((_padding([rng.randint(1, keys) for _ in range(rng.randint(1, 4))], keys), rng.randint(1, keys),
                      "a batch drawn at random"))
    return cases


def check_keep_mask(fn, model=None, captured=None, ref_tokens=None, new_tokens: int = 8) -> None:
    for (real, q_len, what), say in [*((case, check) for case in MASK_CASES),
                                     *((case, _quiet) for case in MORE_MASK_CASES + _fresh_mask_cases())]:
        want = faults.keep_left_padded(real, q_len)
        name = f"{what}: lengths {real.sum(1).tolist()} of {real.shape[1]}, {q_len} queries"
        got = call_answer(name, fn, (real.clone(), q_len), f"real {_kind(real)}, q_len={q_len}", names=["real"])
        if not isinstance(got, torch.Tensor):
            check(f"{name}: shape", False, f"expected a bool tensor of shape {tuple(want.shape)}, got "
                                           f"{type(got).__name__}")
        if tuple(got.shape) != tuple(want.shape) or got.dtype != torch.bool:
            check(f"{name}: shape", False,
                  f"expected a bool tensor of shape {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}")
        if torch.equal(got, want):
            say(name, True, "")
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
            found = call_answer("the model with your mask", divergence.find, (captured, model),
                          "the model's attention (real from its attention mask)")
            tokens = divergence.generate(model, captured.batch, new_tokens)
        finally:
            model.set_attn_implementation(before)
        check("the model with your mask: no module diverges", found.first_propagated is None, found.summary())
        same = divergence.compare_tokens(ref_tokens[:, :new_tokens], tokens)
        check("the model with your mask: the tokens equal the unmodified model's", same.equal, str(same))


def check_prediction(fn, found) -> None:
    guess = call_answer("a module name", fn, (), "predicted_rope_culprit()")
    check("a module name", isinstance(guess, str) and guess.strip() != "", f"return a name such as 'lm_head', not {guess!r}")
    if guess.strip() == found.culprit:
        check(f"your prediction {guess!r}", True, "")
        return
    names = [r.name for r in found.rows]
    if found.culprit.endswith("." + guess.strip()):
        hint = ("that is the module's own attribute name: the finder's tables print the full name from the model's "
                "root, as model.named_modules() does")
    elif "self_attn" in guess or "layers" in guess:
        hint = ("the angles are applied inside attention, but attention is right when its inputs (cos, sin) are "
                "right: which module computes cos and sin?")
    elif guess not in names:
        hint = ("no module of that name runs in this model's forward pass (the finder names modules as "
                "model.named_modules() does); which module computes the cos/sin of every position, once per forward "
                "pass?")
    else:
        hint = "which module computes the cos/sin of every position, once per forward pass?"
    check(f"your prediction {guess!r}", False, "the finder names another module. " + hint[0].upper() + hint[1:])
