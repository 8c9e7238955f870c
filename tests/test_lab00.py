"""Lab 00: the CPU's measured ceilings, and the grader of every exercise (utils/graders/lab00.py: the reference
passes, an answer written differently passes, known-wrong answers fail with the hint that names their mistake)."""
import pytest

from grading import errors, grades_afresh, run_lab_with, stream_text
from utils import device as devices
from utils import solutions
from utils.exercises import ExerciseFailed
from utils.graders import lab00 as graders


def test_cpu_ceilings_are_measured_and_say_so():
    cpu = devices.cpu_info()
    measured = devices.measure_cpu_ceilings(cpu, copy_mib=8, matmul_n=128, reps=1)
    assert cpu.peak_bandwidth_gbps is None and not cpu.measured          # the original is left alone
    assert measured.measured and measured.peak_bandwidth_gbps > 0 and measured.peak_fp32_tflops > 0
    assert measured.peak_bf16_tflops is None
    text = str(measured)
    assert "ceiling: bandwidth" in text and "ceiling: FP32" in text and "peak BF16 (dense): unknown" in text
    assert "measured on this machine" in measured.notes[0] and "torch.matmul 128³" in measured.notes[0]


def test_gpu_peaks_are_left_alone(recorded):
    h100 = devices.from_properties(recorded["h100"]["properties"], cuda=recorded["h100"]["cuda"])
    assert devices.measure_cpu_ceilings(h100) is h100
    assert "peak bandwidth" in str(h100) and "ceiling" not in str(h100)


# exercise -> (checker, function, [answers that must pass], [(known-wrong answer, words of its hint)])
GRADER = {
    "0.1": ("check_matmul_flops", "matmul_flops",
            ["return m * k * n * 2", "return sum(2 * k for _ in range(m * n))", "return 2.0 * m * n * k"],
            [("return m * n * k", "a multiply-add is 2 operations"),
             ("return 48", "must use m, n and k each once"),
             ("return m * n * (2 * k - 1)", "the first add, onto zero"),
             ("return 2 * m * n", "grows with k"),
             ("return 2 * m * n * n", "matmul_flops\\(2, 3, 4\\) returned 36"),
             ("print(2 * m * n * k)", "returned None: return one finite number"),
             ("return 2 * m * n * k / (m - 1)", "raised ZeroDivisionError")]),
    "0.2": ("check_add_bytes", "add_bytes",
            ["return (n + n + n) * itemsize", "return sum(n * itemsize for _ in 'abc')"],
            [("return 2 * n * itemsize", "c is written: three arrays"),
             ("return 3 * n", "multiply by itemsize"),
             ("return 12000", "a and b are read"),
             ("return 4 * n * itemsize", "c is only written"),
             ("return n * itemsize", "each of n elements"),
             ("return 3 * n * itemsize * 8", "not bits"),
             ("return str(3 * n * itemsize)", "return one finite number")]),
    "0.3": ("check_rate", "rate",
            ["return amount / ms * 1e3 / unit", "seconds = ms * 1e-3\nreturn amount / seconds / unit",
             "return (amount / unit) / (ms * 1e-3)"],
            [("return amount / ms / unit", "ms is in milliseconds"),
             ("return amount / (ms / 1e3) * unit", "do not multiply"),
             # issue 31: ignoring `unit` (GB/s hard-coded) was told "ms is in milliseconds"
             ("return amount / ms * 1e3 / 1e9", "divides by 1e\\+09 whatever `unit` is"),
             ("return amount / (ms / 1e3)", "divide the rate per second by it"),
             ("return amount / (ms * 1e3) / unit", "ms is in milliseconds"),
             ("return (ms / 1e3) / amount / unit", "not seconds / amount"),
             ("return amount // (ms / 1e3) // unit", "// rounds down"),
             ("return amount / (ms / 1e3) / unit if unit != 1e3 else 0", "rate\\(7, 0.5, 1000\\)"),
             ("return 0", "(?s)^(?!.*//).*amount / seconds is the rate per second")]),
    "0.4": ("check_ridge_point", "ridge_point",
            ["return peak_tflops / peak_gbps * 1000", "return 1000 * peak_tflops / peak_gbps"],
            [("return peak_tflops / peak_gbps", "mind the factor 1000"),
             ("return peak_gbps * 1e9 / (peak_tflops * 1e12)", "not the other way round"),
             ("return peak_gbps / peak_tflops", "not the other way round; and TFLOP/s counts"),
             ("return peak_tflops * 1e12 // (peak_gbps * 1e9)", "// rounds down"),
             # issue 46: a constant, a whole number everywhere, was blamed on //
             ("return 1000", "(?s)^(?!.*//).*operations per second / bytes per second"),
             ("return peak_tflops / peak_gbps * 1e6", "mind the factor 1000")]),
    "0.5": ("check_roofline_tflops", "roofline_tflops",
            ["slope = intensity * peak_gbps / 1e3\nif slope < peak_tflops:\n    return slope\nreturn peak_tflops",
             "return min(intensity * peak_gbps * 1e9, peak_tflops * 1e12) / 1e12",
             "ridge = peak_tflops * 1e12 / (peak_gbps * 1e9)\n"
             "return peak_tflops if intensity >= ridge else intensity * peak_gbps / 1e3"],
            [("return max(intensity * peak_gbps / 1e3, peak_tflops)", "the lower of the two limits applies \\(min\\)"),
             ("return min(intensity * peak_gbps, peak_tflops)", "divide by 1000"),
             ("return intensity * peak_gbps / 1e3", "the lower of the two limits"),
             # issue 31: two answers that take the minimum were told "min, not max"
             ("return min(intensity * peak_gbps / 1e3, peak_tflops * 1e12)",
              "(?s)^(?!.*not the higher).*the compute roof is the limit.*both in TFLOP/s"),
             ("ridge = peak_tflops / peak_gbps\nif intensity < ridge:\n    return intensity * peak_gbps / 1e3\n"
              "return peak_tflops", "(?s)^(?!.*not the higher).*the switch is at the ridge point"),
             ("return peak_tflops", "below the ridge point memory is the limit"),
             ("return min(intensity * peak_gbps, peak_tflops * 1e3)", "every answer is 1000 times the right one"),
             ("return min(intensity * peak_gbps / 1e6, peak_tflops)", "not 10\\^6"),
             ("return min(intensity * peak_gbps / 1e3, peak_tflops)[0]", "raised TypeError")]),
}


def _grade(exercise, answer=None):
    checker, name, _, _ = GRADER[exercise]
    module = solutions.load("00", answers=None if answer is None else {exercise: answer})
    getattr(graders, checker)(getattr(module, name))


@pytest.mark.parametrize("exercise", GRADER)
def test_reference_and_other_correct_answers_pass(exercise, build_dir, capsys):
    _grade(exercise)
    for answer in GRADER[exercise][2]:
        _grade(exercise, answer)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("exercise, wrong, hint",
                         [(e, w, h) for e, (_, _, _, wrongs) in GRADER.items() for w, h in wrongs])
def test_known_wrong_answers_fail_with_their_hint(exercise, wrong, hint, build_dir):
    with pytest.raises(ExerciseFailed, match=hint):
        _grade(exercise, wrong)


def test_the_lab_grades_answers_as_a_learner_runs_it(tmp_path, build_dir):
    """The generated lab with another correct answer to 0.1 and a wrong one to 0.3: 0.1 passes, 0.2 is
    not done, and Run All stops at 0.3 with its hint."""
    nb, error = run_lab_with("00", {"0.1": GRADER["0.1"][2][0], "0.3": "return amount / ms / unit"}, tmp_path)
    text = stream_text(nb)
    assert "PASS: exercise 0.1 (count a matmul's operations)" in text
    assert "NOT DONE: exercise 0.2 " in text
    assert error is not None and error[0] == "ExerciseFailed" and "ms is in milliseconds" in error[1]
    assert [e for e, _ in errors(nb)] == ["ExerciseFailed"]


@pytest.mark.parametrize("exercise", GRADER)
def test_every_grade_draws_fresh_hidden_cases(exercise, monkeypatch, capsys, build_dir):
    """Issue 46: the shown cases are fixed (the stored output lists them), hidden ones are new on every grade."""
    checker, name, _, _ = GRADER[exercise]
    grades_afresh(getattr(graders, checker), getattr(solutions.load("00"), name), monkeypatch, capsys)
