"""The ``convlower`` backend: Inductor, plus convlower's graph passes.

``torch.compile(m, backend="convlower", mode=..., options=...)`` reaches
:func:`convlower_backend`.  It validates the options, then hands the graph to Inductor exactly
as ``backend="inductor"`` would (same mode handling, same config) with one addition: the
post-grad custom pass that lowers convolutions.  A graph without an eligible convolution
therefore compiles to the same kernels as under Inductor.  Before that, Snake activations
in the Dynamo graph are routed (snake_pass.py): on HIP + bf16 they become an opaque custom op.
"""
from __future__ import annotations

import itertools
import json
import logging
from typing import Optional

import torch

from .. import torch_internals as ti
from ..observe import persist as _persist
from ..observe import records as _records
from ..observe import stats as _stats
from ..regions import compile_regions
from ..selection import cache_dir, decisions_digest
from . import options as _options
from .conv_pass import ConvLowerPass
from .snake_pass import route_snakes

log = logging.getLogger("convlower")
_graph_ids = itertools.count()


def _on_cache_lookup(key: str, graph, backward: bool) -> None:
    # A graph of a convlower compile served from Inductor's cache (directly or through an
    # AOTAutograd entry) runs no pass: report the records its first compile saved.
    lowering = ti.post_grad_pass()
    if graph is None or not isinstance(lowering, ConvLowerPass):
        return
    for rec in _persist.load(cache_dir(), key, ti.cached_graph_guards(graph),
                             lowering.graph_name, "backward" if backward else "forward"):
        _records.record(rec)


def _on_cache_save(key: str, graph) -> None:
    if isinstance(ti.post_grad_pass(), ConvLowerPass):
        _persist.save(cache_dir(), key, ti.cached_graph_guards(graph))


def _in_our_compile() -> bool:
    return isinstance(ti.post_grad_pass(), ConvLowerPass)  # configured for our compiles only


def _kernels_together() -> bool:
    # Inductor loads a graph's kernels inside its compile, where our pass is configured.
    lowering = ti.post_grad_pass()
    return isinstance(lowering, ConvLowerPass) and lowering.options.kernel_builds == "together"


_stats.install()  # at backend lookup, so graph breaks of the very first frame are seen too
ti.on_fx_graph_cache(_on_cache_lookup, _on_cache_save)  # per-conv records across caches
ti.build_kernels_together(_kernels_together, _stats.note_kernels)  # compile seconds
ti.remember_vec_isa_probe(_in_our_compile)  # 1.4 s of every process's first compile


def _probe_ahead(example_inputs=None) -> None:
    # Inductor's vector-ISA probe waits on child processes: started now, it runs on another
    # core while this one traces.  At Dynamo's start of a frame bound for this backend where
    # no accelerator can take the graph; else once a graph with CPU tensors reaches us.
    if example_inputs is None:
        cpu = (ti.backend_being_compiled() is convlower_backend
               and not torch.accelerator.is_available())
    else:
        cpu = any(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in example_inputs)
    if cpu:
        ti.probe_vec_isa_ahead()


def _probe_ahead_at_start(_args) -> None:
    _probe_ahead()


# Once per process is enough: torch._dynamo.reset() drops it, but the probe has run by then.
ti.on_compile(_probe_ahead_at_start, lambda _: None)


def _inductor(gm, example_inputs, mode: Optional[str], opts, patches=None):
    # As torch.compile does for backend="inductor" (mode and Inductor options applied and
    # validated the same way), plus our patches for this compile and its later backward.
    return ti.compile_with_inductor(gm, example_inputs, mode, dict(opts.inductor), patches)


def convlower_backend(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str] = None,
                      options: Optional[dict] = None):
    """A ``torch.compile`` backend (entry point ``convlower``)."""
    opts = _options.parse(options, mode=mode)
    _probe_ahead(example_inputs)
    if opts.regions != "off":  # each repeated block compiled once (regions/), else whole
        context = json.dumps({"options": opts.key(), "mode": mode,
                              "decisions": decisions_digest()}, sort_keys=True)
        try:  # the parts' kernels built together once all parts are compiled
            with ti.kernels_built_at_end():
                split = compile_regions(gm, opts.regions, context=context,
                                        compile_graph=lambda g, x: _compile_graph(g, x, mode, opts),
                                        direct_calls=opts.part_calls == "direct")
        except CompileError:
            raise  # a part failed as a whole graph would have: the same error
        except Exception as e:  # splitting must never break a compile: the graph goes whole
            if ti.is_dynamo_control_flow(e):
                raise
            log.warning("convlower: regions failed (%s: %s); compiling the graph whole",
                        type(e).__name__, e)
            split = None
        if split is not None:  # in a form torch's AOT compile can save (a warm-up's saved compile)
            return ti.saveable_split(split)
    return _compile_graph(gm, example_inputs, mode, opts)


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, mode: Optional[str], opts):
    """One graph through convlower: Snake routing, then Inductor with the conv pass."""
    name = f"graph{next(_graph_ids)}"
    try:  # before AOTAutograd, so an eager-safe Snake's backward stays opaque too
        route_snakes(gm, opts, name)
    except Exception:  # never break a compile: the graph goes to Inductor as it is
        log.warning("convlower: Snake routing failed on %s", name, exc_info=True)
    patches = {"post_grad_custom_pre_pass": ConvLowerPass(opts, name)}
    _stats.note_graph(name)
    try:
        return _inductor(gm, example_inputs, mode, opts, patches)
    except Exception as e:
        if ti.is_dynamo_control_flow(e):
            raise  # Dynamo's own control flow (restart, skip), not a failure
        what = _failure(name, e)
        if opts.fallback == "inductor":
            log.warning("%s; compiling %s with plain Inductor (fallback='inductor')", what, name)
            return _inductor(gm, example_inputs, mode, opts)
        raise CompileError(f"{what}. Pass options={{'fallback': 'inductor'}} to compile such a "
                           f"graph with plain Inductor, or leave the failing rule out of "
                           f"options['rules']") from e


class CompileError(RuntimeError):
    """convlower could not compile a graph; the message names the graph and its rules."""


def _failure(name: str, e: Exception) -> str:
    rules = sorted({f"{c.rule} ({c.phase} {c.node})" for c in _records.records("convolutions")
                    if c.graph == name and c.rule})
    applied = f"rules applied: {', '.join(rules)}" if rules else "no convlower rule was applied"
    first = (str(e).splitlines() or [""])[0]
    return f"convlower failed to compile {name} ({applied}): {type(e).__name__}: {first}"
