"""Lab 05's load plan: the probe's verdict, the windows sized from a request's lifetime, the command to run anyway."""
import math

import pytest

from utils.llm import loadplan, serving


def answer(latency_s):
    return serving.RequestResult(ttft_s=latency_s / 4, latency_s=latency_s, output_tokens=8, text="x")


def test_levels_that_fit_the_budget_run():
    assert loadplan.skip_reason(loadplan.Probe(answer(1.8), 108), levels=4, budget_s=40, max_tokens=8, gpu=False) is None


def test_a_slow_request_skips_with_the_time_it_took_and_the_command_to_run_anyway():
    why = loadplan.skip_reason(loadplan.Probe(answer(6.0), 108), levels=4, budget_s=40, max_tokens=8, gpu=False)
    assert "took 6.0 s" in why and "about 48 s" in why and "LOAD_BUDGET_SECONDS=40" in why
    assert why.endswith("--device cpu -p LOAD_BUDGET_SECONDS 96 solutions/05_llm_serving.ipynb")


def test_a_request_that_did_not_end_skips_with_the_time_it_was_given():
    found = loadplan.Probe(None, 95.0)
    assert found.lifetime == math.inf
    why = loadplan.skip_reason(found, levels=4, budget_s=40, max_tokens=8, gpu=False)
    assert "did not end within 95 s" in why and "need longer" in why and "LOAD_BUDGET_SECONDS 400 " in why


@pytest.mark.parametrize("gpu, expected", [(False, (5, 1)), (True, (5, 2))])
def test_default_windows_grow_to_the_request_lifetime_within_half_the_share(gpu, expected, capsys):
    # 1.8 s requests: 4 lifetimes = 8 s, but half of one level's share of 40 s over 4 levels is 5 s; the warm-up
    # grows to one lifetime on a GPU only (on a CPU the probe has warmed the server)
    got = loadplan.windows(1.8, load_s=3, warmup_s=1, stretch=(True, True), budget_s=40, levels=4, gpu=gpu)
    assert got == expected and "a request takes about 1.8 s here" in capsys.readouterr().out


def test_windows_a_learner_set_are_kept(capsys):
    assert loadplan.windows(9.0, load_s=3, warmup_s=1, stretch=(False, False), budget_s=40, levels=4, gpu=True) == (3, 1)
    assert capsys.readouterr().out == ""
