"""Pass step: read one convolution node into a :class:`ConvSite` (built once, passed whole)."""
from __future__ import annotations

import torch

from ..lowerings.rule import ConvCall
from ..lowerings.site import ConvSite
from .pad_fold import fold_pad


def _val(a):
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


def input_nodes(node: torch.fx.Node) -> list:
    """The graph values the emission takes, in :attr:`ConvSite.inputs` order."""
    if node.target is torch.ops.aten.convolution_backward.default:
        return list(node.args[:3])  # grad_out, input, weight
    folded = fold_pad(node)
    first = folded.source if folded else node.args[0]
    return [first] + [a for a in node.args[1:3] if a is not None]


def site_of(node: torch.fx.Node, graph_name: str, layout_opt: bool = False) -> ConvSite:
    vals = [_val(a) for a in node.args]
    inputs = tuple(_val(a) for a in input_nodes(node))
    if node.target is torch.ops.aten.convolution_backward.default:
        call = ConvCall.from_args(vals[1:10])  # (input, weight, bias_sizes, params...)
        return ConvSite(call, call, "backward", graph_name, node.name, inputs, node.meta["val"],
                        output_mask=tuple(bool(m) for m in node.args[10]),
                        input_produced=_produced(node.args[0]), output_consumed=False,
                        layout_opt=layout_opt)
    folded = fold_pad(node)
    original = ConvCall.from_args(vals)
    # Is the activation made by an op of this graph, or a graph input with a fixed layout?
    # Is the output read by an op, or returned / saved?  Measuring reproduces both.
    return ConvSite(folded.call if folded else original, original, "forward", graph_name,
                    node.name, inputs, node.meta["val"],
                    pad_fold=folded.fold if folded else None,
                    input_produced=_produced(folded.source if folded else node.args[0]),
                    output_consumed=not _leaves(node),
                    layout_opt=layout_opt)


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten.expand.default, torch.ops.aten.permute.default,
          torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.squeeze.dim,
          torch.ops.aten.unsqueeze.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.transpose.int, torch.ops.aten.t.default, torch.ops.aten.alias.default,
          torch.ops.aten.detach.default}


def _produced(value) -> bool:
    """Made by an op of this graph (its layout is Inductor's to choose and a copy of it can fuse
    into that op), rather than a graph input or a view of one (fixed layout)."""
    while isinstance(value, torch.fx.Node) and value.target in _VIEWS:
        value = value.args[0]
    return not (isinstance(value, torch.fx.Node) and value.op == "placeholder")


def _leaves(node: torch.fx.Node) -> bool:
    """Whether the value, or a view of it, is returned or saved: then it is made in its own
    layout by a kernel of its own, which no op reading it absorbs (a ViT patch embedding's
    conv output leaves the graph as ``flatten(2).transpose(1, 2)``)."""
    users = list(node.users)
    while users:
        user = users.pop()
        if user.op == "output":
            return True
        if _is_view(user):
            users.extend(user.users)
    return False


def _is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its input (``split``'s items included)."""
    import operator

    target = node.target
    return target in _VIEWS or target is operator.getitem or \
        bool(getattr(target, "is_view", False))
