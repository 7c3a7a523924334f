"""eager_conv: the original convolution, called as eager calls it, opaque to Inductor.

Why.  Inductor does not always run a conv the way eager does.  With mkldnn (CPU) its layout
optimisation (``GraphLowering.decide_layout_opt``) runs *every* 2-D conv of a graph
channels-last: generated copy kernels turn a contiguous activation and the weight
channels-last, the extern conv runs, and an output that leaves the graph is copied back.  On
the 2-core development CPU that made fp32 Conv2d calls 1.8-2.4x slower than eager's own
(docs/selection.md).  Keeping "the original" then keeps Inductor's slower version.

Identity.  None to prove: ``convlower::eager_conv`` calls ``aten.convolution`` on its inputs
with the node's own arguments, and its backward ``convlower::eager_conv_backward`` calls
``aten.convolution_backward``.  Both are custom ops, so Inductor runs them as opaque fallback
kernels: no layout pass reaches inside, and their tags (``needs_exact_strides``) make Inductor
hand them their inputs in the strides the graph traced, which are eager's.  A graph whose convs
all become ``eager_conv`` has no ``aten.convolution`` left, so Inductor's layout optimisation
is off for it altogether.

Conditions.  Not transposed, in_channels per group > 0 (as every rule), and, at a graph site,
that Inductor would run the original in another layout than eager: layout optimisation on for
the graph, a 2-D conv, an activation not already channels-last, a layout copy at the graph's
boundary (:func:`inductor_format`).  Elsewhere the op would run the same kernel as Inductor's
original plus a custom op's call.

It is not a lowering: ``select="always"`` never forces it; the screen (``auto``), measurement
(``measure``, ``exhaustive``) or the heuristic table choose it (selection/screen.py).
"""
from __future__ import annotations

from typing import Optional

import sympy
import torch

from .. import torch_internals as ti
from .opaque_conv import (conv_grads, conv_params, exact_strides_tags, opaque_backward,
                          route_autograd)
from .rule import Condition, ConvCall, Rule, common_conditions

aten = torch.ops.aten
# Inductor hands the ops their inputs in the strides the graph traced (eager's).
_TAGS = exact_strides_tags()


@torch.library.custom_op("convlower::eager_conv", mutates_args=(), tags=_TAGS)
def _eager_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                stride: list[int], padding: list[int], dilation: list[int], transposed: bool,
                output_padding: list[int], groups: int) -> torch.Tensor:
    return aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed,
                                    output_padding, groups)


@_eager_conv.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed,
                                    output_padding, groups)


@torch.library.custom_op("convlower::eager_conv_backward", mutates_args=(),
                         tags=_TAGS)
def _eager_conv_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         stride: list[int], padding: list[int], dilation: list[int],
                         transposed: bool, output_padding: list[int], groups: int,
                         output_mask: list[bool]) -> list[torch.Tensor]:
    """The wanted gradients only, in (input, weight, bias) order."""
    return conv_grads(grad_out, x, weight, stride, padding, dilation, transposed,
                      output_padding, groups, output_mask)


_eager_conv_backward.register_fake(conv_grads)
route_autograd(_eager_conv, _eager_conv_backward)


def inductor_format(site) -> Optional[torch.memory_format]:
    """The memory format Inductor's compiled original runs ``site`` in when it is not eager's
    and that costs layout copies (``channels_last``: layout optimisation on, a 2-D conv, an
    activation eager runs in the contiguous format, and a copy at the graph's boundary: the
    activation is a graph input or an output leaves the graph), else None.  Inside a graph
    a producer writes channels-last for free and a consumer reads it: no copy to save, and
    the screen's cost (milliseconds per conv) is not spent there."""
    if not getattr(site, "layout_opt", False) or site.call.ndim != 2:
        return None
    if site.input_produced and not site.backward and site.output_consumed:
        return None
    x = site.inputs[1] if site.backward else site.inputs[0]
    if ti.memory_format_of(x) == torch.channels_last:
        return None
    return torch.channels_last


class EagerConv(Rule):
    name = "eager_conv"
    summary = "the original conv as eager calls it (opaque op): Inductor's layout passes skip it"
    lowers = False
    follows_compute_dtype = False  # the original, in the model's own dtype
    eager_numerics = True
    traced = False  # one custom op

    def conditions(self, c: ConvCall) -> list[Condition]:
        return common_conditions(c)

    def site_conditions(self, site) -> list[Condition]:
        return [Condition("Inductor would run the original in another layout than eager",
                          sympy.sympify(inductor_format(site) is not None))]

    def emit(self, c, x, weight, bias):
        return torch.ops.convlower.eager_conv(x, weight, bias, *conv_params(c))

    def emit_backward(self, c, output_mask):
        return opaque_backward(_eager_conv_backward, c, output_mask)

    def heuristic(self, c, platform):
        if platform == "cpu" and c.x.dtype == torch.float32:
            return True, ("fp32 on CPU: Inductor's channels-last copies around a 2-D conv cost "
                          "1.1-2.4x eager's call")
        return False, "Inductor's layout is not known to lose here"


RULE = EagerConv()
