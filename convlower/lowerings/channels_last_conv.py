"""channels_last_conv: a 3-D convolution run channels-last (NDHWC), opaque to Inductor.

Why.  Inductor never changes a 3-D conv's memory format (its layout optimisation is 2-D only:
``torch/_inductor/kernel/conv.py``), so its compiled original runs eager's contiguous NCDHW
call.  On the 2-core development CPU, oneDNN's bf16 Conv3d is 2-12x faster channels-last:
Wan DiT's patch conv (1x16x5x32x32 -> 1536, kernel (1,2,2)) takes 5.0 ms contiguous, 0.4 ms
channels-last, 1.8-3.0 ms with the copies in and out; the Wan VAE's 3x3x3 convs 0.71-0.93x
with the copies (fp32 loses: 1.15-2.8x).  The screen decides per call; nothing is assumed.

Identity.  The same ``aten.convolution`` of the same values: only the memory format of its
operands changes (copies), and the result is copied back to the layout eager's call gives
(contiguous: the conditions exclude channels-last operands).  The backward is
``aten.convolution_backward`` the same way.  Different kernels may sum in another order:
floating-point reordering only.

Opaque.  ``convlower::channels_last_conv`` (and its backward) are custom ops: the copies run
inside them, so the graph gains no generated kernel.  Lowered forms whose copies Inductor
generates cost seconds of C++ build, which on a one-conv graph is more than Inductor's whole
compile; and the screen's eager figure of an opaque op is what the compiled code runs.

Conditions.  Not transposed (as every rule), a 3-D conv, no dilation, neither the activation
nor the weight already channels-last-3d (then eager runs channels-last already).  No dilation:
torch 2.13's channels-last Conv3d on CPU crashed the process (a segmentation fault, in fp32 and
bf16) on dilated convs that run contiguous, e.g. 2x4x5x4x1 * 4x2x3x2x1, stride (3,2,2),
padding (0,2,1), dilation (2,3,2), groups 2, and 7 of 2,000 random dilated convs; none of 5,000
undilated ones (groups 1-3, kernels 1-4, strides 1-3, padding 0-2, sizes 1-8, fp32 and bf16).
A crash cannot fall back, and the screen runs every candidate, so the rule must never see one.
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
NDHWC = torch.channels_last_3d


def _ndhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=NDHWC)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with contiguous strides (``contiguous()`` keeps any strides of an empty tensor)."""
    if t.numel() and t.is_contiguous():
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


@torch.library.custom_op("convlower::channels_last_conv", mutates_args=(),
                         tags=exact_strides_tags())
def _channels_last_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        stride: list[int], padding: list[int], dilation: list[int],
                        transposed: bool, output_padding: list[int],
                        groups: int) -> torch.Tensor:
    out = aten.convolution.default(_ndhwc(x), _ndhwc(weight), bias, stride, padding, dilation,
                                   transposed, output_padding, groups)
    return _contiguous(out)  # eager's layout for these operands (see the conditions)


@_channels_last_conv.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed,
                                    output_padding, groups).contiguous()


@torch.library.custom_op("convlower::channels_last_conv_backward", mutates_args=(),
                         tags=exact_strides_tags())
def _channels_last_conv_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                 stride: list[int], padding: list[int], dilation: list[int],
                                 transposed: bool, output_padding: list[int], groups: int,
                                 output_mask: list[bool]) -> list[torch.Tensor]:
    """The wanted gradients only, in (input, weight, bias) order, each in the layout of what
    it is the gradient of (contiguous, see the conditions)."""
    grads = conv_grads(_ndhwc(grad_out), _ndhwc(x), _ndhwc(weight), stride, padding, dilation,
                       transposed, output_padding, groups, output_mask)
    return [_contiguous(g) for g in grads]


@_channels_last_conv_backward.register_fake
def _(grad_out, x, weight, *params_and_mask):
    return [g.contiguous() for g in conv_grads(grad_out, x, weight, *params_and_mask)]


route_autograd(_channels_last_conv, _channels_last_conv_backward)


def opaque_ops() -> set:
    """The custom ops this rule emits (the screen times them whole: nothing in them fuses)."""
    ops = torch.ops.convlower
    return {ops.channels_last_conv, ops.channels_last_conv_backward}


class ChannelsLastConv(Rule):
    traced = False  # one custom op, copies inside
    name = "channels_last_conv"
    summary = "a 3-D conv run channels-last (NDHWC) inside an opaque op, eager's layout out"
    eager_numerics = True

    def conditions(self, c: ConvCall) -> list[Condition]:
        return common_conditions(c) + [
            Condition("a 3-D conv", sympy.sympify(c.ndim == 3)),
            Condition("dilation == 1", sympy.sympify(all(d == 1 for d in c.dilation))),
            Condition("activation not channels-last-3d",
                      sympy.sympify(ti.memory_format_of(c.x) != NDHWC)),
            Condition("weight not channels-last-3d",
                      sympy.sympify(ti.memory_format_of(c.weight) != NDHWC)),
        ]

    def emit(self, c, x, weight, bias):
        return _channels_last_conv(x, weight, bias, *conv_params(c))

    def emit_backward(self, c, output_mask):
        return opaque_backward(_channels_last_conv_backward, c, output_mask)

    def heuristic(self, c, platform):
        # Even bf16 on CPU, where the conv itself is 2-12x faster, the copies make some
        # shapes lose (1x1x1 and 2x2x2 convs 1.2x): the screen decides.
        return False, "channels-last Conv3d with its copies wins on some shapes only"


RULE = ChannelsLastConv()
