"""Lab 00's graders: exercises 0.1-0.5 (a matmul's operations, an add's bytes, a rate, the ridge point, the roofline)."""
import math
import numbers
import random

from utils import grading_guard
from utils.exercises import call_answer, check


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _call(name: str, f, args: tuple):
    """f(*args), or a hint naming the call and what it raised (a stub's own exception goes on: NOT DONE)."""
    call = f"{name}({', '.join(repr(a) for a in args)})"
    got = call_answer(call, f, args, "these numbers", hint=lambda err: "; it takes numbers and returns a number")
    if not _number(got):
        check(call, False, f"returned {got!r}: return one finite number")
    return got


def _fresh(draw, n: int = 4) -> list[tuple]:
    """`n` hidden cases drawn from a fresh seed (new on every grade, named in a failure's message): beside the
    fixed cases, so that a table of the tried cases or a result kept from an earlier grade fails."""
    rng = random.Random(grading_guard.fresh_seed())
    return [draw(rng) for _ in range(n)]


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A value between low and high, evenly spread over the orders of magnitude, to 4 significant digits."""
    return float(f"{math.exp(rng.uniform(math.log(low), math.log(high))):.4g}")


def _close(a, b) -> bool:
    return _number(a) and _number(b) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _mistake(gots, cases, mistakes) -> str | None:
    """The hint of the first known mistake that gives what the answer gave on every case (None: none does)."""
    for hint, wrong in mistakes:
        try:
            if all(_close(got, wrong(*case)) for got, case in zip(gots, cases)):
                return hint
        except (ArithmeticError, ValueError):
            continue
    return None


def _report(i: int, shown: int, name: str, ok: bool, hint: str) -> None:
    """Case `i` of a table: the first `shown` cases are always reported (the learner sees them pass), a hidden one
    only when it fails."""
    if i < shown or not ok:
        check(name, ok, hint)


def _integer_division(gots, wants) -> bool:
    """Whether the answer looks floored (// somewhere): a whole number where the right value is not one, and within 1
    of the right value everywhere (a constant, or a wrong formula that happens to give whole numbers, is not)."""
    return any(g == math.floor(g) != w for g, w in zip(gots, wants)) and \
        all(abs(g - w) <= 1.0 + 1e-9 * abs(w) for g, w in zip(gots, wants))


def _unit_ratio(gots, wants) -> float | None:
    """A power of 1000 by which every answer is off, if there is one."""
    if not all(_number(g) and g and w for g, w in zip(gots, wants)):
        return None
    ratios = [g / w for g, w in zip(gots, wants)]
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        if all(math.isclose(r, 1000.0**k, rel_tol=1e-9) for r in ratios):
            return 1000.0**k
    return None


# --- 0.1 --------------------------------------------------------------------------------------------------

def check_matmul_flops(f):
    cases = [(2, 3, 4), (64, 32, 16), (5, 7, 11), (1, 1, 1), (3, 1, 2), (1, 9, 6)]
    cases += _fresh(lambda rng: tuple(rng.randint(1, 5000) for _ in "mnk"))
    gots = [_call("matmul_flops", f, case) for case in cases]
    wants = [2 * m * n * k for m, n, k in cases]
    known = _mistake(gots, cases, [
        ("a multiply-add is 2 operations (a multiply and an add): count 2 per term of each dot product",
         lambda m, n, k: m * n * k),
        ("the convention counts k multiply-adds per output, 2*k operations (the first add, onto zero, too)",
         lambda m, n, k: m * n * (2 * k - 1)),
        ("each of the m*n outputs is a dot product of length k: the count grows with k as well",
         lambda m, n, k: 2 * m * n),
    ])
    for i, ((m, n, k), got, want) in enumerate(zip(cases, gots, wants)):
        name = ["matmul_flops", "matmul_flops (non-square)"][i] if i < 2 else f"matmul_flops({m}, {n}, {k})"
        if i == 0:
            hint = known or (f"there are {m}*{n} outputs, each a dot product of length {k}, and a multiply-add "
                             "is 2 operations")
            hint = f"matmul_flops(2, 3, 4) returned {got}; {hint}"
        else:
            hint = f"matmul_flops({m}, {n}, {k}) returned {got}; " + (
                known or "the count must use m, n and k each once: 2*m*n*k")
        if i < 2:
            check(name, got == want, hint)
        elif got != want:
            check(name, False, hint)


# --- 0.2 --------------------------------------------------------------------------------------------------

def check_add_bytes(f):
    cases = [(1000, 4), (7, 2), (1, 8), (4099, 2), (3, 1), (0, 4)]
    cases += _fresh(lambda rng: (rng.randint(2, 10**9), rng.choice((1, 2, 4, 8))))
    gots = [_call("add_bytes", f, case) for case in cases]
    known = _mistake(gots, cases, [
        ("a and b are read, and c is written: three arrays move", lambda n, s: 2 * n * s),
        ("n elements of `itemsize` bytes each: multiply by itemsize", lambda n, s: 3 * n),
        ("a and b are read, and c is written: three arrays move, each of n elements", lambda n, s: n * s),
        ("c is only written: two arrays are read and one written, each once (three, not four)",
         lambda n, s: 4 * n * s),
        ("count bytes, not bits: itemsize is already in bytes", lambda n, s: 24 * n * s),
    ])
    for i, ((n, itemsize), got) in enumerate(zip(cases, gots)):
        ok = got == 3 * n * itemsize
        hint = known or f"a and b are read ({2 * n} x {itemsize} bytes) and c is written ({n} x {itemsize} bytes)"
        _report(i, 3, f"add_bytes({n}, {itemsize})", ok, f"returned {got}; {hint}")


# --- 0.3 --------------------------------------------------------------------------------------------------

def check_rate(f):
    shown = [(12_000, 0.004, 1e9), (2 * 8192**3, 1.4, 1e12), (1, 1000.0, 1.0), (3 * 4 * 2**28, 1.07, 1e9)]
    cases = shown + [(5e8, 2.5, 1e9), (7, 0.5, 1e3), (3e15, 3.0, 1e12), (123_456, 0.25, 1e6)]
    cases += _fresh(lambda rng: (_log_uniform(rng, 10, 1e13), _log_uniform(rng, 1e-3, 1e4),
                                 rng.choice((1e6, 1e9, 1e12))))
    gots = [_call("rate", f, case) for case in cases]
    wants = [a / (ms / 1e3) / u for a, ms, u in cases]
    ms_hint = "ms is in milliseconds: the seconds are ms / 1e3"
    mistakes = [
        (ms_hint, lambda a, ms, u: a / ms / u),
        (ms_hint + " (divide by 1000, do not multiply)", lambda a, ms, u: a / (ms * 1e3) / u),
        ("divide by the unit (3e9 bytes per second is 3 GB/s), do not multiply", lambda a, ms, u: a / (ms / 1e3) * u),
        ("amount per second: amount / seconds, not seconds / amount", lambda a, ms, u: (ms / 1e3) / a / u),
        ("the answer is in units of `unit`: divide the rate per second by it (1e9 for GB/s, 1e12 for TFLOP/s)",
         lambda a, ms, u: a / (ms / 1e3)),
    ] + [(f"the answer divides by {c:g} whatever `unit` is: divide by the argument unit "
          "(1e9 for GB/s, 1e12 for TFLOP/s, 1 for per second)", lambda a, ms, u, c=c: a / (ms / 1e3) / c)
         for c in (1e3, 1e6, 1e9, 1e12)] + [
        (ms_hint + "; and divide by the argument unit, whatever it is", lambda a, ms, u, c=c: a / ms / c)
        for c in (1.0, 1e9, 1e12)]
    known = _mistake(gots, cases, mistakes)
    if known is None and _integer_division(gots, wants):
        known = "// rounds down to a whole number: a rate is a float, use /"
    for i, ((amount, ms, unit), got, want) in enumerate(zip(cases, gots, wants)):
        ok = _close(got, want)
        hint = known or "amount / seconds is the rate per second; then divide by the unit"
        hint = f"returned {got!r}, expected {want:.7g}: {hint}"
        _report(i, len(shown), f"rate({amount:,}, {ms}, {unit:g})", ok, hint)


# --- 0.4 --------------------------------------------------------------------------------------------------

def check_ridge_point(f):
    shown = [(989.0, 3350.0), (1307.4, 5300.0), (0.1, 20.0)]
    cases = shown + [(2.0, 1000.0), (67.0, 2039.0), (1.5, 50.0)]
    cases += _fresh(lambda rng: (_log_uniform(rng, 0.05, 5000), _log_uniform(rng, 5, 20000)))
    gots = [_call("ridge_point", f, case) for case in cases]
    wants = [t * 1e12 / (g * 1e9) for t, g in cases]
    factor = "TFLOP/s counts 10^12 operations, GB/s 10^9 bytes: mind the factor 1000"
    inverted = "FLOP per byte: operations per second divided by bytes per second, not the other way round"
    known = _mistake(gots, cases, [
        (factor, lambda t, g: t / g),
        (factor, lambda t, g: t * 1e6 / g),
        (factor + " (10^12 / 10^9 = 1000)", lambda t, g: t * 1e12 / g),
        (inverted, lambda t, g: g * 1e9 / (t * 1e12)),
        (inverted + "; and " + factor, lambda t, g: g / t),
        (inverted + "; and " + factor, lambda t, g: g / t / 1e6),
    ])
    if known is None and _integer_division(gots, wants):
        known = "// rounds down to a whole number: the ridge point is a float, use /"
    for i, ((tflops, gbps), got, want) in enumerate(zip(cases, gots, wants)):
        ok = _close(got, want)
        hint = f"returned {got!r}, expected {want:.7g}: {known or 'operations per second / bytes per second'}"
        _report(i, len(shown), f"ridge_point({tflops}, {gbps})", ok, hint)


# --- 0.5 --------------------------------------------------------------------------------------------------

def check_roofline_tflops(f):
    cases = [(1 / 12, 989.0, 3350.0, "memory"),    # c = a + b in float32 on an H100
             (8192 / 3, 989.0, 3350.0, "compute"),  # an 8192³ bfloat16 matmul on an H100
             (3.0, 1307.4, 5300.0, "memory"),
             (10.0, 0.1, 20.0, "compute"),          # a CPU
             (150.0, 989.0, 3350.0, "memory"),      # just below the ridge point (295 FLOP/byte)
             (600.0, 989.0, 3350.0, "compute"),     # just above it
             (0.25, 2.0, 1000.0, "memory"),
             (40.0, 0.5, 2.0, "compute")]
    slope = lambda i, g_: i * g_ * 1e9 / 1e12          # what memory allows, TFLOP/s
    cases += [(i, t, g, "memory" if slope(i, g) < t else "compute") for i, t, g in _fresh(lambda rng: (
        _log_uniform(rng, 0.01, 10000), _log_uniform(rng, 0.05, 5000), _log_uniform(rng, 5, 20000)))]
    args = [c[:3] for c in cases]
    gots = [_call("roofline_tflops", f, a) for a in args]
    wants = [min(slope(i, g), t) for i, t, g in args]
    both = "take the lower of the two limits (the memory slope and the compute roof, both in TFLOP/s)"
    known = _mistake(gots, args, [
        ("the lower of the two limits applies (min), not the higher", lambda i, t, g: max(slope(i, g), t)),
        ("intensity x GB/s is in GFLOP/s: divide by 1000 for TFLOP/s", lambda i, t, g: min(slope(i, g) * 1e3, t)),
        ("intensity x GB/s is in GFLOP/s, and 1000 GFLOP/s make one TFLOP/s: divide by 1000 (not 10^6)",
         lambda i, t, g: min(slope(i, g) / 1e3, t)),
        ("above the ridge point the compute roof is the limit: " + both.replace("take", "the answer is"),
         lambda i, t, g: slope(i, g)),
        ("below the ridge point memory is the limit (intensity x bandwidth): " + both.replace("take", "the answer is"),
         lambda i, t, g: t),
    ])
    if all(_close(g, w) for g, w in zip(gots, wants)):
        known = None
    elif known is None and all(_close(g, slope(i, b)) or _close(g, t) for g, (i, t, b) in zip(gots, args)):
        known = ("each answer is the memory slope or the compute roof, but some pick the higher one: the switch "
                 "is at the ridge point (exercise 0.4), or simply " + both)
    if known is None and (r := _unit_ratio(gots, wants)):
        known = f"every answer is {r:g} times the right one: the result is in TFLOP/s (10^12 FLOP/s)"
    if known is None and _integer_division(gots, wants):
        known = "// rounds down to a whole number: use /"
    for (intensity, tflops, gbps, roof), got, want in zip(cases, gots, wants):
        if _close(got, want):
            continue
        if known:
            hint = known
        elif roof == "compute":
            hint = f"above the ridge point the compute peak ({tflops} TFLOP/s) is the limit"
        else:
            hint = "below the ridge point memory is the limit: intensity x bandwidth"
        check(f"roofline_tflops({intensity:.4g}, {tflops}, {gbps}), {roof}-bound", False,
              f"returned {got!r}, expected {want:.7g}: {hint}")
    check("roofline_tflops: memory-bound below the ridge point, compute-bound above it", True, "")
