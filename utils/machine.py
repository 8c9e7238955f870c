"""The machine's state around a measurement: clocks, temperature, power, throttling, other processes, CPU load.

    before = machine.snapshot(plat)          # plat: a backend.Backend (CPU, CUDA or ROCm)
    ...measure...
    after = machine.snapshot(plat)
    machine.judge(before, after)             # ["SM clock fell from 1980 to 1410 MHz", ...]; [] when steady

NVIDIA GPUs are read through NVML (`nvidia-ml-py`), AMD GPUs through `amdsmi` (ROCm 6+) or, where only it
exists, `rocm-smi --json`; the CPU through /proc (load average, CPU seconds of the whole machine and of this
process tree, clock). What cannot be read is left out of the record, never guessed. `judge` is the validity
test `utils.record` applies to every figure: a figure measured while another program took the CPU, the GPU's
clock fell, the GPU slowed itself down (thermal, hardware slowdown, power brake) or another process used the GPU
is not a measurement of the kernel alone.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import psutil

from utils import backend

# A figure is unreliable when, during its measurement...
OTHERS_CPU_MAX = 0.25        # ...other processes used more than this share of all CPU cores,
MIN_WINDOW_S = 0.3           # (judged only over windows at least this long: /proc counts in 10 ms ticks)
CLOCK_DROP_MAX = 0.10        # ...the GPU's compute clock fell by more than this fraction (not at its power cap),
# ...or the GPU reported one of these reasons for slowing down (NVML's clock-event reasons, amdsmi's throttle
# status). A power cap is recorded but not judged: a busy GPU at its power limit is its sustained state.
NVML_REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hardware slowdown",
                0x10: "sync boost", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                0x80: "hardware power brake", 0x100: "display clock"}
SLOWDOWNS = ("hardware slowdown", "software thermal slowdown", "hardware thermal slowdown", "hardware power brake",
             "thermal throttling", "prochot")


def snapshot(plat: backend.Backend | None = None, index: int = 0) -> dict:
    """The machine now: {"time", "cpu": {...}, "gpu": {...} (a GPU backend only, where readable)}."""
    state = {"time": time.time(), "cpu": cpu_state()}
    if plat is not None and plat.is_gpu:
        gpu = gpu_state(plat, index)
        if gpu:
            state["gpu"] = gpu
    return state


def cpu_state() -> dict:
    """Load average, cores, clock, CPU seconds of the whole machine and of this process and its children."""
    times = psutil.cpu_times()
    state = {"cores": psutil.cpu_count() or 1, "load1": round(os.getloadavg()[0], 2),
             "busy_s": round(sum(times) - times.idle - getattr(times, "iowait", 0.0), 3),
             "own_s": round(_tree_cpu_seconds(), 3)}
    try:
        freq = psutil.cpu_freq()
    except (OSError, RuntimeError, NotImplementedError):
        freq = None
    if freq and freq.current:
        state["clock_mhz"] = round(freq.current)
    return state


def _tree_cpu_seconds() -> float:
    """CPU seconds of this process, its finished children and its live descendants (a lab's server, its ranks)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += c.user + c.system
    return total


def gpu_state(plat: backend.Backend, index: int = 0) -> dict:
    """The GPU's clocks, temperature, power, slowdown reasons and processes; {} when nothing can read them."""
    try:
        if plat.vendor == "NVIDIA":
            return _nvml(index)
        if plat.vendor == "AMD":
            return _amdsmi(index) or _rocm_smi(index)
    except Exception as err:   # a reader that fails must not stop a lab: say why in the record
        return {"error": f"{type(err).__name__}: {err}"}
    return {}


_nvml_ready = False


def _nvml(index: int) -> dict:
    try:
        import pynvml   # nvidia-ml-py: optional on a machine without NVIDIA's driver
    except ImportError:
        return {"error": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}
    global _nvml_ready
    if not _nvml_ready:     # once per process, as torch.cuda does: a timing takes two snapshots, a sweep hundreds
        pynvml.nvmlInit()
        _nvml_ready = True
    h = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
    reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    return from_nvml({
        "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
        "memory_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        "power_mw": pynvml.nvmlDeviceGetPowerUsage(h),
        "power_limit_mw": pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
        "reasons": reasons_of(h),
        "utilization_pct": pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
        "pids": [p.pid for p in procs],
    })


def _physical_index(index: int) -> int:
    """NVML counts every GPU of the machine; CUDA_VISIBLE_DEVICES may show PyTorch only some of them."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.strip().isdigit() for v in visible) and index < len(visible):
        return int(visible[index])
    return index


def from_nvml(raw: dict) -> dict:
    """NVML's readings (as `_nvml` gathers them; tests pass recorded ones) -> the course's GPU state."""
    reasons = [name for bit, name in NVML_REASONS.items() if raw.get("reasons", 0) & bit]
    return _gpu_record("nvml", raw["sm_clock_mhz"], raw.get("max_sm_clock_mhz"), raw.get("memory_clock_mhz"),
                       raw.get("temperature_c"), raw["power_mw"] / 1e3 if raw.get("power_mw") is not None else None,
                       raw["power_limit_mw"] / 1e3 if raw.get("power_limit_mw") else None, reasons,
                       raw.get("utilization_pct"), raw.get("pids", []))


def _amdsmi(index: int) -> dict:
    try:
        import amdsmi   # ships with ROCm (and on PyPI), needs ROCm's libamd_smi
    except ImportError:
        return {}
    amdsmi.amdsmi_init()
    try:
        h = amdsmi.amdsmi_get_processor_handles()[index]
        clock = amdsmi.amdsmi_get_clock_info(h, amdsmi.AmdSmiClkType.GFX)
        metrics = amdsmi.amdsmi_get_gpu_metrics_info(h)
        raw = {"clock": clock, "metrics": metrics,
               "power": amdsmi.amdsmi_get_power_info(h),
               "temperature_c": amdsmi.amdsmi_get_temp_metric(h, amdsmi.AmdSmiTemperatureType.HOTSPOT,
                                                              amdsmi.AmdSmiTemperatureMetric.CURRENT),
               "activity": amdsmi.amdsmi_get_gpu_activity(h),
               "processes": [amdsmi.amdsmi_get_gpu_process_info(h, p) for p in amdsmi.amdsmi_get_gpu_process_list(h)]}
        return from_amdsmi(raw)
    finally:
        amdsmi.amdsmi_shut_down()


def _number(v):
    """amdsmi reports "N/A" (or a dict with a value) where a sensor does not exist."""
    if isinstance(v, dict):
        v = v.get("value")
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def from_amdsmi(raw: dict) -> dict:
    """amdsmi's readings (`_amdsmi` gathers them; tests pass recorded ones) -> the course's GPU state."""
    clock, metrics, power = raw.get("clock", {}), raw.get("metrics", {}), raw.get("power", {})
    watts = _number(power.get("current_socket_power")) or _number(power.get("average_socket_power"))
    reasons = []
    status = _number(metrics.get("throttle_status"))
    if status:
        reasons.append("thermal throttling")   # the driver's legacy flag: any throttling
    pids = [p.get("pid") for p in raw.get("processes", []) if isinstance(p, dict) and p.get("pid")]
    return _gpu_record("amdsmi", _number(clock.get("clk")), _number(clock.get("max_clk")), None,
                       _number(raw.get("temperature_c")), watts, _number(power.get("power_limit")),
                       reasons, _number(raw.get("activity", {}).get("gfx_activity")), pids)


def _rocm_smi(index: int) -> dict:
    exe = shutil.which("rocm-smi")
    if not exe:
        return {"error": "neither amdsmi nor rocm-smi found (ROCm's amd-smi package)"}
    out = subprocess.run([exe, "-d", str(index), "--showclocks", "--showtemp", "--showpower", "--showuse",
                          "--showpids", "--json"], capture_output=True, text=True, timeout=20, check=False).stdout
    return from_rocm_smi(json.loads(out or "{}"), index)


def _mhz(text) -> float | None:
    """rocm-smi's "(2100Mhz)" -> 2100.0."""
    digits = "".join(ch for ch in str(text) if ch.isdigit() or ch == ".")
    return float(digits) if digits else None


def from_rocm_smi(data: dict, index: int = 0) -> dict:
    """`rocm-smi --showclocks --showtemp --showpower --showuse --showpids --json` -> the course's GPU state."""
    card = data.get(f"card{index}", {})

    def field(*words):
        for key, value in card.items():
            if all(w in key.lower() for w in words):
                return value
        return None

    # --showpids: {"system": {"PID4242": "python3, 1, 2097152, 0, unknown", ...}}
    pids = [int(k[3:]) for k in (data.get("system", {}) or {}) if k.startswith("PID") and k[3:].isdigit()]
    return _gpu_record("rocm-smi", _mhz(field("sclk")), None, _mhz(field("mclk")),
                       _number(_float(field("temperature", "junction")) or _float(field("temperature", "edge"))),
                       _float(field("power", "(w)")), None, [], _float(field("gpu use")), pids)


def _float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _gpu_record(source, clock, max_clock, mem_clock, temp, watts, limit, reasons, util, pids) -> dict:
    record = {"source": source, "sm_clock_mhz": clock, "max_sm_clock_mhz": max_clock,
              "memory_clock_mhz": mem_clock, "temperature_c": temp,
              "power_w": round(watts, 1) if watts is not None else None,
              "power_limit_w": round(limit, 1) if limit else None,
              "slowdown": reasons, "utilization_pct": util, "pids": sorted(pids)}
    return {k: v for k, v in record.items() if v is not None}


def judge(before: dict | None, after: dict | None) -> list[str]:
    """Why a figure measured between two snapshots is not a measurement of the kernel alone ([] if none)."""
    if not before or not after:
        return []
    reasons = []
    wall = after["time"] - before["time"]
    b, a = before.get("cpu", {}), after.get("cpu", {})
    if wall >= MIN_WINDOW_S and "busy_s" in a and "busy_s" in b:
        others = (a["busy_s"] - b["busy_s"]) - (a["own_s"] - b["own_s"])
        share = others / (wall * a.get("cores", 1))
        if share > OTHERS_CPU_MAX:
            reasons.append(f"other processes used {share:.0%} of the {a.get('cores')} CPU cores during the "
                           f"measurement ({wall:.1f} s; load average {a.get('load1')})")

    gb, ga = before.get("gpu", {}), after.get("gpu", {})
    # A clock that falls while the GPU reports its power cap is a busy GPU settling at its sustained clock (the
    # warm-up's job, and the interleaved rounds'); one that falls with no such reason, or with a slowdown, is not.
    explained = set(ga.get("slowdown", [])) & {"idle", "power cap"}
    if gb.get("sm_clock_mhz") and ga.get("sm_clock_mhz") and not explained and \
            ga["sm_clock_mhz"] < (1 - CLOCK_DROP_MAX) * gb["sm_clock_mhz"]:
        reasons.append(f"the GPU's clock fell from {gb['sm_clock_mhz']:.0f} to {ga['sm_clock_mhz']:.0f} MHz")
    slow = [r for r in ga.get("slowdown", []) if r in SLOWDOWNS]
    if slow:
        reasons.append(f"the GPU slowed itself down ({', '.join(slow)}) at {ga.get('temperature_c', '?')} °C, "
                       f"{ga.get('power_w', '?')} W")
    if ga.get("pids"):
        mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
        others = [p for p in ga["pids"] if p not in mine and psutil.pid_exists(p)]
        if others:
            reasons.append(f"{len(others)} other process(es) used the GPU (pids {', '.join(map(str, others[:5]))})")
    return reasons


def summary(state: dict | None) -> str:
    """One line for a report: "GPU 1980 MHz, 41 °C, 120/700 W; CPU load 0.4 on 16 cores"."""
    if not state:
        return "not recorded"
    parts = []
    g = state.get("gpu") or {}
    if g.get("error"):
        parts.append(f"GPU state unreadable ({g['error']})")
    elif g:
        bits = [f"{g['sm_clock_mhz']:.0f} MHz" if g.get("sm_clock_mhz") else None,
                f"{g['temperature_c']:.0f} °C" if g.get("temperature_c") is not None else None,
                (f"{g['power_w']:.0f}" + (f"/{g['power_limit_w']:.0f}" if g.get("power_limit_w") else "") + " W")
                if g.get("power_w") is not None else None,
                ("slowdown: " + ", ".join(g["slowdown"])) if g.get("slowdown") else None]
        parts.append("GPU " + ", ".join(b for b in bits if b))
    c = state.get("cpu") or {}
    if c:
        parts.append(f"CPU load {c.get('load1')} on {c.get('cores')} cores"
                     + (f", {c['clock_mhz']} MHz" if c.get("clock_mhz") else ""))
    return "; ".join(parts)
