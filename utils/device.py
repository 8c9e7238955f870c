"""Which device the course runs on: ROCm, CUDA or the CPU, and what its published peaks are.

`detect()` looks at the machine; `from_properties()` builds the same record from a device-properties
object (PyTorch's, or a plain mapping with the same names), which is how the tests cover GPUs this
machine does not have. Nothing here assumes a warp size: it is read from the properties.
A CPU has no data-sheet peaks here: `measure_cpu_ceilings()` measures its ceilings instead (lab 00).
"""
from __future__ import annotations

import html
import os
import platform as host
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

from utils import backend
from utils.base.paths import DATA_DIR
from utils.params import ParameterError, choice
from utils.timing import benchmark

SPECS_FILE = DATA_DIR / "gpu_specs.toml"
DEVICE_CHOICES = backend.DEVICE_CHOICES


@dataclass(frozen=True)
class DeviceInfo:
    backend: str                      # "rocm" | "cuda" | "cpu"
    vendor: str                       # "AMD" | "NVIDIA" | the CPU's vendor
    name: str
    arch: str                         # "gfx942", "gfx1100", "sm_90", "cpu"
    warp_size: int | None             # lanes per wavefront / warp; None on a CPU
    compute_units: int | None         # CUs (AMD), SMs (NVIDIA), cores (CPU)
    memory_bytes: int | None
    l2_bytes: int | None = None
    peak_bandwidth_gbps: float | None = None
    peak_bf16_tflops: float | None = None
    peak_fp32_tflops: float | None = None
    peak_fp8_tflops: float | None = None   # dense FP8 on the matrix units, where the data sheet states it
    spec: str | None = None           # the spec-table row the peaks come from
    runtime: str | None = None        # "HIP 6.4.x" / "CUDA 13.0"
    notes: tuple[str, ...] = field(default_factory=tuple)
    measured: bool = False            # the peaks were measured on this machine (a CPU), not published

    @property
    def platform(self) -> backend.Backend:
        """The backend's record: its words, its PyTorch module, its compiler (utils.backend)."""
        return backend.get(self.backend)

    @property
    def is_gpu(self) -> bool:
        return self.platform.is_gpu

    @property
    def torch_device(self) -> str:
        """The device string for PyTorch: ROCm builds of PyTorch also call the GPU "cuda"."""
        return self.platform.torch_device

    @property
    def unit_name(self) -> str:
        return self.platform.unit

    @property
    def lane_group(self) -> str:
        return self.platform.lane_group

    def _fields(self) -> list[tuple[str, str]]:
        def num(v, fmt):
            return "unknown" if v is None else fmt.format(v)

        def peak(label, v, fmt):   # a measured ceiling says so, in its label
            return ("ceiling: " + label.removeprefix("peak ") if self.measured and v is not None else label), num(v, fmt)
        return [
            ("device", self.name),
            ("backend", f"{self.backend} ({self.runtime})" if self.runtime else self.backend),
            ("architecture", self.arch),
            (f"{self.lane_group} size", num(self.warp_size, "{} lanes")),
            (self.unit_name, num(self.compute_units, "{}")),
            ("memory", num(self.memory_bytes and self.memory_bytes / 2**30, "{:.1f} GiB")),
            peak("peak bandwidth", self.peak_bandwidth_gbps, "{:,.4g} GB/s"),
            peak("peak BF16 (dense)", self.peak_bf16_tflops, "{:,.4g} TFLOP/s"),
            peak("peak FP32", self.peak_fp32_tflops, "{:,.4g} TFLOP/s"),
        ]

    def __str__(self) -> str:
        lines = [f"{k:>18}: {v}" for k, v in self._fields()]
        lines += [f"{'note':>18}: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                       f"{html.escape(v)}</td></tr>" for k, v in self._fields())
        notes = "".join(f"<p><b>Note:</b> {html.escape(n)}</p>" for n in self.notes)
        return f"<table>{rows}</table>{notes}"


@lru_cache(maxsize=1)
def spec_table() -> tuple[dict[str, Any], ...]:
    with SPECS_FILE.open("rb") as f:
        return tuple(tomllib.load(f)["gpu"])


def spec(key: str) -> dict[str, Any]:
    """One row of the spec table by its key ("mi300x", "h100_sxm", ...)."""
    for row in spec_table():
        if row["key"] == key:
            return row
    raise KeyError(f"no GPU {key!r} in {SPECS_FILE.name}; known: {[r['key'] for r in spec_table()]}")


def find_spec(name: str, arch: str) -> dict[str, Any] | None:
    for row in spec_table():
        if row["arch"] == arch and any(re.search(p, name, re.IGNORECASE) for p in row["match"]):
            return row
    return None


def _get(props: Any, key: str, default=None):
    if isinstance(props, Mapping):
        return props.get(key, default)
    return getattr(props, key, default)


def from_properties(props: Any, *, hip: str | None = None, cuda: str | None = None) -> DeviceInfo:
    """Build a `DeviceInfo` from `torch.cuda.get_device_properties(i)` or a mapping of the same names.

    `hip` / `cuda` are `torch.version.hip` / `torch.version.cuda`; with neither, a `gcnArchName`
    that starts with "gfx" means ROCm."""
    name = str(_get(props, "name", "unknown GPU"))
    given = {"hip": hip, "cuda": cuda}
    plat = backend.of_torch_build(**given)
    if not plat.is_gpu:                  # no version given: the properties tell
        plat = next((b for b in backend.GPUS if b.arch_property
                     and str(_get(props, b.arch_property) or "").startswith(b.arch_prefix)), backend.CUDA)
    notes: list[str] = []
    arch = plat.arch_of(props)
    version = given.get(plat.torch_version)
    runtime = f"{plat.runtime} {version}" if version else None
    warp = _get(props, "warp_size")
    if warp is None:
        notes.append("this PyTorch does not report warp_size; the wavefront/warp size is unknown "
                     "(it is not assumed: 64 on CDNA, 32 on RDNA by default and on NVIDIA)")
    row = find_spec(name, arch)
    if row is None:
        notes.append(f"no published peaks for {name!r} ({arch}) in utils/data/{SPECS_FILE.name}: "
                     "ratios against peak are left out; add a row with its data-sheet figures")
    return DeviceInfo(
        backend=plat.name, vendor=plat.vendor, name=name, arch=arch,
        warp_size=None if warp is None else int(warp),
        compute_units=_get(props, "multi_processor_count"),
        memory_bytes=_get(props, "total_memory"),
        l2_bytes=_get(props, "L2_cache_size"),
        peak_bandwidth_gbps=row and row["peak_bandwidth_gbps"],
        peak_bf16_tflops=row and row["peak_bf16_tflops"],
        peak_fp32_tflops=row and row["peak_fp32_tflops"],
        peak_fp8_tflops=row and row.get("peak_fp8_tflops"),
        spec=row and row["key"],
        runtime=runtime,
        notes=tuple(notes),
    )


def cpu_info() -> DeviceInfo:
    name = host.processor() or host.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = None
    vendor = "AMD" if "AMD" in name.upper() else "Intel" if "INTEL" in name.upper() else host.machine()
    return DeviceInfo(
        backend="cpu", vendor=vendor, name=name, arch="cpu", warp_size=None,
        compute_units=os.cpu_count(), memory_bytes=memory,
        notes=("CPU: no published peaks in the spec table (lab 00 measures this machine's ceilings); the labs "
               "run small sizes, Triton kernels under TRITON_INTERPRET=1",),
    )


def cpu_simd_lanes() -> tuple[str, int] | None:
    """The widest fp32 SIMD this x86 CPU reports in /proc/cpuinfo, as (name, fp32 lanes); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line.split(":", 1)[1].split() for line in f if line.startswith("flags")))
    except (OSError, StopIteration):
        return None
    for flag, name, lanes in (("avx512f", "AVX-512", 16), ("avx2", "AVX2", 8), ("avx", "AVX", 8), ("sse2", "SSE2", 4)):
        if flag in flags:
            return name, lanes
    return None


def measure_cpu_ceilings(info: DeviceInfo, *, copy_mib: int | None = None, matmul_n: int = 1024,
                         reps: int = 3) -> DeviceInfo:
    """A CPU's ceilings, measured, since no data sheet gives them here: memory bandwidth as the best of
    `reps` copies of `copy_mib` MiB (default: 64 MiB or 4x the last-level cache; read and written, so 2x the bytes,
    as STREAM counts a copy), the fp32 rate as the best of `reps` `torch.matmul` of `matmul_n`³ float32 on
    PyTorch's threads. Returns `info` with `peak_bandwidth_gbps` and `peak_fp32_tflops` set, `measured`
    True and a note saying how they were obtained. These are what software reaches here, a practical
    ceiling: the hardware's own peak (cores x SIMD lanes x 2 for FMA x FMA units x clock) needs a clock and
    unit count the OS does not report. A GPU's `info` is returned unchanged: its peaks are published."""
    if info.is_gpu:
        return info
    import dataclasses

    import torch

    if copy_mib is None:
        try:
            llc = os.sysconf("SC_LEVEL3_CACHE_SIZE") or 0
        except (ValueError, OSError, AttributeError):
            llc = 0
        copy_mib = max(64, 4 * llc // 2**20)
    nbytes = copy_mib * 2**20
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    copy = benchmark(lambda: dst.copy_(src), warmup=1, reps=reps, flush_l2=False, device="cpu")
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    mm = benchmark(lambda: torch.matmul(a, b), warmup=1, reps=reps, flush_l2=False, device="cpu")
    gbps = 2 * nbytes / (copy.min_ms / 1e3) / 1e9
    tflops = 2 * matmul_n**3 / (mm.min_ms / 1e3) / 1e12
    simd = cpu_simd_lanes()
    how = (f"ceilings measured on this machine with {torch.get_num_threads()} thread(s): bandwidth = best of {reps} "
           f"copies of {nbytes / 2**20:,.0f} MiB (2 x the bytes: read and written); FP32 = best of {reps} torch.matmul "
           f"{matmul_n}³ float32" + (f"; {info.compute_units} cores with {simd[0]} ({simd[1]} fp32 lanes each)"
                                      if simd else ""))
    return dataclasses.replace(info, peak_bandwidth_gbps=gbps, peak_fp32_tflops=tflops, measured=True,
                               notes=(how,))


def detect(device: str = "auto") -> DeviceInfo:
    """The device the notebooks run on.

    `device` is a notebook's DEVICE parameter: "auto" (the default) uses the COURSE_DEVICE
    environment variable if set, else the GPU PyTorch sees, else the CPU. "cpu" forces the CPU on a
    GPU machine; "gpu" insists on a GPU, "cuda" and "rocm" (a backend's name) on one of that kind."""
    wanted = choice("DEVICE", device, DEVICE_CHOICES)
    if wanted == "auto":
        wanted = choice("COURSE_DEVICE (environment)", os.environ.get("COURSE_DEVICE") or "auto",
                        DEVICE_CHOICES)
    if wanted == "cpu":
        return cpu_info()
    import torch

    plat = backend.this_torch_build()
    if not plat.available():
        if wanted == "auto":
            return cpu_info()
        raise ParameterError(f"DEVICE={device!r} (resolved to {wanted!r}) but PyTorch sees no GPU "
                             f"(torch {torch.__version__}); use 'auto' or 'cpu', or install a "
                             "CUDA/ROCm build of PyTorch (README: environments)")
    info = from_properties(plat.module().get_device_properties(0), **backend.versions())
    if wanted not in ("auto", "gpu") and info.backend != wanted:
        raise ParameterError(f"DEVICE={wanted!r} but this machine's GPU is {info.name} "
                             f"({info.backend}); use 'auto', 'gpu' or {info.backend!r}")
    return info
