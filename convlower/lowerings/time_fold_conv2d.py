"""time_fold_conv2d: a Conv3d whose temporal windows do not overlap is one conv2d.

Identity.  With temporal kernel == temporal stride (``kT == sT``), no temporal padding and no
temporal dilation, output frame ``t`` reads exactly input frames ``[t*kT, t*kT + kT)``; the
windows are disjoint and the trailing ``T mod kT`` frames are read by nobody.  Cut time into
those windows (``unfold(2, kT, kT)``, a view that drops the remainder as the conv does), move
each window's ``kT`` frames into the channels (channel ``c*kT + i`` = channel ``c`` of frame
``i``) and the windows into the batch.  Then
``out[n, o, t] = bias[o] + sum_{c, i} conv2d(frame t*kT+i of x[n, c], w[o, c, i])``
is a single conv2d of ``(N*T_out, C*kT, H, W)`` with the weight viewed as
``(O, C/groups*kT, kH, kW)`` (same ``c*kT + i`` order) and the conv's own spatial stride,
padding, dilation and groups.  Channel order ``c*kT + i`` keeps each group's channels
contiguous (group-major), so grouped convs stay grouped.  ``kT == 1`` puts time into the batch.

Conditions.  3-D, not transposed; ``kernel[0] == stride[0]``, ``padding[0] == 0``,
``dilation[0] == 1 or kernel[0] == 1``.  No condition on sizes: dynamic frame counts need no
guard.

Emission.  ``unfold`` -> permute to (N, T_out, C, kT, H, W) -> reshape -> conv2d -> view
(N, T_out, O, H', W') -> permute to (N, O, T_out, H', W').  The weight is reshaped from the
conv's own weight in the graph (no stored copy), so its gradient flows.  This is the Mochi-style
(2,2,2)-stride-2 downsample and every (1,k,k) "2-D conv per frame".
"""
from __future__ import annotations

import sympy
import torch

from .rule import Condition, ConvCall, Rule, common_conditions


def frames_to_batch(windows: torch.Tensor) -> torch.Tensor:
    """(N, C, T_out, H, W, k) windows -> (N*T_out, C*k, H, W), channel ``c*k + i``."""
    n, ch, t_out, h, w, k = windows.shape
    return windows.permute(0, 2, 1, 5, 3, 4).reshape(n * t_out, ch * k, h, w)


def batch_to_frames(y: torch.Tensor, n, t_out) -> torch.Tensor:
    """(N*T_out, O, H', W') -> (N, O, T_out, H', W')."""
    return y.view(n, t_out, *y.shape[1:]).permute(0, 2, 1, 3, 4)


class TimeFoldConv2d(Rule):
    name = "time_fold_conv2d"
    summary = "Conv3d with kT == sT, no temporal padding: frames into channels, one conv2d"

    def conditions(self, c: ConvCall) -> list[Condition]:
        conds = common_conditions(c) + [Condition("3-D convolution", sympy.sympify(c.ndim == 3))]
        if c.ndim != 3:
            return conds
        k, s, p, dl = c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]
        return conds + [
            Condition("kernel[0] == stride[0]", sympy.Eq(k, s)),
            Condition("padding[0] == 0", sympy.Eq(p, 0)),
            Condition("dilation[0] == 1 or kernel[0] == 1", sympy.sympify(dl == 1 or k == 1)),
        ]

    def emit(self, c, x, weight, bias):
        kt = c.kernel[0]
        windows = x.unfold(2, kt, kt)  # (N, C, T_out, H, W, kT), a view
        n, t_out = windows.shape[0], windows.shape[2]
        w2 = weight.reshape(weight.shape[0], weight.shape[1] * kt, *weight.shape[3:])
        y = torch.conv2d(frames_to_batch(windows), w2, bias, c.stride[1:], c.padding[1:],
                         c.dilation[1:], c.groups)
        return batch_to_frames(y, n, t_out)


RULE = TimeFoldConv2d()
