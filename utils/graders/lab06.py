"""Lab 06's graders: 6.1 the bus-bandwidth factor, 6.2 and 6.3 column- and row-parallel linear layers, 6.4 collectives per token."""
import math
import numbers
import random

import torch
import torch.nn.functional as F

from utils import grading_guard
from utils.exercises import call_answer, check
from utils.multigpu import collectives


def _number(x):
    """x as a float if it is a real number (int, float, numpy scalar, 0-d tensor), else None (bool is no number)."""
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return None
    if isinstance(x, torch.Tensor) and x.numel() == 1 and (x.dtype.is_floating_point or x.dtype in (torch.int32,
                                                                                                    torch.int64)):
        return float(x)
    return float(x) if isinstance(x, numbers.Real) else None


RANKS = (2, 3, 4, 5, 8, 16, 1)
SHARES_ONCE = ("all_gather", "reduce_scatter", "all_to_all")


def _bus_mistakes(collective):
    """(hint, factor on n ranks or None where it tells nothing) for the known mistakes on `collective`."""
    floor = "`//` is floor division: the factor is a fraction ((n-1)//n is 0 on every n), so divide with /"
    common = [
        (floor, lambda n: math.floor(collectives.bus_factor(collective, n))),
        ("that is algbw / busbw, upside down: busbw = algbw x the factor",
         lambda n: 1 / collectives.bus_factor(collective, n) if n > 1 else None),
        ("off by one in n: on n ranks each rank holds 1/n of the data and exchanges with the n - 1 others",
         lambda n: collectives.bus_factor(collective, n + 1) if collective != "broadcast" else None),
        ("off by one in n: on n ranks each rank holds 1/n of the data and exchanges with the n - 1 others",
         lambda n: collectives.bus_factor(collective, n - 1) if collective != "broadcast" and n > 1 else None),
    ]
    if collective == "all_reduce":
        return [(floor, lambda n: 2 * ((n - 1) // n)),
                ("an all-reduce is a reduce-scatter followed by an all-gather: each rank's link carries (n-1)/n of "
                 "the buffer twice", lambda n: (n - 1) / n),
                ("each rank already holds its own share: 2(n-1)/n, which is 0 on one rank", lambda n: 2.0),
                *common]
    if collective in SHARES_ONCE:
        return [("each rank already holds 1/n of the result, so (n-1)/n of the buffer crosses its link",
                 lambda n: 1.0),
                (f"only an all-reduce moves the data twice (a reduce-scatter, then an all-gather); {collective} "
                 "moves each byte once", lambda n: 2 * (n - 1) / n),
                *common]
    return [("all the data leaves the root through its own link: the factor is 1", lambda n: (n - 1) / n),
            ("all the data leaves the root through its own link: the factor is 1", lambda n: 2 * (n - 1) / n),
            *common]


def check_bus_factor(f):
    rng = random.Random(grading_guard.fresh_seed())      # rank counts drawn on every grade, beside RANKS
    ranks = (*RANKS, rng.choice([n for n in range(6, 16) if n not in RANKS]), rng.randint(17, 4096))
    for collective in collectives.COLLECTIVES:
        got = {}
        for n in ranks:
            value = call_answer("bus_factor", f, (collective, n), f"bus_factor({collective!r}, {n})")
            if _number(value) is None:
                check("bus_factor", False, f"bus_factor({collective!r}, {n}) should return a number, got {value!r}")
            got[n] = _number(value)
        wrong = [n for n in ranks if abs(got[n] - collectives.bus_factor(collective, n)) >= 1e-12]
        if not wrong:
            continue
        n = wrong[0]
        hint = f"{collective} on {n} ranks: expected {collectives.bus_factor(collective, n):.4g}, got {got[n]:.4g}"
        for why, factor in _bus_mistakes(collective):
            values = {m: factor(m) for m in ranks}
            if all(v is None or abs(got[m] - v) < 1e-12 for m, v in values.items()) and values[n] is not None:
                hint += "; " + why
                break
        check("bus_factor", False, hint)
    check("bus_factor: every collective on 1 to 16 ranks", True, "")


# tokens, in, out, world, dtype, shown: x is [tokens, in] and not contiguous, on purpose; the cases not `shown` are
# checked without a PASS line of their own (the notebook's stored output lists the others)
SPLITS = [(1, 8, 8, 2, torch.float64, True), (3, 12, 24, 4, torch.float64, True), (2, 18, 12, 3, torch.float64, True),
          (1, 5, 7, 1, torch.float64, True), (4, 16, 16, 8, torch.float64, True),
          (5, 12, 18, 6, torch.float32, False), (7, 30, 10, 5, torch.float64, False)]


def _splits(n=2):
    """(seed, [(*split, seed of its values)]): SPLITS (seeded by their place), then `n` hidden ones of random sizes
    drawn from a fresh seed on every grade (a table of the tried cases, or a result kept from an earlier grade,
    fails)."""
    seed = grading_guard.fresh_seed()
    rng = random.Random(seed)
    fresh = []
    for _ in range(n):
        world = rng.choice((2, 3, 4, 6, 8))
        fresh.append((rng.randint(1, 9), world * rng.randint(1, 6), world * rng.randint(1, 6), world,
                      rng.choice((torch.float64, torch.float32)), False))
    return seed, [(*s, k) for k, s in enumerate(SPLITS)] + [(*s, seed + i) for i, s in enumerate(fresh)]


def _quiet(name, ok, hint):
    """check() without its PASS line."""
    if not ok:
        check(name, False, hint)


def _inputs(tokens, d_in, d_out, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d_in, tokens, generator=g, dtype=torch.float64).T        # not contiguous, on purpose
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def _reference_columns(x, w, rank, world):
    rows = w.shape[0] // world
    return x @ w[rank * rows:(rank + 1) * rows].T


def _close(a, b):
    tol = 1e-10 if b.dtype == torch.float64 else 1e-4
    return torch.allclose(a.to(b.dtype), b, rtol=tol, atol=tol)


def _kind(t):
    return f"[{', '.join(map(str, t.shape))}] {str(t.dtype).removeprefix('torch.')}"


def _tensor(name, got, x, inputs):
    """A hint unless `got` is a tensor in x's dtype."""
    if not isinstance(got, torch.Tensor):
        check(name, False, f"on {inputs} return a tensor, got {type(got).__name__}")
    if got.dtype != x.dtype:
        check(name, False, f"on {inputs} return the result in x's dtype ({str(x.dtype).removeprefix('torch.')}), got "
                           f"{str(got.dtype).removeprefix('torch.')}")


def _shape_slip(exc):
    text = str(exc)
    return ("; the shapes do not multiply: check which axis of weight you slice and that you multiply by its "
            "transpose (weight is [out, in])" if "cannot be multiplied" in text or "size of tensor" in text or
            "size mismatch" in text else "")


def check_column_parallel(f):
    for tokens, d_in, d_out, world, dtype, shown, seed in _splits()[1]:
        say = check if shown else _quiet
        x, w = _inputs(tokens, d_in, d_out, seed, dtype)
        full = F.linear(x, w)
        name = f"column_parallel_linear ({tokens} tokens, {d_in} -> {d_out}, {world} ranks)"
        parts = []
        for rank in range(world):
            inputs = f"x {_kind(x)}, weight {_kind(w)}, rank={rank}, world={world}"
            parts.append(call_answer(name, f, (x, w, rank, world), inputs, _shape_slip, names=["x", "weight"]))
            _tensor(name, parts[-1], x, inputs)
        say(name + " leaves its inputs alone", True, "")     # call_answer failed any call that changed x or weight
        shapes = {tuple(p.shape) for p in parts}
        say(name + ": shape", shapes == {(tokens, d_out // world)},
              f"each rank returns [tokens, out/world] = {[tokens, d_out // world]}, got {sorted(shapes)}"
              + ("; it computed all output features: keep only this rank's rows of weight"
                 if shapes == {(tokens, d_out)} else ""))
        joined = torch.cat(parts, dim=-1)
        interleaved = torch.cat([x @ w[r::world].T for r in range(world)], dim=-1)
        reversed_ranks = torch.cat([_reference_columns(x, w, world - 1 - r, world) for r in range(world)], dim=-1)
        say(name + ": values", _close(joined, full),
              "rank r keeps rows r*out/world to (r+1)*out/world of weight, contiguous: the ranks' outputs side by "
              "side must be the full output" + (" (yours takes every world-th row)" if _close(joined, interleaved)
                                                else " (yours gives rank r the share of rank world-1-r)"
                                                if _close(joined, reversed_ranks) else ""))


def check_row_parallel(f):
    seed, splits = _splits()
    for tokens, d_in, d_out, world, dtype, shown, values in splits:
        if d_in % world:
            continue
        say = check if shown else _quiet
        x, w = _inputs(tokens, d_in, d_out, 10 + values, dtype)
        cols = d_in // world
        full = F.linear(x, w)
        name = f"row_parallel_linear ({tokens} tokens, {d_in} -> {d_out}, {world} ranks)"
        parts = []
        for r in range(world):
            part = x[:, r * cols:(r + 1) * cols]
            inputs = f"x_part {_kind(part)} (a strided slice), weight {_kind(w)}, rank={r}, world={world}"
            parts.append(call_answer(name, f, (part, w, r, world), inputs, lambda exc: (
                ": x_part holds in/world input features; multiply it by the matching columns of weight, "
                "weight[:, rank*in/world:(rank+1)*in/world]" if _shape_slip(exc) else ""), names=["x_part", "weight"]))
            _tensor(name, parts[-1], x, inputs)
        say(name + ": shape", {tuple(p.shape) for p in parts} == {(tokens, d_out)},
              f"each rank returns a partial output of the full shape {[tokens, d_out]}, got "
              f"{sorted({tuple(p.shape) for p in parts})}")
        total = sum(parts)
        hint = "the partial outputs of all ranks must add up to x @ weight.T"
        if world > 1 and _close(total * world, full):
            hint += ": the all-reduce adds them; do not divide by world"
        elif world > 1 and _close(total / world, full):
            hint += ": the all-reduce adds them, so each rank returns only its own partial product"
        say(name + ": the partial outputs add up to the full output", _close(total, full), hint)
    # one Llama MLP over 4 ranks: column-parallel gate and up (the course's), SiLU, row-parallel down (yours)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(24, 16, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(16, 24, generator=g, dtype=torch.float64)
    full = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    split = 0
    for r in range(4):
        h = F.silu(_reference_columns(x, wg, r, 4)) * _reference_columns(x, wu, r, 4)
        part = call_answer("row_parallel_linear", f, (h, wd, r, 4), f"an MLP's down_proj, x_part {_kind(h)}, weight "
                           f"{_kind(wd)}, rank={r}, world=4", names=["x_part", "weight"])
        _tensor("row_parallel_linear", part, h, f"an MLP's down_proj on rank {r}")
        split = split + part
    check("an MLP split over 4 ranks (gate and up column-parallel, down row-parallel) equals the whole MLP",
          tuple(split.shape) == tuple(full.shape) and _close(split, full),
          "each rank's down_proj partial must use its own columns")


def check_collectives_per_token(f):
    rng = random.Random(grading_guard.fresh_seed())
    fresh = [(rng.randint(1, 128), 64 * rng.randint(1, 256), rng.choice((1, 2, 4))) for _ in range(2)]
    listed = [(32, 4096, 2), (2, 128, 4), (80, 8192, 2), (1, 64, 1)]    # the notebook's stored output lists these
    for (layers, hidden, nbytes), shown in [*((c, True) for c in listed), *((c, False) for c in [(3, 96, 4), *fresh])]:
        want = 2 * layers, hidden * nbytes      # after o_proj and after down_proj, one token's hidden vector
        got = call_answer("collectives_per_token", f, (layers, hidden, nbytes),
                    f"collectives_per_token({layers}, {hidden}, {nbytes})")
        try:
            count, size = got
        except (TypeError, ValueError):
            check("collectives_per_token", False, f"return a pair (count, bytes), got {got!r}")
        count, size = _number(count), _number(size)
        if count is None or size is None:
            check("collectives_per_token", False, f"return a pair of numbers (count, bytes), got {got!r}")
        hint = f"{layers} layers, hidden {hidden}, {nbytes}-byte numbers: expected {want}, got {got!r}"
        if (count, size) == want:
            if shown:
                check(f"collectives_per_token({layers}, {hidden}, {nbytes})", True, "")
            continue
        if count == 2 * layers + 1:
            hint += ("; this split keeps the embedding whole on every rank, so it needs no all-reduce "
                     "(transformers' plan splits it by vocabulary and pays one more)")
        elif count == layers:
            hint += "; two per layer: after attention's o_proj and after the MLP's down_proj"
        elif count == 7 * layers:
            hint += ("; only the row-parallel layers (o_proj, down_proj) end with an all-reduce: the column-parallel "
                     "ones need none")
        elif count != 2 * layers:
            hint += "; count the row-parallel layers of one decoder layer, times the layers"
        elif size == hidden:
            hint += "; bytes, not numbers: times dtype_bytes"
        elif size == hidden * nbytes * 8:
            hint += "; bytes, not bits: no factor 8"
        else:
            hint += "; each all-reduce carries one token's hidden vector"
        check(f"collectives_per_token({layers}, {hidden}, {nbytes})", False, hint)
