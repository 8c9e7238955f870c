"""The divergence finder: a model on the device against a CPU float32 reference, module by module, then token by token.

`capture(reference, batch)` runs the reference (on the CPU, float32) with a forward hook on every module and keeps
each module's inputs and output. `find(captured, model)` runs the model under test (any device and dtype) on the same
batch and measures, for every module in the order the modules finish:

- `propagated`: the error of its output in the model's own run (errors of earlier modules carried along), and
- `isolated`: the error of its output when it is given the *reference's* inputs (what the module itself adds);
  measured for the modules whose propagated error is above the tolerance.

Errors are per token: the largest ||device - reference|| / ||reference|| over the batch's real (non-padding)
tokens, against a tolerance that depends on the dtype the model runs in (`TOLERANCE`). The *culprit* is the first
module whose isolated error is above it: every module that finished before it (its children included) computes
right from right inputs, so the divergence starts in its own code. `first_propagated` is where the error first
shows in the plain run: often a victim downstream of the culprit. `generate` and `compare_tokens` then compare
greedy tokens.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

# Per-token relative error a module may show against the float32 CPU reference, by the dtype the model under test
# runs in. float32: another device only sums in another order (1e-3 leaves room for 30 layers of that). bfloat16
# keeps 8 significant bits (a step of 2^-8 = 0.4%): every module rounds its inputs and output, and a deep model
# carries those roundings along; for SmolLM2 in bf16 on the CPU the worst module output of the 30 layers was 12%
# off per token (a late attention output), so the allowance is 2^-2. float16 keeps 3 bits more: 2^-5.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 2.0**-2, torch.float16: 2.0**-5}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def tolerance(dtype: torch.dtype) -> float:
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for {dtype}; known: {', '.join(map(str, TOLERANCE))}")
    return TOLERANCE[dtype]


def model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def named_modules(model) -> dict:
    """{name: module}, the model itself named "(model)"."""
    return {(name or "(model)"): m for name, m in model.named_modules()}


# --- batches -------------------------------------------------------------------------------------

def prompt_batch(tokenizer, prompts: list[str], *, chat: bool = True) -> dict:
    """Token ids, attention mask and position ids of `prompts`, left-padded (as for generation), on the CPU.
    Position ids are what `generate` uses: a running count of real tokens, so padding does not shift them."""
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty strings")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) if chat else p for p in prompts]
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    if pad is None:     # lab 07's own tokenizer as transformers 5.17 loaded it on the H100: the mask hides the
        if tokenizer.eos_token is None:                    # padding, so any real token's id will do, for this call only
            raise ValueError("the tokenizer has neither a padding token nor an end-of-text token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
        if pad is None:
            tokenizer.pad_token = None
    return ids_batch(enc["input_ids"], enc["attention_mask"])


def ids_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """A batch from token ids (and a 0/1 mask of real tokens; all real if None)."""
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, tokens) with at least one token, not {tuple(input_ids.shape)}")
    mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if not bool(mask[:, -1].all()):
        raise ValueError("the batch must be left-padded: every sequence's last token must be real")
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}


# --- moving and measuring ------------------------------------------------------------------------

def _convert(value, device, dtype):
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value.to(device=device, dtype=dtype)
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_convert(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [_convert(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _convert(v, device, dtype) for k, v in value.items()}
    return value


def _tensors(value) -> list[torch.Tensor]:
    """The floating-point tensors of a module's output (a tensor, a tuple, a ModelOutput), in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):          # ModelOutput is a dict too
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _per_token(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(tokens, features) of an output: the real tokens of a (batch, tokens, ...) tensor, else every row."""
    t = t.detach().float().cpu()
    if t.dim() >= 2 and tuple(t.shape[:2]) == tuple(valid.shape):
        return t[valid].reshape(int(valid.sum()), -1)
    if t.dim() >= 2:
        return t.reshape(t.shape[0] * t.shape[1], -1)
    return t.reshape(1, -1)


def token_error(out, ref, valid: torch.Tensor) -> tuple[float, float]:
    """(largest per-token relative error, largest absolute error) of `out` against `ref`. NaN or infinity in
    `out` where `ref` is finite gives an infinite error; a shape change gives NaN."""
    a_list, b_list = _tensors(out), _tensors(ref)
    if len(a_list) != len(b_list):
        return math.nan, math.nan
    rel = absolute = 0.0
    for a, b in zip(a_list, b_list):
        if a.shape != b.shape:
            return math.nan, math.nan
        a, b = _per_token(a, valid), _per_token(b, valid)
        if a.numel() == 0:
            continue
        diff = (a - b).abs()
        bad = ~torch.isfinite(a) & torch.isfinite(b)
        if bool(bad.any()):
            return math.inf, math.inf
        diff = torch.nan_to_num(diff, nan=0.0)
        norm_b = b.norm(dim=1)
        floor = max(float(norm_b.max()) * 1e-6, 1e-30)
        rel = max(rel, float((diff.norm(dim=1) / norm_b.clamp_min(floor)).max()))
        absolute = max(absolute, float(diff.max()))
    return rel, absolute


# --- the reference run ---------------------------------------------------------------------------

@dataclass
class Captured:
    """The reference run: every module's (args, kwargs, output) in the order the modules finished."""
    batch: dict
    order: list[str]
    calls: dict          # name -> (args, kwargs, output)
    kinds: dict          # name -> class name
    logits_to_keep: int | None


def _forward_kwargs(batch: dict, logits_to_keep) -> dict:
    kwargs = dict(batch, use_cache=False)
    if logits_to_keep is not None:
        kwargs["logits_to_keep"] = logits_to_keep
    return kwargs


@torch.no_grad()
def capture(reference, batch: dict, *, logits_to_keep: int | None = 1) -> Captured:
    """Run `reference` (a float32 model on the CPU) on `batch` with a hook on every module.

    `logits_to_keep=1` computes the vocabulary projection for the last position only, as generation does
    (the full (batch, tokens, vocabulary) logits of a 49k vocabulary are large and not needed)."""
    if model_device(reference).type != "cpu" or model_dtype(reference) != torch.float32:
        raise ValueError(f"the reference must be float32 on the CPU, not {model_dtype(reference)} on "
                         f"{model_device(reference)}")
    names = {m: n for n, m in named_modules(reference).items()}
    order, calls, kinds = [], {}, {}

    def hook(module, args, kwargs, output):
        name = names[module]
        if name not in calls:          # a module called twice keeps its first call
            order.append(name)
            calls[name] = (args, kwargs, output)
            kinds[name] = type(module).__name__

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in reference.modules()]
    try:
        reference.eval()(**_forward_kwargs(batch, logits_to_keep))
    finally:
        for h in handles:
            h.remove()
    return Captured(batch, order, calls, kinds, logits_to_keep)


# --- the comparison ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    propagated: float          # error in the model's own run
    isolated: float | None     # error on the reference's inputs (None: not replayed)
    max_abs: float


@dataclass
class Report:
    rows: list[Row]
    tol: float
    dtype: torch.dtype
    device: str
    first_propagated: str | None = None
    culprit: str | None = None
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def layers(self) -> list[Row]:
        """The rows of the decoder layers (`...layers.N`), in order."""
        return [r for r in self.rows if _LAYER.search(r.name)]

    def diverged(self, which: str = "propagated") -> list[Row]:
        return [r for r in self.rows if not (getattr(r, which) is None or getattr(r, which) <= self.tol)]

    def table(self, names=None, *, limit: int = 12) -> str:
        """Text table of `names` (default: the culprit's neighbourhood and the decoder layers), errors as %."""
        if names is None:
            picked = self._interesting(limit)
        else:
            picked = [self.row(n) for n in names]
        fmt = lambda v: "-" if v is None else ("nan" if v != v else "inf" if v == math.inf else f"{100 * v:.3g}%")
        width = max([len(r.name) for r in picked] + [6])
        lines = [f"{'module':<{width}}  {'kind':<22} {'propagated':>11} {'isolated':>9}   (tolerance {100 * self.tol:.3g}%, "
                 f"{str(self.dtype).replace('torch.', '')} on {self.device})"]
        for r in picked:
            mark = ("  <- culprit" if r.name == self.culprit else
                    "  <- first to diverge" if r.name == self.first_propagated else "")
            lines.append(f"{r.name:<{width}}  {r.kind:<22} {fmt(r.propagated):>11} {fmt(r.isolated):>9}{mark}")
        return "\n".join(lines)

    def _interesting(self, limit: int) -> list[Row]:
        keys = [self.culprit, self.first_propagated]
        idx = [i for i, r in enumerate(self.rows) if r.name in keys]
        if not idx:
            return self.layers()[:limit]
        lo = max(0, min(idx) - 2)
        return self.rows[lo:lo + limit]

    def summary(self) -> str:
        if self.culprit:
            return (f"culprit: {self.culprit} ({self.row(self.culprit).kind}): wrong on the reference's own inputs "
                    f"({100 * self.row(self.culprit).isolated:.3g}% > {100 * self.tol:.3g}%); first wrong output in the "
                    f"run: {self.first_propagated}")
        if self.first_propagated:
            return (f"first wrong output: {self.first_propagated}, but no module is wrong on the reference's inputs: "
                    "the errors add up across modules (or the replay was off)")
        worst = max(self.rows, key=lambda r: r.propagated if r.propagated == r.propagated else math.inf)
        return (f"no divergence: every module within {100 * self.tol:.3g}% (largest: {worst.name}, "
                f"{100 * worst.propagated:.3g}%)")

    def plot(self, ax=None, *, title: str | None = None):
        """Error per decoder layer (propagated and isolated) against the tolerance, log scale."""
        import matplotlib.pyplot as plt

        ax = ax or plt.subplots(figsize=(7, 3.2))[1]
        rows = self.layers()
        xs = [int(_LAYER.search(r.name).group(1)) for r in rows]
        floor = self.tol * 1e-4
        clip = lambda v: floor if v is None or v != v else min(max(v, floor), 1e3)
        ax.plot(xs, [clip(r.propagated) for r in rows], "o-", ms=3, label="propagated (own run)")
        ax.plot(xs, [clip(r.isolated) for r in rows], "s--", ms=3, label="isolated (reference inputs)")
        ax.axhline(self.tol, color="red", lw=1, label=f"tolerance ({str(self.dtype).replace('torch.', '')})")
        ax.set_yscale("log")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("per-token relative error")
        ax.set_title(title or self.summary()[:90], fontsize=9)
        ax.legend(fontsize=8)
        return ax


def _replay(model_modules: dict, name: str, call, device, dtype):
    args, kwargs, _ = call
    return model_modules[name](*_convert(args, device, dtype), **_convert(kwargs, device, dtype))


@torch.no_grad()
def find(captured: Captured, model, *, tol: float | None = None, isolate: bool = True,
         stop_at_culprit: bool = True, replay_all: bool = False) -> Report:
    """Compare `model` (on its own device and dtype) with the captured reference run, module by module.

    With `isolate`, each module whose output in the model's own run is above the tolerance is also run on the
    reference's inputs (in the order the modules finished) until the first one that is wrong there: the culprit
    (`stop_at_culprit=False` goes on to the end). A module whose own-run output is within the tolerance is not
    replayed (it is not where a divergence starts) unless `replay_all`, which measures every module's own error
    (to calibrate a tolerance)."""
    device, dtype = model_device(model), model_dtype(model)
    tol = tolerance(dtype) if tol is None else float(tol)
    valid = captured.batch["attention_mask"].bool()
    modules = named_modules(model)
    missing = [n for n in captured.order if n not in modules]
    if missing:
        raise ValueError(f"the model under test has no module {missing[0]!r}: is it the same architecture "
                         "as the reference?")
    names = {m: n for n, m in modules.items()}
    propagated: dict[str, tuple[float, float]] = {}

    def hook(module, args, output):
        name = names.get(module)
        if name in captured.calls and name not in propagated:
            propagated[name] = token_error(output, captured.calls[name][2], valid)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        model.eval()(**_convert(_forward_kwargs(captured.batch, captured.logits_to_keep), device, dtype))
    finally:
        for h in handles:
            h.remove()
    rows, culprit, first = [], None, None
    replaying = isolate
    for name in captured.order:
        prop, absolute = propagated.get(name, (math.nan, math.nan))
        iso = None
        if replaying and (replay_all or not prop <= tol):   # right in its own run: not where a divergence starts
            iso = token_error(_replay(modules, name, captured.calls[name], device, dtype),
                              captured.calls[name][2], valid)[0]
            if culprit is None and not iso <= tol:
                culprit = name
                replaying = not stop_at_culprit
        if first is None and not prop <= tol:
            first = name
        rows.append(Row(name, captured.kinds[name], prop, iso, absolute))
    report = Report(rows, tol, dtype, str(device), first_propagated=first, culprit=culprit)
    if first and not culprit and isolate:
        report.notes.append("the outputs diverge but no module does on the reference's inputs")
    return report


# --- tokens --------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, batch: dict, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of `batch` (exactly `new_tokens` tokens, on the model's device), on the CPU."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens} must be at least 1")
    device = model_device(model)
    ids = batch["input_ids"].to(device)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
    out = model.generate(input_ids=ids, attention_mask=batch["attention_mask"].to(device), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
    return out[:, ids.shape[1]:].cpu()


@dataclass(frozen=True)
class TokenComparison:
    equal: bool
    first_mismatch: tuple[int | None, ...]     # per sequence: index of the first differing token, None if equal

    def __str__(self) -> str:
        if self.equal:
            return f"tokens: all {len(self.first_mismatch)} sequences equal the reference's"
        return "tokens: " + ", ".join(f"sequence {i}: " + ("equal" if m is None else f"differs from token {m}")
                                      for i, m in enumerate(self.first_mismatch))


def compare_tokens(reference: torch.Tensor, tokens: torch.Tensor) -> TokenComparison:
    if reference.shape != tokens.shape:
        raise ValueError(f"token shapes differ: {tuple(reference.shape)} vs {tuple(tokens.shape)}")
    first = []
    for r, t in zip(reference, tokens):
        diff = (r != t).nonzero()
        first.append(None if diff.numel() == 0 else int(diff[0]))
    return TokenComparison(all(m is None for m in first), tuple(first))
