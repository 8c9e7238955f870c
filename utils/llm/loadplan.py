"""Lab 05's load test planned for this machine: the one-request probe that decides, each level's windows, the levels.

A serving benchmark's levels only mean something when each holds several requests. On a GPU a request takes a
fraction of a second; on a slow or busy CPU one 16-token answer can take seconds. So lab 05 asks the running server
one request first (``probe``), skips the load levels with the command to run them anyway when they cannot fit in
``LOAD_BUDGET_SECONDS`` (``skip_reason``), and otherwise sizes each level's windows from that request's lifetime
(``windows``). ``run_levels`` then runs the closed loop, takes the capacity it held within the SLO and runs the open
loop below and past it, adding levels past capacity until TTFT grows (``loadgen.past_capacity``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from utils.llm import loadgen, serving

LIFETIMES_PER_WINDOW = 4   # a measured window holds this many request lifetimes (a median of several), budget allowing


def machine_load() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def run_anyway(gpu: bool, budget_s: float) -> str:
    """The command that runs lab 05 with more time for its load levels."""
    return (f"python -m utils.machinery.harness run --device {'gpu' if gpu else 'cpu'} -p LOAD_BUDGET_SECONDS "
            f"{min(int(budget_s), 7200)} solutions/05_llm_serving.ipynb")


def show(level, slo: dict) -> None:
    """Print one level's line as it ends (``loadgen.sweep``'s ``on_level``)."""
    s = level.summary(**slo)
    load = loadgen.row(s)["load"]
    if loadgen.completed_nothing(s):
        print(f"{load:>13}: measured nothing: no request completed in {s['duration_s']:.1f} s "
              f"({s['requests']} started, {s['failed']} failed)")
        return
    print(f"{load:>13}: {s['requests']:4d} requests ({s['failed']} failed) in {s['duration_s']:5.1f} s, "
          f"{s['output_tokens_per_s']:8.1f} tokens/s, TTFT p50 {loadgen.stat_text(s['ttft'], 'p50')}, "
          f"TPOT p50 {loadgen.stat_text(s['tpot'], 'p50')}, goodput {s['goodput_requests_per_s']:.2f} req/s")


@dataclass
class Probe:
    answer: serving.RequestResult | None   # None when it did not end in time
    waited_s: float         # how long the probe was given (None: no limit)

    @property
    def lifetime(self) -> float:
        return self.answer.latency_s if self.answer else math.inf


def probe(server, prompt: str, *, max_tokens: int, left_s: float | None) -> Probe:
    """One load-test-sized request alone, within ``left_s`` seconds (None: no limit)."""
    limit = max(left_s, 1.0) if left_s is not None else None
    try:
        answer = serving.chat(server, prompt, max_tokens=max_tokens, timeout=limit)
    except TimeoutError:
        answer = None
    if answer:
        print(f"answer ({answer.output_tokens} tokens, first after {answer.ttft_s * 1e3:.0f} ms, all in "
              f"{answer.latency_s:.2f} s): {answer.text!r}")
    return Probe(answer, limit)


def skip_reason(found: Probe, *, levels: int, budget_s: float, max_tokens: int, gpu: bool) -> str | None:
    """Why the load levels cannot run in ``budget_s`` (each level's window holding two requests, for a median), with
    the command to run them anyway; None when they fit."""
    need = levels * 2 * found.lifetime
    if need <= budget_s:
        return None
    took = (f"took {found.lifetime:.1f} s" if found.answer else f"did not end within {found.waited_s:.0f} s")
    return (f"one {max_tokens}-token request {took} on this {'GPU' if gpu else 'CPU'} ({machine_load()}), so {levels} "
            f"levels of two requests' time each need " + (f"about {need:.0f} s" if found.answer else "longer")
            + f", more than LOAD_BUDGET_SECONDS={budget_s:g}; to run them anyway: "
            + run_anyway(gpu, math.ceil(2 * need) if found.answer else budget_s * 10))


def windows(lifetime: float, *, load_s: float, warmup_s: float, stretch: tuple[bool, bool], budget_s: float,
            levels: int, gpu: bool) -> tuple[float, float]:
    """(measured seconds, warm-up seconds) per level. A default that is too short for this machine's requests grows
    (``stretch``: which of the two are defaults): the window to hold ``LIFETIMES_PER_WINDOW`` lifetimes, within half
    of each level's share of the budget (the other half: room to extend a level until it holds enough requests); on a
    GPU the warm-up to one lifetime (on a CPU the probe has warmed the server: there is nothing to compile)."""
    new_load, new_warmup = load_s, warmup_s
    if stretch[0] and load_s < LIFETIMES_PER_WINDOW * lifetime:
        share = budget_s / (2 * levels)
        new_load = max(load_s, min(math.ceil(LIFETIMES_PER_WINDOW * lifetime), int(share)))
    if stretch[1] and gpu and warmup_s < lifetime:
        new_warmup = math.ceil(lifetime)
    if (new_load, new_warmup) != (load_s, warmup_s):
        print(f"a request takes about {lifetime:.1f} s here: {new_warmup:g} s of warm-up and {new_load:g} s per level "
              "(at most half of each level's share of LOAD_BUDGET_SECONDS), so that each level holds several requests")
    return new_load, new_warmup


def run_levels(server, requests, *, concurrency, load_percent, arrivals: str, budget_s: float, slo: dict,
               past: int = 3, **run):
    """The closed loop at ``concurrency``, then the open loop at ``load_percent`` % of the capacity the closed loop
    held within the SLO, then up to ``past`` levels past it until TTFT grows, all within ``budget_s``; ``run``:
    ``loadgen.sweep``'s per-level arguments. Returns (closed levels, open levels, capacity in requests/s, how it was
    found)."""
    levels = len(concurrency) + len(load_percent)
    closed = loadgen.sweep(server, "concurrency", concurrency, requests, budget_s=budget_s * len(concurrency) / levels,
                           **run)
    one = next((s for s in closed[0].streams if s.ok and s.chunks), None)
    if one:
        print(f"one request at c={concurrency[0]}: its role-only first chunk arrived after "
              f"{(one.chunks[0][0] - one.sent) * 1e3:.0f} ms, its first token after "
              f"{(next(t for t, text in one.chunks if text) - one.sent) * 1e3:.0f} ms")
    capacity, how = loadgen.capacity(closed, **slo)
    if capacity <= 0:
        print(f"SKIP: the open loop: no closed-loop level completed a request ({how}), so there is no capacity to "
              "take shares of (raise LOAD_BUDGET_SECONDS)")
        return closed, [], capacity, how
    print(f"capacity: {capacity:.3g} requests/s ({how}); open loop at {list(load_percent)}% of it")
    left = budget_s - sum(lv.duration_s for lv in closed)
    timed = dict(burstiness=loadgen.BURSTINESS[arrivals], **run)
    opened = loadgen.sweep(server, "rate", [p / 100 * capacity for p in load_percent], requests, seed=100,
                           budget_s=max(left, 0.0), **timed)
    # past capacity requests queue: until TTFT p90 is 3x the first level's, twice the rate, at most `past` times
    more = loadgen.past_capacity(server, opened, requests, budget_s=left - sum(lv.duration_s for lv in opened),
                                 most=past, **timed)
    if more:
        print(f"{len(more)} more level(s) at twice the rate before each: past capacity, where TTFT grows")
    return closed, opened + more, capacity, how
