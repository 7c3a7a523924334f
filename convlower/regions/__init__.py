"""Regions: compile each repeated block once and call that code for every instance.

A step ahead of convlower's passes (docs/regions.md).  The backend hands its Dynamo graph to
:func:`compile_regions`; the graph is split along repeated module instances (blocks.py,
partition.py), every part that is not plain data movement is compiled by the function the
backend passes in (the usual convlower pipeline: conv rules and Snake routing apply inside
regions), and parts with one signature (signature.py) share one compiled function, within a
graph and across graphs of this process.  Seams between compiled parts carry activations in
the layout the compiled code computes in (seams.py).  The passes never know regions exist.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

import torch
import torch.fx

from .. import torch_internals as ti
from ..observe import records as _records
from .blocks import Setting, assign, shared_share
from .partition import (Part, example_inputs, return_as_tuple, returns_tuple, split,
                        writes_in_place)
from .seams import channels_last_seams, channels_last_wanted, output_strides
from .signature import signature

__all__ = ["compile_regions", "clear", "Setting"]


@dataclasses.dataclass
class _Compiled:
    fn: Callable
    first: str          # the split graph and part that compiled it


# "auto" splits a graph only where instances repeating an earlier one are this share of its
# nodes or more.  Below it, the parts' compiles and seams cost more than the few shared
# instances save: on the Wan VAE decode (3 of 13 parts shared) regions took 0.69-0.76x of
# Inductor's cold compile, the whole graph 0.57-0.63x (docs/benchmarks.md).
MIN_AUTO_SHARED = 0.3

_lock = threading.Lock()
_compiled: dict[str, _Compiled] = {}    # signature -> compiled function
_names = iter(range(1 << 62))


def clear() -> None:
    """Forget every compiled part (the next compile of a region compiles again)."""
    with _lock:
        _compiled.clear()


def _call_compiled(split_gm: torch.fx.GraphModule, part: str, fn: Callable,
                   single: bool, strides: tuple, wrapped: bool,
                   settled: Optional[Callable[[bool], None]] = None) -> None:
    """The split graph calls ``fn`` where it called submodule ``part``: a plain function call
    (an nn.Module's ``__call__`` would add its hook machinery to every call of every part).
    ``fn`` returns a sequence; ``single``: the part's value is its one element; ``strides``:
    its outputs' traced strides, which the parts reading them were compiled for
    (seams.output_strides), checked on the first call; ``wrapped``: never called straight into
    Inductor's code (it may write in place, or ``part_calls="wrapped"``; torch_direct.py);
    ``settled`` hears on the first call whether later ones are.
    ``split_gm.meta["compiled_parts"]`` names them, for a saved compile (torch_saved.py).
    A UNet step calls some 30 parts: each layer of wrapper left out is 2-5 us per part, more
    with caches cold between kernels."""
    # Dynamo is off already: it calls the split graph through its own disable wrapper
    call = ti.part_caller(f"compiled_{part}", ti.without_dynamo_disable(fn), single, strides,
                          wrapped, settled)
    split_gm.meta.setdefault("compiled_parts", {})[call.__name__] = (fn, single, strides,
                                                                      wrapped)
    for node in split_gm.graph.nodes:
        if node.op == "call_module" and node.target == part:
            node.op, node.target = "call_function", call
    split_gm.delete_submodule(part)


def _context(base: str, inputs: list) -> str:
    # Symbolic sizes mean something only in their own shape environment.
    env = ti.shape_env_of([v for v in inputs if isinstance(v, torch.Tensor)])
    symbolic = any(isinstance(v, torch.SymInt) for v in inputs) or any(
        isinstance(s, torch.SymInt) for v in inputs if isinstance(v, torch.Tensor)
        for s in (*v.shape, *v.stride()))
    return f"{base}|grad={torch.is_grad_enabled()}|env={id(env) if symbolic else ''}"


def _compiled_part(sub, inputs: list, key: str, label: str, compile_graph) -> tuple:
    with _lock:
        hit = _compiled.get(key)
    if hit is not None:
        return hit.fn, "reused", 0.0, hit.first
    start = time.perf_counter()
    with ti.own_tracing_context(inputs):
        fn = compile_graph(sub, inputs)
    with _lock:
        _compiled.setdefault(key, _Compiled(fn, label))
    return fn, "compiled", time.perf_counter() - start, ""


def compile_regions(gm: torch.fx.GraphModule, setting: Setting, compile_graph: Callable,
                    context: str = "",
                    direct_calls: bool = True) -> Optional[torch.fx.GraphModule]:
    """``gm`` split into region and glue parts, each compiled with ``compile_graph(part,
    example_inputs)`` or sharing the function an identical part compiled; None when
    ``setting`` finds no region in ``gm`` (the caller then compiles the graph whole).
    ``context`` names what else the compiled code depends on (options, mode);
    ``direct_calls``: inference calls may go straight to Inductor's code (torch_direct.py)."""
    owner = assign(gm, setting)
    if not any(owner.values()):
        return None
    name = f"regions{next(_names)}"
    share = shared_share(owner) if setting == "auto" else 1.0  # a class list is taken as given
    if share < MIN_AUTO_SHARED:
        _records.record(_records.RegionRecord(
            graph=name, part="", block="(whole graph)", signature="", nodes=len(owner),
            how=f"compiled whole: repeated instances are {share:.0%} of its nodes (auto splits "
                f"from {MIN_AUTO_SHARED:.0%})", compile_s=0.0, whole=True))
        return None
    split_gm, parts = split(gm, owner)
    compiled = {p.name: split_gm.get_submodule(p.name) for p in parts
                if not (p.region is None and p.only_views)}
    changed, converted = channels_last_seams(split_gm, compiled, channels_last_wanted(gm))
    for part in parts:
        sub = split_gm.get_submodule(part.name)
        if part.region is None and part.only_views:
            _note(name, part, "", "runs as is (views only)", 0.0, "", 0,
                  converted.get(part.name, 0))
            continue
        inputs = example_inputs(sub)
        key = signature(sub, inputs, _context(context, inputs))
        # returned as a tuple of one, so compile_fx adds no wrapper to unpack it on every call
        single = not returns_tuple(sub)
        if single:
            return_as_tuple(sub)
        strides = output_strides(sub)   # before the compile, which may change sub's graph
        wrapped = writes_in_place(sub) or not direct_calls
        fn, how, spent, first = _compiled_part(sub, inputs, key, f"{name}.{part.name}",
                                               compile_graph)
        rec = _note(name, part, key, how, spent, first, changed.get(part.name, 0),
                    converted.get(part.name, 0))
        _call_compiled(split_gm, part.name, fn, single, strides, wrapped,
                       settled=lambda direct, rec=rec: setattr(rec, "direct", direct))
    split_gm.recompile()
    return split_gm


def _note(graph: str, part: Part, key: str, how: str, spent: float, first: str,
          channels_last_out: int, inputs_converted: int) -> _records.RegionRecord:
    rec = _records.RegionRecord(
        graph=graph, part=part.name, block=part.block or "(glue)", signature=key,
        nodes=part.nodes, how=how, compile_s=round(spent, 3), shared_from=first,
        channels_last_out=channels_last_out, inputs_converted=inputs_converted)
    _records.record(rec)
    return rec
