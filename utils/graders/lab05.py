"""Lab 05's graders: 5.1 decode ceiling, 5.2 KV bytes per token, 5.3 the prediction, 5.4 request metrics, 5.5 paged attention."""
import math
import numbers

import numpy as np
import torch

from utils import grading_guard, solutions
from utils.exercises import call_answer, check
from utils.llm import loadgen, models


def _number(x):
    """x as a float if it is a real number (int, float, numpy scalar, 0-d tensor), else None (bool is no number)."""
    if isinstance(x, bool) or isinstance(x, np.bool_):
        return None
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.dtype.is_complex and x.dtype != torch.bool:
        return float(x)
    return float(x) if isinstance(x, numbers.Real) else None


def _same(a, b, rel=1e-6):
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-300)


def _named(mistakes, got):
    """The first known mistake whose values match the learner's on every case (None if none does)."""
    return next((why for why, values in mistakes if all(_same(g, v) for g, v in zip(got, values))), None)


DECODE_CASES = [(3350, 16e9), (5300, 141.1e9), (17.5, 0.54e9), (1, 1), (819.2, 3), (2039, 70.6e9)]


def _fresh_rng() -> np.random.Generator:
    """Random numbers for the cases drawn on every grade, beside the fixed ones (a table of the tried cases, or a
    result kept from an earlier grade, fails); the seed is named in a failure's message (utils.grading_guard)."""
    return np.random.default_rng(grading_guard.fresh_seed())


def _fresh_decode_cases(n=4):
    rng = _fresh_rng()
    return [(round(float(rng.uniform(1, 8000)), 1), float(f"{rng.uniform(1e6, 2e11):.4g}")) for _ in range(n)]


def check_decode_ceiling(f):
    cases, got = DECODE_CASES + _fresh_decode_cases(), []
    for bandwidth, nbytes in cases:
        value = call_answer("decode_ceiling", f, (bandwidth, nbytes), f"decode_ceiling({bandwidth}, {nbytes:g})")
        if _number(value) is None:
            check("decode_ceiling", False, f"decode_ceiling({bandwidth}, {nbytes:g}) should return a number of "
                                           f"tokens per second, got {value!r}")
        got.append(_number(value))
    want = [bw * 1e9 / nb for bw, nb in cases]
    if all(math.isclose(g, w, rel_tol=1e-9) for g, w in zip(got, want)):
        check("decode_ceiling", True, "")
        return
    per = lambda fn: [fn(bw, nb) for bw, nb in cases]
    mistakes = [
        ("GB/s means 1e9 bytes per second, not 2**30", per(lambda bw, nb: bw * 2**30 / nb)),
        ("GB/s means 1e9 bytes per second, not 1e6", per(lambda bw, nb: bw * 1e6 / nb)),
        ("that is seconds per token: tokens/s = bytes per second / bytes per token",
         per(lambda bw, nb: nb / (bw * 1e9))),
        ("that is milliseconds per token, and the question asks for tokens per second",
         per(lambda bw, nb: nb / (bw * 1e9) * 1e3)),
        ("bandwidth_gbps is in GB/s: times 1e9 gives bytes per second", per(lambda bw, nb: bw / nb)),
        ("both are in bytes: no factor 8 (bits)", per(lambda bw, nb: bw * 1e9 * 8 / nb)),
        ("both are in bytes: no factor 8 (bits)", per(lambda bw, nb: bw * 1e9 / 8 / nb)),
        ("return the exact quotient: no rounding (int(), round() or //)", per(lambda bw, nb: bw * 1e9 // nb)),
        ("return the exact quotient: no rounding (int(), round() or //)", per(lambda bw, nb: round(bw * 1e9 / nb))),
    ]
    why = _named(mistakes, got) or "not the tokens per second that this bandwidth allows"
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if not math.isclose(g, w, rel_tol=1e-9))
    bandwidth, nbytes = cases[i]
    check("decode_ceiling", False, f"decode_ceiling({bandwidth}, {nbytes:g}) should be {want[i]:,.6g} tokens/s, "
                                   f"got {got[i]:,.6g}: {why}")


KV_CASES = [("Llama-3.1-8B in BF16", 32, 8, 128, 2), ("Llama-3.1-70B in BF16", 80, 8, 128, 2),
            ("SmolLM2-135M in FP32", 30, 3, 64, 4), ("Llama-3.1-8B in FP8", 32, 8, 128, 1),
            ("an odd shape", 3, 1, 80, 2), ("a 4-bit cache (half a byte per number)", 5, 3, 96, 0.5)]


def _fresh_kv_cases(n=3):
    rng = _fresh_rng()
    return [(f"a shape drawn at random ({i + 1})", int(rng.integers(1, 129)), int(rng.integers(1, 17)),
             int(rng.choice([32, 48, 64, 80, 96, 128, 256])), float(rng.choice([0.5, 1, 2, 4]))) for i in range(n)]


def check_kv_bytes_per_token(f):
    cases, got = KV_CASES + _fresh_kv_cases(), []
    for what, layers, kv_heads, head_dim, nbytes in cases:
        value = call_answer("kv_bytes_per_token", f, (layers, kv_heads, head_dim, nbytes),
                      f"kv_bytes_per_token({layers}, {kv_heads}, {head_dim}, {nbytes}) ({what})")
        if _number(value) is None:
            check("kv_bytes_per_token", False, f"{what}: return a number of bytes, got {value!r}")
        got.append(_number(value))
    want = [2 * L * H * D * B for _, L, H, D, B in cases]
    if all(math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want)):
        check("kv_bytes_per_token", True, "")
        return
    per = lambda fn: [fn(L, H, D, B) for _, L, H, D, B in cases]
    mistakes = [
        ("count both K and V", per(lambda L, H, D, B: L * H * D * B)),
        ("dtype_bytes is already in bytes, not bits", per(lambda L, H, D, B: 2 * L * H * D * B * 8)),
        ("dtype_bytes is already in bytes, not bits", per(lambda L, H, D, B: 2 * L * H * D * B / 8)),
        ("every layer keeps its own K and V", per(lambda L, H, D, B: 2 * H * D * B)),
        ("every KV head keeps its own K and V", per(lambda L, H, D, B: 2 * L * D * B)),
        ("that counts numbers, not bytes: times dtype_bytes", per(lambda L, H, D, B: 2 * L * H * D)),
        ("dtype_bytes may be a fraction (0.5 for 4-bit numbers): do not round it",
         per(lambda L, H, D, B: 2 * L * H * D * max(1, int(B)))),
        ("dtype_bytes may be a fraction (0.5 for 4-bit numbers): do not round it",
         per(lambda L, H, D, B: 2 * L * H * D * int(B))),
    ]
    why = _named(mistakes, got) or "not the bytes one token's keys and values take"
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if not math.isclose(g, w, rel_tol=1e-12))
    what, layers, kv_heads, head_dim, nbytes = cases[i]
    check("kv_bytes_per_token", False, f"{what} ({layers} layers, {kv_heads} KV heads of {head_dim}, {nbytes} "
                                       f"bytes per number) should give {want[i]:,.10g} bytes, got {got[i]:,.10g}: {why}")


def check_prediction(predict, want):
    """The prediction of 5.3 against the table's count (one sequence either way is fine)."""
    value = call_answer("prediction", predict, (), "predicted_sequences()")
    got = _number(value)
    if got is None or not math.isfinite(got):
        check("prediction", False, f"return a number of sequences, got {value!r}")
    if abs(got - want) <= 1:
        print(f"PASS: predicted {got:g} sequences; the table says {want}")
        return
    weights = 2 * models.param_count(models.llama_config("llama-3.1-8b"))
    kv = 2 * 32 * 8 * 128 * 2 * 4096
    wrong = {"80 GiB is 2**30 bytes per GiB; GPU memory is quoted in GB (1e9 bytes)": (0.9 * 80 * 2**30 - weights) / kv,
             "that counts only the keys: each token keeps a key and a value": (0.9 * 80e9 - weights) / (kv / 2),
             "only 90% of the memory may be used": (80e9 - weights) / kv,
             "the weights take their share of the memory first": 0.9 * 80e9 / kv,
             "the weights are in BF16: 2 bytes per parameter, not 4": (0.9 * 80e9 - 2 * weights) / kv,
             "only 90% of the memory may be used, and the weights take their share of it first": 80e9 / kv,
             "that counts tokens: each sequence holds 4096 of them": (0.9 * 80e9 - weights) / (kv / 4096)}
    why = next((w for w, v in wrong.items() if abs(got - v) <= 1.5), "(0.9 x 80e9 - weight bytes) // KV bytes of one "
               "4096-token sequence")
    check("prediction", False, f"you predicted {got:g} sequences, the table says {want}: {why}")


PAGED_CASES = [   # (what, lengths, q_heads, kv_heads, head_dim, block, dtype, score scale, poisoned, q as a view)
    ("a block exactly, and one token more", [16, 17, 1], 4, 2, 64, 16, torch.float32, 1, False, False),
    ("one sequence of one token", [1], 1, 1, 8, 16, torch.float32, 1, False, False),
    ("ragged lengths, one KV head for 8 query heads", [37, 5, 100, 64, 3], 8, 1, 80, 16, torch.float32, 1, False,
     False),
    ("blocks of 32, four query heads per KV head", [33, 95, 64], 8, 2, 32, 32, torch.float32, 1, False, False),
    ("unused slots and blocks poisoned (V = 1e4 wherever no sequence has a token)", [7, 40, 16, 1], 4, 2, 16, 16,
     torch.float32, 1, True, False),
    ("spread scores (q x 40: scores in the hundreds)", [50, 3, 17], 4, 2, 64, 16, torch.float32, 40, True, False),
    ("Llama-3.1-8B heads in BF16", [300, 17, 129, 1], 32, 8, 128, 16, torch.bfloat16, 1, False, False),
    ("FP16, blocks of 8", [9, 8, 23], 6, 3, 24, 8, torch.float16, 1, True, False),
    ("q a strided view (not contiguous), batch of 5", [2, 31, 16, 15, 48], 4, 4, 32, 16, torch.float32, 1, False,
     True),
]
POISON = 1e4
PAGED_NAMES = ["q", "k_cache", "v_cache", "block_table", "seq_lens"]


def _fresh_paged_cases(n=2):
    """`n` cases of random shapes and lengths (float32, some poisoned, some with q a strided view), each with the
    seed of its values."""
    seed = grading_guard.fresh_seed()
    rng = np.random.default_rng(seed)
    for i in range(n):
        hkv, block = int(rng.choice([1, 2, 4])), int(rng.choice([8, 16, 32]))
        lengths = [int(v) for v in rng.integers(1, 4 * block, int(rng.integers(1, 6)))]
        yield (f"random case {i + 1}", lengths, hkv * int(rng.choice([1, 2, 4])), hkv, int(rng.choice([16, 32, 64])),
               block, torch.float32, 1, bool(rng.integers(2)), bool(rng.integers(2))), seed + i


def _paged_inputs(lengths, hq, hkv, d, block, dtype, scale, poisoned, strided, device, seed):
    """The lab's seeded inputs (make_paged_cache, its exported cells), made harder: q scaled, V poisoned in every
    slot that holds no sequence's token, q handed as a non-contiguous view."""
    make_paged_cache = solutions.load("05").make_paged_cache
    q, k_cache, v_cache, table, lens = make_paged_cache(lengths, q_heads=hq, kv_heads=hkv, head_dim=d, block=block,
                                                        dtype=dtype, device=device, seed=seed)
    if scale != 1:
        q = (q.float() * scale).to(dtype)
    if poisoned:
        used = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
        for b, n in enumerate(lengths):
            for p in range(n):
                used[table[b, p // block], p % block] = True
        v_cache = v_cache.clone()
        v_cache[~used] = POISON
    if strided:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)      # head-major in memory: (B, Hq) do not merge
    return q, k_cache, v_cache, table, lens


def _attention(q, k_cache, v_cache, block_table, seq_lens, *, extra=0, length=None, grouped=True, scale=True,
               slot_major=False):
    """Plain FP32 decode attention over the paged cache (and known mistakes, for the hints): `extra` keeps that many
    positions more (or fewer) than seq_lens; `length` one length for every sequence; `grouped=False` repeats the KV
    heads instead of interleaving them; `slot_major` flattens (slots, blocks) instead of (blocks, slots)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    block, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    heads = torch.arange(hq) // (hq // hkv) if grouped else torch.arange(hq) % hkv
    k_all, v_all, table = k_cache.cpu().float(), v_cache.cpu().float(), block_table.cpu()
    for b in range(q.shape[0]):
        gather = lambda cache: (cache[table[b]].transpose(0, 1) if slot_major else cache[table[b]]).flatten(0, 1)
        n = int(seq_lens[b]) if length is None else int(length)
        n = max(1, min(n + extra, table.shape[1] * block))
        k, v = gather(k_all)[:n][:, heads], gather(v_all)[:n][:, heads]         # (n, Hq, D)
        s = torch.einsum("hd,nhd->hn", q[b].cpu().float(), k) / (math.sqrt(q.shape[-1]) if scale else 1)
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def _describe(inputs):
    q, k_cache, _, table, lens = inputs
    kind = lambda t: f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return (f"q {kind(q)}{'' if q.is_contiguous() else ' (a strided view)'}, k_cache and v_cache {kind(k_cache)}, "
            f"block_table {kind(table)}, seq_lens {lens.tolist()}")


def check_paged_attention(f, device="cpu"):
    fixed = [(case, len(case[0]) + i) for i, case in enumerate(PAGED_CASES)]
    for (what, lengths, hq, hkv, d, block, dtype, scale, poisoned, strided), seed in [*fixed, *_fresh_paged_cases()]:
        inputs = _paged_inputs(lengths, hq, hkv, d, block, dtype, scale, poisoned, strided, device, seed=seed)
        q = inputs[0]
        want = _attention(*inputs)
        got = call_answer("paged_attention", f, inputs, f"{what} ({_describe(inputs)})", names=PAGED_NAMES)
        shape = (q.shape[0], q.shape[1], q.shape[2])
        if not isinstance(got, torch.Tensor):
            check("paged_attention", False, f"{what}: return a tensor of shape (B, Hq, D) = {shape}, got "
                                            f"{type(got).__name__}")
        if tuple(got.shape) != shape:
            check("paged_attention", False, f"{what}: return a tensor of shape (B, Hq, D) = {shape}, got "
                                            f"{tuple(got.shape)}"
                                            + ("; the query axis of length 1 is still there: drop it" if
                                               tuple(got.shape) in ((*shape[:2], 1, shape[2]),) else ""))
        if got.dtype != q.dtype or got.device != q.device:
            check("paged_attention", False, f"{what}: return the result in q's dtype and on its device, "
                                            f"{str(q.dtype).removeprefix('torch.')} on {q.device}, as "
                                            f"paged_attention_loop does; got {str(got.dtype).removeprefix('torch.')} "
                                            f"on {got.device}")
        tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3}.get(dtype, 1e-4)
        got = got.detach().float().cpu()
        err = (got - want).abs().max().item()
        if err <= tol:
            continue
        longer = torch.tensor([n > 1 for n in lengths])

        def close(rows=None, **wrong):     # the learner's result is that mistake's (on `rows`, if given)
            diff = (got - _attention(*inputs, **wrong)).abs()
            diff = diff if rows is None else diff[rows]
            return diff.numel() > 0 and diff.max().item() <= tol
        where = (f"{what} (lengths {lengths}, {hq} query and {hkv} KV heads of {d}, blocks of {block}, "
                 f"{str(dtype).removeprefix('torch.')})")
        if not math.isfinite(err):
            why = "your result has NaN or infinite values" + (
                ": these scores are large, and exp overflows unless each row's maximum is subtracted first (softmax "
                "does it)" if scale != 1 else "")
        elif close(extra=1):
            why = "positions 0 to seq_lens[b] - 1 hold tokens: yours also keeps position seq_lens[b] (<= instead of <?)"
        elif close(rows=longer, extra=-1):    # (a sequence of one token has nothing left)
            why = "positions 0 to seq_lens[b] - 1 hold tokens: yours leaves out the last one"
        elif close(length=max(lengths)):
            why = "each sequence has its own length: mask with seq_lens[b], not the longest one"
        elif close(extra=10**9):
            why = ("mask the positions past each sequence's length: its last block and the rest of its block_table "
                   "row hold garbage")
        elif close(grouped=False):
            why = "query head h reads KV head h // (Hq // Hkv) (repeat_interleave, not repeat)"
        elif close(scale=False):
            why = "scale the scores by 1 / sqrt(head_dim)"
        elif close(slot_major=True):
            why = ("position p of a sequence is slot p % BLOCK of its block block_table[b, p // BLOCK]: flatten "
                   "(blocks, slots) in that order")
        elif poisoned and err > 10:
            why = (f"the slots that hold no token are set to {POISON:g} in V here, and your result shows them: "
                   "some garbage position is not masked")
        else:
            first = int(((got - want).abs().amax(dim=(1, 2)) > tol).nonzero()[0])
            why = (f"sequence {first} (length {lengths[first]}) is off first; compare with paged_attention_loop on "
                   "these inputs")
        check("paged_attention", False, f"{where}: max error {err:.3g}: {why}")
    check("paged_attention", True, "")


# what computes the answer: the grader may call it, the answer may not
check_paged_attention.may_not_call = ('answer:paged_attention_loop',)


# (what it tests, start, chunks as (arrival, tokens), end, the server's token count)
METRIC_CASES = [
    ("a role-only first chunk and a usage chunk", 0.0,
     [(0.05, 0), (0.20, 1), (0.25, 1), (0.30, 1), (0.35, 1), (0.351, 0)], 0.35, 4),
    ("chunks of 3 and 2 tokens", 10.0, [(10.1, 0), (10.2, 1), (10.29, 3), (10.35, 2), (10.36, 0)], 10.35, 6),
    ("an empty chunk between two tokens", 0.0, [(0.1, 1), (0.15, 0), (0.2, 1), (0.3, 2)], 0.3, 4),
    ("a one-token answer", 5.0, [(5.1, 0), (5.3, 1), (5.31, 0)], 5.3, 1),
    ("a first chunk of 2 tokens", 0.0, [(0.1, 2), (0.2, 1), (0.3, 1)], 0.3, 4),
    ("a token the server counted but sent no text for", 0.0, [(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)], 0.4, 5),
]


def _random_cases(seed=0, n=8):
    """`n` random streams (the grader draws them from a fresh seed on every grade)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        start = float(1000 * rng.random())
        t = start + 0.01 + 0.02 * rng.random()
        chunks = [(t, 0)]
        for _ in range(int(rng.integers(1, 30))):
            t += 0.001 + 0.05 * rng.random()
            chunks.append((t, int(rng.choice([0, 1, 1, 1, 2, 3]))))
        if not any(k for _, k in chunks):
            chunks.append((t + 0.01, 1))
        n_tokens = sum(k for _, k in chunks)
        yield f"random stream {i}", start, chunks, max(t for t, k in chunks if k), n_tokens


def _close(a, b):
    seq = (list, tuple, np.ndarray, torch.Tensor)
    if isinstance(a, seq) and not getattr(a, "ndim", 1) == 0 or isinstance(b, seq) and not getattr(b, "ndim", 1) == 0:
        try:
            return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
        except TypeError:
            return False
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError, RuntimeError):
        return False
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _why(key, got, start, chunks, end, n):
    """Name the mistake behind a wrong value, when it is a known one."""
    tokens = [(t, k) for t, k in chunks if k > 0]
    ttft, e2e = tokens[0][0] - start, end - start
    want = loadgen.request_metrics(start, chunks, end, n)[key]
    if isinstance(got, torch.Tensor) or isinstance(got, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in got):
        return "return Python floats (a list of them for itl): a float32 tensor loses these times' digits"
    if _close(got, [x * 1e3 for x in want] if key == "itl" else want * 1e3):
        return "every time here is in seconds, and so are the metrics: no factor 1000 (milliseconds)"
    if key == "ttft" and _close(got, chunks[0][0] - start):
        return "TTFT runs to the first chunk that carries a token; the role-only first chunk carries none"
    if key in ("ttft", "e2e") and _close(got, want + start):
        return f"{key.upper()} counts from start, when the request was sent: subtract it"
    if key == "e2e" and _close(got, chunks[-1][0] - start):
        return "E2E runs to end, the arrival of the last token; the last chunk may carry only the usage (0 tokens)"
    if key == "e2e" and _close(got, end - tokens[0][0]):
        return "E2E counts from start, when the request was sent, not from the first token"
    if key == "tpot":
        if n > 1 and _close(got, (e2e - ttft) / n):
            return "TPOT divides by output_tokens - 1: the first token's time is TTFT's"
        if _close(got, e2e / n):
            return "TPOT leaves the first token out: (E2E - TTFT) / (output_tokens - 1)"
        if n > 1 and _close(got, (e2e - ttft) / (sum(k for _, k in tokens) - 1)):
            return "count the tokens the server reports (output_tokens), not the chunks' tokens"
        if n == 1:
            return "a one-token answer has no TPOT: return float('nan')"
    if key == "itl":
        if _close(got, [b - a for (a, _), (b, _) in zip(tokens, tokens[1:])]):
            return "ITL is per token: a chunk of k tokens after a gap g gives k values g / k"
        from_any_chunk, seen = [], False
        for i, (t, k) in enumerate(chunks):
            if k > 0:
                from_any_chunk += [(t - chunks[i - 1][0]) / k] * k if seen else []
                seen = True
        if _close(got, from_any_chunk):
            return "each gap runs from the previous chunk that carried a token, not from an empty one"
        return "one value per token after the first chunk that carries tokens; the first chunk's own tokens add none"
    return {"ttft": "TTFT runs from start to the arrival of the first chunk that carries a token",
            "e2e": "E2E runs from start to end", "tpot": "see TPOT's definition above"}.get(key, "see the definitions above")


def check_request_metrics(f):
    for what, start, chunks, end, n in [*METRIC_CASES, *_random_cases(grading_guard.fresh_seed())]:
        want = loadgen.request_metrics(start, chunks, end, n)
        inputs = (f"{what} (start={start:g}, chunks={[(round(t, 4), k) for t, k in chunks]}, end={end:g}, "
                  f"output_tokens={n})")
        given = list(chunks)
        got = call_answer("request_metrics", f, (start, given, end, n), inputs)
        if given != chunks:
            check("request_metrics", False, f"on {inputs} your code changed its input chunks: read the inputs, never "
                                            "write into them (filter into a new list)")
        if not isinstance(got, dict) or not {"ttft", "tpot", "itl", "e2e"} <= set(got):
            check("request_metrics", False, f"return a dict with keys 'ttft', 'tpot', 'itl', 'e2e', got {got!r}")
        for key in ("ttft", "e2e", "tpot", "itl"):
            if not _close(got[key], want[key]):
                shown = lambda v: (f"[{', '.join(f'{x:.4g}' for x in v[:8])}{', ...' if len(v) > 8 else ''}] "
                                   f"({len(v)} values)" if isinstance(v, (list, tuple, np.ndarray)) and
                                   all(_number(x) is not None for x in v) else repr(v))
                check("request_metrics", False, f"{inputs}: {key} should be {shown(want[key])}, got "
                                                f"{shown(got[key])}: " + _why(key, got[key], start, chunks, end, n))
    check("request_metrics", True, "")


# what computes the answer: the grader may call it, the answer may not
check_request_metrics.may_not_call = ('utils.llm.loadgen.request_metrics',)
