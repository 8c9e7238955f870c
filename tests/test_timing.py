"""utils.timing: statistics on the CPU; agreement with triton's do_bench on a GPU."""
import time

import pytest
import torch

from utils import timing


def test_cpu_benchmark_measures_what_it_runs():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    t = timing.benchmark(work, warmup=2, reps=7, device="cpu")
    assert len(calls) == 9 and len(t.samples_ms) == 7 and t.clock == "perf_counter"
    assert 2.0 <= t.min_ms <= t.median_ms < 50
    assert t.iqr_ms >= 0


def test_statistics():
    t = timing.Timing((1.0, 2.0, 3.0, 4.0, 100.0), "perf_counter")
    assert (t.median_ms, t.min_ms, t.iqr_ms) == (3.0, 1.0, 2.0)
    assert t.median_s == 0.003
    assert t.gbps(3e9) == pytest.approx(1000.0) and t.tflops(3e12) == pytest.approx(1000.0)
    assert timing.Timing((5.0,), "x").iqr_ms == 0.0


def test_rate_helpers():
    assert timing.gbps(2e9, 0.5) == 4.0
    assert timing.tflops(2 * 8192**3, 1.0) == pytest.approx(1.0995, rel=1e-4)
    assert timing.relative_difference(1.05, 1.0) == pytest.approx(0.05)


@pytest.mark.parametrize("warmup, reps, batch", [(-1, 5, 1), (0, 0, 1), (1, 1, 0)])
def test_bad_arguments(warmup, reps, batch):
    with pytest.raises(ValueError, match="warmup >= 0, reps >= 1 and batch >= 1"):
        timing.benchmark(lambda: None, warmup=warmup, reps=reps, batch=batch, device="cpu")


def test_batch_reports_time_per_call():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.001)

    t = timing.benchmark(work, warmup=1, reps=3, batch=5, device="cpu")
    assert len(calls) == (1 + 3) * 5
    assert 1.0 <= t.min_ms < 5.0, "samples are per call, not per batch of 5"


def test_warmup_ms_keeps_warming_until_the_time_has_passed():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.001)

    timing.benchmark(work, warmup=1, reps=1, warmup_ms=30, device="cpu")
    assert 3 <= len(calls) - 1 <= 31, "warm-up stops once 30 ms have passed, not after one call"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (device events)")
def test_agrees_with_do_bench_on_gpu():
    """utils.timing's median is within 5% of triton.testing.do_bench's for an 8192^3 bf16 matmul and
    a 256M-element fp32 add (the kernels lab 00 measures), timed in alternating rounds."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256 * 2**20, device="cuda")
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    for name, fn in [("matmul 8192^3 bf16", lambda: torch.matmul(a, b)),
                     ("add 256M fp32", lambda: torch.add(x, y, out=out))]:
        ours, theirs = timing.compare_with_do_bench(fn)
        diff = timing.relative_difference(ours, theirs)
        print(f"{name}: utils.timing {ours:.4f} ms, do_bench {theirs:.4f} ms, difference {diff:.2%}")
        assert diff < 0.05, f"{name}: utils.timing {ours:.4f} ms vs do_bench {theirs:.4f} ms"


def test_interleaved_times_each_function_on_cpu():
    out = timing.interleaved({"short": lambda: time.sleep(0.001), "long": lambda: time.sleep(0.003)},
                             rounds=2, rep_ms=10, warmup_ms=0, flush_l2=False)
    assert set(out) == {"short", "long"} and 1.0 <= out["short"] < out["long"] < 30
