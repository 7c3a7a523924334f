"""A compile spike: should I compile this model, and with what?

The experiment users write by hand before adopting ``torch.compile``, as one function.  In one
process it runs the model eagerly and under each plan (:mod:`.plans`: Inductor and convlower on
the whole graph, convlower with regions, the model's own ``compile_repeated_blocks()`` where it
has one) and measures, per plan:

* cold compile: the first call after ``torch.compiler.reset()`` with Inductor's caches off;
* warm compile: the first call after a reset with the caches on and populated (a first
  cache-filling compile runs in between, untimed, unless the caches already had the graphs);
* steady-state step time: ``runs`` rounds after ``warmup`` untimed rounds, the plans
  interleaved in a rotating order so drift in machine load hits them alike (median and
  interquartile range);
* graph breaks, recompiles and graphs of the cold compile; which convolutions convlower
  lowered with which rule (``convlower.report()``); the largest error against eager;
* speed-up, break-even calls and verdict (:func:`convlower.tools.amortize.amortize`), from
  the cold compile (the conservative case) and, as a second opinion, the warm one.

"Compile cost" is the first call minus one compiled step, so the cumulative time of ``n``
compiled calls is ``compile_s + n * step``: the curve ``plot`` draws.  The machinery is in
:mod:`.spike_runner` and :mod:`.plans`, the recommendation, report and plot in
:mod:`.spike_report`.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch

from ..backend.options import OptionError, parse
from ..version import __version__
from . import plans, zoo
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
    settle_budget_s: float = 120.0  # measuring convlower's close calls (then its clear wins)


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


# -- the experiment, phase by phase --------------------------------------------------------------
def run_spike(cfg: SpikeConfig) -> dict:
    """Run the experiment; return everything it measured as a JSON-ready dict."""
    inductor_options = _checked(cfg)
    progress = Progress(cfg.progress)
    model, inputs, desc = resolve(cfg.model, cfg.size)
    run = Runner(*_moved(model, inputs, cfg), cfg)
    eager_first, run.reference = _eager(run, cfg, progress)
    progress.say("paying the process's one-time compile start-up (imports, worker pool)")
    plans.prime_process()
    run.results["eager"] = {"backend": "eager", "first_call_s": eager_first}
    results, decisions, steady = plans.compare(run, inductor_options, progress, runs=cfg.runs,
                                               warmup=cfg.warmup, settle_budget_s=cfg.settle_budget_s)
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
    for plan in ("inductor", "blocks"):  # Inductor alone: no convlower records
        if plan in results:
            results[plan]["convolutions"], results[plan]["lowered_by_rule"] = [], {}
