"""Warm-up at session load: compile ahead, time a few steps, decide whether compiling pays.

``convlower.warmup(model, example_inputs)`` compiles ``model`` with the convlower backend, runs
the warm-up steps (so the first real call is fast) and returns ``(compiled, WarmupResult)``:
compile seconds, whether the caches were cold or warm, eager and compiled step timings, the
compile statistics (:mod:`convlower.observe.stats`) and the amortisation verdict
(:mod:`convlower.tools.amortize`).

With ``cache_dir`` it persists, and reuses in the next process, what makes a compile cheap:

* ``inductor/``: Inductor's cache directory (FX graph cache, AOTAutograd cache, the compiled
  C++ kernels).  On CPU this is what saves most: the kernels are not rebuilt.
* ``artifacts.bin``: the portable cache artifacts (``torch.compiler.save_cache_artifacts``),
  which refill an emptied Inductor cache directory (the C++ kernels are then rebuilt).
* ``convlower/``: convlower's measured rule decisions (:mod:`convlower.selection.cache`).

Cache directories hold pickled data: loading one runs code from it.  Use only a directory
that you (and nobody else) can write.  convlower creates it owner-only (0700), writes its own
files owner-only (0600) and warns when the directory is writable by others.  A missing,
corrupt, truncated or foreign entry is ignored with a warning, and the model compiles anyway.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import statistics as _statistics
import stat
import time
import warnings
from typing import Any, Optional, Sequence, Union

import torch

from .. import torch_internals as ti
from ..device import sync, tensors
from ..observe import stats as _stats
from ..private_files import write_atomic
from ..selection.cache import CACHE as DECISIONS
from ..version import __version__
from .amortize import Amortization, amortize

log = logging.getLogger("convlower")

ARTIFACTS = "artifacts.bin"
_MAGIC = b"CONVLOWER-CACHE-ARTIFACTS\n"
_FORMAT = 1


@dataclasses.dataclass
class WarmupResult:
    compile_s: float              # first step minus a steady compiled step: the compile's cost
    first_step_s: float           # the first compiled call (compiles + one step)
    cache: str                    # "cold" | "warm" | "partial" | "disabled"
    warm: bool                    # every graph came from the cache (no FX graph cache miss)
    cache_counts: dict            # FX graph / AOTAutograd cache hits, misses, bypasses
    eager_steps_s: list
    compiled_steps_s: list
    statistics: dict              # stats.totals() of the compiles during warm-up
    compiles: list                # the per-compile statistics records
    amortization: Optional[Amortization]
    cache_dir: Optional[str]
    warnings: list

    @property
    def verdict(self) -> Optional[str]:
        return self.amortization.verdict if self.amortization else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["amortization"] = self.amortization.to_dict() if self.amortization else None
        d["verdict"] = self.verdict
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
        if self.amortization:
            lines.append(f"  verdict: {self.amortization.verdict} ({self.amortization.reason})")
        for b in st.get("graph_breaks", []):
            lines.append(f"  graph break at {b['location']}: {b['reason']}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    __repr__ = __str__


def _median(xs: Sequence[float]) -> float:
    return _statistics.median(xs) if xs else 0.0


# -- cache directory -----------------------------------------------------------------------------
class _Warnings(list):
    def add(self, msg: str) -> None:
        self.append(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        log.warning(msg)


def _private_dir(path: str, warns: _Warnings) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        warns.add(f"convlower: cache directory {path} belongs to another user; it holds pickled "
                  f"data that runs code when loaded: use only a directory you own")
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        warns.add(f"convlower: cache directory {path} is writable by others; it holds pickled "
                  f"data that runs code when loaded (chmod 700 it)")
    return path


def _point_caches(cache_dir: str, warns: _Warnings) -> None:
    _private_dir(cache_dir, warns)
    inductor = _private_dir(os.path.join(cache_dir, "inductor"), warns)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != inductor:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
        ti.clear_inductor_caches()  # cached paths still point at the old directory
    DECISIONS.set_directory(_private_dir(os.path.join(cache_dir, "convlower"), warns))
    if ti.caches_disabled():
        warns.add("convlower: Inductor's caches are disabled (force_disable_caches / "
                  "TORCHINDUCTOR_FORCE_DISABLE_CACHES): cache_dir will not make compiles faster")


def _header() -> dict:
    return {"format": _FORMAT, "torch": torch.__version__, "convlower": __version__}


def _load_artifacts(path: str, warns: _Warnings) -> bool:
    """Load the portable cache artifacts at ``path``; any problem is a warning."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    except OSError as e:
        warns.add(f"convlower: cannot read cache artifacts {path}: {e}; compiling without them")
        return False
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a convlower cache-artifacts file")
        head, sep, payload = data[len(_MAGIC):].partition(b"\n")
        if not sep:
            raise ValueError("truncated header")
        meta = json.loads(head)
        want = _header()
        for k in ("format", "torch"):
            if meta.get(k) != want[k]:
                raise ValueError(f"written for {k} {meta.get(k)!r}, this is {want[k]!r}")
        if len(payload) != meta.get("size") or hashlib.sha256(payload).hexdigest() != meta.get("sha256"):
            raise ValueError(f"truncated or corrupt ({len(payload)} of {meta.get('size')} bytes)")
        torch.compiler.load_cache_artifacts(payload)
        return True
    except Exception as e:
        warns.add(f"convlower: ignoring cache artifacts {path}: {type(e).__name__}: {e}; "
                  f"compiling anyway")
        return False


def _save_artifacts(path: str, warns: _Warnings) -> None:
    try:
        saved = torch.compiler.save_cache_artifacts()
        if not saved or not saved[0]:
            return  # nothing new (e.g. everything came from the cache directory): keep the file
        payload = saved[0]
        meta = dict(_header(), size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        write_atomic(path, _MAGIC + json.dumps(meta).encode() + b"\n" + payload)
    except Exception as e:
        warns.add(f"convlower: could not save cache artifacts to {path}: {type(e).__name__}: {e}")


def _fresh_inductor_dir(cache_dir: str, error: Exception, warns: _Warnings) -> None:
    """Inductor ignores an unreadable cache entry but fails on a corrupt cached module or
    kernel library; move the whole Inductor cache aside and compile from scratch."""
    inductor = os.path.join(cache_dir, "inductor")
    while getattr(error, "inner_exception", None) or error.__cause__:  # Dynamo wraps it
        error = getattr(error, "inner_exception", None) or error.__cause__
    first = (str(error).strip().splitlines() or [""])[0][:300]
    warns.add(f"convlower: compiling with the cache in {inductor} failed ({type(error).__name__}: "
              f"{first}); discarding that cache and compiling anyway")
    aside = f"{inductor}.discarded-{os.getpid()}"
    with contextlib.suppress(OSError):
        os.replace(inductor, aside)
    shutil.rmtree(aside, ignore_errors=True)
    _private_dir(inductor, warns)
    ti.clear_inductor_caches()


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
           iters: int = 3, backward: bool = False, **amortize_kw: Any):
    """Compile ``model`` with convlower ahead of use; return ``(compiled, WarmupResult)``.

    ``example_inputs``: a tensor or a tuple of positional inputs.  ``dynamic``: passed to
    ``torch.compile`` when a bool; a dict ``{input index: dim or dims}`` marks those dims of
    the example inputs dynamic (Dynamo's ``mark_dynamic``) so other sizes later do not
    recompile.  ``iters``: timed steps, eager and compiled, for the verdict (0: no timing, no
    verdict).  ``backward``: each step also runs a backward (of the outputs' sum); gradients
    the warm-up produced are discarded.  Run it in the grad mode you will run the model in
    (e.g. inside ``torch.no_grad()`` for inference), or the first real call recompiles.
    Extra keywords (``low``, ``high``, ``stability``) go to :func:`amortize`.
    """
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    warns = _Warnings()
    if cache_dir is not None:
        cache_dir = os.path.abspath(os.fspath(cache_dir))
        _point_caches(cache_dir, warns)
        _load_artifacts(os.path.join(cache_dir, ARTIFACTS), warns)
    compile_dynamic = dynamic if isinstance(dynamic, bool) or dynamic is None else None
    if isinstance(dynamic, dict):
        _mark_dynamic(inputs, dynamic)
    compiled = torch.compile(model, backend="convlower", dynamic=compile_dynamic,
                             options=dict(options) if options else None)
    with _keep_grads(model, inputs):
        eager = []
        if iters > 0:
            _step(model, inputs, backward)  # untimed: first-call allocations and library plans
            eager = _timed(model, inputs, backward, iters)
        first, steps, counts, records = _first_compiled(compiled, inputs, backward, iters,
                                                        cache_dir, warns)
    if cache_dir is not None:
        _save_artifacts(os.path.join(cache_dir, ARTIFACTS), warns)
    result = _result(first, steps, eager, counts, records, cache_dir, warns, amortize_kw)
    log.info("%s", str(result).splitlines()[0])
    ti.trace_artifact("convlower_warmup", result.to_dict())
    return compiled, result


def _first_compiled(compiled, inputs, backward: bool, iters: int, cache_dir: Optional[str],
                    warns: _Warnings) -> tuple[float, list, dict, list]:
    """The first compiled call (the compile), ``iters`` timed steps, the cache counts and
    the compile records of both."""
    before = ti.counters()
    with _stats.window() as w:
        start = time.perf_counter()
        try:
            _step(compiled, inputs, backward)
        except Exception as e:
            if cache_dir is None:
                raise
            _fresh_inductor_dir(cache_dir, e, warns)  # a corrupt entry: start it over
            _step(compiled, inputs, backward)
        first = time.perf_counter() - start
        steps = _timed(compiled, inputs, backward, iters)
    return first, steps, _stats.cache_counts(before, ti.counters()), w.records


def _result(first: float, steps: list, eager: list, counts: dict, records: list,
            cache_dir: Optional[str], warns: _Warnings, amortize_kw: dict) -> WarmupResult:
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
