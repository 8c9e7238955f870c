"""Lab 05's graders: 5.1 decode ceiling, 5.2 KV bytes per token, 5.3 the prediction, 5.4 request metrics, 5.5 paged attention."""
import math

import numpy as np
import torch

from utils import solutions
from utils.exercises import check
from utils.llm import loadgen, models


def check_decode_ceiling(f):
    for bandwidth, nbytes in [(3350, 16e9), (5300, 141.1e9), (17.5, 0.54e9), (1, 1), (819.2, 3)]:
        want, got = bandwidth * 1e9 / nbytes, f(bandwidth, nbytes)
        if isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9):
            continue
        same = lambda x: isinstance(got, (int, float)) and math.isclose(got, x, rel_tol=1e-6)
        why = ("GB/s means 1e9 bytes per second, not 2**30" if same(bandwidth * 2**30 / nbytes) else
               "that is seconds per token: tokens/s = bytes per second / bytes per token"
               if same(nbytes / (bandwidth * 1e9)) else
               "bandwidth_gbps is in GB/s: times 1e9 gives bytes per second" if same(bandwidth / nbytes) else
               "tokens/s = bandwidth_gbps * 1e9 / bytes_per_token")
        check("decode_ceiling", False, f"decode_ceiling({bandwidth}, {nbytes:g}) should be {want:,.6g} tokens/s, "
                                       f"got {got!r}: {why}")
    check("decode_ceiling", True, "")


def check_kv_bytes_per_token(f):
    cases = [("Llama-3.1-8B in BF16", 32, 8, 128, 2), ("Llama-3.1-70B in BF16", 80, 8, 128, 2),
             ("SmolLM2-135M in FP32", 30, 3, 64, 4), ("Llama-3.1-8B in FP8", 32, 8, 128, 1),
             ("an odd shape", 3, 1, 80, 2)]
    for what, layers, kv_heads, head_dim, nbytes in cases:
        want, got = 2 * layers * kv_heads * head_dim * nbytes, f(layers, kv_heads, head_dim, nbytes)
        if got == want:
            continue
        why = ("count both K and V" if got == want / 2 else "dtype_bytes is already in bytes, not bits"
               if got in (want * 8, want / 8) else "every layer keeps its own K and V" if got == want / layers
               else "2 (K and V) x layers x kv_heads x head_dim x dtype_bytes")
        check("kv_bytes_per_token", False, f"{what} ({layers} layers, {kv_heads} KV heads of {head_dim}, {nbytes} "
                                           f"bytes per number) should give {want:,} bytes, got {got!r}: {why}")
    check("kv_bytes_per_token", True, "")


def check_prediction(predict, want):
    """The prediction of 5.3 against the table's count (one sequence either way is fine)."""
    got = predict()
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        check("prediction", False, f"return a number of sequences, got {got!r}")
    if abs(got - want) <= 1:
        print(f"PASS: predicted {got:g} sequences; the table says {want}")
        return
    weights = 2 * models.param_count(models.llama_config("llama-3.1-8b"))
    kv = 2 * 32 * 8 * 128 * 2 * 4096
    wrong = {"80 GiB is 2**30 bytes per GiB; GPU memory is quoted in GB (1e9 bytes)": (0.9 * 80 * 2**30 - weights) / kv,
             "that counts only the keys: each token keeps a key and a value": (0.9 * 80e9 - weights) / (kv / 2),
             "only 90% of the memory may be used": (80e9 - weights) / kv,
             "the weights take their share of the memory first": 0.9 * 80e9 / kv}
    why = next((w for w, v in wrong.items() if abs(got - v) <= 1.5), "(0.9 x 80e9 - weight bytes) // KV bytes of one "
               "4096-token sequence")
    check("prediction", False, f"you predicted {got:g} sequences, the table says {want}: {why}")


PAGED_CASES = [   # (what, lengths, q_heads, kv_heads, head_dim, block, dtype)
    ("one sequence of one token", [1], 1, 1, 8, 16, torch.float32),
    ("a block exactly, and one token more", [16, 17, 1], 4, 2, 64, 16, torch.float32),
    ("ragged lengths, one KV head for 8 query heads", [37, 5, 100, 64, 3], 8, 1, 80, 16, torch.float32),
    ("blocks of 32, four query heads per KV head", [33, 95, 64], 8, 2, 32, 32, torch.float32),
    ("Llama-3.1-8B heads in BF16", [300, 17, 129, 1], 32, 8, 128, 16, torch.bfloat16),
]


def _attention(q, k_cache, v_cache, block_table, seq_lens, *, mask=True, grouped=True, scale=True):
    """Plain FP32 decode attention over the paged cache (and known mistakes, for the hints)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    block, hq, hkv = k_cache.shape[1], q.shape[1], k_cache.shape[2]
    heads = torch.arange(hq) // (hq // hkv) if grouped else torch.arange(hq) % hkv
    for b in range(q.shape[0]):
        n = int(seq_lens[b]) if mask else block_table.shape[1] * block
        ids = block_table[b, :-(-n // block)].cpu()
        k = k_cache.cpu().float()[ids].flatten(0, 1)[:n][:, heads]     # (n, Hq, D)
        v = v_cache.cpu().float()[ids].flatten(0, 1)[:n][:, heads]
        s = torch.einsum("hd,nhd->hn", q[b].cpu().float(), k) / (math.sqrt(q.shape[-1]) if scale else 1)
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def check_paged_attention(f, device="cpu"):
    make_paged_cache = solutions.load("05").make_paged_cache     # the lab's seeded inputs (its exported cells)
    for what, lengths, hq, hkv, d, block, dtype in PAGED_CASES:
        inputs = make_paged_cache(lengths, q_heads=hq, kv_heads=hkv, head_dim=d, block=block, dtype=dtype,
                                  device=device, seed=len(what))
        got = f(*inputs)
        want = _attention(*inputs)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            check("paged_attention", False, f"{what}: return a tensor of shape (B, Hq, D) = {tuple(want.shape)}, got "
                                            f"{getattr(got, 'shape', got)!r}")
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        got = got.detach().float().cpu()
        err = (got - want).abs().max().item()
        if err <= tol:
            continue
        close = lambda **wrong: (got - _attention(*inputs, **wrong)).abs().max().item() <= tol
        why = ("mask the positions past each sequence's length: its last block and the rest of its block_table row "
               "hold garbage" if close(mask=False) else
               "query head h reads KV head h // (Hq // Hkv) (repeat_interleave, not repeat)" if close(grouped=False)
               else "scale the scores by 1 / sqrt(head_dim)" if close(scale=False) else
               "compare with paged_attention_loop on these inputs")
        check("paged_attention", False, f"{what} (lengths {lengths}, {hq} query and {hkv} KV heads of {d}, blocks of "
                                        f"{block}, {str(dtype).removeprefix('torch.')}): max error {err:.3g}: {why}")
    check("paged_attention", True, "")


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
    if isinstance(a, (list, tuple, np.ndarray)) or isinstance(b, (list, tuple, np.ndarray)):
        try:
            return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
        except TypeError:
            return False
    try:
        a, b = float(a), float(b)
    except (TypeError, ValueError):
        return False
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _why(key, got, start, chunks, end, n):
    """Name the mistake behind a wrong value, when it is a known one."""
    tokens = [(t, k) for t, k in chunks if k > 0]
    ttft, e2e = tokens[0][0] - start, end - start
    if key == "ttft" and _close(got, chunks[0][0] - start):
        return "TTFT runs to the first chunk that carries a token; the role-only first chunk carries none"
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
    return "see the definitions above"


def check_request_metrics(f):
    for what, start, chunks, end, n in [*METRIC_CASES, *_random_cases()]:
        want = loadgen.request_metrics(start, chunks, end, n)
        got = f(start, list(chunks), end, n)
        if not isinstance(got, dict) or not {"ttft", "tpot", "itl", "e2e"} <= set(got):
            check("request_metrics", False, f"return a dict with keys 'ttft', 'tpot', 'itl', 'e2e', got {got!r}")
        for key in ("ttft", "e2e", "tpot", "itl"):
            if not _close(got[key], want[key]):
                check("request_metrics", False,
                      f"{what} (start={start:g}, chunks={[(round(t, 4), k) for t, k in chunks]}, end={end:g}, "
                      f"output_tokens={n}): {key} should be {want[key]!r}, got {got[key]!r}: "
                      + _why(key, got[key], start, chunks, end, n))
    check("request_metrics", True, "")
