"""Pass step: trace an emission on a node's fake values, check it, splice it in its place."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from .. import torch_internals as ti
from ..decompositions.emission import same_layout, same_sizes


class RuleFailed(RuntimeError):
    pass


def replace(graph: torch.fx.Graph, node: torch.fx.Node, fn: Callable, inputs: list,
            label: str) -> None:
    """Replace ``node`` by ``fn`` traced on ``inputs`` (FX nodes) after checking that the
    traced result has the node's exact sizes, dtype and strides.  Raises on any mismatch and
    then leaves the graph as it was."""
    backward = node.target is torch.ops.aten.convolution_backward.default
    vals = [n.meta["val"] for n in inputs]
    gm = ti.trace_aten(fn, vals)
    _check(gm, node.meta["val"], ti.shape_env_of(vals), label, guard=not backward)
    if backward and any(u.target is not operator.getitem for u in node.users):
        raise RuleFailed("convolution_backward result used other than by getitem")
    new = _splice(graph, node, gm, inputs)
    if backward:
        new = new if isinstance(new, (tuple, list)) else (new,)
        for user in list(node.users):
            user.replace_all_uses_with(new[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(new)
    graph.erase_node(node)


def _check(gm: torch.fx.GraphModule, old, shape_env, label: str, guard: bool) -> None:
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    olds = old if isinstance(old, (tuple, list)) else (old,)
    for o, v in zip(outs, olds):
        if (o is None) != (v is None):
            raise RuleFailed("the rule's outputs do not match the convolution's")
        if v is None:
            continue
        ov = o.meta["val"]
        if ov.dtype != v.dtype or not same_sizes(ov.shape, v.shape, shape_env, guard=guard):
            raise RuleFailed(f"rule {label} produced {tuple(ov.shape)} {ov.dtype}, "
                             f"expected {tuple(v.shape)} {v.dtype}")
        if not same_layout(ov, v, shape_env):
            raise RuleFailed(f"rule {label} produced strides {ov.stride()}, "
                             f"expected {v.stride()}")


def _splice(graph: torch.fx.Graph, before: torch.fx.Node, gm: torch.fx.GraphModule,
            inputs: list[torch.fx.Node]):
    """Copy ``gm``'s nodes into ``graph`` before ``before``; return its output node(s)."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise RuleFailed(f"traced graph takes {len(placeholders)} inputs, expected {len(inputs)}")
    env.update(zip(placeholders, inputs))
    result = None
    with graph.inserting_before(before):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                new = graph.call_function(n.target, torch.fx.map_arg(n.args, env.__getitem__),
                                          torch.fx.map_arg(n.kwargs, env.__getitem__))
                new.meta.update(n.meta)
                new.meta["convlower"] = True
                env[n] = new
            elif n.op == "output":
                result = torch.fx.map_arg(n.args[0], env.__getitem__)
            elif n.op != "placeholder":
                raise RuleFailed(f"traced graph has a {n.op} node")
    return result
