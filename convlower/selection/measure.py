"""Measured selection: time the original convolution and each eligible rule, keep the winner.

Like Inductor's ``pad_mm``, a bounded compile-time micro-benchmark.  For one site it builds
real random tensors of the site's concrete sizes (size hints under dynamic shapes), device,
dtype and strides, and times each candidate **as Inductor compiles it** (eager timings
mislead: Inductor fuses a rule's copies and picks channels-last for the original conv).  The
function timed is the one the pass splices (:func:`convlower.decompositions.emission.build`).

Every candidate is compiled before any is timed (``COMPILE_BUDGET_S`` bounds it); then all are
timed in ``ROUNDS`` interleaved rounds.  A rule replaces the convolution only when its median
is faster by at least ``MARGIN`` (5%) and it won in every round: within noise the original
stays.  A close call (the best rule within a margin of the line, or two rules within a margin
of each other) is timed for ``ROUNDS`` more rounds (:func:`close_call`), within a budget of
its own: one look decided such calls on noise, so two measurements of one conv disagreed
(bench/bench_settle.py).  Rules that share an emission are compiled and timed once.  Timings
that are not positive and finite keep the original (:func:`convlower.selection.timer.plausible`).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from .. import device as _device
from .. import torch_internals as ti
from ..decompositions import emission
from ..decompositions.opaque_form import has_opaque_form
from ..lowerings.rule import Rule
from ..lowerings.site import ConvSite
from . import timer as _timer
from .cache import CACHE, decision_key
from .decision import OPAQUE, Decision, fastest_opaque, label, opaque_of
from .inputs import real_inputs

MARGIN = 0.05  # a rule must be at least 5% faster than the original convolution
BUDGET_S = float(os.environ.get("CONVLOWER_MEASURE_BUDGET_S", "3.0"))  # timing, per site
# a conv faster than this (eagerly) keeps the original without compiling candidates
MIN_CONV_S = float(os.environ.get("CONVLOWER_MEASURE_MIN_US", "200")) * 1e-6
# compiling the candidates, per site: past it, uncompiled rules are not measured
COMPILE_BUDGET_S = float(os.environ.get("CONVLOWER_MEASURE_COMPILE_BUDGET_S", "60"))
ROUNDS = 3  # candidates are timed in interleaved rounds, so a burst of load hits all of them
METHOD = "inductor-compiled/median/every-round/v3"  # how timings are taken: part of the key
# (v3: outputs leaving the graph keep eager's strides, as in the model; an opaque backward runs
# without its forward's GEMM)


def compiled_step(fn: Callable, args: list, prologue: Sequence[bool], epilogue: bool,
                  compile_log: dict, label: str) -> Callable[[], object]:
    """``fn(*args)`` as Inductor runs it inside the model, synchronised.  ``step.prepare()``
    compiles (untimed; the seconds go to ``compile_log[label]``).

    Inputs flagged in ``prologue`` go through a negation first, as an activation made by an
    op of the graph does: Inductor then picks its layout and fuses a rule's copies into that
    producer; a graph input has a fixed layout.  With ``epilogue`` the outputs feed a
    negation, as a conv output read by another op does; without, they materialise."""
    state = {}

    def graph(*inputs):
        inputs = [t.neg() if p else t for t, p in zip(inputs, prologue)]
        out = fn(*inputs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        return tuple(o.neg() if epilogue else o for o in outs)

    def prepare():
        if "fn" not in state:
            start = time.perf_counter()
            try:
                state["fn"] = ti.compile_inner(ti.trace_aten(graph, args), args,
                                               outputs_leave=not epilogue)
            finally:
                compile_log[label] = time.perf_counter() - start

    def step():
        prepare()
        out = state["fn"](list(args))  # boxed call: it consumes the list
        _device.sync(args[0].device)
        return out[0] if len(out) == 1 else tuple(out)

    step.prepare, step.compiled = prepare, lambda: "fn" in state
    step.eager = lambda: (fn(*args), _device.sync(args[0].device))  # for the tiny-conv check
    step.emission = fn
    return step


def benchmarks(site: ConvSite, candidates: Sequence[Rule], compute_dtype: Optional[str],
               compile_log: dict) -> dict[str, Callable]:
    """{label: step} for the original ("aten") and each distinct emission among the
    candidates (labelled by the first rule that uses it) in both its forms, traced and opaque
    (``OPAQUE``), compiled lazily."""
    args = real_inputs(site)
    prologue = (site.input_produced, False, False)
    # Grads mostly leave the graph (weight/bias grads always do): no epilogue in the backward.
    epilogue = site.output_consumed and not site.backward
    steps = {"aten": compiled_step(emission.build(site, None), args, prologue, epilogue,
                                   compile_log, "aten")}
    seen = set()
    for rule in candidates:
        if rule.emission in seen:
            continue
        seen.add(rule.emission)
        for opaque in (False, True) if has_opaque_form(rule) else (False,):
            name = label(rule.name, opaque)
            fn = emission.build(site, rule, compute_dtype, opaque)
            steps[name] = compiled_step(fn, args, prologue, epilogue, compile_log, name)
    return steps


class _Run:
    """One measurement's state: steps, per-round timings, compile seconds, problems."""

    def __init__(self, steps: dict):
        self.steps = steps
        self.rounds: dict[str, list[float]] = {}
        self.compile_log: dict[str, float] = {}
        self.errors: list[str] = []

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.rounds.items() if v}

    def drop(self, name: str, why: str) -> None:
        if name == "aten":
            raise RuntimeError(f"the original convolution cannot be timed: {why}")
        self.steps.pop(name, None)
        self.rounds.pop(name, None)
        self.errors.append(why)

    def over_budget(self, name: str) -> bool:
        """Drop rule ``name`` if it is not compiled yet and compiling used COMPILE_BUDGET_S."""
        step = self.steps[name]
        if name == "aten" or step.compiled() or sum(self.compile_log.values()) <= COMPILE_BUDGET_S:
            return False
        self.drop(name, f"{name} not measured: the compile budget ({COMPILE_BUDGET_S:.0f} s) "
                        f"is spent")
        return True

    def compile_all(self) -> None:
        for name, step in list(self.steps.items()):
            if self.over_budget(name):
                continue
            try:
                step.prepare()
            except Exception as e:  # a rule Inductor cannot compile here is not chosen
                self.drop(name, f"{name} failed to compile: {type(e).__name__}: {e}")

    def time_rounds(self, names: Optional[Sequence[str]] = None) -> None:
        """``ROUNDS`` interleaved rounds of ``names`` (every step by default)."""
        share = BUDGET_S / (len(self.steps) * ROUNDS)
        start = time.perf_counter()
        for i in range(ROUNDS):  # interleaved rounds
            if i and time.perf_counter() - start - sum(self.compile_log.values()) > BUDGET_S:
                break  # long ops: one round is all the budget allows
            for name in list(self.steps) if names is None else names:
                if name in self.steps and not self.over_budget(name):
                    self._time_one(name, share)

    def _time_one(self, name: str, share: float) -> None:
        try:
            seconds = _timer.timer()(name, self.steps[name], share)
        except Exception as e:  # a rule that fails here is not chosen
            self.drop(name, f"{name} failed: {type(e).__name__}: {e}")
            return
        problem = _timer.plausible(seconds)
        if problem:
            self.drop(name, f"{name}: {problem}")
        else:
            self.rounds.setdefault(name, []).append(float(seconds))


def decide(site: ConvSite, candidates: Sequence[Rule],
            compute_dtype: Optional[str] = None) -> Decision:
    """Time the original and the candidates; the fastest clear winner, or the original."""
    key = decision_key(site, candidates, compute_dtype, METHOD)
    hit = CACHE.lookup(key)
    by_name = {r.name: r for r in candidates}
    if hit is not None and (hit.get("rule") is None or hit.get("rule") in by_name):
        rule = by_name.get(hit.get("rule"))
        return Decision(rule, f"{hit.get('why', 'measured')} (cached)", "cache", 0.0,
                        dict(hit.get("timings", {})), opaque=opaque_of(hit, rule))
    start = time.perf_counter()
    try:
        with ti.fake_mode_off(), torch.no_grad(), ti.kernel_builds_quiet():  # built when loaded
            run = _Run({})
            run.steps = benchmarks(site, candidates, compute_dtype, run.compile_log)
            tiny = _tiny(run) if _timer.compile_first() else None
            if tiny is not None:
                decision = tiny
            else:
                if _timer.compile_first():
                    run.compile_all()
                run.time_rounds()
                again = close_call(clear_wins(run), run.medians()["aten"])
                if again:
                    run.time_rounds(again)
                decision = _verdict(run, by_name)
                if again:
                    decision.why += f"; a close call, timed twice ({', '.join(again)})"
    except Exception as e:  # cannot measure (e.g. out of memory): keep the original
        return Decision(None, f"measurement failed, kept the original: {type(e).__name__}: {e}",
                        "measurement", time.perf_counter() - start, {})
    decision.seconds = time.perf_counter() - start
    CACHE.store(key, {"rule": decision.rule.name if decision.rule else None,
                      "opaque": decision.opaque, "why": decision.why, "timings": decision.timings,
                      "compile_s": sum(run.compile_log.values())})
    return decision


def _tiny(run: _Run) -> Optional[Decision]:
    """Compiling candidates costs seconds; a conv that takes microseconds cannot win that
    back (and in sum is not where a model's time goes): keep the original, compile nothing."""
    quick = _timer.default_timer("aten", run.steps["aten"].eager, BUDGET_S / 10)
    if quick >= MIN_CONV_S:
        return None
    why = (f"measured: kept the original (it takes {quick * 1e6:.0f} us eagerly, under the "
           f"{MIN_CONV_S * 1e6:.0f} us worth compiling candidates for)")
    return Decision(None, why, "measurement", 0.0, {"aten_eager": quick})


def clear_wins(run: "_Run") -> dict[str, float]:
    """{label: median of all its rounds} for the rules that win clearly: faster than the
    original by the margin in the median of the rounds timed beside the original's, and in
    each of those rounds (a burst of load during one candidate's turn cannot make it win).
    A tie's second look times the rules only: its rounds order them, they do not decide
    whether they beat the original."""
    aten = run.rounds.get("aten", [])
    out = {}
    for name, rounds in run.rounds.items():
        n = min(len(rounds), len(aten))   # the rounds both were timed in
        if name == "aten" or not n:
            continue
        line = (1.0 - MARGIN) * statistics.median(aten[:n])
        if statistics.median(rounds[:n]) <= line and all(
                t <= (1.0 - MARGIN) * a for t, a in zip(rounds[:n], aten[:n])):
            out[name] = statistics.median(rounds)
    return out


def close_call(clear: dict[str, float], base: float) -> list[str]:
    """The labels a second look times again, or [] when one look decided; ``clear``: the
    first look's clear winners (:func:`clear_wins`), ``base``: the original's median.
    Marginal: the best is slower than (1 - 2 MARGIN) of the original, within a margin of the
    line; the original is timed again with the clear winners, and a win must hold in every
    round of both looks.  A tie: a second rule is within a margin of the best; the clear
    winners are timed again and ordered on all their rounds.  A rule that lost a round of the
    first look is not timed again: it cannot win any more.  The two forms of one rule are not
    rivals: their tie is decided by _cheaper_form."""
    best_of: dict[str, float] = {}
    for n, t in clear.items():
        rule = n.removesuffix(OPAQUE)
        best_of[rule] = min(t, best_of.get(rule, t))
    ranked = sorted(best_of.values())
    if not ranked:
        return []
    if ranked[0] > (1.0 - 2 * MARGIN) * base:
        return ["aten", *clear]
    return list(clear) if len(ranked) > 1 and ranked[1] < (1.0 + MARGIN) * ranked[0] else []


def _verdict(run: _Run, by_name: dict) -> Decision:
    timings = run.medians()
    if "aten" not in timings:
        raise RuntimeError("the original convolution was not timed")
    base = timings["aten"]
    ranked = sorted((n for n in timings if n != "aten"), key=timings.get)
    best = ranked[0] if ranked else None
    # The fastest clear winner wins: one round of the fastest lost in noise need not keep the
    # original over a rule that clearly won (ViT fp32: patchify_mm 0.80x, eager_conv 0.83x).
    clear = clear_wins(run)
    wins = bool(clear)
    if wins:
        best = _cheaper_form(min(clear, key=clear.get), clear)
        rule = by_name[best.removesuffix(OPAQUE)]
        why = f"measured: {best} takes {timings[best] / base:.2f}x the original's time"
    else:
        shown = f"best rule {best} takes {timings[best] / base:.2f}x" if best else "no rule ran"
        rule, why = None, f"measured: kept the original ({shown}; a rule must be >= " \
                          f"{MARGIN:.0%} faster in every round)"
    compile_s = sum(run.compile_log.values())
    opaque = bool(wins and best.endswith(OPAQUE))
    if compile_s:
        why += f"; compiling the candidates took {compile_s:.1f} s"
    if run.errors:
        why += "; " + "; ".join(run.errors)
    return Decision(rule, why, "measurement", 0.0, timings, opaque=opaque)


def _cheaper_form(best: str, clear: dict) -> str:
    """``best``, or the fastest opaque form among the clear winners ``clear`` (label ->
    median) when ``best`` does not beat it by the margin: within noise, the choice with no
    kernels to generate (Wan DiT's bf16 patch conv: compiled time_fold_conv2d 0.39x the
    original, patchify_mm's opaque form 0.40x, for ~2 s less C++ to build)."""
    cheap = fastest_opaque(clear)
    if cheap is None or best.endswith(OPAQUE):
        return best
    return cheap if clear[best] > (1.0 - MARGIN) * clear[cheap] else best
