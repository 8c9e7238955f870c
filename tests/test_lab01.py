"""Lab 01: the public kernels are right on every layout or say what they support, and the grader of every
exercise passes the reference and answers written differently and fails known-wrong answers with their hint.

On the CPU the Triton kernels run under the interpreter (a private copy of the lab's exported module, since
`@triton.jit` picks the interpreter when a kernel is defined) on a seeded covering grid: sizes 1, 17, 97 and
4099, every layout once, every accepted dtype once, and every unsupported input. The graders are
utils/graders/lab01.py, called with the loaded module's functions. The full grids, and the hand-written CUDA/HIP
kernels built with load_inline (also under compute-sanitizer's memcheck, bad calls included), are `gpu` tests
(`make test-gpu`)."""
import hashlib
import importlib.util
import os
import sys

import pytest
import torch

from grading import errors, run_lab_with, run_under_memcheck, stream_text
from utils import isa, solutions
from utils.exercises import ExerciseFailed
from utils.graders import lab01 as graders


@pytest.fixture(scope="module")
def interpreter(tmp_path_factory):
    """A loader of the lab's exported module, with answers substituted, whose kernels run under Triton's
    interpreter (TRITON_INTERPRET=1 while this module's tests run)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    folder = tmp_path_factory.mktemp("lab01_interpreted")
    loaded = {}

    def load(answers=None):
        source = solutions.export_source("01", answers)
        name = "lab01_interpreted_" + hashlib.sha256(source.encode()).hexdigest()[:12]
        if name not in loaded:
            path = folder / f"{name}.py"
            path.write_text(source)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    yield load
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def lab(interpreter):
    return interpreter()


# --- triton_add on the CPU: a covering grid ------------------------------------------------------

def test_contiguous_sizes_and_dtypes(lab, capsys):
    graders.check_add("triton_add", lab.triton_add, sizes=(1, 17, 97, 4099))
    graders.check_add("triton_add", lab.triton_add, sizes=(97,), dtypes=(torch.float16,))
    graders.check_add("triton_add", lab.triton_add, sizes=(4099,), dtypes=(torch.bfloat16,))
    graders.check_add("add", lab.add, sizes=(1, 4099), dtypes=(torch.float32, torch.float16))
    assert capsys.readouterr().out.count("PASS") == 4


def test_the_short_wrapper_takes_contiguous_tensors_only(lab):
    """add, the lesson's short wrapper: out=None gives a new tensor; a view that is not contiguous is refused
    (triton_add takes those)."""
    x, y = torch.randn(17), torch.randn(17)
    assert torch.equal(lab.add(x, y), x + y)
    with pytest.raises(AssertionError, match="contiguous"):
        lab.add(torch.randn(34)[::2], y)
    for other in (torch.randn(16), torch.randn(1), torch.randn(17).double(), torch.empty(17, dtype=torch.int32)):
        with pytest.raises(AssertionError, match="one shape and dtype"):     # no read or write past a tensor
            lab.add(x, y, other)


def test_every_layout(lab, capsys):
    graders.check_layouts("triton_add", lab.triton_add, n=97)
    graders.check_layouts("triton_add", lab.triton_add, n=17, dtype=torch.float16, names={"x.T (2-D)", "out[::2]"})
    graders.check_layouts("triton_add", lab.triton_add, n=17, dtype=torch.bfloat16,
                          names={"heads transposed (B, N, H, D) -> (B, H, N, D)", "expand: a row broadcast"})
    assert capsys.readouterr().out.count("PASS") == len(graders.layouts()) + 4


def test_more_layouts(lab):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 3, 2, generator=gen).permute(4, 2, 0, 3, 1)
    out = torch.full((2, 3, 2, 3, 2), float("nan")).permute(4, 2, 0, 3, 1)      # 5-D strided out as well
    y = torch.randn(2, 2, 2, 3, 3, generator=gen)
    assert lab.triton_add(x, y, out) is out and torch.equal(out, x + y)
    a = torch.randn(4099, generator=gen)
    b = torch.randn(4099, generator=gen)
    want = a + b
    assert lab.triton_add(a, b, a) is a and torch.equal(a, want)                 # in place
    got = lab.triton_add(a[::3], b[::3])                                          # out=None: a new tensor
    assert got.is_contiguous() and torch.equal(got, a[::3] + b[::3])


def test_the_64_bit_index_path(lab):
    """Offsets past 2**31 switch add_strided_kernel to 64-bit arithmetic; the same kernel on small tensors."""
    x, y = torch.randn(5, 7).T, torch.randn(7, 5)
    out = torch.full((7, 5), float("nan"))
    sizes, (xs, ys, os_) = lab.merged_layout(out.shape, x.stride(), y.stride(), out.stride())
    lab.add_strided_kernel[(1,)](x, y, out, out.numel(), 1, *sizes, 0, 0, *xs, 0, 0, *ys, 0, 0, *os_,
                                 BLOCK=64, INT64=True)
    assert torch.equal(out, x + y)


def test_merged_layout(lab):
    t = torch.empty(3, 4, 5)
    assert lab.merged_layout(t.shape, t.stride(), t.stride(), t.stride()) == ([60], [[1], [1], [1]])
    tt = t.transpose(0, 2)
    assert lab.merged_layout(tt.shape, tt.stride(), tt.stride(), tt.stride()) == ([60], [[1], [1], [1]])
    q = torch.empty(8, 3 * 16)[:, :16]
    assert lab.merged_layout(q.shape, q.stride(), (16, 1), (16, 1)) == ([8, 16], [[48, 1], [16, 1], [16, 1]])
    e = torch.empty(1, 16).expand(8, 16)
    assert lab.merged_layout(e.shape, e.stride(), (16, 1), (16, 1)) == ([8, 16], [[0, 1], [16, 1], [16, 1]])
    assert lab.merged_layout((), (), (), ()) == ([], [[], [], []])


@pytest.mark.parametrize("call, error, words", [
    (lambda t: t.triton_add(torch.ones(3, 4), torch.ones(4)), ValueError, "no broadcasting"),
    (lambda t: t.triton_add(torch.ones(4), torch.ones(4), torch.ones(5)), ValueError, "one shape"),
    (lambda t: t.triton_add(torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)), TypeError,
     "float32, float16, bfloat16"),
    (lambda t: t.triton_add(torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32)), TypeError, "one of"),
    (lambda t: t.triton_add(torch.ones(4), torch.ones(4, dtype=torch.float16)), TypeError, "one dtype"),
    (lambda t: t.triton_add([1.0], torch.ones(1)), TypeError, "x must be a torch.Tensor"),
    (lambda t: t.triton_add(torch.ones(1), torch.ones(1), "out"), TypeError, "out must be a torch.Tensor"),
    (lambda t: t.triton_add(torch.ones(3, 4), torch.ones(3, 4), torch.ones(1, 4).expand(3, 4)), ValueError,
     "elements of out share memory"),
    (lambda t: (lambda a: t.triton_add(a[1:], a[1:], a[:-1]))(torch.ones(9)), ValueError, "out overlaps x"),
    (lambda t: (lambda a: t.triton_add(a[::2], a[1::2], a[:5]))(torch.ones(10)), ValueError, "out overlaps x"),
    (lambda t: t.triton_add_rows(torch.ones(4, 3).T, torch.ones(3, 4), torch.ones(3, 4)), ValueError,
     "rows are contiguous"),
    (lambda t: t.triton_add_rows(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(2, 3, 4)), ValueError,
     "2-D tensors"),
    (lambda t: t.triton_add_rows(torch.ones(2, 3), torch.ones(3, 2), torch.ones(2, 3)), ValueError, "one shape"),
])
def test_unsupported_inputs_are_clear_errors(lab, call, error, words):
    with pytest.raises(error, match=words):
        call(lab)


def test_cpu_tensors_without_the_interpreter_are_refused(lab, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on a GPU"):
        lab.triton_add(torch.ones(4), torch.ones(4))


def test_rows_kernel_layouts(lab, capsys):
    graders.check_rows("triton_add_rows", lab.triton_add_rows)
    x = torch.randn(6, 3 * 40)[:, 40:80]
    assert torch.equal(lab.triton_add_rows(x, x, torch.empty(6, 40)), x + x)
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("block", [-1, 0, 3, 100, 2.0, True])
def test_rows_kernel_refuses_a_block_that_is_not_a_power_of_two(lab, block):
    x = torch.randn(5, 300)
    with pytest.raises(ValueError, match="must be a power of two"):
        lab.triton_add_rows(x, x, torch.full_like(x, 7.0), block=block)


# --- the graders --------------------------------------------------------------------------------

ADD_ALT = """start = tl.program_id(0) * BLOCK
idx = start + tl.arange(0, BLOCK)
ok = idx < n
x = tl.load(x_ptr + idx, mask=ok, other=0.0)
tl.store(out_ptr + idx, x + tl.load(y_ptr + idx, mask=ok, other=0.0), mask=ok)"""
ADD_BODY = """pid = tl.program_id(0)
offsets = pid * BLOCK + tl.arange(0, BLOCK)
mask = offsets < n
tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load({y}_ptr + offsets, mask=mask), mask=mask)"""
ROWS_BODY = """pid = tl.program_id(0)
row = pid {div} blocks_per_row
cols = (pid {mod} blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
mask = cols < n_cols
x = tl.load(x_ptr + row * {xs} + cols, mask=mask)
y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask)
tl.store(out_ptr + row * {os} + cols, x + y, mask={m})"""
ROWS = dict(div="//", mod="%", xs="x_row_stride", os="out_row_stride", m="mask")
ROWS_ALT = """pid = tl.program_id(0)
row = pid // blocks_per_row
cols = (pid - row * blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
x_ptr += row * x_row_stride
y_ptr += row * y_row_stride
out_ptr += row * out_row_stride
mask = cols < n_cols
tl.store(out_ptr + cols, tl.load(x_ptr + cols, mask=mask) + tl.load(y_ptr + cols, mask=mask), mask=mask)"""

ADD_LOADS_UNMASKED = """pid = tl.program_id(0)
offsets = pid * BLOCK + tl.arange(0, BLOCK)
mask = offsets < n
tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets), mask=mask)"""
ADD_BY_REMAINDER = """base = tl.program_id(axis=0) * BLOCK
lane = tl.arange(0, BLOCK)
live = lane < n - base
a = tl.load(x_ptr + base + lane, mask=live)
b = tl.load(y_ptr + base + lane, mask=live)
tl.store(out_ptr + base + lane, a + b, mask=live)"""
ROWS_LOADS_UNMASKED = ROWS_BODY.format(**ROWS).replace(", mask=mask)\ny", ")\ny").replace(
    "cols, mask=mask)\ntl", "cols)\ntl")

GRADER = {   # exercise -> (how to grade a loaded module, [other correct answers], [(wrong answer, words of its hint)])
    "1.2": (lambda m: graders.check_add("add", m.add, dtypes=(torch.float32, torch.float16)),
            [ADD_ALT, ADD_BY_REMAINDER,
             # issue 31: a right kernel with the stub's line left below it was reported NOT DONE
             ADD_ALT + "\npass  # exercise not done: 1.2, replace this line with your code"],
            [(ADD_BODY.format(y="y").replace(", mask=mask)", ")"), "mask the store"),
             (ADD_BODY.format(y="y").replace("pid * BLOCK + ", ""), "must start at element pid \\* BLOCK"),
             (ADD_BODY.format(y="x"), "store the sum of the loaded x and y"),
             (ADD_BODY.format(y="y").replace("offsets < n", "offsets < n - 1"), "was never written"),
             # issue 31: a kernel that masks only its store and reads past n passed (slack after the buffers)
             (ADD_LOADS_UNMASKED, "reads x\\[1\\], outside the 1 elements.*mask the loads too"),
             # issue 31: a wrong store address was told "store the sum"
             (ADD_BODY.format(y="y").replace("out_ptr + offsets", "out_ptr + offsets + 1"),
              "(?s)^(?!.*store the sum).*lands 1 element\\(s\\) late"),
             (ADD_BODY.format(y="y").replace("offsets < n", "offsets <= n"), "one past the end, was written"),
             (ADD_BODY.format(y="y").replace("out_ptr + offsets", "x_ptr + offsets"), "stored into an input"),
             (ADD_BODY.format(y="y").replace("tl.arange(0, BLOCK)", "tl.arange(0, 1000)"),
              "raised .* for x, y and out of 1 contiguous float32 elements")]),
    "1.3": (lambda m: graders.check_q_strides(m.predict_q_strides, m.gpt2_qkv),
            ["shape = (batch, seq, 3 * heads * head_dim)\n"
             "qkv = torch.empty(shape)[..., :heads * head_dim]\n"
             "return qkv.view(batch, seq, heads, head_dim).transpose(1, 2).stride()",
             "row = 3 * heads * head_dim\nreturn [seq * row, head_dim, row, 1]"],
            [("return (heads * seq * head_dim, seq * head_dim, head_dim, 1)", "strides of a contiguous"),
             ("e = heads * head_dim\nreturn (seq * e, head_dim, 3 * e, 1)", "the batch stride is off"),
             ("e = heads * head_dim\nreturn (seq * 3 * e, head_dim, 3 * e)", "returned 3 strides"),
             ("e = heads * head_dim\nprint(seq * 3 * e, head_dim, 3 * e, 1)", "return 4 integers"),
             ("e = heads * head_dim\nreturn (seq * e, head_dim, e, 1)", "3\\*E long"),
             ("e = 3 * heads * head_dim\nreturn (seq * e, e, head_dim, 1)", "before transpose")]),
    "1.4": (lambda m: graders.check_rows("triton_add_rows", m.triton_add_rows),
            [ROWS_ALT],
            [(ROWS_BODY.format(**{**ROWS, "os": "x_row_stride"}), "out's rows are out_row_stride apart"),
             (ROWS_BODY.format(**{**ROWS, "xs": "n_cols"}), "x's rows are x_row_stride apart"),
             (ROWS_BODY.format(**{**ROWS, "m": "None"}), "mask the columns"),
             (ROWS_BODY.format(**{**ROWS, "div": "%", "mod": "//"}), "was never written"),
             (ROWS_LOADS_UNMASKED, "reads elements outside x's and y's rows.*mask the loads too"),
             (ROWS_BODY.format(**{**ROWS, "os": "x_row_stride"}).replace("row * y_row_stride", "row * out_row_stride"),
              "out's rows are out_row_stride apart")]),
}


@pytest.mark.parametrize("exercise", GRADER)
def test_reference_and_other_correct_answers_pass(exercise, interpreter, capsys):
    grade, others, _ = GRADER[exercise]
    grade(interpreter())
    for answer in others:
        grade(interpreter({exercise: answer}))
    assert capsys.readouterr().out.count("PASS") == 1 + len(others)


@pytest.mark.parametrize("exercise, wrong, hint", [(e, w, h) for e, (_, _, ws) in GRADER.items() for w, h in ws])
def test_known_wrong_answers_fail_with_their_hint(exercise, wrong, hint, interpreter):
    with pytest.raises(ExerciseFailed, match=hint):
        GRADER[exercise][0](interpreter({exercise: wrong}))


# --- fresh inputs on every grade (issue 46): a table of the tried cases, or results kept across calls, fail ----------

def _torch_add(x, y, out):
    return out.copy_(x + y)


@pytest.mark.parametrize("grade", [lambda fn: graders.check_add("add", fn, sizes=(17, 97)),
                                   lambda fn: graders.check_rows("rows", fn, cases=((3, 17),)),
                                   lambda fn: graders.check_layouts("add", fn, names={"contiguous", "x[::2]"})],
                         ids=["check_add", "check_rows", "check_layouts"])
def test_every_grade_draws_fresh_inputs_and_a_kept_result_fails(grade, capsys):
    seen, kept = [], {}

    def recording(x, y, out):
        seen.append((tuple(x.shape), x.sum().item()))
        return _torch_add(x, y, out)

    first_grade = [True]

    def keeping(x, y, out):                     # results kept across calls, by shape
        key = (tuple(x.shape), x.stride())
        if first_grade[0] or key not in kept:   # one grade may meet a shape twice: right within it, stale after it
            kept[key] = (x + y).clone()
        return out.copy_(kept[key])

    grade(recording)
    first, seen[:] = list(seen), []
    grade(recording)
    # sizes drawn per grade: two grades meet more than one size (one grade may draw its fixed size again, 1 in ~300)
    assert first != seen and len({shape for shape, _ in first + seen}) > 1
    assert not any(value in {v for _, v in first} for _, value in seen if value)     # no value reused
    grade(keeping)                              # the first call computes every case it meets
    first_grade[0] = False
    with pytest.raises(ExerciseFailed, match="x \\+ y|wrong values"):
        grade(keeping)


def test_a_table_of_the_strides_tried_fails():
    table = {(2, 5, 3, 4): (180, 4, 36, 1), (1, 7, 2, 8): (336, 8, 48, 1), (3, 2, 4, 16): (384, 16, 192, 1),
             (2, 9, 12, 64): (20736, 64, 2304, 1)}
    lab = solutions.load("01")
    assert all(lab.predict_q_strides(*k) == v for k, v in table.items())
    with pytest.raises(ExerciseFailed, match="raised KeyError for batch="):
        graders.check_q_strides(lambda *shape: table[shape], lab.gpt2_qkv)


def test_layouts_fail_an_answer_that_writes_into_its_inputs():
    def scribbles(x, y, out):
        _torch_add(x, y, out)
        x.zero_()                               # out is right: the reference comes from copies made before the call
    with pytest.raises(ExerciseFailed, match="contiguous: x or y changed for contiguous"):
        graders.check_layouts("add", scribbles)


# 1.1 compiles the port: it needs hipcc (CI requires it)
needs_hipcc = pytest.mark.skipif(not isa.shutil.which("hipcc") and "hipcc" not in isa.required_tools(),
                                 reason="hipcc is not installed (apt-get install hipcc)")
LAUNCH = "saxpy<<<(n + 255) / 256, 256>>>(n, 2.0f, x, y);"
GGL = lambda port: port.replace(LAUNCH, "hipLaunchKernelGGL(saxpy, dim3((n + 255) / 256), dim3(256), 0, 0, n, 2.0f, x, y);")
PORT_WRONG = [   # (what it does to the reference port, words of the hint)
    (lambda p: p.replace("hipMalloc(&x", "cudaMalloc(&x"), "cudaMalloc is CUDA's name; HIP's is hipMalloc"),
    (lambda p: p.replace("a * x[i] + y[i]", "a * x[i]"), "saxpy computes y\\[i\\] = a \\* x\\[i\\] \\+ y\\[i\\]"),
    (lambda p: p.replace("hipMemcpy(hy.data(), y, n * sizeof(float), hipMemcpyDeviceToHost);", ""),
     "calls hipMemcpy 3 times, yours 2"),
    (lambda p: p.replace(LAUNCH, ""), "saxpy is never launched"),
    # issue 31: a copy back in the wrong direction, and a bound i <= n, passed
    (lambda p: p.replace("y, n * sizeof(float), hipMemcpyDeviceToHost", "y, n * sizeof(float), hipMemcpyHostToDevice"),
     "copies the result back the wrong way"),
    (lambda p: p.replace("if (i < n)", "if (i <= n)"), "lets i == n through \\(i <= n\\)"),
    (lambda p: p.replace("hipMemcpy(hy.data(), y,", "hipMemcpy(y, hy.data(),"), "the destination comes first"),
]
PORT_RIGHT = [   # other right ports
    lambda p: p.replace("if (i < n) y[i]", "if (i >= n) return;\n    y[i]"),
    lambda p: p.replace("hipMemcpyDeviceToHost", "hipMemcpyDefault"),
]


def _grade_port(interpreter, change):
    ref = interpreter()
    source = change(ref.saxpy_hip())
    assert source != ref.saxpy_hip() or change is _same
    module = interpreter({"1.1": f'return r"""{source}"""'})
    # ref.compile_port: one hipcc cache for all answers (hipify's port compiles once)
    graders.check_hip_port(module.saxpy_hip(), module.SAXPY_CU, ref.compile_port)


def _same(port):
    return port


@needs_hipcc
@pytest.mark.parametrize("change", [_same, GGL, *PORT_RIGHT],
                         ids=["reference", "hipLaunchKernelGGL", "early return", "hipMemcpyDefault"])
def test_hip_port_passes(change, interpreter, capsys):
    _grade_port(interpreter, change)
    out = capsys.readouterr().out
    assert "PASS: main makes every runtime call hipify's port makes" in out
    assert "PASS: saxpy, run on the CPU" in out and "its launch and its result are the CUDA program's" in out


@needs_hipcc
@pytest.mark.parametrize("change, hint", PORT_WRONG, ids=["cuda name", "kernel changed", "no copy back", "no launch", "copy back wrong way",
                                                     "i <= n", "dst and src swapped"])
def test_hip_port_wrong_answers_fail_with_their_hint(change, hint, interpreter):
    with pytest.raises(ExerciseFailed, match=hint):
        _grade_port(interpreter, change)


# what only a run sees (issue 46: a port whose copy sizes, index or launch were wrong passed hipcc's inspection): on
# any machine, with hipcc or without, the port's kernel runs on the CPU (utils.simt) on fixed awkward and fresh sizes,
# and its whole program against a model of the HIP runtime, beside hipify's port of the CUDA program
KERNEL_LINE = "int i = blockIdx.x * blockDim.x + threadIdx.x;"
PORT_WRONG_ON_CPU = [   # (what it does to the reference port, words of the hint)
    (lambda p: p.replace("hipMemcpy(x, hx.data(), n * sizeof(float)", "hipMemcpy(x, hx.data(), n"),
     "hipMemcpy\\(x, hx.data\\(\\), n, hipMemcpyHostToDevice\\) copies n = 1,048,576 bytes.*size is in bytes"),
    (lambda p: p.replace("hipMemcpy(hy.data(), y, n * sizeof(float)", "hipMemcpy(hy.data(), y, n"),
     "hipMemcpy\\(hy.data\\(\\), y, n, hipMemcpyDeviceToHost\\) copies n = 1,048,576 bytes"),
    (lambda p: p.replace("hipMalloc(&y, n * sizeof(float))", "hipMalloc(&y, n)"),
     "its destination, y, holds 1,048,576 bytes \\(hipMalloc\\(&y, n\\)\\).*size is in bytes"),
    (lambda p: p.replace(KERNEL_LINE, "int i = threadIdx.x;"),
     "several threads had the same index i: thread i of the grid is blockIdx.x \\* blockDim.x"),
    (lambda p: p.replace("if (i < n) y[i]", "y[i]"), "stored past the end of y.*if \\(i < n\\)"),
    (lambda p: p.replace(LAUNCH, "saxpy<<<n / 512, 256>>>(n, 2.0f, x, y);"),
     "524,288 threads for n = 1,048,576 elements.*\\(n \\+ 256 - 1\\) / 256 blocks"),
    (lambda p: p.replace(LAUNCH, "saxpy<<<(n + 2047) / 2048, 2048>>>(n, 2.0f, x, y);"),
     "blocks of \\(2048, 1, 1\\) threads: a block has 1 to 1024 threads"),
    (lambda p: p.replace("hipMemcpy(y, hy.data(), n * sizeof(float), hipMemcpyHostToDevice);", ""),
     "1 copy\\(ies\\) from the host to the GPU before saxpy is launched; the CUDA program makes 2"),
]
PORT_RIGHT_ON_CPU = [   # right ports written differently: sizes in a variable, y allocated first, blocks of 128 from a
    # dim3, a grid-stride loop over fewer blocks, fmaf, the launch's error read with hipGetLastError
    lambda p: p.replace("hipMalloc(&x, n * sizeof(float));\n    hipMalloc(&y, n * sizeof(float));",
                        "const size_t bytes = sizeof(float) * n;\n    hipMalloc((void**)&y, bytes);\n"
                        "    hipMalloc((void**)&x, bytes);").replace(
        LAUNCH, "dim3 block(128), grid((n + block.x - 1) / block.x);\n"
                "    saxpy<<<grid, block, 0, 0>>>(n, 2.0f, x, y);"),
    lambda p: p.replace(f"    {KERNEL_LINE}\n    if (i < n) y[i] = a * x[i] + y[i];",
                        "    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)\n"
                        "        y[i] = fmaf(a, x[i], y[i]);").replace(
        LAUNCH, GGL(LAUNCH).replace("(n + 255) / 256", "64")).replace(
        "hipError_t err = hipDeviceSynchronize();",
        "hipError_t err = hipGetLastError();\n    if (err == hipSuccess) err = hipDeviceSynchronize();"),
]


def _no_hipcc(source):
    raise isa.ToolMissing("hipcc")


@pytest.fixture
def without_hipcc(monkeypatch):
    """Grade as on a machine without hipcc: only the runs on the CPU (and the source's names and copy kinds)."""
    monkeypatch.setattr(isa, "required_tools", lambda: set())


@pytest.mark.parametrize("change, hint", PORT_WRONG_ON_CPU, ids=["copy size n", "copy back n", "hipMalloc n",
                                                                  "index threadIdx.x", "no bound", "half the grid",
                                                                  "2048 threads a block", "y never copied in"])
def test_hip_port_wrong_on_the_cpu_fails_with_its_hint(change, hint, interpreter, without_hipcc):
    ref = interpreter()
    with pytest.raises(ExerciseFailed, match=hint):
        graders.check_hip_port(change(ref.saxpy_hip()), ref.SAXPY_CU, _no_hipcc)


@pytest.mark.parametrize("change", [_same, *PORT_RIGHT_ON_CPU],
                         ids=["reference", "bytes, dim3, y first", "grid-stride"])
def test_hip_port_right_on_the_cpu_passes(change, interpreter, without_hipcc, capsys):
    ref = interpreter()
    port = change(ref.saxpy_hip())
    assert change is _same or port != ref.saxpy_hip()
    graders.check_hip_port(port, ref.SAXPY_CU, _no_hipcc)
    out = capsys.readouterr().out
    assert "PASS: saxpy, run on the CPU" in out and "its launch and its result are the CUDA program's" in out


@needs_hipcc
def test_the_lab_grades_answers_as_a_learner_runs_it(tmp_path, build_dir, interpreter):
    """The generated lab with the hipLaunchKernelGGL port for 1.1 and an unmasked store in 1.2: 1.1 passes
    and Run All stops at 1.2 with its hint."""
    port = GGL(interpreter().saxpy_hip())
    nb, error = run_lab_with("01", {"1.1": f'return r"""{port}"""', "1.2": GRADER["1.2"][2][0][0]}, tmp_path)
    assert "PASS: exercise 1.1 (port SAXPY to HIP by hand)" in stream_text(nb)
    assert error is not None and error[0] == "ExerciseFailed" and "mask the store" in error[1]
    assert [e for e, _ in errors(nb)] == ["ExerciseFailed"]


# --- on a GPU (make test-gpu): the full grids, and the hand-written kernels -----------------------

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
SIZES = [1, 17, 97, 1024, 4099, 2**20 + 3]


@pytest.fixture(scope="module")
def compiled():
    """The exported module with compiled (not interpreted) kernels."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return solutions.load("01")
    finally:
        if old is not None:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def hand(compiled):
    """The hand-written CUDA/HIP kernels and their binding, built with load_inline."""
    return compiled.build_hand_kernels()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_gpu_triton_add_full_grid(compiled, no_interpreter, n, dtype, capsys):
    graders.check_add("triton_add", compiled.triton_add, sizes=(n,), dtypes=(dtype,), device="cuda")
    graders.check_layouts("triton_add", compiled.triton_add, device="cuda", dtype=dtype, n=n)
    assert capsys.readouterr().out.count("PASS") == 1 + len(graders.layouts())


@pytest.mark.gpu
@gpu_only
def test_gpu_triton_add_past_2_31_elements(compiled, no_interpreter):
    """Offsets past 2**31: the index space itself, and a strided view whose reach passes it."""
    n = 2**31 + 5
    if torch.cuda.mem_get_info()[0] < 7 * n * 2:
        pytest.skip("needs about 30 GB of free GPU memory")
    x, y = torch.randn(n, dtype=torch.float16, device="cuda"), torch.randn(n, dtype=torch.float16, device="cuda")
    out = compiled.triton_add(x, y)
    assert torch.equal(out, x + y)
    del out
    xs, ys = x[:-1:2], y[1::2]          # n is odd: both views take (n - 1) / 2 elements, reaching past 2**31
    out = compiled.triton_add(xs, ys)
    assert torch.equal(out, xs + ys)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_rows_kernel_grid(compiled, no_interpreter, dtype, capsys):
    graders.check_rows("triton_add_rows", compiled.triton_add_rows, device="cuda", dtype=dtype,
                        cases=((1, 1), (3, 17), (5, 97), (2, 1100), (7, 33), (64, 4096), (1000, 4099), (3, 65537)))
    assert "PASS" in capsys.readouterr().out


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kernel", ["add_naive", "add_vec4"])
@pytest.mark.parametrize("n", SIZES)
def test_gpu_hand_kernels_full_grid(compiled, hand, kernel, n, capsys):
    fn = getattr(hand, kernel)
    graders.check_add(kernel, fn, block=256, sizes=(n,), device="cuda")
    graders.check_layouts(kernel, fn, device="cuda", n=n)
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    want = a + b
    assert fn(a, b, a) is not None and torch.equal(a, want)             # in place
    assert capsys.readouterr().out.count("PASS") == 1 + len(graders.layouts())


# What the hand kernels refuse, with the words of the Python check (check_add_args) or of the C++ one (`.ext`).
BAD_HAND_CALLS = [
    (lambda: [torch.ones(4, device="cuda", dtype=torch.float16)] * 3, TypeError, "float32"),
    (lambda: [torch.ones(4), torch.ones(4, device="cuda"), torch.ones(4, device="cuda")], ValueError,
     "one device|one GPU"),
    (lambda: [torch.ones(4)] * 3, ValueError, "runs on a GPU|one GPU"),
    (lambda: [torch.ones(3, 4, device="cuda"), torch.ones(4, device="cuda"), torch.ones(3, 4, device="cuda")],
     ValueError, "one shape"),
    (lambda: [torch.ones(3, 4, device="cuda"), torch.ones(3, 4, device="cuda"),
              torch.ones(1, 4, device="cuda").expand(3, 4)], ValueError, "share memory"),
    (lambda: (lambda a: [a[1:], a[1:], a[:-1]])(torch.ones(9, device="cuda")), ValueError, "overlaps"),
    (lambda: [[1.0], torch.ones(1, device="cuda"), torch.ones(1, device="cuda")], TypeError,
     "torch.Tensor|incompatible function arguments"),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("kernel", ["add_naive", "add_vec4", "ext.add_naive", "ext.add_vec4"])
@pytest.mark.parametrize("args, error, words", BAD_HAND_CALLS)
def test_gpu_hand_kernels_say_what_they_support(hand, kernel, args, error, words):
    """The Python functions build_hand_kernels returns, and the compiled module's own (`.ext`, checked in C++)."""
    fn = hand.ext if kernel.startswith("ext.") else hand
    with pytest.raises(error, match=words):
        getattr(fn, kernel.removeprefix("ext."))(*args())
    torch.cuda.synchronize()                   # nothing was launched that could fail later


MEMCHECKED = r"""
import torch
from utils import solutions
from utils.graders import lab01 as graders

hand = solutions.load("01").build_hand_kernels()          # built already by the test (the same cache)
cuda = dict(device="cuda")
bad = [lambda: [torch.ones(4, dtype=torch.float16, **cuda)] * 3,
       lambda: [torch.ones(4), torch.ones(4, **cuda), torch.ones(4, **cuda)],
       lambda: [torch.ones(3, 4, **cuda), torch.ones(4, **cuda), torch.ones(3, 4, **cuda)],
       lambda: [torch.ones(4, **cuda), torch.ones(3, 4, **cuda), torch.ones(4, **cuda)],
       lambda: [torch.ones(3, 4, **cuda), torch.ones(3, 4, **cuda), torch.ones(1, 4, **cuda).expand(3, 4)],
       lambda: (lambda a: [a[1:], a[1:], a[:-1]])(torch.ones(9, **cuda)),
       lambda: (lambda a: [a[:-1], a[:-1], a[1:]])(torch.ones(9, **cuda))]
refused = 0
for name in ("add_naive", "add_vec4"):
    for fn in (getattr(hand, name), getattr(hand.ext, name)):
        graders.check_add(name, fn, block=256, sizes=(1, 3, 17, 1027, 4099), device="cuda")
        graders.check_layouts(name, fn, device="cuda", n=33)
        for n, start in ((1027, 0), (1027, 1), (8, 3)):          # in place; starts off 16-byte alignment
            a, b = torch.randn(n + start, **cuda)[start:], torch.randn(n + start, **cuda)[start:]
            want = a + b
            assert fn(a, b, a).data_ptr() == a.data_ptr() and torch.equal(a, want)
        for args in bad:
            try:
                fn(*args())
            except (TypeError, ValueError):
                refused += 1
            else:
                raise AssertionError(f"{name} took a bad call")
torch.cuda.synchronize()
print(f"memcheck: lab 01's hand kernels ran on every layout; {refused} bad calls refused")
"""


@pytest.mark.gpu
@gpu_only
def test_gpu_hand_kernels_under_compute_sanitizer(hand, tmp_path):
    """Small sizes, every layout, in place, misaligned starts and the bad calls, under memcheck: no access outside
    an allocation, no launch on what the checks refuse."""
    print(run_under_memcheck(MEMCHECKED, tmp_path).strip().splitlines()[-2:])
