"""Lab 05's exercises graded the way a learner's answers are: for each, the reference passes, answers written
differently pass, and known-wrong ones fail with the hint that names the mistake (the checkers of
utils/graders/lab05.py called directly on the solution's exported functions, and the generated lab run once with
papermill)."""
import pytest

from grading import run_lab_with, stream_text
from utils import solutions
from utils.llm import models
from utils.exercises import ExerciseFailed
from utils.graders import lab05 as graders

LAB = "05_llm_serving"


def lab(answers=None):
    return solutions.load(LAB, answers=answers)


@pytest.fixture(scope="module")
def ref():
    return lab()


# ---- 5.1 the decode ceiling ------------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    None,
    "return bandwidth_gbps / (bytes_per_token / 1e9)",
    "bytes_per_s = bandwidth_gbps * 10**9\nreturn bytes_per_s / bytes_per_token",
], ids=["reference", "GB per token", "two lines"])
def test_decode_ceiling_right_answers_pass(answer, capsys):
    m = lab({"5.1": answer}) if answer else lab()
    graders.check_decode_ceiling(m.decode_ceiling)
    assert "PASS: decode_ceiling" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    ("return bandwidth_gbps * 2**30 / bytes_per_token", "1e9 bytes per second, not 2\\*\\*30"),
    ("return bytes_per_token / (bandwidth_gbps * 1e9)", "that is seconds per token"),
    ("return bandwidth_gbps / bytes_per_token", "times 1e9 gives bytes per second"),
    ("return int(bandwidth_gbps * 1e9 // bytes_per_token)", "should be 209.375 tokens/s, got 209: tokens/s ="),
], ids=["GiB", "inverted", "no 1e9", "rounded"])
def test_decode_ceiling_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.1": answer})
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_decode_ceiling(m.decode_ceiling)


# ---- 5.2 KV-cache bytes per token ------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    "per_layer = 2 * kv_heads * head_dim\nreturn per_layer * layers * dtype_bytes",
    "k = v = layers * kv_heads * head_dim * dtype_bytes\nreturn k + v",
], ids=["per layer", "k plus v"])
def test_kv_bytes_right_answers_pass(answer, capsys):
    m = lab({"5.2": answer})
    graders.check_kv_bytes_per_token(m.kv_bytes_per_token)
    assert "PASS: kv_bytes_per_token" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    ("return layers * kv_heads * head_dim * dtype_bytes", "count both K and V"),
    ("return 2 * layers * kv_heads * head_dim * dtype_bytes * 8", "already in bytes, not bits"),
    ("return 2 * kv_heads * head_dim * dtype_bytes", "every layer keeps its own K and V"),
    ("return 2 * layers * 32 * head_dim * dtype_bytes", "should give 131,072 bytes"),
], ids=["only K", "bits", "one layer", "query heads"])
def test_kv_bytes_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.2": answer})
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_kv_bytes_per_token(m.kv_bytes_per_token)


# ---- 5.3 predict the sequences that fit ------------------------------------------------------------

def table_count():
    """What the lab's KV table prints for Llama-3.1-8B in BF16 on 80 GB (computed here independently)."""
    weights = 2 * models.param_count(models.llama_config("llama-3.1-8b"))
    return int((0.9 * 80e9 - weights) // (2 * 32 * 8 * 128 * 2 * 4096))


def test_the_prediction_is_graded_against_the_table(ref, capsys):
    want = table_count()
    assert want == 104
    for right in (104, 103, 105, 104.0):
        graders.check_prediction(lambda: right, want)
    assert "PASS: predicted 104 sequences; the table says 104" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (114, "2\\*\\*30 bytes per GiB"), (208, "only the keys"), (119, "only 90% of the memory"),
    (134, "the weights take their share"), (52, "the table says 104: \\(0.9 x 80e9"),
    ("104", "return a number"), (float("nan"), "return a number"),
], ids=["GiB", "only K", "no 90%", "no weights", "half", "a string", "nan"])
def test_wrong_predictions_fail_with_their_hint(ref, wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_prediction(lambda: wrong, table_count())


# ---- 5.4 a serving benchmark's per-request metrics --------------------------------------------------

ALTERNATIVE_METRICS = """import numpy as np
times = np.array([t for t, k in chunks if k], dtype=float)
sizes = np.array([k for t, k in chunks if k])
gaps = np.diff(times) / sizes[1:]
itl = np.repeat(gaps, sizes[1:]).tolist()
ttft = times[0] - start
e2e = end - start
return {"ttft": ttft, "e2e": e2e, "itl": itl,
        "tpot": (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else float("nan")}"""

PER_CHUNK_ITL = """tokens = [(t, k) for t, k in chunks if k > 0]
ttft, e2e = tokens[0][0] - start, end - start
tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else float("nan")
return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": [b - a for (a, _), (b, _) in zip(tokens, tokens[1:])]}"""


REFERENCE_METRICS = """tokens = [(t, k) for t, k in chunks if k > 0]
ttft, e2e = tokens[0][0] - start, end - start
tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else float("nan")
itl = []
for (before, _), (t, k) in zip(tokens, tokens[1:]):
    itl += [(t - before) / k] * k
return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e}"""


@pytest.mark.parametrize("answer", [REFERENCE_METRICS, ALTERNATIVE_METRICS], ids=["reference", "numpy"])
def test_request_metrics_right_answers_pass(answer, capsys):
    m = lab({"5.4": answer})
    graders.check_request_metrics(m.request_metrics)
    assert "PASS: request_metrics" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    (PER_CHUNK_ITL, "ITL is per token: a chunk of k tokens after a gap g gives k values g / k"),
    (REFERENCE_METRICS.replace("tokens[0][0] - start, end", "chunks[0][0] - start, end"),
     "the role-only first chunk carries none"),
    (REFERENCE_METRICS.replace("(output_tokens - 1) if", "output_tokens if"), "TPOT divides by output_tokens - 1"),
    (REFERENCE_METRICS.replace("(e2e - ttft) / (output_tokens - 1)", "e2e / output_tokens"),
     "TPOT leaves the first token out"),
    (REFERENCE_METRICS.replace("(output_tokens - 1) if output_tokens > 1",
                               "(sum(k for _, k in tokens) - 1) if output_tokens > 1"),
     "count the tokens the server reports"),
    (REFERENCE_METRICS.replace(' if output_tokens > 1 else float("nan")', " if output_tokens > 1 else 0.0"),
     "a one-token answer has no TPOT"),
    ("""itl, last, ttft = [], None, None
for t, k in chunks:
    if k and ttft is not None:
        itl += [(t - last) / k] * k
    if k and ttft is None:
        ttft = t - start
    last = t
e2e = end - start
return {"ttft": ttft, "tpot": (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else float("nan"),
        "itl": itl, "e2e": e2e}""", "each gap runs from the previous chunk that carried a token"),
    ("return (0.1, 0.01, [], 0.2)", "return a dict with keys"),
], ids=["per-chunk ITL", "role chunk as TTFT", "TPOT over N", "TPOT with TTFT", "chunk count",
        "one-token TPOT", "gap from an empty chunk", "a tuple"])
def test_request_metrics_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.4": answer})
    with pytest.raises(ExerciseFailed, match=hint.replace("(", "\\(").replace(")", "\\)")):
        graders.check_request_metrics(m.request_metrics)


def test_the_reference_metrics_are_the_load_generators():
    from utils.llm import loadgen

    m = lab()
    for what, start, chunks, end, n in [*graders.METRIC_CASES, *graders._random_cases()]:
        mine, theirs = m.request_metrics(start, chunks, end, n), loadgen.request_metrics(start, chunks, end, n)
        assert mine.keys() == theirs.keys() and all(graders._close(mine[k], theirs[k]) for k in mine), what


# ---- 5.5 paged decode attention ---------------------------------------------------------------------

EINSUM_PAGED = """B, hq, d = q.shape
hkv = k_cache.shape[2]
k = k_cache[block_table].flatten(1, 2).repeat_interleave(hq // hkv, dim=2)   # (B, L, Hq, D)
v = v_cache[block_table].flatten(1, 2).repeat_interleave(hq // hkv, dim=2)
s = torch.einsum("bhd,blhd->bhl", q.float(), k.float()) / d ** 0.5
s = s.masked_fill(torch.arange(k.shape[1])[None, None, :] >= seq_lens[:, None, None], float("-inf"))
return torch.einsum("bhl,blhd->bhd", s.softmax(-1), v.float()).to(q.dtype)"""


@pytest.mark.parametrize("answer", [None, EINSUM_PAGED, "return paged_attention_loop(q, k_cache, v_cache, "
                                                         "block_table, seq_lens)"],
                         ids=["reference", "einsum", "the loop"])
def test_paged_attention_right_answers_pass(answer, capsys):
    m = lab({"5.5": answer}) if answer else lab()
    graders.check_paged_attention(m.paged_attention)
    assert "PASS: paged_attention" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    (EINSUM_PAGED.replace('s = s.masked_fill(torch.arange(k.shape[1])[None, None, :] >= seq_lens[:, None, None], '
                          'float("-inf"))\n', ""), "mask the positions past each sequence's length"),
    (EINSUM_PAGED.replace("repeat_interleave(hq // hkv, dim=2)", "repeat(1, 1, hq // hkv, 1)"),
     "query head h reads KV head h // \\(Hq // Hkv\\)"),
    (EINSUM_PAGED.replace(" / d ** 0.5", ""), "scale the scores by 1 / sqrt\\(head_dim\\)"),
    (EINSUM_PAGED.replace("return torch.einsum", "return 1 + torch.einsum"), "compare with paged_attention_loop"),
    ("return q", "max error"),
    ("return q[..., :1]", "return a tensor of shape \\(B, Hq, D\\)"),
], ids=["no mask", "repeat not interleave", "no scale", "off by one", "identity", "wrong shape"])
def test_paged_attention_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.5": answer})
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_paged_attention(m.paged_attention)


def test_paged_inputs_scatter_blocks_and_count_bytes(ref):
    import torch

    q, k, v, table, lens = ref.make_paged_cache([1, 16, 17], q_heads=4, kv_heads=2, head_dim=8)
    assert table.shape == (3, 3) and k.shape == (1 + 1 + 2 + 3, 16, 2, 8)
    used = torch.cat([table[0, :1], table[1, :1], table[2, :2]])
    assert len(set(used.tolist())) == 4                     # each sequence's blocks are its own
    assert ref.kv_bytes_read(k, lens) == 2 * 34 * 2 * 8 * 4


# ---- the generated lab, run with papermill -------------------------------------------------------

def test_the_lab_passes_an_alternative_answer_and_stops_at_a_wrong_one(tmp_path, build_dir):
    """The learner's lab with 5.1 written differently (passes) and 5.2 counting only K (fails with its hint):
    Run All stops at 5.2's check, after 5.1 said PASS."""
    nb, error = run_lab_with(LAB, {"5.1": "return bandwidth_gbps / (bytes_per_token / 1e9)",
                                   "5.2": "return layers * kv_heads * head_dim * dtype_bytes"}, tmp_path)
    assert error is not None and error[0] == "ExerciseFailed", error
    assert "count both K and V" in error[1]
    assert "PASS: exercise 5.1 (the decode ceiling)" in stream_text(nb)
