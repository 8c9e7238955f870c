"""Lab 06's graders: 6.1 the bus-bandwidth factor, 6.2 and 6.3 column- and row-parallel linear layers, 6.4 collectives per token."""
import torch
import torch.nn.functional as F

from utils.exercises import check
from utils.multigpu import collectives


def check_bus_factor(f):
    for collective in collectives.COLLECTIVES:
        for n in (2, 3, 4, 8, 16, 1):
            want, got = collectives.bus_factor(collective, n), f(collective, n)
            if isinstance(got, (int, float)) and abs(got - want) < 1e-12:
                continue
            hint = f"{collective} on {n} ranks: expected {want:.4g}, got {got!r}"
            if collective == "all_reduce" and n > 1 and got == (n - 1) / n:
                hint += ("; an all-reduce is a reduce-scatter followed by an all-gather: each rank's link carries "
                         "(n-1)/n of the buffer twice")
            elif collective == "all_reduce" and got == 2:
                hint += "; each rank already holds its own share: 2(n-1)/n, which is 0 on one rank"
            elif collective == "broadcast" and got == (n - 1) / n:
                hint += "; all the data leaves the root through its own link: the factor is 1"
            elif collective != "broadcast" and got == 1:
                hint += "; each rank already holds 1/n of the result, so (n-1)/n of the buffer crosses its link"
            check("bus_factor", False, hint)
    check("bus_factor: every collective on 1 to 16 ranks", True, "")


SPLITS = [(1, 8, 8, 2), (3, 12, 24, 4), (2, 18, 12, 3), (1, 5, 7, 1), (4, 16, 16, 8)]   # tokens, in, out, world


def _inputs(tokens, d_in, d_out, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d_in, tokens, generator=g, dtype=torch.float64).T        # not contiguous, on purpose
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    return x, w


def _reference_columns(x, w, rank, world):
    rows = w.shape[0] // world
    return x @ w[rank * rows:(rank + 1) * rows].T


def check_column_parallel(f):
    for k, (tokens, d_in, d_out, world) in enumerate(SPLITS):
        x, w = _inputs(tokens, d_in, d_out, k)
        x0, w0 = x.clone(), w.clone()
        full = F.linear(x, w)
        parts = [f(x, w, rank, world) for rank in range(world)]
        name = f"column_parallel_linear ({tokens} tokens, {d_in} -> {d_out}, {world} ranks)"
        check(name + " leaves its inputs alone", torch.equal(x, x0) and torch.equal(w, w0), "x or weight was modified")
        shapes = {tuple(p.shape) for p in parts}
        check(name + ": shape", shapes == {(tokens, d_out // world)},
              f"each rank returns [tokens, out/world] = {[tokens, d_out // world]}, got {sorted(shapes)}"
              + ("; it computed all output features: keep only this rank's rows of weight"
                 if shapes == {(tokens, d_out)} else ""))
        joined = torch.cat(parts, dim=-1)
        ok = torch.allclose(joined, full, rtol=1e-10, atol=1e-10)
        interleaved = torch.cat([x @ w[r::world].T for r in range(world)], dim=-1)
        check(name + ": values", ok,
              "rank r keeps rows r*out/world to (r+1)*out/world of weight, contiguous: the ranks' outputs side by "
              "side must be the full output" + (" (yours takes every world-th row)"
                                                if torch.allclose(joined, interleaved) else ""))


def check_row_parallel(f):
    for k, (tokens, d_in, d_out, world) in enumerate(SPLITS):
        if d_in % world:
            continue
        x, w = _inputs(tokens, d_in, d_out, 10 + k)
        cols = d_in // world
        full = F.linear(x, w)
        name = f"row_parallel_linear ({tokens} tokens, {d_in} -> {d_out}, {world} ranks)"
        try:
            parts = [f(x[:, r * cols:(r + 1) * cols], w, r, world) for r in range(world)]
        except NotImplementedError:
            raise                                   # the unfinished exercise's stub: NOT DONE, not wrong
        except RuntimeError as exc:                 # shapes that do not multiply
            check(name, False, f"{exc}: x_part holds in/world input features; multiply it by the matching columns "
                               "of weight, weight[:, rank*in/world:(rank+1)*in/world]")
        check(name + ": shape", {tuple(p.shape) for p in parts} == {(tokens, d_out)},
              f"each rank returns a partial output of the full shape {[tokens, d_out]}")
        total = sum(parts)
        hint = "the partial outputs of all ranks must add up to x @ weight.T"
        if world > 1 and torch.allclose(total * world, full):
            hint += ": the all-reduce adds them; do not divide by world"
        check(name + ": the partial outputs add up to the full output", torch.allclose(total, full, rtol=1e-10, atol=1e-10), hint)
    # one Llama MLP over 4 ranks: column-parallel gate and up (the course's), SiLU, row-parallel down (yours)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    wg, wu = (torch.randn(24, 16, generator=g, dtype=torch.float64) for _ in range(2))
    wd = torch.randn(16, 24, generator=g, dtype=torch.float64)
    full = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    split = sum(f(F.silu(_reference_columns(x, wg, r, 4)) * _reference_columns(x, wu, r, 4), wd, r, 4) for r in range(4))
    check("an MLP split over 4 ranks (gate and up column-parallel, down row-parallel) equals the whole MLP",
          torch.allclose(split, full, rtol=1e-10, atol=1e-10), "each rank's down_proj partial must use its own columns")


def check_collectives_per_token(f):
    for layers, hidden, nbytes in ((32, 4096, 2), (2, 128, 4), (80, 8192, 2), (1, 64, 1)):
        want = 2 * layers, hidden * nbytes      # after o_proj and after down_proj, one token's hidden vector
        got = f(layers, hidden, nbytes)
        try:
            count, size = got
        except (TypeError, ValueError):
            check("collectives_per_token", False, f"return a pair (count, bytes), got {got!r}")
        hint = f"{layers} layers, hidden {hidden}, {nbytes}-byte numbers: expected {want}, got {got!r}"
        if count == 2 * layers + 1:
            hint += ("; this split keeps the embedding whole on every rank, so it needs no all-reduce "
                     "(transformers' plan splits it by vocabulary and pays one more)")
        elif count == layers:
            hint += "; two per layer: after attention's o_proj and after the MLP's down_proj"
        elif size == hidden:
            hint += "; bytes, not numbers: times dtype_bytes"
        elif size != want[1]:
            hint += "; each all-reduce carries one token's hidden vector"
        check(f"collectives_per_token({layers}, {hidden}, {nbytes})", (count, size) == want, hint)
