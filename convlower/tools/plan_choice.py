"""``convlower.warmup(..., compare_plans=True)``: which plan this model runs, measured once.

The first such warm-up compares the plans side by side on the user's own model
(:mod:`.plans`: Inductor and convlower on the whole graph, convlower with regions, the model's
own ``compile_repeated_blocks()`` where it has one; cold compile, warm compile, step, errors)
and names the plan with the least total time over a session of ``session_calls`` calls (the
spike's rule; eager when no plan pays).  With a ``cache_dir`` later sessions load their compile
warm, so the warm totals decide, and the choice is written to ``<cache_dir>/plans.json``, keyed
by the model's identity and the question asked: the next warm-up reads it and compiles only
the chosen plan.  A plan whose output is off from eager's (beyond ``MAX_REL_ERR``) is not chosen.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Callable, Optional

import torch

from ..backend.options import parse as parse_options
from ..device import tensors
from ..regions import clear as clear_regions
from ..saved import identity as _identity
from . import plans as _plans
from . import session_cache as _cache
from .spike import SpikeConfig
from .spike_report import plan_for_session
from .spike_runner import Progress, Runner, own_blocks

log = logging.getLogger("convlower")
FILE = "plans.json"
CONVLOWER_PLANS = ("convlower", "convlower-regions")
MAX_REL_ERR = {torch.float32: 1e-3, torch.float64: 1e-6}  # else (bf16, fp16): 5e-2
_FIGURES = ("cold_compile_s", "warm_compile_s", "step_median_s", "break_even_calls",
            "break_even_calls_warm", "max_rel_err", "verdict", "error")


@dataclasses.dataclass
class PlanChoice:
    plan: str                 # "eager" | "inductor" | "convlower" | "convlower-regions" | "blocks"
    state: str                # "compared" (measured in this warm-up) | "remembered" (plans.json)
    session_calls: int
    by: str                   # "warm" | "cold": which compile cost decided
    totals_s: dict            # plan -> {"cold": s, "warm": s} over the session
    figures: dict             # plan -> the figures of _FIGURES
    seconds: float = 0.0      # what comparing cost in this warm-up (0 when remembered)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        how = (f"compared in {self.seconds:.1f} s" if self.state == "compared"
               else "remembered from an earlier warm-up")
        out = [f"  plan: {self.plan} for sessions of {self.session_calls} calls ({how}; "
               f"{self.by} compile + steps)"]
        for plan, f in self.figures.items():
            if f.get("error"):
                out.append(f"    {plan:18} failed: {f['error']}")
                continue
            total = self.totals_s.get(plan, {}).get(self.by)
            out.append(f"    {plan:18} cold {_s(f.get('cold_compile_s'))}, warm "
                       f"{_s(f.get('warm_compile_s'))}, step {_s(f.get('step_median_s'))}, "
                       f"session {_s(total)}: {f.get('verdict', '')}")
        return out


def _s(v) -> str:
    return "-" if v is None else f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


def choose(model, inputs: tuple, *, backward: bool, options: Optional[dict], dynamic,
           session_calls: int, cache_dir: Optional[str], runs: int = 5) -> PlanChoice:
    """The plan for ``model``: remembered in ``cache_dir`` for the same question, else measured."""
    if session_calls < 1:
        raise ValueError(f"session_calls must be >= 1, got {session_calls}")
    context = {"question": "plans", "session_calls": session_calls, "backward": backward,
               "options": options or {}, "dynamic": dynamic}
    ident = _identity.identity(model, inputs, context)
    key = _identity.slot(ident)
    path = os.path.join(cache_dir, FILE) if cache_dir else None
    known = _read(path).get(key) if path else None
    if isinstance(known, dict) and known.get("identity") == ident:
        try:
            return PlanChoice(**{**known["choice"], "state": "remembered", "seconds": 0.0})
        except (KeyError, TypeError) as e:
            log.warning("convlower: ignoring a malformed entry of %s (%s); comparing plans again",
                        path, e)
    choice = _compare(model, inputs, backward, options, dynamic, session_calls,
                      by="warm" if cache_dir else "cold", runs=runs)
    if path:
        table = _read(path)
        table[key] = {"identity": ident, "choice": choice.to_dict()}
        _cache.write_atomic(path, json.dumps(table, indent=1, default=str).encode())
    return choice


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("convlower: ignoring unreadable %s (%s); comparing plans again", path, e)
        return {}


def _compare(model, inputs, backward, options, dynamic, session_calls, by, runs) -> PlanChoice:
    clock = time.perf_counter()
    device = next((t.device for t in tensors(inputs)), torch.device("cpu"))
    cfg = SpikeConfig(model="(the warm-up's model)", device=str(device), backward=backward,
                      dynamic=dynamic is True, options=dict(options or {}), progress=False,
                      runs=runs, warmup=1, session_calls=session_calls, settle_budget_s=0.0)
    run = Runner(model, inputs, cfg)
    progress = Progress(log.isEnabledFor(logging.INFO))
    t0 = time.perf_counter()
    run.step("eager")
    run.results["eager"] = {"backend": "eager", "first_call_s": time.perf_counter() - t0}
    run.reference = run.values("eager")
    _plans.prime_process()
    inductor_options = dict(parse_options(options, env={}).inductor)  # Inductor plans: the same config
    results, _, _ = _plans.compare(run, inductor_options, progress, runs=runs, warmup=1,
                                   settle_budget_s=0.0)
    _drop_inexact(results, _dtype(inputs))
    torch.compiler.reset()  # the chosen plan is compiled afresh by the warm-up
    clear_regions()
    if backward:
        for p in run.leaves:
            p.grad = None
    session = plan_for_session(results, session_calls)
    plan = session["plan"] if by == "cold" else session["plan_warm"]
    figures = {b: {k: r.get(k) for k in _FIGURES} for b, r in results.items() if b != "eager"}
    return PlanChoice(plan=plan or "eager", state="compared", session_calls=session_calls, by=by,
                      totals_s=session["totals_s"], figures=figures,
                      seconds=time.perf_counter() - clock)


def _dtype(inputs) -> torch.dtype:
    return next((t.dtype for t in tensors(inputs) if t.is_floating_point()), torch.float32)


def _drop_inexact(results: dict, dtype: torch.dtype) -> None:
    """A plan whose output strays from eager's cannot be chosen: marked failed."""
    bound = MAX_REL_ERR.get(dtype, 5e-2)
    for b, r in results.items():
        err = r.get("max_rel_err")
        if b != "eager" and r.get("error") is None and err is not None and not err <= bound:
            r["error"] = f"output differs from eager's (relative error {err:.2e} > {bound:.0e})"


def build(plan: str, model, dynamic) -> Callable:
    """The callable of a plan that is not a convlower compile.  ``blocks`` compiles the
    model's own repeated blocks in place, as ``model.compile_repeated_blocks()`` would."""
    if plan == "eager":
        return model
    if plan == "inductor":
        return torch.compile(model, backend="inductor", dynamic=dynamic if isinstance(dynamic, bool) else None)
    if plan == "blocks":
        own_blocks(model).compile_repeated_blocks(backend="inductor")
        return model
    raise ValueError(f"unknown plan {plan!r}")
