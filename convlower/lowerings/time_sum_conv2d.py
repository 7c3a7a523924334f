"""time_sum_conv2d: any Conv3d as a sum over its temporal taps of conv2d on time slices.

Identity.  ``out[n, o, t] = bias[o] + sum_{i < kT} conv2d(xp[n, :, t*sT + i*dT], w[o, :, i])``
where ``xp`` is the input zero-padded by ``pT`` frames on both sides.  For tap ``i`` the frames
``t*sT + i*dT`` over all ``t`` are one strided slice of time (a view whose length is the
conv's own output formula); folding those frames
into the batch gives one conv2d per tap with ``w[:, :, i]`` and the conv's own spatial
parameters and groups.  Unlike time_unfold_conv2d no activation is duplicated ``kT`` times:
each tap reads one copy of (at most) the input.

Accumulation.  For bf16/fp16 inputs the partial sums are added in fp32 and rounded once at the
end (summing kT rounded partials in bf16 doubles the error against an fp32 conv3d).

Conditions.  3-D, not transposed.  Nothing on sizes (no guards).
"""
from __future__ import annotations

import sympy
import torch

from .rule import Condition, ConvCall, Rule, common_conditions
from .dense import dense
from .frames import batch_to_frames, conv2d, time_taps


class TimeSumConv2d(Rule):
    name = "time_sum_conv2d"
    summary = "any Conv3d: sum over temporal taps of batched conv2d, fp32 accumulation"

    def conditions(self, c: ConvCall) -> list[Condition]:
        return common_conditions(c) + [Condition("3-D convolution", sympy.sympify(c.ndim == 3))]

    def emit(self, c, x, weight, bias):
        taps = time_taps(c, x)  # kT strided views (N, C, T_out, H, W)
        n, ch, t_out, h, w = taps[0].shape
        acc_dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        acc = None
        for i, tap in enumerate(taps):
            frames = dense(tap.permute(0, 2, 1, 3, 4)).view(n * t_out, ch, h, w)
            y = conv2d(frames, weight[:, :, i], None, c.stride[1:], c.padding[1:],
                       c.dilation[1:], c.groups)
            # Back to (N, O, T_out, H', W') per tap, on the conv2d's own output: viewing the
            # summed buffer instead made Inductor fail on dynamic sizes ("Invalid ranges").
            y = batch_to_frames(y, n, t_out).to(acc_dtype)
            acc = y if acc is None else acc + y
        if bias is not None:
            acc = acc + bias.to(acc_dtype)[:, None, None, None]
        return acc.to(x.dtype)

    def heuristic(self, c, platform):
        return False, "memory-lean, rarely faster: only by measurement or select=always"


RULE = TimeSumConv2d()
