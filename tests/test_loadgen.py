"""utils.llm.loadgen without a server: the metric definitions on synthetic streams (role-only and usage chunks,
multi-token chunks, one-token answers), seeded arrivals (Poisson, bursty, constant), the closed and open
loops against a fake engine (warm-up left out, a failed request counted and the level goes on, queueing
seen from the scheduled arrival), and throughput and goodput over the measured window."""
import asyncio
import math
import time

import pytest

from utils import course
from utils.llm import loadgen
from utils.llm.loadgen import Request, Stream, request_metrics

ms = 1e-3


def approx(x, rel=1e-9):
    return pytest.approx(x, rel=rel, abs=1e-12)


def test_metrics_skip_the_role_only_chunk_and_the_usage_chunk():
    # sent at 0; role-only chunk at 50 ms; tokens at 200, 250, 300, 350 ms; usage chunk at 351; end 360
    chunks = [(50 * ms, 0), (200 * ms, 1), (250 * ms, 1), (300 * ms, 1), (350 * ms, 1), (351 * ms, 0)]
    m = request_metrics(0.0, chunks, 360 * ms, 4)
    assert m["ttft"] == approx(0.2) and m["e2e"] == approx(0.36)
    assert m["tpot"] == approx(0.16 / 3)
    assert m["itl"] == [approx(0.05)] * 3


def test_metrics_split_multi_token_chunks_into_per_token_gaps():
    # 1 token at 100 ms, then 3 tokens arrive together 90 ms later, then 2 tokens 60 ms later
    m = request_metrics(0.0, [(100 * ms, 1), (190 * ms, 3), (250 * ms, 2)], 250 * ms, 6)
    assert m["itl"] == [approx(0.03)] * 5
    assert m["tpot"] == approx(0.15 / 5)
    # the first chunk's extra tokens have no gap of their own to measure
    m = request_metrics(0.0, [(100 * ms, 2), (200 * ms, 1)], 200 * ms, 3)
    assert m["ttft"] == approx(0.1) and m["itl"] == [approx(0.1)] and m["tpot"] == approx(0.05)


def test_metrics_gap_runs_from_the_previous_token_not_an_empty_chunk():
    m = request_metrics(0.0, [(100 * ms, 1), (150 * ms, 0), (200 * ms, 1)], 200 * ms, 2)
    assert m["itl"] == [approx(0.1)]


def test_a_one_token_answer_has_no_tpot_and_no_itl():
    m = request_metrics(1.0, [(1.1, 0), (1.3, 1)], 1.31, 1)
    assert m["ttft"] == approx(0.3) and math.isnan(m["tpot"]) and m["itl"] == []
    with pytest.raises(ValueError, match="no token"):
        request_metrics(0.0, [(0.1, 0)], 0.2, 0)


def test_describe_reports_mean_median_p90_p99_and_count():
    d = loadgen.describe([float(i) for i in range(1, 101)] + [math.nan])
    assert d["n"] == 100 and d["mean"] == 50.5 and d["p50"] == 50.5
    assert d["p90"] == approx(90.1) and d["p99"] == approx(99.01)
    assert loadgen.describe([])["n"] == 0 and math.isnan(loadgen.describe([])["p50"])


def test_chunk_tokens_counted_by_the_tokenizer_at_least_one_per_text():
    class Words:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    chunks = [(0.1, ""), (0.2, "one"), (0.3, "two three"), (0.4, " ")]
    assert loadgen.count_chunk_tokens(chunks, Words()) == [(0.1, 0), (0.2, 1), (0.3, 2), (0.4, 1)]
    assert loadgen.count_chunk_tokens(chunks) == [(0.1, 0), (0.2, 1), (0.3, 1), (0.4, 1)]


def cv(times):
    import numpy as np

    gaps = np.diff([0.0, *times])
    return gaps.std() / gaps.mean()


def test_arrivals_are_seeded_at_the_rate_with_the_asked_burstiness():
    poisson = loadgen.arrival_times(50, 200, seed=1)
    assert poisson == loadgen.arrival_times(50, 200, seed=1) != loadgen.arrival_times(50, 200, seed=2)
    assert len(poisson) == pytest.approx(50 * 200, rel=0.05) and all(0 < t < 200 for t in poisson)
    assert cv(poisson) == pytest.approx(1.0, abs=0.05)                          # exponential gaps
    assert cv(loadgen.arrival_times(50, 200, burstiness=0.25)) == pytest.approx(2.0, abs=0.2)
    constant = loadgen.arrival_times(4, 2.0, burstiness=math.inf)
    assert constant == approx([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="rate="):
            loadgen.arrival_times(bad, 1)
    with pytest.raises(ValueError, match="burstiness="):
        loadgen.arrival_times(1, 1, burstiness=0)


def test_the_labs_arrival_kinds():
    """ARRIVALS of lab 05: its allowed names are loadgen's, and each gives its spread of gaps."""
    assert set(course.declared("05")["ARRIVALS"].allowed) == set(loadgen.BURSTINESS)
    spread = {k: cv(loadgen.arrival_times(50, 200, burstiness=b, seed=3)) for k, b in loadgen.BURSTINESS.items()}
    assert spread["constant"] == pytest.approx(0, abs=1e-6)
    assert spread["poisson"] == pytest.approx(1, abs=0.05)
    assert spread["bursty"] == pytest.approx(2 ** 0.5, abs=0.1)          # gamma, shape 0.5: CV = 1 / sqrt(0.5)


def fake_engine(*, ttft=0.02, step=0.005, tokens=5, slots=None, fail=None):
    """A streaming engine in-process: a role chunk, then one token per step, then a usage chunk. With
    ``slots``, at most that many requests are served at once (the rest queue, as in a busy server)."""
    gate = asyncio.Semaphore(slots) if slots else None
    now = time.perf_counter
    state = {"in_flight": 0, "most": 0}

    async def serve(s: Stream):
        s.sent = now()
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        try:
            if fail and fail(s):
                await asyncio.sleep(0.001)
                raise ConnectionError("connection reset by peer")
            if gate:
                await gate.acquire()
            try:
                s.chunks.append((now(), ""))
                await asyncio.sleep(ttft)
                for _ in range(tokens):
                    s.chunks.append((now(), "tok"))
                    await asyncio.sleep(step)
                s.chunks.append((now(), ""))
                s.output_tokens = tokens
                s.end = now()
            finally:
                if gate:
                    gate.release()
        finally:
            state["in_flight"] -= 1

    return serve, state


REQUESTS = [Request("a", 10), Request("b", 20), Request("c", 30)]


def test_closed_loop_keeps_c_in_flight_and_leaves_the_warmup_out():
    send, state = fake_engine()
    streams, (w0, w1) = asyncio.run(loadgen.run_level(send, "concurrency", 3, REQUESTS, duration_s=0.6,
                                                      warmup_s=0.2))
    assert state["most"] == 3
    assert w1 - w0 == approx(0.6)
    warm = [s for s in streams if s.warmup]
    assert warm and all(s.scheduled < w0 for s in warm)
    assert all(w0 <= s.scheduled < w1 for s in streams if not s.warmup)
    level = loadgen.Level("concurrency", 3, (w0, w1), streams)
    summary = level.summary()
    assert summary["requests"] == len(streams) - len(warm) and summary["failed"] == 0
    # each request takes ~45 ms for 5 tokens: 3 clients give ~330 tokens/s at most
    assert 100 < summary["output_tokens_per_s"] < 360
    assert summary["ttft"]["p50"] == pytest.approx(0.02, abs=0.015)
    assert summary["itl"]["n"] == 4 * summary["requests"]


def test_a_failed_request_is_counted_and_the_level_goes_on():
    send, _ = fake_engine(fail=lambda s: s.request.prompt == "b")
    streams, window = asyncio.run(loadgen.run_level(send, "rate", 40, REQUESTS, duration_s=0.5, seed=3))
    level = loadgen.Level("rate", 40, window, streams)
    summary = level.summary()
    failed = [s for s in streams if s.request.prompt == "b"]
    assert failed and summary["failed"] == len(failed) and summary["requests"] == len(streams)
    assert all(e.startswith("ConnectionError: connection reset") for e in level.errors())
    assert len(level.per_request()) == len(streams) - len(failed) > 0


def test_open_loop_sends_at_the_rate_and_latency_counts_queueing_from_the_arrival():
    # light load: ~rate x duration arrivals, none waits
    send, _ = fake_engine()
    streams, window = asyncio.run(loadgen.run_level(send, "rate", 30, REQUESTS, duration_s=1.0, warmup_s=0.2,
                                                    seed=0))
    arrivals = loadgen.arrival_times(30, 1.2, seed=0)
    assert len(streams) == len(arrivals)
    assert sum(not s.warmup for s in streams) == sum(a >= 0.2 for a in arrivals)
    light = loadgen.Level("rate", 30, window, streams).summary()
    # overload: one slot serves ~22 requests/s and 60/s arrive; the queue shows up in TTFT, and the
    # completed requests per second stay at the engine's capacity
    send, _ = fake_engine(slots=1)
    streams, window = asyncio.run(loadgen.run_level(send, "rate", 60, REQUESTS, duration_s=1.0, seed=0))
    heavy = loadgen.Level("rate", 60, window, streams).summary()
    assert heavy["ttft"]["p90"] > 5 * light["ttft"]["p90"]
    assert heavy["requests_per_s"] < 30 < heavy["requests"]


def test_requests_unfinished_after_the_drain_are_failures():
    send, _ = fake_engine(step=0.2, tokens=10)     # each request takes 2 s
    streams, window = asyncio.run(loadgen.run_level(send, "concurrency", 2, REQUESTS, duration_s=0.1,
                                                    drain_s=0.3))
    level = loadgen.Level("concurrency", 2, window, streams)
    assert level.summary()["failed"] == 2
    assert all("not finished 0.3 s after the level ended" in e for e in level.errors())


def synthetic_stream(start, ttft, tpot, n, warmup=False):
    s = Stream(Request("p", 5), scheduled=start, warmup=warmup, sent=start)
    s.chunks = [(start + ttft + i * tpot, "x") for i in range(n)]
    s.end = start + ttft + (n - 1) * tpot
    s.output_tokens = n
    return s


def test_window_throughput_goodput_and_slo():
    # window [10, 20): four requests; tokens arrive every 0.1 s
    streams = [synthetic_stream(9.05, 0.5, 0.1, 10, warmup=True),  # tokens 9.55..10.45: 5 in the window
               synthetic_stream(10.0, 0.1, 0.1, 11),               # ends 11.1, TTFT 0.1, TPOT 0.1
               synthetic_stream(12.0, 0.5, 0.02, 11),              # ends 12.7, TTFT 0.5 (misses a 0.3 s SLO)
               synthetic_stream(19.45, 0.2, 0.1, 11)]              # tokens 19.65..19.95 in it, ends after
    level = loadgen.Level("rate", 0.4, (10.0, 20.0), streams)
    s = level.summary(slo_ttft_s=0.3, slo_tpot_s=0.05)
    assert s["requests"] == 3 and s["failed"] == 0
    assert s["output_tokens_per_s"] == approx((5 + 11 + 11 + 4) / 10)
    assert s["requests_per_s"] == approx(3 / 10)                            # the warm-up one ends at 10.45
    assert s["goodput_requests_per_s"] == 0.0                               # each misses TTFT or TPOT
    assert s["slo_met"] == 0.0
    s = level.summary(slo_ttft_s=0.3, slo_tpot_s=0.15)
    assert s["goodput_requests_per_s"] == approx(1 / 10)                    # the one ending at 11.1
    assert s["slo_met"] == approx(2 / 3)                                    # of the measured ones
    assert s["ttft"]["n"] == 3 and s["ttft"]["p50"] == approx(0.2)
    row = loadgen.row(s)
    assert row["load"] == "0.4 req/s" and row["requests"] == 3 and row["goodput req/s"] == approx(0.1)
    # of 100, 500, 200 ms: three requests support a mean and a median, not a p90 (10) or a p99 (100)
    assert row["TTFT ms: mean / p50 / p90 / p99"] == "267 / 200 / · / ·"
    assert loadgen.stat_text(s["ttft"], "p50") == "200 ms"
    assert loadgen.stat_text(s["ttft"], "p90") == "not enough requests (n=3)"
    assert not loadgen.completed_nothing(s)


def test_percentiles_need_enough_requests():
    one = loadgen.describe([0.25])
    assert loadgen.supported(one, "mean") and not loadgen.supported(one, "p50")   # p50 = p90 = p99 of one request
    assert loadgen.stat_text(one, "p99") == "not enough requests (n=1)"
    ten, hundred = loadgen.describe([0.1] * 10), loadgen.describe([0.1] * 100)
    assert loadgen.supported(ten, "p90") and not loadgen.supported(ten, "p99") and loadgen.supported(hundred, "p99")
    assert [loadgen.needs(q) for q in ("p50", "p90", "p99")] == [2, 10, 100]


def test_a_level_that_completed_nothing_says_so():
    # window [10, 20): the only request started in the warm-up and ended after the window
    level = loadgen.Level("concurrency", 1, (10.0, 20.0), [synthetic_stream(5.0, 16.0, 1.0, 2, warmup=True)])
    s = level.summary()
    assert s["requests"] == 0 and loadgen.completed_nothing(s)
    assert loadgen.row(s)["TTFT ms: mean / p50 / p90 / p99"] == "– / – / – / –"


def test_a_slow_level_goes_on_until_it_has_requests_up_to_its_cap():
    # each request takes ~0.25 s; a 0.1 s window would start one request at most
    send, _ = fake_engine(ttft=0.05, step=0.05, tokens=4)
    streams, (w0, w1) = asyncio.run(loadgen.run_level(send, "concurrency", 1, REQUESTS, duration_s=0.1,
                                                      min_requests=3, max_duration_s=5.0))
    assert sum(not s.warmup for s in streams) == 3 and 0.4 < w1 - w0 < 2.0
    streams, (w0, w1) = asyncio.run(loadgen.run_level(send, "concurrency", 1, REQUESTS, duration_s=0.1,
                                                      min_requests=50, max_duration_s=0.6))
    assert w1 - w0 <= 0.6 + 0.3 and sum(not s.warmup for s in streams) < 50          # the cap wins
    # open loop at 10 requests/s for 0.05 s: the next arrivals of the same process are kept until there are 4
    streams, (w0, w1) = asyncio.run(loadgen.run_level(send, "rate", 10, REQUESTS, duration_s=0.05, seed=1,
                                                      min_requests=4, max_duration_s=60))
    arrivals = loadgen.arrival_times(10, 60, seed=1)
    assert len(streams) == 4 and w1 - w0 == pytest.approx(arrivals[3], abs=1e-3)


def test_bad_levels_are_refused():
    send, _ = fake_engine()
    with pytest.raises(ValueError, match="mode="):
        asyncio.run(loadgen.run_level(send, "batch", 1, REQUESTS, duration_s=0.1))
    with pytest.raises(ValueError, match="concurrency 2.5"):
        asyncio.run(loadgen.run_level(send, "concurrency", 2.5, REQUESTS, duration_s=0.1))
    with pytest.raises(ValueError, match="no requests"):
        asyncio.run(loadgen.run_level(send, "rate", 1, [], duration_s=0.1))


def test_the_prompt_set_ships_with_the_course():
    requests = loadgen.prompt_set(lambda p: len(p.split()))
    assert len(requests) == 40 and len({r.prompt for r in requests}) == 40
    lengths = [r.prompt_tokens for r in requests]
    assert min(lengths) < 10 and max(lengths) > 40


def test_the_load_figures_show_a_level_that_measured_nothing():
    """One panel per figure, sized for a report page; a level that completed no request is drawn as such (the knee
    marks it on the axis), never as a throughput; p90 lines only where 10 requests support them."""
    ok = [synthetic_stream(10.0 + i, 0.1, 0.05, 11) for i in range(4)]
    good = loadgen.Level("concurrency", 4, (10.0, 20.0), ok).summary(slo_ttft_s=0.3, slo_tpot_s=0.1)
    empty = loadgen.Level("concurrency", 1, (10.0, 20.0), [synthetic_stream(5.0, 16.0, 1.0, 2, warmup=True)]).summary()
    rate = loadgen.Level("rate", 0.5, (10.0, 20.0), ok).summary(slo_ttft_s=0.3, slo_tpot_s=0.1)
    knee = loadgen.plot_knee([empty, good], [rate], slo_tpot_s=0.1)
    texts = [t.get_text() for t in knee.axes[0].texts]
    assert "c=1: measured nothing" in texts and "c=4" in texts
    labels = knee.axes[0].get_legend_handles_labels()[1]
    assert "measured nothing (no request completed)" in labels and not any("p90" in x for x in labels)
    assert tuple(knee.get_size_inches()) == loadgen.FIGSIZE and len(knee.axes) == 1
    sat = loadgen.plot_saturation([empty, good], ceiling=lambda c: 100 * c)
    assert any("measured nothing" in t.get_text() for t in sat.axes[0].texts)
    assert len(loadgen.plot_rates([rate], slo_ttft_s=0.3).axes) == 2          # the latencies and a requests/s axis
    # one request per level (a busy CPU): no median, so each level is its mean, hollow and labelled, not a bare frame
    one = [loadgen.Level(m, x, (10.0, 20.0), [synthetic_stream(10.5, 0.1, 0.05, 11)]).summary()
           for m, x in (("concurrency", 1), ("rate", 0.5))]
    knee, rates = loadgen.plot_knee([one[0]], [one[1]]), loadgen.plot_rates([one[1]])
    for fig in (knee, rates):
        hollow = [l for l in fig.axes[0].lines if l.get_markerfacecolor() == "none" and len(l.get_xdata())]
        assert hollow and any("mean of < 2 requests" in l.get_label() for l in hollow)
    # every open-loop level measured nothing (a busy machine): the figure says so, with no latency to draw
    none = [loadgen.Level("rate", x, (10.0, 20.0), [synthetic_stream(5.0, 16.0, 1.0, 2, warmup=True)]).summary(
        slo_ttft_s=0.3, slo_tpot_s=0.1) for x in (0.08, 0.24)]
    empty_rates = loadgen.plot_rates(none, slo_ttft_s=0.3, slo_tpot_s=0.1)
    assert sum("measured nothing" in t.get_text() for t in empty_rates.axes[0].texts) == 2
    import matplotlib.pyplot as plt

    plt.close("all")


def test_capacity_is_the_most_the_closed_loop_held_within_the_slo():
    slo = dict(slo_ttft_s=0.3, slo_tpot_s=0.05)
    fast = [synthetic_stream(10.0 + i, 0.1, 0.02, 11) for i in range(8)]        # 8 requests in 10 s, within the SLO
    slow = [synthetic_stream(10.0 + i / 2, 0.5, 0.1, 11) for i in range(16)]    # 16, every one past it
    c1, c8 = loadgen.Level("concurrency", 1, (10.0, 20.0), fast), loadgen.Level("concurrency", 8, (10.0, 20.0), slow)
    assert loadgen.capacity([c1, c8], **slo) == (approx(0.8), "goodput at c=1")
    rate, how = loadgen.capacity([c8], **slo)               # none within it: the busiest level's completions
    assert rate == approx(1.6) and "no level within the SLO" in how
    empty = loadgen.Level("concurrency", 1, (10.0, 20.0), [])
    assert loadgen.capacity([empty], **slo) == (0.0, "c=1 completed no request")


def test_past_capacity_doubles_the_rate_until_ttft_grows(monkeypatch):
    def level_at(rate, ttft):
        return loadgen.Level("rate", rate, (10.0, 20.0), [synthetic_stream(10.0 + i, ttft, 0.02, 4) for i in range(9)])

    knee = {"rate": 8.0}
    sent = []

    def fake_sweep(server, mode, loads, requests, **kw):
        sent.append(loads[0])
        return [level_at(loads[0], 0.1 if loads[0] < knee["rate"] else 0.5)]

    monkeypatch.setattr(loadgen, "sweep", fake_sweep)
    run = dict(duration_s=10.0, warmup_s=1.0)
    below = [level_at(2.0, 0.1), level_at(3.0, 0.1)]
    added = loadgen.past_capacity(None, below, [], budget_s=100.0, **run)
    assert sent == [6.0, 12.0] and [lv.load for lv in added] == [6.0, 12.0]    # 12 req/s: TTFT p90 5x the first's
    sent.clear()
    knee["rate"] = 1e9                                                         # it never grows: three levels at most
    assert [lv.load for lv in loadgen.past_capacity(None, below, [], budget_s=100.0, **run)] == [6.0, 12.0, 24.0]
    sent.clear()
    assert loadgen.past_capacity(None, below, [], budget_s=15.0, **run) and sent == [6.0]     # room for one level
    assert loadgen.past_capacity(None, [level_at(2.0, 0.1), level_at(9.0, 0.5)], [], budget_s=100.0, **run) == []
