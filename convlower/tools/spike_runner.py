"""The spike's machinery: one step per backend, timing, error against eager, compile counts.

:mod:`convlower.tools.spike` runs the experiment with these parts.
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch

from .. import torch_internals as ti
from ..device import sync, tensors
from ..observe import stats

BACKENDS = ("eager", "inductor", "convlower", "convlower-regions", "blocks")
# Plans compiled and compared: Inductor and convlower on the whole graph, convlower with
# each repeated block compiled once (options regions="auto", or the caller's class list), and
# the model's own compile_repeated_blocks() (diffusers; Inductor, blocks only) where it has one.
COMPILED = ("inductor", "convlower", "convlower-regions", "blocks")


def plan_options(plan: str, options: Optional[dict]) -> dict:
    """convlower's options for a convlower plan: regions off (``convlower``), or the caller's
    regions setting, "auto" when it has none (``convlower-regions``)."""
    opts = dict(options or {})
    given = opts.get("regions", "off")
    opts["regions"] = "off" if plan == "convlower" else (given if given not in ("off", None) else "auto")
    return opts


def own_blocks(model) -> Optional[torch.nn.Module]:
    """The module of ``model`` with its own ``compile_repeated_blocks()`` and a non-empty
    ``_repeated_blocks`` list (diffusers' convention), or None."""
    for m in model.modules() if isinstance(model, torch.nn.Module) else ():
        if callable(getattr(m, "compile_repeated_blocks", None)) and getattr(m, "_repeated_blocks", None):
            return m
    return None


class SpikeError(Exception):
    """A problem the user can fix; the CLI prints its message as one line."""


@contextlib.contextmanager
def compile_counts() -> Iterator[dict]:
    """Graph breaks, recompiles, graphs, frames compiled and cache hits of the compiles inside.

    Yields a dict that is filled on exit.  Deltas of Dynamo's counters and compilation
    metrics, so it works for any backend (the convlower-only records of
    :mod:`convlower.observe.stats` see no Inductor compile).  A frame recompiled only because
    another backend owns its cache entry (``BACKEND_MATCH``) is no recompile: the spike
    causes those itself.
    """
    before = ti.counters()
    seen = {id(m) for m in ti.compilation_metrics()}
    out: dict = {}
    yield out
    after = ti.counters()
    new = [m for m in ti.compilation_metrics() if id(m) not in seen]
    old_breaks = before.get("graph_break", {})
    breaks = {k: v - old_breaks.get(k, 0) for k, v in after.get("graph_break", {}).items()}
    reasons = [m.recompile_reason for m in new
               if m.recompile_reason and "BACKEND_MATCH" not in m.recompile_reason]
    graphs = lambda c: c.get("stats", {}).get("unique_graphs", 0)
    out.update(graph_breaks=sum(max(v, 0) for v in breaks.values()),
               graph_break_reasons=sorted(k for k, v in breaks.items() if v > 0),
               recompiles=len(reasons), recompile_reasons=reasons,
               graphs=graphs(after) - graphs(before), frames_compiled=len(new),
               cache=stats.cache_counts(before, after))


class Progress:
    """Phase lines and a bar for the timed rounds, on stderr (tqdm if installed)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def say(self, msg: str) -> None:
        if self.enabled:
            print(f"[spike] {msg}", file=sys.stderr, flush=True)

    def rounds(self, n: int, desc: str):
        if not self.enabled:
            return range(n)
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is None or not sys.stderr.isatty():  # a log file gets one line, not a bar
            self.say(desc)
            return range(n)
        return tqdm(range(n), desc=f"[spike] {desc}", file=sys.stderr, leave=False)


class Runner:
    """The model, its inputs and one step (forward, or forward + backward) per backend."""

    def __init__(self, model, inputs, cfg):
        self.model, self.inputs, self.cfg = model, inputs, cfg
        self.device = torch.device(cfg.device)
        params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "parameters") else []
        self.trains_parameters = bool(params)
        if cfg.backward and not params:  # nothing to train: differentiate the inputs instead
            self.inputs = tuple(x.detach().requires_grad_() if isinstance(x, torch.Tensor)
                                and x.is_floating_point() else x for x in inputs)
            params = [x for x in self.inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        self.leaves = params
        self.leaves_of: dict[str, list] = {}  # a plan running a copy of the model: its leaves
        self.cotangents: Optional[list[torch.Tensor]] = None
        self.compiled: dict[str, Callable] = {}
        self.results: dict[str, dict] = {}  # per plan, filled by tools.plans.compare
        self.reference: list[torch.Tensor] = []  # eager's values, the error check's reference

    def plans(self) -> list[str]:
        """The compiled plans this model has (``blocks`` only with its own repeated blocks)."""
        return [p for p in COMPILED if p != "blocks" or own_blocks(self.model) is not None]

    def compile(self, backend: str, inductor_options: dict):
        if backend == "blocks":  # compile_repeated_blocks works in place: on a copy
            model = copy.deepcopy(self.model)
            own_blocks(model).compile_repeated_blocks(backend="inductor", dynamic=self.cfg.dynamic or None,
                                                      options=dict(inductor_options) or None)
            self.compiled[backend] = model
            if self.trains_parameters:
                self.leaves_of[backend] = [p for p in model.parameters() if p.requires_grad]
            return
        kw: dict[str, Any] = {"dynamic": True if self.cfg.dynamic else None}
        opts = plan_options(backend, self.cfg.options) if backend.startswith("convlower") \
            else inductor_options
        if opts:
            kw["options"] = dict(opts)
        self.compiled[backend] = torch.compile(self.model, backend=backend.split("-")[0], **kw)

    def step(self, backend: str):
        fn = self.model if backend == "eager" else self.compiled[backend]
        if not self.cfg.backward:
            with torch.no_grad():
                return fn(*self.inputs)
        for p in self.leaves_of.get(backend, self.leaves):
            p.grad = None
        out = fn(*self.inputs)
        outs = [t for t in tensors(out) if t.requires_grad]
        if self.cotangents is None:  # fixed random cotangents, drawn once from eager's output
            g = torch.Generator().manual_seed(0)
            self.cotangents = [torch.randn(t.shape, generator=g).to(t.device, t.dtype) for t in outs]
        loss = sum((t.float() * c.float()).sum() for t, c in zip(outs, self.cotangents))
        loss.backward()
        return out

    def timed(self, backend: str) -> tuple[float, Any]:
        sync(self.device)
        t0 = time.perf_counter()
        out = self.step(backend)
        sync(self.device)
        return time.perf_counter() - t0, out

    def values(self, backend: str) -> list[torch.Tensor]:
        """Outputs (and gradients) of one untimed step, detached, for the error check."""
        out = self.step(backend)
        vals = [t.detach().clone() for t in tensors(out)]
        if self.cfg.backward:
            vals += [p.grad.detach().clone() for p in self.leaves_of.get(backend, self.leaves)
                     if p.grad is not None]
        return vals


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    """(max absolute error, max error relative to each reference tensor's largest value)."""
    if len(got) != len(ref):
        return math.inf, math.inf
    abs_err = rel_err = 0.0
    for a, b in zip(got, ref):
        if a.shape != b.shape:
            return math.inf, math.inf
        if b.numel() == 0:
            continue
        a, b = a.double(), b.double()
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / scale if scale > 0 else (0.0 if err == 0 else math.inf))
    return abs_err, rel_err


def step_stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"step_median_s": statistics.median(times), "step_iqr_s": q[2] - q[0],
            "step_min_s": min(times), "step_max_s": max(times), "steps_s": times}


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
