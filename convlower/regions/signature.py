"""The identity of a graph part: two parts with one signature are the same computation.

A signature covers what the compiled code depends on: every node's op, target, constants and
argument wiring (node names left out, placeholders numbered by position), and every input's
shape (symbolic sizes as expressions), strides, dtype, device, requires_grad and which inputs
share storage.  Two instances of a block with other widths, resolutions or hooks therefore get
different signatures and never share code.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx


def _target(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    t = node.target
    if node.op == "call_module":  # a module kept as a call: its identity, not only its code
        return f"module@{id(gm.get_submodule(t))}"
    if node.op == "get_attr":  # a constant of this graph: shared only if it is the same object
        return f"attr@{id(getattr(gm, t, None))}"
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _arg(a: Any, index: dict, outside) -> str:
    """``a`` with nodes numbered by ``index``; a node not in it is ``outside(node)``."""
    if isinstance(a, torch.fx.Node):
        return f"%{index[a]}" if a in index else outside(a)
    if isinstance(a, (list, tuple)):
        inner = ",".join(_arg(x, index, outside) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg(v, index, outside)}" for k, v in a.items()) + "}"
    if isinstance(a, slice):
        return "slice(" + ",".join(_arg(x, index, outside) for x in (a.start, a.stop, a.step)) + ")"
    if isinstance(a, torch.Tensor):  # a tensor constant in the args: its identity
        return f"tensor@{id(a)}"
    return repr(a)


def describe_value(v: Any, storages: dict) -> str:
    """One input: its metadata, with storage shared with an earlier input numbered."""
    if isinstance(v, torch.Tensor):
        try:
            ref = v.untyped_storage()._cdata
            alias = storages.setdefault(ref, len(storages))
        except Exception:  # no storage to compare (a subclass): never alias-equal by chance
            alias = f"?{id(v)}"
        return (f"T{tuple(str(s) for s in v.shape)} s{tuple(str(s) for s in v.stride())} "
                f"o{v.storage_offset()} {v.dtype} {v.device} g{int(v.requires_grad)} "
                f"a{alias} {type(v).__name__}")
    if isinstance(v, torch.SymInt):
        return f"sym {v.node.expr}"
    return f"{type(v).__name__} {v!r}"


def _node_line(n: torch.fx.Node, gm, index: dict, outside) -> str:
    return (f"{n.op} {_target(n, gm)} {_arg(n.args, index, outside)} "
            f"{_arg(n.kwargs, index, outside)}")


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _no_outside(node: torch.fx.Node) -> str:
    raise KeyError(f"node {node} is not in the graph being signed")


def signature(gm: torch.fx.GraphModule, inputs: list, context: str = "") -> str:
    """A hash of ``gm``'s computation on ``inputs`` (its placeholders' example values), plus
    ``context`` (options, grad mode, ... whatever else the compile depends on)."""
    index: dict = {}
    storages: dict = {}
    lines, pos = [context], 0
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            lines.append("in " + describe_value(inputs[pos], storages))
            pos += 1
        else:
            lines.append(_node_line(n, gm, index, _no_outside))
    return _digest(lines)


def signature_of_nodes(nodes: list[torch.fx.Node]) -> str:
    """The same identity for a run of nodes of a larger graph (before it is split): values
    from outside the run are inputs, described by their example values."""
    index: dict = {n: i for i, n in enumerate(nodes)}
    storages: dict = {}
    outside: dict = {}

    def from_outside(node: torch.fx.Node) -> str:
        if node not in outside:
            value = node.meta.get("example_value", node.meta.get("val"))
            outside[node] = f"in{len(outside)}<{describe_value(value, storages)}>"
        return outside[node]

    gm = nodes[0].graph.owning_module if nodes else None
    return _digest([_node_line(n, gm, index, from_outside) for n in nodes])
