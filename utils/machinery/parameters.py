"""Every lab's parameters in one table: the harness checks `-p NAME VALUE` against it before anything
runs (`make run`, papermill through the harness); a notebook's own check cell checks them again."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from utils.llm.models import SHAPES
from utils.params import DEVICE_CHOICES, ParameterError, choice, int_list, milliseconds, pair, positive_int


@dataclass(frozen=True)
class Spec:
    kind: str                       # "choice" | "count" | "counts" | "milliseconds" | "pair"
    allowed: tuple = ()             # choices
    maximum: float | None = None
    none_ok: bool = True            # None means "pick by device"

    def validate(self, name: str, value):
        if value is None and self.none_ok:
            return None
        if self.kind == "choice":
            allowed = self.allowed
            return choice(name, value, allowed)
        if self.kind == "count":
            return positive_int(name, value, self.maximum)
        if self.kind == "counts":
            return int_list(name, value, self.maximum)
        if self.kind == "milliseconds":
            return milliseconds(name, value, self.maximum or 60_000)
        if self.kind == "pair":
            return pair(name, value, self.maximum)
        raise ValueError(f"unknown parameter kind {self.kind!r}")

    def describe(self) -> str:
        allowed = self.allowed
        text = {"choice": "one of " + ", ".join(map(repr, allowed)),
                "count": "a positive whole number", "counts": "a list of positive whole numbers",
                "milliseconds": "milliseconds >= 0", "pair": "a pair of positive whole numbers"}[self.kind]
        if self.maximum is not None and self.kind != "choice":
            text += f" (at most {self.maximum:,})"
        return text + (", or None (chosen by device)" if self.none_ok and self.kind != "choice" else "")


SPECS: dict[str, Spec] = {
    # every lab
    "DEVICE": Spec("choice", DEVICE_CHOICES, none_ok=False),
    "REPS": Spec("count", maximum=10_000),
    "WARMUP_MS": Spec("milliseconds", maximum=60_000, none_ok=False),

    # lab 00
    "MATMUL_N": Spec("count"), "ADD_N": Spec("count"),

    # lab 01
    "MIN_N": Spec("count"), "MAX_N": Spec("count"),

    # lab 02
    "N": Spec("count"), "ITERS": Spec("count", maximum=1 << 20, none_ok=False),

    # lab 03
    "BENCH_N": Spec("counts"),

    # lab 04
    "BATCH": Spec("count"), "HEADS": Spec("count"), "NAIVE_MAX_N": Spec("count"), "SEQ_LENS": Spec("counts"),
    "HEAD_DIMS": Spec("counts", maximum=256), "HEADLINE": Spec("pair"),

    # lab 05
    "ENGINE": Spec("choice", ("auto", "vllm", "transformers"), none_ok=False),
    "RANDOM_SHAPE": Spec("choice", tuple(SHAPES)), "SERVE_MODEL": Spec("choice", ("smollm2", "random")),
    "CONCURRENCY": Spec("counts", maximum=1024), "OUTPUT_TOKENS": Spec("count", maximum=4096),
    "DECODE_TOKENS": Spec("count", maximum=4096),
    "LOAD_PERCENT": Spec("counts", maximum=1000), "LOAD_SECONDS": Spec("count", maximum=600),
    "WARMUP_SECONDS": Spec("count", maximum=300), "DATASET": Spec("choice", ("random", "prompts"), none_ok=False),
    "INPUT_TOKENS": Spec("count", maximum=8192), "SLO_TTFT_MS": Spec("milliseconds", maximum=600_000),
    "SLO_TPOT_MS": Spec("milliseconds", maximum=600_000),
    "ARRIVALS": Spec("choice", ("poisson", "bursty", "constant"), none_ok=False),

    # lab 06 (and DECODE_TOKENS, as in lab 05)
    "RANKS": Spec("count", maximum=64), "MESSAGE_SIZES": Spec("counts", maximum=1 << 34),
    "TP_SHAPE": Spec("choice", ("tiny", *SHAPES)),

    # lab 07
    "CLINIC_MODEL": Spec("choice", ("smollm2", "random")), "NEW_TOKENS": Spec("count", maximum=512),
    "CHECK_DTYPE": Spec("choice", ("bfloat16", "float16", "float32"), none_ok=False),
}


def validate(name: str, value):
    """Check one parameter by its spec (the harness does this before running anything)."""
    if name not in SPECS:
        raise ParameterError(unknown_message(name, SPECS))
    return SPECS[name].validate(name, value)


def unknown_message(name: str, known) -> str:
    near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return (f"{name} is not a parameter of the selected notebooks"
            + (f" (did you mean {near[0]}?)" if near else "")
            + f"; their parameters: {', '.join(sorted(known))}")
