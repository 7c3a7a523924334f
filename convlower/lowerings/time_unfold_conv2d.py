"""time_unfold_conv2d: any Conv3d as one batched conv2d over temporal windows.

Identity.  Zero-pad time by ``pT`` on both sides; output frame ``t`` reads the frames
``t*sT + i*dT`` (``i < kT``) of the padded input.  ``unfold(2, span, sT)`` with
``span = dT*(kT-1) + 1`` gives each output frame's window (a view; its size is the conv's own
output-size formula), and ``[..., ::dT]`` keeps the ``kT`` taps.  Moving the taps into the
channels (channel ``c*kT + i``) and the windows into the batch turns the Conv3d into one conv2d
of ``(N*T_out, C*kT, H, W)`` with the weight viewed as ``(O, C/groups*kT, kH, kW)`` and the
conv's own spatial stride, padding, dilation and groups (``c*kT + i`` is group-major, so groups
stay correct; spatial dilation is conv2d's own).  Overlapping windows (``sT < kT``) duplicate
activations ``kT/sT`` times: that is the price of a single large conv2d.

Conditions.  3-D, not transposed.  Nothing else, and nothing on sizes (no guards).

Emission.  ``constant_pad_nd`` (time only, when ``pT > 0``) -> ``unfold`` -> taps -> permute ->
reshape -> conv2d -> view -> permute.  The weight is reshaped from the conv's own weight in the
graph: no stored copy, and its gradient flows.  This is the ROCm Wan VAE remedy.
"""
from __future__ import annotations

import sympy
import torch

from .rule import Condition, ConvCall, Rule, common_conditions
from .time_fold_conv2d import batch_to_frames, frames_to_batch


def time_windows(c: ConvCall, x: torch.Tensor) -> torch.Tensor:
    """(N, C, T, H, W) -> (N, C, T_out, H, W, kT): the kT taps each output frame reads."""
    kt, st, pt, dt = c.kernel[0], c.stride[0], c.padding[0], c.dilation[0]
    if pt:
        x = torch.constant_pad_nd(x, [0, 0, 0, 0, pt, pt])
    windows = x.unfold(2, dt * (kt - 1) + 1, st)
    return windows[..., ::dt] if dt > 1 else windows


class TimeUnfoldConv2d(Rule):
    name = "time_unfold_conv2d"
    summary = "any Conv3d: temporal windows into channels, one batched conv2d"

    def conditions(self, c: ConvCall) -> list[Condition]:
        return common_conditions(c) + [Condition("3-D convolution", sympy.sympify(c.ndim == 3))]

    def emit(self, c, x, weight, bias):
        kt = c.kernel[0]
        windows = time_windows(c, x)
        n, t_out = windows.shape[0], windows.shape[2]
        w2 = weight.reshape(weight.shape[0], weight.shape[1] * kt, *weight.shape[3:])
        y = torch.conv2d(frames_to_batch(windows), w2, bias, c.stride[1:], c.padding[1:],
                         c.dilation[1:], c.groups)
        return batch_to_frames(y, n, t_out)


RULE = TimeUnfoldConv2d()
