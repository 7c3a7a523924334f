"""Warm-up at session load: compile ahead, time a few steps, decide whether compiling pays.

``convlower.warmup(model, example_inputs)`` compiles ``model`` with the convlower backend, runs
the warm-up steps (so the first real call is fast) and returns ``(compiled, WarmupResult)``:
compile seconds, whether the caches were cold or warm, eager and compiled step timings, the
compile statistics (:mod:`convlower.observe.stats`) and the amortisation verdict
(:mod:`convlower.tools.amortize`).

With ``cache_dir`` it persists, and reuses in the next process, what makes a compile cheap
(:mod:`.session_cache`: Inductor's cache, the portable artifacts, convlower's decisions).

With ``cache_dir`` it also saves the compiled model whole (:mod:`.warm_start`,
:mod:`convlower.saved`), and the next process's warm-up loads it without tracing again.

Once the model is usable, the warm-up settles the close calls ``select="auto"`` left open, then
looks again at the screen's clear wins (:mod:`convlower.selection.close_calls`, within
``settle_budget_s``): each is compiled and timed,
the measured choice is stored where the next compile reads it, and when a choice changed the
model is compiled again at once, so the model returned already runs it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics as _statistics
import time
from typing import Any, Optional, Sequence, Union

import torch

from .. import torch_internals as ti
from ..device import sync, tensors
from ..observe import stats as _stats
from ..saved import SavedCompile
from ..selection import close_calls as _settle
from . import plan_choice as _choice
from . import session_cache as _cache
from .amortize import Amortization, amortize
from .spike_runner import plan_options
from .warm_start import WarmStart

log = logging.getLogger("convlower")


@dataclasses.dataclass
class Settling:
    """What the warm-up's measuring of close calls (and of the screen's clear wins) found and
    cost."""

    settled: list = dataclasses.field(default_factory=list)  # selection.close_calls.Settled
    left_open: int = 0            # close calls the budget left unmeasured
    seconds: float = 0.0          # measuring them
    recompile_s: float = 0.0      # compiling the model again with the changed choices
    steps_before_s: list = dataclasses.field(default_factory=list)  # compiled steps before
    clear_wins_left: int = 0      # the screen's clear wins the budget left unmeasured

    @property
    def changed(self) -> list:
        return [s for s in self.settled if s.changed]

    def to_dict(self) -> dict:
        return {"settled": [s.to_dict() for s in self.settled], "left_open": self.left_open,
                "seconds": self.seconds, "recompile_s": self.recompile_s,
                "steps_before_s": self.steps_before_s, "clear_wins_left": self.clear_wins_left,
                "saved_per_call_s": sum(s.saved_s for s in self.settled)}


@dataclasses.dataclass
class WarmupResult:
    compile_s: float              # first step minus a steady compiled step: the compile's cost
    first_step_s: float           # the first compiled call (compiles + one step)
    cache: str                    # "cold" | "warm" | "partial" | "disabled" | "saved" (loaded whole)
    warm: bool                    # every graph came from the cache (no FX graph cache miss)
    cache_counts: dict            # FX graph / AOTAutograd cache hits, misses, bypasses
    eager_steps_s: list
    compiled_steps_s: list
    statistics: dict              # stats.totals() of the compiles during warm-up
    compiles: list                # the per-compile statistics records
    amortization: Optional[Amortization]
    cache_dir: Optional[str]
    warnings: list
    settling: Settling = dataclasses.field(default_factory=Settling)  # close calls measured
    saved: SavedCompile = dataclasses.field(default_factory=SavedCompile)  # whole compile on disk
    plans: Optional[_choice.PlanChoice] = None  # compare_plans=True: the plans side by side

    @property
    def verdict(self) -> Optional[str]:
        return self.amortization.verdict if self.amortization else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["settling"] = self.settling.to_dict()
        d["amortization"] = self.amortization.to_dict() if self.amortization else None
        d["verdict"] = self.verdict
        d["plans"] = self.plans.to_dict() if self.plans else None
        return d

    def __str__(self) -> str:
        st = self.statistics
        lines = [f"convlower warm-up: compile {self.compile_s:.2f} s ({self.cache} cache: "
                 f"fx {self.cache_counts.get('fx_graph_hit', 0)} hit/"
                 f"{self.cache_counts.get('fx_graph_miss', 0)} miss, aot "
                 f"{self.cache_counts.get('aot_autograd_hit', 0)} hit/"
                 f"{self.cache_counts.get('aot_autograd_miss', 0)} miss); "
                 f"{st.get('graphs', 0)} graphs, {len(st.get('graph_breaks', []))} graph breaks, "
                 f"{len(st.get('recompiles', []))} recompiles"]
        if self.compiled_steps_s:
            lines.append(f"  steps: eager {_median(self.eager_steps_s) * 1e3:.3g} ms, compiled "
                         f"{_median(self.compiled_steps_s) * 1e3:.3g} ms")
        se = self.settling
        if se.settled or se.left_open:
            worth = sum(s.saved_s for s in se.changed)
            lines.append(f"  close calls: {_measured(se.settled)} in {se.seconds:.1f} s, "
                         f"{len(se.changed)} changed (worth {worth * 1e3:.3g} ms per call; "
                         f"recompiled in {se.recompile_s:.1f} s), {se.left_open} left open"
                         + (f", {se.clear_wins_left} clear wins not measured"
                            if se.clear_wins_left else ""))
            lines += [f"    {s.conv}: {s.rule or 'original'} ({s.why})" for s in se.changed]
        if self.plans:
            lines += self.plans.lines()
        if self.saved.state != "off" or self.cache_dir:
            lines.append(f"  saved compile: {self.saved}")
        if self.amortization:
            lines.append(f"  verdict: {self.amortization.verdict} ({self.amortization.reason})")
        for b in st.get("graph_breaks", []):
            lines.append(f"  graph break at {b['location']}: {b['reason']}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __repr__ = __str__


def _median(xs: Sequence[float]) -> float:
    return _statistics.median(xs) if xs else 0.0


# -- running steps -----------------------------------------------------------------------------
def _step(fn, inputs, backward: bool):
    out = fn(*inputs)
    if backward:
        loss = [o.float().sum() for o in tensors(out) if o.requires_grad]
        if loss:
            torch.stack(loss).sum().backward()
    sync(inputs)
    return out


def _timed(fn, inputs, backward: bool, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        _step(fn, inputs, backward)
        times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def _keep_grads(model, inputs):
    """Warm-up must not leave gradients behind in the user's parameters or inputs."""
    leaves = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    leaves += [t for t in tensors(inputs) if t.is_leaf]
    saved = [(t, t.grad) for t in leaves]
    try:
        yield
    finally:
        for t, g in saved:
            t.grad = g


def _mark_dynamic(inputs: tuple, dynamic: dict) -> None:
    for index, dims in dynamic.items():
        dims = [dims] if isinstance(dims, int) else list(dims)
        ti.mark_dynamic(inputs[index], dims)


def _cache_state(counts: dict) -> str:
    if ti.caches_disabled():
        return "disabled"
    hits = counts["fx_graph_hit"] + counts["aot_autograd_hit"]
    if hits and not counts["fx_graph_miss"]:
        return "warm"
    return "partial" if hits else "cold"


# -- the entry point -----------------------------------------------------------------------------
def warmup(model, example_inputs, *, options: Optional[dict] = None,
           dynamic: Union[None, bool, dict] = None, cache_dir: Optional[str] = None,
           iters: int = 3, backward: bool = False, settle_budget_s: float = 120.0,
           save_compiled: bool = True, compare_plans: bool = False, session_calls: int = 1000,
           **amortize_kw: Any):
    """Compile ``model`` with convlower ahead of use; return ``(compiled, WarmupResult)``.

    ``example_inputs``: a tensor or a tuple of positional inputs.  ``dynamic``: passed to
    ``torch.compile`` when a bool; a dict ``{input index: dim or dims}`` marks those dims of
    the example inputs dynamic (Dynamo's ``mark_dynamic``) so other sizes later do not
    recompile.  ``iters``: timed steps, eager and compiled, for the verdict (0: no timing, no
    verdict).  ``backward``: each step also runs a backward (of the outputs' sum); gradients
    the warm-up produced are discarded.  Run it in the grad mode you will run the model in
    (e.g. inside ``torch.no_grad()`` for inference), or the first real call recompiles.
    ``settle_budget_s``: seconds to measure close calls, then the screen's clear wins (0: none).
    ``save_compiled``: with ``cache_dir``, save the compiled model whole and load it in the
    next process without tracing it again (:mod:`convlower.saved`; models without graph
    breaks).  ``compare_plans``: first time every plan side by side on this model (Inductor,
    convlower, convlower with regions, the model's own ``compile_repeated_blocks()``; about
    three compiles each) and run the one with the least total time over ``session_calls``
    calls (:mod:`.plan_choice`; remembered in ``cache_dir``, so later warm-ups compile only
    that plan; ``result.plans``).  Extra keywords (``low``, ``high``, ``stability``) go to
    :func:`amortize`.
    """
    if settle_budget_s < 0:
        raise ValueError(f"settle_budget_s must be >= 0, got {settle_budget_s}")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    warns = _cache.Warnings()
    cache_dir = _use_cache_dir(cache_dir, warns)
    if isinstance(dynamic, dict):
        _mark_dynamic(inputs, dynamic)
    choice = _plan(model, inputs, backward, options, dynamic, session_calls, cache_dir,
                   iters) if compare_plans else None
    if choice is not None and choice.plan not in _choice.CONVLOWER_PLANS:
        return _other_plan(choice, model, inputs, backward, iters, dynamic, cache_dir, warns,
                           amortize_kw)
    options = plan_options(choice.plan, options) if choice else options
    start = WarmStart(model, inputs, options=options, dynamic=dynamic, backward=backward,
                      cache_dir=cache_dir, save=save_compiled, warns=warns)
    with _keep_grads(model, inputs):
        eager = []
        if iters > 0:
            _step(model, inputs, backward)  # untimed: first-call allocations and library plans
            eager = _timed(model, inputs, backward, iters)
        compiled, first, steps, counts, records = _first_compiled(start, inputs, backward, iters,
                                                                  cache_dir, warns)
        settling = _settle_close_calls(settle_budget_s)
        if settling.changed:  # the model returned runs the measured choices
            settling.steps_before_s = steps
            settling.recompile_s, steps, compiled = _recompile(start, inputs, backward, iters)
    start.save(first + settling.recompile_s, _stats.totals(records)["phases_s"])
    if cache_dir is not None:
        _cache.save_artifacts(os.path.join(cache_dir, _cache.ARTIFACTS), warns)
    result = _result(first, steps, eager, counts, records, cache_dir, warns, amortize_kw)
    result.settling, result.saved, result.plans = settling, start.status, choice
    if start.status.state == "loaded":  # nothing was compiled: the whole model was loaded
        result.cache, result.warm = "saved", True
    log.info("%s", str(result).splitlines()[0])
    ti.trace_artifact("convlower_warmup", result.to_dict())
    return compiled, result


def _use_cache_dir(cache_dir, warns: _cache.Warnings) -> Optional[str]:
    """Point the caches at ``cache_dir`` and load its portable artifacts; its absolute path."""
    if cache_dir is None:
        return None
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    _cache.point_caches(cache_dir, warns)
    _cache.load_artifacts(os.path.join(cache_dir, _cache.ARTIFACTS), warns)
    return cache_dir


def _plan(model, inputs, backward, options, dynamic, session_calls, cache_dir, iters):
    with _keep_grads(model, inputs):
        return _choice.choose(model, inputs, backward=backward, options=options, dynamic=dynamic,
                              session_calls=session_calls, cache_dir=cache_dir,
                              runs=max(iters, 3))


def _other_plan(choice, model, inputs, backward, iters, dynamic, cache_dir, warns, amortize_kw):
    """The compared plans named eager, Inductor or the model's own blocks: run that one."""
    with _keep_grads(model, inputs):
        eager = _timed(model, inputs, backward, iters) if iters > 0 else []
        before = ti.counters()
        with _stats.window() as w:
            clock = time.perf_counter()
            compiled = _choice.build(choice.plan, model, dynamic)
            _step(compiled, inputs, backward)
            first = time.perf_counter() - clock
            steps = _timed(compiled, inputs, backward, iters)
    if cache_dir is not None:
        _cache.save_artifacts(os.path.join(cache_dir, _cache.ARTIFACTS), warns)
    result = _result(first, steps, eager, _stats.cache_counts(before, ti.counters()), w.records,
                     cache_dir, warns, amortize_kw)
    result.plans = choice
    result.saved.why = f"plan {choice.plan} was chosen: not a convlower compile"
    log.info("%s", str(result).splitlines()[0])
    return compiled, result


def _measured(settled: list) -> str:
    """"3 measured (and 2 of the screen's clear wins)": the close calls first."""
    wins = sum(s.clear_win for s in settled)
    return f"{len(settled) - wins} measured" + \
        (f" (and {wins} of the screen's clear wins)" if wins else "")


def _settle_close_calls(budget_s: float) -> Settling:
    settled, seconds = [], 0.0
    if budget_s > 0 and _settle.pending():
        settled, _, seconds = _settle.settle(budget_s,
                                             progress=lambda m: log.info("convlower: %s", m))
    close, wins = _settle.waiting()
    return Settling(settled, left_open=close, seconds=seconds, clear_wins_left=wins)


def _recompile(start: WarmStart, inputs, backward: bool, iters: int) -> tuple[float, list, Any]:
    """A new compile of the model, its first call and ``iters`` timed steps.  The settled
    decisions are part of convlower's cache key: every graph compiles again, taking the
    measured choices."""
    clock = time.perf_counter()
    again = start.again()
    _step(again, inputs, backward)
    seconds = time.perf_counter() - clock
    start.note_compile(seconds)
    return seconds, _timed(again, inputs, backward, iters), again


def _first_compiled(start: WarmStart, inputs, backward: bool, iters: int,
                    cache_dir: Optional[str], warns: _cache.Warnings):
    """The compiled model, its first call (the compile, or the saved compile's load),
    ``iters`` timed steps, the cache counts and the compile records of both."""
    before = ti.counters()
    with _stats.window() as w:
        clock = time.perf_counter()
        try:
            compiled = start.first()
            _step(compiled, inputs, backward)
        except Exception as e:
            if cache_dir is None:
                raise
            _cache.fresh_inductor_dir(cache_dir, e, warns)  # a corrupt entry: start it over
            compiled = start.recover(e)
            _step(compiled, inputs, backward)
        first = time.perf_counter() - clock
        start.note_compile(first)
        steps = _timed(compiled, inputs, backward, iters)
    return compiled, first, steps, _stats.cache_counts(before, ti.counters()), w.records


def _result(first: float, steps: list, eager: list, counts: dict, records: list,
            cache_dir: Optional[str], warns: _cache.Warnings, amortize_kw: dict) -> WarmupResult:
    compile_s = max(first - (min(steps) if steps else 0.0), 0.0)
    verdict = None
    if steps and eager:
        spread = max(steps) - min(steps)
        verdict = amortize(_median(eager), _median(steps), compile_s, spread_s=spread, **amortize_kw)
    state = _cache_state(counts)
    return WarmupResult(
        compile_s=compile_s, first_step_s=first, cache=state, warm=state == "warm",
        cache_counts=counts, eager_steps_s=eager, compiled_steps_s=steps,
        statistics=_stats.totals(records), compiles=records, amortization=verdict,
        cache_dir=cache_dir, warnings=list(warns))
