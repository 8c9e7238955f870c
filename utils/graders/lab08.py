"""Lab 08's graders: 8.1 dequantize Q4_1, 8.2 the Q4 GEMV's inner loop, 8.3 the numbers that compare two backends."""
import math

import numpy as np
import torch

from utils import blocks
from utils.exercises import call_answer, check
from utils import grading_guard


# --- 8.1: Q4_1 blocks to weights ----------------------------------------------------------------------------

def _q4_1_mistakes(b: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Known wrong decoders of Q4_1 blocks, each with the hint meant for it (a wrong decoder can make NaN and inf
    of some blocks: computed quietly)."""
    np_errors = np.seterr(all="ignore")
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    lo, hi = (qs & 0x0F).astype(np.float32), (qs >> 4).astype(np.float32)
    ggml = np.concatenate([lo, hi], axis=1)
    inter = np.stack([lo, hi], axis=2).reshape(len(b), 32)
    swapped = np.concatenate([hi, lo], axis=1)
    be = lambda cols: b[:, cols][:, ::-1].copy().view(np.float16).astype(np.float32)     # bytes read big-endian
    mistakes = [
        ("weights 0-15 are the LOW nibbles of the 16 bytes and weights 16-31 their HIGH nibbles (ggml's order), "
         "not low and high of each byte side by side", d * inter + m),
        ("the low nibbles come first (weights 0-15), the high nibbles second", d * swapped + m),
        ("Q4_1 adds the block's minimum: w = d * q + m (m is the fp16 in bytes 2-3)", d * ggml),
        ("Q4_1 has no offset of 8 (that is Q4_0): w = d * q + m", d * (ggml - 8) + m),
        ("d is bytes 0-1 and m bytes 2-3: they are swapped", m * ggml + d),
        ("the fp16 fields are little-endian (the low byte first): view the two bytes as np.float16",
         be([0, 1]) * ggml + be([2, 3])),
    ]
    np.seterr(**np_errors)
    return mistakes


def check_dequantize_q4_1(f):
    """f(blocks) -> float32 weights (n, 32) for uint8 Q4_1 blocks (n, 20): equal to gguf's own dequantizer on fresh
    random blocks and the awkward ones (zero scale, nibbles 0 and 15, negative minimums, the largest fp16)."""
    seed = grading_guard.fresh_seed()
    for n in (64, 7, 1):      # the most blocks first: every awkward one and random ones tell the mistakes apart
        data = blocks.random_blocks("Q4_1", n, seed=seed + n, awkward=True, scale=0.05)
        want = blocks.dequantize(data, "Q4_1")
        got = call_answer("dequantize_q4_1", f, (data,), f"{n} Q4_1 block(s) (uint8, shape {data.shape})",
                          names=["data"])
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu().numpy()
        if not isinstance(got, np.ndarray):
            check("dequantize_q4_1", False, f"return a NumPy array of float32 weights, shape ({n}, 32); got {type(got).__name__}")
        if got.size == want.size and got.shape != want.shape:
            check("dequantize_q4_1", False, f"return one row of 32 weights per block: shape ({n}, 32), got {got.shape}")
        if got.shape != want.shape:
            check("dequantize_q4_1", False, f"{n} blocks hold {n} x 32 weights: shape ({n}, 32), got {got.shape}")
        if got.dtype != np.float32:
            check("dequantize_q4_1", False, f"return float32 weights, as ggml does (got {got.dtype}): .astype(np.float32)")
        if np.array_equal(got, want):           # every value equal (a zero's sign aside), NaN nowhere
            continue
        why = next((hint for hint, wrong in _q4_1_mistakes(data) if np.array_equal(got, wrong, equal_nan=True)), None)
        i, j = map(int, np.argwhere(got != want)[0])
        check("dequantize_q4_1", False, f"block {i} (bytes {data[i, :4].tolist()} then nibbles), weight {j}: "
                                        f"{want[i, j]!r} expected, got {got[i, j]!r}"
                                        + (f": {why}" if why else ""))
    check("dequantize_q4_1", True, "")


# what computes the answer: the grader may call it, the answer may not
check_dequantize_q4_1.may_not_call = ('utils.blocks.dequantize', 'utils.blocks.decode', 'gguf.quants.dequantize')


# --- 8.2: the GEMV that never expands the weights -----------------------------------------------------------

# (rows N, columns K, x's dtype): odd rows, odd block counts (Q4_0 rows that are not whole 32-bit words in gguf's
# layout), rows that end inside a step of the loop
GEMV_CASES = [(1, 32, "float32"), (7, 64, "float16"), (9, 32 * 37, "float32"), (24, 256, "bfloat16"),
              (5, 32 * 130, "float32")]


def _kernel_model(data: np.ndarray, q: np.ndarray, dx: np.ndarray, qtype: str, lo, hi, swap=False):
    """The lab's GEMV in float64, with the integer dot products of each word given: byte j of a block's 16 bytes of
    nibbles contributes lo[j] * qx[j] + hi[j] * qx[16 + j] (swapped: lo with qx[16 + j], hi with qx[j]), qx the int8
    x of the block; per block, dx * (d * (dot - ZERO * sum qx) + m * sum qx). `lo`, `hi`: functions of the nibble
    bytes (int64, shape (N, blocks, 16); a word is 4 of them). Returns (y, the size of its terms)."""
    f = blocks.fmt(qtype)
    n, row_bytes = data.shape
    nblk, zero = row_bytes // f.nbytes, 8 if f is blocks.Q4_0 else 0
    scales = data.reshape(n, nblk, f.nbytes)
    b = scales[:, :, f.nbytes - 16:].astype(np.int64)                             # (n, nblk, 16)
    x_lo, x_hi = q[:, :16].astype(np.int64), q[:, 16:].astype(np.int64)            # (nblk, 16)
    if swap:
        x_lo, x_hi = x_hi, x_lo
    terms = lo(b) * x_lo + hi(b) * x_hi                                           # (n, nblk, 16)
    dot, size = terms.sum(axis=2).astype(np.float64), np.abs(terms).sum(axis=2).astype(np.float64)
    d = scales[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = scales[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if "m" in f.scales else 0 * d
    sq = q.astype(np.int64).sum(axis=1)                                           # (nblk,): the sum of q of x
    dxf = dx.astype(np.float64)
    y = (dxf * (d * (dot - zero * sq) + m * sq)).sum(axis=1)
    magnitude = (dxf * (np.abs(d) * (size + zero * np.abs(q).sum(axis=1)) + np.abs(m) * np.abs(q).sum(axis=1))).sum(1)
    return y, magnitude


def _signed_bytes(v):
    return np.where(v >= 128, v - 256, v)


def _shifted_unmasked(b):
    """The four bytes of word >> 4 (an arithmetic shift), as dot4 reads them (signed): a byte's high nibble with
    the next byte's low nibble above it, the word's top byte's high nibble sign-extended."""
    nxt = np.zeros_like(b)
    nxt[..., :-1] = b[..., 1:]
    top = np.arange(b.shape[-1]) % 4 == 3
    return np.where(top, _signed_bytes(b) >> 4, _signed_bytes((b >> 4) | ((nxt & 0x0F) << 4)))


def _gemv_mistakes(data: np.ndarray, q: np.ndarray, dx: np.ndarray, qtype: str) -> list[tuple[str, tuple]]:
    """Known wrong pairs of dot products, as whole products (float64) with the size of their terms, each with its
    hint."""
    low, high = (lambda b: b & 0x0F), (lambda b: b >> 4)
    first = lambda g: (lambda b: g(b) * (np.arange(b.shape[-1]) % 4 == 0))          # byte 0 of each word only
    none = lambda b: 0 * b
    model = lambda lo, hi, swap=False: _kernel_model(data, q, dx, qtype, lo, hi, swap)
    one_nibble = ("mask with 0x0F0F0F0F, one nibble in each of the word's 4 bytes: word & 0xF keeps byte 0's alone "
                  "(and (word >> 4) & 0x0F0F0F0F the 4 high nibbles)")
    return [
        ("the low nibbles (word & 0x0F0F0F0F) are weights 0-15 of their blocks and multiply x_lo, the high nibbles "
         "x_hi: swapped", model(low, high, swap=True)),
        (one_nibble, model(first(low), first(high))),
        (one_nibble, model(first(low), high)),
        (one_nibble, model(low, first(high))),
        ("the high nibbles are missing: add dot4((word >> 4) & 0x0F0F0F0F, x_hi, dots, DOT4) to the low ones",
         model(low, none)),
        ("the low nibbles are missing: each dot4 adds to its third argument, so pass it dots (what the first one "
         "returned), not zeros", model(none, high)),
        ("mask the shifted word too: (word >> 4) & 0x0F0F0F0F; word >> 4 alone leaves the next nibble in each byte's "
         "high half", model(low, _shifted_unmasked)),
    ]


def check_q4_gemv(q4_gemv, device="cpu", blocks_per_step=32):
    """q4_gemv(weights, x, qtype=...), weights as gguf lays them out, against gguf's dequantization then a float64
    product with x quantized as the lab's kernel does it (`blocks.quantize_q8_rows`), for Q4_0 and Q4_1, odd row
    counts, odd block counts and block counts that end inside a step of the loop (a step: `blocks_per_step` blocks
    of a row); x in float32, float16 and bfloat16."""
    seed = grading_guard.fresh_seed()
    rng = np.random.default_rng(seed)
    cases = GEMV_CASES + [(3, 32 * (2 * blocks_per_step + 3), "float16")]      # more than two steps, the last partial
    failed = []      # (what, relative error, the hints of the known mistakes that give the answer's outputs)
    for qtype in ("Q4_0", "Q4_1"):
        for n, k, dtype in cases:
            data = blocks.random_blocks(qtype, n * k // 32, seed=seed + n + k, awkward=n * k >= 2048).reshape(n, -1)
            x = torch.from_numpy(rng.standard_normal(k).astype(np.float32)).to(getattr(torch, dtype))
            w_t, x_t = torch.from_numpy(data.copy()).to(device), x.to(device)
            what = f"{qtype} weights {n}x{k} (uint8 {tuple(w_t.shape)}), x {dtype} ({k},)"
            y = call_answer("q4_gemv", lambda w, x: q4_gemv(w, x, qtype=qtype), (w_t, x_t), what, names=["weights", "x"])
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != (n,):
                check("q4_gemv", False, f"{what}: expected a tensor of {n} outputs, got "
                                        f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
            got = y.detach().double().cpu().numpy()
            q, dx = blocks.quantize_q8_rows(x)
            xq = (q.astype(np.float64) * dx.astype(np.float64)[:, None]).ravel()       # the x the kernel multiplies
            w = blocks.dequantize(data, qtype).astype(np.float64)
            want, scale = w @ xq, np.abs(w) @ np.abs(xq) + 1e-30
            err = float(np.max(np.abs(got - want) / scale))
            if err < 1e-5:
                continue
            # a mistake's own terms can be far larger than the right ones: room for their float32 rounding too, or
            # the mistake goes unnamed on some draws
            failed.append((what, err, [hint for hint, (wrong, size) in _gemv_mistakes(data, q, dx, qtype)
                                       if np.max(np.abs(got - wrong) / (scale + size)) < 1e-5]))
    if failed:       # a mistake is named when it gives the answer's outputs on every case that failed (on one small
        what, err, hints = failed[0]                  # case, two mistakes can give the same integers by chance)
        why = next((h for h in hints if all(h in other for _, _, other in failed)), None)
        check("q4_gemv", False, f"{what}: relative error {err:.2e} (tolerance 1e-5, against W @ x with x quantized "
                                "to int8 per 32 as the kernel does it)" + (f": {why}" if why else ""))
    check("q4_gemv", True, "")


# --- 8.3: how far apart two backends' next-token distributions are ------------------------------------------

def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def reference_stats(ref_logits, test_logits, tokens) -> dict:
    """The three figures, computed in float64 (the grader's answer)."""
    lr, lt = _log_softmax(np.asarray(ref_logits)), _log_softmax(np.asarray(test_logits))
    rows = np.arange(len(tokens))
    tok = np.asarray(tokens)
    ppl = lambda lp: math.exp(-lp[rows, tok].mean())
    return {"ppl_ratio": ppl(lt) / ppl(lr),
            "kl": float((np.exp(lr) * (lr - lt)).sum(axis=1).mean()),
            "top1": float((lr.argmax(axis=1) == lt.argmax(axis=1)).mean())}


def _stats_mistakes(ref, test, tokens) -> list[tuple[str, dict]]:
    lr, lt = _log_softmax(ref), _log_softmax(test)
    rows, tok = np.arange(len(tokens)), np.asarray(tokens)
    ppl = lambda lp: math.exp(-lp[rows, tok].mean())
    right = reference_stats(ref, test, tokens)
    return [
        ("kl: KL(ref || test) weighs by the REFERENCE's probabilities: sum p_ref * (log p_ref - log p_test)",
         dict(right, kl=float((np.exp(lt) * (lt - lr)).sum(axis=1).mean()))),
        ("kl: the logarithms are of probabilities (log-softmax of the logits), not of the raw logits",
         dict(right, kl=float((np.exp(lr) * (ref - test)).sum(axis=1).mean()))),
        ("kl: the mean over positions, not the sum",
         dict(right, kl=float((np.exp(lr) * (lr - lt)).sum()))),
        ("ppl_ratio: the test backend's perplexity over the reference's (not the other way round)",
         dict(right, ppl_ratio=ppl(lr) / ppl(lt))),
        ("ppl_ratio: perplexity is exp of the mean negative log-probability of the NEXT TOKEN (tokens[t]), "
         "not of each row's most likely token",
         dict(right, ppl_ratio=math.exp(-lt.max(axis=1).mean()) / math.exp(-lr.max(axis=1).mean()))),
        ("ppl_ratio: natural logarithms and exp (2 ** of a log2 gives the same ratio only if both use base 2)",
         dict(right, ppl_ratio=2 ** (-lt[rows, tok].mean()) / 2 ** (-lr[rows, tok].mean()))),
    ]


def check_backend_stats(f):
    """f(ref_logits, test_logits, tokens) -> {"ppl_ratio", "kl", "top1"} on fresh random logits: large ones (a
    softmax without its max subtracted overflows), near-ties, a test backend that agrees and one that does not."""
    seed = grading_guard.fresh_seed()
    rng = np.random.default_rng(seed)
    cases = []
    for t, v, scale, noise in ((9, 50, 3.0, 0.05), (17, 300, 4.0, 1.5), (5, 64, 90.0, 0.5), (1, 7, 1.0, 0.0)):
        ref = (rng.standard_normal((t, v)) * scale).astype(np.float32)
        test = (ref + rng.standard_normal((t, v)) * noise).astype(np.float32)
        cases.append((ref, test, rng.integers(0, v, t)))
    graded = []        # (ref, what, the answer's figures, the right ones, the known mistakes' figures), per case
    for ref, test, tokens in cases:
        what = f"logits of {ref.shape[0]} positions x {ref.shape[1]} tokens (scale {np.abs(ref).max():.3g})"
        want = reference_stats(ref, test, tokens)
        got = call_answer("backend_stats", f, (ref, test, tokens), what, names=["ref_logits", "test_logits", "tokens"])
        if not isinstance(got, dict) or not {"ppl_ratio", "kl", "top1"} <= set(got):
            check("backend_stats", False, f'return a dict with "ppl_ratio", "kl" and "top1"; got {got!r:.120}')
        values = {}
        for key in ("ppl_ratio", "kl", "top1"):
            try:
                values[key] = float(got[key])
            except (TypeError, ValueError):
                check("backend_stats", False, f"{key} must be a number, got {got[key]!r:.80}")
        graded.append((ref, what, values, want, _stats_mistakes(ref, test, tokens)))
    same = lambda a, b: all(math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-9) for k in b)
    for ref, what, values, want, _ in graded:
        bad = [k for k in want if not math.isclose(values[k], want[k], rel_tol=1e-5, abs_tol=1e-9)]
        if not bad:
            continue
        if any(not math.isfinite(values[k]) for k in bad) and np.abs(ref).max() > 80:
            check("backend_stats", False, f"{what}: {', '.join(bad)} not finite: exp of logits near 90 overflows "
                                          "float32; subtract each row's maximum first (log-sum-exp)")
        # a known mistake is named only when it gives the answer's figures on every case (near 1, one ratio can
        # come close to another's inverse by chance)
        why = next((hint for i, (hint, _) in enumerate(graded[0][4])
                    if all(same(v, m[i][1]) for _, _, v, _, m in graded)), None)
        k = bad[0]
        check("backend_stats", False, f"{what}: {k} should be {want[k]:.6g}, got {values[k]:.6g}"
                                      + (f": {why}" if why else ""))
    check("backend_stats", True, "")
