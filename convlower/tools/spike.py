"""A compile spike: should I compile this model, and with what?

The experiment users write by hand before adopting ``torch.compile``, as one function.  In one
process it runs the model eagerly, under ``backend="inductor"`` and under
``backend="convlower"`` and measures, per backend:

* cold compile: the first call after ``torch.compiler.reset()`` with Inductor's caches off;
* warm compile: the first call after a reset with the caches on and populated (a first
  cache-filling compile runs in between, untimed, unless the caches already had the graphs);
* steady-state step time: ``runs`` rounds after ``warmup`` untimed rounds, the three backends
  interleaved in a rotating order so drift in machine load hits them alike (median and
  interquartile range);
* graph breaks, recompiles and graphs of the cold compile; which convolutions convlower
  lowered with which rule (``convlower.report()``); the largest error against eager;
* speed-up, break-even calls and verdict (:func:`convlower.tools.amortize.amortize`), from
  the cold compile (the conservative case) and, as a second opinion, the warm one.

"Compile cost" is the first call minus one compiled step, so the cumulative time of ``n``
compiled calls is ``compile_s + n * step``: the curve ``plot`` draws.  The machinery is in
:mod:`.spike_runner`, the recommendation, report and plot in :mod:`.spike_report`.
"""
from __future__ import annotations

import dataclasses
import importlib
import warnings

import torch

from .. import torch_internals as ti
from ..backend.options import OptionError, parse
from ..observe import stats
from ..observe.report import report as conv_report, reset_report
from ..selection import close_calls
from ..regions import clear as clear_regions
from ..version import __version__
from . import zoo
from .amortize import amortize
from .spike_report import format_report, plot, recommend  # noqa: F401  (the spike's API)
from .spike_runner import (BACKENDS, COMPILED, Progress, Runner, SpikeError,  # noqa: F401
                           compile_counts, errors, first_line, step_stats)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class SpikeConfig:
    model: str = zoo.DEFAULT  # zoo name or "package.module:factory"
    size: str = "small"  # zoo size (ignored for factories)
    dtype: str = "float32"
    device: str = "cpu"
    runs: int = 20
    warmup: int = 3
    dynamic: bool = False
    backward: bool = False
    options: dict = dataclasses.field(default_factory=dict)  # convlower options
    progress: bool = True
    session_calls: int = 1000  # the session length the recommendation names a plan for
    settle_budget_s: float = 120.0  # measuring convlower's close calls after its warm compile


# -- the model ---------------------------------------------------------------------------------
def resolve(model: str, size: str = "small") -> tuple[torch.nn.Module, tuple, dict]:
    """``(module, example_inputs, description)`` for a zoo name or ``package.module:factory``."""
    if ":" in model:
        mod_name, _, attr = model.partition(":")
        if not mod_name or not attr:
            raise SpikeError(f"bad factory {model!r}: expected 'package.module:function'")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:
            raise SpikeError(f"cannot import {mod_name!r} for factory {model!r}: "
                             f"{type(e).__name__}: {e}") from None
        factory = getattr(mod, attr, None)
        if not callable(factory):
            raise SpikeError(f"factory {model!r}: module {mod_name!r} has no function {attr!r}")
        try:
            made = factory()
        except Exception as e:
            raise SpikeError(f"factory {model!r} raised {type(e).__name__}: {e}") from None
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and callable(made[0])
                and isinstance(made[1], (tuple, list))):
            raise SpikeError(f"factory {model!r} must return (model, example_inputs) with "
                             f"example_inputs a tuple, got {type(made).__name__}")
        return made[0], tuple(made[1]), {"source": "factory", "factory": model}
    if model not in zoo.ZOO:
        raise SpikeError(f"unknown model {model!r}: use a zoo name ({', '.join(zoo.ZOO)}) or "
                         f"'package.module:factory'")
    if size not in zoo.ZOO[model].configs:
        raise SpikeError(f"unknown size {size!r}; valid sizes: {', '.join(zoo.SIZES)}")
    entry = zoo.ZOO[model]
    try:
        m, inputs = entry.build(size)
    except ImportError as e:
        raise SpikeError(f"zoo model {model!r} needs {entry.needs or 'a missing package'}: {e}") from None
    return m, inputs, {"source": "zoo", "size": size, "config": _jsonable(entry.configs[size]),
                       "summary": entry.summary}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def _to(x, dtype, device):
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, dtype, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, dtype, device) for k, v in x.items()}
    return x


def _conv_rows(rep: dict) -> list[dict]:
    rows = []
    for c in rep.get("convolutions", []):
        call = c["call"]
        rows.append({"graph": c["graph"], "phase": c["phase"], "node": c["node"],
                     "input": "x".join(call["input"]), "kernel": "x".join(call["weight"][2:]),
                     "stride": list(call["stride"]), "padding": list(call["padding"]),
                     "dtype": call["dtype"], "rule": c["rule"], "reason": c["reason"]})
    return rows


def _prime_process() -> None:
    """Compile a trivial function once, so the first backend measured does not also pay the
    process's one-time start-up (Inductor imports, compile workers, C++ header)."""
    torch.compiler.reset()
    torch.compile(lambda x: (x + 1).sin(), backend="inductor")(torch.ones(4))
    torch.compiler.reset()




# -- the experiment, phase by phase --------------------------------------------------------------
def run_spike(cfg: SpikeConfig) -> dict:
    """Run the experiment; return everything it measured as a JSON-ready dict."""
    inductor_options = _checked(cfg)
    progress = Progress(cfg.progress)
    model, inputs, desc = resolve(cfg.model, cfg.size)
    run = Runner(*_moved(model, inputs, cfg), cfg)
    eager_first, reference = _eager(run, cfg, progress)
    progress.say("paying the process's one-time compile start-up (imports, worker pool)")
    _prime_process()
    results: dict[str, dict] = {"eager": {"backend": "eager", "first_call_s": eager_first}}
    decisions: dict = {}
    for backend in COMPILED:
        results[backend], found = _compile(run, backend, inductor_options, progress,
                                           cfg.settle_budget_s)
        decisions = found or decisions
    steady = _steady_state(run, results, inductor_options, cfg, progress)
    _verdicts(run, results, reference)
    _conv_results(results, decisions)
    return {
        "model": cfg.model, **desc, "dtype": cfg.dtype, "device": cfg.device, "runs": cfg.runs,
        "warmup": cfg.warmup, "dynamic": cfg.dynamic, "backward": cfg.backward,
        "options": _jsonable(cfg.options), "torch": torch.__version__, "convlower": __version__,
        "steady_state_compiles": steady["frames_compiled"],
        "backends": results, "recommendation": recommend(results, cfg.session_calls),
    }


def _checked(cfg: SpikeConfig) -> dict:
    """Refuse bad settings before anything runs; return the Inductor options."""
    if cfg.dtype not in DTYPES:
        raise SpikeError(f"unknown dtype {cfg.dtype!r}; valid: {', '.join(DTYPES)}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpikeError("--device cuda: no CUDA device is available")
    if cfg.settle_budget_s < 0:
        raise SpikeError(f"need settle_budget_s >= 0, got {cfg.settle_budget_s}")
    if cfg.runs < 1 or cfg.warmup < 0:
        raise SpikeError(f"need runs >= 1 and warmup >= 0, got runs={cfg.runs}, warmup={cfg.warmup}")
    try:
        return dict(parse(cfg.options, env={}).inductor)
    except OptionError as e:
        raise SpikeError(f"bad --options: {e}") from None


def _moved(model, inputs, cfg: SpikeConfig) -> tuple:
    dtype = DTYPES[cfg.dtype]
    try:
        if isinstance(model, torch.nn.Module):
            model = model.to(device=cfg.device, dtype=dtype).eval()
        return model, _to(inputs, dtype, cfg.device)
    except Exception as e:
        raise SpikeError(f"cannot move the model to {cfg.device} / {cfg.dtype}: "
                         f"{type(e).__name__}: {e}") from None


def _eager(run: Runner, cfg: SpikeConfig, progress: Progress) -> tuple[float, list]:
    """The first eager call's time and eager's values, the reference for the error check."""
    progress.say(f"{cfg.model}: eager")
    try:
        first, _ = run.timed("eager")
        reference = run.values("eager")
    except Exception as e:
        raise SpikeError(f"model {cfg.model!r} fails in eager mode: {first_line(e)}") from None
    if not reference:
        raise SpikeError(f"model {cfg.model!r} returned no tensor")
    return first, reference


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
    """Measure the close calls the cold compile's screen left (selection/close_calls.py)."""
    if budget_s <= 0 or not close_calls.open_calls():
        return
    progress.say(f"convlower: measuring {close_calls.open_calls()} close call(s) compiled")
    settled, left, seconds = close_calls.settle(budget_s, progress=progress.say)
    res["settling"] = {"settled": [s.to_dict() for s in settled], "left_open": left,
                       "seconds": seconds}


def _steady_state(run, results, inductor_options, cfg, progress) -> dict:
    """Every backend that compiled, interleaved in a rotating order; the compile counts of
    the timed rounds (any compile there is in the step times)."""
    torch.compiler.reset()
    live = ["eager"] + [b for b in COMPILED if results[b]["error"] is None]
    for backend in live[1:]:
        try:
            run.compile(backend, inductor_options)
            run.step(backend)
        except Exception as e:
            results[backend]["error"] = f"{type(e).__name__}: {e}"
            live.remove(backend)
    times: dict[str, list[float]] = {b: [] for b in live}
    with compile_counts() as steady:
        for r in progress.rounds(cfg.warmup + cfg.runs, f"{cfg.runs} timed rounds"):
            for i in range(len(live)):
                backend = live[(r + i) % len(live)]
                t, _ = run.timed(backend)
                if r >= cfg.warmup:
                    times[backend].append(t)
    for backend in live:
        results[backend].update(step_stats(times[backend]))
    return steady


def _verdicts(run: Runner, results: dict, reference: list) -> None:
    """Errors against eager, compile costs, speed-up, break-even and verdict per backend."""
    eager_step = results["eager"]["step_median_s"]
    for backend in COMPILED:
        res = results[backend]
        if res["error"] is not None:
            res.update(verdict="compile failed", verdict_code="failed", reason=res["error"])
            continue
        res["max_abs_err"], res["max_rel_err"] = errors(run.values(backend), reference)
        step = res["step_median_s"]
        res["cold_compile_s"] = max(res["cold_first_call_s"] - step, 0.0)
        res["warm_compile_s"] = max(res["warm_first_call_s"] - step, 0.0)
        cold = amortize(eager_step, step, res["cold_compile_s"], spread_s=res["step_iqr_s"])
        warm = amortize(eager_step, step, res["warm_compile_s"], spread_s=res["step_iqr_s"])
        res.update(speedup=cold.speedup, break_even_calls=cold.break_even_calls,
                   break_even_calls_warm=warm.break_even_calls, verdict=cold.verdict,
                   verdict_code=cold.code, reason=cold.reason, amortization=cold.to_dict(),
                   amortization_warm=warm.to_dict())


def _conv_results(results: dict, decisions: dict) -> None:
    """Which convolutions convlower lowered with which rule, and its Snake sites."""
    results["convlower"]["convolutions"] = convs = _conv_rows(decisions)
    lowered: dict[str, int] = {}
    for c in convs:
        if c["rule"]:
            lowered[c["rule"]] = lowered.get(c["rule"], 0) + 1
    results["convlower"]["lowered_by_rule"] = lowered
    results["convlower"]["snake"] = [{k: s.get(k) for k in ("graph", "node", "variant", "dtype", "route", "why")}
                                     for s in decisions.get("snake", [])]
    results["inductor"]["convolutions"], results["inductor"]["lowered_by_rule"] = [], {}
