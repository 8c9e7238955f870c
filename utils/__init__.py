"""rocm-cuda-labs: shared helpers for every lab.

utils.device (detection, peaks), utils.timing (benchmark), utils.params (parameter checks),
utils.report (headline figures, the course report), utils.plots, utils.stack (software, install
hints), utils.exercises (check helpers), utils.harness (make run / make labs).
"""
from .device import DeviceInfo, detect
from .exercises import check
from .params import ParameterError
from .timing import benchmark

__all__ = ["DeviceInfo", "detect", "check", "ParameterError", "benchmark"]
