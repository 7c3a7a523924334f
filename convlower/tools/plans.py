"""Plans side by side on one model: cold compile, warm compile, step, errors, verdicts.

The plans (:data:`.spike_runner.COMPILED`) are Inductor on the whole graph, convlower on the
whole graph, convlower with each repeated block compiled once (``regions``) and, where the
model has one, its own ``compile_repeated_blocks()`` (diffusers).  :func:`compare` runs them
all in this process on a :class:`.spike_runner.Runner` (eager's first call and values are the
caller's): the spike runs it on a model named on the command line, ``convlower.warmup(...,
compare_plans=True)`` on the user's own model.
"""
from __future__ import annotations

import warnings

import torch

from .. import torch_internals as ti
from ..observe import stats
from ..observe.report import report as conv_report, reset_report
from ..regions import clear as clear_regions
from ..selection import close_calls
from .amortize import amortize
from .spike_runner import Progress, Runner, compile_counts, errors, first_line, step_stats


def prime_process() -> None:
    """Compile a trivial function once, so the first plan measured does not also pay the
    process's one-time start-up (Inductor imports, compile workers, C++ header)."""
    torch.compiler.reset()
    torch.compile(lambda x: (x + 1).sin(), backend="inductor")(torch.ones(4))
    torch.compiler.reset()


def compare(run: Runner, inductor_options: dict, progress: Progress, *, runs: int,
            warmup: int, settle_budget_s: float) -> tuple[dict, dict, dict]:
    """Every plan the model has, compiled cold and warm, then all steps interleaved (``warmup``
    untimed and ``runs`` timed rounds).  Returns ``(results, decisions, steady)``: per plan
    the figures (``results["eager"]`` must hold eager's first call already), convlower's
    decisions of its cold compile, and the compile counts of the timed rounds."""
    decisions: dict = {}
    for backend in run.plans():
        run.results[backend], found = _compile(run, backend, inductor_options, progress,
                                               settle_budget_s)
        decisions = found or decisions
    steady = _steady_state(run, inductor_options, runs, warmup, progress)
    _verdicts(run)
    return run.results, decisions, steady


def _compile(run: Runner, backend: str, inductor_options: dict, progress: Progress,
             budget_s: float) -> tuple[dict, dict]:
    """Cold and warm compile of one backend, and convlower's decisions of the cold one; a
    failure is recorded, not raised."""
    res: dict = {"backend": backend, "error": None}
    decisions: dict = {}
    try:
        decisions = _cold_compile(run, backend, inductor_options, progress, res)
        _warm_compile(run, backend, inductor_options, progress, res)
        if backend == "convlower":  # as a warm-up would: the steady state runs the result
            _settle(res, budget_s, progress)
    except Exception as e:
        res["error"] = first_line(e)
        progress.say(f"{backend}: compile failed: {res['error']}")
    return res, decisions


def _cold_compile(run, backend, inductor_options, progress, res) -> dict:
    progress.say(f"{backend}: cold compile (caches off)")
    torch.compiler.reset()
    clear_regions()  # compiled regions are shared within a process: a cold compile starts empty
    if backend.startswith("convlower"):
        reset_report()
    with ti.inductor_caches_off(), compile_counts() as counts, \
            stats.window() as window, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*force_disable_caches")
        run.compile(backend, inductor_options)
        res["cold_first_call_s"], _ = run.timed(backend)
        run.step(backend)  # a second call shows recompiles (e.g. state changed by call 1)
    res.update(counts)
    if backend == "convlower-regions":
        rep = conv_report()  # one snapshot of the records (each call copies them all)
        regs = rep.regions
        res["regions"] = {"parts": len(regs), "compiled": sum(r.how == "compiled" for r in regs),
                          "reused": sum(r.how == "reused" for r in regs)}
        rules = [c.rule for c in rep.convolutions if c.rule]
        res["lowered_by_rule"] = {r: rules.count(r) for r in sorted(set(rules))}
    if backend != "convlower":
        return {}
    totals = stats.totals(window.records)
    res["compile_phases_s"] = totals["phases_s"]  # where the time went
    res["graph_break_details"] = totals["graph_breaks"]  # reason, GB code, frame and code line
    return conv_report().to_dict()


def _warm_compile(run, backend, inductor_options, progress, res) -> None:
    progress.say(f"{backend}: warm compile (caches on)")
    torch.compiler.reset()
    clear_regions()
    with compile_counts() as fill:
        run.compile(backend, inductor_options)
        first, _ = run.timed(backend)
    c = fill["cache"]
    if c["fx_graph_miss"] or c["aot_autograd_miss"] or not (c["fx_graph_hit"] or c["aot_autograd_hit"]):
        torch.compiler.reset()  # that call filled the caches; the next one reads them
        with compile_counts() as fill:
            run.compile(backend, inductor_options)
            first, _ = run.timed(backend)
    res["warm_first_call_s"] = first
    res["warm_cache"] = fill["cache"]


def _settle(res: dict, budget_s: float, progress: Progress) -> None:
    """Measure the close calls the cold compile's screen left, then its clear wins
    (selection/close_calls.py)."""
    close, wins = close_calls.waiting()
    if budget_s <= 0 or not close + wins:
        return
    progress.say(f"convlower: measuring {close} close call(s) and {wins} clear win(s) compiled")
    settled, _, seconds = close_calls.settle(budget_s, progress=progress.say)
    close, wins = close_calls.waiting()
    res["settling"] = {"settled": [s.to_dict() for s in settled], "left_open": close,
                       "seconds": seconds, "clear_wins_left": wins}


def _steady_state(run, inductor_options, runs: int, warmup: int, progress) -> dict:
    """Every backend that compiled, interleaved in a rotating order; the compile counts of
    the timed rounds (any compile there is in the step times)."""
    results = run.results
    torch.compiler.reset()
    live = ["eager"] + [b for b in run.plans() if results[b]["error"] is None]
    for backend in live[1:]:
        try:
            run.compile(backend, inductor_options)
            run.step(backend)
        except Exception as e:
            results[backend]["error"] = f"{type(e).__name__}: {e}"
            live.remove(backend)
    times: dict[str, list[float]] = {b: [] for b in live}
    with compile_counts() as steady:
        for r in progress.rounds(warmup + runs, f"{runs} timed rounds"):
            for i in range(len(live)):
                backend = live[(r + i) % len(live)]
                t, _ = run.timed(backend)
                if r >= warmup:
                    times[backend].append(t)
    for backend in live:
        results[backend].update(step_stats(times[backend]))
    return steady


def _verdicts(run: Runner) -> None:
    """Errors against eager, compile costs, speed-up, break-even and verdict per backend."""
    results = run.results
    eager_step = results["eager"]["step_median_s"]
    for backend in run.plans():
        res = results[backend]
        if res["error"] is not None:
            res.update(verdict="compile failed", verdict_code="failed", reason=res["error"])
            continue
        res["max_abs_err"], res["max_rel_err"] = errors(run.values(backend), run.reference)
        step = res["step_median_s"]
        res["cold_compile_s"] = max(res["cold_first_call_s"] - step, 0.0)
        res["warm_compile_s"] = max(res["warm_first_call_s"] - step, 0.0)
        cold = amortize(eager_step, step, res["cold_compile_s"], spread_s=res["step_iqr_s"])
        warm = amortize(eager_step, step, res["warm_compile_s"], spread_s=res["step_iqr_s"])
        res.update(speedup=cold.speedup, break_even_calls=cold.break_even_calls,
                   break_even_calls_warm=warm.break_even_calls, verdict=cold.verdict,
                   verdict_code=cold.code, reason=cold.reason, amortization=cold.to_dict(),
                   amortization_warm=warm.to_dict())


