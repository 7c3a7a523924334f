"""time_fold_conv2d: a Conv3d whose temporal windows do not overlap is one conv2d.

Identity.  With temporal kernel == temporal stride (``kT == sT``), no temporal padding and no
temporal dilation, output frame ``t`` reads exactly input frames ``[t*kT, t*kT + kT)``; the
windows are disjoint and the trailing ``T mod kT`` frames are read by nobody.  Cut time into
those windows (strided time slices that drop the remainder as the conv does), move
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

Emission.  time taps (slices, :mod:`.frames`) -> stack, permute to (N, T_out, C, kT, H, W) -> reshape -> conv2d -> view
(N, T_out, O, H', W') -> permute to (N, O, T_out, H', W').  The weight is reshaped from the
conv's own weight in the graph (no stored copy), so its gradient flows.  This is the Mochi-style
(2,2,2)-stride-2 downsample and every (1,k,k) "2-D conv per frame".
"""
from __future__ import annotations

import sympy

from .frames import conv2d_over_time
from .rule import Condition, ConvCall, Rule, common_conditions


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

    emission = "conv2d_over_time"  # shared with time_unfold_conv2d (same function)

    def emit(self, c, x, weight, bias):
        return conv2d_over_time(c, x, weight, bias)

    def heuristic(self, c, platform):
        if c.kernel[0] >= 2:
            return True, "disjoint temporal windows folded into channels (1.25x fp32 on CPU)"
        return False, "kT == 1 (time into batch) is not a reliable win"


RULE = TimeFoldConv2d()
