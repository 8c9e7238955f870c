"""Lab 05's exercises graded the way a learner's answers are: for each, the reference passes, answers written
differently pass, and known-wrong ones fail with the hint that names the mistake (the checkers of
utils/graders/lab05.py called directly on the solution's exported functions, and the generated lab run once with
papermill)."""
import pytest

from grading import grades_afresh, run_lab_with, stream_text
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
    "import numpy as np\nreturn np.float64(bandwidth_gbps) * np.float64(1e9) / bytes_per_token",
    "return float(bandwidth_gbps * 1e9 / bytes_per_token)",
], ids=["reference", "GB per token", "two lines", "numpy scalar", "float()"])
def test_decode_ceiling_right_answers_pass(answer, capsys):
    m = lab({"5.1": answer}) if answer else lab()
    graders.check_decode_ceiling(m.decode_ceiling)
    assert "PASS: decode_ceiling" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    ("return bandwidth_gbps * 2**30 / bytes_per_token", "1e9 bytes per second, not 2\\*\\*30"),
    ("return bytes_per_token / (bandwidth_gbps * 1e9)", "that is seconds per token"),
    ("return bandwidth_gbps / bytes_per_token", "times 1e9 gives bytes per second"),
    ("return int(bandwidth_gbps * 1e9 // bytes_per_token)", "should be 209.375 tokens/s, got 209: return the exact "
                                                            "quotient: no rounding"),
    ("return round(bandwidth_gbps * 1e9 / bytes_per_token)", "no rounding"),
    ("return bandwidth_gbps * 1e6 / bytes_per_token", "not 1e6"),
    ("return bytes_per_token / (bandwidth_gbps * 1e9) * 1000", "that is milliseconds per token"),
    ("return bandwidth_gbps * 1e9 * 8 / bytes_per_token", "no factor 8"),
    ("return bandwidth_gbps * 1e9 / (bytes_per_token - 1)", "on decode_ceiling\\(1, 1\\) your code raised "
                                                          "ZeroDivisionError"),
    ("return f'{bandwidth_gbps * 1e9 / bytes_per_token:.1f} tokens/s'", "should return a number of tokens per second"),
    ("return [bandwidth_gbps * 1e9 / bytes_per_token]", "should return a number"),
], ids=["GiB", "inverted", "no 1e9", "rounded", "round()", "MB", "ms per token", "bits", "off by one byte",
        "a string", "a list"])
def test_decode_ceiling_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.1": answer})
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_decode_ceiling(m.decode_ceiling)


# ---- 5.2 KV-cache bytes per token ------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    "per_layer = 2 * kv_heads * head_dim\nreturn per_layer * layers * dtype_bytes",
    "k = v = layers * kv_heads * head_dim * dtype_bytes\nreturn k + v",
    "return int(2 * layers * kv_heads * head_dim * dtype_bytes) if dtype_bytes >= 1 else "
    "2 * layers * kv_heads * head_dim * dtype_bytes",
    "import numpy as np\nreturn np.prod([2, layers, kv_heads, head_dim, dtype_bytes])",
], ids=["per layer", "k plus v", "int where whole", "numpy product"])
def test_kv_bytes_right_answers_pass(answer, capsys):
    m = lab({"5.2": answer})
    graders.check_kv_bytes_per_token(m.kv_bytes_per_token)
    assert "PASS: kv_bytes_per_token" in capsys.readouterr().out


@pytest.mark.parametrize("answer, hint", [
    ("return layers * kv_heads * head_dim * dtype_bytes", "count both K and V"),
    ("return 2 * layers * kv_heads * head_dim * dtype_bytes * 8", "already in bytes, not bits"),
    ("return 2 * kv_heads * head_dim * dtype_bytes", "every layer keeps its own K and V"),
    ("return 2 * layers * 32 * head_dim * dtype_bytes", "should give 131,072 bytes, got 524,288: not the bytes"),
    ("return 2 * layers * head_dim * dtype_bytes", "every KV head keeps its own K and V"),
    ("return 2 * layers * kv_heads * head_dim", "that counts numbers, not bytes"),
    ("return 2 * layers * kv_heads * head_dim * int(dtype_bytes)", "may be a fraction"),
    ("return 2 * layers * kv_heads * head_dim * dtype_bytes / 8", "already in bytes, not bits"),
    ("return 2 * (layers - 1) * kv_heads * head_dim * dtype_bytes", "should give 131,072 bytes, got 126,976"),
    ("return None", "return a number of bytes, got None"),
    ("return {}[layers]", "on kv_bytes_per_token\\(32, 8, 128, 2\\) \\(Llama-3.1-8B in BF16\\) your code raised KeyError"),
], ids=["only K", "bits", "one layer", "query heads", "no KV heads", "no dtype", "rounded dtype", "bits down",
        "off by one layer", "None", "raises"])
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
    import numpy as np
    import torch

    for right in (104, 103, 105, 104.0, np.int64(104), torch.tensor(104)):
        graders.check_prediction(lambda: right, want)
    assert "PASS: predicted 104 sequences; the table says 104" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (114, "2\\*\\*30 bytes per GiB"), (208, "only the keys"), (119, "only 90% of the memory"),
    (134, "the weights take their share"), (52, "the table says 104: \\(0.9 x 80e9"),
    ("104", "return a number"), (float("nan"), "return a number"),
    (74, "2 bytes per parameter, not 4"), (149, "and the weights take their share"),
    (426784, "each sequence holds 4096"), (True, "return a number"),
], ids=["GiB", "only K", "no 90%", "no weights", "half", "a string", "nan", "fp32 weights", "neither",
        "tokens", "a bool"])
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


GENERATOR_METRICS = """ttft = next(t for t, k in chunks if k) - start
e2e = end - start
itl, last = [], None
for t, k in chunks:
    if not k:
        continue
    if last is not None:
        itl.extend((t - last) / k for _ in range(k))
    last = t
return dict(e2e=e2e, ttft=ttft, itl=itl, tpot=float("nan") if output_tokens == 1 else (e2e - ttft) / (output_tokens - 1))"""


@pytest.mark.parametrize("answer", [REFERENCE_METRICS, ALTERNATIVE_METRICS, GENERATOR_METRICS],
                         ids=["reference", "numpy", "one pass"])
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
    (REFERENCE_METRICS.replace('"ttft": ttft,', '"ttft": ttft * 1000,'), "no factor 1000 (milliseconds)"),
    (REFERENCE_METRICS.replace("itl += [(t - before) / k] * k", "itl += [(t - before) / k * 1e3] * k"),
     "no factor 1000 (milliseconds)"),
    (REFERENCE_METRICS.replace("e2e = tokens[0][0] - start, end - start", "e2e = tokens[0][0], end - start"),
     "TTFT counts from start, when the request was sent"),
    (REFERENCE_METRICS.replace("end - start", "chunks[-1][0] - start"), "the last chunk may carry only the usage"),
    (REFERENCE_METRICS.replace("end - start", "end - tokens[0][0]"), "not from the first token"),
    (REFERENCE_METRICS.replace("tokens = [(t, k) for t, k in chunks if k > 0]",
                               "tokens = [(t, k) for t, k in chunks[1:] if k > 0]"),
     "an empty chunk between two tokens .* ttft should be 0.1, got 0.2: TTFT runs from start to the arrival of the "
     "first chunk that carries a token"),
    (REFERENCE_METRICS.replace('{"ttft": ttft,', '{"ttft": torch.tensor(ttft),'), "return Python floats"),
    (REFERENCE_METRICS.replace(' if output_tokens > 1 else float("nan")', ""),
     "on a one-token answer .* your code raised ZeroDivisionError"),
    # issue 46: an answer that writes into its input fails, naming it
    ("chunks[:] = [c for c in chunks if c[1] > 0]\n" + REFERENCE_METRICS, "your code changed its input chunks"),
], ids=["per-chunk ITL", "role chunk as TTFT", "TPOT over N", "TPOT with TTFT", "chunk count",
        "one-token TPOT", "gap from an empty chunk", "a tuple", "TTFT in ms", "ITL in ms", "TTFT without start",
        "E2E to the usage chunk", "E2E from the first token", "first chunk skipped", "float32 tensor",
        "one token divides by 0", "filters chunks in place"])
def test_request_metrics_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.4": answer})
    with pytest.raises(ExerciseFailed, match=hint if ".*" in hint else hint.replace("(", "\\(").replace(")", "\\)")):
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


MANUAL_SOFTMAX = """B, hq, d = q.shape
block, hkv = k_cache.shape[1], k_cache.shape[2]
positions = torch.arange(block_table.shape[1] * block, device=q.device)
slots = k_cache[block_table].reshape(B, -1, hkv, d).float()                  # (B, L, Hkv, D)
values = v_cache[block_table].reshape(B, -1, hkv, d).float()
group = hq // hkv
qg = q.float().reshape(B, hkv, group, d)
s = torch.einsum("bkgd,blkd->bkgl", qg, slots) * d ** -0.5
s = torch.where(positions < seq_lens[:, None, None, None], s, torch.tensor(float("-inf")))
w = torch.exp(s - s.amax(-1, keepdim=True))
w = w / w.sum(-1, keepdim=True)
return torch.einsum("bkgl,blkd->bkgd", w, values).reshape(B, hq, d).to(q.dtype)"""

ADDITIVE_MASK = """k = k_cache[block_table].flatten(1, 2).transpose(1, 2)
v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
far = torch.arange(k.shape[2], device=q.device)[None, :] >= seq_lens[:, None]
bias = torch.zeros(far.shape, dtype=q.dtype, device=q.device).masked_fill(far, float("-inf"))[:, None, None, :]
return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=bias, enable_gqa=True).squeeze(2)"""

REFERENCE_PAGED = """k = k_cache[block_table].flatten(1, 2).transpose(1, 2)     # (B, Hkv, max_blocks * BLOCK, D)
v = v_cache[block_table].flatten(1, 2).transpose(1, 2)
keep = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]   # (B, positions)
out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep[:, None, None, :], enable_gqa=True)
return out[:, :, 0]"""


@pytest.mark.parametrize("answer", [None, EINSUM_PAGED, MANUAL_SOFTMAX, ADDITIVE_MASK],
                         ids=["reference", "einsum", "grouped by hand", "additive mask"])
def test_paged_attention_right_answers_pass(answer, capsys):
    m = lab({"5.5": answer}) if answer else lab()
    graders.check_paged_attention(m.paged_attention)
    assert "PASS: paged_attention" in capsys.readouterr().out


def test_paged_attention_that_calls_the_labs_loop_fails(build_dir):
    """Issue 46's independent answers: 5.5 asks for all sequences at once; handing the work to the lab's own
    paged_attention_loop (which the grader may run) is not that."""
    from utils import exercises

    m = lab({"5.5": "return paged_attention_loop(q, k_cache, v_cache, block_table, seq_lens)"})
    with pytest.raises(ExerciseFailed, match="the lab's paged_attention_loop"):
        exercises.Lab(LAB).grade("5.5", "paged decode attention", graders.check_paged_attention, m.paged_attention)


@pytest.mark.parametrize("answer, hint", [
    (EINSUM_PAGED.replace('s = s.masked_fill(torch.arange(k.shape[1])[None, None, :] >= seq_lens[:, None, None], '
                          'float("-inf"))\n', ""), "mask the positions past each sequence's length"),
    (EINSUM_PAGED.replace("repeat_interleave(hq // hkv, dim=2)", "repeat(1, 1, hq // hkv, 1)"),
     "query head h reads KV head h // \\(Hq // Hkv\\)"),
    (EINSUM_PAGED.replace(" / d ** 0.5", ""), "scale the scores by 1 / sqrt\\(head_dim\\)"),
    (EINSUM_PAGED.replace("return torch.einsum", "return 1 + torch.einsum"), "compare with paged_attention_loop"),
    ("return q", "max error"),
    ("return q[..., :1]", "return a tensor of shape \\(B, Hq, D\\)"),
    (REFERENCE_PAGED.replace("keep[:, None, None, :]", "keep[:, None, :]"),
     "on a block exactly, and one token more \\(q \\(3, 4, 64\\) float32, .*\\) your code raised RuntimeError: "
     "The size of tensor"),
    (REFERENCE_PAGED.replace("q[:, :, None], k, v", "q[:, :, None].float(), k.float(), v"),
     "on Llama-3.1-8B heads in BF16 \\(q \\(4, 32, 128\\) bfloat16, k_cache and v_cache .* bfloat16.*\\) your code raised"),
    (EINSUM_PAGED.replace(".to(q.dtype)", ""), "Llama-3.1-8B heads in BF16: return the result in q's dtype"),
    (REFERENCE_PAGED.replace("< seq_lens[:, None]", "<= seq_lens[:, None]"), "yours also keeps position seq_lens\\[b\\]"),
    (REFERENCE_PAGED.replace("< seq_lens[:, None]", "< seq_lens[:, None] - 1"), "yours leaves out the last one"),
    (REFERENCE_PAGED.replace("< seq_lens[:, None]", "< seq_lens.max()"), "each sequence has its own length"),
    (REFERENCE_PAGED.replace("k_cache[block_table].flatten(1, 2)", "k_cache[block_table].transpose(1, 2).flatten(1, 2)")
     .replace("v_cache[block_table].flatten(1, 2)", "v_cache[block_table].transpose(1, 2).flatten(1, 2)"),
     "flatten \\(blocks, slots\\) in that order"),
    (MANUAL_SOFTMAX.replace("torch.exp(s - s.amax(-1, keepdim=True))", "torch.exp(s)"),
     "spread scores .* exp overflows unless each row's maximum is subtracted"),
    (EINSUM_PAGED.replace('q.float()', 'q.view(B * hq, d).float().view(B, hq, d)'),
     "q a strided view .*\\(a strided view\\).* your code raised RuntimeError: view size is not compatible"),
    (REFERENCE_PAGED.replace("return out[:, :, 0]", "return out"), "the query axis of length 1 is still there"),
    ("return {}", "return a tensor of shape \\(B, Hq, D\\) = \\(3, 4, 64\\), got dict"),
    # issue 46: q scaled in place was graded against a reference computed from the scaled q, and told to scale
    # the scores; now it fails naming q
    ("q *= q.shape[-1] ** -0.5\n" + REFERENCE_PAGED.replace("enable_gqa=True", "enable_gqa=True, scale=1.0"),
     "^(?!.*scale the scores).*your code changed its input q: read the inputs"),
], ids=["no mask", "repeat not interleave", "no scale", "off by one", "identity", "wrong shape", "mask shape slip",
        "dtype slip", "float32 out", "<= length", "length - 1", "longest length", "slots before blocks",
        "exp without max", "view of a strided q", "4-d out", "a dict", "scales q in place"])
def test_paged_attention_wrong_answers_fail_with_their_hint(answer, hint):
    m = lab({"5.5": answer})
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_paged_attention(m.paged_attention)


@pytest.mark.parametrize("checker, fn", [("check_decode_ceiling", "decode_ceiling"),
                                         ("check_kv_bytes_per_token", "kv_bytes_per_token"),
                                         ("check_request_metrics", "request_metrics"),
                                         ("check_paged_attention", "paged_attention")])
def test_every_grade_draws_fresh_cases(ref, checker, fn, monkeypatch, capsys):
    """Issue 46: beside the fixed cases, each grade draws new ones: an answer that replays an earlier grade's answers
    (a lookup table of the cases tried) fails, and what a right answer prints stays the same. (5.3 is a prediction
    of one number, against the lab's own table: no inputs to draw.)"""
    grades_afresh(getattr(graders, checker), getattr(ref, fn), monkeypatch, capsys)


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
