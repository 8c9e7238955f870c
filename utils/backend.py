"""A GPU vendor's stack as one record: its words, its PyTorch device module, its compiler and targets.

The course asks a `Backend` instead of comparing "rocm" and "cuda" in every module:

    plat = backend.get(dev.backend)          # or dev.platform
    plat.lane_group, plat.unit               # "wavefront", "CUs" (ROCm) / "warp", "SMs" (CUDA)
    plat.synchronize(); plat.event()         # torch.cuda on both (ROCm builds of PyTorch call it cuda too)
    plat.free_memory_bytes()                 # what the allocator could still hand out

Adding a vendor (docs/authoring.md): one record here (with its Triton targets), its GPUs' rows in
utils/data/gpu_specs.toml, a verdict in utils.clinic.doctor, a topology parser in utils.multigpu.topology.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    name: str                     # "rocm" | "cuda" | "cpu": DeviceInfo.backend, DEVICE="rocm"
    vendor: str                   # "AMD" | "NVIDIA" | "" (a CPU's vendor is read from the CPU)
    runtime: str                  # "HIP" | "CUDA": what torch.version names it after
    lane_group: str               # the lanes that run in lock-step: "wavefront" | "warp"
    unit: str                     # the compute unit, plural: "CUs" | "SMs" | "cores"
    arch_prefix: str = ""         # what its architecture names start with: "gfx" | "sm_"
    # the device property that names the architecture ("gcnArchName": "gfx942:sramecc+:xnack-"); empty: the
    # compute capability (major, minor) -> arch_prefix + "90"
    arch_property: str = ""
    torch_version: str = ""       # torch.version.<this> is set in a PyTorch built for it: "hip" | "cuda"
    torch_module: str = ""        # torch.<module> that drives it: "cuda" for ROCm too; "" on the CPU
    compiler: str | None = None   # the C++ compiler of its kernel language: "hipcc" | "nvcc"
    source_suffix: str = ""       # ".hip" | ".cu"
    compiler_env: dict = field(default_factory=dict)   # e.g. HIP_PLATFORM=amd (Debian's hipcc picks nvcc otherwise)
    triton_backend: str = ""      # Triton's GPUTarget backend: "hip" | "cuda"
    # Triton targets the course compiles for ahead of time: name -> (arch as GPUTarget wants it, lanes)
    triton_targets: dict = field(default_factory=dict)
    # the FP8 dialect each architecture's matrix units take: "ocp" (OCP's e4m3fn / e5m2) or "fnuz" (e4m3fnuz /
    # e5m2fnuz: finite, no negative zero); an architecture not named has no FP8 matrix units (utils.fp8)
    fp8_dialects: dict = field(default_factory=dict)
    topology_commands: tuple = ()  # commands that print how its GPUs are connected (utils.multigpu.topology)
    install_torch: str = ""       # how to get a PyTorch built for it (utils.clinic.doctor's advice)

    @property
    def is_gpu(self) -> bool:
        return bool(self.torch_module)

    @property
    def torch_device(self) -> str:
        """The device string PyTorch uses for it ("cuda" on ROCm too)."""
        return self.torch_module or "cpu"

    def module(self):
        """torch.cuda (or another vendor's module); None on the CPU."""
        if not self.is_gpu:
            return None
        import torch

        return getattr(torch, self.torch_module)

    def arch_of(self, props) -> str:
        """The architecture name ("gfx942", "sm_90") from device properties (PyTorch's, or a mapping)."""
        get = props.get if isinstance(props, Mapping) else lambda key, default=None: getattr(props, key, default)
        if self.arch_property:
            value = str(get(self.arch_property, "") or "")
            if not value.startswith(self.arch_prefix):
                raise ValueError(f"{self.runtime} device {get('name', '?')!r} reports no {self.arch_prefix} "
                                 f"architecture ({self.arch_property}={value!r})")
            return value.split(":", 1)[0].strip()
        major, minor = get("major"), get("minor")
        if major is None or minor is None:
            raise ValueError(f"{self.runtime} device {get('name', '?')!r} reports no compute capability (major/minor)")
        return f"{self.arch_prefix}{major}{minor}"

    def available(self) -> bool:
        mod = self.module()
        return bool(mod and mod.is_available())

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU)."""
        if self.is_gpu:
            self.module().synchronize()

    def event(self):
        """A timing event on the device's current stream."""
        return self.module().Event(enable_timing=True)

    def free_memory_bytes(self) -> int:
        """Free device memory plus what PyTorch's caching allocator holds but does not use."""
        mod = self.module()
        free, _total = mod.mem_get_info()
        return int(free) + max(int(mod.memory_reserved() - mod.memory_allocated()), 0)


TORCH_INDEX = "https://download.pytorch.org/whl"

ROCM = Backend(
    name="rocm", vendor="AMD", runtime="HIP", lane_group="wavefront", unit="CUs", arch_prefix="gfx",
    arch_property="gcnArchName", torch_version="hip",
    torch_module="cuda", compiler="hipcc", source_suffix=".hip", compiler_env={"HIP_PLATFORM": "amd"},
    triton_backend="hip",
    triton_targets={"gfx942": ("gfx942", 64), "gfx950": ("gfx950", 64), "gfx90a": ("gfx90a", 64), "gfx1100": ("gfx1100", 32)},
    fp8_dialects={"gfx942": "fnuz", "gfx950": "ocp"},   # MI300X / MI325X; MI350X / MI355X
    topology_commands=(("amd-smi", "topology"), ("rocm-smi", "--showtopo")),
    install_torch=f"a ROCm build of PyTorch: pip install torch --index-url {TORCH_INDEX}/rocm7.2 "
                  "(README: environment-rocm.yml)",
)
CUDA = Backend(
    name="cuda", vendor="NVIDIA", runtime="CUDA", lane_group="warp", unit="SMs", arch_prefix="sm_", torch_version="cuda",
    torch_module="cuda", compiler="nvcc", source_suffix=".cu", triton_backend="cuda",
    triton_targets={"sm_90": (90, 32), "sm_80": (80, 32), "sm_100": (100, 32), "sm_120": (120, 32)},
    fp8_dialects={"sm_89": "ocp", "sm_90": "ocp", "sm_100": "ocp", "sm_120": "ocp"},   # Ada, Hopper, Blackwell
    topology_commands=(("nvidia-smi", "topo", "-m"),),
    install_torch=f"a CUDA build of PyTorch: pip install torch --index-url {TORCH_INDEX}/cu130 "
                  "(driver >= 580; cu126 for drivers >= 525)",
)
CPU = Backend(name="cpu", vendor="", runtime="", lane_group="warp", unit="cores")   # the labs' tables say "warp size: unknown"

BACKENDS = {b.name: b for b in (CUDA, ROCM, CPU)}
GPUS = tuple(b for b in BACKENDS.values() if b.is_gpu)
# A notebook's DEVICE: "auto" (the GPU PyTorch sees, else the CPU), "gpu" (any GPU) or a backend's name.
DEVICE_CHOICES = ("auto", "cpu", "gpu", *(b.name for b in GPUS))


def get(name: str) -> Backend:
    """The record of a backend by name ("rocm", "cuda", "cpu")."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None


def for_arch(arch: str | None) -> Backend | None:
    """The GPU backend whose architectures are named like `arch` ("gfx942" -> ROCm, "sm_90" -> CUDA)."""
    return next((b for b in GPUS if arch and arch.startswith(b.arch_prefix)), None)


def fp8_dialect_of(arch: str | None) -> str | None:
    """The FP8 dialect ("ocp" | "fnuz") the matrix units of `arch` take, from its backend's record; None where the
    course knows of no FP8 matrix units (gfx90a, sm_80) or of no such architecture."""
    plat = for_arch(arch)
    return plat.fp8_dialects.get(arch) if plat else None


def for_vendor(vendor: str | None) -> Backend | None:
    return next((b for b in GPUS if vendor and b.vendor.upper() in vendor.upper()), None)


def of_torch_build(**versions) -> Backend:
    """The backend a PyTorch build targets, from its versions (`of_torch_build(hip=torch.version.hip,
    cuda=torch.version.cuda)`); a ROCm build's torch.version.cuda is None. The CPU when none is set."""
    return next((b for b in GPUS if versions.get(b.torch_version)), CPU)


def this_torch_build() -> Backend:
    """The backend this process's PyTorch was built for."""
    return of_torch_build(**versions())


def versions() -> dict[str, str]:
    """{"hip": "6.4", ...}: the GPU runtime versions this PyTorch was built with (empty on a CPU build)."""
    import torch

    found = {b.torch_version: getattr(torch.version, b.torch_version, None) for b in GPUS}
    return {k: str(v) for k, v in found.items() if v}


def of(device) -> Backend:
    """The record of a DeviceInfo, a torch.device, or a device string ("cuda", "cuda:1", "cpu")."""
    name = getattr(device, "backend", None)
    if isinstance(name, str):
        return get(name)
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    if kind == "cpu":
        return CPU
    gpu = next((b for b in GPUS if b.torch_module == kind), None)
    if gpu is None:
        raise ValueError(f"no backend drives torch device {device!r}")
    return this_torch_build() if gpu.torch_module == "cuda" else gpu
