"""Lab 00's graders: exercises 0.1-0.5 (a matmul's operations, an add's bytes, a rate, the ridge point, the roofline)."""
import math

from utils.exercises import check


def check_matmul_flops(f):
    got = f(2, 3, 4)
    check("matmul_flops", got == 48,
          f"matmul_flops(2, 3, 4) returned {got}; there are 2*3 outputs, each a dot product of length 4, "
          "and a multiply-add is 2 operations")
    check("matmul_flops (non-square)", f(64, 32, 16) == 65536,
          "the count must use m, n and k each once: 2*m*n*k")


def check_add_bytes(f):
    for n, itemsize in [(1000, 4), (7, 2), (1, 8)]:
        got = f(n, itemsize)
        if got == 2 * n * itemsize:
            hint = "a and b are read, and c is written: three arrays move"
        elif got == 3 * n:
            hint = "n elements of `itemsize` bytes each: multiply by itemsize"
        else:
            hint = f"a and b are read ({2 * n} x {itemsize} bytes) and c is written ({n} x {itemsize} bytes)"
        check(f"add_bytes({n}, {itemsize})", got == 3 * n * itemsize, f"returned {got}; {hint}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def check_rate(f):
    for amount, ms, unit in [(12_000, 0.004, 1e9), (2 * 8192**3, 1.4, 1e12), (1, 1000.0, 1.0), (3 * 4 * 2**28, 1.07, 1e9)]:
        got, want = f(amount, ms, unit), amount / (ms / 1e3) / unit
        ratio = got / want if _number(got) else float("nan")
        if math.isclose(ratio, 1e-3) or math.isclose(ratio, 1e3):
            hint = "ms is in milliseconds: the seconds are ms / 1e3"
        elif math.isclose(ratio, unit * unit):
            hint = "divide by the unit (3e9 bytes per second is 3 GB/s), do not multiply"
        else:
            hint = "amount / seconds is the rate per second; then divide by the unit"
        check(f"rate({amount:,}, {ms}, {unit:g})", _number(got) and math.isclose(got, want, rel_tol=1e-9),
              f"returned {got!r}, expected {want:.7g}: {hint}")


def check_ridge_point(f):
    for tflops, gbps in [(989.0, 3350.0), (1307.4, 5300.0), (0.1, 20.0)]:
        got, want = f(tflops, gbps), tflops * 1e12 / (gbps * 1e9)
        ratio = got / want if _number(got) else float("nan")
        if math.isclose(ratio, 1e-3):
            hint = "TFLOP/s counts 10^12 operations, GB/s 10^9 bytes: mind the factor 1000"
        elif _number(got) and got and math.isclose(got * want, 1.0):
            hint = "FLOP per byte: operations per second divided by bytes per second, not the other way round"
        else:
            hint = "operations per second / bytes per second"
        check(f"ridge_point({tflops}, {gbps})", _number(got) and math.isclose(got, want, rel_tol=1e-9),
              f"returned {got!r}, expected {want:.7g}: {hint}")


def check_roofline_tflops(f):
    cases = [(1 / 12, 989.0, 3350.0, "memory"),    # c = a + b in float32 on an H100
             (8192 / 3, 989.0, 3350.0, "compute"),  # an 8192³ bfloat16 matmul on an H100
             (3.0, 1307.4, 5300.0, "memory"),
             (10.0, 0.1, 20.0, "compute")]           # a CPU
    for intensity, tflops, gbps, roof in cases:
        slope = intensity * gbps * 1e9 / 1e12          # what memory allows, TFLOP/s
        got, want = f(intensity, tflops, gbps), min(slope, tflops)
        if _number(got) and math.isclose(got, want, rel_tol=1e-9):
            continue
        if _number(got) and math.isclose(got, max(slope, tflops)):
            hint = "the lower of the two limits applies (min), not the higher"
        elif _number(got) and math.isclose(got, min(slope * 1e3, tflops)):
            hint = "intensity x GB/s is in GFLOP/s: divide by 1000 for TFLOP/s"
        elif roof == "compute":
            hint = f"above the ridge point the compute peak ({tflops} TFLOP/s) is the limit"
        else:
            hint = "below the ridge point memory is the limit: intensity x bandwidth"
        check(f"roofline_tflops({intensity:.4g}, {tflops}, {gbps}), {roof}-bound", False,
              f"returned {got!r}, expected {want:.7g}: {hint}")
    check("roofline_tflops: memory-bound below the ridge point, compute-bound above it", True, "")
