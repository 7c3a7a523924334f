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
* speed-up, break-even calls and verdict (:func:`convlower.backend.amortize.amortize`), from
  the cold compile (the conservative case) and, as a second opinion, the warm one.

"Compile cost" is the first call minus one compiled step, so the cumulative time of ``n``
compiled calls is ``compile_s + n * step``: the curve ``plot`` draws.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch

from .. import torch_internals as _ti
from ..backend.options import OptionError, parse
from ..lowerings import RULES
from ..observe import stats as _stats
from ..observe.report import report as conv_report, reset_report
from ..version import __version__
from . import zoo
from .amortize import DONT, amortize

BACKENDS = ("eager", "inductor", "convlower")
COMPILED = ("inductor", "convlower")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SpikeError(Exception):
    """A problem the user can fix; the CLI prints its message as one line."""


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


def _tensors(x) -> list[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, tuples, lists, dicts, ModelOutput."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):  # includes transformers' ModelOutput
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    return []


# -- statistics of one compile phase ---------------------------------------------------------
class _Watch:
    """Graph breaks, recompiles, graphs and cache hits of the compiles inside a ``with``.

    Reads Dynamo's counters and compilation metrics (through the wrappers in
    :mod:`convlower.backend.stats`) as deltas, so it works for any backend and changes no
    state.  A frame recompiled only because another backend owns its cache entry
    (``BACKEND_MATCH``) is not counted as a recompile: the spike causes those itself.
    """

    def __enter__(self):
        self._counters = _ti.counters()
        self._seen = {id(m) for m in _ti.compilation_metrics()}
        return self

    def __exit__(self, *exc):
        after = _ti.counters()
        new = [m for m in _ti.compilation_metrics() if id(m) not in self._seen]
        before = self._counters.get("graph_break", {})
        breaks = {k: v - before.get(k, 0) for k, v in after.get("graph_break", {}).items()}
        self.graph_break_reasons = sorted(k for k, v in breaks.items() if v > 0)
        self.graph_breaks = sum(max(v, 0) for v in breaks.values())
        reasons = [m.recompile_reason for m in new if m.recompile_reason
                   and "BACKEND_MATCH" not in m.recompile_reason]
        self.recompiles = len(reasons)
        self.recompile_reasons = reasons
        self.frames_compiled = len(new)
        graphs = lambda c: c.get("stats", {}).get("unique_graphs", 0)
        self.graphs = graphs(after) - graphs(self._counters)
        total = lambda f: sum(getattr(m, f, 0) or 0 for m in new)
        self.cache = {"fx_hits": total("inductor_fx_local_cache_hit_count"),
                      "fx_misses": total("inductor_fx_local_cache_miss_count"),
                      "aot_hits": total("aotautograd_local_cache_hit_count"),
                      "aot_misses": total("aotautograd_local_cache_miss_count")}
        return False

    def to_dict(self) -> dict:
        return {"graph_breaks": self.graph_breaks, "graph_break_reasons": self.graph_break_reasons,
                "recompiles": self.recompiles, "recompile_reasons": self.recompile_reasons,
                "graphs": self.graphs, "frames_compiled": self.frames_compiled, "cache": self.cache}


# -- progress ----------------------------------------------------------------------------------
class _Progress:
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


# -- the experiment ----------------------------------------------------------------------------
class _Runner:
    """The model, its inputs and one step (forward, or forward + backward) per backend."""

    def __init__(self, model, inputs, cfg: SpikeConfig):
        self.model, self.inputs, self.cfg = model, inputs, cfg
        self.device = torch.device(cfg.device)
        params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "parameters") else []
        if cfg.backward and not params:  # nothing to train: differentiate the inputs instead
            self.inputs = tuple(x.detach().requires_grad_() if isinstance(x, torch.Tensor)
                                and x.is_floating_point() else x for x in inputs)
            params = [x for x in self.inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        self.leaves = params
        self.cotangents: Optional[list[torch.Tensor]] = None
        self.compiled: dict[str, Callable] = {}

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def compile(self, backend: str, inductor_options: dict):
        kw: dict[str, Any] = {"dynamic": True if self.cfg.dynamic else None}
        opts = self.cfg.options if backend == "convlower" else inductor_options
        if opts:
            kw["options"] = dict(opts)
        self.compiled[backend] = torch.compile(self.model, backend=backend, **kw)

    def step(self, backend: str):
        fn = self.model if backend == "eager" else self.compiled[backend]
        if not self.cfg.backward:
            with torch.no_grad():
                return fn(*self.inputs)
        for p in self.leaves:
            p.grad = None
        out = fn(*self.inputs)
        outs = [t for t in _tensors(out) if t.requires_grad]
        if self.cotangents is None:  # fixed random cotangents, drawn once from eager's output
            g = torch.Generator().manual_seed(0)
            self.cotangents = [torch.randn(t.shape, generator=g).to(t.device, t.dtype) for t in outs]
        loss = sum((t.float() * c.float()).sum() for t, c in zip(outs, self.cotangents))
        loss.backward()
        return out

    def timed(self, backend: str) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = self.step(backend)
        self.sync()
        return time.perf_counter() - t0, out

    def values(self, backend: str) -> list[torch.Tensor]:
        """Outputs (and gradients) of one untimed step, detached, for the error check."""
        out = self.step(backend)
        vals = [t.detach().clone() for t in _tensors(out)]
        if self.cfg.backward:
            vals += [p.grad.detach().clone() for p in self.leaves if p.grad is not None]
        return vals


def _errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
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


def _step_stats(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"step_median_s": statistics.median(times), "step_iqr_s": q[2] - q[0],
            "step_min_s": min(times), "step_max_s": max(times), "steps_s": times}


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


def run_spike(cfg: SpikeConfig) -> dict:
    """Run the experiment; return everything it measured as a JSON-ready dict."""
    if cfg.dtype not in DTYPES:
        raise SpikeError(f"unknown dtype {cfg.dtype!r}; valid: {', '.join(DTYPES)}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpikeError("--device cuda: no CUDA device is available")
    if cfg.runs < 1 or cfg.warmup < 0:
        raise SpikeError(f"need runs >= 1 and warmup >= 0, got runs={cfg.runs}, warmup={cfg.warmup}")
    try:
        inductor_options = dict(parse(cfg.options, env={}).inductor)
    except OptionError as e:
        raise SpikeError(f"bad --options: {e}") from None

    progress = _Progress(cfg.progress)
    model, inputs, desc = resolve(cfg.model, cfg.size)
    dtype = DTYPES[cfg.dtype]
    try:
        if isinstance(model, torch.nn.Module):
            model = model.to(device=cfg.device, dtype=dtype).eval()
        inputs = _to(inputs, dtype, cfg.device)
    except Exception as e:
        raise SpikeError(f"cannot move the model to {cfg.device} / {cfg.dtype}: "
                         f"{type(e).__name__}: {e}") from None
    run = _Runner(model, inputs, cfg)

    progress.say(f"{cfg.model}: eager")
    try:
        eager_first, _ = run.timed("eager")
        reference = run.values("eager")
    except Exception as e:
        raise SpikeError(f"model {cfg.model!r} fails in eager mode: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not reference:
        raise SpikeError(f"model {cfg.model!r} returned no tensor")

    progress.say("paying the process's one-time compile start-up (imports, worker pool)")
    _prime_process()
    results: dict[str, dict] = {"eager": {"backend": "eager", "first_call_s": eager_first}}
    decisions: dict = {}
    for backend in COMPILED:
        res = results[backend] = {"backend": backend, "error": None}
        try:
            progress.say(f"{backend}: cold compile (caches off)")
            torch.compiler.reset()
            if backend == "convlower":
                reset_report()
            with _ti.inductor_caches_off(), _Watch() as watch, \
                    _stats.window() as window, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*force_disable_caches")
                run.compile(backend, inductor_options)
                res["cold_first_call_s"], _ = run.timed(backend)
                run.step(backend)  # a second call shows recompiles (e.g. state changed by call 1)
            res.update(watch.to_dict())
            if backend == "convlower":  # convlower's own statistics: where the compile time went
                decisions = conv_report().to_dict()
                res["compile_phases_s"] = _stats.totals(window.records)["phases_s"]
            progress.say(f"{backend}: warm compile (caches on)")
            torch.compiler.reset()
            with _Watch() as fill:
                run.compile(backend, inductor_options)
                first, _ = run.timed(backend)
            if fill.cache["fx_misses"] or fill.cache["aot_misses"] or not (
                    fill.cache["fx_hits"] or fill.cache["aot_hits"]):
                torch.compiler.reset()  # that call filled the caches; the next one reads them
                with _Watch() as fill:
                    run.compile(backend, inductor_options)
                    first, _ = run.timed(backend)
            res["warm_first_call_s"] = first
            res["warm_cache"] = fill.cache
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            progress.say(f"{backend}: compile failed: {res['error']}")

    # Steady state: every backend that compiled, interleaved in a rotating order.
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
    with _Watch() as steady:
        for r in progress.rounds(cfg.warmup + cfg.runs, f"{cfg.runs} timed rounds"):
            for i in range(len(live)):
                backend = live[(r + i) % len(live)]
                t, _ = run.timed(backend)
                if r >= cfg.warmup:
                    times[backend].append(t)
    for backend in live:
        results[backend].update(_step_stats(times[backend]))

    eager_step = results["eager"]["step_median_s"]
    for backend in COMPILED:
        res = results[backend]
        if res["error"] is not None:
            res.update(verdict="compile failed", verdict_code="failed", reason=res["error"])
            continue
        res["max_abs_err"], res["max_rel_err"] = _errors(run.values(backend), reference)
        step = res["step_median_s"]
        res["cold_compile_s"] = max(res["cold_first_call_s"] - step, 0.0)
        res["warm_compile_s"] = max(res["warm_first_call_s"] - step, 0.0)
        cold = amortize(eager_step, step, res["cold_compile_s"], spread_s=res["step_iqr_s"])
        warm = amortize(eager_step, step, res["warm_compile_s"], spread_s=res["step_iqr_s"])
        res.update(speedup=cold.speedup, break_even_calls=cold.break_even_calls,
                   break_even_calls_warm=warm.break_even_calls, verdict=cold.verdict,
                   verdict_code=cold.code, reason=cold.reason, amortization=cold.to_dict(),
                   amortization_warm=warm.to_dict())
    results["convlower"]["convolutions"] = convs = _conv_rows(decisions)
    lowered: dict[str, int] = {}
    for c in convs:
        if c["rule"]:
            lowered[c["rule"]] = lowered.get(c["rule"], 0) + 1
    results["convlower"]["lowered_by_rule"] = lowered
    results["convlower"]["snake"] = [{k: s.get(k) for k in ("graph", "node", "variant", "dtype", "route", "why")}
                                     for s in decisions.get("snake", [])]
    results["inductor"]["convolutions"], results["inductor"]["lowered_by_rule"] = [], {}

    return {
        "model": cfg.model, **desc, "dtype": cfg.dtype, "device": cfg.device, "runs": cfg.runs,
        "warmup": cfg.warmup, "dynamic": cfg.dynamic, "backward": cfg.backward,
        "options": _jsonable(cfg.options), "torch": torch.__version__, "convlower": __version__,
        "steady_state_compiles": steady.frames_compiled,
        "backends": results, "recommendation": recommend(results),
    }


def recommend(results: dict) -> dict:
    """The answer: which backend (if any) to compile with, and when."""
    ranked = [results[b] for b in COMPILED
              if results[b].get("verdict_code") in ("session_load", "long_sessions")]
    if not ranked:
        return {"backend": "eager", "verdict": DONT,
                "text": "stay eager: no backend is worth its compile time here"}
    order = {"session_load": 0, "long_sessions": 1}
    best = min(ranked, key=lambda r: (order[r["verdict_code"]], r["step_median_s"]))
    return {"backend": best["backend"], "verdict": best["verdict"],
            "text": f"backend={best['backend']!r}: {best['verdict']} ({best['speedup']:+.0%} vs "
                    f"eager, break-even after {best['break_even_calls']} calls cold, "
                    f"{best['break_even_calls_warm']} warm)"}


# -- presenting it -----------------------------------------------------------------------------
def _ms(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _short_reason(reason: str) -> str:
    """'rule_a: cond is false; rule_b: ...' (every rule's rejection) -> 'no rule applies'."""

    parts = reason.removesuffix(" (cached)").split("; ")
    if len(parts) > 1 and all(p.split(":")[0] in RULES for p in parts):
        return f"no rule applies ({len(parts)} rules' conditions fail)"
    return reason.removesuffix(" (cached)")


def format_report(res: dict) -> str:
    b = res["backends"]
    where = f"size {res['size']}" if res.get("source") == "zoo" else res.get("factory", "")
    mode = "forward+backward" if res["backward"] else "forward"
    head = (f"convlower spike: {res['model']} ({where}), {res['dtype']} on {res['device']}, "
            f"{mode}, {res['runs']} runs after {res['warmup']} warm-up, "
            f"dynamic={res['dynamic']}, torch {res['torch']}")
    rows = [["", "eager"] + list(COMPILED)]
    get = lambda k, f: [f(b[x].get(k)) if b[x].get("error") is None else "failed" for x in COMPILED]
    num = lambda v: "-" if v is None else str(v)
    rows += [
        ["cold compile"] + ["-"] + get("cold_compile_s", _ms),
        ["warm compile"] + ["-"] + get("warm_compile_s", _ms),
        ["step (median)", _ms(b["eager"]["step_median_s"])] + get("step_median_s", _ms),
        ["step spread (IQR)", _ms(b["eager"]["step_iqr_s"])] + get("step_iqr_s", _ms),
        ["speed-up", "-"] + get("speedup", lambda v: f"{v:+.1%}"),
        ["break-even (cold)", "-"] + get("break_even_calls", lambda v: "never" if v is None else f"{v} calls"),
        ["break-even (warm)", "-"] + get("break_even_calls_warm", lambda v: "never" if v is None else f"{v} calls"),
        ["graph breaks", "-"] + get("graph_breaks", num),
        ["recompiles", "-"] + get("recompiles", num),
        ["graphs", "-"] + get("graphs", num),
        ["max abs error", "-"] + get("max_abs_err", lambda v: f"{v:.2e}"),
        ["max rel error", "-"] + get("max_rel_err", lambda v: f"{v:.2e}"),
        ["lowered convs", "-"] + get("lowered_by_rule", lambda d: ", ".join(f"{k} x{v}" for k, v in d.items()) or "none"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    out = [head, "", table, ""]
    phases = b["convlower"].get("compile_phases_s")
    if phases:
        out += ["convlower cold compile by phase: "
                + ", ".join(f"{k} {_ms(v)}" for k, v in phases.items()), ""]
    for x in COMPILED:
        out.append(f"{x}: {b[x]['verdict']} - {b[x]['reason']}")
        for why in b[x].get("graph_break_reasons") or []:
            out.append(f"    graph break: {why.splitlines()[0]}")
        for why in b[x].get("recompile_reasons") or []:
            out.append(f"    recompile: {why.splitlines()[0]}")
    convs = b["convlower"].get("convolutions") or []
    if convs:  # identical rows grouped; the first clause of a reason (the JSON has all of it)
        groups: dict[tuple, int] = {}
        for c in convs:
            why = c["rule"] or "kept: " + _short_reason(c["reason"])
            key = (c["phase"], c["input"], c["kernel"], ",".join(map(str, c["stride"])), why)
            groups[key] = groups.get(key, 0) + 1
        out.append("\nconvolutions seen by convlower:")
        for (phase, inp, kernel, stride, why), n in groups.items():
            count = f" x{n}" if n > 1 else ""
            out.append(f"    {phase:8} {inp:>18} k={kernel:8} s={stride:8} -> {why[:100]}{count}")
    snake = b["convlower"].get("snake") or []
    if snake:
        routes: dict[str, int] = {}
        for site in snake:
            routes[site["route"]] = routes.get(site["route"], 0) + 1
        out.append(f"\nSnake sites seen by convlower: {len(snake)} ("
                   + ", ".join(f"{k} x{v}" for k, v in routes.items()) + ")")
    if res.get("steady_state_compiles"):
        out.append(f"\nwarning: {res['steady_state_compiles']} compile(s) during the timed rounds; "
                   "the step times include them")
    out.append(f"\nrecommendation: {res['recommendation']['text']}")
    return "\n".join(out)


def plot(res: dict, path: str) -> str:
    """Cumulative time against calls for the three backends, break-even points marked."""
    try:
        import matplotlib
    except ImportError:
        raise SpikeError("--plot needs matplotlib (pip install 'convlower[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = res["backends"]
    eager = b["eager"]["step_median_s"]
    ok = [x for x in COMPILED if b[x].get("error") is None]
    evens = [b[x][k] for x in ok for k in ("break_even_calls", "break_even_calls_warm") if b[x][k]]
    n_max = max([2 * n for n in evens] + [10])
    calls = [0, n_max]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(calls, [0, eager * n_max], color="black", label=f"eager ({_ms(eager)}/call)")
    for x, color in zip(ok, ("tab:blue", "tab:orange")):
        step = b[x]["step_median_s"]
        for kind, style in (("cold", "-"), ("warm", ":")):
            c = b[x][f"{kind}_compile_s"]
            ax.plot(calls, [c, c + step * n_max], style, color=color,
                    label=f"{x}, {kind} compile ({_ms(c)} + {_ms(step)}/call)")
            n = b[x]["break_even_calls" if kind == "cold" else "break_even_calls_warm"]
            if n:
                ax.plot([n], [c + step * n], "o", color=color)
                ax.annotate(f"{x} {kind}: {n} calls", (n, c + step * n), color=color,
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("calls")
    ax.set_ylabel("cumulative time (s)")
    ax.set_title(f"{res['model']} ({res['dtype']}, {res['device']}): compile pays off at the dots",
                 fontsize=10)
    ax.set_xlim(0, n_max)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
