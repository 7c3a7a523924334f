"""time_unfold_conv2d: any Conv3d as one batched conv2d over temporal windows.

Identity.  Zero-pad time by ``pT`` on both sides; output frame ``t`` reads the frames
``t*sT + i*dT`` (``i < kT``) of the padded input: tap ``i`` is one strided slice of time whose
length is the conv's own output-size formula.  Moving the taps into the
channels (channel ``c*kT + i``) and the windows into the batch turns the Conv3d into one conv2d
of ``(N*T_out, C*kT, H, W)`` with the weight viewed as ``(O, C/groups*kT, kH, kW)`` and the
conv's own spatial stride, padding, dilation and groups (``c*kT + i`` is group-major, so groups
stay correct; spatial dilation is conv2d's own).  Overlapping windows (``sT < kT``) duplicate
activations ``kT/sT`` times: that is the price of a single large conv2d.

Conditions.  3-D, not transposed.  Nothing else, and nothing on sizes (no guards).

Emission.  ``constant_pad_nd`` (time only, when ``pT > 0``) -> tap slices -> stack, permute ->
reshape -> conv2d -> view -> permute.  The weight is reshaped from the conv's own weight in the
graph: no stored copy, and its gradient flows.  This is the ROCm Wan VAE remedy.
"""
from __future__ import annotations

import sympy

from .frames import conv2d_over_time
from .rule import Condition, ConvCall, Rule, common_conditions


class TimeUnfoldConv2d(Rule):
    name = "time_unfold_conv2d"
    summary = "any Conv3d: temporal windows into channels, one batched conv2d"

    def conditions(self, c: ConvCall) -> list[Condition]:
        return common_conditions(c) + [Condition("3-D convolution", sympy.sympify(c.ndim == 3))]

    emission = "conv2d_over_time"  # shared with time_fold_conv2d (same function)

    def emit(self, c, x, weight, bias):
        return conv2d_over_time(c, x, weight, bias)

    def heuristic(self, c, platform):
        if platform == "hip":
            return True, "MIOpen picks slow kernels for 3-D convs; batched conv2d is the remedy"
        return False, f"general Conv3d rewrite is often a loss on {platform} (0.4-1.2x)"


RULE = TimeUnfoldConv2d()
