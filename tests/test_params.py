"""utils.params: bad notebook parameters stop with one clear line."""
import dataclasses

import pytest

from utils import device as devices
from utils import backend, params
from utils.params import ParameterError

CPU = devices.cpu_info()


def gpu(recorded):
    r = recorded["h100"]
    return devices.from_properties(r["properties"], cuda=r["cuda"])


@pytest.mark.parametrize("value", [0, -3, 1.5, "10", True, None, [4]])
def test_positive_int_rejects(value):
    with pytest.raises(ParameterError, match=r"^N=.* must be a positive whole number"):
        params.positive_int("N", value)


def test_positive_int_accepts_whole_floats():
    assert params.positive_int("N", 1e6) == 1_000_000 and params.positive_int("N", 7) == 7


def test_size_defaults_by_device(recorded):
    assert params.size("N", None, device=CPU, cpu=256, gpu=8192) == 256
    assert params.size("N", None, device=gpu(recorded), cpu=256, gpu=8192) == 8192
    assert params.size("N", 1024, device=CPU, cpu=256, gpu=8192) == 1024


def no_gpu_runtime(monkeypatch):
    """As on a machine with no CUDA/ROCm runtime: a recorded GPU's free memory is unknown, its total stands in."""
    def unavailable(self):
        raise RuntimeError("no GPU runtime in this process")
    monkeypatch.setattr(backend.Backend, "free_memory_bytes", unavailable)


def test_size_that_does_not_fit_names_the_parameter_and_a_size_that_does(recorded, monkeypatch):
    no_gpu_runtime(monkeypatch)
    h100 = gpu(recorded)
    with pytest.raises(ParameterError) as err:
        params.size("ADD_N", 2**34, device=h100, cpu=1, gpu=1, bytes_needed=lambda n: 3 * n * 4)
    msg = str(err.value)
    assert msg.startswith(f"ADD_N=17179869184 needs 192.0 GiB but NVIDIA H100 80GB HBM3 has "
                          f"{h100.memory_bytes / 2**30:.1f} GiB")
    suggested = int(msg.rsplit("ADD_N=", 1)[1].split()[0])
    assert 3 * suggested * 4 <= params.MEMORY_BUDGET * h100.memory_bytes
    params.size("ADD_N", suggested, device=h100, cpu=1, gpu=1, bytes_needed=lambda n: 3 * n * 4)


def test_size_uses_free_memory_on_cpu(monkeypatch):
    monkeypatch.setattr(params, "available_memory_bytes", lambda device: 1 << 30)
    with pytest.raises(ParameterError, match="needs 3.0 GiB"):
        params.size("N", 1 << 28, device=CPU, cpu=1, gpu=1, bytes_needed=lambda n: 12 * n)


def test_unknown_memory_is_not_checked(monkeypatch):
    no_gpu_runtime(monkeypatch)
    unknown = dataclasses.replace(CPU, backend="cuda", memory_bytes=None)
    assert params.size("N", 10**12, device=unknown, cpu=1, gpu=1, bytes_needed=lambda n: n) == 10**12


def test_choice():
    assert params.choice("MODE", "Fast", ["fast", "slow"]) == "fast"
    with pytest.raises(ParameterError, match=r"MODE='medium' is not allowed; use one of 'fast', 'slow'"):
        params.choice("MODE", "medium", ["fast", "slow"])


def test_parameter_error_renders_as_one_line_in_ipython():
    err = ParameterError("N=0 must be a positive whole number (> 0)")
    assert err._render_traceback_() == ["ParameterError: N=0 must be a positive whole number (> 0)"]


@pytest.mark.parametrize("value", [-1, "5", True, None])
def test_non_negative_rejects(value):
    with pytest.raises(ParameterError, match=r"^W=.* must be a number >= 0$"):
        params.non_negative("W", value)


def test_non_negative_accepts():
    assert params.non_negative("W", 0) == 0.0 and params.non_negative("W", 2.5) == 2.5
