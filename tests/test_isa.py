"""utils.isa: hipify, the vendors' compilers and Triton's ahead-of-time compiler, with no GPU.

The compilers are optional on a learner's machine (a printed skip), but CI installs hipcc and
sets COURSE_REQUIRE_TOOLS=hipcc,nvcc, so there these tests cannot skip."""
import pytest

from utils import isa

CUDA = r"""
#include <cuda_runtime.h>
__global__ void vector_add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
int main() {
    float* a;
    cudaMalloc(&a, 1024);
    vector_add<<<4, 256>>>(a, a, a, 1024);
    cudaDeviceSynchronize();
    cudaFree(a);
    return 0;
}
"""


def need(tool):
    try:
        return isa.find_tool(tool)
    except isa.ToolMissing:
        if tool in isa.required_tools():
            pytest.fail(f"{tool} is required here (COURSE_REQUIRE_TOOLS) but not installed")
        pytest.skip(f"{tool} is not installed; install: {isa.install_hint(tool)}")


def test_hipify_translates_the_runtime_and_keeps_the_kernel():
    hip = isa.hipify(CUDA)
    assert "#include <hip/hip_runtime.h>" in hip and "hipMalloc(&a, 1024)" in hip
    assert "hipLaunchKernelGGL(( vector_add), dim3(4), dim3(256), 0, 0, a, a, a, 1024)" in hip
    assert "cuda" not in hip.replace("hip/hip_runtime", "")
    assert "if (i < n) c[i] = a[i] + b[i];" in hip and not hip.startswith("// !!!")


def test_side_by_side_lists_changed_lines():
    diff = isa.side_by_side(CUDA, isa.hipify(CUDA))
    pairs = diff.changed_lines()
    assert ("    cudaFree(a);", "    hipFree(a);") in pairs
    assert all("__global__" not in left for left, _ in pairs)
    assert "diff_chg" in diff._repr_html_() and "-    cudaFree(a);" in str(diff)


def test_hipified_source_compiles_for_cdna_wave64_and_rdna3_wave32():
    need("hipcc")
    hip = isa.hipify(CUDA)
    cdna = isa.compile_hip(hip, "gfx90a")
    assert cdna.count(r"v_add_f32") >= 1 and cdna.count("global_load_dword") >= 2
    assert ".wavefront_size: 64" in cdna.text and "s_and_saveexec_b64" in cdna.text
    assert cdna.command.startswith("HIP_PLATFORM=amd hipcc --offload-arch=gfx90a")
    rdna = isa.compile_hip(hip, "gfx1100")
    assert ".wavefront_size: 32" in rdna.text and "exec_lo" in rdna.text


def test_hip_compile_errors_are_reported():
    need("hipcc")
    with pytest.raises(isa.CompileError, match="failed"):
        isa.compile_hip("__global__ void broken( {", "gfx90a")


def test_ptx_and_sass_for_sm90():
    need("nvcc")
    ptx = isa.compile_cuda(CUDA, "sm_90", "ptx")
    assert ptx.count(r"add\.f32") == 1 and ptx.count(r"ld\.global") == 2 and ".target sm_90" in ptx.text
    sass = isa.compile_cuda(CUDA, "sm_90", "sass")
    assert sass.count(r"FADD") >= 1 and sass.count(r"LDG") == 2


def test_triton_ahead_of_time_for_both_vendors(tmp_path):
    import importlib.util
    import sys

    # Triton reads a kernel's source from its file, so the kernel lives in a module of its own.
    (tmp_path / "aot_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    mask = offs < n\n"
        "    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)\n")
    spec = importlib.util.spec_from_file_location("aot_kernel", tmp_path / "aot_kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["aot_kernel"] = module
    spec.loader.exec_module(module)
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    amd = isa.compile_triton(module.add_kernel, sig, "gfx942", constexprs={"BLOCK": 1024},
                             aligned=("x_ptr", "y_ptr", "out_ptr", "n"))
    assert amd["amdgcn"].count("global_load_dwordx4") >= 2 and ".wavefront_size: 64" in amd["amdgcn"].text
    assert "threads-per-warp\" = 64" in amd["ttgir"].text
    nv = isa.compile_triton(module.add_kernel, sig, "sm_90", constexprs={"BLOCK": 1024})
    assert nv["ptx"].count(r"add\.f32") >= 1 and ".target sm_90" in nv["ptx"].text
    assert nv["ptx"].count(r"ld\.global\.v4") == 0, "without the alignment promise the loads stay scalar"
    with pytest.raises(ValueError, match="unknown target"):
        isa.compile_triton(module.add_kernel, sig, "gfx9000")


def test_missing_tool_is_a_skip_line_unless_required(monkeypatch, capsys):
    def needs_a_compiler():
        raise isa.ToolMissing("hipcc")

    monkeypatch.setenv("COURSE_REQUIRE_TOOLS", "nvcc")
    assert isa.or_skip(needs_a_compiler) is None
    out = capsys.readouterr().out
    assert out.startswith("SKIP: hipcc is not installed; install: sudo apt-get install hipcc")
    monkeypatch.setenv("COURSE_REQUIRE_TOOLS", "nvcc, hipcc")
    with pytest.raises(isa.ToolMissing):
        isa.or_skip(needs_a_compiler)


def test_find_tool(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("ROCM_PATH", raising=False)
    assert isa.find_tool("cuobjdump").endswith("triton/backends/nvidia/bin/cuobjdump")  # bundled with Triton
    with pytest.raises(isa.ToolMissing, match="no-such-compiler is not installed"):
        isa.find_tool("no-such-compiler")


BRANCHY = r"""
#include <hip/hip_runtime.h>
__global__ void branchy(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        if (threadIdx.x % 2) x[i] = x[i] * 2.0f; else x[i] = x[i] * x[i] + 1.0f;
    }
}
"""


def test_exec_masks_are_64_bit_on_cdna_and_32_bit_on_rdna3():
    need("hipcc")
    cdna, rdna = isa.compile_hip(BRANCHY, "gfx90a"), isa.compile_hip(BRANCHY, "gfx1100")
    assert cdna.count(r"s_and_saveexec_b64") > 0 and cdna.count(r"\bvcc\b") > 0 and cdna.count("vcc_lo") == 0
    assert rdna.count(r"exec_lo") > 0 and rdna.count("vcc_lo") > 0
    assert rdna.count(r"_b64\s+\S+,\s*exec\b|saveexec_b64") == 0 and rdna.count(r"\bvcc\b") == 0
    (meta,) = cdna.kernels().values()
    assert meta["wavefront_size"] == 64 and meta["vgprs"] > 0 and meta["occupancy"] == 8
    assert list(cdna.kernels()) == ["branchy"]          # demangled from _Z7branchyPfi


def test_cuda_registers_per_kernel():
    need("nvcc")
    regs = isa.cuda_registers(BRANCHY.replace("hip/hip_runtime.h", "cuda_runtime.h") + CUDA.split("int main")[0], "sm_90")
    assert set(regs) == {"branchy", "vector_add"}
    assert all(0 < r["registers"] <= 255 and r["spill_bytes"] == 0 for r in regs.values())


def test_compile_triton_many_returns_each_build_or_its_refusal(tmp_path, monkeypatch):
    """One child process under the interpreter; a target that refuses an option is that job's CompileError."""
    import importlib.util
    import sys

    (tmp_path / "aot_dot.py").write_text(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def dot_kernel(a_ptr, c_ptr, P: tl.constexpr):\n"
        "    o = tl.arange(0, 16)\n"
        "    a = tl.load(a_ptr + o[:, None] * 16 + o[None, :])\n"
        "    tl.store(c_ptr + o[:, None] * 16 + o[None, :], tl.dot(a, a, input_precision=P))\n")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("aot_dot", tmp_path / "aot_dot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["aot_dot"] = module
    spec.loader.exec_module(module)
    sig = {"a_ptr": "*fp32", "c_ptr": "*fp32"}
    jobs = [dict(signature=sig, target=t, constexprs={"P": p}) for t, p in (("gfx942", "tf32"), ("gfx90a", "tf32"), ("sm_90", "ieee"))]
    xf32, refused, ieee = isa.compile_triton_many(module.dot_kernel, jobs)
    assert xf32["amdgcn"].count(r"v_mfma_f32_\w+_xf32") > 0
    assert isinstance(refused, isa.CompileError) and "input_precision must be one of" in str(refused)
    assert ieee["ptx"].count(r"fma\.rn\.f32") > 0 and "mma" not in ieee["ptx"].text
    with pytest.raises(isa.CompileError, match="input_precision"):
        isa.compile_triton(module.dot_kernel, sig, "gfx90a", constexprs={"P": "tf32"})
