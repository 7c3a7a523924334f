"""Split a Dynamo graph along region instances: one part per contiguous run of nodes of one
instance (a region part) or of no region (a glue part), in graph order, so the parts run one
after another and each depends only on earlier ones."""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import torch_internals as ti
from .blocks import stack_of

# Glue that only moves or views data runs as it is (no compile): a compile would cost more
# than it saves.  Anything else is compiled like a region.
VIEW_METHODS = {"view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "flatten",
                "size", "chunk", "split", "expand", "contiguous", "unflatten", "dim"}
VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.permute, torch.transpose,
                  torch.unsqueeze, torch.squeeze, torch.flatten, torch.chunk, torch.split,
                  ti.api_usage_log}  # a no-op torch's modules call: nothing to compile


@dataclasses.dataclass
class Part:
    name: str                  # the submodule's name in the split graph
    region: Optional[str]      # instance key, or None for glue
    block: str                 # the region's class name ("" for glue)
    nodes: int
    only_views: bool


def _only_views(nodes: list[torch.fx.Node]) -> bool:
    return all((n.op == "call_method" and n.target in VIEW_METHODS)
               or (n.op == "call_function" and n.target in VIEW_FUNCTIONS) for n in nodes)


def split(gm: torch.fx.GraphModule, owner: dict) -> tuple[torch.fx.GraphModule, list[Part]]:
    """``owner``: compute node -> region instance key or None.  Returns the split graph (its
    submodules ``submod_<i>`` called in order) and one :class:`Part` per submodule."""
    run_of: dict[torch.fx.Node, int] = {}
    runs: list[list] = []
    last = object()
    for n in gm.graph.nodes:
        if n not in owner:
            continue
        if owner[n] != last:
            runs.append([])
            last = owner[n]
        runs[-1].append(n)
        run_of[n] = len(runs) - 1
    split_gm = split_module(gm, None, lambda n: run_of[n], keep_original_order=True)
    parts = []
    for i, run in enumerate(runs):
        region = owner[run[0]]
        block = next((name for key, name in stack_of(run[0]) if key == region), "")
        parts.append(Part(f"submod_{i}", region, block, len(run), _only_views(run)))
    return split_gm, parts


def example_of(node: torch.fx.Node):
    """The value Dynamo traced for ``node`` (a fake tensor, SymInt, ...)."""
    return node.meta.get("example_value", node.meta.get("val"))


def example_inputs(sub: torch.fx.GraphModule) -> list:
    return [example_of(n) for n in sub.graph.nodes if n.op == "placeholder"]


def returns_tuple(sub: torch.fx.GraphModule) -> bool:
    return isinstance(sub.graph.output_node().args[0], (tuple, list))


def return_as_tuple(sub: torch.fx.GraphModule) -> None:
    """``sub``, which returns one value, returns it as a tuple of one."""
    out = sub.graph.output_node()
    out.args = ((out.args[0],),)
    sub.recompile()


def writes_in_place(sub: torch.fx.GraphModule) -> bool:
    """Whether ``sub`` may write into a tensor in place (a ``..._`` method, function or op, an
    in-place dunder, a mutable op schema, an ``inplace=``, ``training=`` (batch norm's running
    statistics) or ``out=`` argument, an augmented assignment, an item set, a module kept as a
    call, which could do any of these).  Conservative: True when unsure.  The first call checks
    version counters too (torch_direct.py)."""
    for n in sub.graph.nodes:
        if n.op == "call_module":
            return True
        if n.op not in ("call_method", "call_function"):
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        name = name.split(".")[0]   # an op overload: "add_.Tensor"
        schema = getattr(n.target, "_schema", None)
        if ((name.endswith("_") and not name.startswith("__")) or n.target in _IN_PLACE
                or (name.startswith("__i") and name.endswith("__"))   # x.__iadd__(y)
                or (schema is not None and schema.is_mutable)
                or n.kwargs.get("inplace") or n.kwargs.get("training") or "out" in n.kwargs):
            return True
        if (getattr(n.target, "__module__", "") in ("torch.nn.functional", "torch")
                and any(a is True for a in n.args[1:])):
            return True   # perhaps ``inplace`` or ``training`` given by position
    return False


_IN_PLACE = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
             operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
             operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}
