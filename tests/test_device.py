"""utils.device: detection on ROCm, CUDA and CPU, from recorded properties and a mocked torch."""
import re
from types import SimpleNamespace

import pytest
import torch

from utils import backend, device as devices
from utils.params import ParameterError


def info(recorded, key, as_object=False):
    r = recorded[key]
    props = SimpleNamespace(**r["properties"]) if as_object else r["properties"]
    return devices.from_properties(props, hip=r["hip"], cuda=r["cuda"])


@pytest.mark.parametrize("as_object", [False, True], ids=["mapping", "properties-object"])
def test_mi300x_is_rocm_gfx942_wave64(recorded, as_object):
    d = info(recorded, "mi300x", as_object)
    assert (d.backend, d.vendor, d.arch, d.warp_size) == ("rocm", "AMD", "gfx942", 64)
    assert d.compute_units == 304 and d.unit_name == "CUs" and d.lane_group == "wavefront"
    assert (d.peak_bf16_tflops, d.peak_bandwidth_gbps, d.spec) == (1307.4, 5300, "mi300x")
    assert d.is_gpu and d.torch_device == "cuda"
    assert d.runtime.startswith("HIP 6.4")
    assert "wavefront size: 64 lanes" in str(d)


def test_rx7900xtx_is_rdna3_wave32(recorded):
    d = info(recorded, "rx7900xtx")
    assert (d.backend, d.arch, d.warp_size, d.spec) == ("rocm", "gfx1100", 32, "rx7900xtx")
    assert d.peak_bf16_tflops == 122.8 and d.peak_bandwidth_gbps == 960


def test_h100_is_cuda_sm90_warp32(recorded):
    d = info(recorded, "h100")
    assert (d.backend, d.vendor, d.arch, d.warp_size) == ("cuda", "NVIDIA", "sm_90", 32)
    assert d.compute_units == 132 and d.unit_name == "SMs"
    # dense BF16, not the 1979 TFLOP/s "with sparsity" figure
    assert (d.peak_bf16_tflops, d.peak_bandwidth_gbps, d.spec) == (989.4, 3350, "h100_sxm")
    assert d.runtime == "CUDA 13.0" and not d.notes


def test_backend_inferred_without_versions(recorded):
    rocm = devices.from_properties(recorded["mi300x"]["properties"])
    cuda = devices.from_properties(recorded["h100"]["properties"])
    assert (rocm.backend, rocm.arch) == ("rocm", "gfx942")
    assert (cuda.backend, cuda.arch) == ("cuda", "sm_90")


def test_warp_size_comes_from_the_properties_not_the_vendor(recorded):
    props = dict(recorded["mi300x"]["properties"], warp_size=32)   # e.g. a wave32 mode
    assert devices.from_properties(props, hip="6.4").warp_size == 32
    props.pop("warp_size")
    d = devices.from_properties(props, hip="6.4")
    assert d.warp_size is None
    assert any("warp_size" in n for n in d.notes)


def test_unknown_gpu_gets_no_peaks_and_a_note(recorded):
    d = info(recorded, "mi100_unknown")
    assert (d.backend, d.arch, d.warp_size) == ("rocm", "gfx908", 64)
    assert d.peak_bf16_tflops is d.peak_bandwidth_gbps is d.peak_fp32_tflops is d.spec is None
    assert any("no published peaks" in n and "MI100" in n for n in d.notes)
    assert "unknown" in str(d) and "<table>" in d._repr_html_()


@pytest.mark.parametrize("raw, arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx90a:sramecc-:xnack+", "gfx90a"),
                                       ("gfx1100", "gfx1100")])
def test_parse_gcn_arch(raw, arch):
    assert backend.ROCM.arch_of({"gcnArchName": raw}) == arch


def test_name_alone_does_not_match_another_arch(recorded):
    # An "MI300X" name with a gfx90a architecture is not the MI300X row.
    props = dict(recorded["mi300x"]["properties"], gcnArchName="gfx90a")
    assert devices.from_properties(props, hip="6.4").spec is None


def test_spec_table_is_complete_and_sourced():
    text = devices.SPECS_FILE.read_text()
    rows = devices.spec_table()
    keys = {r["key"] for r in rows}
    assert {"mi300x", "mi325x", "mi250x", "mi210", "rx7900xtx", "h100_sxm", "h100_pcie", "h200",
            "a100_80gb", "rtx4090", "l40s"} <= keys
    blocks = text.split("[[gpu]]")[1:]
    preceding = text.split("[[gpu]]")[:-1]
    assert len(blocks) == len(rows)
    for before, row in zip(preceding, rows):
        assert "# Source:" in before.split("\n\n")[-1], f"row {row['key']} has no source comment above it"
        for field in ("name", "vendor", "arch", "warp_size", "match", "peak_bf16_tflops", "peak_fp32_tflops",
                      "peak_bandwidth_gbps", "memory_gb", "compute_units"):
            assert field in row, f"{row['key']} lacks {field}"
        assert re.fullmatch(r"gfx\d+[a-z]?|sm_\d+", row["arch"])
        assert row["peak_bf16_tflops"] > row["peak_fp32_tflops"] > 0


def test_cpu_info():
    d = devices.cpu_info()
    assert (d.backend, d.arch, d.warp_size, d.is_gpu, d.torch_device) == ("cpu", "cpu", None, False, "cpu")
    assert d.compute_units >= 1 and d.peak_bandwidth_gbps is None


@pytest.fixture
def fake_gpu(monkeypatch, recorded):
    """Make torch look like a ROCm build that sees an MI300X."""
    r = recorded["mi300x"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(**r["properties"]))
    monkeypatch.setattr(torch.version, "hip", r["hip"])
    monkeypatch.setattr(torch.version, "cuda", None)


def test_detect_sees_a_rocm_gpu(fake_gpu, monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    d = devices.detect()
    assert (d.backend, d.arch, d.warp_size) == ("rocm", "gfx942", 64)
    assert devices.detect("rocm").backend == devices.detect("gpu").backend == "rocm"


def test_course_device_cpu_forces_the_cpu_on_a_gpu_machine(fake_gpu, monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert devices.detect().backend == "cpu"
    monkeypatch.delenv("COURSE_DEVICE")
    assert devices.detect("cpu").backend == "cpu"


def test_wrong_gpu_kind_is_a_parameter_error(fake_gpu):
    with pytest.raises(ParameterError, match=r"DEVICE='cuda' but this machine's GPU is AMD Instinct MI300X"):
        devices.detect("cuda")


def test_gpu_requested_without_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    assert devices.detect().backend == "cpu"
    with pytest.raises(ParameterError, match="PyTorch sees no GPU"):
        devices.detect("gpu")


@pytest.mark.parametrize("bad", ["tpu", "", 3, None])
def test_unknown_device_name(bad, monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    with pytest.raises(ParameterError, match=r"DEVICE=.* is not allowed; use one of 'auto', 'cpu'"):
        devices.detect(bad)


def test_bad_course_device_environment(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "h100")
    with pytest.raises(ParameterError, match="COURSE_DEVICE"):
        devices.detect()
