"""Measured selection: time the original convolution and each eligible rule, keep the winner.

Like Inductor's ``pad_mm``, this is a bounded compile-time micro-benchmark.  For one
convolution call it builds real random tensors of the call's concrete sizes (size hints under
dynamic shapes), on the call's device, dtype and memory layout (strides), and times each
candidate **as Inductor compiles it** (eager timings mislead: Inductor fuses a rule's copies
and picks channels-last for the original conv, so eager ratios were off by up to 4x):

* forward: ``aten.convolution`` against each rule's forward decomposition;
* backward: ``aten.convolution_backward`` against each rule's backward decomposition (autograd
  of the rule's emission), with the node's output mask.

Every candidate is compiled before any is timed (``COMPILE_BUDGET_S`` bounds it); then all are
timed in ``ROUNDS`` interleaved rounds.  A rule replaces the convolution only when its median is
faster by at least ``MARGIN`` (5%) and it won in every round: within noise the original stays.

Decisions are cached in memory and on disk (``decisions.json``), keyed by device name, torch
and convlower versions, phase, dtype, compute dtype, sizes, strides (layout), parameters and
the candidate rules, so a later compile, in this process or another, does not measure again.
The directory is ``$CONVLOWER_CACHE_DIR``, else ``~/.cache/convlower``, or what
:func:`set_cache_dir` set.  The file is written atomically (temp file + ``os.replace``) with
owner-only permissions; a corrupt or unreadable file is ignored with a warning.

The timer is injectable (:func:`set_timer`) so the decision logic is tested without timings.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import statistics
import threading
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

from .. import __version__
from ..lowerings.rule import ConvCall, Rule
from .private_files import write_atomic

log = logging.getLogger("convlower")
aten = torch.ops.aten

MARGIN = 0.05  # a rule must be at least 5% faster than the original convolution
BUDGET_S = float(os.environ.get("CONVLOWER_MEASURE_BUDGET_S", "3.0"))  # timing, per convolution
# a conv faster than this (eagerly) keeps the original without compiling candidates
MIN_CONV_S = float(os.environ.get("CONVLOWER_MEASURE_MIN_US", "200")) * 1e-6
# compiling the candidates, per convolution and phase: past it, uncompiled rules are not measured
COMPILE_BUDGET_S = float(os.environ.get("CONVLOWER_MEASURE_COMPILE_BUDGET_S", "60"))
REPEATS = 5  # timed samples per candidate and round (after one warm-up), fewer past the budget
ROUNDS = 3  # candidates are timed in interleaved rounds, so a burst of load hits all of them
MIN_SAMPLE_S = 1e-3  # a sample repeats a short op until it lasts about this long
CACHE_FILE = "decisions.json"
_FORMAT = 1
METHOD = "inductor-compiled/median/every-round"  # how timings are taken: part of the key

# A timer: (label, fn, budget_s) -> seconds per call of fn.  label is "aten" or a rule name.
Timer = Callable[[str, Callable[[], object], float], float]


def default_timer(label: str, fn: Callable[[], object], budget_s: float) -> float:
    """Seconds per call: median of up to REPEATS samples after one warm-up, within ``budget_s``.
    A sample runs a short op several times (about MIN_SAMPLE_S) so timer resolution and
    scheduling jitter do not dominate."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()  # compile, untimed
    start = time.perf_counter()
    fn()  # warm-up (allocations, library plans)
    warm = time.perf_counter() - start
    if warm >= budget_s:  # a long op: its one run is the (conservative) measurement
        return warm
    inner = max(1, min(50, int(MIN_SAMPLE_S / max(warm, 1e-7))))
    times = []
    deadline = time.perf_counter() + max(budget_s - warm, 0.0)
    while len(times) < REPEATS and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    # The median, not the best: on a shared machine a kernel runs in a fast and a slow mode
    # (cache, memory and CPU contention); the best sample shows a mode users rarely see.
    return statistics.median(times)


_timer: Timer = default_timer
_cache_dir: Optional[str] = None
_memory: dict[tuple[str, str], dict] = {}
_lock = threading.Lock()


_compile_first = True  # compile every candidate before timing any (the default timer)


def set_timer(timer: Optional[Timer], *, compiles: bool = False) -> Timer:
    """Use ``timer`` for measurements (None: the default); return the previous one.

    The default timer compiles every candidate before timing any, so compiling never overlaps
    a measurement.  A stub timer pays for no compile unless ``compiles`` (a candidate is then
    compiled on its first call)."""
    global _timer, _compile_first
    prev, _timer = _timer, timer or default_timer
    _compile_first = timer is None or timer is default_timer or compiles
    return prev


def set_cache_dir(path: Optional[str]) -> None:
    """Keep decisions under ``path`` (None: back to $CONVLOWER_CACHE_DIR / ~/.cache/convlower)."""
    global _cache_dir
    _cache_dir = os.fspath(path) if path is not None else None


def cache_dir() -> str:
    if _cache_dir is not None:
        return _cache_dir
    env = os.environ.get("CONVLOWER_CACHE_DIR")
    return env or os.path.join(os.path.expanduser("~"), ".cache", "convlower")


def clear_memory() -> None:
    """Forget the in-memory decisions (the disk cache stays)."""
    with _lock:
        _memory.clear()


# -- the on-disk cache ---------------------------------------------------------------------------
def _warn(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != _FORMAT \
                or not isinstance(data.get("decisions"), dict):
            raise ValueError("not a convlower decision cache")
        return data["decisions"]
    except FileNotFoundError:
        return {}
    except Exception as e:  # corrupt or unreadable: ignore it, measure again
        _warn(f"convlower: ignoring the decision cache {path}: {type(e).__name__}: {e}")
        return {}


def _write(directory: str, key: str, decision: dict) -> None:
    path = os.path.join(directory, CACHE_FILE)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a corrupt file was already reported; replace it
            decisions = _read(path)  # merge with what other processes wrote meanwhile
        decisions[key] = decision
        text = json.dumps({"format": _FORMAT, "decisions": decisions}, indent=1, sort_keys=True)
        write_atomic(path, text.encode("utf-8"))
    except OSError as e:
        _warn(f"convlower: could not write the decision cache in {directory}: {e}")


def _lookup(key: str) -> Optional[dict]:
    directory = cache_dir()
    with _lock:
        hit = _memory.get((directory, key))
        if hit is None:
            hit = _read(os.path.join(directory, CACHE_FILE)).get(key)
            if isinstance(hit, dict):
                _memory[(directory, key)] = hit
        return hit if isinstance(hit, dict) else None


def _store(key: str, decision: dict) -> None:
    directory = cache_dir()
    with _lock:
        _memory[(directory, key)] = decision
        _write(directory, key, decision)


# -- what a measurement is about -----------------------------------------------------------------
def _hint(v) -> int:
    if isinstance(v, torch.SymInt):
        # torch 2.13 has no hint_int; optimization_hint reads the hint without a guard
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        return int(optimization_hint(v, fallback=8))
    return int(v)


def device_name(device: torch.device) -> str:
    """What a timing depends on: GPU name, or CPU model and thread count."""
    return _device_name(str(device), torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _device_name(device: str, threads: int) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        return f"{'hip' if torch.version.hip else 'cuda'}:{name}"
    if device.type == "cpu":
        model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")),
                             model)
        return f"cpu:{model}:{threads} threads"
    return device.type


def decision_key(call: ConvCall, candidates: Sequence[Rule], phase: str,
                 output_mask: Optional[Sequence[bool]], compute_dtype: Optional[str],
                 produced: bool = True, consumed: bool = True) -> str:
    x, w = call.x, call.weight
    return json.dumps({
        "device": device_name(x.device), "torch": torch.__version__, "convlower": __version__,
        "method": METHOD,
        "phase": phase, "produced": produced, "consumed": consumed and phase == "forward",
        "mask": [bool(m) for m in output_mask] if output_mask else None,
        "dtype": str(x.dtype), "compute_dtype": compute_dtype,
        "x": [_hint(s) for s in x.shape], "x_stride": [_hint(s) for s in x.stride()],
        "w": [_hint(s) for s in w.shape], "w_stride": [_hint(s) for s in w.stride()],
        "bias": call.has_bias, "stride": list(call.stride), "padding": list(call.padding),
        "dilation": list(call.dilation), "transposed": call.transposed,
        "output_padding": list(call.output_padding), "groups": call.groups,
        "candidates": [r.name for r in candidates],
    }, sort_keys=True)


def _real(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor with ``t``'s concrete sizes, strides, dtype and device."""
    size = [_hint(s) for s in t.shape]
    values = torch.randn(size, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)
    try:
        out = torch.empty_strided(size, [_hint(s) for s in t.stride()], device=t.device,
                                  dtype=t.dtype)
        return out.copy_(values)
    except RuntimeError:  # overlapping strides (an expanded tensor): keep it contiguous
        return values


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# Inductor adds a nested compile's time to the enclosing compile's metrics.  Measuring runs
# inside convlower's pass, whose seconds already hold it: without a restore the report would
# count it twice (once as convlower, once as Inductor / code generation).
_NESTED_COLUMNS = ("inductor_cumulative_compile_time_us",
                   "inductor_code_gen_cumulative_compile_time_us")


@contextlib.contextmanager
def _outer_metrics_kept():
    from torch._dynamo.utils import get_metrics_context

    ctx = get_metrics_context()
    metrics = getattr(ctx, "_metrics", None) if ctx.in_progress() else None
    before = {c: metrics.get(c) for c in _NESTED_COLUMNS} if isinstance(metrics, dict) else None
    try:
        yield
    finally:
        if before is not None and ctx.in_progress():
            for column, value in before.items():
                if value is None:
                    metrics.pop(column, None)
                else:
                    metrics[column] = value


def _compiled(fn, args: Sequence[torch.Tensor], prologue: Sequence[bool], epilogue: bool,
              compile_log: dict, label: str) -> Callable[[], object]:
    """``fn(*args)`` as Inductor will run it inside the model: traced to aten and compiled by
    Inductor (the current config, convlower's own pass off).  ``run.prepare()`` compiles (the
    default timer calls it untimed; a stub timer never pays for it); the seconds it took go
    into ``compile_log[label]``.

    Inputs flagged in ``prologue`` go through a negation first, as the conv's activation (or
    gradient) does when an op of the graph makes it (a norm, an activation): Inductor then picks
    its layout for free (channels-last for mkldnn convs) and fuses the copies a rule needs into
    that producer.  A graph input instead has a fixed layout, and any copy costs a pass; the
    pass tells which case a conv is (``produced``).  Likewise with ``epilogue`` the outputs
    feed a negation, as a conv output read by another op does (a layout copy fuses into it);
    without, they are graph outputs and materialise in the original's layout (``consumed``)."""
    compiled = None

    def graph(*inputs):
        inputs = [t.neg() if p else t for t, p in zip(inputs, prologue)]
        out = fn(*inputs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        return tuple(o.neg() if epilogue else o for o in outs)

    def prepare():
        nonlocal compiled
        if compiled is None:
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx_inner
            from torch._inductor.pattern_matcher import fwd_only

            start = time.perf_counter()
            try:
                gm = fwd_only(graph, list(args))
                # A fresh compile: no outer tracing context, and no convlower pass inside it.
                with torch._guards.tracing(None), _outer_metrics_kept(), \
                        inductor_config.patch(post_grad_custom_pre_pass=None):
                    compiled = compile_fx_inner(gm, list(args))
            finally:
                compile_log[label] = time.perf_counter() - start

    def run():
        prepare()
        out = compiled(list(args))  # boxed call: it consumes the list
        return out[0] if len(out) == 1 else tuple(out)

    run.prepare = prepare
    run.compiled = lambda: compiled is not None
    return run


def _meta(t):
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                      device="meta")


def _benchmarks(call: ConvCall, candidates, phase, output_mask, compute_dtype, compile_log,
                produced=True, consumed=True):
    """{label: fn} for the original and every candidate, on real tensors, compiled lazily."""
    from ..decompositions import convolution as decomp

    device = call.x.device
    gen = torch.Generator(device=device).manual_seed(0)  # never touches the user's RNG
    x, w = _real(call.x, gen), _real(call.weight, gen)
    b = torch.randn(w.shape[0], generator=gen, device=device).to(w.dtype) if call.has_bias else None
    real = ConvCall.from_args([x, w, b, call.stride, call.padding, call.dilation, call.transposed,
                               call.output_padding, call.groups])
    params = (list(call.stride), list(call.padding), list(call.dilation), call.transposed,
              list(call.output_padding), call.groups)
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else None
    sync = _sync(device)

    from .graph_pass import _with_layout_of

    def timed(fn, args, prologue, label):
        if label != "aten":  # as spliced: outputs keep the original's layout (graph_pass)
            fn = _with_layout_of(fn, original(*map(_meta, args)))
        run = _compiled(fn, args, prologue, consumed, compile_log, label)

        def step():
            out = run()
            sync()
            return out
        step.prepare, step.compiled = run.prepare, run.compiled
        step.eager = lambda: (fn(*args), sync())  # uncompiled, for the tiny-conv check
        return step

    fns = {}
    if phase == "forward":
        args = (x, w, b) if b is not None else (x, w)
        prologue = (produced, False, False)
        original = lambda x, w, b=None: aten.convolution(x, w, b, *params)
        fns["aten"] = timed(original, args, prologue, "aten")
        for r in candidates:
            fns[r.name] = timed(decomp.convolution(r, real, dtype), args, prologue, r.name)
    else:
        mask = [bool(m) for m in (output_mask or (True, True, call.has_bias))]
        grad = torch.randn(aten.convolution(x, w, b, *params).shape, generator=gen,
                           device=device).to(x.dtype)
        bias_sizes = [w.shape[0]] if call.has_bias else None
        # x is a saved activation (its layout is fixed); grad comes from the op after the conv
        consumed = False  # grads mostly leave the graph (weight/bias grads always do)
        args, prologue = (grad, x, w), (produced, False, False)
        original = lambda g, x, w: aten.convolution_backward(g, x, w, bias_sizes, *params, mask)
        fns["aten"] = timed(original, args, prologue, "aten")
        for r in candidates:
            fns[r.name] = timed(decomp.convolution_backward(r, real, mask, dtype), args, prologue,
                                r.name)
    return fns


def _fake_mode_off():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _over_compile_budget(name: str, fn, compile_log: dict, fns: dict, errors: list) -> bool:
    """Drop rule ``name`` if it is not compiled yet and compiling has used COMPILE_BUDGET_S."""
    if name == "aten" or fn.compiled() or sum(compile_log.values()) <= COMPILE_BUDGET_S:
        return False
    del fns[name]
    errors.append(f"{name} not measured: the compile budget ({COMPILE_BUDGET_S:.0f} s) is spent")
    return True


def _compile_all(fns: dict, compile_log: dict, errors: list) -> None:
    """Compile the original and then each rule, within COMPILE_BUDGET_S; drop what fails."""
    for name, fn in list(fns.items()):
        if _over_compile_budget(name, fn, compile_log, fns, errors):
            continue
        try:
            fn.prepare()
        except Exception as e:
            if name == "aten":
                raise
            del fns[name]  # a rule Inductor cannot compile here is not chosen
            errors.append(f"{name} failed to compile: {type(e).__name__}: {e}")


# -- the decision --------------------------------------------------------------------------------
def choose_by_measurement(call: ConvCall, candidates: Sequence[Rule], *, phase: str = "forward",
                          output_mask: Optional[Sequence[bool]] = None,
                          compute_dtype: Optional[str] = None, produced: bool = True,
                          consumed: bool = True) -> tuple[Optional[Rule], str, dict]:
    """Return (the fastest rule or None for the original, why, {label: seconds})."""
    by_name = {r.name: r for r in candidates}
    key = decision_key(call, candidates, phase, output_mask, compute_dtype, produced, consumed)
    hit = _lookup(key)
    if hit is not None and (hit.get("rule") is None or hit.get("rule") in by_name):
        rule = by_name.get(hit.get("rule"))
        return rule, f"{hit.get('why', 'measured')} (cached)", dict(hit.get("timings", {}))

    timings: dict[str, float] = {}  # median over rounds per label
    rounds: dict[str, list[float]] = {}  # per label, one time per round
    compile_log: dict[str, float] = {}
    errors = []
    try:
        with _fake_mode_off(), torch.no_grad():
            fns = _benchmarks(call, candidates, phase, output_mask, compute_dtype, compile_log,
                              produced, consumed)
            if _compile_first:
                # Compiling the candidates costs seconds; a conv that takes microseconds
                # cannot win that back (and in sum is not where a model's time goes).
                quick = default_timer("aten", fns["aten"].eager, BUDGET_S / 10)
                if quick < MIN_CONV_S:
                    why = (f"measured: kept the original (it takes {quick * 1e6:.0f} us eagerly, "
                           f"under the {MIN_CONV_S * 1e6:.0f} us worth compiling candidates for)")
                    timings = {"aten_eager": quick}
                    _store(key, {"rule": None, "why": why, "timings": timings, "compile_s": 0.0})
                    return None, why, timings
                _compile_all(fns, compile_log, errors)
            share = BUDGET_S / (len(fns) * ROUNDS)
            start = time.perf_counter()
            for i in range(ROUNDS):  # interleaved rounds
                if i and time.perf_counter() - start - sum(compile_log.values()) > BUDGET_S:
                    break  # long ops: one round is all the budget allows
                for name, fn in list(fns.items()):
                    # a stub timer that compiles does so lazily, on a candidate's first turn
                    if _over_compile_budget(name, fn, compile_log, fns, errors):
                        continue
                    try:
                        rounds.setdefault(name, []).append(float(_timer(name, fn, share)))
                        timings[name] = statistics.median(rounds[name])
                    except Exception as e:
                        if name == "aten":
                            raise
                        del fns[name]  # a rule that fails here is not chosen
                        timings.pop(name, None)
                        errors.append(f"{name} failed: {type(e).__name__}: {e}")
    except Exception as e:  # cannot measure (e.g. out of memory): keep the original
        return None, f"measurement failed, kept the original: {type(e).__name__}: {e}", timings

    base = timings["aten"]
    best = min((n for n in timings if n != "aten"), key=timings.get, default=None)
    # A clear win: faster by the margin overall, and in every round against that round's
    # original (a burst of load during one candidate's turn cannot make it win).
    wins = best is not None and timings[best] <= (1.0 - MARGIN) * base and all(
        t <= (1.0 - MARGIN) * a for t, a in zip(rounds[best], rounds["aten"]))
    if wins:
        rule, why = by_name[best], (f"measured: {best} takes {timings[best] / base:.2f}x "
                                    f"the original's time")
    else:
        shown = f"best rule {best} takes {timings[best] / base:.2f}x" if best else "no rule ran"
        rule, why = None, f"measured: kept the original ({shown}; a rule must be >= " \
                          f"{MARGIN:.0%} faster in every round)"
    compile_s = sum(compile_log.values())
    if compile_s:
        why += f"; compiling the candidates took {compile_s:.1f} s"
    if errors:
        why += "; " + "; ".join(errors)
    _store(key, {"rule": rule.name if rule else None, "why": why, "timings": timings,
                 "compile_s": compile_s})
    return rule, why, timings
